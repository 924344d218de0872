"""A timeline of where each step's time goes on every rank, in Chrome's / Perfetto's trace format.

    ringtrain train --nproc-per-node 2 --steps 20 --trace-steps 10:13   # -> RUN_DIR/trace.json
    # open trace.json in https://ui.perfetto.dev (or chrome://tracing): one track group per rank

A `Tracer` records spans (name, lane, start, end) on one rank while a traced step runs: the
trainer's step, forward, backward and the optimizer step on the "compute" lane; each gradient
bucket's all-reduce (from launch to completion, timed by the collective's own future, so a
bucket that finished early in backward ends there), pipeline sends and receives and
parameter-server pushes and pulls on the "comm" lane. The engines that record them (DDP's
reducer, the pipeline stage, the parameter-server worker) get the tracer as an explicit argument;
`NO_TRACE` is everyone's default. A hook asks `tracer.active` (one attribute read) before doing
anything, so an untraced run pays nothing measurable (`benchmarks/ddp_vs_torch.py` unchanged).

Clocks: every rank stamps spans with its own `time.perf_counter_ns()`. `align_clocks` measures
each rank's offset against rank 0 at start: `ROUNDS` all-gathers in a row, each rank reading its
clock as a gather returns (every rank leaves a gather at about the same instant: the last
arrival releases all), the offset being the median over the rounds of (rank 0's reading - mine).
The residual error is how unevenly ranks leave a gather. On one host, where the true offset is
0, a 2-rank run on a busy 2-core machine measured an offset of 0.04 ms, the 7 rounds spreading
over 0.85 ms (`trace.json` records each rank's offset and spread under otherData.clock). Drift
over the run is not corrected (crystal clocks drift ~10-100 us per second between hosts): on
several hosts, trace a window early in the run.

Writing: `finish` gathers every rank's spans to rank 0 (`gather`, the strategy's agreement) and
rank 0 writes ONE file: "X" (complete) events, pid = rank, tid = a lane; spans of one lane that
partly overlap (buckets in flight together) go to extra tracks of that lane ("comm 2", ...), so
every track holds spans that nest or follow each other, as the format requires.

Import rules: this module imports nothing of ringtrain's (the engines may all import it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

now_ns = time.perf_counter_ns
ROUNDS = 7  # all-gathers behind one clock offset (the median is taken)
COMPUTE, COMM = "compute", "comm"
_NULL = contextlib.nullcontext()  # reusable: what an inactive tracer hands out


class StepRange(NamedTuple):
    """Steps `start` (included) to `stop` (excluded), numbered as in metrics.jsonl (from 1)."""

    start: int
    stop: int

    def __str__(self) -> str:  # the command-line form, so a relaunched worker gets it back
        return f"{self.start}:{self.stop}"


def parse_steps(text: str) -> StepRange:
    """An argparse type: `A:B`, steps A to B-1 (like a Python slice; the first step is 1)."""
    a, sep, b = text.partition(":")
    try:
        start, stop = int(a), int(b) if sep else int(a) + 1
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use A:B, two step numbers "
            "(e.g. 10:13 traces steps 10, 11 and 12)") from None
    if start < 1 or stop <= start:
        raise argparse.ArgumentTypeError(
            f"{text!r}: need 1 <= A < B (steps count from 1; 10:13 traces steps 10, 11 and 12)")
    return StepRange(start, stop)


class _Span:
    __slots__ = ("tracer", "name", "lane", "args", "start")

    def __init__(self, tracer: Tracer, name: str, lane: str, args: dict[str, Any] | None):
        self.tracer, self.name, self.lane, self.args = tracer, name, lane, args

    def __enter__(self) -> _Span:
        self.start = now_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tracer.add(self.name, self.lane, self.start, now_ns(), self.args)


class Tracer:
    """One rank's spans, recorded during the steps of `steps` (None: never; `NO_TRACE`).

    Args:
        rank: this process's global rank (the trace's pid).
        steps: the traced steps, e.g. `StepRange(10, 13)` or `(10, 13)`.
    """

    def __init__(self, rank: int = 0, steps: tuple[int, int] | None = None):
        self.rank = rank
        self.steps = StepRange(*steps) if steps is not None else None
        self.active = False  # inside a traced step: hooks record only then
        self.spans: list[tuple[str, str, int, int, dict[str, Any] | None]] = []
        self.offset_ns = 0  # rank 0's clock minus this rank's (`align_clocks`)
        self.clock: dict[str, Any] = {"offset_ns": 0, "spread_ns": 0, "rounds": 0}

    @property
    def enabled(self) -> bool:
        return self.steps is not None

    # -- recording ---------------------------------------------------------------------------
    def step(self, n: int) -> contextlib.AbstractContextManager:
        """Around step `n` (from 1): turns recording on inside the window, with a "step n" span."""
        if self.steps is None or not self.steps.start <= n < self.steps.stop:
            return _NULL
        return self._step(n)

    @contextlib.contextmanager
    def _step(self, n: int) -> Iterator[None]:
        self.active = True
        start = now_ns()
        try:
            yield
        finally:
            self.active = False
            self.add(f"step {n}", COMPUTE, start, now_ns(), {"step": n})

    def span(self, name: str, lane: str = COMPUTE,
             **args: Any) -> contextlib.AbstractContextManager:
        """`with tracer.span("forward"):` records the block while a traced step runs."""
        if not self.active:
            return _NULL
        return _Span(self, name, lane, args or None)

    def add(self, name: str, lane: str, start_ns: int, end_ns: int,
            args: dict[str, Any] | None = None) -> None:
        """A span measured elsewhere (`perf_counter_ns` times). Safe from another thread."""
        self.spans.append((name, lane, start_ns, end_ns, args))  # list.append is atomic

    def until_done(self, name: str, lane: str, work: Any, **args: Any) -> None:
        """A span from now until `work` (a `dist.Work` or a future) completes, stamped by the
        future's callback on the thread that completes it (gloo's, NCCL's watchdog). Works
        without a future (gloo's isend) are skipped: time their wait with `span` instead."""
        if not self.active or work is None:
            return
        start = now_ns()
        try:
            fut = work.get_future() if hasattr(work, "get_future") else work
        except RuntimeError:  # "Work::getFuture not implemented" for this backend and op
            return
        fut.add_done_callback(lambda _f: self.add(name, lane, start, now_ns(), args or None))

    # -- across ranks --------------------------------------------------------------------------
    def align_clocks(self, gather: Callable[[str], dict[int, str]], rounds: int = ROUNDS) -> None:
        """Measure this rank's clock offset against rank 0 (collective: every rank calls it).

        `gather(text)` returns every rank's text by rank (`Agreement.gather`). No-op when off.
        """
        if not self.enabled:
            return
        gather("")  # everyone is here: the next readings are taken as the ranks leave together
        offsets = []
        for _ in range(rounds):
            mine = now_ns()
            offsets.append(int(gather(str(mine))[0]) - mine)
        self.offset_ns = int(statistics.median(offsets))
        self.clock = {"offset_ns": self.offset_ns, "spread_ns": max(offsets) - min(offsets),
                      "rounds": rounds}

    def finish(self, gather: Callable[[str], dict[int, str]],
               run_dir: str | None) -> dict[str, Any]:
        """Gather every rank's spans; rank 0 writes `run_dir/trace.json`. Collective; no-op when
        off. Returns {"trace": path} on the rank that wrote it, else {}."""
        if not self.enabled:
            return {}
        mine = json.dumps({"rank": self.rank, "offset_ns": self.offset_ns, "clock": self.clock,
                           "spans": self.spans})
        got = gather(mine)
        if self.rank != 0 or not run_dir:
            return {}
        path = os.path.join(run_dir, "trace.json")
        write_trace(path, [json.loads(v) for _, v in sorted(got.items())], self.steps)
        return {"trace": path}


NO_TRACE = Tracer()  # records nothing: `active` is never set (its `steps` is None)


# -- the file ------------------------------------------------------------------------------------
def _pack(spans: list[tuple[int, int]]) -> list[int]:
    """A track index for each (start, end): on one track, spans nest or follow each other."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1]))
    tracks: list[list[int]] = []  # per track, the ends of the spans still open
    out = [0] * len(spans)
    for i in order:
        start, end = spans[i]
        for open_ends in tracks:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
        # The first track where it follows (nothing open) or nests in the innermost open span.
        fits = [t for t, ends in enumerate(tracks) if not ends or end <= ends[-1]]
        if not fits:
            tracks.append([])
            fits = [len(tracks) - 1]
        tracks[fits[0]].append(end)
        out[i] = fits[0]
    return out


def chrome_events(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trace events for every rank's spans (`Tracer.finish`'s records), times aligned to rank 0's
    clock, in microseconds from the first span."""
    aligned = [[(n, lane, s + r["offset_ns"], e + r["offset_ns"], a)
                for n, lane, s, e, a in r["spans"]]
               for r in ranks]
    origin = min((s for spans in aligned for _, _, s, _, _ in spans), default=0)
    events: list[dict[str, Any]] = []
    for r, spans in zip(ranks, aligned, strict=True):
        pid = r["rank"]
        events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid,
                    "args": {"sort_index": pid}}]
        lanes = sorted({lane for _, lane, _, _, _ in spans},
                       key=lambda x: (x != COMPUTE, x != COMM, x))
        tid = 0
        for lane in lanes:
            mine = [sp for sp in spans if sp[1] == lane]
            track = _pack([(s, e) for _, _, s, e, _ in mine])
            for k in range(max(track) + 1):
                name = lane if k == 0 else f"{lane} {k + 1}"
                events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid + k,
                            "args": {"name": name}},
                           {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid + k,
                            "args": {"sort_index": tid + k}}]
            for (name, _, s, e, args), k in zip(mine, track, strict=True):
                ev = {"name": name, "cat": lane, "ph": "X", "pid": pid, "tid": tid + k,
                      "ts": (s - origin) / 1e3, "dur": max(0, e - s) / 1e3}
                if args:
                    ev["args"] = args
                events.append(ev)
            tid += max(track) + 1
    return events


def write_trace(path: str, ranks: list[dict[str, Any]], steps: StepRange | None = None) -> None:
    """Write the trace JSON (atomically: a temp file, then rename)."""
    doc = {"traceEvents": chrome_events(ranks), "displayTimeUnit": "ms",
           "otherData": {"steps": str(steps) if steps else None,
                         "clock": {str(r["rank"]): r["clock"] for r in ranks},
                         "clock_note": "offset_ns: rank 0's perf_counter minus this rank's, "
                                       "median of the rounds; spread_ns: max - min of the rounds"}}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
