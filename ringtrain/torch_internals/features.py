"""How the shim looks torch's private names up, and switches off the feature of a missing one.

A name is looked up by its dotted path (`lookup("torch.a_module.a_name", feature)`): found,
it is returned; missing (the attribute or its module), it is recorded on the `Feature` that
needs it, which is then off. Nothing here raises at import. A feature that is off either uses
a public equivalent (its `when_off` is None: nothing is lost, nothing said), or says once per
process what the user loses (`Feature.announce`), and raises `TorchInternalsError` only where
a caller actually uses what it cannot give (`Feature.require`).

Warnings rather than the "ringtrain" logger: features are looked up at import, before any
rank has set that logger up (`setup_logging` routes warnings through it afterwards, with the
rank), and a warning category can be filtered, or made an error by a CI job that wants to
hear of a feature lost on a new torch.

No private torch name appears in this file: they are all in the modules beside it.
"""

from __future__ import annotations

import contextlib
import importlib
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: The torch versions the whole suite passed on (`make test-torch TORCH_VERSION=...`).
TESTED_TORCH = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
#: pyproject.toml's torch range: from the first minor tested to the last (a test checks both).
TORCH_RANGE = ">=2.11,<2.16"


class TorchInternalsError(RuntimeError):
    """A ringtrain feature was used that this torch cannot give (it lacks a private name)."""


class TorchFeatureWarning(UserWarning):
    """A ringtrain feature is off, or does less, on this torch."""


@dataclass(eq=False)
class Feature:
    """One thing ringtrain does with torch's private names, and what a torch without one loses.

    Args:
        what: what ringtrain does with the names, and where.
        when_off: what the user gets instead on a torch that lacks one; None where a public
            equivalent stands in and nothing is lost.
    """

    what: str
    when_off: str | None
    names: list[str] = field(default_factory=list)  # every name looked up for it
    missing: list[str] = field(default_factory=list)  # those this torch lacks
    warned: bool = False

    @property
    def on(self) -> bool:
        return not self.missing

    def announce(self) -> None:
        """Warn, once per process, that this feature is off and what that costs."""
        if self.on or self.when_off is None or self.warned:
            return
        self.warned = True
        warnings.warn(f"torch {torch.__version__}: {self.when_off} (it has no "
                      f"{', '.join(self.missing)})", TorchFeatureWarning, stacklevel=2)

    def unavailable(self) -> TorchInternalsError:
        """The error for using this feature on a torch that lacks a name it needs."""
        return TorchInternalsError(
            f"{self.what} needs {', '.join(self.missing)}, which torch {torch.__version__} "
            f"lacks; ringtrain is tested with torch {', '.join(TESTED_TORCH)}: install one, "
            f"e.g. `pip install 'torch{TORCH_RANGE}'`")

    def require(self) -> None:
        """Raise `unavailable()` if this feature is off (for callers that cannot do without)."""
        if not self.on:
            raise self.unavailable()


def resolve(path: str) -> Any:
    """The object at dotted `path`, importing torch's submodules on the way."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not isinstance(obj, types.ModuleType):
                raise
            obj = importlib.import_module(".".join(parts[:i]))  # a submodule not imported yet
    return obj


def lookup(path: str, feature: Feature) -> Any:
    """The object at `path`, or None with `path` recorded as missing for `feature`."""
    feature.names.append(path)
    try:
        return resolve(path)
    except (AttributeError, ImportError):
        feature.missing.append(path)
        return None


def set_by_init(cls: type | None, name: str, feature: Feature) -> None:
    """Check that a constructor in `cls`'s MRO assigns the instance attribute `name`.

    Instance attributes cannot be looked up on the class; the names a constructor stores are
    in its code object's `co_names`, so a torch that renamed one is seen here, at import.
    `cls` None: the class itself is missing, and already recorded.
    """
    if cls is None:
        return
    path = f"{cls.__module__}.{cls.__qualname__}().{name}"
    feature.names.append(path)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if name in getattr(getattr(init, "__code__", None), "co_names", ()):
            return
    feature.missing.append(path + " (set by its constructor)")


@dataclass(frozen=True)
class PatchPoint:
    """An attribute of torch's that ringtrain replaces for a while (looked up at import).

    Args:
        owner: the object (class or module) holding the attribute.
        name: the attribute's name.
        feature: the feature it serves. While that is off, `get()` is None and `replaced()`
            changes nothing, so torch's own behaviour stays; with `raise_when_off`, both
            raise `TorchInternalsError` instead.
        raise_when_off: for features whose callers must not run on without them.
    """

    owner: Any
    name: str
    feature: Feature | None = None
    raise_when_off: bool = False

    def _off(self) -> bool:
        if self.feature is None or self.feature.on:
            return False
        if self.raise_when_off:
            raise self.feature.unavailable()
        return True

    def get(self) -> Any:
        """The attribute's current value (torch's own, unless replaced)."""
        return None if self._off() else getattr(self.owner, self.name)

    @contextlib.contextmanager
    def replaced(self, value: Any) -> Iterator[None]:
        """Inside: the attribute is `value`; after, whatever it was before (even on error)."""
        if self._off():
            yield
            return
        original = getattr(self.owner, self.name)
        setattr(self.owner, self.name, value)
        try:
            yield
        finally:
            setattr(self.owner, self.name, original)


def patch_point(path: str, feature: Feature, raise_when_off: bool = False) -> PatchPoint:
    """The `PatchPoint` at dotted `path`, its owner and attribute looked up for `feature`.

    A class must define the attribute itself: one it inherits (an abstract stub of a base
    class, say) is not the step ringtrain wraps, and wrapping it would call the stub.
    """
    owner_path, name = path.rsplit(".", 1)
    owner = lookup(owner_path, feature)
    if owner is not None and lookup(path, feature) is None:
        owner = None
    elif isinstance(owner, type) and name not in vars(owner):
        feature.missing.append(path + " (inherited, not its own)")
        owner = None
    return PatchPoint(owner, name, feature, raise_when_off)
