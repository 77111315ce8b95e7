"""Issue 22 items 5, 6 and 9 for the model's own inputs, through the real `qnpipe` command.

Each row runs `python -m qnpipe ...` in a subprocess under a memory limit and a timeout
(tests/cli_harness.py) and checks the exit code, the message naming the file / key / value,
no traceback, and nothing left behind. The classes:

- sizes: a count or size in config.json, experts/index.json or a setting far beyond any model
  is an error naming the key and value, in about a second, before anything is sized from it;
- files: a FIFO, a directory or a device (/dev/zero) where a model-side file belongs is refused
  by name (never read, never waited on); for the heat and snapshot files, whose contract is to
  be optional, it is a warning naming the file and the answer comes (exit 0);
- heat: a heat file naming an expert or layer the model does not have is a warning naming the
  heat file and a zero start; the model still generates.

Model directories are linked copies (symlinks) of the session's tiny models with one file changed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cli_harness import Case, check_table

BIG = 10**12


def _linked(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """`dst` with a symlink to each file of `src` (its experts/ directory linked file by file), except `skip`."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in skip:
            continue
        if f.is_dir():
            _linked(f, dst / f.name, skip=tuple(s.split("/", 1)[1] for s in skip if s.startswith(f.name + "/")))
        else:
            (dst / f.name).symlink_to(f)
    return dst


