"""Issue 34 items 1 and 3: a plan file is data, and the planner writes only where it means to.

- A cached plan (`<expert dir>/plans/<key>/plan.json`) that is not one the planner could have made
  for this model, budget and config (a plug-in path, a budgets map, capacities out of range, another
  shape, ...) is said ("ignoring the cached plan FILE: ...") and planned again, never applied; no
  code runs from it (`evil_trust_probe.py` beside it writes a marker file when imported).
- Settings the user gave (TOML, environment, --set, Python API) win over a plan: the planner plans
  with them fixed, or refuses naming the key; the config's fingerprint does not change for it.
- A model directory, a plan file and a server request cannot name an eviction plug-in.
- No write under `plans/` follows a symlink; a cache that cannot be written puts the capacity
  profile into a private temporary directory; nothing is left in $TMPDIR after a plan run, on
  success, error or SIGTERM.

In-process rows call `plan_at_startup` (no model loads); the CLI rows run `python -m qnpipe`
(tests/cli_harness.py) under a memory limit and a timeout.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from qnpipe import config
from qnpipe.errors import ConfigError
from qnpipe.plan import minimum_budget, model_facts
from qnpipe.plan.startup import cache_key, find_log, plan_at_startup
from qnpipe.plan.units import parse_memory
from tests.cli_harness import MEM_LIMIT, TIMEOUT, clean_env, run_cli

CONTEXT = 512
PROCESS = 100 * 2**20  # the account's process line, fixed: measured, it would be this test process's size
PROBE = "evil_trust_probe"
TOKENS = "3,17,5,99,42,7,8,250,11,64"


# --------------------------------------------------------------------------- model directories and the probe


def _linked(src: Path, dst: Path) -> Path:
    """`dst` with a symlink to each file of `src`, its directories real (so `experts/plans` can be made)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_dir():
            _linked(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f)
    return dst


def _probe_source(marker: Path) -> str:
    return (f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n\n\n"
            "class P:\n    def __init__(self, capacity):\n        self.capacity = capacity\n")


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An importable module `evil_trust_probe` (class P) that writes the marker file it yields when imported."""
    marker = tmp_path / "probe-imported"
    lib = tmp_path / "probe-lib"
    lib.mkdir()
    (lib / f"{PROBE}.py").write_text(_probe_source(marker))
    monkeypatch.syspath_prepend(str(lib))
    yield marker
    sys.modules.pop(PROBE, None)


@pytest.fixture(scope="module")
def model(tiny_qn4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _linked(tiny_qn4, tmp_path_factory.mktemp("trust") / "tiny-qn4")


def _budget(model: Path) -> int:
    cfg = config.load(None, env={}, overrides={"model.model_dir": str(model), "plan.process_bytes": PROCESS})
    facts = model_facts(model, cfg)
    return minimum_budget(facts, cfg, context=CONTEXT) + 2 * sum(facts.record_nbytes.values())


def _overrides(model: Path | str, cache: Path | None, memory: int, **kw: object) -> dict[str, object]:
    return {"model.model_dir": str(model), "plan.memory": str(memory), "plan.context_tokens": CONTEXT,
            "plan.process_bytes": PROCESS, **({"plan.cache_dir": str(cache)} if cache is not None else {}), **kw}


def _cfg(model: Path | str, cache: Path | None, memory: int, **kw: object) -> config.Config:
    return config.load(None, env={}, overrides=_overrides(model, cache, memory, **kw))


def _cached(cfg: config.Config) -> Path:
    """Where `plan_at_startup(cfg)` looks for its cached plan (the key anyone can compute)."""
    facts = model_facts(Path(cfg.model.model_dir), cfg)
    key = cache_key(facts, cfg, find_log(cfg), budget=parse_memory(cfg.plan.memory))
    root = Path(cfg.plan.cache_dir or Path(cfg.model.resolved_expert_dir()) / "plans")
    return root / key[:16] / "plan.json"


@pytest.fixture(scope="module")
def genuine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The JSON of a plan the planner made for `model` at `_budget` (defaults otherwise)."""
    cache = tmp_path_factory.mktemp("genuine")
    cfg, plan = plan_at_startup(_cfg(model, cache, _budget(model)))
    assert plan is not None
    [path] = cache.glob("*/plan.json")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- item 1: a crafted plan.json


