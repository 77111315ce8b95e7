"""What a model directory holds, named cheaply enough for every start of a ring.

The ranks of a ring compare it before anything loads (qnpipe.live.parallel.join): the same
config.json is not the same model (two trainings of one shape, a fine-tune, another model's
experts), and ranks that differ would mix their outputs with exit 0. Each part is a sha256:

- `config`: config.json's bytes;
- `weights`: the weight files' bytes (`model*.safetensors`), as crc32s of 16 MiB pieces read on
  several threads. In a qnpipe directory these hold no expert (about 3 GB for the 80B at 4 bits,
  one read at start-up); in a checkpoint not converted by qnpipe, whose experts sit in these
  files, each expert tensor counts by its first and last 64 KiB only, as reading them whole
  would cost the whole model at every start (`qnpipe convert` it for an exact check);
- `experts`: the expert store's `index.json` bytes, which hold every record's crc32: the records
  themselves (40 GB for the 80B) are never read;
- `mtp`: `mtp.safetensors` whole, when the MTP head is used.

These are the bytes qnpipe.model.snapshots.engine_fingerprint names from memory, read from disk:
each rank holds only its own layers.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs

from qnpipe.errors import CheckpointError
from qnpipe.io.files import CONFIG_CAP, open_regular, read_capped
from qnpipe.model.checkpoint import TensorInfo, is_qnpipe_dir, read_header, weight_files

_PIECE = 16 << 20  # bytes per crc32 call: several threads, 128 MiB in flight at most
SAMPLE = 64 << 10  # bytes at each end of an expert tensor inside a weight file


@attrs.frozen
class ModelIdentity:
    config: str
    weights: str
    experts: str  # "" without an expert store (the experts are in the weight files)
    mtp: str  # "" when the MTP head is not used

    def parts(self) -> list[tuple[str, str]]:
        """(what, sha256) for messages that name what differs."""
        return [("config.json", self.config), ("weights (model*.safetensors)", self.weights),
                ("expert store (experts/index.json)", self.experts), ("MTP head (mtp.safetensors)", self.mtp)]


def model_identity(model_dir: Path, expert_dir: Path | None = None, mtp_file: Path | None = None) -> ModelIdentity:
    """The identity of `model_dir` with its store in `expert_dir` (None: `model_dir/experts`) and, when the
    MTP head is used, `mtp_file`. CheckpointError or StoreError naming a file that cannot be read."""
    import json

    from qnpipe.io.store import read_index_sha256

    raw = read_capped(model_dir / "config.json", CONFIG_CAP, error=CheckpointError)
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):
        raise CheckpointError(f"{model_dir / 'config.json'}: not valid JSON") from None
    store = isinstance(config, dict) and is_qnpipe_dir(model_dir, config)
    h = hashlib.sha256()
    for f in weight_files(model_dir):
        h.update(f"{f.name}|{_weights_digest(f, sample_experts=not store)}|".encode())
    experts = read_index_sha256(expert_dir or model_dir)[2] if store else ""
    mtp = _digest(mtp_file, None) if mtp_file is not None and os.path.lexists(mtp_file) else ""
    return ModelIdentity(hashlib.sha256(raw).hexdigest(), h.hexdigest(), experts, mtp)


def _is_expert(name: str) -> bool:
    return ".mlp.switch_mlp." in name or ".mlp.experts." in name


def _weights_digest(path: Path, *, sample_experts: bool) -> str:
    if not sample_experts:
        return _digest(path, None)
    infos = read_header(path)
    if not any(_is_expert(n) for n in infos):
        return _digest(path, None)
    ranges = [(0, min((i.offset for i in infos.values()), default=0))]  # the header
    for name, info in sorted(infos.items(), key=lambda kv: kv[1].offset):
        ranges += _sampled(info) if _is_expert(name) else [(info.offset, info.offset + info.nbytes)]
    return _digest(path, ranges)


def _sampled(info: TensorInfo) -> list[tuple[int, int]]:
    lo, hi = info.offset, info.offset + info.nbytes
    if hi - lo <= 2 * SAMPLE:
        return [(lo, hi)]
    return [(lo, lo + SAMPLE), (hi - SAMPLE, hi)]


def _digest(path: Path, ranges: list[tuple[int, int]] | None) -> str:
    """sha256 of the crc32s of `path`'s bytes in `ranges` (None: the whole file), in pieces on several threads."""
    fd, st = open_regular(path, error=CheckpointError)  # a FIFO or a device: refused, never read
    try:
        spans = ranges if ranges is not None else [(0, st.st_size)]
        pieces = [(off, min(_PIECE, hi - off)) for lo, hi in spans for off in range(lo, hi, _PIECE)]

        def crc(piece: tuple[int, int]) -> int:
            off, n = piece
            data = os.pread(fd, n, off)
            if len(data) != n:
                raise CheckpointError(f"{path}: changed while it was read (short read at offset {off})")
            return zlib.crc32(data)

        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, len(pieces)))) as pool:
            crcs = list(pool.map(crc, pieces))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    h = hashlib.sha256(f"{st.st_size}|".encode())
    for (off, n), c in zip(pieces, crcs, strict=True):
        h.update(f"{off}:{n}:{c:08x}|".encode())
    return h.hexdigest()
