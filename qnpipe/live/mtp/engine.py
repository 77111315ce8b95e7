"""The engine's entry to speculation: `cfg.mtp` made into SpecOptions, one generate call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qnpipe.actors.forward import Forward
from qnpipe.config import Config
from qnpipe.live.mlx_thread import MLXThread
from qnpipe.live.mtp import loop, tree
from qnpipe.live.prefix import PrefixCache
from qnpipe.messages import Msg
from qnpipe.stats import GenerateResult


def options(cfg: Config, emit: Callable[[Msg], None] | None = None, *, temperature: float = 0.0,
            top_p: float = 1.0, seed: int | None = None, mtp_streamed: bool = False, top_k: int = 0,
            min_p: float = 0.0) -> loop.SpecOptions:
    return loop.SpecOptions(k=cfg.mtp.num_draft_tokens, verify_mode=cfg.mtp.verify_mode, hidden=cfg.mtp.hidden,
                            adaptive_depth=cfg.mtp.adaptive_depth, conf_tau=cfg.mtp.conf_tau,
                            depth_max=cfg.mtp.depth_max, accept_topk=cfg.diag.accept_topk, emit=emit,
                            temperature=temperature, top_p=top_p, seed=seed, mtp_streamed=mtp_streamed,
                            top_k=top_k, min_p=min_p,
                            branches=tree.branches(cfg.mtp.tree_verify, cfg.mtp.tree_branches, cfg.mtp.tree_top2,
                                                   cfg.mtp.tree_top2_p1, cfg.mtp.adaptive_rescue))


async def speculate(fwd: Forward, emit: Callable[[Msg], None] | None, thread: MLXThread, core: Any,
                    ids: list[int], kw: dict[str, Any],
                    on_text: Callable[[str], None] | None, on_prefill: Callable[[int, int], None] | None,
                    partial: list[int] | None, prefix: PrefixCache | None = None) -> GenerateResult:
    """A `generate` of the engine `core` with its MTP head (`core.mtp`): greedy, or speculative sampling.

    Rank 0 of a ring (`core.mtp_ring`): the last rank holds the head (qnpipe.live.parallel.speculate)."""
    runner = core.runner
    if core.mtp_ring:
        from qnpipe.live.parallel import speculate as ring

        return await ring.generate(fwd, thread, runner.loaded.model, runner.tokenizer, ids, max_tokens=kw["max_tokens"],
                                   eos=runner.eos_ids if kw["stop_at_eos"] else set(),
                                   chunk=core.cfg.forward.prefill_chunk_tokens, depth=core.cfg.mtp.num_draft_tokens,
                                   max_depth=options(core.cfg).max_depth, temperature=kw["temperature"],
                                   top_p=kw["top_p"], seed=kw["seed"], emit=emit, on_text=on_text,
                                   on_prefill=on_prefill, partial=partial, prefix=prefix)
    return await loop.generate(fwd, thread, runner.loaded.model, core.mtp, runner.tokenizer, ids,
                               max_tokens=kw["max_tokens"], eos=runner.eos_ids if kw["stop_at_eos"] else set(),
                               chunk=core.cfg.forward.prefill_chunk_tokens, opts=options(core.cfg, emit, temperature=kw["temperature"],
                                                                    top_p=kw["top_p"], seed=kw["seed"],
                                                                    mtp_streamed=core.streaming is not None,
                                                                    top_k=kw["top_k"], min_p=kw["min_p"]),
                               on_text=on_text, on_prefill=on_prefill, partial=partial, prefix=prefix)
