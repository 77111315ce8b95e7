"""MLX memory limits, applied once at engine start-up (`memory.*`).

The peak of each request is in `GenerateStats.peak_memory_bytes`, the highest one in
`EngineStats.peak_memory_bytes` (`qnpipe chat`'s /stats shows it).

`memory.mlx_cache_limit_gb` caps MLX's cache of freed buffers (long sessions otherwise keep
every one). `memory.mlx_wired_limit_gb` wires that much memory so the OS does not page the
model out; only Metal (Apple silicon) has wired memory: elsewhere the setting warns once
per process and does nothing.
"""

from __future__ import annotations

import warnings

from qnpipe.config import MemoryCfg
from qnpipe.errors import ConfigError

GB = 2**30
_warned = False


class MemoryLimitWarning(UserWarning):
    """A memory setting cannot take effect on this platform (it is ignored)."""


def wired_supported() -> bool:
    import mlx.core as mx

    return bool(mx.metal.is_available())


def apply_memory_limits(memory_cfg: MemoryCfg) -> None:
    """Set MLX's cache limit and, where supported, its wired limit. MLX thread.

    Raises ConfigError when the wired limit exceeds the device's recommended working set.
    """
    global _warned
    import mlx.core as mx

    mx.set_cache_limit(int(memory_cfg.mlx_cache_limit_gb * GB))
    wired = memory_cfg.mlx_wired_limit_gb
    if wired <= 0:
        return
    if not wired_supported():
        if not _warned:
            _warned = True
            warnings.warn(f"memory.mlx_wired_limit_gb={wired:g} has no effect here: wired memory needs MLX's "
                          f"Metal backend (Apple silicon); this MLX runs on the CPU", MemoryLimitWarning,
                          stacklevel=2)
        return
    limit = int(mx.device_info().get("max_recommended_working_set_size", 0))
    if limit and wired * GB > limit:
        raise ConfigError(f"memory.mlx_wired_limit_gb={wired:g} is above this device's recommended working set "
                          f"({limit / GB:.1f} GB); allowed: 0 (off) to {limit / GB:.1f}")
    mx.set_wired_limit(int(wired * GB))
