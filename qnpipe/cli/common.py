"""What the subcommands share: config flags, generation flags, the model pre-check, stats printing."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

from qnpipe.builtin_models import DEMO_MODEL_DIR
from qnpipe.config.validate import (
    check_max_tokens,
    check_min_p,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
)
from qnpipe.errors import QnpipeError


def add_config_flags(p: argparse.ArgumentParser, *, prefill: bool = True,
                      example: str = "forward.prefill_chunk_tokens=0") -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE.toml", help="TOML file of settings (see docs/config.md)")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help=f"override one setting, e.g. --set {example} (repeatable)")
    if prefill:  # convert runs no forward
        g.add_argument("--prefill-chunk", "--prefill-step-size", type=int, metavar="N",
                       help="prefill N prompt tokens per forward (0 = whole prompt; mlx-lm's --prefill-step-size); "
                       "sets forward.prefill_chunk_tokens (PREFILL_CHUNK)")


def echo(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def add_gen_flags(p: argparse.ArgumentParser, default_tokens: int, json: bool = True) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("-n", "-m", "--max-tokens", type=int_arg(check_max_tokens), default=default_tokens, metavar="N",
                   help=f"stop after N new tokens (default {default_tokens}); generation also stops at EOS")
    add_sampling_flags(g, temperature=0.0)
    g.add_argument("--stats", action="store_true",
                   help="print the engine's figures on stderr: expert source, pool hits and misses by cause, "
                        "reads, bytes read, stall time, per-layer occupancy")
    g.add_argument("--trace", metavar="FILE", nargs="?", const=RECORDED_LOG,
                   help="write the event log (routes, acquires, grants, reads, evictions) to FILE; "
                        "docs/trace-format.md (sets trace.event_log_path). Without FILE: the model's "
                        "<expert dir>/trace.qtrace, which --memory plans from")
    if json:
        g.add_argument("--json", action="store_true",
                       help="print one JSON object (text, tokens, stats, engine stats) instead of text")


def add_sampling_flags(g: Any, *, temperature: float, what: str = "") -> None:
    """--temperature/--temp, --top-p, --top-k, --min-p, --seed (mlx-lm's names and its sampler: qnpipe.model.tails)."""
    g.add_argument("--temperature", "--temp", type=float_arg(check_temperature), default=temperature, metavar="T",
                   help=f"sampling temperature{what}; 0 = greedy (default {temperature:g})")
    g.add_argument("--top-p", type=float_arg(check_top_p), default=1.0, metavar="P",
                   help=f"nucleus sampling mass{what}, (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=int_arg(check_top_k), default=0, metavar="K",
                   help=f"sample from the K most likely tokens{what} (default 0 = off)")
    g.add_argument("--min-p", type=float_arg(check_min_p), default=0.0, metavar="P",
                   help=f"keep tokens at least P times as likely as the most likely one{what}, [0, 1] "
                   "(default 0 = off); filters apply as mlx-lm's: top-p, min-p, top-k, then temperature")
    if not what:
        g.add_argument("--seed", type=int_arg(check_seed), default=None,
                       help="random seed for sampling, >= 0 (reproducible output)")


# `--trace` given without a file: the model's recorded log (Config.recorded_log_path), set once the config is loaded.
RECORDED_LOG = "\0recorded"


def add_memory_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("memory")
    g.add_argument("--memory", metavar="SIZE",
                   help="plan the pool for this budget before loading, e.g. 8GB (GB = 2^30 bytes): slots per "
                        "layer, eviction, prefetch, chosen on --log, else on the log an earlier --trace run "
                        "recorded, else on a synthetic log; cached in <expert dir>/plans (docs/plan.md). "
                        "Settings of these you give are kept (planned with, or refused naming them: "
                        "pool.expert_slots, pool.capacity_profile_path). With --distributed, "
                        "each rank's own budget: layers split by the memory account, each rank plans its own")
    # dest plan_log: `replay` and `sweep` have a positional LOG of their own
    g.add_argument("--log", dest="plan_log", metavar="LOG", help="with --memory: the routing or event log to plan from")
    g.add_argument("--kv-bits", type=int_arg(_check_kv_bits), metavar="N",
                   help="quantize the KV cache of the full-attention layers to N bits, keys and values (mlx-lm's "
                   "--kv-bits; sets kv.quantize, kv.k_bits, kv.v_bits; from the first token). mlx-lm's "
                   "--max-kv-size has no counterpart: qnpipe keeps the whole context, a rotating cache would "
                   "change the answers (docs/mlx-lm-flags.md)")


def apply_memory(args: argparse.Namespace, cfg: Any) -> Any:
    """`cfg` with the `--memory` plan applied (one line on stderr says what was chosen), before the model loads."""
    if not cfg.plan.memory:
        if getattr(args, "plan_log", None):
            raise QnpipeError("--log is for --memory: give the budget to plan for (e.g. --memory 8GB)")
        return cfg
    from qnpipe import config
    from qnpipe.plan.startup import plan_at_startup

    cfg = config.with_overrides(cfg, {"model.model_dir": str(args.model_dir)})  # as Engine(model_dir, cfg) sets it
    with stop_on_signals(args):  # SIGTERM unwinds the planning: its temporary files are removed
        cfg, _ = plan_at_startup(cfg, say=lambda s: print(f"qnpipe {args.command}: {s}", file=sys.stderr, flush=True))
    return cfg


def add_mtp_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--mtp", action="store_true",
                   help="draft with the model's MTP head and verify: greedy output unchanged, sampling keeps "
                        "its distribution (sets mtp.enabled; variants: --set mtp.tree_top2=true, ...)")
    g.add_argument("-K", "--num-draft-tokens", type=int_arg(_check_k), default=None, metavar="N",
                   help="drafts per round with --mtp (default: mtp.num_draft_tokens, 3)")


