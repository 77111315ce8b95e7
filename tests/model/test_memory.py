"""Issue 13: MLX memory limits applied at start-up; wired memory only where MLX has it (one warning elsewhere)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest

import qnpipe
from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.config import MemoryCfg
from qnpipe.errors import ConfigError
from qnpipe.model import memory


def test_the_cache_limit_bounds_mlxs_buffer_cache() -> None:
    try:
        memory.apply_memory_limits(MemoryCfg(mlx_cache_limit_gb=0.0))
        a = mx.ones((512, 1024))
        mx.eval(a)
        del a
        assert mx.get_cache_memory() == 0  # freed buffers are not kept
        memory.apply_memory_limits(MemoryCfg(mlx_cache_limit_gb=1.0))
        b = mx.ones((512, 1024))
        mx.eval(b)
        del b
        assert mx.get_cache_memory() >= 512 * 1024 * 4
    finally:
        mx.clear_cache()


@pytest.mark.skipif(memory.wired_supported(), reason="this platform has wired memory: nothing to warn about")
def test_the_wired_limit_warns_once_where_there_is_no_wired_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_warned", False)
    with pytest.warns(memory.MemoryLimitWarning, match=r"memory.mlx_wired_limit_gb=2 has no effect here") as rec:
        with qnpipe.Engine(DEMO_MODEL_DIR, wired_limit_gb=2) as eng:
            res = eng.generate("def f(x):", max_tokens=4)
        with qnpipe.Engine(DEMO_MODEL_DIR, wired_limit_gb=2):
            pass
    assert len(rec) == 1
    assert res.stats.peak_memory_bytes > 0 and eng.stats().peak_memory_bytes >= res.stats.peak_memory_bytes


def test_the_wired_limit_is_checked_against_the_working_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where wired memory exists (simulated here), a limit above the recommended working set is refused."""
    set_to: list[int] = []
    monkeypatch.setattr(memory, "wired_supported", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 8 * 2**30})
    monkeypatch.setattr(mx, "set_wired_limit", lambda n: set_to.append(n) or 0)
    with pytest.raises(ConfigError, match=r"mlx_wired_limit_gb=16 is above .* \(8.0 GB\)"):
        memory.apply_memory_limits(MemoryCfg(mlx_wired_limit_gb=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memory.apply_memory_limits(MemoryCfg(mlx_wired_limit_gb=4))
    assert set_to == [4 * 2**30]
