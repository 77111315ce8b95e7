"""MTP self-speculative decoding against plain greedy decoding, interleaved, on the trained tiny model.

Opens one engine per run, all at once, and runs them round by round (`--rounds`), each round
every engine once on the same prompt (greedy, `--tokens` new tokens, EOS ignored), so load on
a shared machine hits every run alike; every figure is a median over the rounds.

Runs, all-resident (the shipped HF float32 model) and streamed (the same model converted to
a qnpipe directory under `--work`, float32, a pool of top-k + 2 slots per MoE layer,
cross-layer prediction on):

  plain              plain greedy decoding
  k1 … k4            MTP with K fixed drafts per round (`mtp.num_draft_tokens`)
  adaptive           adaptive depth (`mtp.adaptive_depth`, conf_tau 0.3, depth_max 4)
  step               K = 3 verified one token per forward (`mtp.verify_mode=sequential`)
  top2, top2_p1      K = 3 plus the drafter's second choice at the first (and second) position
  tree3              K = 3, three paths (the first position's top 3) verified as one batch
  rescue             adaptive depth plus the top-2 path at the first position

and, all-resident through the speculation loop directly, the two rollbacks of the Gated
DeltaNet state at K = 3: per-token states kept during verify (`states`, what the engine
uses) against a re-forward of the accepted tokens from a snapshot (`rerun`).

The limit: `verify_cost` {n: the time of one verify forward of n positions (the main model
and its LM head on every row, Gated DeltaNet states kept, rolled back) over the time of a
plain decode token}, measured interleaved with plain decoding in the same loop. A round
of K drafts that commits L tokens on average can then be at most L / verify_cost[K+1]
times faster than plain decoding even if drafting cost nothing: `speedup_bound` {kK: that
bound at kK's measured accept length}, `speedup_bound_max`, and `ratio_best_to_bound`
(speedup_best over speedup_bound_max). On a CPU whose matmul time grows with its rows (the
netlib BLAS of mlx[cpu]) the bound is far below a GPU's, where K+1 rows cost about one.

Prints one JSON line: `tok_s_plain`, `tok_s_mtp_best`, `speedup_best`, `best_variant`,
`mean_accept_len` (of the best variant), `identical` (every run's tokens equal plain
greedy's, every round), the same keys with `_streamed`, `tok_s` / `speedup` /
`accept_len` per variant (`..._streamed` too), and `rollback_tok_s` {states, rerun}.
tok/s is `GenerateStats.decode_tok_s` (tokens after the first / time after the first).

The BLAS is chosen once per process (compute.cpu_blas), so the whole set runs twice, back to
back, in a child process each: the fast BLAS (auto: OpenBLAS behind qnpipe's batch-invariant
kernel) gives the keys above, MLX's bundled reference BLAS `speedup_best_bundled`,
`tok_s_plain_bundled`, `identical_bundled`, `identical_streamed_bundled`; `blas` and
`blas_bundled` name them (`--blas` runs one of them only).

  python tools/bench_mtp.py --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import qnpipe  # noqa: E402

MODEL = ROOT / "qnpipe" / "data" / "tiny_trained"
PROMPT = '''import os


def read_lines(path):
    """Return the lines of the file at path."""
    with open(path) as f:
'''
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    **{f"k{k}": {"mtp.enabled": True, "mtp.num_draft_tokens": k} for k in (1, 2, 3, 4)},
    "adaptive": {"mtp.enabled": True, "mtp.adaptive_depth": True, "mtp.conf_tau": 0.3, "mtp.depth_max": 4},
    "step": {"mtp.enabled": True, "mtp.num_draft_tokens": 3, "mtp.verify_mode": "sequential"},
    "top2": {"mtp.enabled": True, "mtp.num_draft_tokens": 3, "mtp.tree_top2": True},
    "top2_p1": {"mtp.enabled": True, "mtp.num_draft_tokens": 3, "mtp.tree_top2": True, "mtp.tree_top2_p1": True},
    "tree3": {"mtp.enabled": True, "mtp.num_draft_tokens": 3, "mtp.tree_verify": True, "mtp.tree_branches": 3},
    "rescue": {"mtp.enabled": True, "mtp.adaptive_depth": True, "mtp.adaptive_rescue": True, "mtp.depth_max": 4},
}


def log(msg: str) -> None:
    print(f"[bench_mtp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _streamed_dir(work: Path) -> Path:
    out = work / "tiny-trained-qn32"
    if not (out / "config.json").is_file():
        from qnpipe.convert import convert

        log(f"converting {MODEL} to {out} (float32) for the streamed runs")
        convert(MODEL, out, dtype="float32", mtp_bits=0)
    return out


def _summary(times: dict[str, list[float]], accept: dict[str, list[float]], suffix: str) -> dict[str, Any]:
    tok_s = {v: statistics.median(t) for v, t in times.items()}
    plain = tok_s.pop("plain")
    best = max(tok_s, key=lambda v: tok_s[v])
    return {f"tok_s_plain{suffix}": round(plain, 2), f"tok_s_mtp_best{suffix}": round(tok_s[best], 2),
            f"speedup_best{suffix}": round(tok_s[best] / plain, 3), f"best_variant{suffix}": best,
            f"mean_accept_len{suffix}": round(statistics.median(accept[best]), 3),
            f"tok_s{suffix}": {v: round(s, 2) for v, s in tok_s.items()},
            f"speedup{suffix}": {v: round(s / plain, 3) for v, s in tok_s.items()},
            f"accept_len{suffix}": {v: round(statistics.median(a), 3) for v, a in accept.items()}}


def _run_set(model_dir: Path, base: dict[str, Any], rounds: int, tokens: int,
             label: str) -> tuple[dict[str, Any], bool]:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    accept: dict[str, list[float]] = {v: [] for v in VARIANTS if v != "plain"}
    identical = True
    with contextlib.ExitStack() as stack:
        engines = {}
        for v, over in VARIANTS.items():
            settings: dict[str, Any] = {**base, **over, "mtp.hidden": "post_norm"}
            engines[v] = stack.enter_context(qnpipe.Engine(model_dir, **settings))
        for e in engines.values():  # warm-up: compile, fill the pools
            e.generate(PROMPT, max_tokens=8, stop_at_eos=False)
        log(f"{label}: {len(engines)} engines open and warm; {rounds} rounds of {tokens} tokens each")
        for r in range(rounds):
            ref = None
            for v, e in engines.items():
                res = e.generate(PROMPT, max_tokens=tokens, stop_at_eos=False)
                ref = res.tokens if ref is None else ref
                identical &= res.tokens == ref
                times[v].append(res.stats.decode_tok_s)
                if res.stats.mtp is not None:
                    accept[v].append(res.stats.mtp.mean_accept_len)
            plain = times["plain"][-1]
            best = max((v for v in times if v != "plain"), key=lambda v: times[v][-1])
            log(f"{label} round {r + 1}/{rounds}: plain {plain:.1f} tok/s, best {best} {times[best][-1]:.1f} "
                f"({times[best][-1] / plain:.2f}x), identical so far: {identical}")
    return {"times": times, "accept": accept}, identical


VERIFY_ROWS = (2, 3, 4, 5)


async def _verify_time(fwd: Any, th: Any, model: Any, head: Any, ids: list[int], n: int, steps: int) -> float:
    """Seconds per verify forward of `n` positions, each rolled back to its first token (as a
    round that accepts nothing), after a prefill of `ids`: the verify alone, no drafting."""
    import mlx.core as mx
    import trio

    from qnpipe.live.mlx_thread import run_on
    from qnpipe.live.mtp import loop

    st = await run_on(th, loop.SpecState, model, head, loop.SpecOptions(k=n - 1, hidden=loop.MtpHidden.POST_NORM))
    await loop.prefill(fwd, th, st, ids, 0)
    rows = ids[:n]
    times = []
    for _ in range(steps):
        t0 = trio.current_time()
        await run_on(th, st.begin_verify)
        await fwd.run(lambda: mx.array([rows], dtype=mx.uint32), st.caches.main, st.verify_tail)
        await run_on(th, st.rollback, n - 1, 0)
        times.append(trio.current_time() - t0)
    return statistics.median(times)


def _bounds(rb: dict[str, float], accept: dict[str, float], best: float) -> dict[str, Any]:
    """The free-drafter bound of each fixed K (module docstring) from the loop's own figures."""
    cost = {n: rb[f"verify{n}"] * rb["plain"] for n in VERIFY_ROWS}  # verify seconds x plain tokens per second
    bound = {f"k{n - 1}": round(accept[f"k{n - 1}"] / cost[n], 3) for n in VERIFY_ROWS if f"k{n - 1}" in accept}
    top = max(bound.values())
    return {"verify_cost": {str(n): round(c, 3) for n, c in cost.items()}, "speedup_bound": bound,
            "speedup_bound_max": top, "ratio_best_to_bound": round(best / top, 3)}


