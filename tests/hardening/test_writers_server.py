"""Issue 22 items 4, 5/6 (event logs) and 7 (the server) through the real `qnpipe` command.

Each row runs `python -m qnpipe ...` under a memory limit and a timeout (tests/cli_harness.py):
exit code, a message naming the path (the target, never its `.partial`: the needle is
`TARGET: cannot write`), no traceback, nothing left behind.

- writers: `--trace` into a directory, /proc, a missing directory, a device, a read-only file
  system, a full one (a small tmpfs: mid-run, and when only the close overflows it), past
  RLIMIT_FSIZE (EFBIG); the other writers of a log (`replay --set trace.event_log_path`,
  `trace synth -o`) on a full disk. Before the fix the full disk hung `generate` for good.
- log headers: counts out of bounds, a footer whose count lies, a frame longer than the file,
  a FIFO / a directory / a device as the log, for every command that reads one (replay,
  replay --train-log, trace stats, trace plot, trace fit-cost).
- serve: an empty API key (given as '', as blanks, as an empty file), a FIFO as the key file,
  a busy port, a bad event log path: all refused before the model loads.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from qnpipe.replay.synth import SynthSpec, write_synth
from qnpipe.trace import MAGIC, SCHEMA_VERSION, Footer, Header, ModelShape, Route, TraceWriter
from tests.cli_harness import MEM_LIMIT, Case, check_table, clean_env, leftovers

GEN_TIMEOUT = 45.0  # a generate row takes 3-6 s here; the full disk hung forever before the fix


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, *, ro: bool = False) -> Iterator[Path | None]:
    """A tmpfs of `size` on `where` (yields it), or None when this process cannot mount one."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs",
                            str(where)], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        yield None
        return
    if r.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


def _gen(model: Path, trace: object, n: int = 3) -> list[object]:
    return ["generate", model, "--tokens", "5,6,7,8,9", "-n", str(n), "--set", "pool.expert_slots=4",
            "--trace", trace]


# --------------------------------------------------------------------------- writers (item 4)


@pytest.mark.slow
def test_trace_into_a_bad_place_fails_before_the_model_loads(tiny_qn4: Path, tmp_path: Path) -> None:
    d = tmp_path / "w"
    (d / "adir").mkdir(parents=True)
    (d / "null").symlink_to("/dev/null")
    ro = tmp_path / "ro"
    with _tmpfs(ro, "64k", ro=True) as mounted:
        if mounted is None:  # not root: a directory without write permission does the same
            ro.mkdir(exist_ok=True)
            ro.chmod(0o555)
        rows = [
            Case("--trace a directory", _gen(tiny_qn4, d / "adir"), 2, (f"{d / 'adir'}: is a directory",), (d,)),
            Case("--trace in /proc", _gen(tiny_qn4, "/proc/run.qtrace"), 2, ("/proc/run.qtrace: cannot write",)),
            Case("--trace in a missing directory", _gen(tiny_qn4, d / "nope" / "run.qtrace"), 2,
                 (f"{d / 'nope' / 'run.qtrace'}: cannot write", "does not exist")),
            # A link to /dev/null, not /dev/null itself: the code this guards against renamed its
            # log over the target, and must not be able to replace the machine's /dev/null.
            Case("--trace a device", _gen(tiny_qn4, d / "null"), 2, (f"{d / 'null'}: not a regular file",)),
            Case("--trace a read-only directory", _gen(tiny_qn4, ro / "run.qtrace"), 2,
                 (f"{ro / 'run.qtrace'}: cannot write",), (ro,)),
            Case("serve, the event log a directory", ["serve", tiny_qn4, "--port", "0", "--set",
                                                      f"trace.event_log_path={d / 'adir'}"], 2,
                 (f"{d / 'adir'}: is a directory",), (d,), timeout=30),
        ]
        check_table(rows)
    assert list((d / "adir").iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_stops_the_writer_with_an_error_naming_the_target(tiny_qn4: Path, tmp_path: Path) -> None:
    log = tmp_path / "r.qtrace"
    write_synth(log, SynthSpec(layers=4, experts=64, top_k=4, tokens=4000, seed=1))
    with _tmpfs(tmp_path / "big", "64k") as mid, _tmpfs(tmp_path / "small", "16k") as end:
        if mid is None or end is None:
            pytest.skip("cannot mount a small tmpfs here (not root); test_efbig_... covers the same writer")
        rows = [
            # before the fix: no output, Ctrl-C ignored, a run.qtrace.partial left, until the timeout
            Case("generate, the disk fills mid-run", _gen(tiny_qn4, mid / "run.qtrace", n=300), 2,
                 (f"{mid / 'run.qtrace'}: cannot write the event log", "No space left"), (mid,), timeout=GEN_TIMEOUT),
            Case("generate, only the close overflows", _gen(tiny_qn4, end / "run.qtrace", n=3), 2,
                 (f"{end / 'run.qtrace'}: cannot write the event log", "No space left"), (end,),
                 timeout=GEN_TIMEOUT),
            Case("replay --set trace.event_log_path, full", ["replay", log, "--set", "replay.record_nbytes=4096",
                                                              "--set", f"trace.event_log_path={mid / 're.qtrace'}"], 2,
                 (f"{mid / 're.qtrace'}: cannot write the event log", "No space left"), (mid,), timeout=GEN_TIMEOUT),
            Case("trace synth -o, full", ["trace", "synth", "-o", mid / "s.qtrace", "--layers", "8", "--experts", "64",
                                          "--top-k", "4", "--tokens", "20000"], 2,
                 (f"{mid / 's.qtrace'}: cannot write the routing log", "No space left"), (mid,)),
        ]
        check_table(rows)
        assert list(mid.iterdir()) == [] and list(end.iterdir()) == []


@pytest.mark.slow
def test_efbig_stops_generate_with_an_error_naming_the_target(tiny_qn4: Path, tmp_path: Path) -> None:
    """RLIMIT_FSIZE: every write past 16 KB fails with EFBIG (Python ignores SIGXFSZ), no mount needed."""
    target = tmp_path / "run.qtrace"

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))

    args = [str(a) for a in _gen(tiny_qn4, target, n=100)]
    r = subprocess.run([sys.executable, "-m", "qnpipe", *args], capture_output=True, timeout=GEN_TIMEOUT,
                       env=clean_env(), preexec_fn=limits)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err[-800:]
    assert f"{target}: cannot write the event log (File too large)" in err and "Traceback" not in err
    assert leftovers(tmp_path) == [] and not target.exists()


