"""The shared expert computed while the pool reads, on the generic tier too.

mlx-lm's MoE blocks call the shared expert after the switch (`y = switch(x, inds); ... +
shared_expert(x)`), so a pooled switch that waits for reads would leave it for after them. The
native path starts it before the wait (qnpipe.model.stepper). Here the pooled switch does the
same: it calls the block's shared expert on its own input before it asks the pool, starts it
(`mx.async_eval`), and the block's own call of the shared expert on that very input then gets
that result. Same module, same input, same ops: the same bits. A block that passes another
array to its shared expert computes it as before (the early result is dropped).

The shared expert keeps its place and parameters in the model tree: its class is swapped for a
subclass that only adds the hand-over, and what it holds is a plain attribute no tree walk sees.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

# Children of a MoE block that hold its shared expert(s), by the names mlx-lm's families use.
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
_AHEAD: dict[type, type] = {}


@attrs.define(eq=False)
class _Early:
    """The input the shared expert was started on and its output (a plain object: not in the tree)."""

    x: Any = None
    y: Any = None
    handed: int = 0  # early results the block took (tests hold the overlap to happening)


def shared_of(block: Any) -> nn.Module | None:
    """The shared expert of MoE block `block` (the module holding the switch), made to take an early
    result (`start`); None when the block has none."""
    if not isinstance(block, nn.Module):
        return None
    for name in SHARED_NAMES:
        m = block.get(name)
        if isinstance(m, nn.Module):
            if type(m) not in _AHEAD.values():
                m.__class__ = _ahead_class(type(m))
                object.__setattr__(m, "_qnpipe_early", _Early())
            return m
    return None


def start(shared: nn.Module, x: mx.array) -> None:
    """Start `shared(x)` now; the block's own `shared(x)` with this very `x` gets the result."""
    early: _Early = shared.__dict__["_qnpipe_early"]
    early.x = x
    early.y = type(shared).__mro__[1].__call__(shared, x)
    mx.async_eval(early.y)


def handed(shared: nn.Module) -> int:
    """How many early results `shared` (made by `shared_of`) has handed to its block."""
    return int(shared.__dict__["_qnpipe_early"].handed)


def _ahead_class(cls: type) -> type:
    if cls not in _AHEAD:
        def __call__(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
            early: _Early = self.__dict__["_qnpipe_early"]
            if early.x is x and not args and not kwargs:
                y, early.x, early.y = early.y, None, None
                early.handed += 1
                return y
            early.x = early.y = None
            return cls.__call__(self, x, *args, **kwargs)

        _AHEAD[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _AHEAD[cls]
