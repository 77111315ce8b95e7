"""`qnpipe convert OWNER/NAME`: a source named by its Hugging Face repository id, fetched through the real
`huggingface_hub` code from a hub cache built here (no network: HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

from qnpipe.convert.hub import CONVERT_FILES, hub_id
from tests.cli_harness import run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "qnpipe-test/tiny-qwen3-next"


def _hub_cache(root: Path, src: Path, *, missing: tuple[str, ...] = (), extra: dict[str, int] | None = None) -> Path:
    """A hub cache (the layout huggingface_hub writes: blobs, refs, snapshots, the tree listing) holding
    `src`'s files as REPO at COMMIT, less `missing`; `extra` lists files the Hub has and the cache has not."""
    store = root / ("models--" + REPO.replace("/", "--"))
    (store / "refs").mkdir(parents=True)
    (store / "refs" / "main").write_text(COMMIT)
    snap = store / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (store / "blobs").mkdir()
    entries = {}
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        entries[f.name] = TreeCacheEntry(size=len(data), blob_id=hashlib.sha1(data).hexdigest(),
                                         lfs_sha256=sha, lfs_size=len(data))
        if f.name in missing:
            continue
        shutil.copyfile(f, store / "blobs" / sha)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", sha))
    for name, size in (extra or {}).items():
        entries[name] = TreeCacheEntry(size=size, blob_id="0" * 40, lfs_sha256="0" * 64, lfs_size=size)
    write_tree_cache(str(store), COMMIT, entries)
    return root


def _env(cache: Path) -> tuple[tuple[str, str], ...]:
    return (("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", str(cache)), ("HF_HOME", str(cache.parent / "hf-home")))


@pytest.mark.slow
def test_convert_by_repository_id_from_the_hub_cache(tmp_path: Path, tiny_hf: Path) -> None:
    # The Hub also has a file convert does not read: offline, its absence from the cache is no error.
    cache = _hub_cache(tmp_path / "hub", tiny_hf, extra={"original/consolidated.pth": 1 << 30})
    out = tmp_path / "qn"
    r = run_cli(["convert", REPO, "--out", out, "--json"], env=_env(cache), timeout=120)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    report = json.loads(r.stdout)
    assert report["moe_layers"] > 0 and (out / "experts" / "index.json").is_file()
    # the same bytes as a convert of the directory itself
    ref = tmp_path / "ref"
    assert run_cli(["convert", tiny_hf, "--out", ref, "-q"], timeout=120).returncode == 0
    for f in sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file()):
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f


@pytest.mark.parametrize(("case", "needles"), [
    ("not cached", ("not in the hub cache", "HF_HUB_OFFLINE is set")),
    ("partly cached", ("holds only part of it", "model.safetensors")),
])
def test_a_repository_the_cache_cannot_give_is_named_before_any_work(tmp_path: Path, tiny_hf: Path, case: str,
                                                                      needles: tuple[str, ...]) -> None:
    if case == "partly cached":
        cache = _hub_cache(tmp_path / "hub", tiny_hf, missing=("model.safetensors",))
    else:
        cache = tmp_path / "hub"
        cache.mkdir()
    out = tmp_path / "qn"
    r = run_cli(["convert", REPO, "--out", out], env=_env(cache), timeout=60)
    err = r.stderr.decode()
    assert r.returncode != 0 and "Traceback" not in err, err
    assert f"SRC {REPO}" in err and all(n in err for n in needles), err
    assert not out.exists() and not any(p.name.startswith("qn") for p in tmp_path.iterdir())


def test_what_is_a_repository_id(tmp_path: Path) -> None:
    assert hub_id("Qwen/Qwen3-Next-80B-A3B-Instruct") == ("Qwen/Qwen3-Next-80B-A3B-Instruct", None)
    assert hub_id("Qwen/Qwen3-Next-80B-A3B-Instruct@v1.0") == ("Qwen/Qwen3-Next-80B-A3B-Instruct", "v1.0")
    for local in ("./a/b", "/a/b", "~/a/b", "tiny", "a/b/c", "a/../b"):
        assert hub_id(local) is None, local
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b").mkdir()
    assert hub_id(tmp_path / "a" / "b") is None  # an existing directory is never a repository


def test_only_the_files_convert_reads_are_fetched() -> None:
    from huggingface_hub.utils import filter_repo_objects

    listing = ["config.json", "model-00001-of-00041.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json",
               "chat_template.jinja", "README.md", "original/consolidated.pth", ".gitattributes", "LICENSE"]
    kept = set(filter_repo_objects(listing, allow_patterns=list(CONVERT_FILES)))
    assert kept == set(listing) - {"README.md", "original/consolidated.pth", ".gitattributes", "LICENSE"}


def test_the_output_is_checked_before_any_download(tmp_path: Path) -> None:
    from qnpipe.convert import convert
    from qnpipe.errors import OutputError

    taken = tmp_path / "mine"
    taken.mkdir()
    (taken / "notes.txt").write_text("not qnpipe's")
    with pytest.raises(OutputError, match="--out .*mine"):
        convert(REPO, taken, force=True)  # refused here: the Hub is never asked
    assert (taken / "notes.txt").read_text() == "not qnpipe's"
