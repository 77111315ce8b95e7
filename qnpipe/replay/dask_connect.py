"""A `dask.distributed.Client` connected to a scheduler within a bound, or an error naming the address.

`Client(address, timeout=T)` bounds the TCP connect alone: the handshake after it has no timeout,
so a port that accepts and never answers (another service, a host whose scheduler hangs) held
`qnpipe sweep --executor dask` for good, and a port nothing listens on was retried silently for
distributed's default 30 s.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from qnpipe.config.tree import DASK_CONNECT_TIMEOUT_S
from qnpipe.errors import QnpipeError

# distributed's own connect error says why (refused, unknown host); the handshake's bound fires this much
# later, so that error comes first when there is one.
_GRACE_S = 1.0
_REMEDY = "check the address, that `dask scheduler` runs there and that its port is reachable from here"


def connect(address: str, timeout_s: float = DASK_CONNECT_TIMEOUT_S) -> Any:
    """A Client of the scheduler at `address`, which answered within `timeout_s` (+1 s), or a QnpipeError."""
    from dask.distributed import Client
    from distributed.comm.addressing import parse_address
    from distributed.comm.registry import get_backend

    try:
        get_backend(parse_address(address)[0])
    except ValueError as e:
        raise QnpipeError(f"--scheduler {address!r}: {e}; e.g. tcp://HOST:8786") from None
    # The scheduler is asked for its handshake first, with no Client: a Client whose start fails part-way
    # stalls the interpreter's exit in its __del__ (4 s, then a traceback).
    _handshake(address, timeout_s)

    class BoundedClient(Client):
        def start(self, **kwargs: Any) -> None:
            # In case the scheduler stops answering after the handshake: distributed.utils.sync's
            # callback_timeout bounds the whole start.
            super().start(callback_timeout=timeout_s + _GRACE_S, **kwargs)

    try:
        return BoundedClient(address, timeout=timeout_s)
    except OSError as e:
        raise _error(address, timeout_s, e) from None


def _handshake(address: str, timeout_s: float) -> None:
    from distributed.comm.core import connect

    async def ask() -> None:
        comm = await asyncio.wait_for(connect(address, timeout=timeout_s), timeout_s + _GRACE_S)
        await comm.close()

    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(ask())
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    # A thread of its own: the caller may be inside an event loop, where asyncio.run cannot start.
    t = threading.Thread(target=run, name="qnpipe-dask-handshake", daemon=True)
    t.start()
    t.join()
    if failed:
        e = failed[0]
        if isinstance(e, OSError):
            raise _error(address, timeout_s, e) from None
        if isinstance(e, ValueError):  # an address distributed cannot parse: "tcp://[::1", "tcp://host:port"
            raise QnpipeError(f"--scheduler {address!r}: {e}; e.g. tcp://HOST:8786") from None
        raise e


def _error(address: str, timeout_s: float, e: OSError) -> QnpipeError:
    bound = f"{timeout_s:g} s (net.dask_connect_timeout_s)"
    if isinstance(e, TimeoutError):  # the bound on the handshake or the whole start; distributed's is an OSError
        return QnpipeError(f"the Dask scheduler at {address}: no answer within {bound} (the port accepts "
                           f"connections but nothing there answers as a Dask scheduler); {_REMEDY}")
    return QnpipeError(f"the Dask scheduler at {address}: cannot connect within {bound}: {_root(e)}; {_REMEDY}")


def _root(e: BaseException) -> str:
    """The innermost cause's message (`[Errno 111] Connection refused` rather than distributed's wrapping);
    when the last attempt was cut by the deadline (a cancel, no message), what distributed said."""
    said = e
    while e.__cause__ is not None:
        e = e.__cause__
        if str(e).strip():
            said = e
    return f"{type(said).__name__}: {str(said).strip().splitlines()[0]}"
