"""Load a model of any MoE family mlx-lm runs onto the generic tier: mlx-lm's own model, its switches pooled.

The skeleton is mlx-lm's model class (`skeleton.build_skeleton`), quantized for the tensors the
directory holds: the non-expert file's headers plus, for a `qnpipe convert` directory, the store's
expert stacks. The non-expert tensors load strictly. Streamed, each `SwitchGLU`/`SwitchMLP` is
replaced by a `PooledSwitch` of its layer (qnpipe.model.family.pooled), which owns no parameter;
resident (an mlx-lm directory, or `pool.eager_load`), mlx-lm's own switches stay with every
expert loaded, from the store or the directory.

`FamilyArgs` is what the engine reads of `loaded.args` (qnpipe.live): the native tier's
`ModelArgs` fields it uses, from the skeleton's `FamilyInfo`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import attrs
import mlx.core as mx
import mlx.nn as nn

from qnpipe.errors import CheckpointError
from qnpipe.model.checkpoint import Layout, TensorInfo, is_qnpipe_dir, load_strict, load_tensors, scan
from qnpipe.model.family.skeleton import FamilyInfo, build_skeleton, family_info, text_config
from qnpipe.model.family.switches import SwitchSite, expert_params, find_switches

GENERIC = "generic"
NO_CONTEXT_LIMIT = 1 << 31  # a config without max_position_embeddings: the server and CLI check nothing


@attrs.frozen
class FamilyArgs:
    """The engine's view of a generic-tier model (what it reads of the native `ModelArgs`)."""

    info: FamilyInfo
    hidden_size: int
    max_position_embeddings: int  # NO_CONTEXT_LIMIT when config.json names none
    tie_word_embeddings: bool

    model_type = property(lambda self: self.info.model_type)
    num_experts = property(lambda self: self.info.num_experts)
    num_experts_per_tok = property(lambda self: self.info.num_experts_per_tok)
    moe_layers = property(lambda self: self.info.moe_layers)
    num_hidden_layers = property(lambda self: self.info.num_hidden_layers)
    vocab_size = property(lambda self: self.info.vocab_size)
    eos_token_id = property(lambda self: self.info.eos_token_id)
    model_id = property(lambda self: self.info.model_id)


class FamilyModel:
    """mlx-lm's model as the engine calls a native one: `model(ids, cache)` gives logits, so the
    tails' `head` is the identity (qnpipe.model.tails), and `make_cache` is mlx-lm's own."""

    tier = GENERIC

    def __init__(self, inner: nn.Module, args: FamilyArgs) -> None:
        self.inner = inner
        self.args = args

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.inner(inputs, cache=cache)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.inner)

    def kv_bytes_per_token(self) -> int:
        """0: not known for every cache kind mlx-lm uses yet (MLA latents, rotating windows, chunks)."""
        return 0

    def head(self, logits: mx.array) -> mx.array:
        return logits

    def parameters(self) -> Any:
        return self.inner.parameters()


@attrs.define
class ResidentSwitches:
    """The experts mlx-lm's own switches hold (all resident): their bytes, for the engine's figures.
    `layers` is empty: they are the model's own parameters (a snapshot's fingerprint has them)."""

    nbytes: int
    layers: dict[int, Any] = attrs.Factory(dict)


@attrs.define
class FamilyLoaded:
    """A generic-tier model ready to run (the fields of qnpipe.model.load.LoadedModel the engine reads)."""

    model: FamilyModel
    args: FamilyArgs
    experts: ResidentSwitches
    config: dict[str, Any]
    layout: Layout
    path: Path
    sites: dict[int, SwitchSite]  # MoE layer -> where its switch was found (mlx-lm's, the template)
    pooled: dict[int, Any] = attrs.Factory(dict)  # MoE layer -> its PooledSwitch, when the experts stream
    store_dir: Path | None = None  # the expert store, when there is one
    mtp_weights: dict[str, mx.array] = attrs.Factory(dict)
    tier: str = GENERIC


def family_args(config: Mapping[str, Any], info: FamilyInfo) -> FamilyArgs:
    tc = text_config(config)
    mpe = tc.get("max_position_embeddings")
    return FamilyArgs(info, int(tc.get("hidden_size") or tc.get("model_dim") or 0),
                      int(mpe) if isinstance(mpe, int) else NO_CONTEXT_LIMIT, bool(tc.get("tie_word_embeddings", False)))


