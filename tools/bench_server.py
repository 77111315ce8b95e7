"""Server overhead: tokens per second through HTTP streaming against direct generate, same requests (issue 14).

`open_engine` on `--model` (default: the shipped tiny trained model) served by
`qnpipe.server.run.serve_engine` on a free loopback port, in a trio run on a thread of this
process. The rounds alternate, with the same request each time (a chat prompt, `--tokens`
new tokens past EOS, temperature 0, so the same tokens):

  direct  `AsyncEngine.generate` called from this process's main thread into the engine's
          loop, which is what `Engine.generate` does (the prompt rendered and encoded once,
          up front)
  http    the official openai client, streamed (`stream=True`), the same messages, run in a
          client process of its own (as an editor or agent is: its SSE and pydantic parsing
          do not share the server's interpreter); the server renders, encodes, queues and
          streams the answer as SSE chunks. `--client-in-process` runs it on a thread here.

tok/s of a run = completion tokens / the caller's wall time from the call to its end (the
last chunk read, for http), prefill included in both. `ratio_http_to_direct` = the median over
rounds of http tok/s / direct tok/s of the same round (the two runs of a round are adjacent in
time, in alternating order; target >= 0.95); `ratio_of_medians` is the ratio of the two
medians. Wall-time figures are noisy on a shared machine; `cpu_ms_per_token_*` (this
process's CPU time, all threads: the model and the server, per token; the client process's
own is `client_cpu_ms_per_token`) are less so, and their difference is what serving costs
(`ratio_cpu_direct_to_http`: direct's CPU per token over http's).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Write a function that parses a CSV file into dictionaries."}]


def stream_once(client: Any, tokens: int) -> dict[str, Any]:
    """One streamed chat request: wall and CPU seconds of this thread, tokens, text."""
    t0, own0 = time.perf_counter(), time.thread_time()
    pieces, n = [], 0
    for chunk in client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            n = chunk.usage.completion_tokens
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
    return {"secs": time.perf_counter() - t0, "client_cpu": time.thread_time() - own0, "n": n,
            "text": "".join(pieces)}


def client_main(url: str, tokens: int) -> int:
    """The client process: one request per line read on stdin, its figures as one JSON line."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    for _ in sys.stdin:
        print(json.dumps(stream_once(client, tokens)), flush=True)
    return 0


class ClientProcess:
    def __init__(self, url: str, tokens: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--client", url, "--tokens", str(tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"bench_server: the client process ended (exit code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny trained one)")
    p.add_argument("--tokens", type=int, default=256, help="new tokens per request (default 256)")
    p.add_argument("--rounds", type=int, default=10, help="direct/http pairs (default 10)")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="sets",
                   help="engine setting, e.g. --set pool.expert_slots=16 (repeatable)")
    p.add_argument("--client-in-process", action="store_true",
                   help="run the openai client on a thread of the server's process (it then competes for its GIL)")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the client process's own entry
    args = p.parse_args(argv)
    if args.client:
        return client_main(args.client, args.tokens)
    overrides = dict(item.split("=", 1) for item in args.sets)

    import trio

    from qnpipe.cli.common import DEMO_MODEL_DIR
    from tests.server.conftest import ServerThread

    model = args.model or DEMO_MODEL_DIR
    with ServerThread(model_dir=model, **overrides) as srv:
        eng = srv.engine
        ids = srv.call(eng.encode, eng.render_chat(MESSAGES))
        if args.client_in_process:
            client = srv.client(timeout=600)
            remote = None

            def request() -> dict[str, Any]:
                return stream_once(client, args.tokens)
        else:
            remote = ClientProcess(srv.url, args.tokens)
            request = remote.run

        def direct() -> tuple[float, float, int, str, float]:
            async def run() -> Any:
                return await eng.generate(ids, max_tokens=args.tokens, temperature=0.0, stop_at_eos=False)

            t0, c0 = time.perf_counter(), time.process_time()
            res = trio.from_thread.run(run, trio_token=srv.token)
            return time.perf_counter() - t0, time.process_time() - c0, res.stats.generated_tokens, res.text, 0.0

        def http() -> tuple[float, float, int, str, float]:
            c0 = time.process_time()
            r = request()
            cpu_s = time.process_time() - c0
            if remote is None:
                cpu_s -= r["client_cpu"]  # the client ran on this process's main thread
            return r["secs"], cpu_s, r["n"], r["text"], r["client_cpu"]

        try:
            direct()  # warm-up: first-call compilation and caches
            http()
            rates: dict[str, list[float]] = {"direct": [], "http": []}
            cpu: dict[str, list[float]] = {"direct": [], "http": []}
            client_cpu: list[float] = []
            texts = set()
            for r in range(args.rounds):
                pair = (("direct", direct), ("http", http))
                for name, fn in pair if r % 2 == 0 else pair[::-1]:  # alternate who goes first
                    secs, cpu_s, n, text, own = fn()
                    rates[name].append(n / secs)
                    cpu[name].append(cpu_s / n)
                    if name == "http":
                        client_cpu.append(own / n)
                    texts.add(text)
        finally:
            if remote is not None:
                remote.close()
    d, h = statistics.median(rates["direct"]), statistics.median(rates["http"])
    # Each round's two runs are adjacent in time: their ratio cancels the load drifting between rounds.
    ratio = statistics.median(b / a for a, b in zip(rates["direct"], rates["http"], strict=True))
    print(json.dumps({"model": str(model), "tokens": args.tokens, "rounds": args.rounds,
                      "client": "thread" if args.client_in_process else "process",
                      "tok_s_direct": round(d, 2), "tok_s_http": round(h, 2),
                      "ratio_http_to_direct": round(ratio, 4), "ratio_of_medians": round(h / d, 4),
                      "same_text": len(texts) == 1,
                      "cpu_ms_per_token_direct": round(1e3 * statistics.median(cpu["direct"]), 3),
                      "cpu_ms_per_token_http": round(1e3 * statistics.median(cpu["http"]), 3),
                      "client_cpu_ms_per_token": round(1e3 * statistics.median(client_cpu), 3),
                      "ratio_cpu_direct_to_http": round(statistics.median(cpu["direct"]) / statistics.median(cpu["http"]), 4),
                      "tok_s_direct_all": [round(x, 2) for x in rates["direct"]],
                      "tok_s_http_all": [round(x, 2) for x in rates["http"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
