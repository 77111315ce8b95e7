"""Flags as mlx-lm's users type them: a bad flag answered by its subcommand, mlx-lm's names taken or explained.

`SubcommandParser` is the parser class of every subcommand: an unknown flag prints that
subcommand's usage (not `qnpipe`'s) with the closest flag it has, or, for an mlx-lm flag qnpipe
does not take, what to use instead and why (MLX_LM_ONLY). A positional that mlx-lm gives as a
flag (`--model`, `--hf-path`) is accepted either way (`positional_or_flag`). docs/mlx-lm-flags.md
has the table of names.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any

# mlx-lm's flags that qnpipe does not take (on purpose, or not yet): what to do instead, and why.
MLX_LM_ONLY: dict[str, str] = {
    "--max-kv-size": "qnpipe keeps the whole context: a rotating KV cache would drop the oldest tokens from the "
                     "full-attention layers and change the answers (the linear-attention layers keep a fixed-size "
                     "state anyway); to make the KV cache smaller, quantize it with --kv-bits",
    "--kv-group-size": "give it as --set kv.group_size=N (with --kv-bits)",
    "--quantized-kv-start": "qnpipe quantizes the KV cache (--kv-bits) from the first token",
    "--draft-model": "qnpipe drafts with the model's own MTP head: --mtp, -K N drafts per round",
    "--adapter-path": "adapters are not loaded at run time: fuse them (mlx_lm.fuse) and convert the fused model",
    "--trust-remote-code": "qnpipe runs no code from a model repository",
    "--ignore-chat-template": "generate sends the prompt as it is unless --chat or --system is given",
    "--use-default-chat-template": "qnpipe uses the model's own chat template (with --chat)",
    "--prompt-cache-file": "chat and serve keep prefix snapshots instead: --set prefix.snapshot_dir=DIR (docs/chat.md)",
    "--xtc-probability": "XTC sampling is not implemented: --top-k, --min-p, --top-p, --temp are",
    "--xtc-threshold": "XTC sampling is not implemented: --top-k, --min-p, --top-p, --temp are",
    "--min-tokens-to-keep": "min-p always keeps the most likely token (mlx-lm's default of 1)",
    "--decode-concurrency": "one engine serves one request at a time; --max-queue sets how many may wait",
    "--prompt-concurrency": "one engine serves one request at a time; --max-queue sets how many may wait",
    "--pipeline": "pipeline parallel across machines is --distributed under mlx.launch (docs/distributed.md)",
    "--quantize": "quantize with --bits N (qnpipe's -q is --quiet)",
    "--q-bits": "the bits are --bits N",
    "--q-group-size": "the group size is --group-size N",
    "--q-mode": "the mode is --mode MODE",
}


def positional_or_flag(p: argparse.ArgumentParser, dest: str, metavar: str, flag: str, help: str) -> None:
    """A required positional `dest` that may be given as `flag` instead (mlx-lm's spelling), not both."""
    p.add_argument(dest, metavar=metavar, nargs="?", help=help)
    p.add_argument(flag, dest=f"{dest}_flag", metavar=metavar, help=f"the same as {metavar} (mlx-lm's spelling)")
    pairs: list[tuple[str, str, str]] = getattr(p, "flag_positionals", [])
    p.flag_positionals = [*pairs, (dest, metavar, flag)]  # type: ignore[attr-defined]


def hint(arg: str, options: Sequence[str]) -> str:
    """Why `arg` is not taken and what to give instead: an mlx-lm flag qnpipe answers otherwise, or the closest."""
    name = arg.split("=", 1)[0]
    if name in MLX_LM_ONLY:
        return f"{name}: {MLX_LM_ONLY[name]}"
    long = [o for o in options if o.startswith("--")] if name.startswith("--") else list(options)
    close = difflib.get_close_matches(name, long, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else ""


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its own usage and a suggestion for an unknown flag; its flag positionals resolved."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            hints = [h for a in extras if a.startswith("-") and (h := hint(a, list(self._option_string_actions)))]
            self.error(f"unrecognized arguments: {' '.join(extras)}" + "".join(f"\n  {h}" for h in hints))
        for dest, metavar, flag in getattr(self, "flag_positionals", []):
            given, flagged = getattr(ns, dest), getattr(ns, f"{dest}_flag")
            if given is not None and flagged is not None and given != flagged:
                self.error(f"{metavar} given twice, as {given!r} and {flag} {flagged!r}: give one")
            if given is None and flagged is None:
                self.error(f"the following arguments are required: {metavar} (or {flag} {metavar})")
            setattr(ns, dest, given if given is not None else flagged)
            delattr(ns, f"{dest}_flag")  # one name for the one value
        return ns, []
