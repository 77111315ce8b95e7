"""Server overhead: tokens per second through HTTP streaming against direct generate, same requests (issue 14).

One process, one engine: `open_engine` on `--model` (default: the shipped tiny trained
model) served by `qnpipe.server.run.serve_engine` on a free loopback port, in a trio run
on a thread of its own. The rounds alternate, with the same request each time (a chat
prompt, `--tokens` new tokens past EOS, temperature 0, so the same tokens):

  direct  `AsyncEngine.generate` called from this thread into the engine's loop, which is
          what `Engine.generate` does (the prompt rendered and encoded once, up front)
  http    the official openai client, streamed (`stream=True`), the same messages; the
          server renders, encodes, queues and streams them as SSE chunks

tok/s of a run = completion tokens / the caller's wall time from the call to its end (the
last chunk read, for http), prefill included in both. Figures are medians over `--rounds`;
`ratio_http_to_direct` = the median over rounds of http tok/s / direct tok/s of the same round
(the two runs of a round are adjacent in time, which order alternating; target >= 0.95);
`ratio_of_medians` is the ratio of the two medians. On a shared machine the wall-time figures
are noisy; `cpu_ms_per_token_*` (this process's CPU time, every thread: the model, the
server, the client, per token) are less so, and their difference is what serving costs;
`cpu_ms_per_token_http_without_client` leaves out the CPU time of the thread the openai
client runs on (its SSE and pydantic parsing), which a client in another process would spend
there.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qnpipe.cli.common import DEMO_MODEL_DIR  # noqa: E402
from tests.server.conftest import ServerThread  # noqa: E402

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that parses a CSV file into dictionaries."}]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEMO_MODEL_DIR, help="model directory (default: the tiny trained one)")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per request (default 256)")
    p.add_argument("--rounds", type=int, default=10, help="direct/http pairs (default 10)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help="engine setting, e.g. --set pool.expert_slots=16 (repeatable)")
    args = p.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.sets)

    import trio

    with ServerThread(model_dir=args.model, **overrides) as srv:
        client = srv.client(timeout=600)
        eng = srv.engine
        ids = srv.call(eng.encode, eng.render_chat(MESSAGES))

        def direct() -> tuple[float, float, int, str]:
            async def run() -> Any:
                return await eng.generate(ids, max_tokens=args.tokens, temperature=0.0, stop_at_eos=False)

            t0, c0 = time.perf_counter(), time.process_time()
            res = trio.from_thread.run(run, trio_token=srv.token)
            return time.perf_counter() - t0, time.process_time() - c0, res.stats.generated_tokens, res.text

        def http() -> tuple[float, float, int, str]:
            t0, c0, own0 = time.perf_counter(), time.process_time(), time.thread_time()
            pieces, n = [], 0
            for chunk in client.chat.completions.create(
                    model="m", messages=MESSAGES, max_tokens=args.tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
            client_cpu.append(time.thread_time() - own0)  # the openai client runs on this thread
            return time.perf_counter() - t0, time.process_time() - c0, n, "".join(pieces)

        client_cpu: list[float] = []
        direct()  # warm-up: first-call compilation and caches
        http()
        client_cpu.clear()
        rates: dict[str, list[float]] = {"direct": [], "http": []}
        cpu: dict[str, list[float]] = {"direct": [], "http": []}
        texts = set()
        for r in range(args.rounds):
            pair = (("direct", direct), ("http", http))
            for name, fn in pair if r % 2 == 0 else pair[::-1]:  # alternate who goes first
                secs, cpu_s, n, text = fn()
                rates[name].append(n / secs)
                cpu[name].append(cpu_s / n)
                texts.add(text)
    d, h = statistics.median(rates["direct"]), statistics.median(rates["http"])
    # Each round's two runs are adjacent in time: their ratio cancels the load drifting between rounds.
    ratio = statistics.median(b / a for a, b in zip(rates["direct"], rates["http"], strict=True))
    print(json.dumps({"model": str(args.model), "tokens": args.tokens, "rounds": args.rounds,
                      "tok_s_direct": round(d, 2), "tok_s_http": round(h, 2),
                      "ratio_http_to_direct": round(ratio, 4), "ratio_of_medians": round(h / d, 4),
                      "same_text": len(texts) == 1,
                      "cpu_ms_per_token_direct": round(1e3 * statistics.median(cpu["direct"]), 3),
                      "cpu_ms_per_token_http": round(1e3 * statistics.median(cpu["http"]), 3),
                      "cpu_ms_per_token_http_without_client": round(1e3 * statistics.median(
                          c - k / args.tokens for c, k in zip(cpu["http"], client_cpu, strict=True)), 3),
                      "tok_s_direct_all": [round(x, 2) for x in rates["direct"]],
                      "tok_s_http_all": [round(x, 2) for x in rates["http"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
