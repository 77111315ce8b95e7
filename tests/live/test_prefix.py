"""Issue 13, prefix snapshots: a resumed prompt computes bit for bit what a full prefill does.

The trained tiny model (every expert resident; tests/pool/test_prefix_streaming.py streams
them). Heads of 16 tokens, prompts of 40-70: the same code paths as 2,048-token heads.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import qnpipe
from qnpipe.cli.common import DEMO_MODEL_DIR
from qnpipe.live.prefix import SUFFIX, SnapshotFileWarning, boundaries
from qnpipe.model.snapshots import token_key

HEAD = 16
# The chunk these scaled-down prompts prefill at (the default, 2048, is longer than any of them): with
# 2 the turn state lands within 2 tokens of a prompt's end, as at a chunk of 2048 it lands within
# 2048 of a long conversation's (docs/chat.md).
CHUNK = 2


@pytest.fixture(scope="module", autouse=True)
def _chunk() -> Iterator[None]:
    """Every engine of this module, the writer's child process too, prefills in chunks of `CHUNK`
    unless a test says otherwise."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QNPIPE_FORWARD__PREFILL_CHUNK_TOKENS", str(CHUNK))
        yield
SYSTEM = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Entry point.\"\"\"\n"
TAILS = ["    return len(argv)\n\n\nif __name__ == '__main__':", "    for a in argv:\n        print(a)\n"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from qnpipe.chat.tokenizer import encode, load_tokenizer

    tok = load_tokenizer(DEMO_MODEL_DIR)
    out = [encode(tok, SYSTEM + t) for t in TAILS]
    assert len(out[0]) > HEAD + 8 and out[0][:HEAD] == out[1][:HEAD] and out[0] != out[1]
    return out


@pytest.fixture(scope="module")
def reference(prompts: list[list[int]]) -> dict[str, object]:
    """Without snapshots: next-token logits and 24 greedy tokens of each prompt."""
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=0) as eng:
        return {"logits": [eng.next_logits(p) for p in prompts],
                "tokens": [eng.generate(p, max_tokens=24, stop_at_eos=False).tokens for p in prompts]}


def test_boundaries() -> None:
    assert boundaries(10, 4, 6) == [4, 6, 8, 10]
    assert boundaries(6, 4, 6) == [4, 6]  # a prompt not longer than the head: no head boundary
    assert boundaries(10, 0, 6) == [6, 10] and boundaries(10, 0, 0) == [10]
    # The boundaries below n do not depend on n: a longer prompt passes through the same ones.
    assert set(boundaries(9, 4, 6)[:-1]) <= set(boundaries(30, 4, 6))


@pytest.mark.slow
def test_resume_equals_full_prefill(prompts: list[list[int]], reference: dict[str, object]) -> None:
    ref_logits, ref_tokens = reference["logits"], reference["tokens"]
    assert isinstance(ref_logits, list) and isinstance(ref_tokens, list)
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, max_entries=4) as eng:
        first = eng.next_logits(prompts[0])  # prefilled, head and turn snapshots taken
        assert eng.stats().prefix.captures == 2  # type: ignore[union-attr]
        again = eng.next_logits(prompts[0])  # resumed from its own turn snapshot
        other = eng.next_logits(prompts[1])  # resumed from the shared head
        res = [eng.generate(p, max_tokens=24, stop_at_eos=False) for p in prompts]
        st = eng.stats().prefix
    assert np.array_equal(first, ref_logits[0]) and np.array_equal(again, ref_logits[0])
    assert np.array_equal(other, ref_logits[1])
    assert [r.tokens for r in res] == ref_tokens
    assert res[1].stats.prefix_tokens_reused >= HEAD
    assert st is not None and st.misses == 1 and st.hits == 4 and st.entries <= 4 and st.bytes > 0


def test_multi_turn_resumes_the_previous_turn(prompts: list[list[int]]) -> None:
    turn1 = prompts[0]
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=0) as eng:
        answer = list(eng.generate(turn1, max_tokens=12, stop_at_eos=False).tokens)
        turn2 = turn1 + answer + prompts[1][HEAD:HEAD + 8]
        ref = eng.next_logits(turn2)
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD) as eng:
        eng.generate(turn1, max_tokens=12, stop_at_eos=False)
        got = eng.generate(turn2, max_tokens=1)
        assert got.stats.prefix_tokens_reused >= len(turn1) - 2  # the turn state, not just the head
        assert np.array_equal(eng.next_logits(turn2), ref)


@pytest.mark.parametrize("chunk", [0, 3])
def test_resume_equals_first_prefill_at_any_chunk(prompts: list[list[int]], chunk: int) -> None:
    """Chunk 0 or one that does not divide the head: the prefill splits at the head, resumed or not."""
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, prefill_chunk_tokens=chunk) as eng:
        first = [eng.next_logits(p) for p in prompts]
        eng_stats = eng.stats().prefix
        assert eng_stats is not None and eng_stats.hits == 1
        assert all(np.array_equal(a, eng.next_logits(p)) for a, p in zip(first, prompts, strict=True))


