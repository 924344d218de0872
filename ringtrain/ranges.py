"""Split `n` items into `parts` contiguous, nearly equal ranges: the ring's chunks, a server's
rows."""

from __future__ import annotations


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous ranges covering range(n); the first n % parts are one
    longer."""

    if parts < 1 or n < 0:
        raise ValueError(f"even_ranges(n={n}, parts={parts}): need n >= 0 and parts >= 1")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
