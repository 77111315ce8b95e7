"""`qnpipe verify-store`: check every expert record of a store against the crc32 in its index."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from qnpipe.errors import CheckpointError, StoreError
from qnpipe.io.outdir import ByteProgress
from qnpipe.io.store import read_index_sha256
from qnpipe.io.store_check import check_against_model, check_store_sha256, open_layer_file
from qnpipe.io.store_format import StoreIndex
from qnpipe.model.args import config_model_id

__all__ = ["BadRecord", "VerifyReport", "describe", "verify_store"]

CHUNK_BYTES = 64 << 20  # bytes read per pread


class BadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One expert record that failed: where it is and why."""

    layer: int
    expert: int
    file: str
    offset: int
    nbytes: int
    reason: str  # "checksum mismatch" | "missing (file truncated)" | "unreadable: ..."
    crc_expected: int
    crc_actual: int | None = None


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """Result of `verify_store`. `ok` is true when every record of every layer matched."""

    store: str
    model_id: str
    layers: int
    records_checked: int
    bytes_checked: int
    seconds: float
    bytes_per_s: float
    bad: tuple[BadRecord, ...]
    file_errors: tuple[str, ...]  # missing / truncated / oversized layer files

    @property
    def ok(self) -> bool:
        return not self.bad and not self.file_errors


def verify_store(path: str | os.PathLike[str], *, progress: bool = False) -> VerifyReport:
    """Check every record's crc32 in the store of model directory (or experts directory) `path`.

    Bad records and bad files are reported, not raised. Raises StoreError when the index itself
    is missing or invalid or, given a model directory, belongs to another model or disagrees
    with its config.json: the same checks (`store_check`) the loader makes, so a store the
    loader refuses never verifies OK.
    """
    t0 = time.perf_counter()
    p = Path(path)
    if _family_config(p) is not None:
        root, index, got = _family_index(p)
    else:
        root, index, got = _qwen3_next_index(p)
    return _verify_records(root, index, t0, progress)


def _family_config(p: Path) -> dict[str, Any] | None:
    """config.json of a converted model of a family other than qwen3_next (None otherwise)."""
    if not (p / "config.json").is_file():
        return None
    from qnpipe.model.args import read_config

    try:
        config = read_config(p)
    except CheckpointError:
        return None  # the Qwen3-Next path names what is wrong with it
    mt = config.get("model_type")
    return config if isinstance(mt, str) and mt != "qwen3_next" else None


def _family_index(p: Path) -> tuple[Path, StoreIndex, str]:
    """The store of a family model directory, checked against the skeleton of its config (as a loader would)."""
    from qnpipe.model.args import store_sha256
    from qnpipe.model.family.skeleton import skeleton_id
    from qnpipe.model.family.store_spec import converted_skeleton

    try:
        model, _, config = converted_skeleton(p)
        sha256 = store_sha256(config, p / "config.json")
    except CheckpointError as e:
        raise StoreError(str(e)) from None
    root, index, got = read_index_sha256(p, expected_model_id=skeleton_id(config, model))
    check_store_sha256(root / "index.json", got, sha256)
    return root, index, got


def _qwen3_next_index(p: Path) -> tuple[Path, StoreIndex, str]:
    # lexists: a config.json that is a FIFO or a directory is refused by name, not taken for none.
    expected = config_model_id(p) if os.path.lexists(p / "config.json") else None
    config = sha256 = None
    if expected is not None:
        from qnpipe.model.args import read_config, store_sha256

        config = read_config(p)
        try:
            sha256 = store_sha256(config, p / "config.json")
        except CheckpointError as e:
            raise StoreError(str(e)) from None
    root, index, got = read_index_sha256(p, expected_model_id=expected)
    if config is not None:
        from qnpipe.model.args import args_from_dict

        qcfg = config.get("quantization") or config.get("quantization_config")
        check_against_model(index, root / "index.json", args_from_dict(config, str(p / "config.json")),
                            qcfg if isinstance(qcfg, dict) else None)
        check_store_sha256(root / "index.json", got, sha256)
    return root, index, got


