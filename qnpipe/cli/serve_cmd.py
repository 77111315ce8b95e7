"""`qnpipe serve`: the OpenAI-compatible HTTP server (qnpipe.server; docs/server.md)."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path
from typing import Any

from qnpipe.cli.common import (
    add_config_flags,
    add_distributed_flag,
    add_memory_flags,
    add_sampling_flags,
    apply_memory,
    check_run_outputs,
    checked,
    int_arg,
    load_config,
    precheck_model,
)
from qnpipe.cli.flags import positional_or_flag
from qnpipe.errors import QnpipeError
from qnpipe.io.files import KiB, read_text_capped
from qnpipe.server.access_log import LEVELS

KEY_FILE_CAP = 64 * KiB


def _positive(value: int, name: str = "value") -> int:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _non_negative(value: int, name: str = "value") -> int:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _port(value: int, name: str = "value") -> int:
    if not 0 <= value <= 65535:
        raise ValueError(f"{name} must be a port in 0..65535, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a number of seconds > 0, got {text!r}")
    return value


def api_key(args: argparse.Namespace) -> str | None:
    """The key of --api-key or --api-key-file (stripped); None without either.

    QnpipeError for both, an empty key (`--api-key ''` would otherwise serve without one) or an
    empty, unreadable or oversized file (read capped: a FIFO or a device is refused).
    """
    if args.api_key is not None and args.api_key_file:
        raise QnpipeError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        path = Path(args.api_key_file)
        key = read_text_capped(path, KEY_FILE_CAP).strip()
        if not key:
            raise QnpipeError(f"{path}: the API key file is empty")
        return key
    if args.api_key is not None and not args.api_key.strip():
        raise QnpipeError("--api-key is empty: give a key (or leave --api-key out to serve loopback without one)")
    return args.api_key.strip() if args.api_key is not None else None


def cmd_serve(args: argparse.Namespace) -> int:
    from qnpipe.server.jobs import Limits
    from qnpipe.server.run import ServerOptions, check_options, run_server

    if args.default_max_tokens > args.max_tokens_cap:
        raise QnpipeError(f"--default-max-tokens {args.default_max_tokens} is above --max-tokens-cap "
                          f"{args.max_tokens_cap}")
    opts = ServerOptions(host=args.host, port=args.port, api_key=api_key(args), max_queue=args.max_queue,
                         limits=Limits(max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens,
                                       max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                       min_p=args.min_p),
                         model_name=args.model_name, log_level=args.log_level)
    check_options(opts)  # before the model loads
    cfg = load_config(args)
    check_run_outputs(args, cfg, args.model_dir)
    precheck_model(args.model_dir, cfg)
    cfg = apply_memory(args, cfg)

    def ready(binds: list[str]) -> None:
        print(f"qnpipe serve: {opts.model_name or Path(args.model_dir).name} on {', '.join(binds)} "
              f"(queue {opts.max_queue}; Ctrl-C stops)", file=sys.stderr, flush=True)

    signum = run_server(args.model_dir, cfg, opts, on_ready=ready)
    if signum is not None:  # a server's normal end: exit 0, whichever signal and however many
        print(f"qnpipe serve: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    return 0


EPILOG = """\
examples:
  qnpipe serve ./qn80b-4bit                                  http://127.0.0.1:8080/v1
  qnpipe serve ./qn80b-4bit --port 9000 --max-queue 4
  qnpipe serve ./qn80b-4bit --memory 8GB                     plan the pool for 8 GiB (docs/plan.md)
  qnpipe serve ./qn80b-4bit --host 0.0.0.0 --api-key-file ~/.qnpipe-key
  curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Ctrl-C (or SIGTERM) stops the server: new requests get 503, the one generating has a few seconds
to finish, then the command exits 0 with one line saying so.
Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). Every field supported, and what is not: docs/server.md.
"""


def register(sub: Any, fmt: Any) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API", formatter_class=fmt,
                       description="Serve MODEL_DIR over HTTP with the OpenAI chat and completions API (streaming,\n"
                       "tool calls). One engine runs one request at a time; the others wait in a bounded\n"
                       "queue, and past it get 429. Binds loopback unless --host says otherwise, which\n"
                       "then needs an API key.",
                       epilog=EPILOG)
    positional_or_flag(p, "model_dir", "MODEL_DIR", "--model",
                       "model directory (original HF, mlx-lm, or qnpipe convert layout)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs --api-key)")
    g.add_argument("--port", type=int_arg(_port), default=8080, help="port (default 8080; 0 picks a free one)")
    g.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` (visible in ps: prefer --api-key-file)")
    g.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE")
    g.add_argument("--max-queue", type=int_arg(_non_negative), default=8, metavar="N",
                   help="requests that may wait for the engine (default 8); past it 429 with Retry-After")
    g.add_argument("--max-tokens-cap", type=int_arg(_positive), default=4096, metavar="N",
                   help="the most max_tokens a request may ask for (default 4096)")
    g.add_argument("--default-max-tokens", "--max-tokens", "-m", type=int_arg(_positive), default=512, metavar="N",
                   help="max_tokens of a request that gives none (default 512; mlx_lm.server's --max-tokens)")
    g.add_argument("--max-body-bytes", type=int_arg(_positive), default=4 * 2**20, metavar="N",
                   help="the largest request body accepted (default 4 MiB); larger gets 413")
    g.add_argument("--body-timeout", type=checked(_seconds), default=30.0, metavar="S",
                   help="a request body must arrive whole within S seconds (default 30); slower gets 408")
    g.add_argument("--model-name", metavar="NAME", help="the model id /v1/models shows (default: MODEL_DIR's name)")
    g.add_argument("--log-level", choices=LEVELS, default="info", type=str.lower,
                   help="info (default): one line per request on stderr (client, method, path, status, "
                   "prompt+completion tokens, seconds); warning: errors only")
    s = p.add_argument_group("sampling defaults", "for a request that leaves the field out (or sends null)")
    add_sampling_flags(s, temperature=1.0, what=" of a request that gives none")
    add_memory_flags(p)
    add_distributed_flag(p)
    add_config_flags(p)
    p.set_defaults(func=cmd_serve)
