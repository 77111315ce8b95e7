"""Speculation is lossless: greedy output token-identical to plain greedy decoding over 128 tokens."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

import qnpipe

PROMPT = "def read_lines(path):\n    "
STREAM = {"pool.expert_slots": 4, "predict.cross_layer_prefetch": True}  # capacity = top-k: verify steps split


@functools.cache
def _plain(model_dir: Path, stream: bool) -> tuple[int, ...]:
    with qnpipe.Engine(model_dir, **(STREAM if stream else {})) as eng:
        return eng.generate(PROMPT, max_tokens=128, stop_at_eos=False).tokens


def _spec(model_dir: Path, stream: bool, k: int, **over: Any) -> tuple[tuple[int, ...], Any, Any]:
    with qnpipe.Engine(model_dir, mtp=True, **{"mtp.num_draft_tokens": k, "mtp.hidden": "post_norm"},
                       **(STREAM if stream else {}), **over) as eng:
        res = eng.generate(PROMPT, max_tokens=128, stop_at_eos=False)
        return res.tokens, res.stats.mtp, eng.stats()


@pytest.mark.slow
@pytest.mark.parametrize(("model", "stream", "k"), [
    *[("trained_hf", False, k) for k in (1, 2, 3, 4)],  # fp32, every expert resident
    *[("trained_qn4", True, k) for k in (1, 2, 3, 4)],  # 4-bit, streamed through a top-k pool
    ("trained_qn4", False, 3),
])
def test_greedy_speculation_equals_plain_greedy(request: pytest.FixtureRequest, model: str, stream: bool,
                                                k: int) -> None:
    d = request.getfixturevalue(model)
    tokens, mtp, st = _spec(d, stream, k)
    assert len(tokens) == 128
    assert tokens == _plain(d, stream)
    # It speculated, and the trained head got drafts accepted: fewer verify rounds than tokens.
    assert mtp.rounds < 100 and sum(mtp.accept_hist[1:]) > 0 and len(mtp.accept_hist) == k + 1
    assert st.mtp == mtp
    if stream:
        assert st.expert_source == "pool" and st.pool.misses > 0
        # k + 1 tokens' experts exceed a top-k capacity: those verify steps went through parts.
        assert mtp.capacity_split_verifies > 0 and st.pool.split_layer_steps > 0
        # The head's MoE is a pool layer of its own (id num_hidden_layers), read from mtp.safetensors.
        own = [ly for ly in st.pool.layers if ly.layer == 8]
        assert len(own) == 1 and own[0].capacity == 4 and own[0].misses > 0 and own[0].hits + own[0].misses >= 128


@pytest.mark.slow
def test_streamed_float32_with_prediction(trained_qn32: Path) -> None:
    tokens, mtp, st = _spec(trained_qn32, True, 3)
    assert tokens == _plain(trained_qn32, True)
    assert st.pool.prefetch_issued > 0 and mtp.rounds < 100


@pytest.mark.parametrize("over", [{"mtp.verify_mode": "sequential"}, {"mtp.adaptive_depth": True,
                                                                        "mtp.depth_max": 4, "mtp.conf_tau": 0.3}])
def test_variants_are_lossless(trained_hf: Path, over: dict[str, Any]) -> None:
    tokens, mtp, _ = _spec(trained_hf, False, 3, **over)
    assert tokens == _plain(trained_hf, False)
    if "mtp.adaptive_depth" in over:
        # The gate varied the depth: some rounds drafted fewer than depth_max.
        assert len(mtp.drafted_at) == 4 and mtp.drafted_at[0] > mtp.drafted_at[3]


TREES = {"top2": {"mtp.tree_top2": True}, "top2_p1": {"mtp.tree_top2": True, "mtp.tree_top2_p1": True},
         "tree3": {"mtp.tree_verify": True, "mtp.tree_branches": 3},
         "rescue": {"mtp.adaptive_depth": True, "mtp.adaptive_rescue": True, "mtp.depth_max": 4}}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(TREES))
def test_path_variants_are_lossless_and_rescue(trained_hf: Path, variant: str) -> None:
    tokens, mtp, _ = _spec(trained_hf, False, 3, **TREES[variant])
    assert tokens == _plain(trained_hf, False)
    # A path other than the greedy chain won some rounds, with more accepted drafts than the chain.
    assert mtp.rescues > 0 and mtp.rounds < 100


@pytest.mark.slow
def test_tree_verify_streamed_4bit(trained_qn4: Path) -> None:
    tokens, mtp, st = _spec(trained_qn4, True, 3, **TREES["tree3"])
    assert tokens == _plain(trained_qn4, True)
    assert mtp.rounds < 100 and st.pool.split_layer_steps > 0
