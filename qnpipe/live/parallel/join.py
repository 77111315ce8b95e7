"""Joining the ring at start-up: this rank's layers, a check that every rank runs the same
model and version, and the settings that must differ per rank.

The layers are split by parameter bytes, or with `--memory` (`plan.memory`) by the memory account
(qnpipe.plan.ranks: each rank's fixed bytes balanced); then every rank's budget is checked against its
share and each rank plans its own layers (qnpipe.plan.startup.plan_for_share), all before loading."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import trio

from qnpipe.config import Config, ConfigError, with_overrides
from qnpipe.config.launch import Launch
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.parallel.ring import Ring
from qnpipe.model.stage import Stage
from qnpipe.plan.account import ModelFacts, model_facts
from qnpipe.plan.layer_split import model_layer_bytes, split_layers
from qnpipe.plan.plan_file import Plan
from qnpipe.plan.ranks import Share, Weights, check_ranks, layer_weights, memory_split
from qnpipe.plan.startup import plan_for_share
from qnpipe.plan.units import parse_memory


async def join(cfg: Config, thread: MLXThread, launch: Launch, say: Callable[[str], None] | None = None
               ) -> tuple[Ring, Stage, Config, Plan | None]:
    """(the ring, this rank's stage, its config, its `--memory` plan or None). DistributedError naming a
    rank that differs or is lost; with `plan.memory`, ConfigError naming a rank whose budget cannot hold
    its share, before anything loads. `say` (default: stderr) gets this rank's plan line."""
    from qnpipe.model.args import args_from_dict, read_config

    mtp = cfg.mtp.enabled
    if mtp:
        check_mtp(cfg)
    distributed_cfg = cfg.distributed
    ring = await run_on(thread, Ring.connect, launch, distributed_cfg.connect_timeout_s,
                        distributed_cfg.step_timeout_s)
    model_dir = Path(cfg.model.model_dir)
    expert_dir = Path(cfg.model.expert_dir) if cfg.model.expert_dir else None
    mtp_file = Path(cfg.model.mtp_weights_path) if cfg.model.mtp_weights_path else model_dir / "mtp.safetensors"
    config = read_config(model_dir)
    args = args_from_dict(config, str(model_dir / "config.json"))
    by_memory = None
    if cfg.plan.memory:  # split by the memory account: each rank's fixed bytes balanced (qnpipe.plan.ranks)
        by_memory = MemorySplit.of(cfg, ring.size)
        split = [(s.lo, s.hi) for s in by_memory.shares]
    else:
        per, embed, head = model_layer_bytes(model_dir, args.num_hidden_layers, expert_dir)
        if mtp:  # the last rank also holds the MTP head and, to embed the tokens it reads, the embedding
            head += embed + (mtp_file.stat().st_size if mtp_file.is_file() else 0)
        split = split_layers(per, ring.size, first_extra=embed, last_extra=head)
    await run_on(thread, ring.check_same_run, await same_run_parts(cfg, split, expert_dir, mtp_file if mtp else None))
    run_id = await run_on(thread, ring.run_id)
    # Each rank's budget is its own: every rank checks every rank's, so all stop with the same message.
    budgets = await run_on(thread, ring.gather_budgets, parse_memory(cfg.plan.memory) if cfg.plan.memory else 0)
    plan = None
    if by_memory is not None:
        by_memory.check(cfg, budgets)
        cfg, plan = await trio.to_thread.run_sync(partial(
            plan_for_share, cfg, by_memory.facts, by_memory.shares[ring.rank],
            say=say or (lambda s: print(f"qnpipe: {s}", file=sys.stderr, flush=True))))
    m = cfg.mtp
    ring.fit(args.hidden_size, (m.depth_max if m.adaptive_depth else m.num_draft_tokens) + 1 if mtp else 1)
    stage = Stage(ring.rank, ring.size, *split[ring.rank], mtp=mtp, run_id=run_id)
    return ring, stage, rank_config(cfg, stage), plan


async def same_run_parts(cfg: Config, split: list[tuple[int, int]], expert_dir: Path | None,
                         mtp_file: Path | None) -> list[tuple[str, str]]:
    """What every rank must have the same of (`Ring.check_same_run`): the model's files, named by their
    contents (qnpipe.model.identity: the same config.json is not the same model), the layer split, the
    MTP settings (they size the frames) and the step timeout (rank 0's keep-alive follows its own)."""
    from qnpipe.model.identity import model_identity

    identity = await trio.to_thread.run_sync(model_identity, Path(cfg.model.model_dir), expert_dir, mtp_file)
    m = cfg.mtp
    return [*identity.parts(), ("layer split", json.dumps(split)),
            ("MTP setting (mtp.enabled, num_draft_tokens, adaptive_depth, conf_tau, depth_max)",
             f"{m.enabled} {m.num_draft_tokens} {m.adaptive_depth} {m.conf_tau} {m.depth_max}" if m.enabled else "off"),
            ("distributed.step_timeout_s", repr(cfg.distributed.step_timeout_s))]


@attrs.frozen
class MemorySplit:
    """The split by the memory account (qnpipe.plan.ranks) and what it was made from."""

    facts: ModelFacts
    weights: Weights
    shares: list[Share]

    @classmethod
    def of(cls, cfg: Config, ranks: int) -> MemorySplit:
        facts = model_facts(Path(cfg.model.model_dir), cfg)
        weights = layer_weights(facts, cfg)
        return cls(facts, weights, memory_split(facts, cfg, weights, ranks, context=cfg.plan.context_tokens))

    def check(self, cfg: Config, budgets: list[int]) -> None:
        check_ranks(self.facts, cfg, self.weights, self.shares, budgets, context=cfg.plan.context_tokens)


# MTP variants a ring does not run yet: (setting, is it on).
_MTP_REFUSED = (
    ("mtp.verify_mode", lambda c: c.mtp.verify_mode.value != "batch"),
    ("mtp.adaptive_rescue", lambda c: c.mtp.adaptive_rescue),
    ("mtp.tree_verify", lambda c: c.mtp.tree_verify),
    ("mtp.tree_top2", lambda c: c.mtp.tree_top2),
    ("diag.accept_topk", lambda c: c.diag.accept_topk > 0),
)


def check_mtp(cfg: Config) -> None:
    """ConfigError naming an MTP setting that does not run distributed (docs/distributed.md): the ring
    runs batch verify of one draft path (fixed or adaptive depth, greedy or sampled) with per-token rollback."""
    for name, on in _MTP_REFUSED:
        if on(cfg):
            raise ConfigError(f"{name}: with mtp.enabled and distributed.enabled only batch verify of one draft "
                              f"path runs (mtp.verify_mode=batch, fixed or adaptive depth; no tree verify, rescue "
                              f"or top-k diagnostics)")


def rank_config(cfg: Config, stage: Stage) -> Config:
    """`cfg` for `stage`'s rank: files it writes get the rank in their name (ranks may share a disk),
    the autopin heat file its layers (a run split otherwise reads the heat of its own layers)."""
    over: dict[str, object] = {}
    if cfg.pool.autopin:
        over["pool.autopin_usage_file"] = _named(cfg.autopin_usage_path(), f"layers{stage.lo}-{stage.hi - 1}")
    if cfg.trace.event_log_path:
        over["trace.event_log_path"] = _named(cfg.trace.event_log_path, f"rank{stage.rank}")
    if cfg.trace.route_trace:
        over["trace.route_trace_path"] = _named(cfg.trace.route_trace_path, f"rank{stage.rank}")
    return with_overrides(cfg, over)


def _named(path: str, tag: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{tag}{p.suffix}"))
