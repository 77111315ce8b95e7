"""The live engine's generic tier: a model of any MoE family mlx-lm runs (qnpipe.model.family.load).

Streamed, each layer's slot arrays (by record tensor name, `LayerSlots.arrays`) are handed to its
`PooledSwitch`, and a `GreenletBackend` runs mlx-lm's own forward, suspended at every switch, behind
the begin/resume/abort protocol the forward actor drives. All resident, mlx-lm's forward runs in
one go (`ResidentBackend`). Either way a step's tail gets logits (mlx-lm's `__call__` ends with the
LM head), which the generic model's `head` passes through (qnpipe.model.tails).

What only the native Qwen3-Next path has is refused on another family, naming the setting and the
family, before any weight is read: never a silent fallback.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from qnpipe.config import Config, PoolCfg
from qnpipe.errors import ConfigError
from qnpipe.io.reader import ExpertReader
from qnpipe.io.store import ExpertStore
from qnpipe.live.streaming import Streaming
from qnpipe.model.runner import Runner
from qnpipe.model.stage import Stage
from qnpipe.steps import Event, LayerRoute, PartDone, PartGrant, Queued, StepDone, Tail

# Below this many (token, expert) pairs mlx-lm's switch does not sort, so early grants change no bit.
EARLY_PAIRS = 64


def check_generic_cfg(cfg: Config, family: str, stage: Stage | None) -> None:
    """ConfigError for a setting only the native Qwen3-Next path has, naming it and the family."""
    why = "runs on the native Qwen3-Next path only"
    bad = []
    if cfg.mtp.enabled:
        bad.append(f"mtp.enabled=true {why} (MTP speculation)")
    if cfg.kv.quantize:
        bad.append(f"kv.quantize=true {why} (rotated KV quantization)")
    if stage is not None and stage.size > 1:
        bad.append(f"distributed ranks ({stage.size}) {why} (pipeline parallel)")
    if cfg.forward.moe_topk_override is not None:
        bad.append(f"forward.moe_topk_override={cfg.forward.moe_topk_override} {why} (the router's top-k)")
    if bad:
        tier = " (model.tier=generic)" if family == "qwen3_next" else ""
        raise ConfigError(f"a {family} model on the generic tier{tier}: " + "; ".join(bad))


class ResidentBackend:
    """mlx-lm's forward with its own switches (every expert resident): one step, no yields."""

    early_pairs = EARLY_PAIRS

    def __init__(self, model: Any) -> None:
        self.model = model
        self.ring_tail: Callable[[Tail, list[Any]], Tail] | None = None

    def begin(self, inputs: Callable[[], mx.array], cache: list[Any], tail: Tail) -> Event:
        return StepDone(tail(self.model(inputs(), cache)))

    def resume(self, grant: PartGrant) -> Event:
        raise AssertionError("an all-resident step asks for no slots")

    def abort(self) -> None:
        pass


def load_generic(cfg: Config, runner: Runner, model_dir: Path, stream: bool,
                 reader: ExpertReader | None) -> tuple[Streaming | None, Any]:
    """What the generic tier adds to its `LoadedModel` (qnpipe.live.loaded): when the experts stream, the
    store, reader, slot arrays and capacities; and the backend."""
    from qnpipe.actors.pipeline import layer_capacities, side_slots
    from qnpipe.io.ssd import SsdReader
    from qnpipe.model.checkpoint import Layout
    from qnpipe.model.slots import make_layer_slots

    loaded: Any = runner.loaded
    args = loaded.args
    if not stream:
        asked = cfg.pool.expert_slots != PoolCfg().expert_slots or cfg.pool.capacity_profile_path
        if asked and not cfg.pool.eager_load and loaded.layout is not Layout.QNPIPE:
            warnings.warn(f"{model_dir} has no expert store: every expert is resident "
                          f"(`qnpipe convert` makes a directory whose experts stream)", stacklevel=3)
        return None, ResidentBackend(loaded.model)
    store = ExpertStore.open(loaded.store_dir, expected_model_id=args.model_id)
    try:
        caps = layer_capacities(cfg, args)
        side = side_slots(cfg)
        slots = {layer: make_layer_slots(store.layer_file(layer), cap + side, native=False)
                 for layer, cap in caps.items()}
        reader = reader if reader is not None else SsdReader.from_config(cfg.read)
    except BaseException:
        store.close()
        raise
    predictor = _predictor(cfg, loaded) if cfg.predict.cross_layer_prefetch else None
    for layer, sw in loaded.pooled.items():
        sw.attach(slots[layer].arrays)
        sw.predictor = predictor
    from qnpipe.model.family.backend import GreenletBackend

    backend = GreenletBackend(loaded.model)
    return Streaming(store, reader, slots, caps), backend


def _predictor(cfg: Config, loaded: Any) -> Any:
    """The family's routers on each layer's switch input (qnpipe.model.family.routers), or None, said once."""
    from qnpipe.model.family.routers import FamilyPredictor, family_routers
    from qnpipe.policy.predict import predict_targets
    from qnpipe.steps import PredictPlan

    family = loaded.args.model_type
    routers, why = family_routers(family, {layer: s.parent for layer, s in loaded.sites.items()})
    if why is not None:
        what = "no predictions" if not routers else "predictions for some layers only"
        warnings.warn(f"predict.cross_layer_prefetch: {what} for a {family} model ({why}); "
                      f"the other experts are read when routed", stacklevel=4)
    if not routers:
        return None
    plan = PredictPlan(predict_targets(tuple(loaded.args.moe_layers), cfg.predict), cfg.predict.width_experts,
                       cfg.predict.use_moe_input)
    return FamilyPredictor(plan, routers)


def warm_up_generic(core: Any) -> float:
    """`warm_up_model` of the generic tier: a prompt-shaped and a decode-shaped step through the backend
    on a cache of their own; a streamed layer gets slot 0 for every pair, whatever it holds."""
    model = core.runner.loaded.model
    t0 = time.perf_counter()
    try:
        cache = model.make_cache()
        n = max(1, min(4, model.args.vocab_size))
        for ids in (mx.arange(n, dtype=mx.uint32)[None], mx.zeros((1, 1), dtype=mx.uint32)):
            ev = core.backend.begin(lambda ids=ids: ids, cache, mx.eval)
            while not isinstance(ev, StepDone):
                if isinstance(ev, LayerRoute):
                    ev = core.backend.resume(PartGrant(0, ev.ids.shape[0], np.zeros_like(ev.ids), True))
                else:
                    assert not isinstance(ev, Queued | PartDone), ev
    finally:
        mx.clear_cache()
    return time.perf_counter() - t0
