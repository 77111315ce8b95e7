"""A ring on one machine: the hostfile `mlx.launch --backend ring` would write, on free local ports."""

from __future__ import annotations

import json
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """`n` TCP ports free on 127.0.0.1 just now (held together while chosen, so they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def write_local_hostfile(path: Path, ranks: int) -> Path:
    """Write the MLX_HOSTFILE of `ranks` ranks on localhost to `path`; returns it."""
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    return path


__all__ = ["free_ports", "write_local_hostfile"]
