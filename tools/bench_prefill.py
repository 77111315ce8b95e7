"""Prefill speed at the default chunk (`forward.prefill_chunk_tokens`): resident against mlx-lm, streamed
against its bound (issue 37 item 4, issue 39 item 2).

Resident: the trained tiny model (`--model`, default qnpipe/data/tiny_trained), one prompt of
`--prompt-tokens` tokens, qnpipe's `Engine` at its default chunk and mlx-lm's `generate_step`
(its default `prefill_step_size`, 2048) on the same weights in the same process, interleaved
round by round (order alternating). `prefill_resident_tok_s` is `GenerateStats.prefill_tok_s` of a
`max_tokens=1` call; `prefill_mlx_lm_tok_s` the prompt over the time to mlx-lm's first token.

Streamed: the bench model of tools/bench_stream.py (`--stream-model`, default made / reused under
/tmp/qnpipe-bench-stream), a `--stream-tokens` (2048) prompt, in chunks of the default. Each
round opens a fresh engine with a pool of `--pool-frac` of each layer's experts (cold, direct I/O,
16 reads in flight) and prefills the prompt; beside it the all-resident engine prefills the same
prompt (its compute time), and the device's bandwidth is measured with the store's own records
(bench_stream.bench_bandwidth). The bound is the prompt over (compute time + the bytes the chunk
must read / bandwidth), where the bytes a chunk must read are each distinct expert of each layer
once: what a cold engine whose pool holds every expert reads for that prompt (measured once).
`prefill_streamed_fullpool_tok_s` is that engine's speed (every expert read once, no parts).

Prints progress on stderr and one JSON line on stdout; figures are medians over `--rounds`.

    python tools/bench_prefill.py                    # both parts
    python tools/bench_prefill.py --no-streamed      # resident against mlx-lm only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench_prefill {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _bench_stream() -> Any:
    spec = importlib.util.spec_from_file_location("bench_stream", REPO / "tools" / "bench_stream.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompt_of(n: int, vocab: int, seed: int) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, min(vocab, 1000), n)]


def resident(model: Path, n: int, rounds: int) -> dict[str, Any]:
    """qnpipe (default chunk, all resident) and mlx-lm prefill of one prompt, interleaved."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    import qnpipe

    ref, _ = load_model(model)
    ours: list[float] = []
    theirs: list[float] = []
    with qnpipe.Engine(model) as eng:
        chunk = eng._eng._rt.core.cfg.forward.prefill_chunk_tokens  # internals, read-only
        prompt = prompt_of(n, eng.args.vocab_size, 0)

        def mlx_lm() -> float:
            t0 = time.perf_counter()
            next(generate_step(mx.array(prompt), ref, max_tokens=1))
            return n / (time.perf_counter() - t0)

        def qn() -> float:
            return eng.generate(prompt, max_tokens=1, stop_at_eos=False).stats.prefill_tok_s

        mlx_lm()  # warm up both
        qn()
        for r in range(rounds):
            for name in (("qnpipe", "mlx_lm") if r % 2 == 0 else ("mlx_lm", "qnpipe")):
                (ours if name == "qnpipe" else theirs).append(qn() if name == "qnpipe" else mlx_lm())
            log(f"resident round {r + 1}: qnpipe {ours[-1]:.0f} tok/s, mlx-lm {theirs[-1]:.0f} tok/s")
    return {"prefill_resident_tok_s": round(statistics.median(ours), 1),
            "prefill_mlx_lm_tok_s": round(statistics.median(theirs), 1),
            "prefill_resident_ratio_to_mlx_lm": round(statistics.median(a / b for a, b in zip(ours, theirs, strict=True)), 4),
            "prefill_resident_raw": [round(x) for x in ours], "prefill_mlx_lm_raw": [round(x) for x in theirs],
            "resident_model": str(model), "resident_prompt_tokens": n, "prefill_chunk_tokens": chunk}


def _streamed_call(model: Path, prompt: list[int], **kw: Any) -> tuple[float, int]:
    """A fresh engine's prefill of `prompt`: (tok/s, bytes read)."""
    import qnpipe

    with qnpipe.Engine(model, **kw) as eng:
        res = eng.generate(prompt, max_tokens=1, stop_at_eos=False)
        pool = eng.stats().pool
        return res.stats.prefill_tok_s, (pool.bytes_read if pool is not None else 0)


