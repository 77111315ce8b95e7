"""A model's identity is more than its config.json (issue 34, item 5).

Ranks running two models with the same config.json and other weights passed the ranks' start-up
check and mixed their outputs with exit 0; `EXPERT_DIR` naming another model's expert store of
the same shape gave other tokens with exit 0. Now the ranks compare the model files' contents
(qnpipe.model.identity) and a store must be the one its model was converted with (config.json
`qnpipe.experts.index_sha256`), each refused at start naming what differs. A model converted
before that key existed still loads (matched by its shape only, as documented).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from cli_harness import Case, check_table, clean_env

from qnpipe.live.parallel.localhost import write_local_hostfile
from qnpipe.model.checkpoint import read_header
from qnpipe.model.identity import model_identity


def _linked(src: Path, dst: Path, real: tuple[str, ...] = ()) -> Path:
    """`dst` with a symlink to each file of `src` (directories linked file by file), but real copies of `real`."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_dir():
            _linked(f, dst / f.name, tuple(r.split("/", 1)[1] for r in real if r.startswith(f.name + "/")))
        elif f.name in real:
            shutil.copyfile(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f)
    return dst


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


def _other_weights(src: Path, dst: Path) -> Path:
    """`src` with one bit of one weight changed: another model, of the same config.json and expert store."""
    d = _linked(src, dst, real=("model.safetensors",))
    info = read_header(d / "model.safetensors")["model.norm.weight"]
    _flip(d / "model.safetensors", info.offset + info.nbytes // 2)
    return d


def _other_store(src: Path, dst: Path) -> Path:
    """An expert store of `src`'s shape whose first record differs, with an index that agrees with it:
    what another model of that shape converts to."""
    d = _linked(src / "experts", dst, real=("layer_000.bin", "index.json"))
    index = json.loads((d / "index.json").read_text())
    lf = index["layers"][0]
    _flip(d / lf["file"], 0)
    with (d / lf["file"]).open("rb") as f:
        lf["checksums"][0] = zlib.crc32(f.read(lf["record_nbytes"]))
    (d / "index.json").write_text(json.dumps(index))
    return d


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory, tiny_qn4: Path) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("identity")
    out = {"model": tiny_qn4, "other-weights": _other_weights(tiny_qn4, tmp / "other-weights"),
           "other-store": _other_store(tiny_qn4, tmp / "other-store" / "experts")}
    changed = _linked(tiny_qn4, tmp / "changed-store", real=("experts/index.json",))
    shutil.rmtree(changed / "experts")
    shutil.copytree(out["other-store"], changed / "experts", symlinks=True)
    out["changed-store"] = changed
    for name, value in (("old", None), ("bad-key", "xyz")):
        d = _linked(tiny_qn4, tmp / name, real=("config.json",))
        cfg = json.loads((d / "config.json").read_text())
        if value is None:
            del cfg["qnpipe"]["experts"]["index_sha256"]
        else:
            cfg["qnpipe"]["experts"]["index_sha256"] = value
        (d / "config.json").write_text(json.dumps(cfg))
        out[name] = d
    return out


def _gen(d: Path) -> list[object]:
    return ["generate", d, "--tokens", "1,2,3,4", "-n", "2"]


def test_a_store_of_another_model_is_refused_naming_it(m: dict[str, Path]) -> None:
    other = m["other-store"] / "index.json"
    check_table([
        # today: exit 0, other tokens
        Case("EXPERT_DIR names another model's store", _gen(m["model"]), 2,
             (str(other), "not this model's expert store", "qnpipe.experts.index_sha256"),
             env=(("EXPERT_DIR", str(m["other-store"])),)),
        # today: exit 0 (every record matches the index it was given)
        Case("verify-store: a store changed since convert", ["verify-store", m["changed-store"]], 2,
             (str(m["changed-store"] / "experts" / "index.json"), "not this model's expert store")),
        # today: the key is not read
        Case("config.json: index_sha256 not a sha256", _gen(m["bad-key"]), 2,
             (str(m["bad-key"] / "config.json"), "qnpipe.experts.index_sha256", '"xyz"')),
    ])


def test_a_model_converted_before_the_store_was_named_still_loads(m: dict[str, Path]) -> None:
    from qnpipe.model.load import load_model

    load_model(m["old"], resident_experts=False)
    # with no record of its store, a store of its shape is taken (docs/store-format.md)
    load_model(m["old"], expert_dir=m["other-store"], resident_experts=False)


def test_the_identity_names_what_differs(m: dict[str, Path], tiny_hf: Path, tmp_path: Path) -> None:
    base = model_identity(m["model"])
    assert model_identity(_linked(m["model"], tmp_path / "copy", real=("model.safetensors",))) == base
    weights = model_identity(m["other-weights"])
    assert (weights.config, weights.experts, weights.mtp) == (base.config, base.experts, base.mtp)
    assert weights.weights != base.weights
    store = model_identity(m["model"], expert_dir=m["other-store"])
    assert (store.config, store.weights) == (base.config, base.weights) and store.experts != base.experts
    assert model_identity(m["model"], mtp_file=m["model"] / "mtp.safetensors").mtp not in ("", base.mtp)
    # a checkpoint with its experts in its weight files: each expert tensor's ends count, the rest every byte
    hf = model_identity(tiny_hf)
    assert hf.experts == ""
    infos = read_header(tiny_hf / "model.safetensors")
    for name in ("model.layers.0.mlp.experts.0.gate_proj.weight", "model.norm.weight"):
        d = _linked(tiny_hf, tmp_path / name, real=("model.safetensors",))
        _flip(d / "model.safetensors", infos[name].offset)
        assert model_identity(d).weights != hf.weights, name


@pytest.mark.slow
def test_ranks_with_other_weights_are_refused_at_start(m: dict[str, Path], tmp_path: Path) -> None:
    """Rank 0 on the model, rank 1 on a model of the same config.json and expert store, one weight's bit
    apart: both stop before loading, naming rank 1 and the weights. Today both generate, exit 0."""
    hostfile = write_local_hostfile(tmp_path / "hosts.json", 2)
    procs = []
    for r, d in enumerate((m["model"], m["other-weights"])):
        env = clean_env() | {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
        env = {k: v for k, v in env.items() if not k.startswith("MLX_") or k in ("MLX_RANK", "MLX_HOSTFILE")}
        procs.append(subprocess.Popen([sys.executable, "-m", "qnpipe", *map(str, _gen(d)), "--distributed"],
                                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True))
    try:
        results = [p.communicate(timeout=120) for p in procs]  # a hang guard
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 2 and out == "", err[-3000:]
        assert "rank 1 differs from rank 0 in its weights (model*.safetensors)" in err, err[-3000:]
        assert "Traceback" not in err and "config.json" not in err.split("differs")[1], err[-3000:]