# --------------------------------------------------------------------------- log headers (items 5, 6)


def _log(path: Path, shape: ModelShape | None, *, capacities: dict[int, int] | None = None,
         layers: tuple[int, ...] = ()) -> Path:
    header = Header(schema_version=SCHEMA_VERSION, fingerprint="test", model=shape, clock_start_t=0.0,
                    wall_start_unix_s=0.0, contents="routes", layers=layers, capacities=capacities or {})
    w = TraceWriter(path, header)
    k = shape.top_k if shape is not None and shape.top_k < 100 else 2
    for step in range(1, 4):
        w.write(Route(t=0.0, seq=step, step=step, layer=0, top_k=k, experts=tuple(range(k))))
    w.close(0, 0.0)
    return path


def _frames(data: bytes) -> list[int]:
    """The byte offset of every frame's length prefix."""
    pos, out = len(MAGIC), []
    while pos < len(data):
        out.append(pos)
        pos += 4 + int.from_bytes(data[pos:pos + 4], "little")
    return out


@pytest.mark.slow
def test_log_headers_and_non_regular_logs_are_refused_by_every_reader(tmp_path: Path) -> None:
    d = tmp_path
    ok = ModelShape(num_layers=2, moe_layers=(0, 1), num_experts=16, top_k=2, hidden_size=8)
    good = _log(d / "good.qtrace", ok)

    def shape(**kw: int | tuple[int, ...]) -> ModelShape:
        return ModelShape(**{"num_layers": 2, "moe_layers": (0, 1), "num_experts": 16, "top_k": 2,
                             "hidden_size": 8, **kw})  # type: ignore[arg-type]

    experts = _log(d / "experts.qtrace", shape(num_experts=10**12))
    layers = _log(d / "layers.qtrace", shape(num_layers=10**9))
    topk = _log(d / "topk.qtrace", shape(top_k=10**6))
    moe = _log(d / "moe.qtrace", shape(moe_layers=(0, 7)))
    hidden = _log(d / "hidden.qtrace", shape(hidden_size=10**15))
    caps = _log(d / "caps.qtrace", ok, capacities={0: 10**12})
    data = good.read_bytes()
    last = _frames(data)[-1]  # the footer: say 10**9 records
    footer = msgspec.msgpack.encode(Footer(records=10**9, dropped=0, clock_end_t=0.0))
    (lying := d / "lying.qtrace").write_bytes(data[:last] + len(footer).to_bytes(4, "little") + footer)
    second = _frames(data)[1]  # a record announcing 4 GB
    (long := d / "long.qtrace").write_bytes(data[:second] + (0xFFFF_FFF0).to_bytes(4, "little") + data[second + 4:])
    os.mkfifo(fifo := d / "fifo.qtrace")
    (adir := d / "dir.qtrace").mkdir()
    out = d / "out"
    out.mkdir()
    t = 20.0  # each answer is immediate; a FIFO blocked for good before the fix
    rp = ["replay"]
    rows = [
        Case("replay: good log", [*rp, good, "--set", "replay.record_nbytes=4096"], 0, ("steps",), timeout=60),
        Case("replay: 10^12 experts", [*rp, experts], 2, ("experts.qtrace", "num_experts", str(10**12)), timeout=t),
        Case("replay: 10^9 layers", [*rp, layers], 2, ("layers.qtrace", "num_layers", str(10**9)), timeout=t),
        Case("replay: top_k over the experts", [*rp, topk], 2, ("topk.qtrace", "top_k", str(10**6)), timeout=t),
        Case("replay: a MoE layer past the model", [*rp, moe], 2, ("moe.qtrace", "moe_layers"), timeout=t),
        Case("trace stats: hidden size 10^15", ["trace", "stats", hidden], 2, ("hidden.qtrace", "hidden_size"),
             timeout=t),
        Case("fit-cost: 10^12 slots", ["trace", "fit-cost", caps, "-o", out / "c.json"], 2,
             ("caps.qtrace", "capacities[0]", str(10**12)), (out,), timeout=t),
        Case("trace plot: 10^12 experts", ["trace", "plot", experts, "-o", out / "p.png"], 2,
             ("experts.qtrace", "num_experts"), (out,), timeout=t),
        Case("replay: the footer counts 10^9 records", [*rp, lying], 2, ("lying.qtrace", "footer", str(10**9),
                                                                         "holds 3 records"), timeout=t),
        Case("trace stats: a record of 4 GB announced", ["trace", "stats", long], 2,
             ("long.qtrace", "record 1", "4294967280 bytes announced"), timeout=t),
        Case("replay --train-log 10^12 experts", [*rp, good, "--predict", "transition", "--train-log", experts], 2,
             ("experts.qtrace", "num_experts"), timeout=t),
        Case("replay: a FIFO", [*rp, fifo], 2, ("fifo.qtrace", "FIFO"), timeout=t),
        Case("replay --train-log a FIFO", [*rp, good, "--predict", "transition", "--train-log", fifo], 2,
             ("fifo.qtrace", "FIFO"), timeout=t),
        Case("trace plot: a FIFO", ["trace", "plot", fifo, "-o", out / "p.png"], 2, ("fifo.qtrace", "FIFO"), (out,),
             timeout=t),
        Case("fit-cost: a FIFO", ["trace", "fit-cost", fifo, "-o", out / "c.json"], 2, ("fifo.qtrace", "FIFO"),
             (out,), timeout=t),
        Case("replay: a directory", [*rp, adir], 2, ("dir.qtrace", "directory"), timeout=t),
        Case("trace plot: a device", ["trace", "plot", "/dev/zero", "-o", out / "p.png"], 2, ("/dev/zero", "device"),
             (out,), timeout=t),
    ]
    check_table(rows)


