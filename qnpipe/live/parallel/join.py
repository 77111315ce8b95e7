"""Joining the ring at start-up: this rank's layers, a check that every rank runs the same
model and version, and the settings that must differ per rank."""

from __future__ import annotations

import hashlib
from pathlib import Path

from qnpipe.config import Config, ConfigError, with_overrides
from qnpipe.live.mlx_thread import MLXThread, run_on
from qnpipe.live.parallel.ring import Ring
from qnpipe.live.parallel.split import model_layer_bytes, split_layers
from qnpipe.model.stage import Stage


async def join(cfg: Config, thread: MLXThread) -> tuple[Ring, Stage, Config]:
    """(the ring, this rank's stage, its config). DistributedError naming a rank that differs or is lost."""
    from qnpipe import __version__
    from qnpipe.model.args import args_from_dict, model_id, read_config

    mtp = cfg.mtp.enabled
    if mtp:
        check_mtp(cfg)
    distributed_cfg = cfg.distributed
    ring = await run_on(thread, Ring.connect, distributed_cfg.connect_timeout_s, distributed_cfg.step_timeout_s)
    model_dir = Path(cfg.model.model_dir)
    config = read_config(model_dir)
    args = args_from_dict(config, str(model_dir / "config.json"))
    per, embed, head = model_layer_bytes(model_dir, args.num_hidden_layers,
                                         Path(cfg.model.expert_dir) if cfg.model.expert_dir else None)
    if mtp:  # the last rank also holds the MTP head and, to embed the tokens it reads, the embedding
        mtp_file = Path(cfg.model.mtp_weights_path) if cfg.model.mtp_weights_path else model_dir / "mtp.safetensors"
        head += embed + (mtp_file.stat().st_size if mtp_file.is_file() else 0)
    split = split_layers(per, ring.size, first_extra=embed, last_extra=head)
    # The same shape is not enough: config.json's bytes tell another checkpoint of it apart.
    key = model_id(args) + hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    mtp_key = f"{mtp} {cfg.mtp.num_draft_tokens if mtp else 0}"
    await run_on(thread, ring.check_same_run, key, __version__, split, mtp_key)
    ring.fit(args.hidden_size, cfg.mtp.num_draft_tokens + 1 if mtp else 1)
    stage = Stage(ring.rank, ring.size, *split[ring.rank], mtp=mtp)
    return ring, stage, rank_config(cfg, stage)


# MTP variants a ring does not run yet: (setting, is it on).
_MTP_REFUSED = (
    ("mtp.verify_mode", lambda c: c.mtp.verify_mode.value != "batch"),
    ("mtp.adaptive_depth", lambda c: c.mtp.adaptive_depth),
    ("mtp.tree_verify", lambda c: c.mtp.tree_verify),
    ("mtp.tree_top2", lambda c: c.mtp.tree_top2),
    ("diag.accept_topk", lambda c: c.diag.accept_topk > 0),
)


def check_mtp(cfg: Config) -> None:
    """ConfigError naming an MTP setting that does not run distributed (docs/distributed.md): the ring
    runs batch verify of a fixed depth, greedy, with per-token rollback."""
    for name, on in _MTP_REFUSED:
        if on(cfg):
            raise ConfigError(f"{name}: with mtp.enabled and distributed.enabled only batch verify of a fixed "
                              f"depth runs (mtp.verify_mode=batch, no adaptive depth, tree verify or top-k diagnostics)")


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