def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    d = _linked(src, dst, skip=("config.json",))
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _with_index(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    d = _linked(src, dst, skip=("experts/index.json",))
    raw = json.loads((src / "experts" / "index.json").read_text())
    edit(raw)
    (d / "experts" / "index.json").write_text(json.dumps(raw))
    return d


def _special(src: Path, dst: Path, name: str, kind: str) -> Path:
    """A linked copy of `src` whose `name` is a FIFO, a directory or a link to /dev/zero."""
    d = _linked(src, dst, skip=(name,))
    _make_special(d / name, kind)
    return d


def _make_special(p: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    else:
        p.symlink_to("/dev/zero")


def _layer0(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    return lambda raw: edit(raw["layers"][0])


def _more_experts(lf: dict[str, Any]) -> None:
    """The index claims a 65th record the layer file does not hold (sizes consistent with each other)."""
    lf["num_experts"] += 1
    lf["checksums"].append(0)
    lf["file_nbytes"] = lf["num_experts"] * lf["stride"]


def _too_many_records(raw: dict[str, Any]) -> None:
    """17 layers of 65,536 records: each layer within bounds, more than 2**20 records in all."""
    lf = raw["layers"][0]
    n = 1 << 16
    raw["layers"] = [{**lf, "layer": i, "file": f"layer_{i:03d}.bin", "num_experts": n, "checksums": [0] * n,
                      "file_nbytes": n * lf["stride"]} for i in range(17)]


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path, tiny_qn4: Path) -> dict[str, Path]:
    from qnpipe.io.heat_file import encode_heat
    from qnpipe.model.args import model_id, read_config
    from qnpipe.model.snapshots import token_key

    t = tmp_path_factory.mktemp("model-inputs")
    out: dict[str, Path] = {"hf": tiny_hf, "qn": tiny_qn4, "root": t}
    for key, value in (("num_experts", BIG), ("hidden_size", BIG), ("vocab_size", BIG), ("num_hidden_layers", 10**8),
                       ("head_dim", 10**9), ("moe_intermediate_size", BIG), ("num_attention_heads", BIG)):
        out[f"cfg-{key}"] = _with_config(tiny_hf, t / f"cfg-{key}", **{key: value})
    big = _linked(tiny_hf, t / "cfg-huge-file", skip=("config.json",))
    with open(big / "config.json", "wb") as f:
        f.truncate(20 << 20)  # 20 MB of zeros where 2 KB of JSON belongs
    out["cfg-huge-file"] = big

    edits: dict[str, Callable[[dict[str, Any]], None]] = {
        "more-experts": _layer0(_more_experts),
        "num-experts": _layer0(lambda lf: lf.update(num_experts=BIG)),
        "record-bytes": _layer0(lambda lf: lf.update(record_nbytes=1 << 40, stride=1 << 40, file_nbytes=1 << 40)),
        "align": lambda raw: raw.update(align=1 << 40),
        "negative-shape": _layer0(lambda lf: lf["tensors"][0].update(shape=[-1, -lf["tensors"][0]["nbytes"]])),
        "layer-id": _layer0(lambda lf: lf.update(layer=10**9)),
        "records": _too_many_records,
    }
    for name, edit in edits.items():
        out[f"idx-{name}"] = _with_index(tiny_qn4, t / f"idx-{name}", edit)

    for name, kind, src in (
        ("config.json", "fifo", tiny_hf), ("config.json", "dir", tiny_hf), ("config.json", "dev", tiny_hf),
        ("experts/index.json", "fifo", tiny_qn4), ("experts/index.json", "dir", tiny_qn4),
        ("experts/index.json", "dev", tiny_qn4), ("experts/layer_000.bin", "fifo", tiny_qn4),
        ("model.safetensors", "fifo", tiny_qn4), ("model.safetensors", "dir", tiny_qn4),
        ("mtp.safetensors", "fifo", tiny_qn4),
        ("tokenizer.json", "fifo", tiny_qn4), ("tokenizer_config.json", "dev", tiny_qn4),
        ("chat_template.jinja", "fifo", tiny_qn4),
        ("generation_config.json", "fifo", tiny_qn4), ("generation_config.json", "dev", tiny_qn4),
    ):
        out[f"{name}-{kind}"] = _special(src, t / f"{name.replace('/', '-')}-{kind}", name, kind)
    shards = _linked(tiny_hf, t / "shard-index-fifo")
    os.mkfifo(shards / "model.safetensors.index.json")
    out["shard-index-fifo"] = shards

    for kind in ("fifo", "dir", "dev"):
        p = t / f"toml-{kind}" / "qnpipe.toml"
        p.parent.mkdir()
        _make_special(p, kind)
        out[f"toml-{kind}"] = p
    (t / "workers.toml").write_text("[read]\nworkers = 1000000000\n")
    out["workers.toml"] = t / "workers.toml"

    args = read_config(tiny_qn4)
    mid = model_id(args)
    heat = t / "heat"
    heat.mkdir()
    for name, counts in (("expert", {0: {3: 5, 999: 7}}), ("layer", {0: {3: 5}, 99: {1: 1}}),
                         ("negative", {1: {-4: 2}})):
        (heat / f"{name}.json").write_bytes(encode_heat(mid, counts))
    os.mkfifo(heat / "fifo.json")
    (heat / "dir.json").mkdir()
    out["heat"] = heat

    snaps = t / "snaps"
    snaps.mkdir()
    os.mkfifo(snaps / f"{token_key(TOKENS[:HEAD])}.qnsnap")
    out["snaps"] = snaps
    return out


TOKENS = list(range(1, 11))
HEAD = 4


def _gen(d: Path, *more: Any, text: bool = False) -> list[Any]:
    prompt = ["-p", "def f(x):"] if text else ["--tokens", ",".join(map(str, TOKENS))]
    return ["generate", d, *prompt, "-n", "2", *more]


@pytest.mark.slow
def test_huge_counts_in_config_json_are_named_errors(m: dict[str, Path]) -> None:
    rows = [Case(f"config.json {key}", _gen(m[f"cfg-{key}"]), 2, ("config.json", key, str(value), "at most"))
            for key, value in (("num_experts", BIG), ("hidden_size", BIG), ("vocab_size", BIG),
                               ("num_hidden_layers", 10**8), ("head_dim", 10**9), ("moe_intermediate_size", BIG),
                               ("num_attention_heads", BIG))]
    rows.append(Case("config.json of 20 MB", _gen(m["cfg-huge-file"]), 2, ("config.json", "too large")))
    check_table(rows)


@pytest.mark.slow
def test_an_index_that_lies_about_its_counts_is_a_named_error(m: dict[str, Path]) -> None:
    def idx(name: str) -> Path:
        return m[f"idx-{name}"] / "experts"

    check_table([
        Case("index: a record more than the file holds", _gen(m["idx-more-experts"]), 2,
             ("layer_000.bin", "truncated", "65 records")),
        Case("index: 10**12 experts", ["verify-store", idx("num-experts")], 2,
             ("index.json", f"num_experts {BIG}", "at most 65536")),
        Case("index: records of a terabyte", ["verify-store", idx("record-bytes")], 2,
             ("index.json", f"record_nbytes {1 << 40}", "at most")),
        Case("index: align of a terabyte", _gen(m["idx-align"]), 2, ("index.json", f"align {1 << 40}")),
        Case("index: negative tensor shape", ["verify-store", idx("negative-shape")], 2,
             ("index.json", "gate_proj.weight", "none negative")),
        Case("index: layer id 10**9", ["verify-store", idx("layer-id")], 2, ("index.json", "layer id 1000000000")),
        Case("index: 17 x 65536 records", ["verify-store", idx("records")], 2,
             ("index.json", "1114112 expert records", "at most 1048576")),
    ])


@pytest.mark.slow
def test_a_fifo_directory_or_device_is_refused_by_name(m: dict[str, Path]) -> None:
    what = {"fifo": "a FIFO", "dir": "a directory", "dev": "a device"}
    rows = []
    for name, kind, text in (
        ("config.json", "fifo", False), ("config.json", "dir", False), ("config.json", "dev", False),
        ("experts/index.json", "fifo", False), ("experts/index.json", "dir", False),
        ("experts/index.json", "dev", False), ("experts/layer_000.bin", "fifo", False),
        ("model.safetensors", "fifo", False), ("model.safetensors", "dir", False),
        ("mtp.safetensors", "fifo", False),
        ("tokenizer.json", "fifo", True), ("tokenizer_config.json", "dev", True), ("chat_template.jinja", "fifo", True),
        ("generation_config.json", "fifo", True), ("generation_config.json", "dev", True),
    ):
        rows.append(Case(f"{name} is {what[kind]}", _gen(m[f"{name}-{kind}"], text=text), 2,
                         (name.split("/")[-1], what[kind])))
    rows.append(Case("shard index is a FIFO", _gen(m["shard-index-fifo"]), 2,
                     ("model.safetensors.index.json", "a FIFO")))
    for kind in ("fifo", "dir", "dev"):
        rows.append(Case(f"--config is {what[kind]}", _gen(m["qn"], "--config", m[f"toml-{kind}"]), 2,
                         ("config file", "qnpipe.toml", what[kind])))
    rows.append(Case("QNPIPE_CONFIG names a FIFO", _gen(m["qn"]), 2, ("qnpipe.toml", "a FIFO"),
                     env=(("QNPIPE_CONFIG", str(m["toml-fifo"])),)))
    check_table(rows)


@pytest.mark.slow
def test_optional_files_that_are_not_regular_warn_and_the_answer_comes(m: dict[str, Path]) -> None:
    heat, snaps = m["heat"], m["snaps"]
    check_table([
        Case("heat file is a FIFO", _gen(m["qn"], "--set", f"pool.autopin_usage_file={heat / 'fifo.json'}"), 0,
             ("HeatFileWarning", str(heat / "fifo.json"), "a FIFO", "generated")),
        Case("heat file is a directory", _gen(m["qn"], "--set", f"pool.autopin_usage_file={heat / 'dir.json'}"), 0,
             ("HeatFileWarning", str(heat / "dir.json"), "a directory", "generated"), clean=(heat,)),
        Case("snapshot file is a FIFO", _gen(m["qn"], "--set", f"prefix.snapshot_dir={snaps}", "--set",
                                             f"prefix.snapshot_head_tokens={HEAD}"), 0,
             ("SnapshotFileWarning", str(snaps), "a FIFO", "generated"), clean=(snaps,)),
    ])


@pytest.mark.slow
def test_a_heat_file_naming_what_the_model_lacks_warns_and_the_model_generates(m: dict[str, Path]) -> None:
    """Issue 22 item 9: before, a heat file with expert 999 made the model unusable (exit 2)."""
    heat = m["heat"]
    check_table([
        Case(f"heat file with {what}", _gen(m["qn"], "--set", f"pool.autopin_usage_file={heat / f'{name}.json'}",
                                            "--set", "pool.expert_slots=16"), 0,
             ("HeatFileWarning", str(heat / f"{name}.json"), what, "autopin starts from zero", "generated"),
             clean=(heat,))
        for name, what in (("expert", "expert 999 out of range"), ("layer", "layer 99 is not a MoE layer"),
                           ("negative", "expert -4 out of range"))
    ])


def test_count_settings_beyond_their_bound_are_named_errors(m: dict[str, Path]) -> None:
    qn = m["qn"]
    need = ("read.workers", "1000000000", "at most 1024")
    check_table([
        Case("--set read.workers=10**9", _gen(qn, "--set", "read.workers=1000000000"), 2, need),
        Case("TOML read.workers=10**9", _gen(qn, "--config", m["workers.toml"]), 2, (*need, "workers.toml")),
        Case("QNPIPE_READ__WORKERS=10**9", _gen(qn), 2, need, env=(("QNPIPE_READ__WORKERS", "1000000000"),)),
        Case("-K 10**9", _gen(qn, "--mtp", "-K", "1000000000"), 2, ("mtp.num_draft_tokens", "at most 64")),
        Case("pool.side_region_slots=10**9", _gen(qn, "--set", "pool.side_region_slots=1000000000", "--set",
                                                  "predict.cross_layer_prefetch=true"), 2,
             ("pool.side_region_slots", "at most 1024")),
    ])
