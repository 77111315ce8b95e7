"""The checking adapter every plug-in eviction policy runs behind, and the plug-in calls in progress.

`make_plugin` (qnpipe.policy.eviction_plugin) wraps each plug-in in a `CheckedEviction`, so a
built-in policy pays nothing. The adapter keeps the set of residents the table told the plug-in
of, checks each answer of `pick` and `victim` against what it offered before the slot table
sees it, and turns any error the plug-in raises into a PluginError naming the setting's value,
the class, the method and the value. A wrong answer thus stops the run before a slot is
rewritten: what the forward reads is what a correct run would have read up to that point.

`RUNNING` says which plug-in method each thread is inside: the hang guard (qnpipe.hang_guard)
reads it to tell a plug-in that never returns (the stall watchdog, and SIGINT / SIGTERM, which
the pipeline's loop cannot act on while user code holds its thread). It keeps no time itself:
policy code reads no clock (tests/test_no_wall_clock.py); the guard measures.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Collection, Iterable
from typing import Any

from qnpipe.errors import PluginError, root_cause
from qnpipe.policy.eviction_protocol import Eviction

# thread id -> (the adapter, the method, a call number unique to this call): the calls now running
RUNNING: dict[int, tuple[CheckedEviction, str, int]] = {}
# Set once a plug-in is built: the hang guard has nothing to watch before (built-in policies return).
IN_USE = threading.Event()
_calls = itertools.count()
_SHOWN = 12  # experts listed in a message; the rest are counted


def where(exc: BaseException) -> str:
    """" in <the plug-in, its class and method>" when `exc` (Ctrl-C, SIGTERM's SystemExit, alone or in
    exception groups) came out of a plug-in's call, else "": what the command says it stopped in."""
    for e in (exc, root_cause(exc)):
        for note in getattr(e, "__notes__", ()):
            if isinstance(note, str) and note.startswith("in the pool.evict_policy plug-in "):
                return f" {note}"
    return ""


def _show(experts: Iterable[int]) -> str:
    s = sorted(experts)
    more = f", ... ({len(s)} in all)" if len(s) > _SHOWN else ""
    return "[" + ", ".join(map(str, s[:_SHOWN])) + more + "]"


class CheckedEviction:
    """`inner`, a plug-in built from `pool.evict_policy = spec`, with every answer checked (module docstring).

    `stall_s` is `diag.watchdog_s`: the hang guard stops the process when one call runs longer."""

    __slots__ = ("inner", "name", "resident", "spec", "stall_s")

    def __init__(self, inner: Eviction, spec: str, stall_s: float = 0.0) -> None:
        self.inner = inner
        self.spec = spec
        self.name = type(inner).__name__
        self.stall_s = stall_s
        self.resident: set[int] = set()
        IN_USE.set()

    def describe(self, method: str) -> str:
        return f"the pool.evict_policy plug-in {self.spec!r} ({self.name}.{method})"

    def _error(self, method: str, what: str) -> PluginError:
        return PluginError(f"pool.evict_policy={self.spec!r}: {self.name}.{method} {what} (the Eviction "
                           f"protocol, docs/pool.md \"Plug-in policies\")")

    def _call(self, method: str, *args: Any) -> Any:
        tid = threading.get_ident()
        RUNNING[tid] = (self, method, next(_calls))
        try:
            return getattr(self.inner, method)(*args)
        except Exception as exc:  # the plug-in's own failure, any kind: named, not a traceback from the table
            raise self._error(method, f"raised {type(exc).__name__}: {exc}") from exc
        except BaseException as exc:  # Ctrl-C, SIGTERM's SystemExit: passed on, saying where they came
            note = f"in {self.describe(method)}"
            if note not in getattr(exc, "__notes__", ()):
                exc.add_note(note)
            raise
        finally:
            RUNNING.pop(tid, None)

    def _expert(self, method: str, value: object) -> int:
        """`value` as an expert id, or a PluginError: an int (a numpy integer too), not a bool."""
        if not isinstance(value, bool):
            try:
                return operator.index(value)  # type: ignore[arg-type]
            except TypeError:
                pass
        raise self._error(method, f"returned {value!r} (a {type(value).__name__}), not an expert id (int)")

    def _evictable(self, loading: Collection[int], held: Collection[int], pinned: Collection[int]) -> list[int]:
        return [e for e in self.resident if e not in loading and e not in held and e not in pinned]

    # ----------------------------------------------------------------- the protocol

    def inserted(self, expert: int, tick: int) -> None:
        self.resident.add(expert)
        self._call("inserted", expert, tick)

    def accessed(self, expert: int, tick: int) -> None:
        self._call("accessed", expert, tick)

    def removed(self, expert: int) -> None:
        self.resident.discard(expert)
        self._call("removed", expert)

    def forward_done(self) -> None:
        self._call("forward_done")

    def victim(self, candidates: Iterable[int], incoming: int) -> int:
        offered = list(candidates)
        got = self._call("victim", offered, incoming)
        e = self._expert("victim", got)
        if e not in offered:
            raise self._error("victim", f"returned {got!r}, not one of the candidates {_show(offered)}")
        return e

    def pick(self, loading: Collection[int], held: Collection[int], pinned: Collection[int],
             incoming: int) -> int | None:
        # Copies: the plug-in cannot change the table's own sets through them.
        loading, held, pinned = frozenset(loading), frozenset(held), frozenset(pinned)
        got = self._call("pick", loading, held, pinned, incoming)
        if got is None:
            if free := self._evictable(loading, held, pinned):
                raise self._error("pick", f"returned None (every expert blocked) for incoming expert {incoming}, "
                                          f"but {_show(free)} could be evicted")
            return None
        e = self._expert("pick", got)
        why = ("the incoming expert (the one that needs the slot)" if e == incoming
               else "not in the pool" if e not in self.resident
               else "still loading" if e in loading
               else "held by a step using it" if e in held
               else "pinned" if e in pinned else None)
        if why is not None:
            raise self._error("pick", f"returned {got!r} for incoming expert {incoming}: {why}; the evictable "
                                      f"residents were {_show(self._evictable(loading, held, pinned))}")
        return e


__all__ = ["IN_USE", "RUNNING", "CheckedEviction", "where"]