def test_a_prompt_not_longer_than_the_head_never_snapshots(prompts: list[list[int]]) -> None:
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=len(prompts[0])) as eng:
        eng.generate(prompts[0], max_tokens=4)
        eng.generate(prompts[0][:HEAD], max_tokens=4)
        st = eng.stats().prefix
    assert st is not None and st.captures == 0 and st.entries == 0 and st.hits == 0


def test_lru_evicts_and_reloads_from_disk(prompts: list[list[int]], reference: dict[str, object],
                                          tmp_path: Path) -> None:
    ref = reference["logits"]
    assert isinstance(ref, list)
    a, b = prompts[0], [*prompts[1][1:]]  # b's head differs from a's
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, max_entries=1, snapshot_dir=str(tmp_path)) as eng:
        first = [eng.next_logits(p) for p in (a, b)]
        again = eng.next_logits(a)  # a's states were evicted by b's: its head comes back from its file
        st = eng.stats().prefix
    assert st is not None and st.evictions >= 2 and st.disk_loads == 1 and st.disk_writes == 2
    assert np.array_equal(first[0], ref[0]) and np.array_equal(again, ref[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(token_key(p[:HEAD]) + SUFFIX for p in (a, b))
    # Without the directory the evicted head is prefilled again, to the same logits.
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, max_entries=1) as eng:
        assert [np.array_equal(eng.next_logits(p), x) for p, x in ((a, ref[0]), (b, first[1]), (a, ref[0]))] == \
            [True] * 3
        st = eng.stats().prefix
    assert st is not None and st.hits == 0 and st.disk_loads == 0


WRITER = """
import sys, qnpipe
from qnpipe.cli.common import DEMO_MODEL_DIR
ids = [int(t) for t in sys.argv[2].split(",")]
with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=%d, snapshot_dir=sys.argv[1]) as eng:
    eng.generate(ids, max_tokens=1)
    assert eng.stats().prefix.disk_writes == 1
"""


@pytest.mark.slow
def test_another_process_resumes_from_the_directory(prompts: list[list[int]], reference: dict[str, object],
                                                    tmp_path: Path) -> None:
    ref = reference["tokens"]
    assert isinstance(ref, list)
    subprocess.run([sys.executable, "-c", WRITER % HEAD, str(tmp_path), ",".join(map(str, prompts[0]))],
                   check=True, timeout=120)
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path)) as eng:
        res = eng.generate(prompts[1], max_tokens=24, stop_at_eos=False)
        st = eng.stats().prefix
    assert st is not None and st.disk_loads == 1 and st.captures == 1  # the head came from the file
    assert res.tokens == ref[1] and res.stats.prefix_tokens_reused == HEAD


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-5] ^= 0xFF
    elif how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[:4] = b"JUNK"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "magic"])
def test_a_corrupt_file_is_ignored_with_one_warning(prompts: list[list[int]], reference: dict[str, object],
                                                    tmp_path: Path, how: str) -> None:
    ref = reference["logits"]
    assert isinstance(ref, list)
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path)) as eng:
        eng.next_logits(prompts[0])
    (path,) = tmp_path.iterdir()
    _corrupt(path, how)
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path), max_entries=1) as eng:
        with pytest.warns(SnapshotFileWarning, match=str(path)) as rec:
            got = eng.next_logits(prompts[0])
        assert len(rec) == 1
        st = eng.stats().prefix
    assert st is not None and st.ignored_files == 1 and st.disk_writes == 1  # replaced by a good one
    assert np.array_equal(got, ref[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path)) as eng:
            assert np.array_equal(eng.next_logits(prompts[1]), ref[1])
            assert eng.stats().prefix.disk_loads == 1  # type: ignore[union-attr]


def test_a_file_of_another_model_is_ignored(prompts: list[list[int]], tmp_path: Path) -> None:
    from qnpipe.convert.tiny import make_tiny

    other = make_tiny(tmp_path / "other", layout="hf", seed=5, config_overrides={"vocab_size": 4096})
    snaps = tmp_path / "snaps"
    with qnpipe.Engine(other, snapshot_head_tokens=HEAD, snapshot_dir=str(snaps)) as eng:
        eng.next_logits(prompts[0])
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(snaps)) as eng:
        with pytest.warns(SnapshotFileWarning, match="another model"):
            eng.next_logits(prompts[0])
        assert eng.stats().prefix.disk_loads == 0  # type: ignore[union-attr]


