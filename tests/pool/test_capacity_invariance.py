"""Capacity invariance: a streamed model gives the all-resident model's logits, bit for bit.

For every shape, fp32 and 4-bit, capacities top-k, top-k+1, half and all experts, every
eviction policy, 1 and 16 reads in flight, the C and Python readers, page cache on and
off, with route verification on: `logits` are np.array_equal to `eager_load` and greedy
tokens are identical. The matrix is covered pairwise (each capacity meets each policy
on each model; the read settings rotate), not as a full product, to keep the suite fast; the
policies taken from libCacheSim and a plug-in run on two of the models.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qnpipe
from qnpipe.io.ssd import c_extension_available

POLICIES = ["lfu", "lru", "fifo", "lrfu"]
READ_SETTINGS = [
    {"read.workers": 1, "read.backend": "python", "read.nocache": True},
    {"read.workers": 16, "read.backend": "c" if c_extension_available() else "python", "read.nocache": False},
    {"read.workers": 16, "read.backend": "python", "read.nocache": True, "read.batch_miss_read": False},
    {"read.workers": 1, "read.backend": "c" if c_extension_available() else "python", "read.nocache": True},
]

def _opt(name: str, value: object) -> dict[str, Any]:
    """One dotted config field as an Engine keyword (a name keywords cannot spell)."""
    return {name: value}



def _prompt(vocab: int, n: int = 14, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _reference(d: Path, prompt: list[int]) -> tuple[np.ndarray, tuple[int, ...], qnpipe.Engine]:
    with qnpipe.Engine(d, eager_load=True, prefill_chunk_tokens=0) as eng:
        return eng.logits(prompt), eng.generate(prompt, max_tokens=16, stop_at_eos=False).tokens, eng


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default-fp32", "default-4bit", "3L-e16k2-fp32", "4L-e8k8-fp32",
                                  "5L-e32k6-fp32", "trained-fp32", "trained-4bit"])
def test_streamed_equals_all_resident(streamed_models: dict[str, Path], name: str) -> None:
    d = streamed_models[name]
    with qnpipe.Engine(d, eager_load=True) as ref:
        E, k, V = ref.args.num_experts, ref.args.num_experts_per_tok, ref.args.vocab_size
        prompt = _prompt(V)
        want_logits = ref.logits(prompt)
        want_tokens = ref.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
        assert ref.stats().expert_source == "resident"
    caps = sorted({k, min(k + 1, E), max(k, E // 2), E})
    reads = itertools.cycle(READ_SETTINGS)
    early = 0
    for cap, policy in itertools.product(caps, POLICIES):
        # Autopin off: its pins are tested in test_autopin.py; here every read must be one miss's load.
        over = {"expert_slots": cap, "pool.evict_policy": policy, "diag.route_verify": True, "pool.autopin": False,
                "read.verify_crc32": True, **next(reads)}
        with qnpipe.Engine(d, **over) as eng:
            got = eng.logits(prompt)
            tokens = eng.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
            st = eng.stats()
        where = f"{name} capacity {cap} policy {policy} {over}"
        assert np.array_equal(got, want_logits), where
        assert tokens == want_tokens, where
        assert st.expert_source == "pool" and st.pool is not None
        # Demand only: every load is one read and has one cause; autopin's pins are read once at start-up.
        causes = st.pool.misses_by_cause
        assert st.pool.reads == causes.get("cold", 0) + causes.get("capacity", 0) + st.pool.pinned > 0, where
        assert all(layer.occupancy <= layer.capacity == cap for layer in st.pool.layers), where
        if cap == E:  # every expert read at most once when the pool holds them all
            assert st.pool.misses_by_cause.get("capacity", 0) == 0, where
            assert st.pool.reads <= E * len(st.pool.layers), where
        early += st.pool.early_grants
    # Layer-steps that started their experts in memory while the rest were read were among those
    # compared (not when every token uses every expert: a layer then misses all or none).
    assert early > 0 or E == k, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["3L-e16k2-fp32", "5L-e32k6-fp32"])
def test_libcachesim_policies_and_a_plugin_stream_exactly(streamed_models: dict[str, Path], name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """CLOCK, SIEVE, ARC, S3-FIFO and the plug-in of docs/pool.md run live, at top-k + 1 and half the experts."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "policy"))  # evict_plugin_example
    d = streamed_models[name]
    with qnpipe.Engine(d, eager_load=True) as ref:
        E, k = ref.args.num_experts, ref.args.num_experts_per_tok
        prompt = _prompt(ref.args.vocab_size)
        want_logits = ref.logits(prompt)
        want_tokens = ref.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
    reads = itertools.cycle(READ_SETTINGS)
    for cap, policy in itertools.product(sorted({k + 1, E // 2}), ["clock", "sieve", "arc", "s3fifo",
                                                                   "evict_plugin_example:LRU2"]):
        over = {"expert_slots": cap, "pool.evict_policy": policy, "diag.route_verify": True, "pool.autopin": False,
                **next(reads)}
        with qnpipe.Engine(d, **over) as eng:
            got = eng.logits(prompt)
            tokens = eng.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
            st = eng.stats()
        where = f"{name} capacity {cap} policy {policy}"
        assert np.array_equal(got, want_logits), where
        assert tokens == want_tokens, where
        assert st.pool is not None and st.pool.misses_by_cause.get("capacity", 0) > 0, where  # it did evict


@pytest.mark.slow
def test_prefill_chunks_whose_union_exceeds_capacity_run_in_parts(streamed_models: dict[str, Path]) -> None:
    """A 40-token chunk routes to more experts than top-k slots hold: parts, same logits (documented: bit-identical)."""
    d = streamed_models["default-fp32"]
    prompt = _prompt(1024, n=40, seed=5)
    with qnpipe.Engine(d, eager_load=True, prefill_chunk_tokens=0) as ref:
        k = ref.args.num_experts_per_tok
        want = ref.logits(prompt)
        want_tokens = ref.generate(prompt, max_tokens=8, stop_at_eos=False).tokens
    for chunk in (0, 16):
        with qnpipe.Engine(d, expert_slots=k, prefill_chunk_tokens=chunk, **_opt("diag.route_verify", True)) as eng:
            got = eng.logits(prompt)
            tokens = eng.generate(prompt, max_tokens=8, stop_at_eos=False).tokens
            st = eng.stats()
        assert st.pool is not None and st.pool.split_layer_steps > 0  # the parts path really ran
        assert np.array_equal(got, want), f"chunk {chunk}"
        assert tokens == want_tokens


def test_capacity_below_top_k_is_a_config_error_naming_the_layer(streamed_models: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    d = streamed_models["default-fp32"]
    with pytest.raises(qnpipe.config.ConfigError, match="layer 0 gets 3 slots, below the model's top-k"):
        qnpipe.Engine(d, expert_slots=3)
    prof = tmp_path / "caps.json"
    prof.write_text('{"layer_caps": {"0": 8, "3": 2}}')
    with pytest.raises(qnpipe.config.ConfigError, match=r"caps.json: layer 3 gets 2 slots"):
        qnpipe.Engine(d, **_opt("pool.capacity_profile_path", str(prof)))
    prof.write_text('{"caps": 1}')
    with pytest.raises(qnpipe.config.ConfigError, match="not a capacity profile"):
        qnpipe.Engine(d, **_opt("pool.capacity_profile_path", str(prof)))


def test_capacity_profile_sets_each_layer(streamed_models: dict[str, Path], tmp_path: Path) -> None:
    d = streamed_models["default-fp32"]
    prof = tmp_path / "caps.json"
    prof.write_text('{"layer_caps": {"0": 4, "1": 9, "7": 1000}}')
    with qnpipe.Engine(d, expert_slots=6, **_opt("pool.capacity_profile_path", str(prof))) as eng:
        eng.generate([1, 2, 3], max_tokens=2)
        st = eng.stats()
    assert st.pool is not None
    caps = {layer.layer: layer.capacity for layer in st.pool.layers}
    assert caps == {0: 4, 1: 9, 2: 6, 3: 6, 4: 6, 5: 6, 6: 6, 7: 64}  # clamped to the 64 experts


@pytest.mark.slow
@pytest.mark.parametrize("name", ["3L-e16k2-fp32", "5L-e32k6-fp32", "trained-4bit"])
def test_streamed_with_prefetch_equals_all_resident_in_both_placements(streamed_models: dict[str, Path],
                                                                       name: str) -> None:
    """Prefetch on, into the side region and into the resident one (pool.prefetch_into), at every capacity."""
    d = streamed_models[name]
    with qnpipe.Engine(d, eager_load=True) as ref:
        E, k, V = ref.args.num_experts, ref.args.num_experts_per_tok, ref.args.vocab_size
        prompt = _prompt(V)
        want_logits = ref.logits(prompt)
        want_tokens = ref.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
    caps = sorted({k, min(k + 1, E), max(k, E // 2)})
    reads = itertools.cycle(READ_SETTINGS)
    for cap, into in itertools.product(caps, ["side", "main"]):
        over = {"expert_slots": cap, "diag.route_verify": True, "pool.autopin": False,
                "predict.cross_layer_prefetch": True, "pool.prefetch_into": into, "pool.side_region_slots": 2,
                "predict.per_layer_budget_experts": 8, **next(reads)}
        with qnpipe.Engine(d, **over) as eng:
            got = eng.logits(prompt)
            tokens = eng.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
            st = eng.stats().pool
        where = f"{name} capacity {cap} {over}"
        assert np.array_equal(got, want_logits), where
        assert tokens == want_tokens, where
        assert st is not None and st.prefetch_issued > 0, where
        assert sum(st.misses_by_cause.values()) == st.misses, where
