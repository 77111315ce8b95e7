"""Conversations (issue 13): time to first token with prefix snapshots, KV bytes per token, KV-quant quality.

Prints one JSON line. What is measured:

* `ttft_ratio` = median time to first token without snapshots / with them, for a second
  request whose prompt shares a `--head`-token head (default 2,048) with the first and has a
  `--tail`-token tail of its own (default 64). Two engines on the same model, side by side in
  one run: `prefix.snapshot_head_tokens=0` and `=--head`; each first serves a request with the
  head (the one with snapshots keeps its state), then `--rounds` requests each with another
  tail, interleaved engine by engine; the time to first token is `GenerateStats.prefill_s`
  (prompt in, first token out). Both prefill in chunks of `--chunk` tokens. `ttft_s_without`,
  `ttft_s_with` are the medians; `tokens_equal` says whether both engines generated the same
  greedy tokens in every round (they must).
* `kv_bytes_ratio` = unquantized / quantized KV bytes per token of context for the
  Qwen3-Next-80B attention shape (12 full-attention layers, 2 KV heads of 256, bf16) at the
  default `kv.*` settings (K4/V3, group 64): measured on the arrays a cache of that shape holds
  after `--head` tokens (`kv_bytes_per_token`, `kv_bytes_per_token_quantized`), and
  `kv_bytes_arithmetic_ok` whether it equals `kvquant.bytes_per_token`. `kv_bytes_ratio_model`
  is the same ratio for the benchmarked model (`EngineStats.kv_bytes_per_token`).
* `token_agreement`, `logits_cosine`: the quality gate of qnpipe.model.kv_quality at K4/V3
  (group = 64, or the model's head_dim when smaller) over `--quality-prompts` prompts x
  `--quality-tokens` greedy tokens, one token per step; `mlx_lm_4_4` and `qnpipe_4_4` hold the
  same two figures for mlx-lm's QuantizedKVCache and qnpipe's cache at 4/4, in the same run.

Example: `python tools/bench_chat.py` (the embedded trained tiny model) or `--model DIR`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import cast

import qnpipe
from qnpipe.cli.common import DEMO_MODEL_DIR

FA_LAYERS, KV_HEADS, HEAD_DIM = 12, 2, 256  # Qwen3-Next-80B-A3B


def corpus_tokens(eng: qnpipe.Engine, n: int) -> list[int]:
    """`n` token ids of Python source (the standard library: what the embedded model was trained on)."""
    import inspect
    import json as json_mod
    import textwrap

    text = "\n".join(inspect.getsource(m) for m in (textwrap, json_mod.decoder, argparse))
    ids = eng.encode(text)
    if len(ids) < n:
        raise SystemExit(f"bench_chat: the corpus has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


def ttft(model: Path, head: int, tail: int, rounds: int, chunk: int) -> dict[str, object]:
    with qnpipe.Engine(model, snapshot_head_tokens=0, prefill_chunk_tokens=chunk) as plain, \
            qnpipe.Engine(model, snapshot_head_tokens=head, prefill_chunk_tokens=chunk, max_entries=4) as snap:
        ids = corpus_tokens(plain, head + tail * (rounds + 1))
        prompts = [ids[:head] + ids[head + i * tail: head + (i + 1) * tail] for i in range(rounds + 1)]
        t_without, t_with, equal = [], [], True
        for i, p in enumerate(prompts):
            a = plain.generate(p, max_tokens=4, stop_at_eos=False)
            b = snap.generate(p, max_tokens=4, stop_at_eos=False)
            equal &= a.tokens == b.tokens
            if i:  # the first request of each engine made the head's state
                t_without.append(a.stats.prefill_s)
                t_with.append(b.stats.prefill_s)
                assert b.stats.prefix_tokens_reused >= head, b.stats
        st = snap.stats()
        model_ratio = plain.stats().kv_bytes_per_token
        head_dim = plain.args.head_dim
    with qnpipe.Engine(model, snapshot_head_tokens=0, kv_quant=True, group_size=min(64, head_dim)) as q:
        model_ratio /= q.stats().kv_bytes_per_token
    w, s = statistics.median(t_without), statistics.median(t_with)
    return {"ttft_ratio": w / s, "ttft_s_without": w, "ttft_s_with": s, "tokens_equal": equal,
            "prefix_hits": st.prefix.hits if st.prefix else 0, "kv_bytes_ratio_model": model_ratio}


def kv_bytes(tokens: int) -> dict[str, object]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from qnpipe.config import KvCfg
    from qnpipe.model.kvquant import RotatedQuantizedKVCache, bytes_per_token

    cfg = KvCfg(quantize=True)
    x = mx.zeros((1, KV_HEADS, tokens, HEAD_DIM), dtype=mx.bfloat16)
    plain, quant = KVCache(), RotatedQuantizedKVCache.from_cfg(cfg, HEAD_DIM)
    k, v = cast(tuple[mx.array, mx.array], plain.update_and_fetch(x, x))  # the keys and values so far
    quant.update_and_fetch(x, x)
    per_plain = (k.nbytes + v.nbytes) * FA_LAYERS // tokens
    per_quant = quant.nbytes * FA_LAYERS // tokens
    ok = (per_plain == bytes_per_token(FA_LAYERS, KV_HEADS, HEAD_DIM, 2, None)
          and per_quant == bytes_per_token(FA_LAYERS, KV_HEADS, HEAD_DIM, 2, cfg))
    return {"kv_bytes_ratio": per_plain / per_quant, "kv_bytes_per_token": per_plain,
            "kv_bytes_per_token_quantized": per_quant, "kv_bytes_arithmetic_ok": ok}


def quality(model_dir: Path, n_prompts: int, n_tokens: int) -> dict[str, object]:
    from qnpipe.model import kv_quality
    from qnpipe.model.load import load_model

    model = load_model(model_dir).model
    with qnpipe.Engine(model_dir, snapshot_head_tokens=0) as eng:
        ids = corpus_tokens(eng, 48 * n_prompts)
    prompts = [ids[i * 48:(i + 1) * 48] for i in range(n_prompts)]
    group = min(64, model.args.head_dim)
    res = kv_quality.quality_gate(model, prompts, n_tokens, kv_quality.variants(model, [(4, 3), (4, 4)], group))
    agree, cos = res["qnpipe 4/3"]
    return {"token_agreement": agree, "logits_cosine": cos, "quality_tokens": n_prompts * n_tokens,
            "quality_group_size": group, "qnpipe_4_4": list(res["qnpipe 4/4"]), "mlx_lm_4_4": list(res["mlx-lm 4/4"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="model directory (default: the embedded one)")
    p.add_argument("--head", type=int, default=2048, help="shared head tokens (default 2048)")
    p.add_argument("--tail", type=int, default=64, help="tail tokens of each request (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="second requests timed per engine (default 3)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk tokens (default 64)")
    p.add_argument("--quality-prompts", type=int, default=4)
    p.add_argument("--quality-tokens", type=int, default=64, help="greedy tokens per prompt (default 64)")
    args = p.parse_args(argv)
    out: dict[str, object] = {"model": str(args.model), "head": args.head, "tail": args.tail, "chunk": args.chunk}
    out |= ttft(args.model, args.head, args.tail, args.rounds, args.chunk)
    out |= kv_bytes(args.head)
    out |= quality(args.model, args.quality_prompts, args.quality_tokens)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
