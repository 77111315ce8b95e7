"""Routing logs: the on-disk format, and the tools that read, summarise, draw and import them.

`format` is the log itself (docs/trace-format.md: a header, then msgspec frames of routes and
pipeline events) with `TraceWriter` and `read`; `stats` summarises a log's routing, `timeline`
and `plot` draw its events per lane, `importers` turns other tools' routing logs into this
format. Nothing here imports MLX or the model (tests/test_imports.py): the tools run where no
model is, and `qnpipe replay` reads logs without loading model code.
"""

from __future__ import annotations

from qnpipe.trace.format import (
    MAGIC,
    MAX_EXPERTS,
    MAX_FRAME,
    MAX_HIDDEN,
    MAX_LAYERS,
    SCHEMA_VERSION,
    TRACE_CAP,
    Candidates,
    Evicted,
    Footer,
    Header,
    ModelShape,
    PrefetchHint,
    ReadStarted,
    RecallSample,
    Record,
    RequestStart,
    Route,
    SpecRound,
    Stalled,
    TraceWriter,
    UnionSize,
    canonical,
    check_header,
    check_log_paths,
    check_output_path,
    iter_records,
    read,
    read_all,
    route_record,
)
from qnpipe.trace.importers import FORMATS, ImportSummary, import_log
from qnpipe.trace.plot import draw
from qnpipe.trace.stats import CrossLayerStats, LayerStats, TraceStats, trace_stats
from qnpipe.trace.timeline import Compute, Read, Stall, Timeline

__all__ = [
    "MAGIC", "MAX_EXPERTS", "MAX_FRAME", "MAX_HIDDEN", "MAX_LAYERS", "SCHEMA_VERSION", "TRACE_CAP",
    "Candidates", "Evicted", "RecallSample", "SpecRound", "UnionSize", "Footer", "Header", "PrefetchHint",
    "ModelShape", "ReadStarted", "Record", "RequestStart", "Route", "Stalled", "TraceWriter", "canonical",
    "check_header", "check_log_paths", "check_output_path", "iter_records", "read", "read_all", "route_record",
    # `stats.describe`/`to_json` and `timeline.timeline` stay in their modules: the names would clash
    # (with replay's) or shadow the submodule.
    "FORMATS", "ImportSummary", "import_log", "draw", "CrossLayerStats", "LayerStats", "TraceStats", "trace_stats",
    "Compute", "Read", "Stall", "Timeline",
]
