"""Malformed or truncated sources fail with the file, the line or record, and what was wrong."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import zipfile
from pathlib import Path

import pytest
from real_traces import MARIO, WEIRAN

from qnpipe.cli import main
from qnpipe.errors import TraceImportError
from qnpipe.trace.importers import import_log


def _mixtral(i: int, layer: object = 0, **over: object) -> str:
    rec = {"dataset": "humaneval", "problem_id": 0, "layer": layer, "experts": [1, 2], "gating_probs": [0.6, 0.4],
           "token_idx": i, **over}
    return json.dumps(rec)


def _write(tmp_path: Path, lines: list[str], name: str = "src.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(("line3", "why"), [
    ("{not json", r"line 3: not a JSON record"),
    (_mixtral(2, experts=[1, 9]), r"line 3: expert ids \[1, 9\]: outside 0..7"),
    (_mixtral(2, experts=[1, 1]), r"line 3: expert ids \[1, 1\]: an expert chosen twice"),
    (_mixtral(2, experts=[1, 2, 3]), r"line 3: 3 experts, the model routes each token to top_k=2"),
    (_mixtral(2, layer=32), r"line 3: layer 32 is not a MoE layer"),
    (_mixtral(2, gating_probs=[0.5]), r"line 3: 1 weights for 2 experts"),
    (_mixtral(5), r"line 3: token_idx 5 at layer 0 of problem 0, expected 2"),
    (_mixtral(2, layer="x"), r"line 3: Expected `int`, got `str` - at `\$.layer`"),
    (_mixtral(2, token_idx=None, token_pos=2), r"line 3: has token_pos, the lines before have token_idx"),
])
def test_a_bad_mixtral_record_is_named_by_its_line(tmp_path: Path, line3: str, why: str) -> None:
    src = _write(tmp_path, [_mixtral(0), _mixtral(1), line3])
    with pytest.raises(TraceImportError, match=why) as e:
        import_log("mixtral-jsonl", src, tmp_path / "out.qtrace")
    assert str(src) in str(e.value)
    assert not (tmp_path / "out.qtrace").exists() and not (tmp_path / "out.qtrace.partial").exists()


def test_a_truncated_gzip_names_the_line_it_stopped_at(tmp_path: Path) -> None:
    data = (MARIO / "routing_raw.jsonl.gz").read_bytes()
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceImportError, match=r"cut.jsonl.gz: line \d+: cannot decompress"):
        import_log("mixtral-jsonl", src, tmp_path / "out.qtrace")


def test_a_torn_last_line_is_named(tmp_path: Path) -> None:
    lines = gzip.decompress((MARIO / "routing_raw.jsonl.gz").read_bytes()).decode().splitlines()[:40]
    src = _write(tmp_path, [*lines[:-1], lines[-1][:30]])
    with pytest.raises(TraceImportError, match=r"line 40: not a JSON record"):
        import_log("mixtral-jsonl", src, tmp_path / "out.qtrace")


def _vllm(i: int, ids: list[int] | None = None) -> str:
    return json.dumps({"type": "route", "req_id": "r1", "token_idx": i, "layer": 0,
                       "topk_ids": ids or [i, i + 1, i + 2, i + 3], "topk_weights": [0.1] * 4})


META = json.dumps({"type": "meta", "model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "top_k": 4, "layers_logged": [0]})


@pytest.mark.parametrize(("lines", "why"), [
    ([_vllm(0)], r"line 1: the first record must be the meta line"),
    ([META.replace("Qwen/Qwen1.5-MoE-A2.7B-Chat", "Org/Other"), _vllm(0)], r"line 1: model_id 'Org/Other': unknown"),
    ([META, _vllm(0), _vllm(1), _vllm(3)], r"line 4: token_idx 3, expected 2 or 0"),
    ([META, _vllm(0), META], r"line 3: a second meta line"),
    ([META, _vllm(0), _vllm(1, [1, 2, 3, 60])], r"line 3: expert ids \[1, 2, 3, 60\]: outside 0..59"),
    ([META, _vllm(0).replace('"layer": 0', '"layer": 5')], r"line 2: layer 5 is not in the meta line's layers_logged"),
    ([META, json.dumps({"type": "route", "token_idx": 0})], r"line 2: Object missing required field `layer`"),
    ([META, json.dumps({"type": "hello"})], r"line 2: Invalid value 'hello' - at `\$.type`"),
])
def test_a_bad_vllm_record_is_named_by_its_line(tmp_path: Path, lines: list[str], why: str) -> None:
    with pytest.raises(TraceImportError, match=why):
        import_log("vllm-jsonl", _write(tmp_path, lines), tmp_path / "out.qtrace")


def test_a_vllm_file_of_dummy_passes_only_says_what_it_skipped(tmp_path: Path) -> None:
    lines = [META] + [_vllm(i, [1, 2, 3, 4]) for i in range(8)]
    with pytest.raises(TraceImportError, match=r"no routing records left to import \(8 skipped: rows of vLLM profiling"):
        import_log("vllm-jsonl", _write(tmp_path, lines), tmp_path / "out.qtrace")


def _pt(path: Path, pickled: bytes, extra: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", b"little")
        for k, v in (extra or {}).items():
            z.writestr(f"archive/data/{k}", v)
    return path


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("echo pwned",))


def test_a_pt_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    src = _pt(tmp_path / "evil.pt", pickle.dumps({"model": _Evil()}, protocol=2))
    with pytest.raises(TraceImportError, match=r"evil.pt: corrupt torch pickle \(refusing to load (posix|os).system"):
        import_log("flame-pt", src, tmp_path / "out.qtrace")


def test_truncated_and_incomplete_pt_files_are_named(flame_dir: Path, tmp_path: Path) -> None:
    good = next((flame_dir / "Encoder_Batch_0-32" / "Layer_2").glob("*.pt")).read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(TraceImportError, match=r"cut.pt: not a readable torch zip file"):
        import_log("flame-pt", cut, tmp_path / "out.qtrace")
    missing = _pt(tmp_path / "nokey.pt", pickle.dumps({"model": "flame-moe-290m", "layer": 2, "token_position": 0}))
    with pytest.raises(TraceImportError, match=r"nokey.pt: key 'samples' is missing or not a tensor"):
        import_log("flame-pt", missing, tmp_path / "out.qtrace")
    buf = io.BytesIO()
    pickle.dump({"model": "flame-moe-290m", "layer": "two"}, buf, protocol=2)
    with pytest.raises(TraceImportError, match=r"badmeta.pt: .*`\$.layer`"):
        import_log("flame-pt", _pt(tmp_path / "badmeta.pt", buf.getvalue()), tmp_path / "out.qtrace")


def test_a_folder_of_both_flame_layouts_is_refused(flame_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TraceImportError, match=r"mixes sequence captures .* import each folder on its own"):
        import_log("flame-pt", flame_dir, tmp_path / "out.qtrace")


def test_cli_import_prints_the_summary_and_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "l0.qtrace"
    assert main(["trace", "import", "vllm-jsonl", str(WEIRAN / "moe_layer0.jsonl.gz"), "-o", str(out)]) == 0
    line = capsys.readouterr().out
    assert line.startswith("imported ") and "25 request(s), 2050 steps" in line and "8448 rows of vLLM profiling" in line
    assert main(["trace", "import", "vllm-jsonl", str(MARIO / "routing_raw.jsonl.gz"), "-o", str(out), "--json"]) == 2
    assert "routing_raw.jsonl.gz: line 1: Object missing required field `type`" in capsys.readouterr().err
    assert main(["trace", "import", "vllm-jsonl", str(WEIRAN / "moe_layer0.jsonl.gz"), "-o", str(out),
                 "--max-steps", "0"]) == 2
    assert "max_steps=0: want at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "import", "parquet", "x", "-o", str(out)])  # not a format
    with pytest.raises(SystemExit) as e:
        main(["trace", "import", "--help"])
    assert e.value.code == 0 and "examples:" in capsys.readouterr().out


def _patched(src: Path, dst: Path, row: int, col: int, value: int | None) -> Path:
    """`src` with indices[row, col] set to `value` (None: to indices[row, 0], a repeated expert)."""
    import numpy as np

    with zipfile.ZipFile(src) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    name = next(n for n in entries if n.endswith("/data/2"))  # the third tensor: indices [N, 6] int64
    ids = np.frombuffer(entries[name], dtype="<i8").copy().reshape(-1, 6)
    ids[row, col] = ids[row, 0] if value is None else value
    entries[name] = ids.tobytes()
    with zipfile.ZipFile(dst, "w") as z:
        for n, b in entries.items():
            z.writestr(n, b)
    return dst


def test_bad_expert_ids_in_a_pt_file_name_the_token(flame_dir: Path, tmp_path: Path) -> None:
    good = next((flame_dir / "Encoder_Batch_0-32" / "Layer_2").glob("*.pt"))
    with pytest.raises(TraceImportError, match=r"big.pt: token 5: expert ids \[64, .*\] outside 0..63"):
        import_log("flame-pt", _patched(good, tmp_path / "big.pt", 5, 0, 64), tmp_path / "out.qtrace")
    with pytest.raises(TraceImportError, match=r"dup.pt: token 7: expert ids .*: an expert chosen twice"):
        import_log("flame-pt", _patched(good, tmp_path / "dup.pt", 7, 3, None), tmp_path / "out.qtrace")


def _row(i: int, layer: int, ids: list[int]) -> str:
    return json.dumps({"type": "route", "token_idx": i, "layer": layer, "topk_ids": ids, "topk_weights": [0.1] * 4})


def test_vllm_passes_of_several_layers_must_share_one_batch(tmp_path: Path) -> None:
    meta = META.replace('"layers_logged": [0]', '"layers_logged": [0, 1]')
    ok = [meta, _row(0, 0, [1, 2, 3, 4]), _row(1, 0, [5, 6, 7, 8]), _row(0, 1, [1, 2, 3, 5]), _row(1, 1, [2, 6, 7, 8])]
    with pytest.raises(TraceImportError, match=r"line 4: layer 1's pass has 1 rows, layer 0's 2: one forward pass"):
        import_log("vllm-jsonl", _write(tmp_path, [*ok[:4], *ok[1:3]]), tmp_path / "out.qtrace")
    with pytest.raises(TraceImportError, match=r"the last pass of layer 1 has 1 rows, layer 0's 2: truncated"):
        import_log("vllm-jsonl", _write(tmp_path, ok[:4]), tmp_path / "out.qtrace")
    s = import_log("vllm-jsonl", _write(tmp_path, ok), tmp_path / "out.qtrace")
    assert (s.requests, s.steps, s.layers) == (2, 2, (0, 1))  # one pass of two rows: two requests of one token


def test_a_single_vllm_request_keeps_its_prefill(tmp_path: Path) -> None:
    lines = [META, *[_vllm(i) for i in range(3)], *[_vllm(0, [9, 8, 7, i]) for i in range(4)]]
    s = import_log("vllm-jsonl", _write(tmp_path, lines), tmp_path / "out.qtrace")
    assert (s.requests, s.steps, s.token_routes, s.skipped) == (1, 5, 7, {})  # a 3-row prefill, then 4 decode steps


def test_valid_views_of_a_storage_still_import_with_the_right_ids(tmp_path: Path) -> None:
    """The bounds checks refuse what reaches outside a storage, not offsets, transposes or shared storages."""
    import numpy as np
    from pt_craft import META, capture_tensors, write_pt

    from qnpipe import trace

    ts = capture_tensors(8)
    ids = ts["indices"].data.reshape(8, 6)
    # indices stored transposed ([6, 8] row-major, viewed with strides (1, 8)) after 5 elements of padding
    stored = np.concatenate([np.full(5, 63), ids.T.reshape(-1)]).astype(np.int64)
    ts["indices"] = ts["indices"]._replace(data=stored, offset=5, stride=(1, 8), numel=stored.size)
    write_pt(tmp_path / "views.pt", META, ts)
    import_log("flame-pt", tmp_path / "views.pt", tmp_path / "out.qtrace")
    routes = [r for r in trace.read(tmp_path / "out.qtrace")[1] if isinstance(r, trace.Route)]
    assert [list(r.experts) for r in routes] == ids.tolist()


def test_the_byte_budget_is_shared_by_the_files_of_a_folder(flame_dir: Path, tmp_path: Path) -> None:
    folder = flame_dir / "Decoder_Batch_0-64"
    total = sum(p.stat().st_size for p in folder.rglob("*.pt"))
    import_log("flame-pt", folder, tmp_path / "ok.qtrace", max_bytes=4 * total)
    with pytest.raises(TraceImportError, match=r"\.pt: .*would pass the import's limit of 100000 bytes"):
        import_log("flame-pt", folder, tmp_path / "small.qtrace", max_bytes=100_000)
    assert not list(tmp_path.glob("small.qtrace*"))
