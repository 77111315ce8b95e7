"""Fuzzing the csv importer and every reader of what it accepts (issue 34, item 9).

Hypothesis writes routing tables as a new user's tool might: columns in any order, a BOM, CRLF,
quoted fields and blanks, negative, huge or out-of-order steps, layers up to 65535 or thousands
of them, ids up to the expert bound, a `.gz`, now and then a broken line. Each is imported;
a refusal must be a TraceImportError naming the file. Every log the importer accepts then goes
through `trace stats`, `replay`, `replay --mrc` and `plan --log` by the CLI's own `main`, in this
process: each must succeed or stop with qnpipe's own error (exit 2), never another exception.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qnpipe import trace
from qnpipe.cli import DEMO_MODEL_DIR, main
from qnpipe.errors import QnpipeError, TraceImportError
from qnpipe.trace.importers import import_log
from tests.profiles import examples

# fewer: each example writes and imports a file
FUZZ = settings(examples(30), database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

COLUMNS = ("step", "layer", "expert", "score")


@st.composite
def tables(draw: st.DrawFn) -> dict:
    k = draw(st.integers(1, 4))
    layer_kind = draw(st.sampled_from(["few", "high", "many"]))
    # 4096 experts at hundreds of layers: `plan --log` runs for minutes (not bounded yet); tests/hardening covers them
    experts = draw(st.sampled_from([k, k + 1, 8, 60] + ([4096] if layer_kind != "many" else [])))
    if layer_kind == "few":
        layers = draw(st.lists(st.integers(0, 47), min_size=1, max_size=4, unique=True))
    elif layer_kind == "high":
        layers = draw(st.lists(st.sampled_from([0, 1, 1023, 1024, 65534, 65535]), min_size=1, max_size=3,
                               unique=True))
    else:
        layers = list(range(draw(st.sampled_from([300, 1200]))))
    step_kind = draw(st.sampled_from(["small", "negative", "gaps", "extreme"]))
    n_steps = draw(st.integers(1, 6 if layer_kind == "many" else 12))
    if step_kind == "small":
        steps = list(range(n_steps))
    elif step_kind == "negative":
        steps = draw(st.lists(st.integers(-50, 50), min_size=n_steps, max_size=n_steps, unique=True))
    elif step_kind == "gaps":
        steps = draw(st.lists(st.integers(0, 2**40), min_size=n_steps, max_size=n_steps, unique=True))
    else:
        steps = draw(st.lists(st.sampled_from([-2**40, -2**40 + 1, -1, 0, 2**40 - 1, 2**40]), min_size=1,
                              max_size=min(n_steps, 6), unique=True))
    seed = draw(st.integers(0, 2**32 - 1))
    return {
        "k": k, "experts": experts, "layers": layers, "steps": steps, "seed": seed,
        "order": draw(st.permutations(COLUMNS[:3] + (("score",) if draw(st.booleans()) else ()))),
        "bom": draw(st.booleans()), "crlf": draw(st.booleans()), "quote": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "blank": draw(st.booleans()), "spaces": draw(st.booleans()), "shuffle": draw(st.booleans()),
        "gz": draw(st.booleans()), "given_experts": draw(st.booleans()),
        "break": draw(st.sampled_from([None, None, None, "field", "int", "dup", "width", "score"])),
    }


def _write(t: dict, path: Path) -> bool:
    """Write the table; True when a line was broken in a way the importer must refuse."""
    rng = random.Random(t["seed"])
    order, k = t["order"], t["k"]

    def field(v: object) -> str:
        s = str(v)
        if t["spaces"] and rng.random() < 0.3:
            s = f" {s} "
        return f'"{s}"' if rng.random() < t["quote"] else s

    groups = []
    for s in t["steps"]:
        for layer in t["layers"]:
            ids = rng.sample(range(t["experts"]), k)
            groups.append([{"step": s, "layer": layer, "expert": e, "score": round(rng.random(), 4)} for e in ids])
    if t["shuffle"]:
        rng.shuffle(groups)
    rows = [r for g in groups for r in g]
    bad, refuse = t["break"], False
    r = rows[rng.randrange(len(rows))]
    if bad == "field":
        r["layer"], refuse = "x,1", True
    elif bad == "int":
        r["step"], refuse = "1.5", True
    elif bad == "dup" and k > 1:
        groups[0][-1]["expert"], refuse = groups[0][0]["expert"], True
    elif bad == "width":
        rows.append(dict(rows[0]))  # one (step, layer) of k + 1 rows, an expert twice
        refuse = True
    elif bad == "score" and "score" in order:
        r["score"], refuse = "nan", True
    eol = "\r\n" if t["crlf"] else "\n"
    lines = [",".join(field(c) for c in order)]
    for r in rows:
        lines.append(",".join(field(r[c]) for c in order))
        if t["blank"] and rng.random() < 0.05:
            lines.append("")
    text = ("\ufeff" if t["bom"] else "") + eol.join(lines) + eol
    data = text.encode()
    path.write_bytes(gzip.compress(data, compresslevel=1) if t["gz"] else data)
    return refuse


def _config_of(shape: trace.ModelShape, path: Path) -> Path:
    """A config.json of the log's routing shape (the demo model's other sizes), for `plan --shape`."""
    cfg = json.loads((Path(DEMO_MODEL_DIR) / "config.json").read_text())
    cfg.update(num_hidden_layers=shape.num_layers, num_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
               mlp_only_layers=[x for x in range(shape.num_layers) if x not in set(shape.moe_layers)])
    path.write_text(json.dumps(cfg))
    return path


def _cli(*argv: object) -> tuple[int, str]:
    """`qnpipe ARGV` in this process: (exit code, stderr). Any exception but qnpipe's own escapes main."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    assert rc in (0, 2), (argv, rc, err.getvalue()[-2000:])
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return rc, err.getvalue()


@pytest.mark.slow
@FUZZ
@given(t=tables())
def test_every_log_the_csv_importer_accepts_every_reader_takes(tmp_path_factory, t: dict) -> None:  # noqa: ANN001
    d = tmp_path_factory.mktemp("fuzz")
    src = d / ("routes.csv.gz" if t["gz"] else "routes.csv")
    refuse = _write(t, src)
    log = d / "routes.qtrace"
    try:
        summary = import_log("csv", src, log, experts=t["experts"] if t["given_experts"] else None)
    except TraceImportError as e:
        assert src.name in str(e), str(e)
        assert not log.exists() and not log.with_name(log.name + ".partial").exists()
        return
    assert not refuse, f"a broken line was let in: {t}"
    shape = trace.read(log)[0].model
    assert shape is not None and shape == summary.model
    _cli("trace", "stats", log)
    _cli("trace", "stats", log, "--json")
    _cli("replay", log, "--set", "replay.record_nbytes=4096")
    _cli("replay", log, "--mrc", "--csv", d / "mrc.csv", "--plot", d / "mrc.png")
    try:
        shape_json = _config_of(shape, d / "config.json")
    except QnpipeError:
        return
    _cli("plan", "--shape", shape_json, "--bits", "4", "--memory", "4GB", "--log", log, "-q", "--context", "64")
