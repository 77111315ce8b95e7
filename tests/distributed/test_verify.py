"""MTP speculation over the ring without a ring: the settings refused, and one rank's rollback."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from qnpipe.config import Config, ConfigError, with_overrides
from qnpipe.errors import DistributedError
from qnpipe.live.parallel.join import check_mtp
from qnpipe.live.parallel.verify import Verifying
from qnpipe.model.stage import Remote
from qnpipe.model.step_cache import StepCache


@pytest.mark.parametrize(("over", "named"), [
    ({"mtp.verify_mode": "sequential"}, "mtp.verify_mode"),
    ({"mtp.adaptive_depth": True, "mtp.adaptive_rescue": True}, "mtp.adaptive_rescue"),
    ({"mtp.tree_verify": True}, "mtp.tree_verify"),
    ({"mtp.tree_top2": True}, "mtp.tree_top2"),
    ({"diag.accept_topk": 4}, "diag.accept_topk"),
])
def test_mtp_variants_the_ring_does_not_run_are_refused_by_name(over: dict[str, Any], named: str) -> None:
    cfg = with_overrides(Config(), {"mtp.enabled": True, **over})
    with pytest.raises(ConfigError, match=named):
        check_mtp(cfg)


def test_batch_verify_of_a_fixed_or_adaptive_depth_runs() -> None:
    check_mtp(with_overrides(Config(), {"mtp.enabled": True, "mtp.num_draft_tokens": 5}))
    check_mtp(with_overrides(Config(), {"mtp.enabled": True, "mtp.adaptive_depth": True, "mtp.depth_max": 4}))


class _Local:
    def __init__(self, is_linear: bool) -> None:
        self.is_linear = is_linear


class _Model:
    """Layers 0, 1 on this rank (attention, Gated DeltaNet); 2, 3 on another."""

    layers = [_Local(False), _Local(True), Remote(False), Remote(True)]


def _filled(n: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
    return c


def _recorded(rows: int) -> StepCache:
    c = StepCache()
    c.recording = True
    c.conv_in = mx.arange(1 * (3 + rows) * 2).reshape(1, 3 + rows, 2)  # a conv window of 3, then the rows
    c.states = [mx.full((1, 2), float(t)) for t in range(rows)]
    return c


def test_a_rank_rolls_its_own_layers_back_before_the_next_step() -> None:
    kv, gdn = _filled(7), StepCache()
    remote_kv, remote_gdn = KVCache(), StepCache()
    v = Verifying(_Model(), [kv, gdn, remote_kv, remote_gdn])  # type: ignore[arg-type]
    v.before(0, 4)  # a verify step of 4 rows: only this rank's Gated DeltaNet layer records
    assert gdn.recording and not remote_gdn.recording
    v.cache[1] = v.own[1] = gdn = _recorded(4)  # what the step's record() keeps
    v.before(2, 0)  # the next (a plain) step keeps 2 rows: y_n and d_1
    assert kv.offset == 7 - 2
    assert not gdn.recording and gdn.states == []
    assert mx.array_equal(gdn[1], mx.full((1, 2), 1.0)).item()  # the state after row 2
    assert mx.array_equal(gdn[0], mx.arange(14).reshape(1, 7, 2)[:, 2:5]).item()  # the window ending at row 2
    assert remote_kv.offset == 0 and remote_gdn[0] is None and v.rows == 0


def test_every_draft_accepted_keeps_every_row() -> None:
    kv = _filled(4)
    v = Verifying(_Model(), [kv, StepCache(), KVCache(), StepCache()])  # type: ignore[arg-type]
    v.before(0, 4)
    v.before(4, 4)  # all kept; the next step verifies again
    assert kv.offset == 4 and v.rows == 4


def test_a_rollback_that_does_not_fit_the_last_step_is_an_error() -> None:
    v = Verifying(_Model(), [_filled(4), StepCache(), KVCache(), StepCache()])  # type: ignore[arg-type]
    with pytest.raises(DistributedError, match="did not run"):
        v.before(2, 0)
    v.before(0, 4)
    with pytest.raises(DistributedError, match="keeps 5"):
        v.before(5, 0)
    with pytest.raises(DistributedError, match="keeps 0"):
        v.before(0, 0)
