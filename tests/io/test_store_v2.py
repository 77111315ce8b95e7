"""Expert store index version 2: the family block, any switch's record tensors, uint8 scales; version 1 reads."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from qnpipe.errors import StoreError
from qnpipe.io import store as st
from qnpipe.io.store_check import FLOAT, ExpertSpec, check_against_model
from qnpipe.io.store_format import Family, LayerFile, Quant, StoreIndex, index_family
from qnpipe.model.args import args_from_dict, read_config


def _v2(tmp: Path, **fam: object) -> tuple[Path, StoreIndex]:
    tensors = [("fc1.weight", "uint32", (64, 8)), ("fc1.scales", "uint8", (64, 2)), ("fc1.bias", "float32", (64,)),
               ("fc2.weight", "uint32", (64, 8)), ("fc2.scales", "uint8", (64, 2)), ("fc2.bias", "float32", (64,))]
    slots, nbytes, stride = st.record_layout(tensors)
    layers = []
    for layer in (1, 3):
        (tmp / st.layer_file_name(layer)).write_bytes(bytes(4 * stride))
        q = Quant(bits=4, group_size=32, mode="mxfp4")
        layers.append(LayerFile(layer=layer, file=st.layer_file_name(layer), num_experts=4, stride=stride,
                                record_nbytes=nbytes, file_nbytes=4 * stride, tensors=slots,
                                quant={"fc1": q, "fc2": q}, checksums=(0,) * 4))
    family = Family(model_type="gpt_oss", switch_class="SwitchGLU",
                    switch_paths={1: "model.layers.1.mlp.experts", 3: "model.layers.3.mlp.experts"})
    index = StoreIndex(version=2, model_id="m", layers=tuple(layers), family=msgspec.structs.replace(family, **fam))
    st.write_index(tmp, index)
    return tmp / "index.json", index


def _spec(index: StoreIndex) -> ExpertSpec:
    fam = index_family(index)
    per = {t.name: (t.shape, FLOAT if t.dtype == "float32" else t.dtype) for t in index.layers[0].tensors}
    q = Quant(bits=4, group_size=32, mode="mxfp4")
    return ExpertSpec(model_type=fam.model_type, num_experts=4, switch_paths=dict(fam.switch_paths),
                      tensors={lf.layer: dict(per) for lf in index.layers},
                      quant={lf.layer: {"fc1": q, "fc2": q} for lf in index.layers})


def test_v2_round_trips_with_its_family_block_and_uint8_scales(tmp_path: Path) -> None:
    path, index = _v2(tmp_path)
    raw = json.loads(path.read_text())
    assert raw["version"] == 2 and raw["family"]["switch_paths"] == {"1": "model.layers.1.mlp.experts",
                                                                     "3": "model.layers.3.mlp.experts"}
    _, back = st.read_index(tmp_path)
    assert back == index and index_family(back).switch_paths[3] == "model.layers.3.mlp.experts"
    check_against_model(back, path, _spec(back))
    with st.ExpertStore.open(tmp_path) as store:
        views = store.record_tensors(3, store.read_record(3, 2))
        assert views["fc1.scales"].dtype.name == "uint8" and views["fc1.scales"].shape == (64, 2)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("family"), r"version 2 index needs a `family` block"),
    (lambda d: d["family"]["switch_paths"].pop("3"), r"switch_paths name layers \[1\], the index stores layers \[1, 3\]"),
    (lambda d: d["family"].update(switch_class="SwitchMoE"), r"switch_class 'SwitchMoE'"),
    (lambda d: d.update(version=1), r"a version 1 index has no `family` block"),
    (lambda d: d["layers"][0]["quant"]["fc1"].update(mode="fp3"), r"fc1 has quantization mode 'fp3'"),
])
def test_bad_v2_indexes_are_refused_by_name(tmp_path: Path, edit, match) -> None:  # type: ignore[no-untyped-def]
    path, _ = _v2(tmp_path)
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))
    with pytest.raises(StoreError, match=match):
        st.read_index(tmp_path)


@pytest.mark.parametrize("change, match", [
    (lambda s: msgspec.structs.replace(s, model_type="qwen3_moe"), r"a store of a gpt_oss model; this model is qwen3_moe"),
    (lambda s: msgspec.structs.replace(s, num_experts=8), r"layer 1 .*4 experts, the model \(model.layers.1.mlp.experts\) has 8"),
    (lambda s: msgspec.structs.replace(s, switch_paths={1: "model.layers.1.mlp.switch_mlp", 3: "x"}),
     r"the store's switch is model.layers.1.mlp.experts, the model's is model.layers.1.mlp.switch_mlp"),
    (lambda s: msgspec.structs.replace(s, tensors={k: {**v, "fc1.weight": ((32, 8), "uint32")} for k, v in s.tensors.items()}),
     r"tensor fc1.weight has shape \[64, 8\] per expert, the model's model.layers.1.mlp.experts.fc1.weight needs \[32, 8\]"),
    (lambda s: msgspec.structs.replace(s, tensors={k: {**v, "fc1.scales": ((64, 2), FLOAT)} for k, v in s.tensors.items()}),
     r"tensor fc1.scales has dtype uint8, .* needs a float type"),
    (lambda s: msgspec.structs.replace(s, quant={1: {"fc1": Quant(bits=4, group_size=32)}, 3: {}}),
     r"layer 1 .*fc1 is mxfp4 4-bit/group 32 in the store, affine 4-bit/group 32 in the model"),
])
def test_a_store_that_does_not_match_the_skeleton_is_named(tmp_path: Path, change, match) -> None:  # type: ignore[no-untyped-def]
    path, index = _v2(tmp_path)
    with pytest.raises(StoreError, match=match):
        check_against_model(index, path, change(_spec(index)))


def test_version_1_from_todays_convert_reads_with_the_implied_block(tiny_qn4: Path, tmp_path: Path) -> None:
    raw = json.loads((tiny_qn4 / "experts" / "index.json").read_text())
    assert raw["version"] == 1 and "family" not in raw  # today's Qwen3-Next stores stay version 1, byte for byte
    assert all("global_scale" not in q for lf in raw["layers"] for q in (lf["quant"] or {}).values())
    root, index = st.read_index(tiny_qn4)
    fam = index_family(index)
    assert (fam.model_type, fam.switch_class) == ("qwen3_next", "SwitchGLU")
    assert fam.switch_paths == {lf.layer: f"model.layers.{lf.layer}.mlp.switch_mlp" for lf in index.layers}
    before = (root / "index.json").read_bytes()
    assert st.write_index(tmp_path, index).read_bytes() == before  # a v1 index writes back as it was
    check_against_model(index, root / "index.json", args_from_dict(read_config(tiny_qn4)))
    with pytest.raises(StoreError, match="a store of a qwen3_next model; this model is gpt_oss"):
        check_against_model(index, root / "index.json", ExpertSpec(model_type="gpt_oss", num_experts=1,
                                                                   switch_paths={}, tensors={}, quant={}))
