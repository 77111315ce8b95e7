"""What counting prefill parts changes in the planner's allocation (issue 38): one JSON line.

On tools/bench_plan.py's synthetic log (48 MoE layers x 512 experts, top-10, `--tokens` one-token steps)
or `--log`, at `--per-layer` average slots per MoE layer, for each `--chunks` prefill chunk size
(`forward.prefill_chunk_tokens`; the log has no multi-token step, so the chunks are derived:
qnpipe.plan.prefill_parts): the LRU allocation on the misses alone and with prefill parts counted, each
with its extra prefill passes over the derived chunks, its LRU curve hit rate (whole log), and its
demand-only LRU replay's tok/s and hit rate on the timing window (decode steps: no prefill in them).

    PYTHONPATH=. python tools/bench_prefill_parts.py [--tokens 10000] [--chunks 2,16] [--per-layer 12,16,24,48]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from qnpipe import config
from qnpipe.io.sim_model import PROFILES
from qnpipe.plan.fixed import Fixed
from qnpipe.plan.search import Search
from qnpipe.replay.runner import CostModel
from qnpipe.replay.synth import SynthSpec, write_synth

RECORD = 1_769_472  # one expert of the 80B at 4 bits (tools/bench_plan.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--chunks", default="2,16")
    p.add_argument("--per-layer", default="12,16,24,48")
    args = p.parse_args()
    out: dict[str, object] = {"rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or write_synth(Path(tmp) / "synth.qtrace", SynthSpec(
            layers=48, experts=512, top_k=10, tokens=args.tokens, seed=1, locality=0.3, cross_layer=0.5,
            popularity="zipf:1.0"))
        for chunk in (int(x) for x in args.chunks.split(",")):
            cfg = config.load(None, overrides={"forward.prefill_chunk_tokens": str(chunk)})
            kw = {"device": PROFILES["apple-m5-internal"], "cost": CostModel(), "record_nbytes": RECORD,
                  "fixed": Fixed(policy="lru"), "work_dir": tmp}
            off, on = Search(log, cfg, prefill=False, **kw), Search(log, cfg, **kw)  # type: ignore[arg-type]
            layers = len(on.log.shape.moe_layers)
            for per in (int(x) for x in args.per_layer.split(",")):
                total = per * layers
                row: dict[str, object] = {"chunk": chunk, "per_layer": per, "parts_source": on.parts_source}
                for name, s in (("misses_only", off), ("with_parts", on)):
                    caps = s.planned(total)
                    r = s.run(name, "planned", caps, "lru", False).report
                    row[name] = {"slots": sum(caps.values()), "min_slots": min(caps.values()),
                                 "prefill_extra_passes": on.prefill_parts(caps),
                                 "curve_hit_rate": round(s.curve_rates(caps)[0], 4),
                                 "replay_tok_s": round(r.tok_s, 3), "replay_hit_rate": round(r.hit_rate, 4)}
                out["rows"].append(row)  # type: ignore[union-attr]
                print(json.dumps(row), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
