"""float32 matmul time on the fast BLAS: OpenBLAS at 1 and 2 threads, and qnpipe's batch-invariant kernel.

All three run in this process (compute.cpu_blas=auto), interleaved shape by shape, and each
figure is the best of `--reps` timed products, so a busy shared machine inflates them least.
Shapes are x @ W.T of a 1024 x 1024 linear layer at 1 row (decode), 4 rows (an MTP verify at
K = 3) and 256 rows (a prefill chunk). Prints one JSON line: `ms` {setting: {rows: best ms}},
`threads_2_over_1` {rows: ms at 2 threads / ms at 1} (the measurement behind the BLAS thread
count) and `exact_over_openblas` {rows: kernel ms / best OpenBLAS ms}.

    python tools/bench_blas.py --reps 30
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 256])
    args = ap.parse_args()

    from qnpipe.compute import blas
    from qnpipe.config import ComputeCfg

    info = blas.apply(ComputeCfg(cpu_blas="auto", batch_invariant=False))  # before MLX is imported
    if info.kind == blas.BUNDLED:
        print(f"needs the fast BLAS: {info.describe()}", file=sys.stderr)
        return 1
    import mlx.core as mx

    set_threads = ctypes.CDLL(info.library).scipy_openblas_set_num_threads
    set_threads.argtypes = [ctypes.c_int]
    w = mx.random.normal((1024, 1024))
    settings = {"openblas_1_thread": (1, False), "openblas_2_threads": (2, False), "exact_kernel": (1, True)}
    best: dict[str, dict[int, float]] = {s: {} for s in settings}
    for rows in args.rows:
        x = mx.random.normal((rows, 1024))
        mx.eval(x, w)
        for _ in range(args.reps):
            for s, (threads, exact) in settings.items():
                set_threads(threads)
                blas.apply(ComputeCfg(cpu_blas="auto", batch_invariant=exact))
                t0 = time.perf_counter()
                mx.eval(x @ w.T)
                dt = (time.perf_counter() - t0) * 1e3
                best[s][rows] = min(best[s].get(rows, dt), dt)
    set_threads(info.threads)
    print(json.dumps({
        "bench": "blas", "reps": args.reps, "blas": info.version,
        "ms": {s: {str(r): round(v, 4) for r, v in b.items()} for s, b in best.items()},
        "threads_2_over_1": {str(r): round(best["openblas_2_threads"][r] / best["openblas_1_thread"][r], 3)
                             for r in args.rows},
        "exact_over_openblas": {str(r): round(best["exact_kernel"][r] / min(best["openblas_1_thread"][r],
                                                                             best["openblas_2_threads"][r]), 3)
                                for r in args.rows},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
