"""Issue 22 items 1 and 10: the directories and files qnpipe writes, and the messages around them.

The table runs the real `qnpipe` command (tests/cli_harness.py: a subprocess under a memory
limit and a timeout) on output paths a new user could give: `.` and `..`, a directory that
is not a qnpipe output, a file, /proc, a read-only and a full file system (small tmpfs
mounts: we run as root; without mount rights those rows are skipped, saying why). The other
tests kill a replace between its steps with SIGKILL, and stop `generate` with SIGTERM and
SIGHUP to check the heat is saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.io.outdir import TMP_TAG
from tests.cli_harness import Case, check_table, clean_env, leftovers

# --------------------------------------------------------------------------- small file systems


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, *, ro: bool = False) -> Iterator[Path | str]:
    """A tmpfs of `size` mounted on `where` (yields the path), or the reason it could not be mounted."""
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        yield f"cannot run mount: {e}"
        return
    if r.returncode != 0:
        yield f"mount -t tmpfs failed (no mount rights?): {r.stderr.decode(errors='replace').strip()}"
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


def _fill(d: Path) -> None:
    """Fill the file system of `d` to the last byte."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (65536, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[dict[str, Path | str]]:
    """"full": a 1 MiB tmpfs filled up; "ro": a read-only tmpfs. A str value says why it is missing."""
    with _tmpfs(tmp_path / "mnt-full", "1m") as full, _tmpfs(tmp_path / "mnt-ro", "1m", ro=True) as ro:
        if isinstance(full, Path):
            _fill(full)
        yield {"full": full, "ro": ro}


def _mounted(m: Path | str, rows: list[Case]) -> list[Case]:
    if isinstance(m, str):
        print(f"rows skipped ({', '.join(r.name for r in rows)}): {m}", file=sys.stderr)
        return []
    return rows


# --------------------------------------------------------------------------- item 1 + 10: the table


@pytest.mark.slow
def test_output_paths_and_messages(tmp_path: Path, tiny_hf: Path, mounts: dict[str, Path | str]) -> None:
    from qnpipe.convert.tiny import make_tiny

    tree = tmp_path / "tree"
    work = tree / "work"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("the user's work")
    (tree / "sibling").mkdir()
    (tree / "sibling" / "data.txt").write_text("a sibling")
    (tree / "top.txt").write_text("a file of the parent")
    foreign = tree / "notes"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    a_file = tree / "file.txt"
    a_file.write_text("a file")
    own = tree / "own"
    make_tiny(own, config_overrides={"num_hidden_layers": 1, "num_experts": 2, "num_experts_per_tok": 1})
    full, ro = mounts["full"], mounts["ro"]
    fp = Path(str(full))
    rp = Path(str(ro))
    save_full = f"/save {fp / 'conv.json'}\n" if isinstance(full, Path) else ""
    saves_full = (f"{fp / 'conv.json'}: No space left on device",) if isinstance(full, Path) else ()
    cases = [
        Case("convert --out . --force replaces nothing", ["convert", tiny_hf, "--out", ".", "--force"], 2,
             ("--out", str(work), "current directory"), clean=(tree,)),
        Case("make-tiny .. --force replaces nothing", ["make-tiny", "..", "--force"], 2,
             (str(tree), "current directory"), clean=(tree,)),
        Case("convert --force on a directory qnpipe did not write", ["convert", tiny_hf, "--out", foreign, "--force"],
             2, (str(foreign), "not a qnpipe output"), clean=(tree,)),
        Case("make-tiny --force on a directory qnpipe did not write", ["make-tiny", foreign, "--force"], 2,
             (str(foreign), "not a qnpipe output"), clean=(tree,)),
        Case("make-tiny --force on a file", ["make-tiny", a_file, "--force"], 2, (str(a_file), "not a directory"),
             clean=(tree,)),
        Case("convert --out in /proc", ["convert", tiny_hf, "--out", "/proc/qnpipe-out"], 2,
             ("/proc/qnpipe-out", "/proc")),
        Case("make-tiny --force replaces its own output", ["make-tiny", own, "--force", "--seed", "1"], 0,
             (str(own),), clean=(tree,)),
        *_mounted(ro, [
            Case("make-tiny on a read-only file system", ["make-tiny", rp / "m"], 2, (str(rp / "m"), "read-only")),
        ]),
        *_mounted(full, [
            Case("make-tiny on a full disk names the output", ["make-tiny", fp / "m"], 2,
                 (f"{fp / 'm'}:", "No space left on device"), clean=(fp,)),
            Case("convert on a full disk says how much it needs", ["convert", tiny_hf, "--out", fp / "qn"], 2,
                 (str(fp), "not enough free disk space"), clean=(fp,)),
        ]),
        # item 10: the messages
        Case("chat /save names the file: a missing directory, a full disk", ["chat", DEMO_MODEL_DIR], 0,
             (f"{tree / 'no' / 'conv.json'}:", *saves_full),
             stdin=f"/save {tree / 'no' / 'conv.json'}\n{save_full}/quit\n".encode(), clean=(tree, fp)),
        Case("generate --tokens out of the vocabulary", ["generate", tiny_hf, "--tokens", "5,999999"], 2,
             ("999999", "vocabulary", "1024")),
        Case("demo tells loading and warm-up from prefill", ["demo", "-n", "4"], 0,
             ("loaded in", "warm-up", "prompt tokens in")),
    ]
    try:
        check_table(cases, cwd=work)
        table = ""
    except AssertionError as e:
        table = str(e)
    # The data-loss bug replaced `tree` (the parent of the working directory) by the output.
    kept = {work / "mine.txt": "the user's work", tree / "sibling" / "data.txt": "a sibling",
            tree / "top.txt": "a file of the parent", foreign / "notes.txt": "not a model", a_file: "a file"}
    lost = [str(p) for p, text in kept.items() if not p.is_file() or p.read_text() != text]
    assert not table and not lost, f"{table}\nlost: {lost}"
    assert not (tree / "no").exists()
    if isinstance(full, Path):
        assert sorted(p.name for p in full.iterdir()) == ["filler"]


