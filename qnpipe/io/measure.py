"""Cold random-read measurements through `SsdReader`, and the `DeviceProfile` fitted to them.

    files = make_files(d, total=1 << 30, nfiles=8, unit=stride)
    sample = bench_reader(ReadBackend.C, files, record=98304, qd=4, seconds=1.0, batch=32, submitters=2, seed=1)
    measured = measure_profile(d, records=(13824, 98304, 1769472), qds=(1, 2, 4, 8, 16), seconds=0.5)
    save_profile("qnpipe-device.json", measured)  # qnpipe.io.device_file

The fit, on the model `SimSSD` serves (`service_s(n) = latency + per_mb * MB + n / bandwidth`,
at most `queue_depth` reads in service at once, so `min(qd, queue_depth) / service_s(n)`
reads per second with `qd` waiting): for each whole `queue_depth` up to the deepest qd
measured, every sample implies a service time `min(qd, queue_depth) / reads_per_s`; a
least-squares line `latency_s + slope * n` through them (relative to each, so small reads
count as much as large ones) gives the latency and slope; the depth whose profile has the
smallest rms log error over all samples wins. `bandwidth_bytes_per_s` is the best aggregate
rate measured (record bytes per second, as `pool.bytes_read` counts) and `per_mb_latency_s`
the rest of the slope (`slope - 1 / bandwidth`, per MB). The model has no aggregate cap, so a
device whose large reads saturate at a lower depth than its small ones fits with a residual:
the profile file keeps both residuals and every sample.
tools/bench_io.py and `qnpipe bench io` use these functions.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qnpipe.config import ReadBackend
from qnpipe.io.device_file import MeasuredProfile, ReadSample, load_profile, save_profile
from qnpipe.io.reader import ReadRequest, aligned_len, alloc_aligned
from qnpipe.io.simssd import DeviceProfile
from qnpipe.io.ssd import SsdReader, c_extension_available, choose_backend, nocache_mode

Log = Callable[[str], None]


def _noop(msg: str) -> None:
    del msg


def make_files(d: Path, total: int, nfiles: int, unit: int, log: Log = _noop) -> list[Path]:
    """`nfiles` files of random bytes, `total` bytes in all (each a multiple of `unit`), fsynced
    and dropped from the page cache."""
    per = max(total // nfiles // unit, 1) * unit
    chunk = 64 << 20
    rng = np.random.default_rng(1234)
    paths = []
    t0 = time.perf_counter()
    for i in range(nfiles):
        path = d / f"layer_{i:03d}.bin"
        with open(path, "wb") as f:
            left = per
            while left:
                n = min(chunk, left)
                f.write(rng.bytes(n))
                left -= n
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        paths.append(path)
    log(f"wrote {nfiles} files x {per / 2**30:.2f} GiB in {d} ({time.perf_counter() - t0:.1f} s)")
    return paths


def run_submitters(n: int, seconds: float, make_batch: Callable[[int], Callable[[], None]]) -> float:
    """`n` threads that start together, each calling its `make_batch(k)()` back to back for
    `seconds`, at least once (as the read scheduler's submitter would, so the reader's workers never wait
    while the next batch is built); returns the wall seconds they ran. `make_batch` runs
    before the clock starts (buffers are allocated outside the timing)."""
    batches = [make_batch(k) for k in range(n)]
    go = threading.Event()
    t0 = 0.0

    def loop(k: int) -> None:
        go.wait()
        while True:  # at least one batch each, however late a loaded machine schedules the thread
            batches[k]()
            if time.perf_counter() - t0 >= seconds:
                break

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def bench_reader(backend: ReadBackend, files: list[Path], record: int, qd: int, seconds: float, batch: int,
                 submitters: int, seed: int, scatter: tuple[int, ...] = ()) -> dict[str, float]:
    """`submitters` threads call read_batch back to back on one reader (as the read scheduler's
    worker threads would), so the `qd` workers do not wait while the next batch is built.
    Every batch draws fresh random (file, expert) pairs, uniform with replacement like fio's
    randread: cycling a small prebuilt set would be re-reading a few hundred MB that a host
    or device cache may hold. `scatter`: tensor sizes; each record then lands in separate
    per-tensor buffers (one preadv with len(scatter) iovecs), as into the pool's slot arrays.
    Returns `gbps` (aligned read bytes, 1e9/s), `iops`, and `record_bps` (record bytes/s)."""
    stride = aligned_len(record)
    per_file = os.path.getsize(files[0]) // stride
    paths = [str(p) for p in files]

    def make_batch(k: int) -> Callable[[], None]:
        rng = np.random.default_rng(seed * 1000 + k)
        if scatter:
            bufs: list[Any] = [tuple(alloc_aligned(n) for n in scatter) for _ in range(batch)]
        else:
            bufs = [alloc_aligned(record) for _ in range(batch)]

        def one() -> None:
            fs = rng.integers(0, len(paths), batch).tolist()
            es = rng.integers(0, per_file, batch).tolist()
            reader.read_batch([
                ReadRequest(path=paths[f], offset=e * stride, nbytes=record, buf=b, layer=f, expert=e)
                for f, e, b in zip(fs, es, bufs, strict=True)
            ])
            counts[k] += batch
        return one

    counts = [0] * submitters
    with SsdReader(workers=qd, backend=backend) as reader:
        warm = alloc_aligned(record)
        reader.read_batch([ReadRequest(path=p, offset=0, nbytes=record, buf=warm) for p in paths])  # open files
        dt = run_submitters(submitters, seconds, make_batch)
        stats = reader.statistics()
    assert stats.bounced_reads == 0 and stats.direct_fallbacks == 0, stats
    reads = sum(counts)
    return {"gbps": reads * stride / dt / 1e9, "iops": reads / dt, "record_bps": reads * record / dt}


# ---------------------------------------------------------------------------- the fit


def fit_profile(samples: Sequence[ReadSample]) -> tuple[DeviceProfile, float, float]:
    """The `DeviceProfile` of `samples` (see the module doc) and its two residuals: the rms of
    the qd-1 read times around the fitted line (s), and the rms of log(measured / modelled
    reads per second) over every sample.

    ValueError when the samples cannot determine it: two record sizes and qd 1 are needed.
    """
    good = [s for s in samples if s.reads_per_s > 0]
    sizes = sorted({s.record_nbytes for s in good})
    if len(sizes) < 2 or not any(s.qd == 1 for s in good):
        raise ValueError(f"{len(sizes)} record size(s), qd {sorted({s.qd for s in good})}: the fit needs at least "
                         "2 record sizes (--records) and qd 1 (--qd)")
    bw_agg = max(s.bytes_per_s for s in good)
    best: tuple[float, DeviceProfile] | None = None
    for qd in range(1, max(s.qd for s in good) + 1):
        # Each sample implies a service time of min(qd, QD) / rate; fit latency + slope * n to
        # them relative to their size (small reads count as much as large ones).
        n = np.array([s.record_nbytes for s in good], dtype=np.float64)
        svc = np.array([min(s.qd, qd) / s.reads_per_s for s in good])
        w = 1.0 / svc
        (lat, slope), *_ = np.linalg.lstsq(np.stack([w, w * n], axis=1), np.ones_like(svc), rcond=None)
        profile = _profile(max(float(lat), 0.0), max(float(slope), 1e-15), bw_agg, qd)
        err = _rate_error(profile, good)
        if best is None or err < best[0] - 1e-12:
            best = (err, profile)
    assert best is not None
    err, profile = best
    alone = [s for s in good if s.qd == 1]
    resid_t = float(np.sqrt(np.mean([(profile.service_s(s.record_nbytes) - 1.0 / s.reads_per_s) ** 2
                                     for s in alone])))
    return profile.check(), resid_t, err


def _profile(latency_s: float, slope_s_per_byte: float, bw_agg: float, queue_depth: int) -> DeviceProfile:
    """`bandwidth` is the best aggregate rate measured, the rest of the slope is per-MB latency
    (when one read alone streams faster than the aggregate, its own rate is the bandwidth)."""
    if slope_s_per_byte >= 1.0 / bw_agg:
        return DeviceProfile(bandwidth_bytes_per_s=bw_agg, latency_s=latency_s,
                             per_mb_latency_s=(slope_s_per_byte - 1.0 / bw_agg) * 1e6, queue_depth=queue_depth)
    return DeviceProfile(bandwidth_bytes_per_s=1.0 / slope_s_per_byte, latency_s=latency_s, queue_depth=queue_depth)


def modelled_reads_per_s(profile: DeviceProfile, record_nbytes: int, qd: int) -> float:
    """Reads per second the `SimSSD` of `profile` serves with `qd` reads always waiting."""
    return min(qd, profile.queue_depth) / profile.service_s(record_nbytes)


def _rate_error(profile: DeviceProfile, samples: Sequence[ReadSample]) -> float:
    errs = [math.log(s.reads_per_s / modelled_reads_per_s(profile, s.record_nbytes, s.qd))
            for s in samples if s.reads_per_s > 0]
    return float(np.sqrt(np.mean(np.square(errs)))) if errs else 0.0


# ---------------------------------------------------------------------------- measuring


def measure_profile(d: Path, *, records: Sequence[int], qds: Sequence[int], seconds: float, size_bytes: int,
                    nfiles: int = 8, backend: ReadBackend = ReadBackend.AUTO, submitters: int = 2,
                    log: Log = _noop) -> MeasuredProfile:
    """Write test files in a temp directory under `d`, measure every (record, qd) cell, remove the files, fit."""
    if 1 not in qds:
        raise ValueError(f"qd {list(qds)}: the fit needs qd 1 (one read alone)")
    unit = int(np.lcm.reduce([aligned_len(r) for r in records]))
    tmp = Path(tempfile.mkdtemp(prefix="qnpipe-measure-", dir=d))
    samples = []
    try:
        files = make_files(tmp, size_bytes, nfiles, unit, log)
        for record in records:
            for qd in qds:
                r = bench_reader(backend, files, record, qd, seconds, max(32, 4 * qd), submitters,
                                 seed=record + qd)
                samples.append(ReadSample(record_nbytes=record, qd=qd, reads_per_s=r["iops"],
                                          bytes_per_s=r["record_bps"]))
                log(f"record {record} B, qd {qd}: {r['iops']:.0f} reads/s, {r['record_bps'] / 1e9:.3f} GB/s")
    finally:
        for p in tmp.glob("*"):
            p.unlink()
        tmp.rmdir()
    profile, resid_t, resid_rate = fit_profile(samples)
    used = choose_backend(backend, hooked=False, c_available=c_extension_available())
    return MeasuredProfile(profile=profile, latency_fit_residual_s=resid_t, rate_fit_residual=resid_rate,
                           backend=used.value, mode=nocache_mode(True).value, samples=samples)


# The first measurement, made when the planner needs this machine's profile and none is saved: small (~2 s:
# 128 MiB of test files, 4 record sizes x 3 depths x 0.1 s); `qnpipe bench io` measures more, and replaces it.
FIRST_MEASURE: dict[str, Any] = {"records": (13824, 98304, 368640, 1769472), "qds": (1, 4, 16), "seconds": 0.1,
                                 "size_bytes": 128 << 20}


def measured_once(path: Path, *, measure: Callable[..., MeasuredProfile] | None = None,
                  log: Log = _noop) -> tuple[MeasuredProfile, str]:
    """The measured profile saved at `path`, measured first (FIRST_MEASURE, in `path`'s directory) when there is
    none; and a few words on where it came from. A directory that cannot be written: measured in a temporary
    one and not kept (said). `measure`: what measures (tests give a fake; default measure_profile)."""
    if path.exists():
        return load_profile(path), f"measured, {path}"
    measure = measure or measure_profile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        measured = measure(path.parent, **FIRST_MEASURE, log=log)
        save_profile(path, measured)
        return measured, f"measured now and kept at {path}; `qnpipe bench io` measures more"
    except OSError as e:
        with tempfile.TemporaryDirectory(prefix="qnpipe-measure-") as d:
            measured = measure(Path(d), **FIRST_MEASURE, log=log)
        return measured, f"measured now, not kept ({e})"


__all__ = ["FIRST_MEASURE", "bench_reader", "fit_profile", "make_files", "measure_profile", "measured_once", "modelled_reads_per_s", "run_submitters"]
