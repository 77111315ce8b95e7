"""Fidelity: a live demand-only run's event log, replayed on the measured device with the cost
model fitted from that log, gives the live run's misses by cause (within 2%) and tok/s (within 15%)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import qnpipe
from qnpipe import config
from qnpipe.io.device_file import load_profile, save_profile
from qnpipe.io.measure import measure_profile
from qnpipe.replay import replay
from qnpipe.replay.cost_fit import fit_cost

SHAPE = {"num_hidden_layers": 4, "full_attention_interval": 4, "num_experts": 32, "num_experts_per_tok": 4}
SLOTS = 8
# tools/bench_stream.py's demand run: direct I/O, 16 reads in flight, no autopin, no chunking, no prefetch.
LIVE: dict[str, object] = {"pool.expert_slots": SLOTS, "read.workers": 16, "read.nocache": True, "pool.autopin": False,
        "forward.prefill_chunk_tokens": 0}


@pytest.fixture(scope="module")
def model_and_device(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A streamed tiny model and this machine's device profile, measured next to it."""
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny
    from qnpipe.io.store import ExpertStore

    root = tmp_path_factory.mktemp("fidelity")
    model = root / "q"
    convert(make_tiny(root / "hf", layout="hf", seed=3, config_overrides=SHAPE), model)
    with ExpertStore.open(model) as store:
        record = store.layer_file(next(iter(store.layers))).record_nbytes
    measured = measure_profile(root, records=(13824, record, 4 * record), qds=(1, 2, 4, 8), seconds=0.15,
                               size_bytes=64 << 20)
    save_profile(root / "device.json", measured)
    return model, root / "device.json"


@pytest.mark.slow
def test_replay_of_a_live_run_reproduces_its_misses_and_tok_s(model_and_device: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    model, device = model_and_device
    measured = load_profile(device)
    cfg = config.load(None, overrides={**LIVE, "read.device_profile_path": str(device)})

    with qnpipe.Engine(model, config.load(None, overrides=LIVE)) as warm:  # MLX's first calls out of the traced run
        warm.generate([3], max_tokens=4, temperature=1.0, seed=1, stop_at_eos=False)
    log = tmp_path / "live.qtrace"
    with qnpipe.Engine(model, config.load(None, overrides={**LIVE, "trace.event_log_path": str(log)})) as eng:
        res = eng.generate([3], max_tokens=48, temperature=1.0, seed=5, stop_at_eos=False)
        pool = eng.stats().pool
    assert pool is not None and pool.misses > 100

    fit = fit_cost(log, measured.profile)
    r = replay(log, cfg, device_profile="measured", cost=fit.cost)
    assert r.device == measured.profile and r.steps == pool.steps
    assert set(r.misses_by_cause) == set(pool.misses_by_cause)
    for cause, live in pool.misses_by_cause.items():
        assert abs(r.misses_by_cause[cause] - live) <= 0.02 * live, (cause, r.misses_by_cause, pool.misses_by_cause)
    live_tok_s = res.stats.decode_tok_s
    assert abs(r.tok_s - live_tok_s) <= 0.15 * live_tok_s, (r.tok_s, live_tok_s, fit)


@pytest.mark.slow
def test_bench_fidelity_prints_its_figures(model_and_device: tuple[Path, Path]) -> None:
    model, device = model_and_device
    tool = Path(__file__).resolve().parents[2] / "tools" / "bench_fidelity.py"
    proc = subprocess.run([sys.executable, str(tool), "--model", str(model), "--profile", str(device), "--rounds", "2",
                           "--tokens", "12", "--pool-frac", "0.25"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["misses_rel_err"] <= 0.02 and 0 <= out["tok_s_rel_err"] < 1 and out["tok_s_rel_err_cross"] is not None
    assert out["pool_slots_per_layer"] == 8 and len(out["per_round"]) == 2
