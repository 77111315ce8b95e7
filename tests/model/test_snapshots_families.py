"""Prefix snapshots of every cache kind mlx-lm's MoE families make: a prefill on mlx-lm's own model,
a snapshot through a file, a fresh cache restored from it, then decode: the same bits as the live cache."""

from __future__ import annotations

import struct
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache

from qnpipe.errors import SnapshotError
from qnpipe.model import snapshots
from qnpipe.model.family import tiny
from qnpipe.model.family.registry import NO_SNAPSHOTS
from qnpipe.model.snapshot_kinds import LayerState, check_kind

FP = "f" * 64
# Longer than the tiny configs' windows (8) and llama4's attention chunk (16): rotating caches have
# wrapped and chunked ones trimmed their front by the time of the snapshot.
PROMPT = [(7 * i + 3) % 200 + 1 for i in range(21)]
SPANS = (13, 21)  # the prefill in two forwards: the second one goes through each cache's update of many tokens
DECODE = 4

_MODELS: dict[str, Any] = {}


def _model(family: str) -> Any:
    if family not in _MODELS:
        _MODELS[family] = tiny.build_random(tiny.tiny_config(family))
    return _MODELS[family]


def _prefill(model: Any) -> list[Any]:
    cache = make_prompt_cache(model)
    start = 0
    for end in SPANS:
        mx.eval(model(mx.array([PROMPT[start:end]]), cache=cache))
        start = end
    return cache


def _decode(model: Any, cache: list[Any]) -> list[Any]:
    out, tok = [], 5
    for _ in range(DECODE):
        logits = model(mx.array([[tok]]), cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
        tok = int(mx.argmax(logits, axis=-1).tolist()[0])  # type: ignore[index]
    return out


def _kinds(cache: list[Any]) -> set[str]:
    def kind(c: Any) -> str:
        return "CacheList" if isinstance(c, CacheList) else type(c).__name__

    return {kind(c) for c in cache} | {type(s).__name__ for c in cache if isinstance(c, CacheList) for s in c.caches}


@pytest.mark.parametrize("family", sorted(set(tiny.CONFIGS) - set(NO_SNAPSHOTS)))
def test_snapshot_through_a_file_decodes_the_same_bits(family: str, tmp_path: Any) -> None:
    model = _model(family)
    live = _prefill(model)
    snap = snapshots.capture(live, len(PROMPT))
    key = snapshots.token_key(PROMPT)
    path = tmp_path / "s.qnsnap"
    snapshots.save(path, snap, key, FP)
    restored = snapshots.restore(snapshots.load(path, key, FP))
    assert [type(c) for c in restored] == [type(c) for c in live]
    again = snapshots.restore(snap)  # from memory too, after the file's copy was used
    want = _decode(model, live)
    for got in (_decode(model, restored), _decode(model, again)):
        for w, g in zip(want, got, strict=True):
            assert mx.array_equal(w, g).item(), family
    # Negative control: a fresh cache does not decode the same (the state is what carries the prompt).
    fresh = _decode(model, make_prompt_cache(model))
    assert not mx.array_equal(want[0], fresh[0]).item()


@pytest.mark.parametrize("family", sorted(NO_SNAPSHOTS))
def test_a_family_with_no_snapshot_kind_is_refused_naming_its_cache(family: str) -> None:
    model = _model(family)
    with pytest.raises(SnapshotError, match=r"cannot snapshot a cache of type \w+"):
        snapshots.capture(_prefill(model), len(PROMPT))


def test_the_tiny_families_cover_every_cache_kind() -> None:
    seen: set[str] = set()
    for family in tiny.CONFIGS:
        seen |= _kinds(make_prompt_cache(_model(family)))
    assert {"KVCache", "RotatingKVCache", "ChunkedKVCache", "ArraysCache", "CacheList"} <= seen


def _filled(kind: str) -> Any:
    """A cache of `kind` after 21 tokens (one update of 13, then one at a time)."""
    k = mx.random.normal((1, 2, 21, 8))
    v = mx.random.normal((1, 2, 21, 8))

    def fill(c: Any) -> Any:
        c.update_and_fetch(k[..., :13, :], v[..., :13, :])
        for t in range(13, 21):
            c.update_and_fetch(k[..., t:t + 1, :], v[..., t:t + 1, :])
        return c

    if kind == "kv":
        return fill(KVCache())
    if kind == "rotating":
        return fill(RotatingKVCache(max_size=8, keep=2))
    if kind == "chunked":
        c = fill(ChunkedKVCache(16))
        c.maybe_trim_front()
        return c
    if kind == "arrays":
        a = ArraysCache(size=2)
        a.cache = [mx.random.normal((1, 3, 24)), mx.random.normal((1, 4, 8, 16))]
        return a
    if kind == "list":
        return CacheList(fill(KVCache()), fill(RotatingKVCache(max_size=8)))
    raise AssertionError(kind)


def _state_of(c: Any) -> list[Any]:
    """Everything a cache holds, arrays as lists: what must come back."""
    if isinstance(c, CacheList):
        return [_state_of(s) for s in c.caches]
    if isinstance(c, KVCache):
        k, v = c.keys_and_values() if c.keys is not None else (None, None)
        return [None if k is None else k.tolist(), None if v is None else v.tolist(), c.offset]
    return [x.tolist() if isinstance(x, mx.array) else [y.tolist() for y in x] if isinstance(x, list)
            else x for x in c.state]


@pytest.mark.parametrize("kind", ["kv", "rotating", "chunked", "arrays", "list"])
def test_round_trip_per_cache_kind(kind: str, tmp_path: Any) -> None:
    mx.random.seed(3)
    c = _filled(kind)
    snap = snapshots.capture([c, None], 21)
    assert snap.layers[0].kind.partition(":")[0] == kind and snap.layers[1].kind == snapshots.REMOTE
    snapshots.save(tmp_path / "k.qnsnap", snap, "k", FP)
    back, gone = snapshots.restore(snapshots.load(tmp_path / "k.qnsnap", "k", FP))
    assert gone is None and type(back) is type(c)
    assert _state_of(back) == _state_of(c)
    # Both take the next token the same way (the rotating one writes into its buffer at _idx).
    k1, v1 = mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8))
    if kind != "arrays":
        for cache in (c, back):
            (cache.caches[1] if kind == "list" else cache).update_and_fetch(k1, v1)
        assert _state_of(back) == _state_of(c)