def _verify_records(root: Path, index: StoreIndex, t0: float, progress: bool) -> VerifyReport:
    total = sum(lf.num_experts * lf.record_nbytes for lf in index.layers)
    bar = ByteProgress(progress, total, "verifying")
    bad: list[BadRecord] = []
    file_errors: list[str] = []
    checked = nbytes = 0
    try:
        for lf in index.layers:
            fpath = root / lf.file
            bar.describe(f"layer {lf.layer}")

            def record(e: int, reason: str, actual: int | None = None, lf=lf, fpath=fpath) -> BadRecord:
                return BadRecord(layer=lf.layer, expert=e, file=str(fpath), offset=e * lf.stride,
                                 nbytes=lf.record_nbytes, reason=reason, crc_expected=lf.checksums[e],
                                 crc_actual=actual)

            try:
                fd = open_layer_file(root, lf, check_size=False)
            except StoreError as err:
                file_errors.append(f"{err}; layer {lf.layer} unchecked")
                bad += [record(e, "unreadable") for e in range(lf.num_experts)]
                continue
            try:
                size = os.fstat(fd).st_size
                if size != lf.file_nbytes:
                    what = "truncated" if size < lf.file_nbytes else "larger than the index says"
                    file_errors.append(f"{fpath}: {what}: {size} bytes, the index expects {lf.file_nbytes}")
                per = max(1, CHUNK_BYTES // lf.stride)
                for e0 in range(0, lf.num_experts, per):
                    e1 = min(lf.num_experts, e0 + per)
                    buf = np.empty((e1 - e0) * lf.stride, dtype=np.uint8)
                    try:
                        n = os.preadv(fd, [buf.data], e0 * lf.stride)
                    except OSError as err:
                        bad += [record(e, f"unreadable: {err.strerror}") for e in range(e0, e1)]
                        continue
                    for e in range(e0, e1):
                        lo = (e - e0) * lf.stride
                        if lo + lf.record_nbytes > n:
                            bad.append(record(e, "missing (file truncated)"))
                            continue
                        crc = zlib.crc32(buf[lo:lo + lf.record_nbytes].data)
                        checked += 1
                        nbytes += lf.record_nbytes
                        if crc != lf.checksums[e]:
                            bad.append(record(e, "checksum mismatch", crc))
                    bar.advance((e1 - e0) * lf.record_nbytes)
            finally:
                os.close(fd)
    finally:
        bar.stop()
    seconds = time.perf_counter() - t0
    return VerifyReport(store=str(root), model_id=index.model_id, layers=len(index.layers), records_checked=checked,
                        bytes_checked=nbytes, seconds=seconds, bytes_per_s=nbytes / seconds if seconds > 0 else 0.0,
                        bad=tuple(bad), file_errors=tuple(file_errors))


def describe(report: VerifyReport, limit: int = 20) -> str:
    """Human-readable summary: counts, then the bad records by layer, expert, file and offset."""
    lines = [f"{report.store}: {report.records_checked} records ({report.bytes_checked / 2**20:.1f} MiB) in "
             f"{report.layers} layers checked in {report.seconds:.2f}s "
             f"({report.bytes_per_s / 2**20:.0f} MiB/s)"]
    lines += [f"bad file: {m}" for m in report.file_errors]
    for b in report.bad[:limit]:
        got = f", crc32 {b.crc_actual:08x}" if b.crc_actual is not None else ""
        lines.append(f"bad record: layer {b.layer} expert {b.expert}: {b.reason} ({b.file}, offset {b.offset}, "
                     f"{b.nbytes} bytes; index crc32 {b.crc_expected:08x}{got})")
    if len(report.bad) > limit:
        lines.append(f"... and {len(report.bad) - limit} more bad records (--json lists all)")
    lines.append("OK: every record matches its checksum" if report.ok else
                 f"FAILED: {len(report.bad)} bad records, {len(report.file_errors)} bad files")
    return "\n".join(lines)
