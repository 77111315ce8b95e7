"""`qnpipe demo`, `generate` and `chat`: the commands that run the model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from qnpipe.cli.common import (
    DEMO_MODEL_DIR,
    add_config_flags,
    add_gen_flags,
    add_mtp_flags,
    echo,
    load_config,
    precheck_model,
    print_stats,
    run_generate,
    text_arg,
)
from qnpipe.errors import QnpipeError


def cmd_demo(args: argparse.Namespace) -> int:
    model_dir = Path(args.model) if args.model else DEMO_MODEL_DIR
    if not args.json:
        print(f"model: {model_dir}", file=sys.stderr)
    cfg = load_config(args)
    precheck_model(model_dir, cfg)
    from qnpipe.embed import Engine

    with Engine(model_dir, cfg) as eng:
        prompt = args.prompt
        if eng.tokenizer is not None and getattr(eng.tokenizer, "chat_template", None) and not args.raw:
            from qnpipe.chat.tokenizer import render_chat

            prompt = render_chat(eng.tokenizer, [{"role": "user", "content": args.prompt}])
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
    if tokens is not None and args.chat:
        raise QnpipeError("--chat needs --prompt TEXT (token ids are sent as they are)")
    cfg = load_config(args)
    precheck_model(args.model_dir, cfg)
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
        return run_generate(eng, prompt, args)


def cmd_chat(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    precheck_model(args.model_dir, cfg)
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
                echo(piece)

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
                print_stats(res.stats)
            messages.append({"role": "assistant", "content": res.text})


def register(sub: Any, fmt: Any) -> None:
    d = sub.add_parser("demo", help="generate from the built-in tiny model (no download)", formatter_class=fmt,
                       description="Generate from the built-in tiny model: checks that qnpipe works on this machine.\n"
                       "The model is a 7M-parameter Qwen3-Next (44 experts, top-4, MTP head) trained for\n"
                       "an hour on the Python standard library: it writes Python-looking code, not good code.",
                       epilog="examples:\n  qnpipe demo\n  qnpipe demo -p 'Write a function that reverses a list.' -n 80\n"
                       "  qnpipe demo --raw -p 'def fibonacci(n):' --json")
    d.add_argument("--model", metavar="DIR", help="use this model directory instead of the built-in one")
    d.add_argument("-p", "--prompt", default="Write a Python function that adds two numbers.", type=text_arg(),
                   help="the user message (default: %(default)r)")
    d.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_gen_flags(d, 48)
    add_config_flags(d)
    d.set_defaults(func=cmd_demo)

    g = sub.add_parser("generate", help="generate text from a prompt", formatter_class=fmt,
                       description="Generate a continuation of --prompt (or of --tokens) and print it as it comes,\n"
                       "then the stats on stderr.",
                       epilog="examples:\n  qnpipe generate ./tiny -p 'def fib(n):' -n 32 --json\n"
                       "  qnpipe generate ./tiny -p 'def fib(n):' --mtp -K 2 --stats   # MTP speculation")
    g.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (original HF, mlx-lm, or qnpipe convert layout)")
    g.add_argument("-p", "--prompt", type=text_arg(), help="prompt text")
    g.add_argument("--tokens", metavar="IDS", help="prompt as token ids, e.g. '1,2,3'")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template as a user turn")
    g.add_argument("--system", type=text_arg(allow_empty=True), help="system message (with --chat)")
    add_gen_flags(g, 128)
    add_mtp_flags(g)
    add_config_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template", formatter_class=fmt,
                       description="Multi-turn chat on the terminal. /reset clears the history; /quit leaves.")
    c.add_argument("model_dir", metavar="MODEL_DIR")
    c.add_argument("--system", type=text_arg(allow_empty=True), help="system message")
    c.add_argument("-v", "--verbose", action="store_true", help="print stats after each answer")
    add_gen_flags(c, 512, json=False)
    add_config_flags(c)
    c.set_defaults(func=cmd_chat)