def test_empty_caches_round_trip() -> None:
    """A layer whose cache never filled (hunyuan's CLA layers read the one before)."""
    snap = snapshots.capture([KVCache(), RotatingKVCache(max_size=8, keep=1), ChunkedKVCache(16)], 0)
    kv, rot, chunk = snapshots.restore(snap)
    assert kv.keys is None and rot.keys is None and chunk.keys is None
    assert (rot.max_size, rot.keep, chunk.chunk_size) == (8, 1, 16)


def test_an_unknown_cache_type_is_refused_by_name() -> None:
    class Mine(KVCache):
        pass

    with pytest.raises(SnapshotError, match="layer 0: cannot snapshot a cache of type"):
        snapshots.capture([RotatingKVCache.__new__(type("Sub", (RotatingKVCache,), {}))], 0)
    snapshots.capture([Mine()], 0)  # a KVCache subclass is a KV cache (qnpipe's StepCache is an ArraysCache)


BAD_KINDS = [
    ("os.system", 0, "unknown cache kind"),
    ("RotatingKVCache", 2, "unknown cache kind"),
    ("rotating:1:2", 2, "3 non-negative integer"),
    ("rotating:0:0:0", 2, "a window of no tokens"),
    ("rotating:-1:8:0", 2, "non-negative integer"),
    ("chunked:0:0", 2, "chunks of no tokens"),
    ("kv", 3, "with 3 arrays"),
    ("kv:1", 2, "takes no parameters"),
    ("arrays", 0, "no arrays"),
    ("list:[[\"kv\",1,2]]", 1, "lists 2 arrays"),
    ("list:nope", 0, "not a list of caches"),
    ("list:[[\"list:[]\",0,0]]", 0, "not a list of"),
    ("list:[[\"evil\",0,0]]", 0, "unknown cache kind"),
]


@pytest.mark.parametrize(("kind", "n", "why"), BAD_KINDS)
def test_a_file_with_a_bad_kind_is_an_error_naming_it(kind: str, n: int, why: str, tmp_path: Any) -> None:
    assert check_kind(kind, n) is not None
    layer = LayerState(kind, tuple(mx.zeros((1, 2, 3, 4)) for _ in range(n)), 3)
    path = tmp_path / "bad.qnsnap"
    snapshots.save(path, snapshots.Snapshot(3, (layer,)), "k", FP)
    with pytest.raises(SnapshotError, match=f"{path}: layer 0: .*{why}"):
        snapshots.load(path, "k", FP)
    with pytest.raises(SnapshotError, match=why):  # and from memory
        snapshots.restore(snapshots.Snapshot(3, (layer,)))


def test_a_corrupt_file_is_an_error_naming_it(tmp_path: Any) -> None:
    path = tmp_path / "c.qnsnap"
    snapshots.save(path, snapshots.capture([_filled("rotating")], 21), "k", FP)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=f"{path}: crc32 mismatch"):
        snapshots.load(path, "k", FP)
    path.write_bytes(snapshots.MAGIC + struct.pack("<Q", 4) + b"\xff\xff\xff\xff")
    with pytest.raises(SnapshotError, match=f"{path}: corrupt header"):
        snapshots.load(path, "k", FP)
