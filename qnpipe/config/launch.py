"""What `mlx.launch` tells each process it starts: its rank and the ring's hostfile.

MLX reads these itself (`mx.distributed.init`); qnpipe reads them only to name the ranks in
its errors before the ring is up (a rank that never starts leaves MLX's connect waiting).
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def launch_rank(env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """(`MLX_RANK` as an int, or None when unset or not a number; `MLX_HOSTFILE`, or "")."""
    env = os.environ if env is None else env
    raw = env.get("MLX_RANK", "")
    return (int(raw) if raw.strip().isdigit() else None), env.get("MLX_HOSTFILE", "")