def load_family(model_dir: Path, config: dict[str, Any], *, expert_dir: str | Path | None = None,
                verify: bool = False, resident_experts: bool = True) -> FamilyLoaded:
    """Load `model_dir` (an mlx-lm directory, or `qnpipe convert`'s of it) on the generic tier.

    `resident_experts` False (a qnpipe directory only) leaves the experts in the store: each switch
    becomes a PooledSwitch whose slot arrays the engine attaches. Raises CheckpointError for a
    config mlx-lm cannot build, a dense model, or tensors that do not match; StoreError for a store
    that does not match the model.
    """
    where = str(model_dir / "config.json")
    infos = scan(model_dir)
    if is_qnpipe_dir(model_dir, config):
        return _load_converted(model_dir, config, infos, Path(expert_dir) if expert_dir else model_dir,
                               verify=verify, resident=resident_experts)
    if not resident_experts:
        raise CheckpointError(f"{model_dir}: an mlx-lm directory has no expert store to stream from "
                              f"(`qnpipe convert` makes one)")
    from qnpipe.model.family.store_spec import headers_as_specs

    model = build_skeleton(config, headers_as_specs(infos), where)
    info = family_info(config, model, where)
    weights = load_tensors(infos)
    sanitize = getattr(model, "sanitize", None)
    if callable(sanitize):
        weights = cast(dict[str, mx.array], sanitize(weights))
    load_strict(model, weights, infos, model_dir)
    model.eval()
    mx.eval(model.parameters())
    sites = {s.layer: s for s in find_switches(model)}
    nbytes = sum(a.nbytes for s in sites.values() for a in expert_params(s.module).values())
    args = family_args(config, info)
    return FamilyLoaded(FamilyModel(model, args), args, ResidentSwitches(nbytes), config, Layout.MLX,
                        model_dir, sites)


def _load_converted(model_dir: Path, config: dict[str, Any], infos: dict[str, TensorInfo], store_dir: Path, *,
                    verify: bool, resident: bool) -> FamilyLoaded:
    """A qnpipe directory: non-expert tensors from its file, experts from its store (never re-sanitized)."""
    from qnpipe.io.store import ExpertStore, as_mx, read_index
    from qnpipe.io.store_check import check_against_model
    from qnpipe.model.family.store_spec import expert_spec, headers_as_specs, index_tensor_specs

    where = str(model_dir / "config.json")
    root, index = read_index(store_dir)
    model = build_skeleton(config, {**headers_as_specs(infos), **index_tensor_specs(index)}, where)
    info = family_info(config, model, where)
    if index.family is None:  # a version 1 store: the native Qwen3-Next convert's, named by the config's shape
        from qnpipe.model.args import model_id

        info = attrs.evolve(info, model_id=model_id(config))
    check_against_model(index, root / "index.json", expert_spec(info.model_type, model))
    sites = {s.layer: s for s in find_switches(model)}
    weights = load_tensors(infos)
    nbytes = 0
    pooled: dict[int, Any] = {}
    with ExpertStore.open(store_dir, expected_model_id=info.model_id) as store:
        if resident:
            for layer, s in sites.items():
                lf = store.layer_file(layer)
                arrays = store.read_layer(layer, verify=verify)
                dtypes = {t.name: t.dtype for t in lf.tensors}
                for name, want in expert_params(s.module).items():
                    a = as_mx(arrays[name], dtypes[name])
                    weights[f"{s.path}.{name}"] = a.view(want.dtype) if a.dtype != want.dtype else a
                    nbytes += a.nbytes
                del arrays
        else:
            from qnpipe.model.family.pooled import PooledSwitch

            for layer, s in sites.items():
                pooled[layer] = PooledSwitch(s.module, s.layer)
                s.replace(pooled[layer])
                pooled[layer].share_ahead(s.parent)
    load_strict(model, weights, infos, model_dir)
    model.eval()
    mx.eval(model.parameters())
    args = family_args(config, info)
    return FamilyLoaded(FamilyModel(model, args), args, ResidentSwitches(nbytes), config, Layout.QNPIPE,
                        model_dir, sites, pooled, store_dir)
