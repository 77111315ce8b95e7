"""The replay's cost model: the modelled compute of each layer part, step and read batch, and its bounds."""

from __future__ import annotations

import math

import msgspec

from qnpipe.errors import ConfigError

# Bounds of the replay's own settings: far beyond any real machine, far below what breaks the
# virtual clock's arithmetic (a 1e300 s layer would make every later time equal to it).
MAX_COST_S = 3600.0  # an hour for one layer part, one step's extra or one read batch's hop
MAX_TABLE_LAYERS = 10_000


def check_seconds(key: str, v: float) -> None:
    """ConfigError naming `key` when `v` is not a finite number of seconds in [0, MAX_COST_S]."""
    if not (math.isfinite(v) and 0.0 <= v <= MAX_COST_S):
        raise ConfigError(f"{key}={v!r}: must be a finite number of seconds in [0, {MAX_COST_S:g}]")


class CostModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Modelled compute: each MoE layer part takes `per_layer_s + per_token_s * tokens` (its layer's
    `layer_table` entry in place of `per_layer_s` when it has one), plus `per_miss_s` for each expert
    its grant had to read (the compute a miss costs beyond its wait: on a machine whose cores the
    reader's threads share, the forward's next work runs slower after a read), and each
    step `per_step_s` more before its first MoE layer (head, sampling, the decode loop); each
    read batch waits `read_hop_s` before it reaches the device. Fitted by `qnpipe.replay.cost_fit`."""

    per_layer_s: float = 2e-3
    per_token_s: float = 0.0
    per_step_s: float = 0.0
    read_hop_s: float = 0.0  # the live read path's time per read batch beyond the device (thread hand-offs)
    layer_table: dict[int, float] = msgspec.field(default_factory=dict)  # per_layer_s of the layers listed
    per_miss_s: float = 0.0  # compute per expert a part's grant read (after the wait, which the device models)

    def check(self, where: str = "cost.") -> CostModel:
        """Self, or ConfigError naming the bad term (`where` + its name) and its value."""
        for name in ("per_layer_s", "per_token_s", "per_step_s", "read_hop_s", "per_miss_s"):
            check_seconds(f"{where}{name}", getattr(self, name))
        if len(self.layer_table) > MAX_TABLE_LAYERS:
            raise ConfigError(f"{where}layer_table: {len(self.layer_table)} entries: at most {MAX_TABLE_LAYERS} "
                              "(one per MoE layer)")
        for layer, v in self.layer_table.items():
            if layer < 0:
                raise ConfigError(f"{where}layer_table: layer {layer}: must be >= 0")
            check_seconds(f"{where}layer_table[{layer}]", v)
        return self

    def layer_s(self, tokens: float, layer: int | None = None, misses: int = 0) -> float:
        base = self.per_layer_s if layer is None else self.layer_table.get(layer, self.per_layer_s)
        s = base + self.per_token_s * tokens
        return s + self.per_miss_s * misses if misses and self.per_miss_s else s


__all__ = ["MAX_COST_S", "MAX_TABLE_LAYERS", "CostModel", "check_seconds"]
