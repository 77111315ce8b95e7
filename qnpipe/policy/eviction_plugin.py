"""Plug-in eviction policies: `pool.evict_policy = "package.module:Class"` (docs/pool.md, "Plug-in policies").

The class is imported when the pool is built and called as `Class(capacity=N)` once per
layer, N the layer's resident slots; what it returns must have the methods of
`qnpipe.policy.eviction_protocol.Eviction`, taking the arguments the slot table passes. Any failure
is a ConfigError naming the setting's value and what is wrong. The plug-in runs behind a
`CheckedEviction` (qnpipe.policy.plugin_check): each answer is checked before the slot table
uses it, a wrong one is a PluginError naming the class, the method and the value.
"""

from __future__ import annotations

import importlib
import inspect
from typing import cast

from qnpipe.config import EvictPolicy, check_evict_policy
from qnpipe.errors import ConfigError
from qnpipe.policy.eviction_protocol import Eviction
from qnpipe.policy.plugin_check import CheckedEviction

# Each method of the Eviction protocol and the arguments the slot table passes it (self aside).
PROTOCOL_ARGS: dict[str, tuple[object, ...]] = {
    "inserted": (0, 0), "accessed": (0, 0), "removed": (0,), "victim": ((0,), 0),
    "pick": ((), (), (), 0), "forward_done": (),
}


def load_class(spec: str) -> type:
    """The class `spec` ("package.module:Class") names, checked against the Eviction protocol."""
    where = f"pool.evict_policy={spec!r}"
    if isinstance(check_evict_policy(spec), EvictPolicy):
        raise ConfigError(f"{where}: a built-in policy, not a plug-in")
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the plug-in's own import may fail any way
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"{where}: module {module_name!r} ({module.__file__}) has no {name!r}")
    if not isinstance(cls, type):
        raise ConfigError(f"{where}: {name!r} is a {type(cls).__name__}, not a class")
    for method, args in PROTOCOL_ARGS.items():
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise ConfigError(f"{where}: {name} does not satisfy the Eviction protocol (docs/pool.md): "
                              f"it has no method {method}")
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            continue
        try:
            sig.bind(None, *args)
        except TypeError as exc:
            raise ConfigError(f"{where}: {name}.{method}{sig} does not take the protocol's {len(args)} "
                              f"arguments (docs/pool.md): {exc}") from None
    return cls


def make_plugin(spec: str, capacity: int, stall_s: float = 0.0) -> Eviction:
    """A fresh plug-in policy for one layer of `capacity` slots, behind the checking adapter; `stall_s`
    (diag.watchdog_s) bounds one call (qnpipe.hang_guard)."""
    cls = load_class(spec)
    try:
        policy = cls(capacity=capacity)
    except Exception as exc:
        raise ConfigError(f"pool.evict_policy={spec!r}: {cls.__name__}(capacity={capacity}) failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return CheckedEviction(cast(Eviction, policy), spec, stall_s)


__all__ = ["PROTOCOL_ARGS", "load_class", "make_plugin"]
