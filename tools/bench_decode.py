"""Decode speed: qnpipe (all experts resident) vs mlx-lm `generate_step` on the same quantized model.

Both run in this process, interleaved round by round, so machine noise hits both alike.
Prints one JSON line: tok/s of each, and the ratio qnpipe / mlx-lm (median over rounds).

    python tools/bench_decode.py                    # tiny 4-bit model made on the fly
    python tools/bench_decode.py --model DIR        # any mlx-lm converted Qwen3-Next directory
    python tools/bench_decode.py --size mid         # a wider model, so compute outweighs overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load

import qnpipe
from qnpipe.convert.tiny import make_tiny

SIZES = {
    "tiny": {},
    "mid": {"hidden_size": 512, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
            "num_attention_heads": 8, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
            "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 4096},
}


def mlx_lm_decode(model, prompt: list[int], n: int) -> float:
    gen = generate_step(mx.array(prompt), model, max_tokens=n)
    next(gen)  # the first token comes from prefill
    t0 = time.perf_counter()
    count = sum(1 for _ in gen)
    return count / (time.perf_counter() - t0)


def qnpipe_decode(eng: qnpipe.Engine, prompt: list[int], n: int) -> float:
    res = eng.generate(prompt, max_tokens=n, stop_at_eos=False)
    return res.stats.decode_tok_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="mlx-lm converted model directory (default: make one)")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or make_tiny(Path(tmp) / "m", layout="mlx", bits=args.bits,
                                            config_overrides=SIZES[args.size], seed=0)
        ref, _ = mlx_lm_load(model_dir)
        prompt = list(range(3, 35))
        ours, theirs = [], []
        with qnpipe.Engine(model_dir) as eng:
            mlx_lm_decode(ref, prompt, 8)  # warm up both
            qnpipe_decode(eng, prompt, 8)
            for _ in range(args.rounds):
                theirs.append(mlx_lm_decode(ref, prompt, args.tokens))
                ours.append(qnpipe_decode(eng, prompt, args.tokens))
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        print(json.dumps({
            "bench": "decode",
            "model": str(args.model) if args.model else f"made:{args.size}-{args.bits}bit",
            "tokens_per_round": args.tokens,
            "rounds": args.rounds,
            "qnpipe_tok_s": round(statistics.median(ours), 2),
            "mlx_lm_tok_s": round(statistics.median(theirs), 2),
            "ratio": round(statistics.median(ratios), 4),
            "target": 0.95,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
