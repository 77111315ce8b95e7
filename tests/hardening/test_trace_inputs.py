"""Logs the csv importer accepts, and logs at the header's bounds, through the readers (issue 34, item 9).

One row per shape a new user's tool writes (a BOM, CRLF, quoted fields, negative, out-of-order or
far-apart steps, layer 65535, thousands of layers, top-k = the expert count, one step), and per
log at the header's maximum counts: `trace stats` takes each (exit 0, no traceback); rows the
importer must refuse name the file, the line and the value; `-o .` is a directory, named.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.trace.format import SCHEMA_VERSION, Header, ModelShape, Route, TraceWriter
from qnpipe.trace.importers import import_log
from tests.cli_harness import Case, check_table, run_in_process

HEAD = "step,layer,expert\n"
CSV = {
    "bom": "\ufeff" + HEAD + "0,0,1\n0,0,2\n1,0,3\n1,0,1\n",
    "crlf": (HEAD + "0,0,1\n0,0,2\n1,0,3\n1,0,1\n").replace("\n", "\r\n"),
    "quoted": '"step","layer","expert"\n"0","0","1"\n" 0 ","0","2"\n"1","0","3"\n"1","0","1"\n',
    "negative_steps": HEAD + "-5,0,1\n-5,0,2\n-3,0,3\n-3,0,1\n",
    "out_of_order_steps": HEAD + "9,0,1\n9,0,2\n1,0,3\n1,0,1\n5,0,0\n5,0,3\n",
    "step_gap_2_40": HEAD + f"0,0,1\n0,0,2\n{1 << 40},0,3\n{1 << 40},0,1\n",
    "layer_65535": HEAD + "0,65535,1\n0,65535,2\n1,65535,3\n1,65535,1\n",
    "layers_3000": HEAD + "".join(f"{s},{x},{(x + s) % 4}\n{s},{x},{(x + s + 1) % 4}\n"
                                  for s in range(2) for x in range(3000)),
    "topk_is_experts": HEAD + "0,0,0\n0,0,1\n1,0,1\n1,0,0\n",
    "one_step": HEAD + "0,0,1\n0,0,2\n0,1,0\n0,1,3\n",
}
# (csv text, extra import args, the value the refusal names)
REFUSED = {
    "topk_over_experts": (HEAD + "0,0,0\n0,0,1\n0,0,2\n", ("--experts", "2"), "line 4: expert 2: outside 0..1"),
    "layer_65536": (HEAD + "0,65536,1\n", (), "line 2: layer 65536: outside 0..65535"),
    "step_over_2_40": (HEAD + f"{(1 << 40) + 1},0,1\n", (), f"line 2: step {(1 << 40) + 1}: outside"),
    "step_not_int": (HEAD + "1.5,0,1\n", (), "line 2: step '1.5': not an integer"),
}
# logs at the header's bounds (format.MAX_LAYERS, MAX_EXPERTS): (shape, routes as (step, layer, ids))
BOUNDS = {
    "max_layers": (ModelShape(num_layers=1 << 16, moe_layers=tuple(range(1 << 16)), num_experts=8, top_k=2,
                              hidden_size=0), [(1, 0, (0, 1)), (2, (1 << 16) - 1, (1, 2))]),
    "max_experts": (ModelShape(num_layers=1, moe_layers=(0,), num_experts=1 << 12, top_k=2, hidden_size=0),
                    [(1, 0, (0, 4095)), (2, 0, (1, 4095))]),
    "max_top_k": (ModelShape(num_layers=1, moe_layers=(0,), num_experts=1 << 12, top_k=1 << 12, hidden_size=0),
                  [(1, 0, tuple(range(4096))), (2, 0, tuple(range(4096)))]),
    "max_all": (ModelShape(num_layers=1 << 16, moe_layers=tuple(range(1 << 16)), num_experts=1 << 12, top_k=8,
                           hidden_size=1 << 20), [(1, 0, tuple(range(8))), (2, (1 << 16) - 1, tuple(range(8)))]),
}


def _bound_log(path: Path, shape: ModelShape, routes: list[tuple[int, int, tuple[int, ...]]]) -> Path:
    w = TraceWriter(path, Header(schema_version=SCHEMA_VERSION, fingerprint="test", model=shape, clock_start_t=0.0,
                                 wall_start_unix_s=0.0, contents="routes"))
    for step, layer, ids in routes:
        w.write(Route(t=0.0, seq=w.records, step=step, layer=layer, top_k=shape.top_k, experts=ids))
    w.close(0, 0.0)
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("trace-inputs")
    out = {}
    for name, text in CSV.items():
        src = d / f"{name}.csv"
        src.write_bytes(text.encode())
        import_log("csv", src, d / f"{name}.qtrace")
        out[name] = d / f"{name}.qtrace"
    for name, (shape, routes) in BOUNDS.items():
        out[name] = _bound_log(d / f"{name}.qtrace", shape, routes)
    for name, (text, _, _) in REFUSED.items():
        (d / f"{name}.csv").write_bytes(text.encode())
    return out


@pytest.mark.slow
def test_trace_stats_takes_every_log_the_importer_accepts(logs: dict[str, Path]) -> None:
    check_table([Case(f"stats {name} {json}", ("trace", "stats", log, *json), 0, (log.name,) if not json else ("reuse_counts",),
                      in_process=True)
                 for name, log in logs.items() for json in ((), ("--json",))])


def test_the_importer_refuses_naming_the_line_and_value(logs: dict[str, Path]) -> None:
    d = next(iter(logs.values())).parent
    check_table([Case(f"import {name}", ("trace", "import", "csv", d / f"{name}.csv", *extra, "-o", d / f"{name}.x.qtrace"),
                      2, (f"{name}.csv", needle), clean=(d,), in_process=True)
                 for name, (_, extra, needle) in REFUSED.items()])


def test_an_output_that_is_a_directory_is_named(logs: dict[str, Path], tmp_path: Path) -> None:
    log = logs["one_step"]
    check_table([
        Case("merge -o .", ("trace", "merge", log, log, "-o", "."), 2, ("is a directory",), in_process=True),
        Case("import -o .", ("trace", "import", "csv", log.with_suffix(".csv"), "-o", "."), 2, ("is a directory",),
             in_process=True),
    ], cwd=tmp_path)


def test_mrc_plot_of_one_capacity_warns_of_nothing(logs: dict[str, Path], tmp_path: Path) -> None:
    r = run_in_process(("replay", logs["topk_is_experts"], "--mrc", "--csv", tmp_path / "m.csv",
                        "--plot", tmp_path / "m.png"))
    assert r.returncode == 0 and b"Warning" not in r.stderr, r.stderr.decode()[-800:]
