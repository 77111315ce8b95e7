"""Qwen3-Next through the generic tier against the native one: decode tok/s side by side, streamed and resident.

Makes (or takes `--model`) the bench model of tools/bench_stream.py (a qnpipe Qwen3-Next directory,
default 16 MoE layers x 128 experts, top-8, 4-bit), opens four engines on it and runs them
interleaved, round by round, with the same one-token prompt and sampling seed (so the same tokens and
routes in all four):

  native_streamed   qnpipe's own Qwen3-Next model, the pool at `--pool-frac` of each layer's experts
  generic_streamed  `model.tier=generic`: mlx-lm's qwen3_next model, its switches pooled (greenlet)
  native_resident   `eager_load=True`, qnpipe's model
  generic_resident  `eager_load=True`, `model.tier=generic`: mlx-lm's model with its own switches

Prefetch is off in all four (demand reads only: the two tiers predict differently). The engines' order
rotates round by round. `tok_s_*` is the median `GenerateStats.decode_tok_s` over `--rounds`; the
ratios `generic_vs_native_streamed` and `generic_vs_native_resident` are the medians of the rounds'
own ratios (generic tok/s / native tok/s: 1.0 is parity, the issue's bar is >= 0.95), robust to a
machine whose load drifts between rounds. The last line printed is that one JSON object.

    python tools/bench_family.py                       # make / reuse the bench model in /tmp/qnpipe-bench-stream
    python tools/bench_family.py --rounds 3 --tokens 16
    python tools/bench_family.py --shape smoke         # a seconds-long run (tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from qnpipe import Engine  # before MLX (make_model imports it): qnpipe's BLAS goes in front of MLX's

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_stream import SHAPES, log, make_model, round_prompt  # noqa: E402

ENGINES = ("native_streamed", "generic_streamed", "native_resident", "generic_resident")


def engine_settings(name: str, slots: int, workers: int) -> dict[str, Any]:
    common: dict[str, Any] = {"predict.cross_layer_prefetch": False}
    if name.endswith("resident"):
        common["eager_load"] = True
    else:
        common |= {"expert_slots": slots, "read.workers": workers}
    if name.startswith("generic"):
        common["model.tier"] = "generic"
    return common


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a qnpipe Qwen3-Next directory (default: make / reuse one under --work)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--pool-frac", type=float, default=0.25, help="streamed pool capacity / experts per layer")
    ap.add_argument("--workers", type=int, default=16, help="read.workers")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per generate call")
    ap.add_argument("--rounds", type=int, default=5)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = a.model or make_model(a.work, a.shape, a.bits, a.group_size)
    cfg = json.loads((model / "config.json").read_text())
    E, k, V = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["vocab_size"]
    slots = max(k, min(E, round(E * a.pool_frac)))
    engines = {name: Engine(model, **engine_settings(name, slots, a.workers)) for name in ENGINES}
    tok_s: dict[str, list[float]] = {name: [] for name in ENGINES}
    try:
        for r in range(a.rounds):
            prompt = round_prompt(r, V)
            tokens = {}
            # The order rotates round by round: no engine always runs first (or after the same one).
            order = list(ENGINES[r % len(ENGINES):] + ENGINES[:r % len(ENGINES)])
            for name in order:
                eng = engines[name]
                res = eng.generate(prompt, max_tokens=a.tokens, temperature=1.0, seed=r, stop_at_eos=False)
                tok_s[name].append(res.stats.decode_tok_s)
                tokens[name] = res.tokens
            if len(set(tokens.values())) != 1:  # the same tokens, or the comparison is of different work
                raise SystemExit(f"round {r}: the engines' tokens differ: {tokens}")
            log(f"round {r}: " + ", ".join(f"{n} {tok_s[n][-1]:.1f}" for n in ENGINES))
    finally:
        for eng in engines.values():
            eng.close()
    med = {name: statistics.median(v) for name, v in tok_s.items()}

    def ratio(kind: str) -> float:
        # Per round, then the median: a machine whose load drifts between rounds moves both engines of a round.
        return statistics.median(g / n for g, n in zip(tok_s[f"generic_{kind}"], tok_s[f"native_{kind}"], strict=True))

    out = {"model": str(model), "shape": a.shape, "slots": slots, "tokens": a.tokens, "rounds": a.rounds,
           **{f"tok_s_{n}": round(med[n], 2) for n in ENGINES},
           "generic_vs_native_streamed": round(ratio("streamed"), 4),
           "generic_vs_native_resident": round(ratio("resident"), 4)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