# --------------------------------------------------------------------------- serve (item 7)


@pytest.fixture
def busy_port() -> Iterator[int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def _broken_weights(src: Path, dst: Path) -> Path:
    """`src` with its dense weights cut to 100 bytes: the checks before loading pass, the load fails."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes()[:100])
    return dst


@pytest.mark.slow
def test_serve_refuses_an_empty_key_and_a_busy_port_before_loading(tiny_qn4: Path, tmp_path: Path,
                                                                     busy_port: int) -> None:
    (empty := tmp_path / "empty.key").write_text("  \n")
    os.mkfifo(fifo := tmp_path / "fifo.key")
    broken = _broken_weights(tiny_qn4, tmp_path / "broken")
    s = ["serve", tiny_qn4, "--port", "0"]
    t = 20.0
    rows = [
        # before the fix: '' meant "no key" and the server ran open
        Case("--api-key ''", [*s, "--api-key", ""], 2, ("--api-key is empty",), timeout=t),
        Case("--api-key blanks", [*s, "--api-key", "   "], 2, ("--api-key is empty",), timeout=t),
        Case("--api-key '' on 0.0.0.0", ["serve", tiny_qn4, "--host", "0.0.0.0", "--port", "0", "--api-key", ""], 2,
             ("--api-key is empty",), timeout=t),
        Case("--api-key-file empty", [*s, "--api-key-file", empty], 2, ("empty.key", "empty"), timeout=t),
        Case("--api-key-file a FIFO", [*s, "--api-key-file", fifo], 2, ("fifo.key", "FIFO"), timeout=t),
        Case("--body-timeout 0", [*s, "--body-timeout", "0"], 2, ("--body-timeout",), timeout=t),
        # the port is taken: the answer must come before the weights load (these cannot load at all)
        Case("busy port, weights that cannot load", ["serve", broken, "--port", str(busy_port)], 2,
             (f"127.0.0.1:{busy_port}", "Address already in use"), timeout=t),
        Case("busy port", ["serve", tiny_qn4, "--port", str(busy_port)], 2,
             (f"127.0.0.1:{busy_port}", "Address already in use"), timeout=t),
    ]
    check_table(rows)
