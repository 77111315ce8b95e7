"""The `qnpipe` command: the only argv parser. Turns flags into config overrides and calls the API."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.errors import QnpipeError

# The embedded default model: a tiny Qwen3-Next trained on the Python standard library
# (tools/train_tiny.py; its MODEL_CARD.md has the figures). Ships inside the package.
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "data" / "tiny_trained"

EPILOG = """\
examples:
  qnpipe demo                                   generate from the built-in tiny model
  qnpipe generate MODEL_DIR -p "def fib(n):" -n 64
  qnpipe generate MODEL_DIR --chat -p "Hi" --temperature 0.7 --top-p 0.8 --seed 1
  qnpipe chat MODEL_DIR --system "You are terse."
  qnpipe make-tiny ./tiny --layout mlx --bits 4
  qnpipe convert ./Qwen3-Next-80B-A3B-Instruct --out ./qn80b-4bit --bits 4
  qnpipe verify-store ./qn80b-4bit
  qnpipe replay run.qtrace --set pool.expert_slots=16     what-if on a log of generate --trace

Configuration: defaults < --config FILE.toml < QNPIPE_* / legacy environment names < flags.
Any setting can be given with --set SECTION.FIELD=VALUE (see docs/config.md).
"""


def _add_config_flags(p: argparse.ArgumentParser, *, prefill: bool = True,
                      example: str = "forward.prefill_chunk_tokens=0") -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE.toml", help="TOML file of settings (see docs/config.md)")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help=f"override one setting, e.g. --set {example} (repeatable)")
    if prefill:  # convert runs no forward
        g.add_argument("--prefill-chunk", type=int, metavar="N",
                       help="prefill N prompt tokens per forward (0 = whole prompt); PREFILL_CHUNK")


def _echo(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _add_gen_flags(p: argparse.ArgumentParser, default_tokens: int, json: bool = True) -> None:
    from qnpipe.validate import check_max_tokens, check_seed, check_temperature, check_top_p

    g = p.add_argument_group("generation")
    g.add_argument("-n", "--max-tokens", type=_int_arg(check_max_tokens), default=default_tokens, metavar="N",
                   help=f"stop after N new tokens (default {default_tokens}); generation also stops at EOS")
    g.add_argument("--temperature", type=_float_arg(check_temperature), default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--top-p", type=_float_arg(check_top_p), default=1.0, metavar="P",
                   help="nucleus sampling mass, (0, 1] (default 1)")
    g.add_argument("--seed", type=_int_arg(check_seed), default=None,
                   help="random seed for sampling, >= 0 (reproducible output)")
    g.add_argument("--stats", action="store_true",
                   help="print the engine's figures on stderr: expert source, pool hits and misses by cause, "
                        "reads, bytes read, stall time, per-layer occupancy")
    g.add_argument("--trace", metavar="FILE",
                   help="write the event log (routes, acquires, grants, reads, evictions) to FILE; "
                        "docs/trace-format.md (sets trace.event_log_path)")
    if json:
        g.add_argument("--json", action="store_true",
                       help="print one JSON object (text, tokens, stats, engine stats) instead of text")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise QnpipeError(f"--set expects KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    if getattr(args, "prefill_chunk", None) is not None:
        out["forward.prefill_chunk_tokens"] = args.prefill_chunk
    if getattr(args, "trace", None):
        out["trace.event_log_path"] = args.trace
    return out


def _load_config(args: argparse.Namespace) -> Any:
    from qnpipe import config

    overrides = _overrides(args)
    positional = getattr(args, "model_dir", None) or getattr(args, "model", None)
    if positional is not None:
        for key in ("model.model_dir", "model_dir"):
            if key in overrides and overrides[key] != str(positional):
                _warn(args, f"the model directory {positional} given on the command line wins over "
                            f"--set {key}={overrides[key]}")
    return config.load(args.config, overrides=overrides)


def _checked(check: Any) -> Any:
    """An argparse `type=` that parses with `check` (qnpipe.validate), so bad values exit 2 before loading."""
    def parse(text: str) -> Any:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def _int_arg(check: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        return check(value, name="value")
    return _checked(parse)


def _float_arg(check: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        return check(value, name="value")
    return _checked(parse)


def _text_arg(allow_empty: bool = False) -> Any:
    from qnpipe.validate import check_text

    def parse(text: str) -> str:
        if not text and not allow_empty:
            raise ValueError("empty text: give at least one character")
        return check_text(text, "value")
    return _checked(parse)


def _precheck_model(model_dir: str | Path, cfg: Any) -> None:
    """The cheap checks of a model directory, before MLX is imported or anything loads.

    config.json (sizes, model type), the tokenizer files, settings that depend on the model
    (forward.moe_topk_override against num_experts) and a qnpipe directory's store index and
    layer files (the validation verify-store makes). The loader repeats them.
    """
    from qnpipe.chat.tokenizer import check_tokenizer_files
    from qnpipe.model.args import args_from_dict, read_config
    from qnpipe.validate import check_topk_override

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    margs = args_from_dict(config, str(model_dir / "config.json"))
    check_tokenizer_files(model_dir)
    check_topk_override(cfg.forward.moe_topk_override, margs.num_experts)
    if isinstance(config.get("qnpipe"), dict) or (model_dir / "experts" / "index.json").is_file():
        from qnpipe.io.store import ExpertStore, model_id
        from qnpipe.io.store_check import check_against_model

        qcfg = config.get("quantization") or config.get("quantization_config")
        with ExpertStore.open(cfg.model.expert_dir or model_dir, expected_model_id=model_id(margs)) as store:
            check_against_model(store.index, store.root / "index.json", margs, qcfg if isinstance(qcfg, dict) else None)


def _warn(args: argparse.Namespace, msg: str) -> None:
    print(f"qnpipe {args.command}: warning: {msg}", file=sys.stderr)


def _print_stats(stats: Any) -> None:
    s = stats
    print(
        f"\n[{s.prompt_tokens} prompt tokens in {s.prefill_s:.2f}s ({s.prefill_tok_s:.1f} tok/s); "
        f"{s.generated_tokens} generated, decode {s.decode_tok_s:.1f} tok/s; "
        f"peak memory {s.peak_memory_bytes / 2**20:.0f} MiB; stop: {s.finish_reason}]",
        file=sys.stderr,
    )


class _PrefillBar:
    """A transient progress bar on stderr while a long prompt (>= MIN_TOKENS) is prefilled."""

    MIN_TOKENS = 256

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> _PrefillBar:
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


def _run_generate(eng: Any, prompt: str | list[int], args: argparse.Namespace) -> int:
    from qnpipe.validate import check_prompt, context_warning

    try:
        prompt = check_prompt(prompt)
    except ValueError as e:
        raise QnpipeError(str(e)) from None
    if isinstance(prompt, str):
        prompt = eng.encode(prompt)  # the same ids generate() would make; counted for the warning
    if (w := context_warning(len(prompt), eng.args.max_position_embeddings)) is not None:
        _warn(args, w)

    with _PrefillBar(enabled=not args.json and sys.stderr.isatty()) as bar:
        res = eng.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, on_text=None if args.json else bar.then(_echo), on_prefill=bar.update)
    if args.json:
        print(msgspec.json.encode({"text": res.text, "tokens": res.tokens, "stats": res.stats,
                                   "engine": eng.stats()}).decode())
    else:
        print()
        _print_stats(res.stats)
        if getattr(args, "stats", False):
            _print_engine_stats(eng.stats())
    return 0


def _print_engine_stats(st: Any) -> None:
    p = st.pool
    if p is None:
        print(f"[experts: {st.expert_source}, {st.resident_expert_bytes / 2**20:.1f} MiB in memory]", file=sys.stderr)
        return
    causes = ", ".join(f"{k} {v}" for k, v in sorted(p.misses_by_cause.items()))
    occ = " ".join(f"{ly.layer}:{ly.occupancy}/{ly.capacity}" for ly in p.layers)
    print(f"[experts: pool, {p.slot_bytes / 2**20:.1f} MiB of slots; hits {p.hits}, misses {p.misses} ({causes}), "
          f"hit rate {p.hit_rate:.3f}; {p.reads} reads, {p.bytes_read / 2**20:.1f} MiB read, "
          f"stall {p.stall_s:.3f}s; {p.split_layer_steps} layer-steps in parts]\n[occupancy {occ}]",
          file=sys.stderr)


def cmd_demo(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else DEMO_MODEL_DIR
    if not args.json:
        print(f"model: {model_dir}", file=sys.stderr)
    cfg = _load_config(args)
    _precheck_model(model_dir, cfg)
    from qnpipe.embed import Engine

    with Engine(model_dir, cfg) as eng:
        prompt = args.prompt
        if eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None) and not args.raw:
            from qnpipe.chat.tokenizer import render_chat

            prompt = render_chat(eng.tokenizer, [{"role": "user", "content": args.prompt}])
        if not args.json:
            print(f"prompt: {args.prompt!r}\n", file=sys.stderr)
        return _run_generate(eng, prompt, args)


def _read_tokens(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise QnpipeError(f"--tokens expects integers separated by commas or spaces, got {text!r}") from None
    if not ids:
        raise QnpipeError("--tokens is empty: give at least one token id")
    if any(t < 0 for t in ids):
        raise QnpipeError(f"--tokens: token id {min(ids)} is negative")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.tokens is None):
        raise QnpipeError("give exactly one of --prompt TEXT or --tokens IDS")
    tokens = _read_tokens(args.tokens) if args.tokens is not None else None
    if tokens is not None and args.chat:
        raise QnpipeError("--chat needs --prompt TEXT (token ids are sent as they are)")
    cfg = _load_config(args)
    _precheck_model(args.model_dir, cfg)
    from qnpipe.embed import Engine

    with Engine(args.model_dir, cfg) as eng:
        prompt: str | list[int]
        if tokens is not None:
            prompt = tokens
        elif args.chat:
            from qnpipe.chat.tokenizer import render_chat

            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}]
            prompt = render_chat(eng.tokenizer, msgs)
        else:
            prompt = args.prompt
        return _run_generate(eng, prompt, args)


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = _load_config(args)
    _precheck_model(args.model_dir, cfg)
    from qnpipe.chat.tokenizer import render_chat
    from qnpipe.embed import Engine

    messages: list[dict[str, Any]] = [{"role": "system", "content": args.system}] if args.system else []
    with Engine(args.model_dir, cfg) as eng:
        print("chat: type a message; /reset clears the conversation, /quit or Ctrl-D leaves "
              "(start a line with // to send one beginning with /).", file=sys.stderr)
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            except UnicodeDecodeError as e:
                print(f"qnpipe chat: error: the input line is not valid UTF-8 (byte 0x{e.object[e.start]:02x}); "
                      f"not sent", file=sys.stderr)
                continue
            from qnpipe.validate import check_text

            try:
                check_text(line, "the input line")
            except ValueError as e:
                print(f"qnpipe chat: error: {e}; not sent", file=sys.stderr)
                continue
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                messages = messages[:1] if args.system else []
                continue
            if cmd.startswith("//"):
                line = line.lstrip()[1:]
            elif cmd.startswith("/"):
                print(f"qnpipe chat: unknown command {cmd.split()[0]} (commands: /reset, /quit, /exit; "
                      f"start the line with // to send it as text)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            sys.stdout.write("assistant> ")
            pieces: list[str] = []

            def show(piece: str, pieces: list[str] = pieces) -> None:
                pieces.append(piece)
                _echo(piece)

            try:
                res = eng.generate(render_chat(eng.tokenizer, messages), max_tokens=args.max_tokens,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                   on_text=show)
            except KeyboardInterrupt:
                # Ctrl-C during an answer: the engine stopped it at its next layer and stays usable.
                # The conversation keeps the part the user saw; back to the prompt.
                print()
                print("[answer interrupted]", file=sys.stderr)
                if pieces:
                    messages.append({"role": "assistant", "content": "".join(pieces)})
                else:
                    messages.pop()
                continue
            print()
            if args.verbose:
                _print_stats(res.stats)
            messages.append({"role": "assistant", "content": res.text})


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from qnpipe.tiny import make_tiny

    if args.layout == "hf" and args.bits is not None:
        raise QnpipeError("--bits needs --layout mlx (the original HF layout is never quantized)")
    try:
        out = make_tiny(Path(args.out), layout=args.layout, bits=args.bits, group_size=args.group_size,
                        seed=args.seed, force=args.force)
    except FileExistsError:
        raise QnpipeError(f"{Path(args.out).absolute()} exists and is not empty (pass --force to replace it)") from None
    print(out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from qnpipe.convert import convert

    mtp_bits = args.mtp_bits
    if mtp_bits is None:
        mtp_bits = _load_config(args).mtp.bits
    report = convert(args.src, args.out, bits=args.bits, group_size=args.group_size, dtype=args.dtype,
                     mtp_bits=mtp_bits, mtp_from=args.mtp_from, force=args.force,
                     progress=not (args.json or args.quiet),
                     log=lambda msg: print(msg, file=sys.stderr))
    if args.json:
        print(msgspec.json.encode(report).decode())
    elif not args.quiet:
        print(f"{report.out}: {report.moe_layers} MoE layers x {report.num_experts} experts, "
              f"{report.bytes_written / 2**20:.1f} MiB written in {report.seconds:.1f}s "
              f"({report.bytes_per_s / 2**20:.1f} MiB/s), peak RSS {report.peak_rss_bytes / 2**20:.0f} MiB",
              file=sys.stderr)
        print(report.out)
    return 0


def cmd_verify_store(args: argparse.Namespace) -> int:
    from qnpipe.verify import describe, verify_store

    report = verify_store(args.dir, progress=not args.json)
    if args.json:
        print(msgspec.json.encode({**msgspec.to_builtins(report), "ok": report.ok}).decode())
    else:
        print(describe(report))
    return 0 if report.ok else 1


_REPLAY_KEYS = {"cost.per_layer_s", "cost.per_token_s", "device.bandwidth_bytes_per_s", "device.latency_s",
                "device.per_mb_latency_s", "device.queue_depth", "replay.record_nbytes"}


def cmd_replay(args: argparse.Namespace) -> int:
    from qnpipe import config
    from qnpipe.io.simssd import PROFILES, DeviceProfile
    from qnpipe.replay import CostModel, describe, replay, to_json

    if args.device not in PROFILES:
        raise QnpipeError(f"--device {args.device}: unknown, known: {', '.join(sorted(PROFILES))}")
    own: dict[str, dict[str, str]] = {"cost": {}, "device": {}, "replay": {}}
    rest = []
    for item in args.sets:  # cost.*, device.* and replay.* are the replay's own; the rest is the config
        key, sep, value = item.partition("=")
        if sep and key.strip() in _REPLAY_KEYS:
            section, _, name = key.strip().partition(".")
            own[section][name] = value.strip()
        else:
            rest.append(item)
    args.sets = rest
    cfg = config.load(args.config, overrides=_overrides(args))
    try:
        cost = msgspec.convert(own["cost"], CostModel, strict=False)
        base = msgspec.to_builtins(PROFILES[args.device])
        device = msgspec.convert({**base, **own["device"]}, DeviceProfile, strict=False)
        nbytes = int(own["replay"]["record_nbytes"]) if "record_nbytes" in own["replay"] else None
    except (msgspec.ValidationError, ValueError) as e:
        raise QnpipeError(f"--set: {e}") from None
    report = replay(args.log, cfg, device_profile=device, cost=cost, record_nbytes=nbytes, predictor=args.predict)
    print(to_json(report).decode() if args.json else describe(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="qnpipe", formatter_class=fmt, epilog=EPILOG,
        description="Run mixture-of-experts models (Qwen3-Next) whose experts do not fit in memory.",
    )
    from qnpipe import __version__

    p.add_argument("--version", action="version", version=f"qnpipe {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser("demo", help="generate from the built-in tiny model (no download)", formatter_class=fmt,
                       description="Generate from the built-in tiny model: checks that qnpipe works on this machine.\n"
                       "The model is a 7M-parameter Qwen3-Next (44 experts, top-4, MTP head) trained for\n"
                       "an hour on the Python standard library: it writes Python-looking code, not good code.",
                       epilog="examples:\n  qnpipe demo\n  qnpipe demo -p 'Write a function that reverses a list.' -n 80\n"
                       "  qnpipe demo --raw -p 'def fibonacci(n):' --json")
    d.add_argument("--model", metavar="DIR", help="use this model directory instead of the built-in one")
    d.add_argument("-p", "--prompt", default="Write a Python function that adds two numbers.", type=_text_arg(),
                   help="the user message (default: %(default)r)")
    d.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_gen_flags(d, 48)
    _add_config_flags(d)
    d.set_defaults(func=cmd_demo)

    g = sub.add_parser("generate", help="generate text from a prompt", formatter_class=fmt,
                       description="Generate a continuation of --prompt (or of --tokens) and print it as it comes,\n"
                       "then the stats on stderr.",
                       epilog="example:\n  qnpipe generate ./tiny -p 'def fib(n):' -n 32 --json")
    g.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (original HF, mlx-lm, or qnpipe convert layout)")
    g.add_argument("-p", "--prompt", type=_text_arg(), help="prompt text")
    g.add_argument("--tokens", metavar="IDS", help="prompt as token ids, e.g. '1,2,3'")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template as a user turn")
    g.add_argument("--system", type=_text_arg(allow_empty=True), help="system message (with --chat)")
    _add_gen_flags(g, 128)
    _add_config_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template", formatter_class=fmt,
                       description="Multi-turn chat on the terminal. /reset clears the history; /quit leaves.")
    c.add_argument("model_dir", metavar="MODEL_DIR")
    c.add_argument("--system", type=_text_arg(allow_empty=True), help="system message")
    c.add_argument("-v", "--verbose", action="store_true", help="print stats after each answer")
    _add_gen_flags(c, 512, json=False)
    _add_config_flags(c)
    c.set_defaults(func=cmd_chat)

    t = sub.add_parser("make-tiny", help="write a deterministic random tiny Qwen3-Next model (for tests)",
                       formatter_class=fmt,
                       description="Write a tiny Qwen3-Next (hidden 128, 8 layers, 64 experts, top-4, vocab 1024)\n"
                       "with random weights, MTP tensors, a small real tokenizer and a Qwen chat template.")
    t.add_argument("out", metavar="OUT", help="directory to create")
    t.add_argument("--layout", choices=["hf", "mlx"], default="hf",
                   help="hf = original Hugging Face layout (default); mlx = mlx-lm converted")
    t.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8], help="quantize (mlx layout only)")
    t.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="quantization group size")
    t.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    t.add_argument("--force", action="store_true", help="replace OUT if it exists")
    t.set_defaults(func=cmd_make_tiny)

    v = sub.add_parser("convert", help="convert a checkpoint into a qnpipe model directory (expert store)",
                       formatter_class=fmt,
                       description="Convert an original Hugging Face Qwen3-Next checkpoint, or an mlx-lm converted one,\n"
                       "into a qnpipe model directory: non-expert weights in safetensors, the MTP head in\n"
                       "mtp.safetensors, and experts/ with one file per MoE layer (one read per expert).\n"
                       "Memory stays near one chunk of experts; the output appears only when complete.\n"
                       "Layout: docs/store-format.md.",
                       epilog="examples:\n"
                       "  qnpipe convert ./Qwen3-Next-80B-A3B-Instruct --out ./qn80b-4bit --bits 4\n"
                       "  qnpipe convert ./Qwen3-Next-80B-A3B-Instruct-4bit --out ./qn80b-4bit \\\n"
                       "      --mtp-from ./Qwen3-Next-80B-A3B-Instruct\n"
                       "  qnpipe convert ./tiny --out ./tiny-qn --json")
    v.add_argument("src", metavar="SRC", help="checkpoint directory (original HF or mlx-lm layout)")
    v.add_argument("--out", required=True, metavar="DIR", help="model directory to create")
    v.add_argument("--bits", type=int, choices=[2, 3, 4, 5, 6, 8],
                   help="quantize an unquantized source as `mlx_lm.convert -q` does (router and "
                   "shared-expert gate at 8 bits)")
    v.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="quantization group size (default 64)")
    v.add_argument("--dtype", choices=["float16", "bfloat16", "float32"],
                   help="float type of the output (default: torch_dtype of an HF source, as mlx-lm; "
                   "unchanged for an mlx-lm source)")
    v.add_argument("--mtp-bits", type=int, choices=[0, 2, 3, 4, 5, 6, 8], metavar="N",
                   help="quantize the MTP head to N bits, 0 = keep float (default: mtp.bits, MTP_BITS, 4)")
    v.add_argument("--mtp-from", metavar="HF_DIR",
                   help="take mtp.* from this original checkpoint (an mlx-lm source has no MTP)")
    v.add_argument("--force", action="store_true", help="replace DIR if it exists")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    v.add_argument("--json", action="store_true", help="print one JSON object with the figures (no progress bar)")
    _add_config_flags(v, prefill=False, example="mtp.bits=8")
    v.set_defaults(func=cmd_convert)

    s = sub.add_parser("verify-store", help="check every expert record against its checksum", formatter_class=fmt,
                       description="Read every expert record of a qnpipe model directory and compare its crc32 with\n"
                       "experts/index.json. Bad records are listed by layer, expert, file and offset;\n"
                       "exit status 1 if any is bad (2 if the index itself is missing or invalid, or does\n"
                       "not match the model's config.json: the checks the loader makes).",
                       epilog="examples:\n  qnpipe verify-store ./qn80b-4bit\n"
                       "  qnpipe verify-store ./qn80b-4bit/experts --json")
    s.add_argument("dir", metavar="DIR", help="qnpipe model directory, or its experts/ directory")
    s.add_argument("--json", action="store_true", help="print one JSON object (counts, throughput, bad records)")
    s.set_defaults(func=cmd_verify_store)

    r = sub.add_parser("replay", help="replay an event log on a simulated SSD in virtual time (what-if)",
                       formatter_class=fmt,
                       description="Replay the routes of a log written by `qnpipe generate --trace FILE` through the real\n"
                       "pool and read scheduler, with modelled compute (cost.*) and a simulated device\n"
                       "(--device, device.*), in virtual time: no model, same report on every run.\n"
                       "Reports steps/s, hit rate, misses by cause, bytes and stall per step, device\n"
                       "utilisation, and per layer the hit rate beside Belady's optimum at that capacity.\n"
                       "Replay settings: cost.per_layer_s, cost.per_token_s, device.bandwidth_bytes_per_s,\n"
                       "device.latency_s, device.per_mb_latency_s, device.queue_depth, replay.record_nbytes;\n"
                       "any other --set is a config setting (pool.expert_slots, pool.evict_policy, read.workers).",
                       epilog="examples:\n"
                       "  qnpipe generate ./tiny-qn -p 'def fib(n):' -n 32 --trace run.qtrace\n"
                       "  qnpipe replay run.qtrace --set pool.expert_slots=16 --set pool.evict_policy=lru\n"
                       "  qnpipe replay run.qtrace --json --set device.bandwidth_bytes_per_s=3e9 "
                       "--set cost.per_layer_s=0.004")
    r.add_argument("log", metavar="LOG", help="event log (qnpipe generate --trace), docs/trace-format.md")
    r.add_argument("--device", default="apple-m5-internal", metavar="NAME",
                   help="built-in device profile the device.* settings start from (default %(default)s)")
    r.add_argument("--predict", choices=["none", "previous"], default="none",
                   help="none = demand reads only (default); previous = model-free prefetch: each MoE layer "
                   "hints that the next routes as the previous token did (turns predict.cross_layer_prefetch on)")
    r.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _add_config_flags(r, prefill=False, example="pool.expert_slots=16")
    r.set_defaults(func=cmd_replay)
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
    args = build_parser().parse_args(argv)
    # A shell without job control starts background jobs with SIGINT ignored; `kill -INT` must still stop us.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return int(args.func(args) or 0)
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
    except KeyboardInterrupt:
        print(f"\nqnpipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
