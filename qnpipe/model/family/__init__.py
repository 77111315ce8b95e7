"""Every MoE family of mlx-lm through the pool: mlx-lm's own model class, its switches pooled.

`switches` finds the `SwitchGLU`/`SwitchMLP` instances of an mlx-lm model by type and names
their expert tensors; `tiny` builds tiny random models of each family (tests, `make-tiny`).
Design: docs/architecture.md (the family seam) and docs/model.md (supported families).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qnpipe.model.family.skeleton import FamilyInfo, build_skeleton, family_info
    from qnpipe.model.family.switches import SwitchSite, find_switches

# Loaded on first use: importing any of these starts MLX and mlx-lm.
_LAZY = {
    "FamilyInfo": "qnpipe.model.family.skeleton",
    "build_skeleton": "qnpipe.model.family.skeleton",
    "family_info": "qnpipe.model.family.skeleton",
    "SwitchSite": "qnpipe.model.family.switches",
    "find_switches": "qnpipe.model.family.switches",
}
__all__ = ["FamilyInfo", "SwitchSite", "build_skeleton", "family_info", "find_switches"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
