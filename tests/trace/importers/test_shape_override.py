"""Every importer takes a routing shape over its source's (`--shape NAME`, `--num-experts N --top-k K
[--num-layers L]`), and a quantized or renamed variant of a known model id is known without one."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from real_traces import MARIO, WEIRAN

from qnpipe.cli import main
from qnpipe.errors import TraceImportError
from qnpipe.replay import load_log
from qnpipe.trace.importers import ShapeOverride, import_log, known_shape
from qnpipe.trace.importers.common import FLAME_MOE_290M, MIXTRAL_8X7B, QWEN15_MOE_A27B


def _vllm(tmp_path: Path, model_id: str, *, top_k: int = 4, name: str = "moe.jsonl") -> Path:
    """The real Qwen layer-12 log with the meta line's model id replaced."""
    lines = gzip.decompress((WEIRAN / "moe_layer12.jsonl.gz").read_bytes()).decode().splitlines()
    meta = json.loads(lines[0]) | {"model_id": model_id, "top_k": top_k}
    p = tmp_path / name
    p.write_text("\n".join([json.dumps(meta), *lines[1:]]) + "\n")
    return p


@pytest.mark.parametrize("model_id", ["Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4", "Qwen/Qwen1.5-MoE-A2.7B-Chat-GPTQ-Int4",
                                      "TheBloke/Qwen1.5-MoE-A2.7B-Chat-AWQ", "mlx-community/Qwen1.5-MoE-A2.7B-4bit",
                                      "qwen/qwen1.5-moe-a2.7b-chat"])
def test_a_quantized_or_renamed_variant_of_a_known_model_is_known(tmp_path: Path, model_id: str) -> None:
    hit = known_shape(model_id)
    assert hit is not None and hit[1] == QWEN15_MOE_A27B
    s = import_log("vllm-jsonl", _vllm(tmp_path, model_id), tmp_path / "q.qtrace")
    assert s.model == QWEN15_MOE_A27B and s.token_routes > 0


@pytest.mark.parametrize("model_id", ["Qwen/Qwen1.5-MoE", "Qwen/Qwen2-57B-A14B", "Qwen1.5-MoE-A2.7Bx"])
def test_a_different_model_is_not_taken_for_a_known_one(model_id: str) -> None:
    assert known_shape(model_id) is None


def test_an_unknown_vllm_model_imports_with_a_shape_given(tmp_path: Path) -> None:
    src = _vllm(tmp_path, "Org/Unknown-MoE", top_k=4)
    with pytest.raises(TraceImportError, match=r"model_id 'Org/Unknown-MoE': unknown routing shape.*--shape NAME"):
        import_log("vllm-jsonl", src, tmp_path / "no.qtrace")
    s = import_log("vllm-jsonl", src, tmp_path / "a.qtrace", shape=ShapeOverride(name="Qwen/Qwen1.5-MoE-A2.7B"))
    assert s.model == QWEN15_MOE_A27B
    s = import_log("vllm-jsonl", src, tmp_path / "b.qtrace",
                   shape=ShapeOverride(num_experts=64, top_k=4, num_layers=16))
    assert (s.model.num_experts, s.model.top_k, s.model.moe_layers) == (64, 4, tuple(range(16)))
    assert load_log(tmp_path / "b.qtrace").shape == s.model
    with pytest.raises(TraceImportError, match="--num-layers"):
        import_log("vllm-jsonl", src, tmp_path / "c.qtrace", shape=ShapeOverride(num_experts=64, top_k=4))
    with pytest.raises(TraceImportError, match=r"top_k=4, Org/Unknown-MoE routes to 2 \(--top-k\)"):
        import_log("vllm-jsonl", src, tmp_path / "d.qtrace", shape=ShapeOverride(num_experts=64, top_k=2,
                                                                                  num_layers=16))


def test_mixtral_jsonl_takes_a_shape_over_mixtral_8x7b(tmp_path: Path) -> None:
    src = MARIO / "routing_raw.jsonl.gz"
    s = import_log("mixtral-jsonl", src, tmp_path / "m.qtrace", max_steps=5)
    assert s.model == MIXTRAL_8X7B
    # e.g. a Mixtral with more layers or experts logged the same way
    s = import_log("mixtral-jsonl", src, tmp_path / "w.qtrace", max_steps=5,
                   shape=ShapeOverride(num_experts=16, num_layers=56))
    assert (s.model.num_experts, s.model.top_k, s.model.num_layers) == (16, 2, 56)
    with pytest.raises(TraceImportError, match="unknown, known"):
        import_log("mixtral-jsonl", src, tmp_path / "x.qtrace", shape=ShapeOverride(name="no/such-model"))


def test_flame_pt_takes_a_shape(flame_dir: Path, tmp_path: Path) -> None:
    src = flame_dir / "Encoder_Batch_0-32"
    s = import_log("flame-pt", src, tmp_path / "f.qtrace", max_steps=3, shape=ShapeOverride(num_experts=128))
    assert (s.model.num_experts, s.model.top_k, s.model.moe_layers) == (128, 6, FLAME_MOE_290M.moe_layers)


def test_csv_takes_a_shape_and_checks_its_rows_fit(tmp_path: Path) -> None:
    src = tmp_path / "r.csv"
    src.write_text("step,layer,expert\n1,0,5\n1,0,2\n2,1,3\n2,1,0\n")
    s = import_log("csv", src, tmp_path / "a.qtrace", shape=ShapeOverride(num_experts=60, top_k=2, num_layers=4))
    assert (s.model.num_experts, s.model.top_k, s.model.moe_layers) == (60, 2, (0, 1, 2, 3))
    with pytest.raises(TraceImportError, match="2 experts per .step, layer., the shape routes to top_k=4"):
        import_log("csv", src, tmp_path / "b.qtrace", shape=ShapeOverride(name="Qwen/Qwen1.5-MoE-A2.7B"))
    with pytest.raises(TraceImportError, match="expert id 5 outside 0..3"):
        import_log("csv", src, tmp_path / "c.qtrace", shape=ShapeOverride(num_experts=4, top_k=2))


def test_the_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _vllm(tmp_path, "Org/Unknown-MoE", top_k=4)
    assert main(["trace", "import", "vllm-jsonl", str(src), "-o", str(tmp_path / "a.qtrace"), "--json",
                 "--num-experts", "60", "--top-k", "4", "--num-layers", "24"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["model"]["num_experts"], out["model"]["top_k"], out["model"]["num_layers"]) == (60, 4, 24)
    assert main(["trace", "import", "vllm-jsonl", str(src), "-o", str(tmp_path / "b.qtrace"), "--json",
                 "--shape", "Qwen/Qwen1.5-MoE-A2.7B-Chat"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["num_experts"] == 60
