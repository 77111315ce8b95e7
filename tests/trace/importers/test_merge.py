"""Per-layer files of one run merged into one log: the real vLLM logs, and the mismatches refused naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from real_traces import WEIRAN

from qnpipe import trace
from qnpipe.cli import main
from qnpipe.errors import TraceImportError
from qnpipe.trace.importers import import_log, vllm_jsonl

LAYERS = (0, 8, 12, 18, 23)


def _routes(path: Path) -> list[trace.Route]:
    _, records = trace.read(path)
    return [r for r in records if isinstance(r, trace.Route)]


@pytest.mark.slow
def test_the_vllm_loggers_five_layer_files_become_one_log_of_five_layers(tmp_path: Path) -> None:
    s = import_log("vllm-jsonl", WEIRAN, tmp_path / "all.qtrace")  # the folder: its five .jsonl.gz files
    header, records = trace.read(tmp_path / "all.qtrace")
    assert header.layers == LAYERS and s.layers == LAYERS and s.requests == 25 and s.steps == 25 * 82
    assert [Path(f).name for f in s.files] == [f"moe_layer{x}.jsonl.gz" for x in LAYERS]  # in layer order
    assert s.skipped[vllm_jsonl.DUMMY] == 5 * (8192 + 256) and s.token_routes == 5 * 2050
    merged = _routes(tmp_path / "all.qtrace")
    for layer in LAYERS:  # each layer's routes are its own file's, step for step
        import_log("vllm-jsonl", WEIRAN / f"moe_layer{layer}.jsonl.gz", tmp_path / f"l{layer}.qtrace")
        own = [(r.step, r.experts, r.weights) for r in _routes(tmp_path / f"l{layer}.qtrace")]
        assert [(r.step, r.experts, r.weights) for r in merged if r.layer == layer] == own
    assert [r.layer for r in merged if r.step == 7] == list(LAYERS)
    starts = [r for r in records if isinstance(r, trace.RequestStart)]
    assert [x.first_step for x in starts] == [1 + 82 * i for i in range(25)]
    # a glob, or the files listed, give the same log
    import_log("vllm-jsonl", str(WEIRAN / "moe_layer*.jsonl.gz"), tmp_path / "glob.qtrace")
    import_log("vllm-jsonl", [WEIRAN / f"moe_layer{x}.jsonl.gz" for x in (23, 0, 8, 18, 12)], tmp_path / "list.qtrace")
    assert (tmp_path / "glob.qtrace").read_bytes() == (tmp_path / "all.qtrace").read_bytes()
    assert _routes(tmp_path / "list.qtrace") == merged


def _vllm_file(path: Path, layer: int, passes: list[int]) -> Path:
    lines = [json.dumps({"type": "meta", "model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "top_k": 4,
                         "layers_logged": [layer]})]
    for n, rows in enumerate(passes):
        for i in range(rows):
            e = (3 * n + 5 * i + layer) % 56
            lines.append(json.dumps({"type": "route", "req_id": "r1", "token_idx": i, "layer": layer,
                                     "topk_ids": [e, e + 1, e + 2, e + 3], "topk_weights": [0.1] * 4}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_files_of_different_runs_or_the_same_layer_are_refused_naming_the_file(tmp_path: Path) -> None:
    a = _vllm_file(tmp_path / "a.jsonl", 0, [3, 3, 3])
    fewer = _vllm_file(tmp_path / "fewer.jsonl", 1, [3, 3])
    with pytest.raises(TraceImportError, match=r"fewer.jsonl: request 0 \(run 0 row 0\) has 2 steps, a.jsonl's has 3"):
        import_log("vllm-jsonl", [a, fewer], tmp_path / "out.qtrace")
    again = _vllm_file(tmp_path / "again.jsonl", 0, [3, 3, 3])
    with pytest.raises(TraceImportError, match=r"again.jsonl: layer 0 is also in .*a.jsonl"):
        import_log("vllm-jsonl", [a, again], tmp_path / "out.qtrace")
    wider = _vllm_file(tmp_path / "wider.jsonl", 2, [4, 4, 4])
    with pytest.raises(TraceImportError, match=r"wider.jsonl: 4 request\(s\), a.jsonl has 3: not the same run"):
        import_log("vllm-jsonl", [a, wider], tmp_path / "out.qtrace")
    # batched, the passes are the steps: one pass of a different size is a different run
    b = _vllm_file(tmp_path / "b.jsonl", 0, [5, 3, 3])
    c = _vllm_file(tmp_path / "c.jsonl", 1, [5, 3, 2])
    with pytest.raises(TraceImportError, match=r"c.jsonl: request 0 \(run 0\) step 3: layer 1 routes 2 tokens, "
                                               r"layer 0 of b.jsonl 3: not the same run"):
        import_log("vllm-jsonl", [b, c], tmp_path / "out.qtrace", batched=True)
    assert not (tmp_path / "out.qtrace").exists()
    ok = import_log("vllm-jsonl", [b, _vllm_file(tmp_path / "d.jsonl", 1, [5, 3, 3])], tmp_path / "ok.qtrace",
                    batched=True)
    assert (ok.requests, ok.steps, ok.layers, ok.token_routes) == (1, 3, (0, 1), 2 * 11)
    with pytest.raises(TraceImportError, match=r"nothing\*.jsonl: no file matches"):
        import_log("vllm-jsonl", str(tmp_path / "nothing*.jsonl"), tmp_path / "out.qtrace")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceImportError, match=r"empty: a directory without .jsonl or .jsonl.gz files"):
        import_log("vllm-jsonl", tmp_path / "empty", tmp_path / "out.qtrace")
    with pytest.raises(TraceImportError, match=r"a file given twice"):
        import_log("vllm-jsonl", [a, tmp_path / "." / "a.jsonl"], tmp_path / "out.qtrace")


def test_cli_merges_several_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "two.qtrace"
    assert main(["trace", "import", "vllm-jsonl", str(WEIRAN / "moe_layer0.jsonl.gz"),
                 str(WEIRAN / "moe_layer23.jsonl.gz"), "-o", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["layers"] == [0, 23] and len(s["files"]) == 2 and s["steps"] == 2050
    assert main(["trace", "import", "vllm-jsonl", str(WEIRAN / "moe_layer0.jsonl.gz"),
                 str(WEIRAN / "moe_layer0.jsonl.gz"), "-o", str(out)]) == 2
    assert "a file given twice" in capsys.readouterr().err


def test_a_fifo_among_a_folders_files_is_refused_not_read(tmp_path: Path) -> None:
    import os

    _vllm_file(tmp_path / "a.jsonl", 0, [3, 3])
    os.mkfifo(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").mkdir()  # a folder with the suffix is not a source
    with pytest.raises(TraceImportError, match=r"b.jsonl: not a regular file \(a FIFO\)"):
        import_log("vllm-jsonl", tmp_path, tmp_path / "out.qtrace")
