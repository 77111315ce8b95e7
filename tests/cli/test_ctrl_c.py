"""Issue 8: Ctrl-C in a real terminal, and `kill -INT` without one, stop the real `qnpipe` command.

`qnpipe generate` and `qnpipe chat` run in a pseudo-terminal (pexpect); Ctrl-C is the
terminal's interrupt character (`sendintr`), so the kernel sends SIGINT to the foreground
process group as a shell would. The stop is timed from the interrupt to the end of the
output (the process has exited): the engine stops at its next layer, well under a second.

The model is a random tiny one (seed 3) that emits no EOS for thousands of greedy tokens
after the prompts used here (checked: 3000 tokens), so `-n 100000` runs until interrupted.
The streamed case uses 4 expert slots per layer (of 64): every step reads experts from disk.
"""

from __future__ import annotations

import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

pexpect = pytest.importorskip("pexpect")

# The stop's latency is printed, not asserted: on 2 shared cores a bound fails for the load, not the code
# (measured 0.1-0.4 s to the stop, 0.2-1.1 s to the exit at load 10). What is asserted: the stop comes
# (within the hang guard), the generation did not run to its end, exit 130, no crash.
HANG_S = 60  # hang guard for every wait: import MLX, load the model, first token, the stop
PROMPT = "x = 1"  # greedy: no EOS for 3000 tokens on the seed-3 tiny model
LONG_CHAT = "hi"  # chat template, greedy: no EOS for 2000 tokens
SHORT_CHAT = "yes"  # chat template, greedy: EOS after 46 tokens
BAD = ("Traceback", "terminate called", "Abort", "Segmentation", "core dumped")
IGNORE_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                 "os.execv(sys.executable, [sys.executable, '-m', 'qnpipe', *sys.argv[1:]])")

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """The environment for the child: no qnpipe settings, and this checkout's qnpipe first on the path."""
    import qnpipe

    drop = ("QNPIPE_", "MOE_TOPK_OVERRIDE", "MODEL", "EXPERT_DIR", "PREFILL_CHUNK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    root = str(Path(qnpipe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """resident: the tiny model in the HF layout (experts in memory); streamed: it converted (experts on disk)."""
    from qnpipe.convert import convert
    from qnpipe.convert.tiny import make_tiny

    root = tmp_path_factory.mktemp("ctrl_c")
    hf = make_tiny(root / "hf", layout="hf", seed=3)
    convert(hf, root / "qn")
    return {"resident": hf, "streamed": root / "qn"}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, str]:
    """The first 160 greedy tokens after PROMPT, as text, per model (the interrupted runs print a prefix)."""
    import qnpipe

    out = {}
    for name, path in models.items():
        with qnpipe.Engine(path) as eng:
            out[name] = eng.generate(PROMPT, max_tokens=160).text
    return out


def _gen_args(model: Path, streamed: bool) -> list[str]:
    slow = ["--set", "pool.expert_slots=4", "--set", "read.nocache=true"] if streamed else []
    return ["generate", str(model), "-p", PROMPT, "-n", "100000", *slow]


def _spawn(args: list[str]) -> tuple[Any, io.StringIO]:
    """`qnpipe ARGS` in a pseudo-terminal (its own session, the terminal's foreground group) and its log."""
    child = pexpect.spawn(sys.executable, ["-m", "qnpipe", *args], env=_env(), encoding="utf-8",
                          codec_errors="replace", timeout=HANG_S, echo=False, dimensions=(24, 200))
    log = io.StringIO()
    child.logfile_read = log  # everything the terminal showed
    return child, log


def _interrupt(child: Any, *until: Any) -> list[float]:
    """Ctrl-C; the seconds until each of `until` (patterns, or pexpect.EOF) has appeared, in turn."""
    t = time.monotonic()
    child.sendintr()
    took = []
    for u in until:
        child.expect(u, timeout=HANG_S)
        took.append(time.monotonic() - t)
    return took


@pytest.mark.parametrize("kind", ["resident", "streamed"])
def test_generate_ctrl_c_in_terminal(models: dict[str, Path], reference: dict[str, str], kind: str) -> None:
    """One Ctrl-C: stops, what was generated so far is on screen, exit 130, no crash."""
    child, log = _spawn(_gen_args(models[kind], kind == "streamed"))
    child.expect(r"\S{20}")  # the text is streaming
    time.sleep(0.3)
    stop, gone = _interrupt(child, "qnpipe generate: interrupted", pexpect.EOF)
    child.close()
    out = log.getvalue()
    print(f"{kind}: stopped {stop:.3f}s, exited {gone:.3f}s after Ctrl-C, {len(out)} characters shown")
    assert (child.exitstatus, child.signalstatus) == (130, None), out[-2000:]
    assert not [b for b in BAD if b in out], out[-2000:]
    shown, sep, _ = out.rpartition("\r\nqnpipe generate: interrupted")
    assert sep, out[-2000:]
    # The terminal shows "\n" as "\r\n". What is shown is the greedy continuation, as far as it got.
    ref = reference[kind].replace("\n", "\r\n")
    assert len(shown) >= 20
    assert ref.startswith(shown) or shown.startswith(ref), (shown[:300], ref[:300])


def test_chat_ctrl_c_stops_the_answer_and_returns_to_the_prompt(models: dict[str, Path]) -> None:
    """Ctrl-C during an answer: back to `you> `; the next message gets a whole answer; Ctrl-D exits 0."""
    child, log = _spawn(["chat", str(models["resident"]), "-n", "100000"])
    child.expect_exact("you> ")
    child.sendline(LONG_CHAT)
    child.expect_exact("assistant> ")
    child.expect(r"\S{20}")  # the answer is streaming (it would run for thousands of tokens)
    time.sleep(0.3)
    (took,) = _interrupt(child, r"\[answer interrupted\]\r\nyou> ")
    print(f"chat: back at the prompt {took:.3f}s after Ctrl-C")
    assert child.isalive()
    child.sendline("/reset")  # the next answer does not depend on how much of the first one was shown
    child.expect_exact("you> ")
    child.sendline(SHORT_CHAT)
    child.expect_exact("assistant> ")
    child.expect_exact("you> ", timeout=HANG_S)  # a whole answer, ended by EOS
    answer = child.before.strip()
    assert len(answer) > 5, answer
    child.sendeof()
    child.expect(pexpect.EOF, timeout=HANG_S)
    child.close()
    out = log.getvalue()
    assert (child.exitstatus, child.signalstatus) == (0, None), out[-2000:]
    assert not [b for b in BAD if b in out] and "interrupted\r\n" not in out.replace("[answer interrupted]", ""), \
        out[-2000:]


def test_chat_ctrl_c_at_the_prompt_exits_130(models: dict[str, Path]) -> None:
    """Ctrl-C at the empty `you> ` prompt leaves, as an interrupted command does: exit 130, no traceback."""
    child, log = _spawn(["chat", str(models["resident"])])
    child.expect_exact("you> ")
    (took,) = _interrupt(child, pexpect.EOF)
    child.close()
    out = log.getvalue()
    assert (child.exitstatus, child.signalstatus) == (130, None), out[-2000:]
    print(f"chat: exited {took:.3f}s after Ctrl-C at the prompt")
    assert not [b for b in BAD if b in out], out[-2000:]


class _Drain(threading.Thread):
    """Reads a pipe to its end in the background; `.data` so far."""

    def __init__(self, f: IO[bytes]):
        super().__init__(daemon=True)
        self.f, self.data = f, b""
        self.interrupted_at: float | None = None  # when "interrupted" arrived

    def run(self) -> None:
        while chunk := os.read(self.f.fileno(), 65536):
            self.data += chunk
            if self.interrupted_at is None and b"interrupted" in self.data:
                self.interrupted_at = time.monotonic()


# How the process is started, without a terminal: argv prefix (before "generate ...") and Popen options.
HOW = {
    "plain": ([sys.executable, "-m", "qnpipe"], {}),
    "new-session": ([sys.executable, "-m", "qnpipe"], {"start_new_session": True}),
    # As a shell without job control starts a background job: SIGINT ignored, inherited through exec.
    "sigint-ignored": ([sys.executable, "-c", IGNORE_SIGINT], {}),
}


@pytest.mark.parametrize("how", list(HOW))
def test_kill_int_without_a_terminal(models: dict[str, Path], how: str) -> None:
    """`kill -INT PID` of a `qnpipe generate` with no terminal: stops, exit 130."""
    t0 = time.monotonic()
    prefix, opts = HOW[how]
    argv = [*prefix, *_gen_args(models["streamed"], streamed=True)]
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env(), **opts)
    assert p.stdout is not None and p.stderr is not None
    out, err = _Drain(p.stdout), _Drain(p.stderr)
    out.start()
    err.start()
    try:
        while len(out.data.strip()) < 20:  # the text is streaming
            assert p.poll() is None, err.data.decode(errors="replace")
            if time.monotonic() - t0 > HANG_S:  # hang guard
                pytest.fail("no text yet")
            time.sleep(0.05)
        if how == "sigint-ignored":
            assert _sigint_ignored(p.pid) in (False, None)  # qnpipe took SIGINT back (it was ignored at exec)
        time.sleep(0.3)
        t = time.monotonic()
        os.kill(p.pid, signal.SIGINT)
        rc = p.wait(timeout=HANG_S)
        gone = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out.join(5)
    err.join(5)
    p.stdout.close()
    p.stderr.close()
    text = out.data.decode(errors="replace") + err.data.decode(errors="replace")
    stop = (err.interrupted_at or float("inf")) - t
    print(f"{how}: stopped {stop:.3f}s, exited {gone:.3f}s after SIGINT")
    assert rc == 130, text[-2000:]
    assert "qnpipe generate: interrupted" in text and not [b for b in BAD if b in text], text[-2000:]


def test_kill_int_of_a_background_job_of_a_non_interactive_shell(models: dict[str, Path]) -> None:
    """`bash -c 'qnpipe generate ... &'`: bash starts the job with SIGINT ignored; `kill -INT` still stops it."""
    # The premise: this bash gives its background jobs SIGINT ignored.
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    premise = subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)} & wait"],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert premise.stdout.strip() == "True", premise
    t0 = time.monotonic()
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "qnpipe",
                                             *_gen_args(models["streamed"], streamed=True)])
    script = f"{cmd} > \"$1\" 2>&1 & echo $!; wait $!"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"qnpipe-ctrl-c-{os.getpid()}.log"
    p = subprocess.Popen(["bash", "-c", script, "bash", str(log)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, env=_env())
    assert p.stdout is not None
    try:
        pid = int(p.stdout.readline())
        while not log.exists() or len(log.read_bytes().strip()) < 20:  # the text is streaming
            assert p.poll() is None, log.read_text(errors="replace") if log.exists() else ""
            if time.monotonic() - t0 > HANG_S:  # hang guard
                pytest.fail("no text yet")
            time.sleep(0.05)
        time.sleep(0.3)
        t = time.monotonic()
        os.kill(pid, signal.SIGINT)
        stop = float("inf")
        while p.poll() is None and time.monotonic() - t < HANG_S:
            if stop == float("inf") and b"interrupted" in log.read_bytes():
                stop = time.monotonic() - t
            time.sleep(0.01)
        rc = p.wait(timeout=HANG_S)  # bash's `wait $!`: the job's exit status
        gone = time.monotonic() - t
        if stop == float("inf") and b"interrupted" in log.read_bytes():
            stop = gone  # written just before the exit, between two looks
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
    text = log.read_text(errors="replace")
    log.unlink()
    print(f"bash background job: stopped {stop:.3f}s, exited {gone:.3f}s after SIGINT")
    assert rc == 130, text[-2000:]
    assert "qnpipe generate: interrupted" in text and not [b for b in BAD if b in text], text[-2000:]


def _sigint_ignored(pid: int) -> bool | None:
    """Whether SIGINT is ignored in process `pid` now (Linux /proc); None where that cannot be read."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(mask & (1 << (signal.SIGINT - 1)))
