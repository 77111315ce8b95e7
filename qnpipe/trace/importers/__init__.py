"""Importers: other tools' routing logs as qnpipe routing logs (docs/trace-format.md, "Imported logs").

    summary = import_log("mixtral-jsonl", Path("routing_raw.jsonl"), Path("raw.qtrace"))

One module per source format; `FORMATS` maps each format's name to its importer,
`(src, progress, budget) -> Imported` (the requests, not yet written); `import_log` writes them. The shared part
(reading lines within a byte budget, the known models, writing the log) is `qnpipe.trace.importers.common`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from qnpipe.errors import TraceImportError
from qnpipe.trace.importers.common import MAX_BYTES, Budget, Imported, ImportSummary, Progress, cut, describe, write_log
from qnpipe.trace.importers.flame_pt import import_flame_pt
from qnpipe.trace.importers.mixtral_jsonl import import_mixtral_jsonl
from qnpipe.trace.importers.vllm_jsonl import import_vllm_jsonl

FORMATS: dict[str, Callable[[Path, Progress | None, Budget], Imported]] = {
    "mixtral-jsonl": import_mixtral_jsonl,
    "vllm-jsonl": import_vllm_jsonl,
    "flame-pt": import_flame_pt,
}


def import_log(fmt: str, src: str | Path, out: str | Path, *, progress: Progress | None = None,
               max_steps: int | None = None, max_bytes: int = MAX_BYTES) -> ImportSummary:
    """Import `src` (format `fmt`) as the routing log `out`; TraceImportError names the file and the record.

    `max_steps` keeps the log's first steps only (its requests in order), e.g. to replay a long trace quickly.
    `max_bytes` bounds what is read, decompressed, over all of the source's files (and so the memory the
    import holds, a few times that): a larger source is an error naming the file and the limit.
    """
    if fmt not in FORMATS:
        raise TraceImportError(f"format {fmt!r}: unknown, known: {', '.join(FORMATS)}")
    src = Path(src)
    if not src.exists():
        raise TraceImportError(f"{src}: no such file or directory")
    if max_steps is not None and max_steps < 1:
        raise TraceImportError(f"max_steps={max_steps}: want at least 1")
    if max_bytes < 1:
        raise TraceImportError(f"max_bytes={max_bytes}: want at least 1")
    imp = FORMATS[fmt](src, progress, Budget(max_bytes))
    if max_steps is not None:
        imp = cut(imp, max_steps)
    return write_log(Path(out), imp, fmt=fmt, source=src)


__all__ = ["FORMATS", "MAX_BYTES", "ImportSummary", "describe", "import_log"]
