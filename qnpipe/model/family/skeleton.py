"""mlx-lm's own model class for a config, built without weights, quantized by mlx-lm's rule.

The skeleton is what every family shares with mlx-lm: its module tree decides which tensors
exist, which are experts (`switches`), and how each linear is quantized. Only mlx-lm's own
model classes are built: a config that names model code of its own (`model_file`) is refused,
since a model directory a user receives is data, never code.

`FamilyInfo` is what the engine needs of a family (MoE layers, experts, top-k, vocabulary,
end-of-sequence ids) and a model id that changes with any tensor's name, shape or dtype.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from qnpipe.errors import CheckpointError
from qnpipe.model.family.switches import find_switches, num_experts

# The config keys families name their top-k by (a list: one per layer, hunyuan).
TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k_experts", "moe_topk", "moe_top_k")


class TensorSpec(Protocol):
    """What the quantization rule reads of a saved tensor (an mx.array, or a header entry)."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of `config` (a VL wrapper keeps it under `text_config`)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


def model_classes(config: Mapping[str, Any], where: str) -> tuple[Any, Any]:
    """mlx-lm's (Model, ModelArgs) for `config`; a CheckpointError naming `where` and the type otherwise."""
    if config.get("model_file") is not None:
        raise CheckpointError(f"{where}: config.json asks to import model code ({config['model_file']!r}); "
                              f"qnpipe runs mlx-lm's own model classes only")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{where}: config.json has no model_type")
    from mlx_lm.utils import _get_classes  # private, but the mlx-lm pin (<0.33) holds it still

    try:
        return _get_classes(dict(config))
    except ValueError:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not a model mlx-lm "
                              f"{_mlx_lm_version()} knows") from None


def build_skeleton(config: Mapping[str, Any], tensors: Mapping[str, TensorSpec], where: str,
                   seed: int = 0) -> nn.Module:
    """mlx-lm's model of `config`, its weights not materialised, quantized as mlx-lm's loader would
    quantize it for a checkpoint holding `tensors` (name -> shape and dtype, experts included).

    `where` names the directory in errors. Raises CheckpointError for a config mlx-lm cannot build.
    """
    model_cls, args_cls = model_classes(config, where)
    cfg = copy.deepcopy(dict(config))
    mx.random.seed(seed)  # construction draws its init keys eagerly: the same skeleton every time
    try:
        model = model_cls(args_cls.from_dict(cfg))
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{where}: mlx-lm cannot build a {cfg['model_type']} model from config.json "
                              f"({type(e).__name__}: {e})") from None
    quant = cfg.get("quantization")
    if quant is None and isinstance(text_config(cfg).get("quantization"), Mapping):
        quant = text_config(cfg)["quantization"]
    if quant is None and cfg.get("quantization_config"):
        raise CheckpointError(f"{where}: config.json has a `quantization_config` but no `quantization`: "
                              f"convert it with `mlx_lm.convert` first, then with `qnpipe convert`")
    if quant is not None:
        _quantize(model, quant, tensors, where)
    model.eval()
    return model


def _quantize(model: nn.Module, quant: Mapping[str, Any], tensors: Mapping[str, TensorSpec], where: str) -> None:
    """mlx-lm's rule (mlx_lm.utils.load_model): a per-path entry, else inferred from the saved scales."""
    from mlx_lm.utils import _takes_global_scale, infer_quant_config

    def predicate(path: str, m: nn.Module) -> bool | dict[str, Any]:
        if isinstance(quant.get(path), Mapping | bool):
            return quant[path]
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in tensors:
            return False
        params = infer_quant_config(path, m, dict(tensors))
        if f"{path}.global_scale" in tensors and _takes_global_scale(m):
            params["global_scale"] = True
        return params

    try:
        nn.quantize(model, group_size=quant["group_size"], bits=quant["bits"], mode=quant.get("mode", "affine"),
                    class_predicate=predicate)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: config.json's quantization cannot be applied ({type(e).__name__}: {e})") from None


@attrs.frozen
class FamilyInfo:
    """What the engine needs of a model of any family."""

    model_type: str
    switch_class: str  # SwitchGLU or SwitchMLP
    switch_paths: dict[int, str]  # MoE layer -> module path of its switch
    num_experts: int
    num_experts_per_tok: int
    vocab_size: int
    num_hidden_layers: int
    eos_token_id: int | list[int] | None
    model_id: str

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.switch_paths))


def family_info(config: Mapping[str, Any], model: nn.Module, where: str) -> FamilyInfo:
    """`FamilyInfo` of a skeleton. Raises CheckpointError for a model with no switch (a dense model) or
    switches of different expert counts (one pool size per model)."""
    sites = find_switches(model)
    if not sites:
        raise CheckpointError(f"{where}: a {config.get('model_type')} model has no routed experts "
                              f"(no SwitchGLU/SwitchMLP): qnpipe streams the experts of MoE models only")
    counts = {num_experts(s.module) for s in sites}
    if len(counts) != 1:
        raise CheckpointError(f"{where}: switches with different expert counts {sorted(counts)}")
    kinds = {type(s.module).__name__ for s in sites}
    tc = text_config(config)
    return FamilyInfo(
        model_type=str(config["model_type"]),
        switch_class="/".join(sorted(kinds)),
        switch_paths={s.layer: s.path for s in sites},
        num_experts=counts.pop(),
        num_experts_per_tok=top_k(config),
        vocab_size=_vocab(tc, model, where),
        num_hidden_layers=len(_decoder_layers(model)) or max(s.layer for s in sites) + 1,
        eos_token_id=config.get("eos_token_id", tc.get("eos_token_id")),
        model_id=skeleton_id(config, model),
    )


def top_k(config: Mapping[str, Any]) -> int:
    """The largest number of experts a router of `config` picks per token."""
    tc = text_config(config)
    for key in TOPK_KEYS:
        if key in tc:
            v = tc[key]
            return int(max(v) if isinstance(v, list) else v)
    raise CheckpointError(f"{config.get('model_type')}: config.json names no top-k ({', '.join(TOPK_KEYS)})")


def skeleton_id(config: Mapping[str, Any], model: nn.Module) -> str:
    """sha256 of the model type and every (name, shape, dtype) of the quantized skeleton."""
    rows = [[n, list(a.shape), str(a.dtype)] for n, a in tree_flatten(model.parameters()) if isinstance(a, mx.array)]
    blob = json.dumps([config.get("model_type"), sorted(rows)], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def _vocab(tc: Mapping[str, Any], model: nn.Module, where: str) -> int:
    for key in ("vocab_size", "num_vocab"):
        if isinstance(tc.get(key), int):
            return int(tc[key])
    raise CheckpointError(f"{where}: config.json has no vocab_size")


def _decoder_layers(model: nn.Module) -> list[Any]:
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, list | tuple) else []


def _mlx_lm_version() -> str:
    import mlx_lm

    return str(getattr(mlx_lm, "__version__", "?"))