def test_an_unwritable_directory_warns_once_and_the_answer_comes(prompts: list[list[int]], tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(blocker / "snaps")) as eng:
        with pytest.warns(SnapshotFileWarning, match="not written") as rec:
            a = eng.generate(prompts[0], max_tokens=4)
            b = eng.generate(prompts[1][1:], max_tokens=4)
        assert len(rec) == 1 and a.tokens and b.tokens
        st = eng.stats().prefix
    assert st is not None and st.disk_writes == 0 and st.captures == 4


def test_a_state_that_cannot_be_captured_turns_snapshots_off_with_a_warning(
        prompts: list[list[int]], reference: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache kind capture does not know (one a later feature adds) costs the snapshots, never the answer."""
    from qnpipe.errors import SnapshotError
    from qnpipe.model import snapshots

    ref = reference["tokens"]
    assert isinstance(ref, list)

    def refuse(cache: object, n: int, next_token: int = -1) -> None:
        raise SnapshotError("layer 8: cannot snapshot a cache of type MTPCache")

    monkeypatch.setattr(snapshots, "capture", refuse)
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD) as eng:
        with pytest.warns(SnapshotFileWarning, match="turned off .* cannot snapshot a cache of type MTPCache"):
            got = eng.generate(prompts[0], max_tokens=24, stop_at_eos=False)
        again = eng.generate(prompts[0], max_tokens=24, stop_at_eos=False)
        assert eng.stats().prefix is None  # off
    assert got.tokens == again.tokens == ref[0]


def test_a_file_made_with_another_prefill_chunk_is_ignored(prompts: list[list[int]], tmp_path: Path) -> None:
    """Another chunk computes the head's state in other steps: not the same bits, so not reused."""
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path)) as eng:
        eng.next_logits(prompts[0])
    with qnpipe.Engine(DEMO_MODEL_DIR, snapshot_head_tokens=HEAD, snapshot_dir=str(tmp_path),
                       prefill_chunk_tokens=4) as eng:
        with pytest.warns(SnapshotFileWarning, match="forward"):
            eng.next_logits(prompts[0])


def _reverse_experts(experts_dir: Path) -> None:
    """Rewrite a store in place with every layer's records in reverse order (and their crc32s with them):
    a valid store of other experts under the same dense weights (an expert-only fine-tune), named by its
    model's config.json as `qnpipe convert` names the store it writes."""
    import hashlib
    import json

    import msgspec

    from qnpipe.io.store import read_index, write_index

    root, index = read_index(experts_dir)
    layers = []
    for lf in index.layers:
        path = root / lf.file
        data = path.read_bytes()
        records = [data[e * lf.stride:(e + 1) * lf.stride].ljust(lf.stride, b"\0") for e in range(lf.num_experts)]
        path.write_bytes(b"".join(reversed(records))[:lf.file_nbytes])
        layers.append(msgspec.structs.replace(lf, checksums=tuple(reversed(lf.checksums))))
    written = write_index(root, msgspec.structs.replace(index, layers=tuple(layers)))
    config_path = experts_dir.parent / "config.json"
    config = json.loads(config_path.read_text())
    config["qnpipe"]["experts"]["index_sha256"] = hashlib.sha256(written.read_bytes()).hexdigest()
    config_path.write_text(json.dumps(config, indent=1))


@pytest.mark.slow
def test_a_store_of_other_experts_does_not_resume_the_first_ones_head(prompts: list[list[int]],
                                                                     tmp_path: Path) -> None:
    """Issue 22 item 3: same dense weights, other experts: the head state of one is not the other's."""
    import shutil

    from qnpipe.convert import convert
    from qnpipe.convert.verify import verify_store

    first, second, snaps = tmp_path / "first", tmp_path / "second", tmp_path / "snaps"
    convert(DEMO_MODEL_DIR, first)
    shutil.copytree(first, second)
    _reverse_experts(second / "experts")
    assert verify_store(second).ok  # a good store, just not the first one's
    with qnpipe.Engine(second, snapshot_head_tokens=0) as eng:
        want = eng.generate(prompts[0], max_tokens=24, stop_at_eos=False).tokens
    with qnpipe.Engine(first, snapshot_head_tokens=HEAD, snapshot_dir=str(snaps)) as eng:
        theirs = eng.generate(prompts[0], max_tokens=24, stop_at_eos=False).tokens
        assert eng.stats().prefix.disk_writes == 1  # type: ignore[union-attr]
    assert theirs != want  # the experts change the numbers
    with qnpipe.Engine(second, snapshot_head_tokens=HEAD, snapshot_dir=str(snaps)) as eng:
        with pytest.warns(SnapshotFileWarning, match="another model"):
            got = eng.generate(prompts[0], max_tokens=24, stop_at_eos=False)
        st = eng.stats().prefix
    assert st is not None and st.disk_loads == 0 and got.stats.prefix_tokens_reused == 0
    assert got.tokens == want
