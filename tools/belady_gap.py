"""Belady's gap on the whole real traces: each imported, replayed with every demand policy; prints JSON.

Imports the traces of tests/data/traces (`qnpipe.trace.importers`), replays each through the real
pool (`qnpipe.replay`, a routing log: `record_nbytes` given) with `pool.evict_policy` = lru,
lfu, fifo and lrfu at one capacity per trace, checks every layer's hit rate against Belady's
and prints a table on stderr and one JSON line on stdout: `traces`, a list of
`{trace, slots, steps, belady_hit_rate, hit_rate: {policy: rate}, gap: {policy: belady - rate}}`
(rates over all the trace's expert requests). tests/trace/importers/test_belady_on_real_traces.py checks
the same bound on the first steps of each trace; this runs the whole logs (about 3 minutes).

Usage: python tools/belady_gap.py [--slots-mixtral 4] [--slots 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qnpipe import config  # noqa: E402
from qnpipe.replay import replay  # noqa: E402
from qnpipe.trace.importers import import_log  # noqa: E402

DATA = ROOT / "tests" / "data" / "traces"
POLICIES = ("lru", "lfu", "fifo", "lrfu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots-mixtral", type=int, default=4, help="slots per layer for Mixtral (8 experts)")
    ap.add_argument("--slots", type=int, default=16, help="slots per layer for Qwen1.5 (60) and FLAME (64)")
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(DATA / "Akash-N-Pai__DynaNDE-Simulator" / "Sample_routing_traces.tar.gz") as t:
            t.extractall(tmp, filter="data")
        flame = Path(tmp) / "Sample_routing_traces"
        mario, weiran = DATA / "Mario928__speculative-moe", DATA / "weiran0129__vLLM-MoE-Logger"
        traces = [("mixtral-humaneval_2", "mixtral-jsonl", mario / "humaneval_2_routing.jsonl.gz", args.slots_mixtral),
                  ("mixtral-routing_raw", "mixtral-jsonl", mario / "routing_raw.jsonl.gz", args.slots_mixtral),
                  *[(f"qwen-layer{n}", "vllm-jsonl", weiran / f"moe_layer{n}.jsonl.gz", args.slots)
                    for n in (0, 8, 12, 18, 23)],
                  ("qwen-totani", "vllm-jsonl",
                   DATA / "TotaniYash__vllm_moe_routelogging_patch" / "moe_routes.jsonl.gz", args.slots),
                  ("flame-sequences", "flame-pt", flame / "Encoder_Batch_0-32", args.slots),
                  ("flame-positions", "flame-pt", flame / "Decoder_Batch_0-64", args.slots)]
        print(f"{'trace':20} {'slots':>5} {'steps':>5} {'belady':>7} " + " ".join(f"{p:>6}" for p in POLICIES),
              file=sys.stderr)
        for name, fmt, src, slots in traces:
            log = Path(tmp) / f"{name}.qtrace"
            s = import_log(fmt, src, log)
            rates, belady = {}, 0.0
            for policy in POLICIES:
                cfg = config.load(None, overrides={"pool.expert_slots": str(slots), "pool.evict_policy": policy})
                r = replay(log, cfg, record_nbytes=1 << 20)
                layers = [x for x in r.layers if x.requests]
                bad = [x.layer for x in layers if x.hit_rate > x.belady_hit_rate]
                if bad:
                    raise SystemExit(f"{name}: {policy} beats Belady at layers {bad}: a bug")
                requests = sum(x.requests for x in layers)
                belady = sum(x.belady_hit_rate * x.requests for x in layers) / requests
                rates[policy] = r.hit_rate
            out.append({"trace": name, "slots": slots, "steps": s.steps, "belady_hit_rate": belady,
                        "hit_rate": rates, "gap": {p: belady - v for p, v in rates.items()}})
            print(f"{name:20} {slots:>5} {s.steps:>5} {belady:>7.3f} " + " ".join(f"{v:>6.3f}" for v in rates.values()),
                  file=sys.stderr, flush=True)
    print(json.dumps({"traces": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
