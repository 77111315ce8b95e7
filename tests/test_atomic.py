"""qnpipe.atomic: a file appears whole or not at all; an error mid-write leaves the old one and no temp file."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.atomic import atomic_file, atomic_write


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    atomic_write(p, b"one")
    atomic_write(p, b"two", fsync_dir=True)
    assert p.read_bytes() == b"two"
    assert [q.name for q in tmp_path.iterdir()] == ["f.json"]


def test_an_error_mid_write_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt), atomic_file(p) as f:
        f.write(b"half of the new")
        assert p.read_bytes() == b"old"  # nothing visible before the block ends
        raise KeyboardInterrupt
    assert p.read_bytes() == b"old"
    assert [q.name for q in tmp_path.iterdir()] == ["f.bin"]


def test_a_missing_directory_is_an_os_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as e:
        atomic_write(tmp_path / "no" / "f", b"x")
    assert str(tmp_path / "no") in str(e.value)