def test_json_of_the_engine_keeps_its_keys_and_adds_load_and_warm_up() -> None:
    """`generate --json` prints EngineStats under "engine": the timings are added keys, none removed."""
    import msgspec

    from qnpipe.stats import EngineStats

    keys = set(msgspec.to_builtins(EngineStats()))
    assert {"load_s", "warmup_s"} <= keys
    assert {"requests", "prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "decode_tok_s",
            "peak_memory_bytes", "expert_source", "pool", "prefix", "kv_bytes_per_token", "mtp"} <= keys


# --------------------------------------------------------------------------- item 1: a kill mid-replace

_KILL_BETWEEN = """
import os, signal, sys
from pathlib import Path
import qnpipe.io.outdir as od
from qnpipe.convert.tiny import make_tiny

out = Path(sys.argv[1])
mode = sys.argv[2]
real_rename, real_exchange = os.rename, getattr(od, "_exchange", None)

def rename(a, b, *args, **kw):
    real_rename(a, b, *args, **kw)
    if Path(a) == out:  # the old output is aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)

def exchange(a, b):
    if mode == "fallback":
        return False  # as on a file system without RENAME_EXCHANGE
    done = real_exchange(a, b)
    os.kill(os.getpid(), signal.SIGKILL)  # swapped, the old output not yet removed
    return done

os.rename = rename
od._exchange = exchange
make_tiny(out, seed=1, force=True)
"""


def _model_bytes(d: Path) -> bytes:
    return (d / "model.safetensors").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fallback", "exchange"])
def test_a_kill_between_the_steps_of_a_replace_keeps_a_complete_output(tmp_path: Path, mode: str) -> None:
    from qnpipe.convert.tiny import make_tiny

    out = tmp_path / "m"
    make_tiny(out, seed=0)
    old = _model_bytes(out)
    r = subprocess.run([sys.executable, "-c", _KILL_BETWEEN, str(out), mode], capture_output=True, timeout=120,
                       env=clean_env())
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    stale = [p for p in tmp_path.iterdir() if TMP_TAG in p.name]
    assert len(stale) == 1
    if mode == "exchange":
        assert _model_bytes(out) != old  # the new output is in place
        expected = _model_bytes(out)
    else:
        assert not out.exists() and _model_bytes(stale[0] / "old") == old  # nothing lost, only aside
        expected = old
    # The next run, even without --force, finds the interrupted replace and puts the output back.
    notes: list[str] = []
    with pytest.raises(FileExistsError):
        make_tiny(out, seed=2, log=notes.append)
    assert _model_bytes(out) == expected
    assert not leftovers(tmp_path), leftovers(tmp_path)
    assert any("interrupted run" in n for n in notes), notes
    if mode == "fallback":
        assert any(f"restored {out}" in n for n in notes), notes


def test_a_replace_keeps_the_old_output_aside_when_the_path_was_taken_again(tmp_path: Path) -> None:
    """Recovery never deletes the only copy: with OUT made again since the kill, the old one stays where it is."""
    from qnpipe.convert.tiny import make_tiny

    out = tmp_path / "m"
    make_tiny(out, seed=0)
    old = _model_bytes(out)
    r = subprocess.run([sys.executable, "-c", _KILL_BETWEEN, str(out), "fallback"], capture_output=True,
                       timeout=120, env=clean_env())
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()
    out.mkdir()
    (out / "new.txt").write_text("made since")
    notes: list[str] = []
    with pytest.raises(FileExistsError):
        make_tiny(out, log=notes.append)
    stale = [p for p in tmp_path.iterdir() if TMP_TAG in p.name]
    assert len(stale) == 1 and _model_bytes(stale[0] / "old") == old
    assert any(str(stale[0] / "old") in n and "kept" in n for n in notes), notes


# --------------------------------------------------------------------------- item 10: the heat on SIGTERM / SIGHUP


@pytest.fixture(scope="module")
def tiny_qn(tmp_path_factory: pytest.TempPathFactory, tiny_hf: Path) -> Path:
    """`tiny_hf` converted by qnpipe: experts stream, so autopin counts heat."""
    from qnpipe.convert import convert

    out = tmp_path_factory.mktemp("models") / "qn"
    convert(tiny_hf, out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_generate_saves_the_heat_when_terminated(tmp_path: Path, tiny_qn: Path, sig: int) -> None:
    heat = tmp_path / "heat.json"
    argv = [sys.executable, "-m", "qnpipe", "generate", str(tiny_qn), "--tokens", "1,2,3", "-n", "100000",
            "--set", "pool.autopin=true", "--set", f"pool.autopin_usage_file={heat}",
            "--set", "pool.autopin_save_every_forwards=1000000"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env()) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            os.set_blocking(proc.stdout.fileno(), False)
            deadline = time.monotonic() + 90
            got = b""
            while len(got) < 16:  # generating: some text is out
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "generate never printed"
                got += proc.stdout.read() or b""
                time.sleep(0.05)
            assert not heat.exists()  # the periodic save is off: only a save at exit writes it
            proc.send_signal(sig)
            rc = proc.wait(timeout=60)
            err = proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == 128 + sig, err
    assert "Traceback" not in err and signal.Signals(sig).name in err, err
    data = json.loads(heat.read_text())
    assert data, "the heat file is empty"
