"""What an expert store must hold for an mlx-lm model of any family, from its skeleton.

`expert_spec` reads the skeleton's switches (`switches.find_switches`, by type) into the
`io.store_check.ExpertSpec` the store's index is checked against; `index_tensor_specs` goes the
other way, giving the skeleton builder the stacked expert tensors `[E, ...]` a store holds, so
mlx-lm's quantization rule sees the experts' scales (they are not in the non-expert file).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from qnpipe.io.store_check import FLOAT, ExpertSpec
from qnpipe.io.store_format import Family, Quant, StoreIndex, index_family
from qnpipe.model.family.switches import expert_linears, expert_params, find_switches, num_experts

__all__ = ["TensorHeader", "converted_skeleton", "expert_spec", "family_block", "headers_as_specs", "index_tensor_specs",
           "linear_quant"]

_MX_OF_NAME = {"uint32": mx.uint32, "uint8": mx.uint8, "bfloat16": mx.bfloat16, "float16": mx.float16,
               "float32": mx.float32}


@attrs.frozen
class TensorHeader:
    """A tensor's shape and MLX dtype without its data (what `skeleton.build_skeleton` reads)."""

    shape: tuple[int, ...]
    dtype: Any


def dtype_kind(dtype: Any) -> str:
    """An ExpertSpec dtype: `FLOAT` for any float type, else the dtype's name ("uint32", "uint8")."""
    if mx.issubdtype(dtype, mx.floating):
        return FLOAT
    return str(dtype).removeprefix("mlx.core.")


def linear_quant(lin: nn.Module) -> Quant | None:
    """The store's Quant of an expert linear (None for a float one)."""
    if not hasattr(lin, "bits") or "scales" not in lin:
        return None
    gs = isinstance(lin.get("global_scale"), mx.array)
    bits, group_size, mode = (getattr(lin, k) for k in ("bits", "group_size", "mode"))
    return Quant(bits=int(bits), group_size=int(group_size), mode=str(mode), global_scale=gs)


def expert_spec(model_type: str, model: nn.Module) -> ExpertSpec:
    """The ExpertSpec of skeleton `model` (config.json's `model_type`). ValueError when it has no switch."""
    sites = find_switches(model)
    if not sites:
        raise ValueError(f"a {model_type} model has no SwitchGLU/SwitchMLP")
    tensors: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}
    quant: dict[int, dict[str, Quant]] = {}
    for s in sites:
        tensors[s.layer] = {n: (tuple(a.shape[1:]), dtype_kind(a.dtype)) for n, a in expert_params(s.module).items()}
        quant[s.layer] = {n: q for n, lin in expert_linears(s.module).items() if (q := linear_quant(lin)) is not None}
    counts = {num_experts(s.module) for s in sites}
    if len(counts) != 1:
        raise ValueError(f"switches of a {model_type} model have different expert counts {sorted(counts)}")
    return ExpertSpec(model_type=model_type, num_experts=counts.pop(), switch_paths={s.layer: s.path for s in sites},
                      tensors=tensors, quant=quant)


def family_block(model_type: str, model: nn.Module) -> Family:
    """The index's family block for skeleton `model`."""
    sites = find_switches(model)
    kinds = sorted({type(s.module).__name__ for s in sites})
    if len(kinds) != 1:
        raise ValueError(f"a {model_type} model mixes switch classes {kinds}")
    return Family(model_type=model_type, switch_class=kinds[0], switch_paths={s.layer: s.path for s in sites})


def index_tensor_specs(index: StoreIndex) -> dict[str, TensorHeader]:
    """Full name (`<switch path>.<linear>.<param>`) -> stacked `[E, ...]` shape and dtype of every expert
    tensor the store holds: merged with the non-expert file's headers, what `build_skeleton` takes."""
    fam = index_family(index)
    out: dict[str, TensorHeader] = {}
    for lf in index.layers:
        path = fam.switch_paths[lf.layer]
        for t in lf.tensors:
            out[f"{path}.{t.name}"] = TensorHeader((lf.num_experts, *t.shape), _MX_OF_NAME[t.dtype])
    return out


def headers_as_specs(headers: Mapping[str, Any]) -> dict[str, TensorHeader]:
    """safetensors header entries (`.dtype` a safetensors name, `.shape`) -> TensorHeaders."""
    from qnpipe.io.dtypes import NAME_OF_ST

    out = {}
    for name, h in headers.items():
        dt = NAME_OF_ST.get(h.dtype)
        out[name] = TensorHeader(tuple(h.shape), getattr(mx, dt) if dt is not None else h.dtype)
    return out


def converted_skeleton(model_dir: Any) -> tuple[nn.Module, StoreIndex, dict[str, Any]]:
    """The skeleton of a converted family model directory, checked against its store.

    Built from config.json with the non-expert file's headers plus the store's expert stacks
    (`index_tensor_specs`), so mlx-lm's rule quantizes the switches as the store holds them;
    the index is then checked against it (`store_check.check_against_model`). Nothing is
    sanitized (the directory holds post-sanitize tensors). Returns (skeleton, index, config).
    Raises CheckpointError (config) or StoreError (a store that does not match)."""
    from pathlib import Path

    from qnpipe.io.store import read_index
    from qnpipe.io.store_check import check_against_model
    from qnpipe.model.args import read_config
    from qnpipe.model.checkpoint import scan
    from qnpipe.model.family.skeleton import build_skeleton

    d = Path(model_dir)
    config = read_config(d)
    root, index = read_index(d)
    where = str(d / "config.json")
    specs = {**headers_as_specs(scan(d)), **index_tensor_specs(index)}
    model = build_skeleton(config, specs, where)
    check_against_model(index, root / "index.json", expert_spec(str(config["model_type"]), model))
    return model, index, config
