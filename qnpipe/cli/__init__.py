"""The `qnpipe` command: the only argv parser. Turns flags into config overrides and calls the API.

Each subcommand lives in its own module of this package, which has a `register(sub, fmt)`
adding its parser; COMMANDS lists them in the order `qnpipe --help` shows them.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from qnpipe.cli import bench_cmd, plan_cmd, replay_cmd, run, serve_cmd, store, sweep_cmd, trace_cmd
from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.cli.flags import SubcommandParser
from qnpipe.cli.model_names import resolve_builtin_model
from qnpipe.errors import QnpipeError, root_cause

__all__ = ["COMMANDS", "DEMO_MODEL_DIR", "build_parser", "main"]

COMMANDS = (run, serve_cmd, store, replay_cmd, sweep_cmd, plan_cmd, trace_cmd, bench_cmd)

EPILOG = """\
examples:
  qnpipe demo                                   generate from the built-in tiny model
  qnpipe generate MODEL_DIR -p "def fib(n):" -n 64
  qnpipe generate MODEL_DIR --chat -p "Hi" --temperature 0.7 --top-p 0.8 --seed 1
  qnpipe generate --model MODEL_DIR --system-prompt "Be terse." -p - -m 64 --temp 0.7 --top-k 20   mlx-lm's names
  qnpipe chat MODEL_DIR --system "You are terse."
  qnpipe make-tiny ./tiny --layout mlx --bits 4
  qnpipe make-tiny ./tiny-moe --family qwen3_moe     a tiny random model of another MoE family
  qnpipe convert ./Qwen3-Next-80B-A3B-Instruct --out ./qn80b-4bit --bits 4
  qnpipe verify-store ./qn80b-4bit
  qnpipe replay run.qtrace --set pool.expert_slots=16     what-if on a log of generate --trace
  qnpipe sweep run.qtrace --grid pool.expert_slots=8,16,32 --plot-dir plots/
  qnpipe plan MODEL_DIR --memory 8GB --log run.qtrace     the fastest configuration in 8 GiB
  qnpipe bench io                               fit this machine's device profile (replay --device measured)
  qnpipe serve MODEL_DIR --port 8080                      OpenAI-compatible HTTP server (docs/server.md)

Configuration: defaults < --config FILE.toml < QNPIPE_* / legacy environment names < flags.
Any setting can be given with --set SECTION.FIELD=VALUE (see docs/config.md).
mlx-lm's flag names and what qnpipe calls them: docs/mlx-lm-flags.md.
"""


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="qnpipe", formatter_class=fmt, epilog=EPILOG,
        description="Run mixture-of-experts models (Qwen3-Next) whose experts do not fit in memory.",
    )
    from qnpipe._version import __version__

    p.add_argument("--version", action="version", version=f"qnpipe {__version__}")
    # Each subcommand answers a bad flag with its own usage (qnpipe.cli.flags); nested ones inherit the class.
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=SubcommandParser)
    for module in COMMANDS:
        module.register(sub, fmt)
    return p


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (`qnpipe generate ... | head`): stop quietly, as standard tools do."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 128 + 13  # as if killed by SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    args = resolve_builtin_model(build_parser().parse_args(argv))  # `tiny`: the built-in model
    # A shell without job control starts background jobs with SIGINT ignored; `kill -INT` must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from qnpipe import hang_guard

    hang_guard.install(args.command)  # a plug-in's call that never returns must not freeze the command
    try:
        try:
            return int(args.func(args) or 0)
        except BaseExceptionGroup as group:  # a lost rank, a disk error in an actor: said as if raised alone
            leaf = root_cause(group)
            if isinstance(leaf, (QnpipeError, OSError, KeyboardInterrupt)):
                raise leaf from None
            raise
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except QnpipeError as e:
        print(f"qnpipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError) as e:
        print(f"qnpipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, I/O error, ... while writing or reading: name the file, no traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"qnpipe {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        from qnpipe.policy.plugin_check import where

        hang_guard.signalled(signal.SIGINT)  # the exit waits for the engine's thread: not for a stuck plug-in
        print(f"\nqnpipe {args.command}: interrupted{where(e)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
