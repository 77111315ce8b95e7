"""Planning in a child process, so that what planning holds is not the run's (issue 38, item 1).

    plan, peak = plan_in_child(cfg, budget, log=log, synth_path=synth, share=None)

An uncached plan at start-up (`--memory` on generate, chat and serve; `Engine(..., memory=)`) reads the
routing log, builds its curves and replays the candidates: tens to hundreds of MB for a large log, held
by the run's own process if it planned there, whose peak resident set is what the budget bounds. Here
that work runs in a fresh interpreter (`python -c`, this package's root first on its path) and ends with
it; the parent gets the plan back as data (the plan file's JSON, `save_plan`/`load_plan`) and the child's
own peak resident set (`VmHWM`, None where /proc cannot tell), which is said beside the budget.

The child plans exactly what the parent would: the parent's `Config` rebuilt with the settings it was
given (`config.rebuilt`: the account names them), and the parent's process line (`measure_process`, taken
in the parent, which the account sizes, not the child's interpreter). A qnpipe error or an OSError in
the child (a budget too small, a log that is not one or cannot be read) is raised again in the parent as
its own class with its own message; anything else names the child's exit status and the end of its stderr. Ctrl-C reaches the child
too (one process group), `subprocess.run` ends it if the parent alone is interrupted, and on Linux it is
killed when the parent is (PR_SET_PDEATHSIG).

The first `--memory` run on a machine with no saved device profile measures the device in a child process
too, for the same reason (qnpipe.plan.measured).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec

from qnpipe.config import Config, explicit_settings
from qnpipe.errors import QnpipeError
from qnpipe.plan.fresh import ROOT, STDERR_TAIL, die_with
from qnpipe.plan.plan_file import Plan, load_plan, save_plan
from qnpipe.plan.process import high_water_bytes, measure_process
from qnpipe.plan.ranks import Share


class _Job(msgspec.Struct, frozen=True, kw_only=True):
    """What the child plans: `make_plan`'s arguments and the parent's config and process line."""

    tree: dict[str, object]
    given: dict[str, str]
    budget: int
    log: str | None
    synth_path: str | None
    share: Share | None
    process: tuple[int, str] | None  # None: plan.process_bytes is set, the child measures nothing


class ChildFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A qnpipe error in the child: its class (module, name) and those it derives from, and its message."""

    classes: list[tuple[str, str]]
    message: str


class _Done(msgspec.Struct, frozen=True, kw_only=True):
    peak_bytes: int | None


def plan_in_child(cfg: Config, budget: int, *, log: Path | None, synth_path: Path | None,
                  share: Share | None) -> tuple[Plan, int | None]:
    """`make_plan` for `cfg`'s model at `budget` in a child process (module doc): the plan and the child's
    peak resident set in bytes (None where unknown)."""
    job = _Job(tree=msgspec.to_builtins(cfg), given=explicit_settings(cfg), budget=budget,
               log=None if log is None else str(log), synth_path=None if synth_path is None else str(synth_path),
               share=share, process=None if cfg.plan.process_bytes else measure_process())
    with tempfile.TemporaryDirectory(prefix="qnpipe-plan-child-") as d:
        out = Path(d)
        code = (f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom qnpipe.plan.child import main\n"
                "main(sys.argv[1], int(sys.argv[2]))\n")
        proc = subprocess.run([sys.executable, "-c", code, str(out), str(os.getpid())], input=msgspec.json.encode(job),
                              capture_output=True, check=False)
        if (out / "failed.json").is_file():
            raise remade(msgspec.json.decode((out / "failed.json").read_bytes(), type=ChildFailure))
        if proc.returncode != 0 or not (out / "done.json").is_file():
            tail = proc.stderr.decode(errors="replace")[-STDERR_TAIL:]
            raise QnpipeError(f"planning in a child process ({sys.executable}) failed: exit status "
                              f"{proc.returncode}; its stderr ends:\n{tail}")
        done = msgspec.json.decode((out / "done.json").read_bytes(), type=_Done)
        return load_plan(out / "plan.json"), done.peak_bytes


def remade(failed: ChildFailure) -> Exception:
    """The child's error as the parent's: its own class when it can be made from the message, else the
    nearest qnpipe class it derives from (QnpipeError at the last); an OSError (a log that cannot be read)
    as the OSError class it was."""
    for module, name in failed.classes:
        try:
            cls = getattr(importlib.import_module(module), name)
            if isinstance(cls, type) and issubclass(cls, (QnpipeError, OSError)):
                return cls(failed.message)
        except (ImportError, AttributeError, TypeError):
            continue
    return QnpipeError(failed.message)


def plan_here(cfg: Config, budget: int, *, log: Path | str | None, synth_path: Path | str | None,
              share: Share | None) -> Plan:
    """What the child runs, in this process: `make_plan` for `cfg`'s model at `budget`."""
    from qnpipe.plan.family_account import dir_facts
    from qnpipe.plan.make import make_plan

    facts = dir_facts(Path(cfg.model.model_dir), cfg)
    return make_plan(facts, budget, log=log, device=cfg.plan.device, cost=cfg.plan.cost_path or None,
                     context=cfg.plan.context_tokens, cfg=cfg, synth_path=synth_path, share=share)


def main(out_dir: str, parent: int) -> None:
    """The child: read the `_Job` on stdin, plan, write `plan.json` and `done.json` (or `failed.json`)."""
    from qnpipe.config import rebuilt
    from qnpipe.plan.process import adopt_measured

    die_with(parent)
    out = Path(out_dir)
    job = msgspec.json.decode(sys.stdin.buffer.read(), type=_Job)
    try:
        cfg = rebuilt(job.tree, job.given)
        if job.process is not None:
            adopt_measured(job.process)
        plan = plan_here(cfg, job.budget, log=job.log, synth_path=job.synth_path, share=job.share)
    except (QnpipeError, OSError) as e:
        classes = [(c.__module__, c.__qualname__) for c in type(e).__mro__ if issubclass(c, (QnpipeError, OSError))]
        (out / "failed.json").write_bytes(msgspec.json.encode(ChildFailure(classes=classes, message=str(e))))
        return
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    save_plan(out / "plan.json", plan)
    (out / "done.json").write_bytes(msgspec.json.encode(_Done(peak_bytes=high_water_bytes())))


__all__ = ["ChildFailure", "plan_here", "plan_in_child", "remade"]
