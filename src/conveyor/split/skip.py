"""Skip connections for nn.Sequential: a layer stashes a named value, a later layer pops it.

    @skippable(stash=["skip"])
    class Down(nn.Module):
        def forward(self, x):
            stash("skip", x)           # kept for a later layer
            return self.pool(x)

    @skippable(pop=["skip"])
    class Up(nn.Module):
        def forward(self, x):
            return torch.cat([self.up(x), pop("skip")], dim=1)

    model = nn.Sequential(Down(), Middle(), Up())
    model(x)                           # runs as is, without conveyor
    verify_skips(model)                # every stash has its pop, in order; errors name layers

Under conveyor, tracing turns each stash/pop pair into a dataflow edge, so a stashed value
goes straight from the rank that stashes it to the rank that pops it: the ranks in between
neither relay nor store it. See Note [skips as edges].
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

__all__ = [
    "SKIPS_KWARG",
    "SkipNames",
    "has_skips",
    "pop",
    "rename",
    "skip_names",
    "skippable",
    "stash",
    "verify_skips",
]


SKIPS_KWARG = "conveyor_skips"
"""Keyword through which conveyor hands a skippable layer its popped values. With it, the
layer returns ``(output, {name: stashed value})`` instead of ``output``."""

_M = TypeVar("_M", bound=nn.Module)


# Note [skips as edges]:
# A skippable layer's forward runs in one of two modes:
# - plain (called as ``layer(x)``, as in ordinary training): stash() puts the value into a
#   per-thread store and pop() takes it out, so a plain nn.Sequential works unchanged;
# - explicit (called with ``conveyor_skips={name: value}``): pop() reads the given values and
#   the layer returns ``(output, {name: stashed})``. conveyor's tracer
#   (conveyor.split.capture) calls every skippable layer this way, so each stash -> pop
#   becomes an edge of the traced graph, and the split sends the value from the stashing
#   stage directly to the popping stage.


@dataclass(frozen=True)
class SkipNames:
    """The names a layer stashes and pops, as seen from outside (after ``rename``)."""

    stashes: tuple[str, ...] = ()
    pops: tuple[str, ...] = ()


@dataclass
class _Scope:
    """One running forward of a skippable layer."""

    layer: nn.Module
    local: dict[str, str]
    """Name used in the layer's code -> name outside it."""
    popped: Mapping[str, Any] | None
    """Values handed in (explicit mode), or None (plain mode)."""
    stashed: dict[str, Any] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)


_current: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "conveyor_skip_scope", default=None
)
_plain = threading.local()


def _plain_store() -> dict[str, Any]:
    store: dict[str, Any] | None = getattr(_plain, "store", None)
    if store is None:
        store = _plain.store = {}
    return store


def skippable(stash: Sequence[str] = (), pop: Sequence[str] = ()) -> Callable[[type[_M]], type[_M]]:
    """Class decorator: the layer's forward may ``stash`` the names in ``stash`` and ``pop``
    the names in ``pop``. Each instance can be given other outside names with ``rename``."""
    stashes, pops = tuple(stash), tuple(pop)
    for names, what in ((stashes, "stash"), (pops, "pop")):
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"skippable({what}={list(names)}): expected distinct non-empty names")

    def decorate(cls: type[_M]) -> type[_M]:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module classes, got {cls!r}")
        original = cls.forward

        @functools.wraps(original)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            popped = kwargs.pop(SKIPS_KWARG, None)
            scope = _Scope(self, _outside_names(self), popped)
            token = _current.set(scope)
            try:
                output = original(self, *args, **kwargs)
            finally:
                _current.reset(token)
            if popped is None:
                return output
            names = skip_names(self)
            assert names is not None
            missing = [n for n in names.stashes if n not in scope.stashed]
            if missing:
                raise RuntimeError(
                    f"{_describe(self)} declares stash {missing} but its forward "
                    "did not stash them; stash every declared name on every "
                    "call (stash None when there is nothing to pass)"
                )
            return output, scope.stashed

        cls.forward = forward
        setattr(cls, "_conveyor_skips", SkipNames(stashes, pops))  # noqa: B010  # read by _declared
        return cls

    return decorate


def rename(layer: _M, **names: str) -> _M:
    """Give ``layer``'s skip names other outside names, e.g. ``rename(Down(), skip="enc1")``.

    Layers of one class used several times in a model need this, since each outside name is
    stashed once. Returns ``layer``.
    """
    declared = _declared(layer)
    if declared is None:
        raise TypeError(
            f"{type(layer).__name__} is not @skippable; only skippable layers have skip names"
        )
    known = set(declared.stashes) | set(declared.pops)
    unknown = sorted(set(names) - known)
    if unknown:
        raise ValueError(
            f"{type(layer).__name__} has no skip names {unknown}; it declares {sorted(known)}"
        )
    mapping = dict(getattr(layer, "_conveyor_skip_names", {}))
    mapping.update(names)
    layer._conveyor_skip_names = mapping  # type: ignore[assignment]  # plain attribute
    return layer