def streamed(model: Path, n: int, rounds: int, pool_frac: float, workers: int) -> dict[str, Any]:
    import qnpipe
    from qnpipe.io.store import ExpertStore

    bs = _bench_stream()
    with ExpertStore.open(model) as store:
        layers = list(store.layers)
        experts = store.layer_file(layers[0]).num_experts
    slots = max(1, round(experts * pool_frac))
    read = {"read.workers": workers, "read.nocache": True, "pool.autopin": False}
    comp: list[float] = []
    got: list[float] = []
    full: list[float] = []
    bw: list[float] = []
    must: list[int] = []
    bounds: list[float] = []
    with qnpipe.Engine(model, eager_load=True) as res_eng:
        vocab = res_eng.args.vocab_size
        res_eng.generate(prompt_of(64, vocab, 99), max_tokens=1, stop_at_eos=False)  # warm up
        for r in range(rounds):
            prompt = prompt_of(n, vocab, r + 1)
            comp.append(n / res_eng.generate(prompt, max_tokens=1, stop_at_eos=False).stats.prefill_tok_s)
            tok_s, nbytes = _streamed_call(model, prompt, expert_slots=slots, **read)
            got.append(tok_s)
            ftok_s, fbytes = _streamed_call(model, prompt, expert_slots=experts, **read)
            full.append(ftok_s)
            must.append(fbytes)
            bw.append(bs.bench_bandwidth(model, workers, 1.5, seed=r)["gbps"] * 1e9)
            bounds.append(n / (comp[-1] + fbytes / bw[-1]))
            log(f"streamed round {r + 1}: {tok_s:.1f} tok/s ({nbytes / 1e9:.2f} GB read), full pool {ftok_s:.1f} "
                f"({fbytes / 1e9:.3f} GB), compute {comp[-1]:.2f} s, bw {bw[-1] / 1e9:.2f} GB/s, "
                f"bound {bounds[-1]:.1f} tok/s; load {os.getloadavg()[0]:.2f}")
            last_bytes = nbytes
    return {"prefill_streamed_tok_s": round(statistics.median(got), 2),
            "prefill_streamed_bound_tok_s": round(statistics.median(bounds), 2),
            "prefill_streamed_ratio_to_bound": round(statistics.median(g / b for g, b in zip(got, bounds, strict=True)), 4),
            "prefill_streamed_fullpool_tok_s": round(statistics.median(full), 2),
            "prefill_streamed_bytes_read": last_bytes, "prefill_must_read_bytes": statistics.median(must),
            "prefill_compute_s": round(statistics.median(comp), 3),
            "bandwidth_gbps": round(statistics.median(bw) / 1e9, 3),
            "stream_model": str(model), "stream_prompt_tokens": n, "pool_slots_per_layer": slots,
            "experts_per_layer": experts, "moe_layers": len(layers)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=REPO / "qnpipe" / "data" / "tiny_trained")
    ap.add_argument("--prompt-tokens", type=int, default=1053, help="resident prompt tokens (issue 39's 1,053)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream-model", type=Path, help="default: bench_stream's bench model (made / reused)")
    ap.add_argument("--stream-tokens", type=int, default=2048)
    ap.add_argument("--stream-rounds", type=int, default=2)
    ap.add_argument("--pool-frac", type=float, default=0.25)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--no-resident", action="store_true")
    ap.add_argument("--no-streamed", action="store_true")
    args = ap.parse_args(argv)
    import qnpipe

    # The CPU BLAS (compute.cpu_blas) is chosen when the engine is first reached, before MLX is imported:
    # mlx-lm's reference below then runs on it too.
    _ = qnpipe.Engine
    load0 = os.getloadavg()
    out: dict[str, Any] = {"bench": "prefill"}
    if not args.no_resident:
        out |= resident(args.model, args.prompt_tokens, args.rounds)
    if not args.no_streamed:
        model = args.stream_model or _bench_stream().make_model(Path("/tmp/qnpipe-bench-stream"), "bench", 4, 64)
        out |= streamed(model, args.stream_tokens, args.stream_rounds, args.pool_frac, args.workers)
    out["targets"] = {"prefill_resident_ratio_to_mlx_lm": ">= 1", "prefill_streamed_ratio_to_bound": ">= 0.8"}
    out["loadavg_start_end"] = [round(load0[0], 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
