"""Smoke run of tools/bench_stream.py on a 2-layer model: it runs and prints its JSON line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_stream.py"


@pytest.mark.slow
def test_bench_stream_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--shape", "smoke", "--work", str(tmp_path), "--rounds", "1", "--tokens", "4",
         "--bw-seconds", "0.1", "--warmup-prompt", "64", "--workers", "4", "--route-ab",
         "--c-acquire-ab", "--yield-ab", "--own-reads-ab", "--landed-ab", "--reads-first-ab",
         "--foresee-ab", "--targets-ab", "--submit-first-ab"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("tok_s_resident", "tok_s_demand", "tok_s_serial_bound", "ratio_demand_to_serial_bound",
                "misses_per_token", "overhead_frac", "overhead_frac_allhit", "bandwidth_gbps",
                "pipeline_us_per_layer_step_allhit", "pipeline_us_per_layer_step_allhit_channel",
                "pipeline_cpu_us_per_layer_step_allhit", "pipeline_us_per_layer_step_demand",
                "tok_s_demand_route_later", "overhead_frac_route_later", "ratio_demand_to_demand_route_later",
                "tok_s_demand_python_acquire", "overhead_frac_python_acquire",
                "ratio_demand_to_demand_python_acquire", "overhead_frac_from_first_read", "read_take_delay_us",
                "tok_s_demand_no_yield", "overhead_frac_no_yield", "ratio_demand_to_demand_no_yield",
                "tok_s_demand_others_wait", "overhead_frac_others_wait", "ratio_demand_to_demand_others_wait",
                "tok_s_demand_grant_first", "overhead_frac_grant_first", "ratio_demand_to_demand_grant_first",
                "tok_s_demand_reads_after_turn", "overhead_frac_reads_after_turn",
                "ratio_demand_to_demand_reads_after_turn", "tok_s_demand_foresee_late",
                "overhead_frac_foresee_late", "ratio_demand_to_demand_foresee_late", "tok_s_demand_targets_off",
                "overhead_frac_targets_off", "ratio_demand_to_demand_targets_off", "tok_s_demand_submit_after_turn",
                "overhead_frac_submit_after_turn", "ratio_demand_to_demand_submit_after_turn"):
        assert key in out, key
    assert out["store_to_pool"] >= 4
    assert out["allhit_misses_per_token"] == 0
    assert out["misses_per_token"] > 0
    # every demand engine's batches are seen on the device, whichever way its device starts them
    assert all(b["device"] > 0 for name, b in out["breakdown_ms_per_token"].items() if name.startswith("demand"))
    # a reader thread may take the first read before the hand-over call returns: either way of the start
    assert 0 < out["overhead_frac_from_first_read"] < 1 and math.isfinite(out["read_take_delay_us"])
    # a batch whose first read came before the hand-over call returned is on the device from that read: never later
    assert 0 < out["overhead_frac"] <= out["overhead_frac_handover"] < 1


@pytest.mark.slow
def test_bench_stream_allhit_only_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--shape", "smoke", "--work", str(tmp_path), "--allhit-only", "--rounds", "1",
         "--tokens", "4", "--warmup-prompt", "64", "--workers", "4"],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("pipeline_us_per_layer_step_allhit", "pipeline_us_per_layer_step_allhit_channel",
                "pipeline_cpu_us_per_layer_step_allhit", "ratio_allhit_to_resident", "resident_ms_per_layer_step"):
        assert key in out, key
    assert out["allhit_misses_per_token"] == 0


def test_round_prompts_stay_in_the_vocabulary() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_stream_prompts", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert [mod.round_prompt(r, 1024)[0] for r in range(3)] == [10, 47, 84]  # the rounds so far, unchanged
    assert all(10 <= mod.round_prompt(r, 1024)[0] < 1024 for r in range(2000))


def test_a_call_variant_turns_its_switch_off_around_its_engine_runs_only() -> None:
    from qnpipe.policy import slot_table
    from tests.tool_module import load_tool

    mod = load_tool("bench_stream.py", "bench_stream_variants")
    assert slot_table._c_acquire
    with mod.call_variant("demand"):
        assert slot_table._c_acquire
    with mod.call_variant("demand_python_acquire"):
        assert not slot_table._c_acquire
    assert slot_table._c_acquire
    from qnpipe.actors import forward, pool, read_scheduler
    from qnpipe.io import pending

    with pytest.raises(RuntimeError), mod.call_variant("demand_before"):
        assert not (slot_table._c_acquire or pending._yield_after_start or forward._wait_own_reads
                    or forward._landed_grants or pool._reads_first or forward._foresee_early
                    or read_scheduler._submit_first)
        raise RuntimeError("a run that fails")
    assert slot_table._c_acquire and pending._yield_after_start and forward._wait_own_reads and forward._landed_grants
    assert pool._reads_first and forward._foresee_early and read_scheduler._submit_first