def _rollbacks(rounds: int, tokens: int) -> dict[str, float]:
    """tok/s of the loop at K = 3 with each rollback, and the verify forwards' times (seconds), interleaved
    (all resident)."""
    from qnpipe.actors.forward import Forward
    from qnpipe.live import decoding
    from qnpipe.live.loaded import ThreadedBackend
    from qnpipe.live.mlx_thread import MLXThread, run_on
    from qnpipe.live.mtp import loop
    from qnpipe.model.load import load_model
    from qnpipe.model.mtp import load_mtp
    from qnpipe.model.stepper import MlxBackend

    async def main() -> dict[str, float]:
        th = MLXThread.shared()
        lm = await run_on(th, load_model, MODEL)
        head = await run_on(th, load_mtp, lm.args, lm.mtp_weights, str(MODEL))
        assert head is not None
        fwd = Forward(ThreadedBackend(th, MlxBackend(lm.model, None)), None, None, {}, lm.args.num_experts)
        ids = list(range(20, 60))
        out: dict[str, list[float]] = {"states": [], "rerun": [], "plain": [], **{f"verify{n}": [] for n in VERIFY_ROWS}}
        await decoding.generate(fwd, th, lm.model, None, ids, max_tokens=8, temperature=0.0, top_p=1.0,
                                seed=None, eos=set(), chunk=2)  # warm-up, as the engines had
        for r in range(rounds):
            log(f"rollbacks and verify costs: round {r + 1}/{rounds}")
            p = await decoding.generate(fwd, th, lm.model, None, ids, max_tokens=tokens, temperature=0.0, top_p=1.0,
                                        seed=None, eos=set(), chunk=2)
            out["plain"].append(p.stats.decode_tok_s)
            for n in VERIFY_ROWS:
                out[f"verify{n}"].append(await _verify_time(fwd, th, lm.model, head, ids, n, tokens))
            for rb in ("states", "rerun"):
                opts = loop.SpecOptions(k=3, hidden=loop.MtpHidden.POST_NORM, rollback=rb)
                r = await loop.generate(fwd, th, lm.model, head, None, ids, max_tokens=tokens, eos=set(), chunk=2,
                                        opts=opts)
                assert r.tokens == p.tokens, rb
                out[rb].append(r.stats.decode_tok_s)
        return {k: statistics.median(v) for k, v in out.items()}

    # Hosted on the MLX thread's own loop, as a sync Engine runs: MLX calls inline, no hand-offs.
    return MLXThread.shared().host(main).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qnpipe-bench-mtp"))
    ap.add_argument("--blas", choices=("auto", "bundled"), help="run on this compute.cpu_blas only, in this process")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    if a.blas is None:
        out = _on("auto", a)
        bundled = _on("bundled", a)
        keys = ("speedup_best", "tok_s_plain", "tok_s_mtp_best", "best_variant", "identical", "identical_streamed",
                "speedup_best_streamed", "blas")
        print(json.dumps({**out, **{f"{k}_bundled": bundled[k] for k in keys}}))
        return
    print(json.dumps(_measure(a)))


