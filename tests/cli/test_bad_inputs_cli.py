"""Issue 8: every bad input through the real `qnpipe` command (a subprocess) is a clear error.

One table: a row per case (the bad ones of issue 8 and the good ones next to them), each
checked for its exit status, for the file / key / value its message must name, and for no
"Traceback" on stderr. Rows that fail while parsing the arguments cost ~0.1 s; rows that get
as far as loading import MLX (~1 s each).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest


class Row(NamedTuple):
    name: str
    argv: list[Any]  # str, Path or bytes (bytes: an argument that is not valid UTF-8)
    rc: int
    needles: tuple[str, ...] = ()  # each must appear on stderr (or stdout for rc 0 rows)
    stdin: bytes | None = None
    env: tuple[tuple[str, str], ...] = ()  # extra environment


def _env() -> dict[str, str]:
    drop = ("QNPIPE_", "MOE_TOPK_OVERRIDE", "MODEL", "EXPERT_DIR", "PREFILL_CHUNK")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def run(argv: list[Any], stdin: bytes | None = None, timeout: float = 60,
        env: tuple[tuple[str, str], ...] = ()) -> subprocess.CompletedProcess[bytes]:
    args = [a if isinstance(a, bytes) else str(a) for a in argv]
    return subprocess.run([sys.executable, "-m", "qnpipe", *args], input=stdin if stdin is not None else b"",
                          capture_output=True, timeout=timeout, env=_env() | dict(env))


def _linked_copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """`dst` with symlinks to `src`'s files (cheap), except those in `skip`."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).symlink_to(f)
    return dst