def _set(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.update(changes)


def _caps(edit: Callable[[dict[str, int]], object]) -> Callable[[dict[str, Any]], object]:
    return lambda d: edit(d["capacities"])


def _prefetching(budgets: dict[str, int]) -> Callable[[dict[str, Any]], None]:
    return _set(prefetch=True, prefetch_into="main", predictor="recorded", budgets=budgets)


BUDGETS = {"read.bg_budget_experts": 12, "predict.per_layer_budget_experts": 4,
           "predict.file_global_budget_experts": 64, "predict.stage_global_budget_experts": 64}

# (name, edit of the genuine plan's JSON, the user's overrides, what the message must name)
CRAFTED: list[tuple[str, Callable[[dict[str, Any]], object], dict[str, object], tuple[str, ...]]] = [
    ("a plug-in policy", _set(evict_policy=f"{PROBE}:P"), {}, ("evict_policy", f"{PROBE}:P")),
    ("a policy the planner never chooses", _set(evict_policy="fifo"), {}, ("evict_policy", "fifo")),
    ("budgets override verify_crc32", _set(budgets={"read.verify_crc32": 0}), {"read.verify_crc32": True},
     ("budgets", "read.verify_crc32")),
    ("budgets on a plan that does not prefetch", _set(budgets=BUDGETS), {}, ("budgets",)),
    ("a budget the config does not have", _prefetching({**BUDGETS, "read.bg_budget_experts": 0}), {},
     ("read.bg_budget_experts", "12")),
    ("prefetch on a log without the gates' candidates", _prefetching(BUDGETS), {}, ("prefetch",)),
    ("a capacity below top-k", _caps(lambda c: c.update({"0": 1})), {}, ("capacities", "layer 0", "1")),
    ("a capacity above the experts", _caps(lambda c: c.update({"3": 65})), {}, ("capacities", "layer 3", "65")),
    ("a layer the model lacks", _caps(lambda c: c.update({"99": 8})), {}, ("capacities", "99")),
    ("a layer missing", _caps(lambda c: c.pop("7")), {}, ("capacities", "7")),
    ("more slots than the budget", _caps(lambda c: c.update({k: 64 for k in c})), {}, ("capacities", "budget")),
    ("another shape", lambda d: d["shape"].update(num_experts=128), {}, ("shape",)),
    ("side slots", _set(side_region_slots=1000), {}, ("side_region_slots", "1000")),
    ("autopin on", _set(autopin=True), {}, ("autopin",)),
    ("a placement that is none", _set(prefetch_into="nowhere"), {}, ("prefetch_into",)),
    ("escapes in the device name", _set(device_name="\x1b[2Jpwned"), {}, ("device_name",)),
    ("another budget", lambda d: d.update(memory_bytes=d["memory_bytes"] + 1), {}, ("memory_bytes",)),
]


@pytest.mark.parametrize(("edit", "user", "needles"), [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_a_crafted_cached_plan_is_said_and_planned_again(model: Path, genuine: dict[str, Any], tmp_path: Path,
                                                        probe: Path, edit: Callable[[dict[str, Any]], object],
                                                        user: dict[str, object], needles: tuple[str, ...],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from qnpipe.plan import Plan

    # Planning again gives the genuine plan (real replans: the model-directory probe and the rows below).
    again = msgspec.json.decode(json.dumps(genuine), type=Plan)
    monkeypatch.setattr("qnpipe.plan.startup.plan_in_child", lambda *a, **k: (again, None))
    cfg = _cfg(model, tmp_path, _budget(model), **user)
    path = _cached(cfg)
    crafted = json.loads(json.dumps(genuine))
    edit(crafted)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(crafted))
    said: list[str] = []
    out, plan = plan_at_startup(cfg, say=said.append)
    ignored = [s for s in said if s.startswith(f"ignoring the cached plan {path}:")]
    assert ignored, said
    assert all(n in ignored[0] for n in needles), (ignored[0], needles)
    assert plan is not None and not probe.exists() and PROBE not in sys.modules
    assert out.pool.evict_policy in ("lru", "lfu") and plan.evict_policy == out.pool.evict_policy
    assert not out.pool.autopin and out.pool.side_region_slots == 0
    for key, value in user.items():  # never above what the user set
        section, field = key.split(".")
        assert getattr(getattr(out, section), field) == value
    assert json.loads(path.read_text())["evict_policy"] in ("lru", "lfu")  # planned again and cached


# --------------------------------------------------------------------------- item 1: the user's settings win


def _toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "user.toml"
    p.write_text(text)
    return p


def _plan(model: Path, tmp_path: Path, given: dict[str, object] | None = None, *, toml: str | None = None,
          env: dict[str, str] | None = None) -> tuple[config.Config, Any]:
    over = _overrides(model, tmp_path / "cache", _budget(model), **(given or {}))
    cfg = config.load(_toml(tmp_path, toml) if toml else None, env=env or {}, overrides=over)
    return plan_at_startup(cfg)


@pytest.mark.slow
@pytest.mark.parametrize(("how", "policy"), [
    ("--set", "lru"), ("--set", "lfu"), ("--set", "fifo"), ("environment", "lru"), ("TOML", "lru"),
    ("Python API", "lru"),
])
def test_the_users_eviction_policy_is_planned_with(model: Path, tmp_path: Path, how: str, policy: str) -> None:
    if how == "--set":
        cfg, plan = _plan(model, tmp_path, {"pool.evict_policy": policy})
    elif how == "environment":
        cfg, plan = _plan(model, tmp_path, env={"QNPIPE_POOL__EVICT_POLICY": policy})
    elif how == "TOML":
        cfg, plan = _plan(model, tmp_path, toml=f'[pool]\nevict_policy = "{policy}"\n')
    else:  # as Engine(model_dir, cfg, evict_policy=...) derives its config
        base = config.load(None, env={}, overrides=_overrides(model, tmp_path, _budget(model)))
        cfg, plan = plan_at_startup(config.with_overrides(base, evict_policy=policy))
    assert cfg.pool.evict_policy == policy and plan is not None and plan.evict_policy == policy
    assert {c.evict_policy for c in plan.candidates} == {policy}


@pytest.mark.slow
def test_a_cached_plan_with_another_policy_than_the_users_is_not_applied(model: Path, genuine: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    cfg = _cfg(model, tmp_path, _budget(model), **{"pool.evict_policy": "lru"})
    path = _cached(cfg)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**genuine, "evict_policy": "lfu"}))
    said: list[str] = []
    out, plan = plan_at_startup(cfg, say=said.append)
    assert any(s.startswith(f"ignoring the cached plan {path}:") and "pool.evict_policy" in s for s in said), said
    assert out.pool.evict_policy == "lru" and plan is not None and plan.evict_policy == "lru"


@pytest.mark.slow
def test_no_prefetch_candidate_when_the_user_turned_prefetch_off(model: Path, tmp_path: Path) -> None:
    cfg, plan = _plan(model, tmp_path, {"predict.cross_layer_prefetch": False})
    assert plan is not None and not plan.prefetch and not any(c.prefetch for c in plan.candidates)
    assert cfg.predict.cross_layer_prefetch is False


@pytest.mark.parametrize(("user", "needles"), [
    ({"pool.evict_policy": f"{PROBE}:P"}, ("pool.evict_policy", f"{PROBE}:P", "plug-in")),
    ({"pool.expert_slots": 16}, ("pool.expert_slots", "16")),
    ({"pool.autopin": True}, ("pool.autopin",)),
    ({"predict.cross_layer_prefetch": True}, ("predict.cross_layer_prefetch", "candidates")),
    ({"pool.side_region_slots": 2, "predict.cross_layer_prefetch": True}, ("pool.side_region_slots",)),
], ids=["plug-in", "expert_slots", "autopin", "prefetch on a synthetic log", "side slots with prefetch"])
def test_a_setting_the_plan_cannot_keep_is_refused_naming_it(model: Path, tmp_path: Path, probe: Path,
                                                             user: dict[str, object], needles: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as e:
        _plan(model, tmp_path, user)
    assert all(n in str(e.value) for n in needles), str(e.value)
    assert not probe.exists()


@pytest.mark.slow
def test_explicit_settings_are_kept_and_the_fingerprint_is_unchanged(model: Path, tmp_path: Path) -> None:
    cfg, plan = _plan(model, tmp_path, {"read.verify_crc32": True, "pool.autopin": False})
    assert plan is not None and cfg.read.verify_crc32 is True and cfg.pool.autopin is False
    given = config.load(None, env={}, overrides={"pool.evict_policy": "lru"})
    built = config.Config(pool=config.PoolCfg(evict_policy="lru"))
    assert given.fingerprint() == built.fingerprint()
    assert msgspec.json.encode(given) == msgspec.json.encode(built)
    assert msgspec.to_builtins(given) == msgspec.to_builtins(built)


# --------------------------------------------------------------------------- item 1: who may name a plug-in


@pytest.mark.slow
def test_a_model_directory_runs_no_code(tiny_qn4: Path, tmp_path: Path) -> None:
    """The probe of the issue: plan.json naming `evil:P` beside an evil.py in the model directory, a
    config.json and a TOML file there naming it too, `qnpipe generate . --memory ...` run from there."""
    d = _linked(tiny_qn4, tmp_path / "shipped")
    marker = tmp_path / "imported"
    (d / "evil.py").write_text(_probe_source(marker))
    (d / "experts" / "evil.py").write_text(_probe_source(marker))
    args = json.loads((tiny_qn4 / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**args, "evict_policy": "evil:P", "pool": {"evict_policy": "evil:P"}}))
    for name in ("qnpipe.toml", "config.toml", ".qnpipe.toml"):
        (d / name).write_text('[pool]\nevict_policy = "evil:P"\n')
    memory = _budget(tiny_qn4)
    old = Path.cwd()
    os.chdir(d)
    try:  # the key as the command computes it, with `.` for the model directory
        cfg = _cfg(".", None, memory)
        genuine, _ = plan_at_startup(_cfg(".", tmp_path / "scratch-cache", memory))
        path = _cached(cfg)
    finally:
        os.chdir(old)
    [made] = (tmp_path / "scratch-cache").glob("*/plan.json")
    crafted = {**json.loads(made.read_text()), "evict_policy": "evil:P"}
    (d / path).parent.mkdir(parents=True)
    (d / path).write_text(json.dumps(crafted))
    r = run_cli(["generate", ".", "--tokens", TOKENS, "-n", "2", "--memory", str(memory), "--set",
                 f"plan.context_tokens={CONTEXT}", "--set", f"plan.process_bytes={PROCESS}"], cwd=d)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert f"ignoring the cached plan {path}:" in err and "evil:P" in err, err
    assert not marker.exists(), err


def test_a_plan_file_cannot_name_a_plug_in(tmp_path: Path, genuine: dict[str, Any], probe: Path) -> None:
    from qnpipe.plan import load_plan

    p = tmp_path / "plan.json"
    p.write_text(json.dumps({**genuine, "evict_policy": f"{PROBE}:P"}))
    with pytest.raises(ConfigError, match="evict_policy") as e:
        load_plan(p)
    assert str(p) in str(e.value) and not probe.exists()


@pytest.mark.parametrize("extra", [
    {"evict_policy": f"{PROBE}:P"}, {"pool": {"evict_policy": f"{PROBE}:P"}},
    {"pool.evict_policy": f"{PROBE}:P"}, {"config": {"pool.evict_policy": f"{PROBE}:P"}},
    {"overrides": {"evict_policy": f"{PROBE}:P"}},
])
def test_a_server_request_cannot_name_a_plug_in(extra: dict[str, Any], probe: Path) -> None:
    # The app decodes each body into these types (qnpipe.server.app.build_app): unknown fields are a 400.
    from qnpipe.server import schemas

    for kind, body in ((schemas.ChatRequest, {"messages": [{"role": "user", "content": "hi"}]}),
                       (schemas.CompletionRequest, {"prompt": "hi"})):
        with pytest.raises(msgspec.ValidationError, match="unknown field"):
            msgspec.json.decode(json.dumps({"model": "m", **body, **extra}), type=kind)
    assert not probe.exists()


def test_the_server_builds_no_config() -> None:
    """No module of the server loads or changes a Config: only the command line and the Python API do."""
    import ast

    import qnpipe.server

    root = Path(qnpipe.server.__file__).parent
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute | ast.Name):
                name = node.attr if isinstance(node, ast.Attribute) else node.id
                assert name not in ("with_overrides", "plan_overrides", "load_class", "make_plugin"), f
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                assert not (isinstance(node.func.value, ast.Name) and node.func.value.id in ("config", "config_mod")), f


