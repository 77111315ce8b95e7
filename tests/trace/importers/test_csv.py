"""The generic CSV importer: `step,layer,expert[,score]`, its inferred shape, and bad rows named by file and line."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from real_traces import MARIO

from qnpipe import trace
from qnpipe.cli import main
from qnpipe.errors import TraceImportError
from qnpipe.replay import load_log
from qnpipe.trace.importers import import_log


def _csv(tmp_path: Path, text: str, name: str = "r.csv") -> Path:
    tmp_path.mkdir(exist_ok=True)
    p = tmp_path / name
    p.write_text(text)
    return p


def test_rows_become_one_token_top_k_routes_in_step_then_layer_order(tmp_path: Path) -> None:
    # out of order on purpose: steps ordered by value (0 and 7 become 1 and 2), a group's rows kept in file order
    src = _csv(tmp_path, "layer,step,expert,score\n"
                         "1,7,3,0.5\n"
                         "0,0,5,0.6\n"
                         "0,0,2,0.4\n"
                         "1,7,0,0.5\n"
                         "\n"
                         "1,0,1,0.7\n"
                         "1,0,4,0.3\n")
    s = import_log("csv", src, tmp_path / "r.qtrace")
    header, records = trace.read(tmp_path / "r.qtrace")
    routes = [r for r in records if isinstance(r, trace.Route)]
    assert header.model == trace.ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=6, top_k=2, hidden_size=0)
    assert [(r.step, r.layer, r.experts, r.weights) for r in routes] == [
        (1, 0, (5, 2), (0.6, 0.4)), (1, 1, (1, 4), (0.7, 0.3)), (2, 1, (3, 0), (0.5, 0.5))]
    assert (s.requests, s.steps, s.token_routes, s.skipped) == (1, 2, 3, {})
    assert load_log(tmp_path / "r.qtrace").shape == header.model  # replay reads it


def test_experts_given_and_no_score_column(tmp_path: Path) -> None:
    src = _csv(tmp_path, '"step","expert","layer"\n1,3,4\n2,0,4\n')
    import_log("csv", src, tmp_path / "r.qtrace", experts=64)
    header, records = trace.read(tmp_path / "r.qtrace")
    assert header.model is not None and (header.model.num_experts, header.model.top_k) == (64, 1)
    assert header.model.moe_layers == (4,) and header.model.num_layers == 5
    assert [r.weights for r in records if isinstance(r, trace.Route)] == [(), ()]
    with pytest.raises(TraceImportError, match=r"r.csv: line 2: expert 3: outside 0..1 \(--experts\)"):
        import_log("csv", src, tmp_path / "r.qtrace", experts=2)
    with pytest.raises(TraceImportError, match=r"experts=8: only for csv"):
        import_log("vllm-jsonl", src, tmp_path / "r.qtrace", experts=8)


@pytest.mark.parametrize(("text", "why"), [
    ("", r"r.csv: empty: no header line"),
    ("1,0,5\n", r"r.csv: line 1: column '1': unknown; the header names step, layer, expert"),
    ("step,layer\n1,0\n", r"r.csv: line 1: no expert column"),
    ("step,layer,expert,expert\n", r"r.csv: line 1: a column named twice"),
    ("step,layer,expert\n", r"r.csv: no rows after the header"),
    ("step,layer,expert\n1,0,5\n1,0\n", r"r.csv: line 3: 2 fields, the header has 3"),
    ("step,layer,expert\n1,0,5\n1,x,6\n", r"r.csv: line 3: layer 'x': not an integer"),
    ("step,layer,expert\n1,0,-1\n", r"r.csv: line 2: expert -1: outside 0..4095"),
    ("step,layer,expert\n1,-2,1\n", r"r.csv: line 2: layer -2: outside"),
    ("step,layer,expert,score\n1,0,5,high\n", r"r.csv: line 2: score 'high': not a number"),
    ("step,layer,expert,score\n1,0,5,nan\n", r"r.csv: line 2: score nan: not finite"),
    ("step,layer,expert\n1,0,5\n1,0,6\n2,0,5\n2,0,6\n2,0,7\n",
     r"r.csv: line 4: \(step 2, layer 0\) has 3 experts, \(step 1, layer 0\) at line 2 has 2: a log has one top-k"),
    ("step,layer,expert\n1,0,5\n1,0,6\n1,1,2\n1,1,2\n",
     r"r.csv: line 5: \(step 1, layer 1\): expert ids \[2, 2\]: an expert chosen twice"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(TraceImportError, match=why):
        import_log("csv", _csv(tmp_path, text), tmp_path / "out.qtrace")
    assert not (tmp_path / "out.qtrace").exists()


def test_a_real_trace_as_csv_gives_the_same_routes(tmp_path: Path) -> None:
    """Mixtral's decode log written as CSV (gzipped, per-layer files) imports to the same routes, merged by step value.

    The source lost tokens (its logger's [0.5, 0.5] caveat): a layer lacks some steps the others have.
    """
    import_log("mixtral-jsonl", MARIO / "routing_raw.jsonl.gz", tmp_path / "raw.qtrace", max_steps=20)
    _, records = trace.read(tmp_path / "raw.qtrace")
    decode = [r for r in records if isinstance(r, trace.Route) and r.step > 1]  # one token per route
    for layer in (0, 1, 2):
        rows = [f"{r.step},{layer},{e},{w!r}" for r in decode if r.layer == layer for e, w in zip(r.experts, r.weights,
                                                                                                      strict=True)]
        (tmp_path / f"layer{layer}.csv.gz").write_bytes(gzip.compress(("step,layer,expert,score\n" + "\n".join(rows)
                                                                       + "\n").encode()))
    s = import_log("csv", tmp_path, tmp_path / "csv.qtrace", experts=8)  # the folder: three per-layer files merged
    _, got = trace.read(tmp_path / "csv.qtrace")
    want = [(r.layer, r.experts, r.weights) for r in decode if r.layer < 3]
    assert [(r.layer, r.experts, r.weights) for r in got if isinstance(r, trace.Route)] == want
    assert s.layers == (0, 1, 2) and len(s.files) == 3 and s.steps == len({r.step for r in decode if r.layer < 3})
    assert len({sum(1 for r in decode if r.layer == ly) for ly in (0, 1, 2)}) > 1  # the layers' step counts differ
    again = _csv(tmp_path / "other", "step,layer,expert,score\n1,2,0,1.0\n", "again.csv")
    with pytest.raises(TraceImportError, match=r"layer2.csv.gz: layer 2 is also in .*again.csv"):
        import_log("csv", [again, tmp_path], tmp_path / "bad.qtrace", experts=8)
    bare = _csv(tmp_path / "other", "step,layer,expert\n1,5,0\n", "bare.csv")
    with pytest.raises(TraceImportError, match=r"bare.csv: no score column, .*layer0.csv.gz has one"):
        import_log("csv", [tmp_path, bare], tmp_path / "bad.qtrace", experts=8)


def test_cli_csv_help_teaches_the_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["trace", "import", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "step,layer,expert[,score]" in out and "--experts" in out and "--batched" in out


def test_the_routes_a_small_file_becomes_are_charged_to_the_byte_budget(tmp_path: Path) -> None:
    src = _csv(tmp_path, "step,layer,expert\n" + "".join(f"{i},0,1\n" for i in range(1000)))  # ~7 kB, 1000 routes
    # each row's columns as it is read (1000 x ROW_BYTES), then the routes of its groups (1000 x ROUTE_BYTES)
    with pytest.raises(TraceImportError, match=r"r.csv: line \d+ \(its columns\): 200 more bytes would pass the "
                                               r"import's limit of 100000 bytes"):
        import_log("csv", src, tmp_path / "out.qtrace", max_bytes=100_000)
    with pytest.raises(TraceImportError, match=r"r.csv: the routes of 1000 \(step, layer\) groups: 160000 more bytes "
                                               r"would pass the import's limit of 300000 bytes"):
        import_log("csv", src, tmp_path / "out.qtrace", max_bytes=300_000)
    assert import_log("csv", src, tmp_path / "out.qtrace", max_bytes=400_000).steps == 1000
