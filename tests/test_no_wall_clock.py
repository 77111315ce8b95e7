"""Actors, policy and replay read time only through trio's clock, so replay on MockClock stays exact."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import qnpipe

ROOT = Path(qnpipe.__file__).parent
CLOCKED = [*(ROOT / "actors").glob("*.py"), *(ROOT / "policy").glob("*.py"), ROOT / "replay" / "runner.py",
           ROOT / "replay" / "actor_driver.py", ROOT / "io" / "simssd.py", ROOT / "live" / "decoding.py"]
WALL = re.compile(r"\btime\.(time|perf_counter|monotonic|process_time)\(|\bdatetime\.now\(")


def wall_clock_reads(paths: list[Path]) -> list[str]:
    return [f"{p.name}:{i}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if WALL.search(line.split("#")[0])]


def test_no_wall_clock_reads_where_time_must_be_trio_time() -> None:
    assert all(p.is_file() for p in CLOCKED)
    assert wall_clock_reads(CLOCKED) == []


def test_the_check_catches_a_wall_clock_read(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("import time\nt0 = time.perf_counter()  # a lap\n# time.time() in a comment is fine\n")
    assert wall_clock_reads([bad]) == ["probe.py:2"]


# ------------------------------------------------------------------ tests: no wall-clock asserts
# A test may time something to print it, or bound a poll loop by a deadline (a hang guard); it may not
# assert that something took less than so long: on 2 shared cores that fails for the load, not the code.
# It counts work instead, or waits on an event.
TESTS = Path(__file__).resolve().parent
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns"}
# Files whose timing asserts remain, and why (each entry must still have one: a fixed file leaves the list).
TIMED = {
    # No counter sees an aborted answer's tokens (EngineStats counts finished generations only).
    "server/test_server_faults.py": "the engine freed well before the answer's end, with nothing to count",
}


def _is_clock(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def _is_duration(node: ast.AST) -> bool:
    """`clock() - start`: how long something took."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and _is_clock(node.left)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _targets(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def timing_asserts(source: str, name: str) -> list[str]:
    """`name:line` of each assert that bounds a duration: `clock() - t0` compared in an assert, directly or
    through the names (and functions, and lists appended to) it flows into; or a clock read compared in an
    assert outside a loop (inside one it is the loop's deadline: a hang guard). Hypothesis deadlines too."""
    tree = ast.parse(source)
    timed: set[str] = set()  # names holding a duration, and functions returning one

    def flows(value: ast.AST) -> bool:
        if isinstance(value, ast.Tuple | ast.List):
            return any(flows(e) for e in value.elts)
        return (_is_duration(value) or (isinstance(value, ast.Name) and value.id in timed)
                or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in timed))

    for _ in range(4):  # durations flow through a few assignments, returns and appends
        for fn in [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]:
            for node in ast.walk(fn):
                if isinstance(node, ast.Return) and node.value is not None and flows(node.value):
                    timed.add(fn.name)
                elif isinstance(node, ast.Assign) and flows(node.value):
                    timed |= set().union(*(_targets(t) for t in node.targets))
                elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None and flows(node.value):
                    timed |= _targets(node.target)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                      and isinstance(node.func.value, ast.Name) and any(flows(a) for a in node.args)):
                    timed.add(node.func.value.id)  # took.append(clock() - t)
    in_loop: set[int] = set()
    for loop in ast.walk(tree):
        if isinstance(loop, ast.While | ast.For):
            in_loop |= {id(n) for stmt in loop.body for n in ast.walk(stmt)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            compares = [c for c in ast.walk(node.test) if isinstance(c, ast.Compare)
                        and any(isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE) for op in c.ops)]
            bad = any(any(_is_duration(n) for n in ast.walk(c)) or _names(c) & timed
                      or (id(node) not in in_loop and any(_is_clock(n) for n in ast.walk(c))) for c in compares)
            if bad:
                hits.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "settings":
            hits += [f"{name}:{k.value.lineno}" for k in node.keywords if k.arg == "deadline"
                     and not (isinstance(k.value, ast.Constant) and k.value.value is None)]
    return sorted(set(hits), key=lambda h: int(h.rsplit(":", 1)[1]))


def test_no_test_asserts_how_long_something_took() -> None:
    found = {}
    for p in sorted(TESTS.rglob("*.py")):
        rel = p.relative_to(TESTS).as_posix()
        if (hits := timing_asserts(p.read_text(encoding="utf-8"), rel)):
            found[rel] = hits
    unexplained = {f: h for f, h in found.items() if f not in TIMED}
    assert not unexplained, f"wall-clock asserts (count work or wait on an event instead): {unexplained}"
    assert set(TIMED) <= set(found), f"no timing assert left in {set(TIMED) - set(found)}: drop it from TIMED"


def test_the_check_catches_each_kind_of_timing_assert() -> None:
    probe = '''
import time
from hypothesis import settings

def lap():
    t0 = time.monotonic()
    return time.monotonic() - t0

def test_it():
    t0 = time.perf_counter()
    work()
    assert time.perf_counter() - t0 < 0.1                         # a difference asserted
    elapsed = time.monotonic() - t0
    assert elapsed < 75, f"took {elapsed:.0f}s"                   # through a name
    took = []
    took.append(time.monotonic() - t0)
    assert max(took) < 1.5                                        # through a list
    stop, gone = lap(), 0
    assert stop < 2                                               # through a function
    assert time.monotonic() < t0 + 0.2                            # a clock read, no loop
    until = time.monotonic() + 30
    while not ready():
        assert time.monotonic() < until, "never ready"            # a hang guard: fine
        time.sleep(0.05)
    while time.monotonic() - t0 < 10:                             # a loop bound: fine
        pass
    print(f"{time.monotonic() - t0:.2f} s")                       # printed: fine

@settings(max_examples=5, deadline=200)                           # a per-example time limit
def test_prop():
    pass

@settings(deadline=None)
def test_fine():
    pass
'''
    assert timing_asserts(probe, "probe.py") == [f"probe.py:{n}" for n in (12, 14, 17, 19, 20, 29)]
