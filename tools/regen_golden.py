"""Regenerate the replay golden files: tests/replay/golden/*.qtrace (seeded routing logs) and *.json (reports).

tests/replay/test_golden.py replays each committed log under its case's settings (CASES
below) and compares the report with the committed JSON byte for byte. When a change to the
pool, the read scheduler, the simulated device or the report is meant to change those
reports, run this and commit the new files with the change (the diff is the change's effect):

    python tools/regen_golden.py            # rewrite the reports from the committed logs
    python tools/regen_golden.py --logs     # also rewrite the logs (only when their generator changed)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "replay" / "golden"

# name -> (seed, MoE layers, experts, top-k, steps, prompt tokens of the first step)
LOGS: dict[str, tuple[int, int, int, int, int, int]] = {
    "skewed-4x32-top4": (11, 4, 32, 4, 40, 6),
    "uniform-3x16-top2": (12, 3, 16, 2, 30, 1),
}
NBYTES = 98304

# The skewed log's first step does not fit 8 or 12 slots: the cases made before expert-major parts
# (forward.parts) keep token-range parts, "skewed-lru-8-by-expert" has the default.
_TOKENS = {"forward.parts": "tokens"}

# name -> the log and the replay's settings
CASES: dict[str, dict[str, Any]] = {
    "skewed-lru-8": {"log": "skewed-4x32-top4", "set": {"pool.expert_slots": 8, "pool.evict_policy": "lru", **_TOKENS}},
    "skewed-lru-8-by-expert": {"log": "skewed-4x32-top4", "set": {"pool.expert_slots": 8, "pool.evict_policy": "lru"}},
    "skewed-lfu-12-slow-device": {
        "log": "skewed-4x32-top4",
        "set": {"pool.expert_slots": 12, "pool.evict_policy": "lfu", "read.workers": 4, **_TOKENS},
        "device": {"bandwidth_bytes_per_s": 1e9, "latency_s": 6e-5, "per_mb_latency_s": 7e-4, "queue_depth": 2},
        "cost": {"per_layer_s": 2e-3, "per_token_s": 1e-4, "per_step_s": 7e-4, "read_hop_s": 9e-4}},
    "skewed-layer-table-8": {"log": "skewed-4x32-top4", "set": {"pool.expert_slots": 8, **_TOKENS},
                             "cost": {"per_layer_s": 2e-3, "per_step_s": 5e-4,
                                      "layer_table": {0: 1e-3, 1: 1e-3, 2: 1e-3, 3: 4e-3}}},
    "skewed-previous-8": {"log": "skewed-4x32-top4", "set": {"pool.expert_slots": 8, **_TOKENS},
                          "predictor": "previous"},
    "uniform-fifo-4": {"log": "uniform-3x16-top2", "set": {"pool.expert_slots": 4, "pool.evict_policy": "fifo"}},
}


def write_log(name: str, path: Path) -> None:
    """A routing log from its seed: per layer a Zipf-like popularity, tokens drawn without replacement."""
    from qnpipe import trace

    seed, layers, experts, k, steps, prompt = LOGS[name]
    rng = np.random.default_rng(seed)
    pop = [rng.permutation(1.0 / np.arange(1, experts + 1) ** 1.1) for _ in range(layers)]
    shape = trace.ModelShape(num_layers=layers, moe_layers=tuple(range(layers)), num_experts=experts, top_k=k,
                             hidden_size=64)
    header = trace.Header(schema_version=trace.SCHEMA_VERSION, fingerprint=f"golden:{name}", model=shape,
                          clock_start_t=0.0, wall_start_unix_s=0.0, contents="routes", capacities={})
    w = trace.TraceWriter(path, header)
    seq = 0
    for step in range(1, steps + 1):
        for layer in range(layers):
            p = pop[layer] / pop[layer].sum()
            toks = [rng.choice(experts, k, replace=False, p=p) for _ in range(prompt if step == 1 else 1)]
            seq += 1
            w.write(trace.Route(t=0.0, seq=seq, step=step, layer=layer, top_k=k,
                                experts=tuple(int(e) for t in toks for e in t)))
    w.close(0, 0.0)


def golden_report(case: str, golden: Path = GOLDEN, driver: str = "fast") -> bytes:
    """The case's replay report as indented JSON (its `log` field: the file name alone), by replay's `driver`."""
    from qnpipe import config
    from qnpipe.io.simssd import DeviceProfile
    from qnpipe.replay import CostModel, replay

    c = CASES[case]
    cfg = config.load(None, overrides={k: str(v) for k, v in c["set"].items()})
    device = DeviceProfile(**c["device"]) if "device" in c else "apple-m5-internal"
    r = replay(golden / f"{c['log']}.qtrace", cfg, device_profile=device, cost=CostModel(**c.get("cost", {})),
               record_nbytes=NBYTES, predictor=c.get("predictor", "none"), driver=driver)
    r = msgspec.structs.replace(r, log=f"{c['log']}.qtrace")
    return msgspec.json.format(msgspec.json.encode(r), indent=1) + b"\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--logs", action="store_true", help="also rewrite the .qtrace logs from their seeds")
    args = p.parse_args(argv)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    if args.logs or not all((GOLDEN / f"{n}.qtrace").exists() for n in LOGS):
        for name in LOGS:
            write_log(name, GOLDEN / f"{name}.qtrace")
            print(f"wrote {GOLDEN / f'{name}.qtrace'}")
    for case in CASES:
        out = GOLDEN / f"{case}.json"
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(golden_report(case))
        tmp.replace(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
