"""A log's routes for replay: read, checked against the log's model shape, and kept for the next replay of it."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import msgspec

from qnpipe.errors import TraceSchemaError
from qnpipe.messages import Candidates, ReadDone
from qnpipe.trace import Header, ModelShape, Route, read


class ReplayLog(msgspec.Struct, frozen=True, kw_only=True):
    """A log's routes by step: `steps[i]` = ((layer, experts [N*k]), ...) in layer order."""

    shape: ModelShape
    steps: list[list[tuple[int, tuple[int, ...]]]]
    record_nbytes: dict[int, int]  # from the log's read.done records (empty for a routing log)
    # the recorded predict.candidates: by steps' index, MoE layer -> ((target, width, experts, scores), ...)
    candidates: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...], tuple[float, ...]]]] = {}
    capacities: dict[int, int] = {}  # the header's: the slots per MoE layer the log was recorded with ({}: not known)
    evict_policy: str = ""  # the header's: pool.evict_policy of the recorded run ("": not known)


def load_log(path: str | Path) -> ReplayLog:
    """The routes of a log, checked against its header's model shape (TraceSchemaError names the record)."""
    header, records = read(path)
    shape = _shape(path, header)
    moe = set(shape.moe_layers)
    by_step: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    nbytes: dict[int, int] = {}
    cands: dict[tuple[int, int], list[tuple[int, int, tuple[int, ...], tuple[float, ...]]]] = {}
    for n, r in enumerate(records, start=1):
        if isinstance(r, ReadDone):
            nbytes[r.layer] = max(nbytes.get(r.layer, 0), r.nbytes)
        if isinstance(r, Candidates):
            if (r.layer not in moe or r.target not in moe or r.width < 1 or len(r.token_experts) % r.width
                    or len(r.token_scores) != len(r.token_experts)
                    or not all(0 <= e < shape.num_experts for e in r.token_experts)):
                raise TraceSchemaError(f"{path}: record {n} (predict.candidates step {r.step}): layers "
                                       f"{r.layer}->{r.target}, width {r.width}, {len(r.token_experts)} experts and "
                                       f"{len(r.token_scores)} scores do not fit the model")
            cands.setdefault((r.step, r.layer), []).append((r.target, r.width, r.token_experts, r.token_scores))
        if not isinstance(r, Route):
            continue
        why = None
        if r.layer not in moe:
            why = f"layer {r.layer} is not a MoE layer of the log's model {sorted(moe)}"
        elif r.top_k != shape.top_k or not r.experts or len(r.experts) % r.top_k:
            why = f"{len(r.experts)} experts at top_k={r.top_k} do not fit the model's top_k={shape.top_k}"
        elif not all(0 <= e < shape.num_experts for e in r.experts):
            why = f"an expert id outside 0..{shape.num_experts - 1}"
        if why is not None:
            raise TraceSchemaError(f"{path}: record {n} (trace.route step {r.step}): {why}")
        by_step.setdefault(r.step, []).append((r.layer, r.experts))
    if not by_step:
        raise TraceSchemaError(f"{path}: no trace.route records to replay")
    order = sorted(by_step)
    index = {s: i for i, s in enumerate(order)}
    return ReplayLog(shape=shape, steps=[by_step[s] for s in order], record_nbytes=nbytes,
                     candidates={(index[s], layer): c for (s, layer), c in cands.items() if s in index},
                     capacities={layer: c for layer, c in header.capacities.items() if layer in moe},
                     evict_policy=header.evict_policy if isinstance(header.evict_policy, str) else "")


def _shape(path: str | Path, header: Header) -> ModelShape:
    if header.model is None:
        raise TraceSchemaError(f"{path}: record 0 (header) has no model shape: nothing to replay against")
    return header.model


# A sweep replays one log at many settings in one worker process: its routes and each predictor's
# guesses are read and computed once there. Keyed by the file's identity, so a rewritten log is read again.
# The guesses' dict is the predictors' to fill (qnpipe.replay.predictors.Predictions lists, by their settings).
_LOADED: dict[tuple[str, int, int, int], tuple[ReplayLog, dict[tuple[Any, ...], Any]]] = {}


def cached_log(path: str | Path) -> tuple[ReplayLog, dict[tuple[Any, ...], Any]]:
    """`load_log(path)` and a dict kept with it for what is computed from it, both from the last call when
    `path` is the same unchanged regular file (one log at a time)."""
    try:
        st = os.stat(path)
    except OSError:
        return load_log(path), {}  # load_log says what is wrong with it
    if not stat.S_ISREG(st.st_mode):
        return load_log(path), {}
    key = (str(Path(path).resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _LOADED.get(key)
    if hit is None:
        loaded = (load_log(path), {})
        _LOADED.clear()  # one log at a time
        hit = _LOADED[key] = loaded
    return hit


__all__ = ["ReplayLog", "cached_log", "load_log"]
