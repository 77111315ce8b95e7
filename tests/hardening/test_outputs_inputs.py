"""Issue 34 item 2: no command writes an output over one of its inputs (qnpipe.io.clobber).

Each row names an output that is an input: the same path, a hard link to it, a symbolic link
to it, or a file of the model directory the command reads; every command that writes a file
has rows. The contract: exit 2 before any work, the message naming the output's flag, the
output and the input; every input byte-for-byte as it was (a hash of every file before and
after); no traceback; nothing left in TMPDIR. Before the fix `replay L --csv L`, `sweep L -o L`,
`plan --log L -o L` and `trace import csv X -o X` replaced their input with exit 0, and
`generate M --trace M/config.json` broke the model for good.

The refusals come before a model loads, so those rows run in this process (cli_harness
`in_process`); the rows that check the files a command is meant to write inside the model
directory (the recorded log) still work, and `chat`'s `/save`, run the real command.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from qnpipe.replay.synth import SynthSpec, write_synth
from tests.cli_harness import Case, check_table, leftovers, stop_with_tmpdir

REC = "replay.record_nbytes=1000000"


def _hashes(*roots: Path) -> dict[Path, str]:
    """sha256 of every regular file under `roots` (links not followed: a link is checked through its target)."""
    out = {}
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink():
                out[p] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def w(tmp_path: Path, tiny_qn4: Path) -> dict[str, Path]:
    """A work directory of inputs and links to them, and a private copy of a qnpipe model directory."""
    d = tmp_path / "work"
    d.mkdir()
    f = {"d": d, "m": tmp_path / "m"}
    shutil.copytree(tiny_qn4, f["m"])
    log, log2 = d / "run.qtrace", d / "run2.qtrace"
    write_synth(log, SynthSpec(layers=2, experts=16, top_k=2, tokens=10, seed=1))
    write_synth(log2, SynthSpec(layers=2, experts=16, top_k=2, tokens=10, seed=2))
    (d / "routes.csv").write_text("step,layer,expert\n1,0,5\n1,0,2\n2,0,5\n2,0,1\n")
    (d / "qnpipe.toml").write_text("[read]\nworkers = 2\n")
    (d / "pop.csv").write_text("Layer,Expert_0,Expert_1\n0,0.5,0.5\n")
    os.link(log, d / "hard.qtrace")
    os.symlink(log, d / "sym.qtrace")
    os.symlink(d / "routes.csv", d / "sym.csv")
    os.link(f["m"] / "config.json", d / "hard-config.json")
    os.symlink(f["m"] / "experts" / "index.json", d / "sym-index.json")
    os.symlink(f["m"] / "tokenizer.json", d / "dangling-to-model")
    (d / "dangling-to-model").unlink()
    os.symlink(f["m"] / "new-file", d / "dangling-to-model")  # a write through it would land in the model
    f.update(log=log, log2=log2)
    return f


def _refused(name: str, argv: list[object], *needles: object) -> Case:
    return Case(name, argv, 2, tuple(str(n) for n in needles), in_process=True, tmp_empty=True)


@pytest.mark.slow
def test_no_output_is_an_input(w: dict[str, Path]) -> None:
    d, m, log, log2 = w["d"], w["m"], w["log"], w["log2"]
    before = _hashes(d, m)
    rp = ["replay", log, "--set", REC]
    sw = ["sweep", log, "--set", REC, "--grid", "pool.expert_slots=4,8", "--executor", "serial", "--no-progress"]
    gen = ["generate", m, "-p", "hi", "-n", "2"]
    rows = [
        # replay: the tidy exports, the miss-ratio curves, the event log it may write
        _refused("replay --csv LOG", [*rp, "--csv", log], "--csv", log, "LOG"),
        _refused("replay --csv a hard link to LOG", [*rp, "--csv", d / "hard.qtrace"], "--csv", "hard.qtrace",
                 "LOG", "hard link"),
        _refused("replay --csv a symlink to LOG", [*rp, "--csv", d / "sym.qtrace"], "--csv", "sym.qtrace", "LOG",
                 "symbolic link"),
        _refused("replay --parquet LOG", [*rp, "--parquet", log], "--parquet", log, "LOG"),
        _refused("replay --csv the --train-log", [*rp, "--predict", "transition", "--train-log", log2, "--csv", log2],
                 "--csv", log2, "--train-log"),
        _refused("replay --csv the --config", [*rp, "--config", d / "qnpipe.toml", "--csv", d / "qnpipe.toml"],
                 "--csv", "qnpipe.toml", "--config"),
        _refused("replay writes its event log over LOG", [*rp, "--set", f"trace.event_log_path={d / 'hard.qtrace'}"],
                 "trace.event_log_path", "hard.qtrace", "LOG"),
        _refused("replay --mrc --csv LOG", ["replay", log, "--mrc", "--csv", log], "--csv", log, "LOG"),
        _refused("replay --mrc --plot a symlink to LOG", ["replay", log, "--mrc", "--plot", d / "sym.qtrace"],
                 "--plot", "sym.qtrace", "LOG"),
        _refused("replay --mrc --csv and --plot one file", ["replay", log, "--mrc", "--csv", d / "o", "--plot", d / "o"],
                 "--plot", "--csv", d / "o"),
        # sweep
        _refused("sweep -o LOG", [*sw, "-o", log], "-o", log, "LOG"),
        _refused("sweep --csv a hard link to LOG", [*sw, "--csv", d / "hard.qtrace"], "--csv", "hard.qtrace", "LOG"),
        _refused("sweep -o and --csv one file", [*sw, "-o", d / "s.json", "--csv", d / "s.json"], "--csv", "-o",
                 "s.json"),
        _refused("sweep a point's event log is LOG", ["sweep", log, "--set", REC, "--grid",
                                                      f"trace.event_log_path={log};{d / 'x.qtrace'}"],
                 "grid point 0", "trace.event_log_path", log, "LOG"),
        # plan
        _refused("plan --log L -o L", ["plan", m, "--memory", "2GB", "--log", log, "-o", log], "-o", log, "--log"),
        _refused("plan -o a file of MODEL_DIR", ["plan", m, "--memory", "2GB", "-o", m / "config.json"],
                 "-o", m / "config.json", "model directory", "MODEL_DIR"),
        _refused("plan --plot the --shape file", ["plan", "--shape", d / "hard-config.json", "--memory", "2GB",
                                                  "--plot", d / "hard-config.json"], "--plot", "--shape"),
        _refused("plan --ranks: a rank's plan is --log", ["plan", m, "--memory", "2GB", "--ranks", "2", "--log",
                                                          d / "p.rank1.qtrace", "-o", d / "p.qtrace"],
                 "-o", "p.rank1.qtrace", "--log"),
        # trace tools
        _refused("trace import csv X -o X", ["trace", "import", "csv", d / "routes.csv", "-o", d / "routes.csv"],
                 "-o", "routes.csv", "SRC"),
        _refused("trace import -o a symlink to SRC", ["trace", "import", "csv", d / "routes.csv", "-o",
                                                      d / "sym.csv"], "-o", "sym.csv", "SRC", "symbolic link"),
        _refused("trace merge -o one of its logs", ["trace", "merge", log, log2, "-o", log2], "-o", log2, "LOG"),
        _refused("trace plot -o LOG", ["trace", "plot", log, "-o", d / "sym.qtrace"], "-o", "sym.qtrace", "LOG"),
        _refused("trace fit-cost -o LOG", ["trace", "fit-cost", log, "-o", d / "hard.qtrace"], "-o", "hard.qtrace",
                 "LOG"),
        _refused("trace synth -o --popularity", ["trace", "synth", "-o", d / "pop.csv", "--popularity",
                                                 d / "pop.csv"], "-o", "pop.csv", "--popularity"),
        _refused("bench io -o --config", ["bench", "io", "--dir", d, "-o", d / "qnpipe.toml", "--config",
                                          d / "qnpipe.toml"], "-o", "qnpipe.toml", "--config"),
        # the model's own files: config, tokenizer, weights, expert store
        _refused("generate --trace MODEL_DIR/config.json", [*gen, "--trace", m / "config.json"],
                 "--trace", m / "config.json", "model directory", "MODEL_DIR"),
        _refused("generate --trace a hard link to config.json", [*gen, "--trace", d / "hard-config.json"],
                 "--trace", "hard-config.json", m / "config.json", "hard link"),
        _refused("generate --trace a symlink into the expert store", [*gen, "--trace", d / "sym-index.json"],
                 "--trace", "sym-index.json", "symbolic link", "model directory"),
        _refused("generate --trace a dangling symlink into MODEL_DIR", [*gen, "--trace", d / "dangling-to-model"],
                 "--trace", "dangling-to-model", "model directory"),
        _refused("generate heat file over an expert file", [*gen, "--set",
                                                            f"pool.autopin_usage_file={m / 'experts' / 'layer_000.bin'}"],
                 "pool.autopin_usage_file", "layer_000.bin", "model directory"),
        _refused("generate --memory --log L --trace L", [*gen, "--memory", "2GB", "--log", log, "--trace", log],
                 "--trace", log, "--log"),
        _refused("demo --model M --trace M/tokenizer.json", ["demo", "--model", m, "-n", "2", "--trace",
                                                             m / "tokenizer.json"], "--trace", "--model"),
        _refused("chat --trace MODEL_DIR/model.safetensors", ["chat", m, "--trace", m / "model.safetensors"],
                 "--trace", "model.safetensors", "MODEL_DIR"),
        _refused("serve: the event log over config.json", ["serve", m, "--set",
                                                          f"trace.event_log_path={m / 'config.json'}"],
                 "trace.event_log_path", "config.json", "MODEL_DIR"),
        _refused("convert --out inside SRC", ["convert", m, "--out", m / "qn"], "--out", m / "qn", "SRC"),
        # still allowed: an output of its own, the log --trace records inside the model directory
        Case("replay --csv a new file works", [*rp, "--csv", d / "out.csv"], 0, ("hit rate",), tmp_empty=True),
        Case("generate --trace records <expert dir>/trace.qtrace", [*gen, "--trace"], 0, ("generated",),
             tmp_empty=True),
        Case("chat /save over config.json is refused, the chat goes on", ["chat", m], 0,
             ("/save", str(m / "config.json"), "model directory"), stdin=f"/save {m / 'config.json'}\n/quit\n".encode(),
             tmp_empty=True),
    ]
    try:
        check_table(rows, cwd=d)
        table = ""
    except AssertionError as e:
        table = str(e)
    after = _hashes(d, m)
    own = ("trace.qtrace", "pool_usage.json")  # written inside the model directory by design
    changed = [str(p) for p, h in before.items() if after.get(p) != h and p.name not in own]
    assert not table and not changed, f"{table}\ninputs changed or gone: {changed}"
    assert (m / "experts" / "trace.qtrace").is_file() and (d / "out.csv").is_file()


@pytest.mark.slow
def test_sigterm_leaves_nothing_in_tmpdir(w: dict[str, Path]) -> None:
    """The commands above stopped by SIGTERM under way: exit 128 + 15, their outputs whole or absent,
    nothing in TMPDIR (a sweep's worker pool keeps its sockets there)."""
    d, m = w["d"], w["m"]
    big = d / "big.qtrace"
    write_synth(big, SynthSpec(layers=8, experts=64, top_k=4, tokens=3000, seed=1))
    runs = {
        # under way: a worker is writing its point's event log
        "sweep": stop_with_tmpdir(["sweep", big, "--set", REC, "--set", "pool.expert_slots=8", "--grid",
                                   "trace.event_log_path=" + ";".join(f"{d / 'p'}{i}.qtrace" for i in range(4)),
                                   "--jobs", "2", "--no-progress", "-o", d / "s.json"],
                                  lambda tmp, out: any(d.glob("p*.qtrace.partial")), cwd=d),
        "generate": stop_with_tmpdir(["generate", m, "-p", "hi", "-n", "100000", "--trace", d / "g.qtrace"],
                                     lambda tmp, out: len(out) > 0, cwd=d),
    }
    bad = {name: (r.returncode, left, r.stderr.decode(errors="replace")[-400:]) for name, (r, left) in runs.items()
           if r.returncode != 128 + 15 or left or b"Traceback" in r.stderr}
    assert not bad, bad
    assert not (d / "s.json").exists() and (d / "g.qtrace").is_file()
    assert leftovers(d) == []
