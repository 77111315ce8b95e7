"""One layer's cache as snapshot data, and back: a kind name, its arrays and its token offset.

Every cache kind mlx-lm's models make (`make_prompt_cache`) has a kind here:

| kind | mlx-lm class | arrays | parameters in the kind |
|---|---|---|---|
| `kv` | `KVCache` (MLA latent caches too) | keys, values up to the offset (none: empty) | |
| `arrays` | `ArraysCache` (Gated DeltaNet, Mamba, short conv) | each state | |
| `rotating:<keep>:<max_size>:<idx>` | `RotatingKVCache` | the whole key and value buffers (none: empty) | `keep`, `max_size`, `_idx` |
| `chunked:<chunk_size>:<start>` | `ChunkedKVCache` | keys, values from the chunk's start (none: empty) | `chunk_size`, `start_position` |
| `list:<json>` | `CacheList` | its caches' arrays, one after the other | `[[kind, offset, number of arrays], ...]` |
| `remote` | (None: a layer another rank runs) | none | |

plus the kinds registered by other modules (`register_kind`: the quantized KV cache, `qkv:...`).
The rotating and chunked kinds go through mlx-lm's own `state` / `from_state`, as
`mlx_lm.models.cache.save_prompt_cache` does, with one difference: the class comes from the
fixed table above, never from a name in the file, and every parameter is checked
(`check_kind`) before a cache is built. A rotating cache keeps its whole buffer, in its own
order: attention sums over the keys in buffer order, so a buffer put in temporal order would
not give the same bits.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache

from qnpipe.errors import SnapshotError

REMOTE = "remote"  # the kind of a layer another rank runs (pipeline parallel): no arrays, its cache is None
MAX_LIST = 64  # caches in one CacheList (longcat_flash has two)


class LayerState(msgspec.Struct, frozen=True):
    """One layer's cache: its `kind`, arrays (evaluated, not shared with a live cache) and token offset."""

    kind: str
    arrays: tuple[Any, ...]  # mx.array each
    offset: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@runtime_checkable
class SnapshotState(Protocol):
    """A cache kind other than mlx-lm's that can be snapshotted."""

    def snapshot(self) -> LayerState: ...

    @classmethod
    def restore(cls, state: LayerState) -> Any: ...


# Cache kinds restored by a class of another module (the quantized KV cache registers itself).
_RESTORERS: dict[str, type[SnapshotState]] = {}


def register_kind(kind: str, cls: type[SnapshotState]) -> None:
    """Make `restore` rebuild layers of `kind` with `cls.restore`."""
    _RESTORERS[kind] = cls


def layer_state(c: Any, i: int, n_tokens: int) -> LayerState:
    """The state of layer `i`'s cache `c` (not yet evaluated); SnapshotError for a cache of no kind."""
    if c is None:  # a layer another rank runs (pipeline parallel): its state is that rank's
        return LayerState(REMOTE, (), n_tokens)
    if isinstance(c, KVCache):
        if c.keys is None or c.values is None:  # a layer that reads another's cache (hunyuan's CLA)
            return LayerState("kv", (), 0)
        off = c.offset
        # Slices, not the buffers: the live cache keeps writing into its buffers.
        return LayerState("kv", (c.keys[..., :off, :], c.values[..., :off, :]), off)
    if isinstance(c, ArraysCache):  # qnpipe's StepCache too: its state is its base's
        arrays = [a for a in c.cache if a is not None]
        if len(arrays) != len(c.cache) or c.lengths is not None or c.left_padding is not None:
            raise SnapshotError(f"layer {i}: the linear-attention cache is not a plain single-sequence state")
        return LayerState("arrays", tuple(mx.array(a) for a in arrays), n_tokens)
    # Exact types from here: a subclass may hold more than its base's state.
    if type(c) is RotatingKVCache:
        keys, values, offset, keep, max_size, idx = _state(c, 6, i)
        arrays = () if keys is None else (mx.array(keys), mx.array(values))
        return LayerState(f"rotating:{keep}:{max_size}:{idx}", arrays, offset)
    if type(c) is ChunkedKVCache:
        keys, values, offset, chunk, start = _state(c, 5, i)
        end = offset - start
        arrays = () if keys is None else (keys[..., :end, :], values[..., :end, :])
        return LayerState(f"chunked:{chunk}:{start}", arrays, offset)
    if type(c) is CacheList:
        subs = [layer_state(s, i, n_tokens) for s in c.caches]
        if any(s.kind.startswith("list:") for s in subs):
            raise SnapshotError(f"layer {i}: a CacheList inside a CacheList")
        spec = json.dumps([[s.kind, s.offset, len(s.arrays)] for s in subs], separators=(",", ":"))
        return LayerState(f"list:{spec}", tuple(a for s in subs for a in s.arrays), n_tokens)
    if isinstance(c, SnapshotState):
        return c.snapshot()
    raise SnapshotError(f"layer {i}: cannot snapshot a cache of type {type(c).__name__}")


