"""One rank of a test ring: `python rank_main.py MODEL_DIR OUT.npz SCENARIO.json` (MLX_RANK, MLX_HOSTFILE set).

Rank 0 runs each engine setting of the scenario through `open_engine(distributed=True)` and saves
what it produced; the other ranks serve it. An engine with `mtp.enabled` runs on its own model
(`"models"`) and prompt (`"mtp_prompt"`): a generation cancelled part way, then greedy tokens, the
rounds' acceptance histogram, and speculative sampling's tokens at a seed. `"loop": true` (the last engine only) then keeps rank 0
generating until the ring fails (the killed-rank test), printing `generating` once it has begun; with `"idle_s"`
it first sends nothing for that long, then generates once.

An engine named in `"prefix"` runs `"prefix_prompts"` (two prompts sharing a head, then a turn's new
tokens) through prefix snapshots (`run_prefix`); one named `"lossy"` does so with rank `"lossy_rank"`
keeping no state (its captures dropped): rank 0's resume must fail naming that rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import trio

from qnpipe import open_engine  # before anything imports MLX: it puts compute.cpu_blas in front of MLX's
from qnpipe.errors import DistributedError
from qnpipe.live.parallel.snap import RankStates


async def main(model_dir: str, out: str, scenario: dict) -> int:
    saved: dict[str, Any] = {}
    for name, overrides in scenario["engines"].items():
        keep = RankStates.capture
        if name == scenario.get("lossy") and int(os.environ["MLX_RANK"]) == scenario["lossy_rank"]:
            RankStates.capture = lambda *_: None  # type: ignore[method-assign]
        try:
            async with open_engine(scenario.get("models", {}).get(name, model_dir), distributed=True, warm_up=True,
                                   **overrides) as eng:
                if not eng.rank:
                    await _run(eng, name, overrides, scenario, saved, out)
        finally:
            RankStates.capture = keep  # type: ignore[method-assign]
    if saved:
        np.savez(out, **saved)
    return 0


async def _run(eng: Any, name: str, overrides: dict[str, Any], scenario: dict, saved: dict[str, Any],
               out: str) -> None:
    prompt = scenario["prompt"]
    if name in scenario.get("prefix", ()):
        await run_prefix(eng, name, scenario["prefix_prompts"], saved)
    elif name == scenario.get("lossy"):
        await _lossy(eng, name, scenario["prefix_prompts"], saved)
    elif overrides.get("mtp.enabled"):
        prompt = scenario["mtp_prompt"]
        saved[f"{name}.cancelled_after"] = np.array(await _cancelled(eng, prompt, scenario["mtp_tokens"]))
        res = await eng.generate(prompt, max_tokens=scenario["mtp_tokens"], stop_at_eos=False)
        assert res.stats.mtp is not None
        saved[f"{name}.greedy"] = np.array(res.tokens)
        saved[f"{name}.accept_hist"] = np.array(res.stats.mtp.accept_hist)
        saved[f"{name}.drafted_at"] = np.array(res.stats.mtp.drafted_at)
        res = await eng.generate(prompt, max_tokens=scenario["sampled_tokens"], temperature=0.8, seed=3,
                                 stop_at_eos=False)
        saved[f"{name}.sampled"] = np.array(res.tokens)
    else:
        await _plain(eng, name, prompt, scenario["tokens"], saved)
    if eng.plan is not None:  # `memory`: rank 0's own plan (qnpipe.plan.ranks)
        saved[f"{name}.plan_layers"] = np.array(sorted(eng.plan.capacities))
    if scenario.get("loop") and name == list(scenario["engines"])[-1]:
        np.savez(out, **saved)
        if scenario.get("idle_s"):  # no request for that long (the other ranks wait), then one more
            await trio.sleep(scenario["idle_s"])
            await eng.generate(prompt, max_tokens=2, stop_at_eos=False)
        print("generating", flush=True)
        while True:
            await eng.generate(prompt, max_tokens=64, stop_at_eos=False)


async def run_prefix(eng: Any, name: str, prompts: list[list[int]], saved: dict[str, Any]) -> None:
    """Next-token logits of both prompts, greedy tokens of the second, then a conversation's two turns;
    the prompt tokens each generation resumed and rank 0's prefix counters."""
    first, second, new = prompts
    saved[f"{name}.next0"] = await eng.next_logits(first)
    saved[f"{name}.next1"] = await eng.next_logits(second)
    res = await eng.generate(second, max_tokens=6, stop_at_eos=False)
    saved[f"{name}.greedy1"] = np.array(res.tokens)
    turn1 = await eng.generate(first, max_tokens=6, stop_at_eos=False)
    turn2 = await eng.generate([*first, *turn1.tokens, *new], max_tokens=6, stop_at_eos=False)
    saved[f"{name}.turns"] = np.array([*turn1.tokens, *turn2.tokens])
    saved[f"{name}.reused"] = np.array([r.stats.prefix_tokens_reused for r in (res, turn1, turn2)])
    if turn2.stats.mtp is not None:  # the drafts of a resumed turn: its MTP layer's state
        saved[f"{name}.accept_hist"] = np.array(turn2.stats.mtp.accept_hist)
    st = eng.stats().prefix
    saved[f"{name}.stats"] = np.array([0] * 5 if st is None else
                                      [st.hits, st.misses, st.captures, st.disk_loads, st.disk_writes])
    if turn2.stats.mtp is not None:  # speculative sampling from a resumed state: the last rank's sampler too
        res = await eng.generate([*first, *turn1.tokens, *new], max_tokens=8, temperature=0.8, seed=3,
                                 stop_at_eos=False)
        saved[f"{name}.sampled"] = np.array([res.stats.prefix_tokens_reused, *res.tokens])


async def _lossy(eng: Any, name: str, prompts: list[list[int]], saved: dict[str, Any]) -> None:
    """The second prompt resumes from a head only rank 0 kept: the error, then the same prompt again."""
    first, second, _ = prompts
    await eng.next_logits(first)
    try:
        await eng.next_logits(second)
    except DistributedError as e:
        saved[f"{name}.refused"] = np.array(str(e))
    saved[f"{name}.next1"] = await eng.next_logits(second)


async def _cancelled(eng: Any, prompt: Any, tokens: int) -> int:
    """A generation cancelled (as Ctrl-C does) once it has 5 tokens: how many it had."""
    partial: list[int] = []
    with trio.CancelScope() as scope:
        def on_text(_: str) -> None:
            if len(partial) >= 5:
                scope.cancel()

        await eng.generate(prompt, max_tokens=tokens, stop_at_eos=False, on_text=on_text, partial=partial)
    return len(partial)


async def _plain(eng: Any, name: str, prompt: Any, tokens: int, saved: dict[str, Any]) -> None:
    saved[f"{name}.logits"] = await eng.logits(prompt)
    saved[f"{name}.next"] = await eng.next_logits(prompt)
    greedy = await eng.generate(prompt, max_tokens=tokens, stop_at_eos=False)
    saved[f"{name}.greedy"] = np.array(greedy.tokens)
    sampled = await eng.generate(prompt, max_tokens=tokens, temperature=0.8, seed=3, stop_at_eos=False)
    saved[f"{name}.sampled"] = np.array(sampled.tokens)


if __name__ == "__main__":
    try:
        sys.exit(trio.run(main, sys.argv[1], sys.argv[2], json.loads(open(sys.argv[3]).read())))
    except* DistributedError as group:
        from qnpipe.errors import root_cause  # nested nursery groups: the error itself, as the CLI prints it

        print(f"DistributedError: {root_cause(group)}", file=sys.stderr, flush=True)
        sys.exit(3)
