"""Cold expert-record read throughput: qnpipe's reader (C extension and Python fallback) next to fio.

Creates layer files of random bytes (`--size-gib` in total, in `--dir`), then for each record
size and each queue depth reads random experts across the files with direct I/O:

  c        SsdReader(backend="c"): the qnpipe.io._preadx pthread pool, `qd` workers
  c_scatter  the same, each 80B record scattered into its 9 tensors' buffers (one preadv)
  python   SsdReader(backend="python"): os.preadv in a ThreadPoolExecutor, `qd` workers
  fio      fio --ioengine=psync --numjobs=qd --direct=1 --bs=<stride>: qd threads, each with one
           blocking pread in flight -- the same design as ours, so the fair yardstick
  fio_io_uring  fio --ioengine=io_uring --iodepth=qd: one thread, qd async reads in flight (a
           reference: does an io_uring reader promise more on this device?)

Each cell is measured `--repeat` times, interleaved across the readers, and the median is
reported; `<reader>_vs_fio` is the median of paired ratios at that queue depth. Prints a
table on stderr and one JSON line on stdout (GB/s = 1e9 bytes/s; per record size, each
reader's best over the queue depths and its ratio to fio psync's best). Optionally measures
the copy MLX makes when an array is built from a read buffer (`--mlx`). Removes its files
at the end.
Installs nothing: needs fio on PATH (`apt-get install -y fio`, or `brew install fio`).

    python tools/bench_io.py                      # 4 GiB of files next to the repo
    python tools/bench_io.py --dir /mnt/nvme --size-gib 16 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from qnpipe.config import ReadBackend
from qnpipe.io import measure
from qnpipe.io.reader import aligned_len, alloc_aligned
from qnpipe.io.ssd import c_extension_available, nocache_mode

REPO = Path(__file__).resolve().parents[1]
# 80B at 4 bits: 3 x (512 KiB weight + 2 x 32 KiB scales/biases); the tiny test model's
# expert in float32 (3 x 64 x 128 x 4) and at 4 bits (3 x 4608, stride 16 KiB).
DEFAULT_RECORDS = "1769472,98304,13824"
# The 80B record's tensors in store order: per projection weight, scales, biases.
SCATTER_80B = (524288, 32768, 32768) * 3
FIO_ENGINES = ("psync", "io_uring", "libaio")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=None,
                   help="where to create the test files (default: a temp dir next to the repo, same disk)")
    p.add_argument("--size-gib", type=float, default=4.0, help="total size of the test files (default 4)")
    p.add_argument("--files", type=int, default=8, help="number of layer files (default 8)")
    p.add_argument("--records", default=DEFAULT_RECORDS,
                   help=f"record sizes in bytes, comma-separated (default {DEFAULT_RECORDS})")
    p.add_argument("--qd", default="1,4,8,16,32", help="reads in flight (default 1,4,8,16,32)")
    p.add_argument("--seconds", type=float, default=1.5, help="time per measurement (default 1.5)")
    p.add_argument("--repeat", type=int, default=5,
                   help="measurements per cell, interleaved across readers; the median is reported (default 5)")
    p.add_argument("--batch", type=int, default=0,
                   help="requests per read_batch call (default 0: max(32, 4 x qd))")
    p.add_argument("--submitters", type=int, default=2,
                   help="threads calling read_batch at once on the one reader (default 2)")
    p.add_argument("--fio-engines", default="psync,io_uring",
                   help=f"fio engines to run, from {','.join(FIO_ENGINES)} (default psync,io_uring)")
    p.add_argument("--no-python", action="store_true", help="skip the Python fallback")
    p.add_argument("--mlx", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the copy of mx.array(numpy buffer) (default on)")
    p.add_argument("--keep", action="store_true", help="keep the test files")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- test files


def default_dir() -> Path:
    parent = REPO.parent
    same_disk = os.access(parent, os.W_OK) and os.stat(parent).st_dev == os.stat(REPO).st_dev
    return Path(tempfile.mkdtemp(prefix="qnpipe-bench-io-", dir=parent if same_disk else REPO))


def make_files(d: Path, total: int, nfiles: int, unit: int) -> list[Path]:
    return measure.make_files(d, total, nfiles, unit, log)


# ---------------------------------------------------------------------------- measurements


bench_reader = measure.bench_reader  # the package's measurement (qnpipe bench io fits a profile with it)


def bench_fio(engine: str, files: list[Path], record: int, qd: int, seconds: float) -> dict[str, float] | str:
    stride = aligned_len(record)
    cmd = [
        "fio", "--name=bench_io", "--filename=" + ":".join(str(p) for p in files), "--rw=randread",
        f"--bs={stride}", "--direct=1", f"--ioengine={engine}", "--time_based", f"--runtime={max(int(seconds * 1000), 1)}ms",
        "--randrepeat=0", "--norandommap", "--file_service_type=random", "--group_reporting", "--thread",
        "--output-format=json",
    ]
    cmd += [f"--numjobs={qd}", "--iodepth=1"] if engine == "psync" else ["--numjobs=1", f"--iodepth={qd}"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip().splitlines()[-1] if (proc.stderr or proc.stdout) else "failed"
    out = proc.stdout[proc.stdout.index("{"):]  # fio may print notes before the JSON
    read = json.loads(out)["jobs"][0]["read"]
    return {"gbps": read["bw_bytes"] / 1e9, "iops": read["iops"]}


def bench_mlx_copy() -> dict[str, float]:
    """What `mx.array(numpy buffer)` costs: a copy. Big-buffer time and peak memory; per-expert
    time with sources out of cache; and the zero-copy alternative (reading into MLX memory)."""
    import mlx.core as mx

    from qnpipe.io.reader import mlx_aligned_buffer

    out: dict[str, float] = {}
    big = 512 << 20
    src = np.random.default_rng(0).integers(0, 256, big, dtype=np.uint8)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    a = mx.array(src)
    mx.eval(a)
    out["big_512MiB_copy_s"] = time.perf_counter() - t0
    out["big_512MiB_mlx_peak_bytes"] = mx.get_peak_memory()  # the copy, next to the numpy source
    src[0] ^= 1
    out["big_shares_memory"] = float(int(np.asarray(a[:1])[0]) == int(src[0]))
    a = mx.array(src)  # second time: MLX's allocator reuses freed buffers (no page faults)
    mx.eval(a)
    t0 = time.perf_counter()
    a = mx.array(src)
    mx.eval(a)
    out["big_512MiB_copy_warm_s"] = time.perf_counter() - t0
    del a, src

    rec = 1769472
    k = 96  # 170 MB of sources: more than the last-level cache, like freshly DMA'd read buffers
    srcs = [alloc_aligned(rec) for _ in range(k)]
    for s in srcs:
        s[:] = 7
    times_mx, times_np = [], []
    dst = [np.empty(rec, np.uint8) for _ in range(k)]
    for _rep in range(5):
        t0 = time.perf_counter()
        arrs = [mx.array(s) for s in srcs]
        mx.eval(*arrs)
        times_mx.append((time.perf_counter() - t0) / k)
        del arrs
        t0 = time.perf_counter()
        for s, d in zip(srcs, dst, strict=True):
            np.copyto(d, s)
        times_np.append((time.perf_counter() - t0) / k)
    out["expert_1769472_mx_array_copy_us_median"] = float(np.median(times_mx[1:]) * 1e6)
    out["expert_1769472_memcpy_us_median"] = float(np.median(times_np[1:]) * 1e6)
    hot = srcs[0]
    t0 = time.perf_counter()
    for _ in range(200):
        mx.eval(mx.array(hot))
    out["expert_1769472_mx_array_copy_cache_hot_us"] = (time.perf_counter() - t0) / 200 * 1e6
    arr, host = mlx_aligned_buffer(rec)
    host[:] = 3
    out["zero_copy_read_into_mlx_memory_works"] = float(int(np.asarray(arr[:1])[0]) == 3)
    return out


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("fio") is None:
        log("bench_io: fio is not installed; install it with `apt-get install -y fio` (Debian/Ubuntu) "
            "or `brew install fio` (macOS), then run again")
        return 2
    engines = [e.strip() for e in args.fio_engines.split(",") if e.strip()]
    if bad := [e for e in engines if e not in FIO_ENGINES]:
        log(f"bench_io: unknown fio engine(s) {bad}; allowed: {', '.join(FIO_ENGINES)}")
        return 2
    records = [int(x) for x in args.records.split(",")]
    qds = [int(x) for x in args.qd.split(",")]
    backends = ([ReadBackend.C] if c_extension_available() else []) + ([] if args.no_python else [ReadBackend.PYTHON])
    if not c_extension_available():
        log("bench_io: the C extension qnpipe.io._preadx is not built; measuring the Python fallback only")
    total = int(args.size_gib * 2**30)
    unit = int(np.lcm.reduce([aligned_len(r) for r in records]))

    created = args.dir is None
    d = default_dir() if created else args.dir
    if not created:
        d.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix="qnpipe-bench-io-", dir=d))
    try:
        free = shutil.disk_usage(d).free
        if free < total + (1 << 30):
            log(f"bench_io: {d} has {free / 2**30:.1f} GiB free; --size-gib {args.size_gib} needs 1 GiB more")
            return 2
        files = make_files(d, total, args.files, unit)
        rows = []
        for record in records:
            for qd in qds:
                row: dict[str, object] = {"record_nbytes": record, "read_nbytes": aligned_len(record), "qd": qd}
                batch = args.batch or max(32, 4 * qd)
                samples: dict[str, list[float]] = {}
                for rep in range(args.repeat):  # interleaved, so drift on a shared disk hits all alike
                    for be in backends:
                        r = bench_reader(be, files, record, qd, args.seconds, batch, args.submitters,
                                         seed=record + qd + rep)
                        samples.setdefault(be.value, []).append(r["gbps"])
                    if record == sum(SCATTER_80B) and ReadBackend.C in backends:
                        r = bench_reader(ReadBackend.C, files, record, qd, args.seconds, batch, args.submitters,
                                         seed=record + qd + rep + 7, scatter=SCATTER_80B)
                        samples.setdefault("c_scatter", []).append(r["gbps"])
                    for eng in engines:
                        f = bench_fio(eng, files, record, qd, args.seconds)
                        key = "fio" if eng == "psync" else f"fio_{eng}"
                        if isinstance(f, dict):
                            samples.setdefault(key, []).append(f["gbps"])
                        else:
                            row[key + "_error"] = f
                for key, xs in samples.items():
                    row[key] = round(float(np.median(xs)), 3)
                if len(samples.get("fio", ())) == args.repeat:
                    # Paired: each sample against the fio sample taken right after it, then the median.
                    for key in [k for k in samples if not k.startswith("fio")]:
                        ratios = np.array(samples[key]) / np.array(samples["fio"])
                        row[f"{key}_vs_fio"] = round(float(np.median(ratios)), 3)
                rows.append(row)
                log("  ".join(f"{k}={v}" for k, v in row.items()))
        summary = {}
        for record in records:
            rs = [r for r in rows if r["record_nbytes"] == record]
            fio_cols = ["fio" if e == "psync" else f"fio_{e}" for e in engines]
            # The yardstick is fio psync (qd threads, one blocking pread each: our design); other
            # engines are listed for reference.
            s: dict[str, object] = {}
            for c in fio_cols:
                if any(r.get(c) for r in rs):
                    best = max((r for r in rs if r.get(c)), key=lambda r: r[c])
                    s[f"{c}_best_gbps"], s[f"{c}_best_qd"] = best[c], best["qd"]
            fio_best = s.get("fio_best_gbps")
            for key in [be.value for be in backends] + (["c_scatter"] if any("c_scatter" in r for r in rs) else []):
                best = max((r for r in rs if key in r), key=lambda r: r[key])
                s[f"{key}_best_gbps"], s[f"{key}_best_qd"] = best[key], best["qd"]
                s[f"{key}_ratio_to_fio_best"] = round(best[key] / fio_best, 3) if fio_best else None
            summary[str(record)] = s
        result = {
            "tool": "bench_io", "dir": str(d), "size_gib": args.size_gib, "files": args.files,
            "seconds": args.seconds, "repeat": args.repeat, "submitters": args.submitters, "mode": nocache_mode(True).value, "platform": sys.platform,
            "c_extension": c_extension_available(), "rows": rows, "summary": summary,
        }
        if args.mlx:
            try:
                result["mlx_copy"] = bench_mlx_copy()
            except ImportError as exc:
                result["mlx_copy"] = f"skipped: {exc}"
        print(json.dumps(result), flush=True)
        log(format_table(rows, summary))
        return 0
    finally:
        if args.keep:
            log(f"kept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


def format_table(rows: list[dict[str, object]], summary: dict[str, dict[str, object]]) -> str:
    cols = [c for c in ("c", "c_scatter", "python", "fio", "fio_io_uring", "fio_libaio") if any(c in r for r in rows)]
    lines = ["record_nbytes  qd  " + "  ".join(f"{c:>12}" for c in cols) + "   (GB/s)"]
    for r in rows:
        cells = [f"{r[c]:12.3f}" if isinstance(r.get(c), float) else f"{'-':>12}" for c in cols]
        lines.append(f"{r['record_nbytes']:>13} {r['qd']:>3}  " + "  ".join(cells))
    for rec, s in summary.items():
        lines.append(f"{rec}: " + ", ".join(f"{k}={v}" for k, v in s.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
