"""What `mlx.launch` tells each process it starts: its rank and the ring's hostfile.

MLX's ring backend (`mx.distributed.init`, mlx/distributed/ring/ring.cpp) reads `MLX_RANK` with
`atoi` and `MLX_HOSTFILE` whole with no check of its own: a hostfile of `[]` divides by zero
(SIGFPE), `MLX_RANK=-1` indexes before the host list (SIGSEGV), `/dev/zero` is read until memory
runs out and a FIFO blocks for ever. So `read_launch` checks both, and the file, before MLX sees
them (`MLX_RING_VERBOSE`, the one other variable it reads, only turns its logging on).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Mapping

import attrs

from qnpipe.errors import ConfigError

# Far above any ring (mlx.launch writes ~25 bytes per address) and far below memory.
HOSTFILE_CAP = 1 << 20
MAX_RANKS = 1024
MAX_ADDRESSES = 64  # per rank: mlx.launch's --connections-per-ip times the host's IPs
_RANK = re.compile(r"[0-9]{1,4}")  # what atoi reads the same way: no sign, no blanks
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_DOCS = "docs/distributed.md"


@attrs.frozen
class Launch:
    """This process's place in the ring, as checked by `read_launch`."""

    rank: int
    hostfile: str
    hosts: tuple[tuple[str, ...], ...]  # per rank, the `host:port` addresses it listens on

    @property
    def size(self) -> int:
        return len(self.hosts)

    def neighbours(self) -> str:
        """The ranks this one connects to, for messages ("rank 0 and rank 2")."""
        n = self.size
        return " and ".join(sorted({f"rank {(self.rank - 1) % n}", f"rank {(self.rank + 1) % n}"}))


def launch_rank(env: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """(`MLX_RANK` as an int, or None when unset or not a rank; `MLX_HOSTFILE`, or ""), unchecked:
    for choosing how to treat Ctrl-C before the ring starts, never for MLX."""
    env = os.environ if env is None else env
    raw = env.get("MLX_RANK", "")
    return (int(raw) if _RANK.fullmatch(raw) else None), env.get("MLX_HOSTFILE", "")


def read_launch(env: Mapping[str, str] | None = None) -> Launch:
    """`MLX_RANK` and `MLX_HOSTFILE` checked as MLX's ring backend needs them; ConfigError naming the
    variable, the file and the value otherwise.

    The hostfile is a regular file of at most HOSTFILE_CAP bytes holding a JSON list (one entry per
    rank, at least two) of non-empty lists of `host:port` strings, as `mlx.launch --backend ring`
    writes it: every rank with as many addresses, none listed twice, hosts an IPv4 address or a
    DNS name, ports 1..65535; `MLX_RANK` a whole number below the number of ranks."""
    from qnpipe.files import read_capped

    env = os.environ if env is None else env
    rank_raw, path = env.get("MLX_RANK"), env.get("MLX_HOSTFILE")
    how = f"start every rank with mlx.launch --backend ring ({_DOCS})"
    if rank_raw is None:
        raise ConfigError(f"distributed.enabled: MLX_RANK is not set: {how}")
    if not path:
        raise ConfigError(f"distributed.enabled: MLX_HOSTFILE is {'empty' if path == '' else 'not set'}: {how}")
    if not _RANK.fullmatch(rank_raw):
        raise ConfigError(f"MLX_RANK={rank_raw!r}: not a rank (a whole number from 0, below the number of "
                          f"ranks in MLX_HOSTFILE {path})")
    try:
        raw = read_capped(path, HOSTFILE_CAP, error=ConfigError)
    except ConfigError as e:
        raise ConfigError(f"MLX_HOSTFILE {e}") from None
    hosts = _hosts(raw, path)
    rank = int(rank_raw)
    if rank >= len(hosts):
        raise ConfigError(f"MLX_RANK={rank_raw!r}: MLX_HOSTFILE {path} lists {len(hosts)} ranks (0 to "
                          f"{len(hosts) - 1}); this rank is not among them")
    return Launch(rank, path, hosts)


def _hosts(raw: bytes, path: str) -> tuple[tuple[str, ...], ...]:
    shape = 'a JSON list with one list of "host:port" strings per rank, e.g. [["10.0.0.1:5000"], ["10.0.0.2:5000"]]'

    def bad(what: str) -> ConfigError:
        return ConfigError(f"MLX_HOSTFILE {path}: {what}; expected {shape}")

    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8 (byte offset {e.start})") from None
    except (ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(data, list):
        raise bad(f"a JSON {type(data).__name__}, not a list")
    if len(data) < 2:
        raise bad(f"{len(data)} rank{'' if len(data) == 1 else 's'} (a ring has at least 2)")
    if len(data) > MAX_RANKS:
        raise bad(f"{len(data)} ranks (at most {MAX_RANKS})")
    seen: dict[str, int] = {}
    out = []
    for r, addrs in enumerate(data):
        if not isinstance(addrs, list) or not addrs or len(addrs) > MAX_ADDRESSES:
            raise bad(f"rank {r}'s entry is {_short(addrs)}, not a list of 1 to {MAX_ADDRESSES} addresses")
        if len(addrs) != len(data[0]):
            raise bad(f"rank {r} has {len(addrs)} addresses and rank 0 {len(data[0])} (MLX's ring needs as many "
                      f"connections to each side)")
        for a in addrs:
            if not isinstance(a, str):
                raise bad(f"rank {r}'s address {_short(a)} is not a string")
            problem = _address_problem(a)
            if problem:
                raise bad(f"rank {r}'s address {a!r}: {problem}")
            if a in seen:
                raise bad(f"rank {seen[a]} and rank {r} both listen on {a}")
            seen[a] = r
        out.append(tuple(addrs))
    return tuple(out)


def _address_problem(addr: str) -> str:
    """Why `addr` is not `host:port` as MLX splits it (at the first colon: no IPv6), or ""."""
    host, colon, port = addr.partition(":")
    if not colon:
        return "no ':port'"
    if ":" in port or host.startswith("["):
        return "an IPv6 address (MLX's ring takes an IPv4 address or a host name)"
    if not port.isascii() or not port.isdigit() or len(port) > 5 or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not a number in 1..65535"
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in host.split(".")):
        return f"host {host!r} is neither an IPv4 address nor a host name"
    if all(label.isdigit() for label in host.split(".")):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"host {host!r} is not an IPv4 address"
    return ""


def _short(v: object) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
