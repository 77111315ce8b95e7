"""Each rank's share of the memory account in pipeline parallel (`--memory` with `--distributed`).

    weights = layer_weights(facts, cfg)
    shares = memory_split(facts, cfg, weights, ranks=2, context=8192)
    needs = check_ranks(facts, cfg, weights, shares, budgets, context=8192)   # ConfigError naming a rank
    lines = share_lines(facts, cfg, weights, shares[1], context=8192)

A rank holds what `qnpipe.model.stage.Stage.keeps` loads: its own decoder layers' non-expert tensors,
the embedding on rank 0, the final norm and LM head on the last rank (with tied embeddings or with
`mtp.enabled`, the embedding there too; with `mtp.enabled`, the MTP head's file), and every tensor
outside those on every rank. Its KV cache and recurrent state are its own layers' (one full-attention
layer's KV cache is the account's KV line over the full-attention layers: it is linear in their count;
so is the recurrent state in the linear-attention layers'). Every other line of the account (the MLX
buffer cache, the headroom, the process) is per process: each rank has it whole.

The split balances what each rank must hold whatever its pool: those bytes plus top-k slots of each of
its MoE layers. Contiguous ranges minimising the largest rank's fixed bytes
(qnpipe.plan.layer_split.split_layers) leave the fullest rank the most room a split can give it, so
one budget `--memory B` on every rank buys the largest pool on the rank with the least.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from qnpipe.config import Config
from qnpipe.errors import CheckpointError, ConfigError, TraceSchemaError
from qnpipe.messages import Candidates, ReadDone
from qnpipe.plan.account import Line, ModelFacts, fixed_lines, kv_nbytes, state_nbytes
from qnpipe.plan.layer_split import split_layers, tensor_bytes
from qnpipe.plan.units import fmt_bytes
from qnpipe.trace import Header, ModelShape, Record, Route, TraceWriter, read_all

if TYPE_CHECKING:
    from qnpipe.plan.family_account import FamilyFacts

# The account's lines that a rank holds only its own part of (qnpipe.plan.account.fixed_lines' names).
WEIGHTS, KV, STATE = "non-expert weights", "KV cache", "recurrent state"


class Share(msgspec.Struct, frozen=True, kw_only=True):
    """Rank `rank` of `ranks` runs decoder layers `lo..hi-1` (qnpipe.model.stage.Stage's range)."""

    rank: int
    ranks: int
    lo: int
    hi: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.ranks - 1

    def holds(self, layer: int) -> bool:
        return self.lo <= layer < self.hi

    @property
    def label(self) -> str:
        return f"rank {self.rank} (layers {self.lo}-{self.hi - 1})"


class Weights(msgspec.Struct, frozen=True, kw_only=True):
    """A model's non-expert tensors' bytes, by who holds them (module doc)."""

    layers: list[int]  # each decoder layer's
    embed: int
    head: int  # final norm and LM head
    shared: int  # every other tensor of the model's file: each rank loads it
    mtp: int  # the MTP head's file, with mtp.enabled (0 without)
    tied: bool
    mtp_enabled: bool
    source: str

    @property
    def total(self) -> int:
        return sum(self.layers) + self.embed + self.head + self.shared + self.mtp

    def of(self, share: Share) -> int:
        """The bytes `share`'s rank loads (qnpipe.model.stage.Stage.keeps)."""
        n = sum(self.layers[share.lo:share.hi]) + self.shared
        if share.first or (share.last and (self.tied or self.mtp_enabled)):
            n += self.embed
        if share.last:
            n += self.head + self.mtp
        return n

    def extras(self) -> tuple[int, int]:
        """(bytes only rank 0 holds, bytes only the last rank holds) of a split over two ranks or more."""
        return self.embed, self.head + self.mtp + (self.embed if self.tied or self.mtp_enabled else 0)


def layer_weights(facts: ModelFacts | FamilyFacts, cfg: Config) -> Weights:
    """The non-expert tensors of a `qnpipe convert` directory by holder, from the safetensors headers the
    account reads (`model.safetensors`, and the MTP file with `mtp.enabled`); their total is the account's
    non-expert line. A model of another family is a ConfigError: pipeline parallel is Qwen3-Next's alone."""
    from qnpipe.model.checkpoint import read_header

    if not isinstance(facts, ModelFacts):
        raise ConfigError(f"ranks: pipeline parallel runs on qwen3_next's native path only, "
                          f"not on a {getattr(facts, 'model_type', '?')} model")
    d = Path(facts.source)
    if not (d / "model.safetensors").is_file():
        raise CheckpointError(f"{d / 'model.safetensors'}: not found: splitting a model's memory over ranks "
                              f"reads a qnpipe model directory's weights")
    layers, embed, head, shared = tensor_bytes(
        {name: info.nbytes for name, info in read_header(d / "model.safetensors").items()},
        facts.args.num_hidden_layers)
    mtp = 0
    if cfg.mtp.enabled:
        mtp = sum(info.nbytes for info in read_header(Path(cfg.model.resolved_mtp_weights_path())).values())
    return Weights(layers=layers, embed=embed, head=head, shared=shared, mtp=mtp,
                   tied=facts.args.tie_word_embeddings, mtp_enabled=cfg.mtp.enabled, source=facts.non_expert_source)


def _per_layer_state(facts: ModelFacts, cfg: Config, context: int) -> tuple[list[int], list[int]]:
    """(KV bytes, recurrent-state bytes) of each decoder layer at `context`."""
    a = facts.args
    n = a.num_hidden_layers
    linear = [a.is_linear(i) for i in range(n)]
    n_lin = sum(linear)
    kv = kv_nbytes(facts, cfg, context) // max(1, n - n_lin)
    st = state_nbytes(facts) // max(1, n_lin)
    return [0 if lin else kv for lin in linear], [st if lin else 0 for lin in linear]


def layer_fixed_bytes(facts: ModelFacts, cfg: Config, weights: Weights, context: int) -> list[int]:
    """What each decoder layer costs its rank whatever the pool: its non-expert weights, its KV cache or
    recurrent state at `context`, and top-k slots when it is a MoE layer."""
    kv, st = _per_layer_state(facts, cfg, context)
    k = facts.args.num_experts_per_tok
    return [w + a + b + k * facts.record_nbytes.get(i, 0)
            for i, (w, a, b) in enumerate(zip(weights.layers, kv, st, strict=True))]


def memory_split(facts: ModelFacts, cfg: Config, weights: Weights, ranks: int, *, context: int) -> list[Share]:
    """Contiguous layer ranges, one per rank, minimising the largest rank's fixed bytes (module doc)."""
    first, last = weights.extras()
    split = split_layers(layer_fixed_bytes(facts, cfg, weights, context), ranks, first_extra=first, last_extra=last)
    return [Share(rank=r, ranks=ranks, lo=lo, hi=hi) for r, (lo, hi) in enumerate(split)]


def share_lines(facts: ModelFacts, cfg: Config, weights: Weights, share: Share, *, context: int,
                headroom_bytes: int = 0) -> list[Line]:
    """The account's fixed lines for `share`'s rank: the weights, KV cache and recurrent state of its
    layers; every other line whole (each rank is a process of its own)."""
    kv, st = _per_layer_state(facts, cfg, context)
    where = f"layers {share.lo}-{share.hi - 1}"
    held = ", ".join(x for x, on in (("embedding", share.first or (share.last and (weights.tied or weights.mtp_enabled))),
                                     ("final norm and LM head", share.last),
                                     ("MTP head", share.last and weights.mtp_enabled)) if on)
    mine = {WEIGHTS: (weights.of(share), f"{where}{' + ' + held if held else ''}: {weights.source}"),
            KV: (sum(kv[share.lo:share.hi]), f"{where}: "),
            STATE: (sum(st[share.lo:share.hi]), f"{where}: ")}
    lines = fixed_lines(facts, cfg, context=context, headroom_bytes=headroom_bytes)
    if missing := set(mine) - {x.name for x in lines}:  # the account renamed a line this module splits
        raise AssertionError(f"qnpipe.plan.account.fixed_lines has no line {sorted(missing)}")
    out = []
    for x in lines:
        if x.name in mine:
            nbytes, src = mine[x.name]
            x = Line(name=x.name, nbytes=nbytes, source=src if x.name == WEIGHTS else src + x.source)
        out.append(x)
    return out


def share_minimum(facts: ModelFacts, cfg: Config, weights: Weights, share: Share, *, context: int,
                  headroom_bytes: int = 0) -> int:
    """The smallest budget that fits `share`'s rank: its fixed lines and top-k slots of each of its MoE layers."""
    k = facts.args.num_experts_per_tok
    return (sum(x.nbytes for x in share_lines(facts, cfg, weights, share, context=context,
                                              headroom_bytes=headroom_bytes))
            + k * sum(n for ly, n in facts.record_nbytes.items() if share.holds(ly)))


def check_ranks(facts: ModelFacts, cfg: Config, weights: Weights, shares: Sequence[Share], budgets: Sequence[int],
                *, context: int, headroom_bytes: int = 0) -> list[int]:
    """Each rank's smallest budget; ConfigError naming every rank whose budget (`budgets[r]`, 0: no
    `--memory` on that rank) is below its own, with its layers, that budget and its lines."""
    needs = [share_minimum(facts, cfg, weights, s, context=context, headroom_bytes=headroom_bytes) for s in shares]
    bad = []
    for s, budget, need in zip(shares, budgets, needs, strict=True):
        if 0 < budget < need:
            lines = share_lines(facts, cfg, weights, s, context=context, headroom_bytes=headroom_bytes)
            parts = ", ".join(f"{x.name} {fmt_bytes(x.nbytes)}" for x in lines if x.nbytes)
            bad.append(f"--memory {fmt_bytes(budget)} on {s.label} of {s.ranks}: below the smallest budget that "
                       f"fits its share of the model, {fmt_bytes(need)} ({need} bytes: {parts}, and top-k "
                       f"({facts.args.num_experts_per_tok}) expert slots per MoE layer of its layers)")
    if bad:
        raise ConfigError("; ".join(bad))
    return needs


def share_shape(shape: ModelShape, share: Share) -> ModelShape:
    """`shape` with only `share`'s MoE layers (layer ids stay the whole model's)."""
    return msgspec.structs.replace(shape, moe_layers=tuple(ly for ly in shape.moe_layers if share.holds(ly)))


def _keep(r: Record, share: Share) -> bool:
    if isinstance(r, Route | ReadDone):
        return share.holds(r.layer)
    if isinstance(r, Candidates):  # a rank's predictor predicts within its own layers
        return share.holds(r.layer) and share.holds(r.target)
    return False


def restrict_log(src: str | Path, dst: str | Path, share: Share) -> Path:
    """Write `dst`: the routes (and recorded gate candidates and read sizes) of `src` at `share`'s layers,
    under a header whose model has only its MoE layers, so the curves and replays of a plan on it are that
    rank's. TraceSchemaError names a log without a model shape; OutputError a `dst` that cannot be written."""
    header, records, footer = read_all(src)
    if header.model is None:
        raise TraceSchemaError(f"{src}: record 0 (header) has no model shape: cannot take a rank's layers from it")
    shape = share_shape(header.model, share)
    layers = tuple(ly for ly in (header.layers or shape.moe_layers) if share.holds(ly))
    head = msgspec.structs.replace(header, model=shape, layers=layers,
                                   capacities={k: v for k, v in header.capacities.items() if share.holds(k)})
    writer = TraceWriter(dst, head)
    try:
        for r in records:
            if _keep(r, share):
                writer.write(r)
        writer.close(footer.dropped, footer.clock_end_t)
    finally:
        writer.abandon()  # a no-op once closed
    return Path(dst)


def restricted_log(src: str | Path, share: Share, out_dir: str | Path) -> Path:
    """`src` restricted to `share` (restrict_log) in `out_dir`, once per content: `src` itself when it is already."""
    from qnpipe.trace import iter_records

    header = next(iter_records(src))  # the generator and its file go with this reference
    if isinstance(header, Header) and header.model is not None and header.model == share_shape(header.model, share):
        return Path(src)
    h = hashlib.sha256(Path(src).read_bytes())
    h.update(msgspec.json.encode(share))
    dst = Path(out_dir) / f"qnpipe-plan-{h.hexdigest()[:16]}.layers{share.lo}-{share.hi - 1}.qtrace"
    return dst if dst.is_file() else restrict_log(src, dst, share)


__all__ = ["Share", "Weights", "check_ranks", "layer_fixed_bytes", "layer_weights", "memory_split", "restrict_log",
           "restricted_log", "share_lines", "share_minimum", "share_shape"]