def _state(c: Any, n: int, i: int) -> tuple[Any, ...]:
    st = tuple(c.state)
    if len(st) != n:  # another mlx-lm whose state holds other fields: refused, not misread
        raise SnapshotError(f"layer {i}: {type(c).__name__}.state has {len(st)} fields, this qnpipe knows {n}")
    return st


def layer_cache(s: LayerState) -> Any:
    """A fresh cache in the state `s` (checked by `check_kind`: nothing shared to write into)."""
    why = check_kind(s.kind, len(s.arrays))
    if why:
        raise SnapshotError(why)
    a = [mx.array(x) for x in s.arrays]
    head, _, rest = s.kind.partition(":")
    if head == REMOTE:
        return None
    if head == "kv":
        c = KVCache()
        if a:  # exactly `offset` long: the next update grows it into a new buffer
            c.keys, c.values = a
            c.offset = s.offset
        return c
    if head == "arrays":
        arrays = ArraysCache(size=len(a))
        arrays.cache = a
        return arrays
    if head == "rotating":
        keep, max_size, idx = (int(x) for x in rest.split(":"))
        if not a:
            return RotatingKVCache(max_size=max_size, keep=keep)
        return RotatingKVCache.from_state((a[0], a[1], s.offset, keep, max_size, idx))
    if head == "chunked":
        chunk, start = (int(x) for x in rest.split(":"))
        if not a:
            return ChunkedKVCache(chunk)
        return ChunkedKVCache.from_state((a[0], a[1], s.offset, chunk, start))
    if head == "list":
        subs, pos = [], 0
        for kind, offset, n in json.loads(rest):
            subs.append(layer_cache(LayerState(kind, tuple(a[pos:pos + n]), offset)))
            pos += n
        return CacheList(*subs)
    return _RESTORERS[head].restore(LayerState(s.kind, tuple(a), s.offset))


def check_kind(kind: str, n_arrays: int, *, in_list: bool = False) -> str | None:
    """Why a layer of `kind` holding `n_arrays` arrays is not one `layer_cache` can rebuild (None: it is)."""
    head, _, rest = kind.partition(":")
    if head in _RESTORERS:
        return None
    if head in (REMOTE, "kv", "arrays") and rest:
        return f"cache kind {kind!r} takes no parameters"
    if head == REMOTE:
        return None if n_arrays == 0 else f"cache kind {kind!r} with {n_arrays} arrays"
    if head == "arrays":
        return None if n_arrays >= 1 else f"cache kind {kind!r} with no arrays"
    if head in ("kv", "rotating", "chunked"):
        want = {"kv": 0, "rotating": 3, "chunked": 2}[head]
        params = rest.split(":") if rest else []
        if len(params) != want or not all(p.isdigit() and len(p) < 19 for p in params):
            return f"cache kind {kind!r}: expected {want} non-negative integer parameters"
        if head == "rotating" and int(params[1]) < 1:
            return f"cache kind {kind!r}: a window of no tokens"
        if head == "chunked" and int(params[0]) < 1:
            return f"cache kind {kind!r}: chunks of no tokens"
        return None if n_arrays in (0, 2) else f"cache kind {kind!r} with {n_arrays} arrays (keys and values)"
    if head == "list" and not in_list:
        try:
            spec = json.loads(rest)
        except ValueError:
            return f"cache kind {kind[:80]!r}: not a list of caches"
        if (not isinstance(spec, list) or not 1 <= len(spec) <= MAX_LIST
                or not all(_sub_ok(x) for x in spec)):
            return f"cache kind {kind[:80]!r}: not a list of [kind, offset, arrays]"
        for sub_kind, _, n in spec:
            if why := check_kind(sub_kind, n, in_list=True):
                return why
        total = sum(x[2] for x in spec)
        return None if total == n_arrays else f"cache kind {kind[:80]!r} lists {total} arrays, the layer has {n_arrays}"
    return f"unknown cache kind {kind[:80]!r}"


def _sub_ok(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 3 and isinstance(x[0], str) and not x[0].startswith("list")
            and all(type(v) is int and v >= 0 for v in x[1:]))


__all__ = ["REMOTE", "LayerState", "SnapshotState", "check_kind", "layer_cache", "layer_state", "register_kind"]