def _with_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A linked copy of `src` whose config.json has `changes` (value None: key removed)."""
    _linked_copy(src, dst, skip=("config.json",))
    cfg = json.loads((src / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _edit_index(d: Path, edit) -> Path:
    p = d / "experts" / "index.json"
    raw = json.loads(p.read_text())
    edit(raw)
    p.write_text(json.dumps(raw))
    return d


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path, tiny_qn4: Path) -> dict[str, Path]:
    from qnpipe.convert.tiny import make_tiny

    t = tmp_path_factory.mktemp("bad")
    d: dict[str, Path] = {"tmp": t}
    d["bf16"] = make_tiny(t / "bf16", dtype="bfloat16")
    d["notok"] = _linked_copy(tiny_hf, t / "notok", skip=("tokenizer.json",))
    d["topk0"] = _with_config(tiny_hf, t / "topk0", num_experts_per_tok=0)
    d["topk65"] = _with_config(tiny_hf, t / "topk65", num_experts_per_tok=65)
    d["fai0"] = _with_config(tiny_hf, t / "fai0", full_attention_interval=0)
    d["hidden0"] = _with_config(tiny_hf, t / "hidden0", hidden_size=-4)
    d["notype"] = _with_config(tiny_hf, t / "notype", model_type=None)
    d["shortctx"] = _with_config(tiny_hf, t / "shortctx", max_position_embeddings=4)
    d["cfgdir"] = _linked_copy(tiny_hf, t / "cfgdir", skip=("config.json",))
    (d["cfgdir"] / "config.json").mkdir()
    d["badjson"] = _linked_copy(tiny_hf, t / "badjson", skip=("config.json",))
    (d["badjson"] / "config.json").write_bytes(b'{"model_type": "qwen3_next", \xff')
    d["toml"] = t / "latin1.toml"
    d["toml"].write_bytes("[read]\nbackend = \"caf\xe9\"\n".encode("latin-1"))
    d["afile"] = t / "a-file"
    d["afile"].write_text("x")
    d["exists"] = make_tiny(t / "exists")
    for name, edit in (
        ("nolayer", lambda raw: raw["layers"].pop(2)),
        ("shape", lambda raw: raw["layers"][0]["tensors"][0].update(
            shape=list(reversed(raw["layers"][0]["tensors"][0]["shape"])))),
        ("bits", lambda raw: raw["layers"][1]["quant"]["up_proj"].update(bits=8)),
    ):
        shutil.copytree(tiny_qn4, t / name)
        d[name] = _edit_index(t / name, edit)
    shutil.copytree(tiny_qn4, t / "fifo")
    (t / "fifo" / "experts" / "layer_004.bin").unlink()
    os.mkfifo(t / "fifo" / "experts" / "layer_004.bin")
    d["fifo"] = t / "fifo"
    shutil.copytree(tiny_qn4, t / "corrupt")
    layer = t / "corrupt" / "experts" / "layer_003.bin"
    raw = bytearray(layer.read_bytes())
    raw[5 * (len(raw) // 64) + 100] ^= 0x04  # expert 5 of 64, inside its record
    layer.write_bytes(bytes(raw))
    d["corrupt"] = t / "corrupt"
    return d


def rows(hf: Path, qn: Path, b: dict[str, Path]) -> list[Row]:
    gen = ["generate", hf, "-p", "def f("]
    t = b["tmp"]
    return [
        # --- good cases
        Row("generate ok", [*gen, "-n", "4"], 0, ("prompt tokens",)),
        Row("generate tokens json ok", ["generate", qn, "--tokens", "1,2,3", "-n", "3", "--json",
                                        "--set", "read.verify_crc32=true"], 0, ('"tokens"',)),
        Row("verify-store ok", ["verify-store", qn], 0, ("OK",)),
        Row("make-tiny ok", ["make-tiny", t / "fresh"], 0, ("fresh",)),
        Row("--set stripped", [*gen, "-n", "2", "--set", " forward.prefill_chunk_tokens = 2 "], 0),
        Row("chat ok, empty lines and /unknown not sent", ["chat", hf, "-n", "2"], 0,
            ("unknown command /frobnicate",), stdin=b"\n   \n/frobnicate\nhello\n/quit\n"),
        # --- 3: unquantized bf16 on the CPU backend
        Row("bf16 on cpu", ["generate", b["bf16"], "-p", "hi"], 2,
            ("bfloat16", "qnpipe convert", "--dtype float32", "--bits 4")),
        # --- 4: arguments checked before loading
        Row("-n -5", [*gen, "-n", "-5"], 2, ("--max-tokens", "-5")),
        Row("-n x", [*gen, "-n", "x"], 2, ("--max-tokens", "'x'")),
        Row("--top-p 0", [*gen, "--top-p", "0"], 2, ("--top-p", "(0, 1]", "0.0")),
        Row("--top-p 2", [*gen, "--top-p", "2"], 2, ("--top-p", "2.0")),
        Row("--top-p nan", [*gen, "--top-p", "nan"], 2, ("--top-p", "nan")),
        Row("--temperature nan", [*gen, "--temperature", "nan"], 2, ("--temperature", "nan")),
        Row("--temperature -1", [*gen, "--temperature", "-1"], 2, ("--temperature", "-1.0")),
        Row("--seed -1", [*gen, "--seed", "-1"], 2, ("--seed", "-1")),
        Row("-p ''", ["generate", hf, "-p", ""], 2, ("--prompt", "empty")),
        Row("--tokens ''", ["generate", hf, "--tokens", ""], 2, ("--tokens", "empty")),
        Row("--tokens 1.5", ["generate", hf, "--tokens", "1.5"], 2, ("--tokens", "1.5")),
        Row("--tokens -3", ["generate", hf, "--tokens", "4,-3"], 2, ("--tokens", "-3")),
        Row("chat -n -1", ["chat", hf, "-n", "-1"], 2, ("--max-tokens",)),
        # --- 5: tokenizer_config.json without tokenizer.json
        Row("no tokenizer.json", ["generate", b["notok"], "-p", "hi"], 2, (str(b["notok"] / "tokenizer.json"), "missing")),
        # --- 6: output locations
        Row("make-tiny /proc", ["make-tiny", "/proc/qnpipe-out"], 2, ("/proc/qnpipe-out", "cannot write")),
        Row("make-tiny under a file", ["make-tiny", b["afile"] / "out"], 2, (str(b["afile"]), "not a directory")),
        Row("convert --out /proc", ["convert", hf, "--out", "/proc/qnpipe-out", "-q"], 2,
            ("/proc/qnpipe-out", "cannot write")),
        Row("convert --out under a file", ["convert", hf, "--out", b["afile"] / "out", "-q"], 2,
            (str(b["afile"]), "not a directory")),
        # --- 7: impossible configs
        Row("num_experts_per_tok 0", ["generate", b["topk0"], "-p", "hi"], 2, ("config.json", "num_experts_per_tok", "0")),
        Row("num_experts_per_tok 65", ["generate", b["topk65"], "-p", "hi"], 2, ("num_experts_per_tok", "65", "64")),
        Row("full_attention_interval 0", ["generate", b["fai0"], "-p", "hi"], 2, ("full_attention_interval", "0")),
        Row("hidden_size -4", ["generate", b["hidden0"], "-p", "hi"], 2, ("hidden_size", "-4")),
        Row("model_type missing", ["generate", b["notype"], "-p", "hi"], 2, ("model_type is missing",)),
        Row("a file as model dir", ["generate", hf / "config.json", "-p", "hi"], 2, ("is a file, not a model directory",)),
        Row("config.json a directory", ["generate", b["cfgdir"], "-p", "hi"], 2, ("config.json", "not a regular file")),
        Row("config.json not JSON", ["generate", b["badjson"], "-p", "hi"], 2, ("config.json", "not valid JSON")),
        # --- 8: non-UTF-8 input
        Row("prompt not UTF-8", ["generate", hf, "-p", b"caf\xe9"], 2, ("--prompt", "UTF-8", "0xe9")),
        Row("TOML not UTF-8", [*gen, "--config", b["toml"]], 2, (str(b["toml"]), "UTF-8")),
        Row("chat line not UTF-8", ["chat", hf, "-n", "1"], 0, ("not valid UTF-8",), stdin=b"caf\xe9\n/quit\n"),
        # --- 9: verify-store and the loader agree
        Row("layer missing: verify-store", ["verify-store", b["nolayer"]], 2, ("missing layer(s) [2]",)),
        Row("layer missing: generate", ["generate", b["nolayer"], "-p", "hi"], 2, ("missing layer(s) [2]",)),
        Row("tampered shape: verify-store", ["verify-store", b["shape"]], 2, ("gate_proj.weight has shape",)),
        Row("tampered shape: generate", ["generate", b["shape"], "-p", "hi"], 2, ("gate_proj.weight has shape",)),
        Row("tampered bits: verify-store", ["verify-store", b["bits"]], 2, ("layer 1", "up_proj")),
        Row("tampered bits: generate", ["generate", b["bits"], "-p", "hi"], 2, ("layer 1", "up_proj")),
        Row("FIFO layer file: verify-store", ["verify-store", b["fifo"]], 1, ("layer_004.bin", "FIFO")),
        Row("FIFO layer file: generate", ["generate", b["fifo"], "-p", "hi"], 2, ("layer_004.bin", "FIFO")),
        Row("corrupt record: verify-store", ["verify-store", b["corrupt"]], 1, ("layer 3 expert 5", "checksum mismatch")),
        # --- 11: smaller
        Row("MOE_TOPK_OVERRIDE above num_experts", [*gen, "--set", "forward.moe_topk_override=65"], 2,
            ("moe_topk_override=65", "64 experts")),
        Row("MOE_TOPK_OVERRIDE=65 in the environment", [*gen], 2, ("moe_topk_override=65", "64 experts"),
            env=(("MOE_TOPK_OVERRIDE", "65"),)),
        Row("chat --json rejected", ["chat", hf, "--json"], 2, ("--json",)),
        Row("make-tiny exists says --force", ["make-tiny", b["exists"]], 2, (str(b["exists"]), "--force")),
        Row("--set model.model_dir beside MODEL_DIR", [*gen, "-n", "1", "--set", "model.model_dir=/nowhere"], 0,
            ("wins over --set model.model_dir=/nowhere",)),
        Row("prompt longer than max_position_embeddings", ["generate", b["shortctx"], "-p", "def f(a, b): return a",
                                                           "-n", "1"], 0, ("max_position_embeddings (4)",)),
    ]


@pytest.mark.slow
def test_bad_inputs_table(tiny_hf: Path, tiny_qn4: Path, bad: dict[str, Path]) -> None:
    failures = []
    table = rows(tiny_hf, tiny_qn4, bad)
    assert len({r.name for r in table}) == len(table)
    for row in table:
        p = run(row.argv, row.stdin, env=row.env)
        err = p.stderr.decode(errors="replace")
        out = p.stdout.decode(errors="replace")
        problems = []
        if p.returncode != row.rc:
            problems.append(f"exit {p.returncode}, expected {row.rc}")
        if "Traceback" in err:
            problems.append("a traceback on stderr")
        problems += [f"no {n!r} in the output" for n in row.needles if n not in err + out]
        if problems:
            failures.append(f"{row.name}: {'; '.join(problems)}\n  stderr: {err[-600:]}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_closed_pipe_exits_quietly(tiny_hf: Path) -> None:
    """`qnpipe generate ... | head`: the reader goes away; no BrokenPipeError traceback, exit 141 (SIGPIPE)."""
    for extra in ([], ["--json"]):
        p = subprocess.Popen([sys.executable, "-m", "qnpipe", "generate", str(tiny_hf), "-p", "def f(", "-n", "20",
                              *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # before the first byte is written
        err = p.stderr.read().decode()
        p.stderr.close()
        assert p.wait(timeout=60) == 141, err
        assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.slow
def test_verify_crc32_setting_catches_corruption_on_eager_load(bad: dict[str, Path]) -> None:
    # Eager load reads every record; the streamed path is tests/pool/test_faults.py.
    eager = ["--set", "pool.eager_load=true"]
    p = run(["generate", bad["corrupt"], "--tokens", "1,2", "-n", "1", "--set", "read.verify_crc32=true", *eager])
    err = p.stderr.decode()
    assert p.returncode == 2 and "layer 3 expert 5" in err and "Traceback" not in err, err
    assert run(["generate", bad["corrupt"], "--tokens", "1,2", "-n", "1", *eager]).returncode == 0  # off: trusts the disk