def _check_kv_bits(bits: int, name: str) -> int:
    if not 2 <= bits <= 8:
        raise ValueError(f"{name} must be in 2..8 (kv.k_bits, kv.v_bits), got {bits}")
    return bits


def _check_k(k: int, name: str) -> int:
    if k < 1:
        raise ValueError(f"{name} must be >= 1, got {k}")
    return k


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise QnpipeError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    if getattr(args, "prefill_chunk", None) is not None:
        out["forward.prefill_chunk_tokens"] = args.prefill_chunk
    if getattr(args, "trace", None) and args.trace != RECORDED_LOG:
        out["trace.event_log_path"] = args.trace
    if getattr(args, "memory", None):
        out["plan.memory"] = args.memory
    if getattr(args, "plan_log", None):
        out["plan.log"] = args.plan_log
    if getattr(args, "mtp", False):
        out["mtp.enabled"] = True
    if getattr(args, "num_draft_tokens", None) is not None:
        out["mtp.num_draft_tokens"] = args.num_draft_tokens
    if getattr(args, "kv_bits", None) is not None:
        out |= {"kv.quantize": True, "kv.k_bits": args.kv_bits, "kv.v_bits": args.kv_bits}
    return out


def add_distributed_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed", action="store_true",
                   help="run as one rank of an mx.distributed ring, under `mlx.launch --backend ring` "
                   "(docs/distributed.md); only rank 0 reads input and writes output")


