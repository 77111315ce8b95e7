"""Pipeline parallel on localhost: decode tok/s with 1, 2 and 3 ranks, the hand-off per token, the bytes moved.

Starts the ranks itself (MLX_RANK, MLX_HOSTFILE on free ports, as `mlx.launch --backend ring`
would). Each run decodes the same greedy tokens; then, on the same ring, rank 0 sends
`--handoffs` token-shaped passes around it (the hidden state rank to rank, the token back to
rank 0) through qnpipe's own messages with no model work: that is the hand-off per token.
Prints one JSON line (`tok_s_by_ranks`, `handoff_us_per_token`, `handoff_share_of_token`: the
hand-off over the time of a token decoded at that many ranks, `bytes_per_token`, and each rank's
memory after loading and at its peak).

    python tools/bench_distributed.py                     # the bench model (tools/bench_stream.py's), made once under --work
    python tools/bench_distributed.py --model tiny        # the tiny model, made and converted here
    python tools/bench_distributed.py --model DIR --set pool.expert_slots=8
    python tools/bench_distributed.py --model DIR --set mtp.enabled=true --prompt "def f(x):"  # MTP speculation

On one machine the ranks share its cores, and a rank waiting in MLX's ring recv keeps about
half a core busy (docs/distributed.md): tok/s here is a floor, not what two machines give.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qnpipe.live.parallel.localhost import write_local_hostfile


def _overrides(pairs: list[str]) -> dict[str, object]:
    return {k: v for k, _, v in (p.partition("=") for p in pairs)}


def worker(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import numpy as np
    import trio

    from qnpipe import open_engine

    out: dict[str, object] = {}

    async def run() -> None:
        from qnpipe import config

        cfg = config.load(overrides={**_overrides(args.set), "model.model_dir": str(args.model)})
        async with open_engine(cfg=cfg, distributed=args.ranks > 1) as eng:
            out["active_after_load_bytes"] = mx.get_active_memory()
            if eng.rank == 0:
                prompt = args.prompt if args.prompt is not None else list(range(1, 17))
                await eng.generate(prompt, max_tokens=8, stop_at_eos=False)  # MLX's first-use costs
                res = await eng.generate(prompt, max_tokens=args.tokens, stop_at_eos=False)
                out["decode_tok_s"] = res.stats.decode_tok_s
                if res.stats.mtp is not None and res.stats.mtp.rounds:
                    out["mtp_tokens_per_round"] = res.stats.mtp.tokens / res.stats.mtp.rounds
                out["hidden_size"] = eng.args.hidden_size
        out["peak_bytes"] = mx.get_peak_memory()

    trio.run(run)
    if args.ranks > 1:
        from qnpipe.config.launch import read_launch
        from qnpipe.live.parallel.lead import result_shape
        from qnpipe.live.parallel.ring import Header, Op, Ring, dtype_code
        from qnpipe.model.tails import TailKind

        ring = Ring.connect(read_launch(), 60.0, 60.0)
        hidden = int(np.array(mx.distributed.all_sum(mx.array([out.get("hidden_size", 0)]))).item())
        ring.fit(hidden)
        h = mx.zeros((1, 1, hidden), dtype=mx.bfloat16)  # a real checkpoint's activations are bfloat16
        token = mx.zeros((1,), dtype=mx.uint32)
        step = Header(Op.STEP, rows=1, kind=int(TailKind.SAMPLE), dtype=dtype_code(h))
        back = Header(Op.RESULT, rows=1, kind=int(TailKind.SAMPLE), dtype=dtype_code(token))
        t0 = time.perf_counter()
        for _ in range(args.handoffs):
            if ring.rank == 0:
                ring.send(step, h, ring.next)
                ring.recv(ring.prev, lambda hd: result_shape(hd.kind, hd.rows, 1))
            else:
                _, x = ring.recv(ring.prev, lambda hd: (1, hd.rows, hidden))
                last = ring.rank == ring.size - 1
                ring.send(back if last else step, token if last else x, ring.next)
        dt = time.perf_counter() - t0
        out["handoff_us_per_token"] = dt / args.handoffs * 1e6
        # Per token: one frame (a header and the hidden state, padded to a float32 row) on each of
        # the size - 1 hops, one back to rank 0 with the token.
        out["bytes_per_token"] = ring.size * ring.frame_bytes
        out["payload_bytes_per_token"] = (ring.size - 1) * h.nbytes + token.nbytes
    Path(args.out).write_text(json.dumps(out))
    return 0


def run_ranks(model: Path, ranks: int, tmp: Path, extra: list[str], tokens: int, handoffs: int,
              prompt: str | None = None) -> list[dict]:
    hostfile = write_local_hostfile(tmp / f"hosts{ranks}.json", ranks)
    procs = []
    for r in range(ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
        if ranks > 1:
            env.update(MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile))
        cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--ranks", str(ranks),
               "--tokens", str(tokens), "--handoffs", str(handoffs), "--out", str(tmp / f"r{ranks}.{r}.json")]
        if prompt is not None:
            cmd += ["--prompt", prompt]
        for s in extra:
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd, env=env))
    for r, p in enumerate(procs):
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"{ranks} ranks: rank {r} exited {p.returncode}")
    return [json.loads((tmp / f"r{ranks}.{r}.json").read_text()) for r in range(ranks)]


def bench_model(work: Path) -> Path:
    """tools/bench_stream.py's bench model (4-bit, group 64), made once under `work`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_stream", Path(__file__).with_name("bench_stream.py"))
    assert spec is not None and spec.loader is not None
    bench_stream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_stream)
    return bench_stream.make_model(work, "bench", 4, 64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench",
                    help="model directory, or `bench` (default: tools/bench_stream.py's bench model, 16 MoE layers "
                    "x 128 experts, made once under --work) or `tiny` (the tiny model, made and converted here)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-stream"),
                    help="where the bench model is made and kept (shared with tools/bench_stream.py)")
    ap.add_argument("--ranks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-ranks", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--handoffs", type=int, default=200, help="passes around the ring for the hand-off time")
    ap.add_argument("--prompt", help="prompt text (default: token ids 1..16)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="engine override (every rank)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if args.model == "tiny":
            from qnpipe.convert import convert
            from qnpipe.convert.tiny import make_tiny

            model = tmp / "tiny-qn"
            convert(make_tiny(tmp / "tiny", layout="mlx", bits=4, seed=0), model)
        elif args.model == "bench":
            model = bench_model(args.work)
        else:
            model = Path(args.model)
        runs = {n: run_ranks(model, n, tmp, args.set, args.tokens, args.handoffs, args.prompt)
                for n in range(1, args.max_ranks + 1)}
    print(json.dumps({
        "tok_s_by_ranks": {str(n): round(rs[0]["decode_tok_s"], 2) for n, rs in runs.items()},
        "handoff_us_per_token": {str(n): round(rs[0]["handoff_us_per_token"], 1) for n, rs in runs.items() if n > 1},
        "handoff_share_of_token": {str(n): round(rs[0]["handoff_us_per_token"] * 1e-6 * rs[0]["decode_tok_s"], 4)
                                   for n, rs in runs.items() if n > 1},
        "bytes_per_token": {str(n): rs[0]["bytes_per_token"] for n, rs in runs.items() if n > 1},
        "payload_bytes_per_token": {str(n): rs[0]["payload_bytes_per_token"] for n, rs in runs.items() if n > 1},
        "active_after_load_bytes_by_rank": {str(n): [r["active_after_load_bytes"] for r in rs] for n, rs in runs.items()},
        "peak_bytes_by_rank": {str(n): [r["peak_bytes"] for r in rs] for n, rs in runs.items()},
        **({"mtp_tokens_per_round": {str(n): round(rs[0]["mtp_tokens_per_round"], 2) for n, rs in runs.items()}}
           if "mtp_tokens_per_round" in runs[1][0] else {}),
        "model": str(args.model if args.model in ("tiny", "bench") else model), "tokens": args.tokens, "set": args.set,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
