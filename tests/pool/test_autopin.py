"""Autopin on streamed tiny models: pins at start-up, heat across runs, bad files, exact output.

Each test keeps its heat in its own file (`pool.autopin_usage_file`), so the shared model
directories' default heat (written by the other tests, autopin being on by default) plays
no part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qnpipe
from qnpipe.actors.pipeline import Pipeline
from qnpipe.io.heat_file import HeatFileWarning, load_heat, save_heat
from qnpipe.model.args import ModelArgs, args_from_dict, model_id, read_config
from qnpipe.policy.heat import pin_budget


def _args(d: Path) -> ModelArgs:
    return args_from_dict(read_config(d))


def _pipe(eng: qnpipe.Engine) -> Pipeline:
    return eng._eng._rt.pipe  # the engine's running pipeline (white box)


def _prompt(vocab: int, n: int = 14, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _heat(d: Path, **over: Any) -> dict[str, Any]:
    return {"pool.autopin_usage_file": str(d), **over}


@pytest.mark.slow
def test_pinned_experts_are_in_the_pool_right_after_start_up(streamed_models: dict[str, Path], tmp_path: Path) -> None:
    d = streamed_models["default-fp32"]
    args = _args(d)
    hot = {layer: {e: 100 - e for e in range(0, 40, 2)} for layer in args.moe_layers}  # even experts, 0 hottest
    path = tmp_path / "heat.json"
    save_heat(path, model_id(args), hot)
    cap = 32
    with qnpipe.Engine(d, **_heat(path, expert_slots=cap)) as eng:
        pipe = _pipe(eng)
        assert pipe.policy is not None
        n = pin_budget(cap, args.num_experts_per_tok, 0.5)
        assert n == 16
        for layer, t in pipe.policy.tables.items():
            assert t.pinned == set(range(0, 2 * n, 2)), layer
            assert t.occupancy == n and set(t.slot_of) == t.pinned
            assert pipe.forward.capacities[layer] == cap - n
        st = eng.stats()
        assert st.pool is not None and st.pool.misses == 0  # preloads are not demand misses
        assert all(layer.occupancy == n for layer in st.pool.layers)


def test_heat_accumulates_across_runs(streamed_models: dict[str, Path], tmp_path: Path) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    args = _args(d)
    path = tmp_path / "heat.json"
    prompt = _prompt(args.vocab_size)
    runs = []
    for _ in range(2):
        with qnpipe.Engine(d, **_heat(path, expert_slots=8)) as eng:
            eng.generate(prompt, max_tokens=6, stop_at_eos=False)
        runs.append(load_heat(path, model_id(args)))
    first, second = runs
    assert set(first) == set(args.moe_layers)
    # One prefill layer-step + 5 decode layer-steps per layer, each counting top-k distinct experts or more.
    assert all(sum(row.values()) >= 6 * args.num_experts_per_tok for row in first.values())
    # The same prompt routes the same way: the second run adds exactly as much again.
    assert second == {layer: {e: 2 * c for e, c in row.items()} for layer, row in first.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default-fp32", "3L-e16k2-fp32", "trained-4bit"])
def test_autopin_keeps_capacity_invariance(streamed_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    d = streamed_models[name]
    with qnpipe.Engine(d, eager_load=True) as ref:
        E, k, V = ref.args.num_experts, ref.args.num_experts_per_tok, ref.args.vocab_size
        prompt = _prompt(V)
        want_logits = ref.logits(prompt)
        want_tokens = ref.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
    for cap in sorted({k + 1, max(k + 1, E // 2)}):
        path = tmp_path / f"heat-{cap}.json"
        for run in range(2):  # the first run counts the heat, the second starts with the pins
            over = _heat(path, expert_slots=cap, **{"diag.route_verify": True, "read.verify_crc32": True,
                                                    "pool.autopin_save_every_forwards": 3})
            with qnpipe.Engine(d, **over) as eng:
                pipe = _pipe(eng)
                assert pipe.policy is not None
                pinned = {layer: len(t.pinned) for layer, t in pipe.policy.tables.items()}
                got = eng.logits(prompt)
                tokens = eng.generate(prompt, max_tokens=16, stop_at_eos=False).tokens
            where = f"{name} capacity {cap} run {run} pins {pinned}"
            assert np.array_equal(got, want_logits), where
            assert tokens == want_tokens, where
            want_pins = 0 if run == 0 else pin_budget(cap, k, 0.5)
            assert all(n == want_pins for n in pinned.values()), where
    assert want_pins > 0


def test_a_corrupt_heat_file_warns_once_and_starts_from_zero(streamed_models: dict[str, Path],
                                                            tmp_path: Path) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    args = _args(d)
    path = tmp_path / "heat.json"
    path.write_bytes(b'{"format": "qnpipe-heat", "vers')
    with pytest.warns(HeatFileWarning) as rec, qnpipe.Engine(d, **_heat(path, expert_slots=8)) as eng:
        policy = _pipe(eng).policy
        assert policy is not None and not any(t.pinned for t in policy.tables.values())
        eng.generate(_prompt(args.vocab_size), max_tokens=3, stop_at_eos=False)
    assert len(rec) == 1 and str(path) in str(rec[0].message) and "not a heat file" in str(rec[0].message)
    assert load_heat(path, model_id(args))  # the close replaced it with this run's heat


def test_a_heat_file_of_another_model_warns_once_and_starts_from_zero(streamed_models: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    other = _args(streamed_models["default-fp32"])
    path = tmp_path / "heat.json"
    save_heat(path, model_id(other), {layer: {0: 5, 1: 5} for layer in other.moe_layers})
    with pytest.warns(HeatFileWarning) as rec, qnpipe.Engine(d, **_heat(path, expert_slots=8)) as eng:
        policy = _pipe(eng).policy
        assert policy is not None and not any(t.pinned for t in policy.tables.values())
    assert len(rec) == 1 and str(path) in str(rec[0].message) and "another model" in str(rec[0].message)


def test_an_unwritable_heat_location_warns_once_and_the_engine_runs(streamed_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    path = tmp_path / "no-such-dir" / "heat.json"
    over = _heat(path, expert_slots=8, **{"pool.autopin_save_every_forwards": 1})
    with pytest.warns(HeatFileWarning) as rec, qnpipe.Engine(d, **over) as eng:
        res = eng.generate(_prompt(_args(d).vocab_size), max_tokens=5, stop_at_eos=False)
        autopin = _pipe(eng).autopin
    assert len(res.tokens) == 5
    assert autopin is not None and autopin.saves == 0
    assert len(rec) == 1 and str(path) in str(rec[0].message) and "cannot save" in str(rec[0].message)


def test_heat_is_saved_every_n_forwards_and_at_close(streamed_models: dict[str, Path], tmp_path: Path) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    path = tmp_path / "heat.json"
    with qnpipe.Engine(d, **_heat(path, expert_slots=8, **{"pool.autopin_save_every_forwards": 2})) as eng:
        eng.generate(_prompt(_args(d).vocab_size), max_tokens=8, stop_at_eos=False)
        pipe = _pipe(eng)
        autopin = pipe.autopin
        assert autopin is not None and autopin.heat.forwards == pipe.forward.stats.steps >= 8
    # Periodic saves (one is skipped while another is still queued) and the one at close.
    assert 2 <= autopin.saves <= autopin.heat.forwards // 2 + 1
    assert load_heat(path, model_id(_args(d))) == autopin.heat.counts


def test_autopin_off_counts_and_writes_nothing(streamed_models: dict[str, Path], tmp_path: Path) -> None:
    d = streamed_models["3L-e16k2-fp32"]
    path = tmp_path / "heat.json"
    with qnpipe.Engine(d, **_heat(path, expert_slots=8, **{"pool.autopin": False})) as eng:
        eng.generate(_prompt(_args(d).vocab_size), max_tokens=3, stop_at_eos=False)
        pipe = _pipe(eng)
        assert pipe.autopin is None and pipe.policy is not None and pipe.policy.heat is None
    assert not path.exists()