def load_config(args: argparse.Namespace) -> Any:
    from qnpipe import config

    overrides = config_overrides(args)
    if getattr(args, "distributed", False):
        overrides = {**overrides, "distributed.enabled": True}
    positional = getattr(args, "model_dir", None) or getattr(args, "model", None)
    if positional is not None:
        for key in ("model.model_dir", "model_dir"):
            if key in overrides and overrides[key] != str(positional):
                warn(args, f"the model directory {positional} given on the command line wins over "
                            f"--set {key}={overrides[key]}")
    cfg = config.load(args.config, overrides=overrides)
    if getattr(args, "trace", None) == RECORDED_LOG:
        if positional is None and getattr(args, "command", None) == "demo":
            positional = DEMO_MODEL_DIR
        at = config.with_overrides(cfg, {"model.model_dir": str(positional)}) if positional is not None else cfg
        cfg = config.with_overrides(cfg, {"trace.event_log_path": at.recorded_log_path()})
    # Every command that computes loads its config here, before it imports MLX.
    from qnpipe.compute import blas

    blas.apply(cfg.compute)
    return cfg


def checked(check: Any) -> Any:
    """An argparse `type=` that parses with `check` (qnpipe.config.validate), so bad values exit 2 before loading."""
    def parse(text: str) -> Any:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def int_arg(check: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        return check(value, name="value")
    return checked(parse)


def float_arg(check: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        return check(value, name="value")
    return checked(parse)


def prompt_arg() -> Any:
    """The prompt's text; `-` reads it from standard input (as mlx-lm's `-p -`)."""
    from qnpipe.config.validate import check_text

    def parse(text: str) -> str:
        if text == "-":
            text = sys.stdin.read()
            if not text:
                raise ValueError("-p -: standard input was empty: give at least one character")
        if not text:
            raise ValueError("empty text: give at least one character")
        return check_text(text, "value")
    return checked(parse)


def text_arg(allow_empty: bool = False) -> Any:
    from qnpipe.config.validate import check_text

    def parse(text: str) -> str:
        if not text and not allow_empty:
            raise ValueError("empty text: give at least one character")
        return check_text(text, "value")
    return checked(parse)


def precheck_model(model_dir: str | Path, cfg: Any) -> Any:
    """The cheap checks of a model directory, before MLX is imported or anything loads; its ModelArgs.

    config.json (sizes, model type), the tokenizer files, settings that depend on the model
    (forward.moe_topk_override against num_experts) and a qnpipe directory's store index and
    layer files (the validation verify-store makes). The loader repeats them.
    """
    from qnpipe.chat.tokenizer import check_tokenizer_files
    from qnpipe.config.validate import check_topk_override
    from qnpipe.model.args import args_from_dict, read_config

    if cfg.trace.event_log_path or cfg.trace.route_trace:  # a bad --trace fails now, not after the load or at the end
        from qnpipe.trace import check_log_paths

        check_log_paths(cfg)
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    if _generic_tier(config, cfg):  # any other family: its loader checks the rest (mlx-lm's classes need MLX)
        check_tokenizer_files(model_dir)
        tc = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        vocab = tc.get("vocab_size", tc.get("num_vocab"))
        return SimpleNamespace(model_type=config["model_type"], vocab_size=vocab if isinstance(vocab, int) else sys.maxsize)
    margs = args_from_dict(config, str(model_dir / "config.json"))
    check_tokenizer_files(model_dir)
    check_topk_override(cfg.forward.moe_topk_override, margs.num_experts)
    if isinstance(config.get("qnpipe"), dict) or (model_dir / "experts" / "index.json").is_file():
        from qnpipe.io.store import ExpertStore
        from qnpipe.io.store_check import check_against_model, check_store_sha256
        from qnpipe.model.args import model_id, store_sha256

        qcfg = config.get("quantization") or config.get("quantization_config")
        with ExpertStore.open(cfg.model.expert_dir or model_dir, expected_model_id=model_id(margs)) as store:
            check_against_model(store.index, store.root / "index.json", margs, qcfg if isinstance(qcfg, dict) else None)
            check_store_sha256(store.root / "index.json", store.sha256, store_sha256(config, model_dir / "config.json"))
    return margs


def _generic_tier(config: dict[str, Any], cfg: Any) -> bool:
    """The loader's choice (qnpipe.model.load.load_model): qwen3_next is native unless `model.tier=generic`."""
    from qnpipe.model.args import MODEL_TYPE

    mt = config.get("model_type")
    return mt is not None and (mt != MODEL_TYPE or str(cfg.model.tier) == "generic")


def check_run_outputs(args: argparse.Namespace, cfg: Any, model_dir: str | Path) -> None:
    """No file a model-running command writes (demo, generate, chat, serve) is one it reads (qnpipe.io.clobber).

    Its outputs: the event log, the routing log, the autopin heat file; its inputs: the model
    directory and expert store, --config, the plan's log, cost and device files, the capacity
    profile, the BLAS library, the API key file. The recorded log, the default heat file and the
    plan cache are the files it writes inside the model directory by design.
    """
    from qnpipe import config
    from qnpipe.io.clobber import check_outputs

    cfg = config.with_overrides(cfg, {"model.model_dir": str(model_dir)})
    experts = cfg.model.resolved_expert_dir()
    trace_flag = "--trace" if getattr(args, "trace", None) else "trace.event_log_path"
    outputs = [(trace_flag, cfg.trace.event_log_path),
               ("trace.route_trace_path", cfg.trace.route_trace_path if cfg.trace.route_trace else None),
               ("pool.autopin_usage_file", cfg.autopin_usage_path() if cfg.pool.autopin else None)]
    planned = bool(cfg.plan.memory)
    device = cfg.plan.device
    inputs = [("--config", args.config),
              ("--log", cfg.plan.log if planned else None),
              ("plan.cost_path", cfg.plan.cost_path if planned else None),
              ("plan.device", device if planned and Path(device).is_file() else None),
              ("read.device_profile_path", cfg.read.device_profile_path if planned and device == "measured" else None),
              ("pool.capacity_profile_path", cfg.pool.capacity_profile_path),
              ("compute.cpu_blas", cfg.compute.cpu_blas if os.sep in cfg.compute.cpu_blas else None),
              ("model.mtp_weights_path", cfg.model.mtp_weights_path),
              ("--api-key-file", getattr(args, "api_key_file", None))]
    model_flag = "MODEL_DIR" if args.command != "demo" else "--model" if getattr(args, "model", None) else "demo"
    models = [(model_flag, model_dir), ("model.expert_dir", experts)]
    own = [cfg.recorded_log_path(), os.path.join(experts, "pool_usage.json"),
           cfg.plan.cache_dir or os.path.join(experts, "plans")]
    check_outputs(outputs, inputs, models=models, own=own)


def check_token_ids(ids: list[int], margs: Any, model_dir: str | Path) -> None:
    """Token ids given on the command line against the model's vocabulary (before the weights load)."""
    bad = [t for t in ids if not 0 <= t < margs.vocab_size]
    if bad:
        raise QnpipeError(f"--tokens: token id {bad[0]} is out of range: the vocabulary of {model_dir} has "
                          f"{margs.vocab_size} ids (0..{margs.vocab_size - 1})")


@contextlib.contextmanager
def stop_on_signals(args: argparse.Namespace, *, ctrl_c: bool = True) -> Iterator[None]:
    """SIGTERM and SIGHUP stop the command through the engine's close, as Ctrl-C does and `serve` does.

    Wrap the open engine in it (`with stop_on_signals(args), eng:`): the signal raises
    SystemExit(128 + signal) in the main thread, the engine closes (the autopin heat is saved,
    the event log closed) and the exit status says which signal it was. A second signal
    during the close takes the default action: who sends two wants the process gone.
    Ctrl-C raises KeyboardInterrupt as ever; with `ctrl_c` through a handler of this block (not
    where trio runs in this thread: its Ctrl-C handling needs the default handler). Either
    signal is told to the hang guard (qnpipe.hang_guard), which ends the process if a plug-in's
    call keeps the engine from stopping; a signal that came out of a plug-in's call says so.
    """
    from qnpipe import hang_guard
    from qnpipe.policy.plugin_check import where

    got: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        hang_guard.signalled(signum)
        got.append(signum)
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    def interrupt(signum: int, frame: Any) -> None:
        hang_guard.signalled(signum)
        raise KeyboardInterrupt

    caught = (signal.SIGTERM, signal.SIGHUP, *((signal.SIGINT,) if ctrl_c else ()))
    old = {s: signal.signal(s, interrupt if s == signal.SIGINT else stop) for s in caught}
    came_from = ""
    try:
        yield
    except BaseException as e:
        came_from = where(e)
        if got and not isinstance(e, SystemExit):  # unwinding wrapped it (trio's groups) or the close failed
            raise SystemExit(128 + got[0]) from None
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            with contextlib.suppress(OSError, ValueError):  # after SIGHUP the terminal may be gone
                print(f"\nqnpipe {args.command}: stopped by {signal.Signals(got[0]).name}{came_from}",
                      file=sys.stderr)


def warn(args: argparse.Namespace, msg: str) -> None:
    print(f"qnpipe {args.command}: warning: {msg}", file=sys.stderr)


def print_stats(stats: Any, engine: Any = None) -> None:
    """The figures of one answer on stderr; with `engine` (EngineStats) first its load and warm-up times,
    which are not prefill (MLX's one-time start-up would otherwise look like a slow prompt)."""
    s = stats
    opened = "" if engine is None else f"loaded in {engine.load_s:.2f}s, warm-up {engine.warmup_s:.2f}s; "
    print(
        f"\n[{opened}{s.prompt_tokens} prompt tokens in {s.prefill_s:.2f}s ({s.prefill_tok_s:.1f} tok/s); "
        f"{s.generated_tokens} generated, decode {s.decode_tok_s:.1f} tok/s; "
        f"peak memory {s.peak_memory_bytes / 2**20:.0f} MiB; stop: {s.finish_reason}]",
        file=sys.stderr,
    )
    if getattr(s, "mtp", None) is not None:
        print(s.mtp.line(), file=sys.stderr)


class PrefillBar:
    """A transient progress bar on stderr while a long prompt (>= MIN_TOKENS) is prefilled."""

    MIN_TOKENS = 256

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> PrefillBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total < self.MIN_TOKENS:
            return
        if self.progress is None and done < total:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("prefill"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                                     TimeRemainingColumn(), transient=True, console=Console(stderr=True))
            self.task = self.progress.add_task("prefill", total=total)
            self.progress.start()
        if self.progress is not None:
            self.progress.update(self.task, completed=done)
            if done >= total:
                self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def then(self, fn: Any) -> Any:
        """`fn`, called after the bar is gone (text must not interleave with it)."""
        def call(*a: Any) -> Any:
            self.close()
            return fn(*a)

        return call


def run_generate(eng: Any, prompt: str | list[int], args: argparse.Namespace) -> int:
    from qnpipe.config.validate import check_prompt, context_warning

    try:
        prompt = check_prompt(prompt)
    except ValueError as e:
        raise QnpipeError(str(e)) from None
    if isinstance(prompt, str):
        prompt = eng.encode(prompt)  # the same ids generate() would make; counted for the warning
    if (w := context_warning(len(prompt), eng.args.max_position_embeddings)) is not None:
        warn(args, w)

    with PrefillBar(enabled=not args.json and sys.stderr.isatty()) as bar:
        res = eng.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, min_p=args.min_p, seed=args.seed, on_text=None if args.json else bar.then(echo), on_prefill=bar.update)
    if args.json:
        print(msgspec.json.encode({"text": res.text, "tokens": res.tokens, "stats": res.stats,
                                   "engine": eng.stats()}).decode())
    else:
        print()
        st = eng.stats()
        print_stats(res.stats, st)
        if getattr(args, "stats", False):
            print_engine_stats(st)
    return 0


def print_engine_stats(st: Any) -> None:
    from qnpipe.stats_lines import engine_lines

    for line in engine_lines(st):
        print(line, file=sys.stderr)