# --------------------------------------------------------------------------- item 3: symlinks under plans/


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    v.mkdir()
    for name in ("plan.json", "capacities.json", "keep.txt"):
        (v / name).write_text(f"the user's own {name}\n")
    return v


def _unchanged(v: Path) -> None:
    assert sorted(p.name for p in v.iterdir()) == ["capacities.json", "keep.txt", "plan.json"]
    for p in v.iterdir():
        assert p.read_text() == f"the user's own {p.name}\n", p


def _linked_plan(d: Path, cached: Path, v: Path) -> None:
    cached.parent.mkdir(parents=True)
    cached.symlink_to(v / "plan.json")
    (cached.parent / "capacities.json").symlink_to(v / "capacities.json")


# what is a symlink: the key's directory, plan.json and capacities.json, plans/ itself
LINKS: dict[str, Callable[[Path, Path, Path], object]] = {
    "plans/<key>": lambda d, cached, v: (cached.parent.parent.mkdir(parents=True), cached.parent.symlink_to(v)),
    "plan.json and capacities.json": _linked_plan,
    "plans": lambda d, cached, v: cached.parent.parent.symlink_to(v),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", list(LINKS))
def test_no_write_under_plans_follows_a_symlink(tiny_qn4: Path, tmp_path: Path, where: str) -> None:
    d = _linked(tiny_qn4, tmp_path / "m")
    v = _victim(tmp_path)
    cfg = _cfg(d, None, _budget(tiny_qn4))
    cached = _cached(cfg)
    LINKS[where](d, cached, v)
    said: list[str] = []
    out, plan = plan_at_startup(cfg, say=said.append)
    assert plan is not None and "symlink" in " ".join(said), said
    _unchanged(v)
    assert not Path(out.pool.capacity_profile_path).resolve().is_relative_to(v.resolve())
    caps = json.loads(Path(out.pool.capacity_profile_path).read_text())["layer_caps"]
    assert {int(k): c for k, c in caps.items()} == plan.capacities


@pytest.mark.parametrize("link", ["directory", "file"])
def test_atomic_write_nofollow_refuses_a_link_and_leaves_nothing(tmp_path: Path, link: str) -> None:
    from qnpipe.io.atomic import atomic_write

    v = _victim(tmp_path)
    d = tmp_path / "cache"
    if link == "directory":
        d.symlink_to(v)
    else:
        d.mkdir()
        (d / "plan.json").symlink_to(v / "plan.json")
    with pytest.raises(OSError) as e:
        atomic_write(d / "plan.json", b"{}", nofollow=True)
    assert e.value.errno == errno.ELOOP and e.value.filename == str(d / "plan.json") and "symlink" in str(e.value)
    _unchanged(v)
    assert not [p for p in (*d.iterdir(), *v.iterdir()) if p.name.endswith(".tmp")]
    atomic_write(tmp_path / "plain.json", b"{}", nofollow=True)  # a directory of its own: written
    assert (tmp_path / "plain.json").read_bytes() == b"{}" and not list(tmp_path.glob(".plain.json.*"))


# --------------------------------------------------------------------------- item 3: the temp directory


def _fresh_tmp(tmp_path: Path) -> Path:
    t = tmp_path / "TMPDIR"
    t.mkdir()
    return t


@pytest.mark.slow
def test_a_read_only_store_uses_a_private_temp_dir_removed_at_exit(tiny_qn4: Path, tmp_path: Path) -> None:
    d = _linked(tiny_qn4, tmp_path / "ro")
    (d / "experts" / "plans").write_text("not a directory: the cache cannot be written\n")
    t = _fresh_tmp(tmp_path)
    v = _victim(tmp_path)
    memory = _budget(tiny_qn4)
    key = _cached(_cfg(d, tmp_path / "k", memory)).parent.name  # the old predictable name, planted
    (t / f"qnpipe-plan-{key}").symlink_to(v)
    r = run_cli(["generate", d, "--tokens", TOKENS, "-n", "2", "--memory", str(memory), "--set",
                 f"plan.context_tokens={CONTEXT}", "--set", f"plan.process_bytes={PROCESS}"],
                env=(("TMPDIR", str(t)),))
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "not cached" in err, err
    _unchanged(v)
    # Only what we planted, and MLX's own compiled-kernel cache ($TMPDIR/mlx/<version>: kept for the next run).
    assert sorted(p.name for p in t.iterdir() if p.name != "mlx") == [f"qnpipe-plan-{key}"], err


@pytest.mark.slow
@pytest.mark.parametrize(("more", "rc"), [
    ([], 0),
    (["--ranks", "2", "--memory", "1.2GB"], 0),
    (["--set", "predict.cross_layer_prefetch=true"], 2),  # refused after the search began: no candidates
], ids=["one plan", "ranks", "an error"])
def test_a_plan_run_leaves_nothing_in_tmpdir(tiny_qn4: Path, tmp_path: Path, more: list[str], rc: int) -> None:
    t = _fresh_tmp(tmp_path)
    memory = ["--memory", "2GB"] if "--memory" not in more else []
    r = run_cli(["plan", tiny_qn4, *memory, "--context", str(CONTEXT), "--window-layer-steps", "800", "-q",
                 "--set", f"plan.process_bytes={PROCESS}", *more], env=(("TMPDIR", str(t)),))
    err = r.stderr.decode(errors="replace")
    assert r.returncode == rc and "Traceback" not in err, err
    assert not list(t.iterdir()), err


@pytest.mark.slow
def test_sigterm_during_a_plan_leaves_nothing_in_tmpdir(tiny_qn4: Path, tmp_path: Path) -> None:
    from qnpipe.replay.synth import SynthSpec, write_synth

    t = _fresh_tmp(tmp_path)
    log = write_synth(tmp_path / "long.qtrace", SynthSpec(layers=8, experts=64, top_k=4, tokens=5000, seed=1,
                                                          locality=0.3, popularity="zipf:1.0"))
    argv = [sys.executable, "-m", "qnpipe", "plan", str(tiny_qn4), "--memory", "2GB", "--context", str(CONTEXT),
            "--log", str(log), "--set", f"plan.process_bytes={PROCESS}"]
    p = subprocess.Popen(argv, env=clean_env() | {"TMPDIR": str(t)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT)))
    try:
        assert p.stderr is not None
        for line in p.stderr:  # the search has begun (its temp files exist) once its curves are said
            if line.startswith(b"curves of"):
                break
        p.send_signal(signal.SIGTERM)
        _, rest = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode in (128 + signal.SIGTERM, 0), rest.decode(errors="replace")
    assert b"Traceback" not in rest
    assert not list(t.iterdir())
    shutil.rmtree(t)
