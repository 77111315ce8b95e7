"""Decode and prefill speed: qnpipe (all experts resident) vs mlx-lm `generate_step`, on each CPU BLAS.

The BLAS is chosen once per process before MLX loads (compute.cpu_blas), so each setting runs
in a child process of its own; the children take turns round by round, so machine noise hits
every setting alike. Within a child, qnpipe and mlx-lm run interleaved on the same model and BLAS.
Settings (`--blas`): `fast` (auto: OpenBLAS, with the batch-invariant kernel, the default),
`fast_variant` (auto without compute.batch_invariant: OpenBLAS itself), `bundled` (MLX's
reference BLAS). Prefill is one prompt of `--prompt-tokens` tokens with qnpipe's default chunking.

Prints one JSON line: per setting `qnpipe_tok_s`, `mlx_lm_tok_s`, `ratio` (qnpipe / mlx-lm decode)
and `prefill_tok_s`; `ratio_fast_blas_to_bundled` {decode, prefill} (qnpipe, fast over bundled);
`exact_cost_decode` (1 - fast / fast_variant decode tok/s: what the batch-invariant kernel costs).
Every figure is a median over the rounds.

    python tools/bench_decode.py                    # tiny 4-bit model made on the fly
    python tools/bench_decode.py --model qnpipe/data/tiny_trained   # the trained tiny model (float32)
    python tools/bench_decode.py --size mid         # a wider model, so compute outweighs overhead
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {
    "tiny": {},
    "mid": {"hidden_size": 512, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
            "num_attention_heads": 8, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
            "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 4096},
}
# compute.cpu_blas and compute.batch_invariant of each setting, as the child's environment.
SETTINGS = {
    "fast": {"QNPIPE_COMPUTE__CPU_BLAS": "auto", "QNPIPE_COMPUTE__BATCH_INVARIANT": "1"},
    "fast_variant": {"QNPIPE_COMPUTE__CPU_BLAS": "auto", "QNPIPE_COMPUTE__BATCH_INVARIANT": "0"},
    "bundled": {"QNPIPE_COMPUTE__CPU_BLAS": "bundled", "QNPIPE_COMPUTE__BATCH_INVARIANT": "1"},
}


def child(model_dir: Path, tokens: int, prompt_tokens: int) -> dict[str, Any]:
    """One round on this process's BLAS: qnpipe and mlx-lm decode, qnpipe prefill."""
    from qnpipe import config
    from qnpipe.compute import blas

    info = blas.apply(config.load().compute)  # before MLX is imported
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as mlx_lm_load

    import qnpipe

    def mlx_lm_decode(model: Any, prompt: list[int], n: int) -> float:
        gen = generate_step(mx.array(prompt), model, max_tokens=n)
        next(gen)  # the first token comes from prefill
        t0 = time.perf_counter()
        count = sum(1 for _ in gen)
        return count / (time.perf_counter() - t0)

    ref, _ = mlx_lm_load(model_dir)
    prompt = list(range(3, 35))
    long_prompt = [3 + i % 200 for i in range(prompt_tokens)]
    with qnpipe.Engine(model_dir) as eng:
        mlx_lm_decode(ref, prompt, 8)  # warm up both
        eng.generate(prompt, max_tokens=8, stop_at_eos=False)
        theirs = mlx_lm_decode(ref, prompt, tokens)
        ours = eng.generate(prompt, max_tokens=tokens, stop_at_eos=False).stats.decode_tok_s
        prefill = eng.generate(long_prompt, max_tokens=1, stop_at_eos=False).stats.prefill_tok_s
    return {"qnpipe_tok_s": ours, "mlx_lm_tok_s": theirs, "prefill_tok_s": prefill, "blas": info.describe()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory mlx-lm can load (default: make one)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per round")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens of the prefill figure")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--blas", nargs="+", choices=sorted(SETTINGS), default=["fast", "fast_variant", "bundled"])
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one round in this process, on its BLAS
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.tokens, args.prompt_tokens)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            from qnpipe.convert.tiny import make_tiny

            model_dir = make_tiny(Path(tmp) / "m", layout="mlx", bits=args.bits,
                                  config_overrides=SIZES[args.size], seed=0)
        else:
            model_dir = args.model
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.blas}
        for _ in range(args.rounds):
            for s in args.blas:
                cmd = [sys.executable, __file__, "--child", str(model_dir), "--tokens", str(args.tokens),
                       "--prompt-tokens", str(args.prompt_tokens)]
                out = subprocess.run(cmd, env={**os.environ, **SETTINGS[s]}, capture_output=True, text=True,
                                     check=True)
                runs[s].append(json.loads(out.stdout.strip().splitlines()[-1]))
    res: dict[str, Any] = {"bench": "decode",
                           "model": str(args.model) if args.model else f"made:{args.size}-{args.bits}bit",
                           "tokens_per_round": args.tokens, "prompt_tokens": args.prompt_tokens,
                           "rounds": args.rounds, "target": 0.95}
    med = {s: {k: statistics.median(r[k] for r in rs) for k in ("qnpipe_tok_s", "mlx_lm_tok_s", "prefill_tok_s")}
           for s, rs in runs.items()}
    for s, rs in runs.items():
        res[s] = {**{k: round(v, 2) for k, v in med[s].items()},
                  "ratio": round(statistics.median(r["qnpipe_tok_s"] / r["mlx_lm_tok_s"] for r in rs), 4),
                  "blas": rs[0]["blas"]}
    if "fast" in med and "bundled" in med:
        res["ratio_fast_blas_to_bundled"] = {
            phase: round(med["fast"][key] / med["bundled"][key], 3)
            for phase, key in (("decode", "qnpipe_tok_s"), ("prefill", "prefill_tok_s"))}
    if "fast" in med and "fast_variant" in med:
        res["exact_cost_decode"] = round(1 - med["fast"]["qnpipe_tok_s"] / med["fast_variant"]["qnpipe_tok_s"], 4)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