def _on(blas: str, a: argparse.Namespace) -> dict[str, Any]:
    """This benchmark in a child process whose compute.cpu_blas is `blas` (its stderr passes through)."""
    log(f"running on compute.cpu_blas={blas}")
    cmd = [sys.executable, __file__, "--blas", blas, "--rounds", str(a.rounds), "--tokens", str(a.tokens),
           "--work", str(a.work)]
    p = subprocess.run(cmd, env={**os.environ, "QNPIPE_COMPUTE__CPU_BLAS": blas}, stdout=subprocess.PIPE, text=True,
                       check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _measure(a: argparse.Namespace) -> dict[str, Any]:
    from qnpipe import config
    from qnpipe.compute import blas

    info = blas.apply(config.load().compute)  # before MLX is imported
    resident, same_r = _run_set(MODEL, {}, a.rounds, a.tokens, "all resident")
    top_k = json.loads((MODEL / "config.json").read_text())["num_experts_per_tok"]
    streamed, same_s = _run_set(_streamed_dir(a.work), {"pool.expert_slots": top_k + 2,
                                                        "predict.cross_layer_prefetch": True}, a.rounds, a.tokens,
                                 "streamed")
    res = _summary(resident["times"], resident["accept"], "")
    rb = _rollbacks(a.rounds, a.tokens)
    out = {**res, "identical": same_r,
           **_summary(streamed["times"], streamed["accept"], "_streamed"), "identical_streamed": same_s,
           **_bounds(rb, res["accept_len"], res["speedup_best"]),
           "rollback_tok_s": {k: round(rb[k], 2) for k in ("states", "rerun", "plain")},
           "rounds": a.rounds, "tokens": a.tokens, "blas": info.describe()}
    return out


if __name__ == "__main__":
    main()
