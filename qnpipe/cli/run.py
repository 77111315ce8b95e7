"""`qnpipe demo`, `generate` and `chat`: the commands that run the model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qnpipe.cli.common import (
    DEMO_MODEL_DIR,
    add_config_flags,
    add_distributed_flag,
    add_gen_flags,
    add_memory_flags,
    add_mtp_flags,
    apply_memory,
    check_run_outputs,
    check_token_ids,
    load_config,
    precheck_model,
    prompt_arg,
    run_generate,
    stop_on_signals,
    text_arg,
)
from qnpipe.cli.flags import positional_or_flag
from qnpipe.errors import QnpipeError

MODEL_HELP = "model directory (original HF, mlx-lm, or qnpipe convert layout)"


def cmd_demo(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else DEMO_MODEL_DIR
    if not args.json:
        print(f"model: {model_dir}", file=sys.stderr)
    cfg = load_config(args)
    check_run_outputs(args, cfg, model_dir)
    precheck_model(model_dir, cfg)
    from qnpipe.engine import Engine

    eng = Engine(model_dir, cfg, warm_up=True)
    with stop_on_signals(args), eng:
        prompt = args.prompt
        if eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None) and not args.raw:
            prompt = eng.render_chat([{"role": "user", "content": args.prompt}])
        if not args.json:
            print(f"prompt: {args.prompt!r}\n", file=sys.stderr)
        return run_generate(eng, prompt, args)


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
    if tokens is not None and (args.chat or args.system is not None):
        raise QnpipeError(f"{'--chat' if args.chat else '--system'} needs --prompt TEXT (token ids are sent as they are)")
    cfg = load_config(args)
    check_run_outputs(args, cfg, args.model_dir)
    margs = precheck_model(args.model_dir, cfg)
    if tokens is not None:
        check_token_ids(tokens, margs, args.model_dir)
    cfg = apply_memory(args, cfg)
    from qnpipe.engine import Engine

    eng = Engine(args.model_dir, cfg, warm_up=True)
    if eng.rank:  # it served rank 0's steps until rank 0 was done: only rank 0 writes output
        eng.close()
        return 0
    with stop_on_signals(args), eng:
        prompt: str | list[int]
        if tokens is not None:
            prompt = tokens
        elif args.chat or args.system is not None:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}]
            prompt = eng.render_chat(msgs)
        else:
            prompt = args.prompt
        return run_generate(eng, prompt, args)


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    check_run_outputs(args, cfg, args.model_dir)
    precheck_model(args.model_dir, cfg)
    cfg = apply_memory(args, cfg)
    from qnpipe.cli.chat_session import ChatSession
    from qnpipe.engine import Engine

    eng = Engine(args.model_dir, cfg, warm_up=True)
    if eng.rank:  # it served rank 0's steps until rank 0's chat ended
        eng.close()
        return 0
    with stop_on_signals(args), eng:
        return ChatSession(eng, args).run()


def register(sub: Any, fmt: Any) -> None:
    d = sub.add_parser("demo", help="generate from the built-in tiny model (no download)", formatter_class=fmt,
                       description="Generate from the built-in tiny model: checks that qnpipe works on this machine.\n"
                       "The model is a 7M-parameter Qwen3-Next (44 experts, top-4, MTP head) trained for\n"
                       "an hour on the Python standard library: it writes Python-looking code, not good code.",
                       epilog="examples:\n  qnpipe demo\n  qnpipe demo -p 'Write a function that reverses a list.' -n 80\n"
                       "  qnpipe demo --raw -p 'def fibonacci(n):' --json")
    d.add_argument("--model", metavar="DIR", help="use this model directory instead of the built-in one")
    d.add_argument("-p", "--prompt", default="Write a Python function that adds two numbers.", type=prompt_arg(),
                   help="the user message, - reads it from standard input (default: %(default)r)")
    d.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_gen_flags(d, 48)
    add_config_flags(d)
    d.set_defaults(func=cmd_demo)

    g = sub.add_parser("generate", help="generate text from a prompt", formatter_class=fmt,
                       description="Generate a continuation of --prompt (or of --tokens) and print it as it comes,\n"
                       "then the stats on stderr.",
                       epilog="examples:\n  qnpipe generate ./tiny -p 'def fib(n):' -n 32 --json\n"
                       "  qnpipe generate ./tiny -p 'def fib(n):' --trace            # record the log --memory plans from\n"
                       "  qnpipe generate ./tiny -p 'def fib(n):' --memory 1.2GB     # plan the pool for a budget\n"
                       "  qnpipe generate ./tiny -p 'def fib(n):' --mtp -K 2 --stats   # MTP speculation\n"
                       "  mlx.launch --backend ring -n 2 -- qnpipe generate ./tiny -p 'def fib(n):' --distributed")
    positional_or_flag(g, "model_dir", "MODEL_DIR", "--model", MODEL_HELP)
    g.add_argument("-p", "--prompt", type=prompt_arg(), help="prompt text; - reads it from standard input")
    g.add_argument("--tokens", metavar="IDS", help="prompt as token ids, e.g. '1,2,3'")
    g.add_argument("--chat", action="store_true",
                   help="wrap --prompt in the model's chat template as a user turn. Without it the prompt is sent "
                   "as it is (unlike mlx-lm, which applies the template unless --ignore-chat-template): a "
                   "continuation is what code completion and the traces want")
    g.add_argument("--system", "--system-prompt", type=text_arg(allow_empty=True),
                   help="system message; implies --chat")
    add_gen_flags(g, 128)
    add_mtp_flags(g)
    add_memory_flags(g)
    add_distributed_flag(g)
    add_config_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template", formatter_class=fmt,
                       description="Multi-turn chat on the terminal, the answer streamed as it is generated.\n"
                       "Once the conversation is longer than prefix.snapshot_head_tokens, each turn resumes\n"
                       "from the previous turn's state instead of prefilling it again (docs/chat.md).\n"
                       "Commands: /reset clears the turns, /system [TEXT] shows or sets the system message,\n"
                       "/stats prints the figures (snapshots, peak memory, pool), /save FILE and /load FILE\n"
                       "store and restore the conversation (JSON), /help, /quit or Ctrl-D leaves.\n"
                       "Ctrl-C stops the answer being generated and returns to the prompt.",
                       epilog="examples:\n  qnpipe chat MODEL_DIR --system 'You are terse.'\n"
                       "  qnpipe chat MODEL_DIR --memory 8GB          (plan the pool for 8 GiB: docs/plan.md)\n"
                       "  qnpipe chat MODEL_DIR -n 256 --temperature 0.7 --seed 1\n"
                       "  qnpipe chat MODEL_DIR --set prefix.snapshot_dir=~/.cache/qnpipe-snaps   (reuse heads across runs)")
    positional_or_flag(c, "model_dir", "MODEL_DIR", "--model", MODEL_HELP)
    c.add_argument("--system", "--system-prompt", type=text_arg(allow_empty=True), help="system message")
    c.add_argument("-v", "--verbose", action="store_true", help="print stats after each answer")
    add_gen_flags(c, 512, json=False)
    add_memory_flags(c)
    add_distributed_flag(c)
    add_config_flags(c)
    c.set_defaults(func=cmd_chat)
