"""Where an mlx-lm model's routed experts are: its `SwitchGLU`/`SwitchMLP` instances, found by type.

A switch's expert tensors are exactly the array parameters of its `SwitchLinear`-type children
(`gate_proj.weight`, `fc1.scales`, `down_proj.bias`, ...), not every tensor under its path:
muse_spark keeps a norm under `experts`, and deepseek_v41 has a `SwitchLinear` in attention that
no switch owns (families.md §0 trap 4(e)).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

SWITCHES = (SwitchGLU, SwitchMLP)
EXPERT_LINEARS = (SwitchLinear, QuantizedSwitchLinear)
# A record's tensors of one linear, in this order (the ones the linear has).
PARAM_ORDER = ("weight", "scales", "biases", "bias", "global_scale")


@attrs.frozen
class SwitchSite:
    """One switch of a model: its module path, its decoder layer, and where it hangs in the tree."""

    path: str  # e.g. "model.layers.3.mlp.switch_mlp", "language_model.model.layers.3.feed_forward.experts"
    layer: int
    parent: Any = attrs.field(eq=False, repr=False)  # the dict, list or module holding it
    key: Any = attrs.field(eq=False, repr=False)  # its key there
    module: nn.Module = attrs.field(eq=False, repr=False)

    def replace(self, new: nn.Module) -> None:
        """Put `new` where the switch was (the model's own code then calls it instead)."""
        self.parent[self.key] = new


def find_switches(model: nn.Module) -> list[SwitchSite]:
    """Every `SwitchGLU`/`SwitchMLP` of `model`, in tree order. A switch's layer is the last index in its
    path (`model.layers.3.mlp.switch_mlp`, phixtral's `transformer.h.3.moe.switch_mlp`)."""
    sites = []
    for parent, key, path, mod in _walk(model, ""):
        index = [int(part) for part in path.split(".") if part.isdigit()]
        if not index:
            raise ValueError(f"switch {path} is in no list of layers: its decoder layer is unknown")
        sites.append(SwitchSite(path, index[-1], parent, key, mod))
    seen: dict[int, str] = {}
    for s in sites:  # the pool keys everything by layer: two switches in one layer would share its slots
        if s.layer in seen:
            raise ValueError(f"switches {seen[s.layer]} and {s.path} are both in layer {s.layer}")
        seen[s.layer] = s.path
    return sites


def _walk(mod: Any, path: str) -> Iterator[tuple[Any, Any, str, nn.Module]]:
    items = mod.items() if isinstance(mod, dict) else enumerate(mod)
    for k, v in items:
        p = f"{path}.{k}" if path else str(k)
        if isinstance(v, SWITCHES):
            yield mod, k, p, v
        elif isinstance(v, dict | list | tuple):
            yield from _walk(v, p)


def expert_linears(switch: nn.Module) -> dict[str, nn.Module]:
    """The switch's expert linears by child name, in the template's order (`gate_proj, up_proj,
    down_proj` or `fc1, fc2`)."""
    return {k: v for k, v in switch.items() if isinstance(v, EXPERT_LINEARS)}


def expert_params(switch: nn.Module) -> dict[str, mx.array]:
    """The switch's expert tensors `[E, ...]` by record name (`<linear>.<param>`), in record order."""
    out = {}
    for name, lin in expert_linears(switch).items():
        arrays = {k: v for k, v in lin.items() if isinstance(v, mx.array)}
        unknown = sorted(set(arrays) - set(PARAM_ORDER))
        if unknown:
            raise ValueError(f"{type(switch).__name__}.{name} has parameters {unknown} no expert record holds")
        out.update({f"{name}.{p}": arrays[p] for p in PARAM_ORDER if p in arrays})
    return out


def num_experts(switch: nn.Module) -> int:
    """E: the leading dimension of the switch's expert stacks."""
    return int(next(iter(expert_params(switch).values())).shape[0])
