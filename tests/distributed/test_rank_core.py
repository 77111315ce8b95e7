"""A rank's core: what each rank of an MTP engine loads (the last rank holds the MTP head, and when
the experts stream, the head's MoE is a layer of that rank's pool, as in one process), and the
warm-up of its own layers."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qnpipe import config
from qnpipe.live.loaded import load_model, warm_up_model
from qnpipe.model.args import args_from_dict, read_config
from qnpipe.model.stage import Stage


def _core(model: Path, stage: Stage, **over: object):  # noqa: ANN202
    cfg = config.load(None, overrides={"model.model_dir": str(model), "mtp.enabled": True, **over})
    return load_model(model, cfg, stage=stage)


@pytest.mark.parametrize("streamed", [True, False])
def test_the_last_rank_streams_the_mtp_heads_experts_when_the_others_stream(trained_qn4: Path,
                                                                             streamed: bool) -> None:
    n = args_from_dict(read_config(trained_qn4), "config.json").num_hidden_layers
    over = {"pool.expert_slots": 4} if streamed else {"pool.eager_load": True}
    last = _core(trained_qn4, Stage(1, 2, n // 2, n, mtp=True), **over)
    first = _core(trained_qn4, Stage(0, 2, 0, n // 2, mtp=True), **over)
    try:
        assert last.mtp is not None and first.mtp is None and first.mtp_ring
        if streamed:
            assert last.streaming is not None and last.streaming.mtp is not None
            assert last.streaming.capacities[n] == 4  # the head's MoE: layer `num_hidden_layers`, 4 slots
            assert first.streaming is not None and n not in first.streaming.capacities
        else:
            assert last.streaming is None
    finally:
        for core in (last, first):
            if core.streaming is not None:
                core.streaming.close()
        mx.clear_cache()


@pytest.mark.parametrize("ranks", [2, 3])
def test_each_rank_warms_up_its_own_layers_and_leaves_its_state_alone(tiny_qn4: Path, ranks: int) -> None:
    n = args_from_dict(read_config(tiny_qn4), "config.json").num_hidden_layers
    cuts = [n * r // ranks for r in range(ranks + 1)]
    for r in range(ranks):
        core = _core(tiny_qn4, Stage(r, ranks, cuts[r], cuts[r + 1]), **{"mtp.enabled": False, "pool.expert_slots": 4})
        try:
            assert core.streaming is not None
            before = {(layer, k): a.copy() for layer, s in core.streaming.slots.items() for k, a in s.host.items()}
            assert warm_up_model(core) > 0.0
            assert all(np.array_equal(s.host[k], before[layer, k]) for layer, s in core.streaming.slots.items()
                       for k in s.host)
        finally:
            if core.streaming is not None:
                core.streaming.close()
            mx.clear_cache()