def skip_names(layer: nn.Module) -> SkipNames | None:
    """Outside names ``layer`` stashes and pops, or None if it is not skippable."""
    declared = _declared(layer)
    if declared is None:
        return None
    outside = _outside_names(layer)
    return SkipNames(
        tuple(outside[n] for n in declared.stashes), tuple(outside[n] for n in declared.pops)
    )


def stash(name: str, value: Any) -> None:
    """Keep ``value`` (a pytree of tensors, or None) under ``name`` for a later layer.

    Call it inside the forward of a ``@skippable(stash=[name])`` layer.
    """
    scope = _scope_for(name, "stash")
    outside = scope.local[name]
    if outside in scope.stashed:
        raise RuntimeError(
            f"{_describe(scope.layer)} stashes {name!r} twice in one forward; "
            "stash each name once per call"
        )
    scope.stashed[outside] = value
    if scope.popped is None:
        _plain_store()[outside] = value


def pop(name: str) -> Any:
    """The value an earlier layer stashed under ``name``.

    Call it inside the forward of a ``@skippable(pop=[name])`` layer, once per call.
    """
    scope = _scope_for(name, "pop")
    outside = scope.local[name]
    if outside in scope.taken:
        raise RuntimeError(
            f"{_describe(scope.layer)} pops {name!r} twice in one forward; pop "
            "each name once per call and keep the value"
        )
    scope.taken.add(outside)
    if scope.popped is not None:
        if outside not in scope.popped:
            raise RuntimeError(
                f"{_describe(scope.layer)} pops {outside!r}, which was not "
                f"handed in (got {sorted(scope.popped)})"
            )
        return scope.popped[outside]
    store = _plain_store()
    if outside not in store:
        raise RuntimeError(
            f"{_describe(scope.layer)} pops {outside!r}, but no earlier layer "
            "stashed it in this forward; check the layer order with "
            "conveyor.verify_skips(model)"
        )
    return store.pop(outside)


def verify_skips(model: nn.Sequential) -> None:
    """Check that every stash of ``model``'s layers is popped by a later layer, once.

    Raises:
        ValueError: listing each problem with the layers involved: a stash nobody pops, a pop
            with no earlier stash, a name stashed again before it was popped.
    """
    problems: list[str] = []
    pending: dict[str, str] = {}  # outside name -> layer that stashed it
    for label, names in _skip_layers(model):
        for name in names.pops:
            if name in pending:
                del pending[name]
            else:
                problems.append(f"layer {label} pops {name!r}, which no earlier layer stashes")
        for name in names.stashes:
            if name in pending:
                problems.append(
                    f"layers {pending[name]} and {label} both stash {name!r} before it is "
                    "popped; give one of them a name of its own with "
                    "conveyor.split.skip.rename(layer, <declared name>='<new name>')"
                )
            pending[name] = label
    problems += [
        f"layer {label} stashes {name!r}, which no later layer pops"
        for name, label in pending.items()
    ]
    if problems:
        raise ValueError("skip connections do not match:\n  " + "\n  ".join(problems))


def has_skips(model: nn.Module) -> bool:
    """True if any submodule of ``model`` is skippable."""
    return any(_declared(m) is not None for m in model.modules())


def _skip_layers(model: nn.Module) -> Iterator[tuple[str, SkipNames]]:
    """Skippable submodules in registration order, labelled 'name (Class)'."""
    for name, module in model.named_modules():
        names = skip_names(module)
        if names is not None:
            yield f"{name or '<root>'} ({type(module).__name__})", names


def _declared(layer: nn.Module) -> SkipNames | None:
    declared = getattr(type(layer), "_conveyor_skips", None)
    return declared if isinstance(declared, SkipNames) else None


def _outside_names(layer: nn.Module) -> dict[str, str]:
    declared = _declared(layer)
    assert declared is not None
    renamed: dict[str, str] = getattr(layer, "_conveyor_skip_names", {})
    return {n: renamed.get(n, n) for n in (*declared.stashes, *declared.pops)}


def _scope_for(name: str, what: str) -> _Scope:
    scope = _current.get()
    if scope is None:
        raise RuntimeError(
            f"{what}({name!r}) called outside the forward of a @skippable layer; "
            f"decorate the layer class with @conveyor.skippable({what}="
            f"[{name!r}])"
        )
    declared = _declared(scope.layer)
    assert declared is not None
    allowed = declared.stashes if what == "stash" else declared.pops
    if name not in allowed:
        raise RuntimeError(
            f"{_describe(scope.layer)} calls {what}({name!r}) but declares "
            f"{what}={list(allowed)}; add {name!r} to @skippable({what}=[...])"
        )
    return scope


def _describe(layer: nn.Module) -> str:
    return f"layer {type(layer).__name__}"
