"""Importers: other tools' routing logs as qnpipe routing logs (docs/trace-format.md, "Imported logs").

    summary = import_log("mixtral-jsonl", Path("routing_raw.jsonl"), Path("raw.qtrace"))
    summary = import_log("vllm-jsonl", "Logs/moe_layer*.jsonl", Path("qwen.qtrace"))  # per-layer files merged

One module per source format; `FORMATS` maps each format's name to its importer,
`(src, progress, budget, options) -> Imported` (the requests, not yet written); `import_log` resolves
the sources (files, folders, globs), imports each, merges per-layer files of one run, and writes
the log. The shared part (reading lines within a byte budget, the known models, merging, writing
the log) is `qnpipe.trace.importers.common`.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from qnpipe.errors import TraceImportError
from qnpipe.trace.format import MAX_EXPERTS
from qnpipe.trace.importers.common import (
    KNOWN_SHAPES,
    MAX_BYTES,
    Budget,
    Imported,
    ImportSummary,
    Options,
    Progress,
    ShapeOverride,
    cut,
    describe,
    known_shape,
    merge,
    write_log,
)
from qnpipe.trace.importers.csv_rows import import_csv, import_csv_files
from qnpipe.trace.importers.flame_pt import import_flame_pt
from qnpipe.trace.importers.mixtral_jsonl import import_mixtral_jsonl
from qnpipe.trace.importers.vllm_jsonl import import_vllm_jsonl

FORMATS: dict[str, Callable[[Path, Progress | None, Budget, Options], Imported]] = {
    "mixtral-jsonl": import_mixtral_jsonl,
    "vllm-jsonl": import_vllm_jsonl,
    "flame-pt": import_flame_pt,
    "csv": import_csv,
}
# The files a folder given as SRC stands for (flame-pt reads its folders itself, recursively).
SUFFIXES = {"mixtral-jsonl": (".jsonl", ".jsonl.gz"), "vllm-jsonl": (".jsonl", ".jsonl.gz"), "csv": (".csv", ".csv.gz")}


def _natural(p: Path) -> list[str | int]:
    """moe_layer8 before moe_layer12."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", str(p))]


def sources(fmt: str, src: str | Path | Sequence[str | Path]) -> list[Path]:
    """The files (or, for flame-pt, folders) `src` names: each a file, a folder of the format's files, or a glob."""
    items = [src] if isinstance(src, str | Path) else list(src)
    if not items:
        raise TraceImportError("no source given")
    out: list[Path] = []
    for x in items:
        p = Path(x)
        if not p.exists() and any(c in str(x) for c in "*?["):
            found = sorted((Path(g) for g in glob.glob(str(x))), key=_natural)
            if not found:
                raise TraceImportError(f"{x}: no file matches")
            out += found
        elif p.is_dir() and fmt in SUFFIXES:
            found = sorted((q for q in p.iterdir() if q.name.endswith(SUFFIXES[fmt]) and not q.is_dir()), key=_natural)
            if not found:
                raise TraceImportError(f"{p}: a directory without {' or '.join(SUFFIXES[fmt])} files")
            out += found
        elif not p.exists():
            raise TraceImportError(f"{p}: no such file or directory")
        else:
            out.append(p)
    if len({q.resolve() for q in out}) != len(out):
        raise TraceImportError(f"{', '.join(map(str, items))}: a file given twice")
    return out


def import_log(fmt: str, src: str | Path | Sequence[str | Path], out: str | Path, *,
               progress: Progress | None = None, max_steps: int | None = None, max_bytes: int = MAX_BYTES,
               experts: int | None = None, batched: bool = False, shape: ShapeOverride | None = None) -> ImportSummary:
    """Import `src` (format `fmt`) as the routing log `out`; TraceImportError names the file and the record.

    `src` is one source, or several (files, folders, globs): the per-layer files of one run,
    merged into one log (`common.merge`: same requests and steps, different layers).
    `max_steps` keeps the log's first steps only (its requests in order), e.g. to replay a long trace quickly.
    `max_bytes` bounds what is read, decompressed, over all of the source's files (and so the memory the
    import holds, a few times that): a larger source is an error naming the file and the limit.
    `experts` (csv only): the model's expert count, else the largest id + 1. `batched`: each forward
    pass of the source is one step of all its tokens (vllm-jsonl, flame-pt), not its requests one after another.
    `shape`: the routing shape over what the source's model id says (every format): a known model by name, or
    experts, top-k and layers, for a model no importer knows or a variant with another shape. A quantized or
    renamed variant of a known id (`Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4`) is known without it.
    """
    if fmt not in FORMATS:
        raise TraceImportError(f"format {fmt!r}: unknown, known: {', '.join(FORMATS)}")
    if max_steps is not None and max_steps < 1:
        raise TraceImportError(f"max_steps={max_steps}: want at least 1")
    if max_bytes < 1:
        raise TraceImportError(f"max_bytes={max_bytes}: want at least 1")
    if experts is not None and fmt != "csv":
        raise TraceImportError(f"experts={experts}: only for csv ({fmt} sources are of a known model)")
    if experts is not None and not 1 <= experts <= MAX_EXPERTS:
        raise TraceImportError(f"experts={experts}: want 1..{MAX_EXPERTS}")
    paths = sources(fmt, src)
    budget, opts = Budget(max_bytes), Options(experts=experts, batched=batched, shape=shape)
    if fmt == "csv":  # one table split in files: rows matched by their step values, not merged step by step
        imp = import_csv_files(paths, progress, budget, opts)
    else:
        imp = merge([FORMATS[fmt](p, progress, budget, opts) for p in paths])
    if max_steps is not None:
        imp = cut(imp, max_steps)
    label = str(src) if isinstance(src, str | Path) else " ".join(map(str, src))
    return write_log(Path(out), imp, fmt=fmt, source=Path(label), batched=batched)


__all__ = ["FORMATS", "KNOWN_SHAPES", "MAX_BYTES", "SUFFIXES", "ImportSummary", "ShapeOverride", "describe",
           "import_log", "known_shape", "sources"]
