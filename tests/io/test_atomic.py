"""qnpipe.io.atomic: a file appears whole or not at all; an error mid-write leaves the old one and no temp file."""

from __future__ import annotations

from pathlib import Path

import pytest

from qnpipe.io.atomic import atomic_file, atomic_write


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


def test_a_new_file_gets_the_umask_mode_and_a_replaced_file_keeps_its_mode(tmp_path: Path) -> None:
    import os
    import stat

    from qnpipe.io.atomic import UMASK

    old = os.umask(0o022)
    os.umask(old)
    assert old == UMASK  # read once at import, without a window where the umask is changed
    p = tmp_path / "shared.json"
    atomic_write(p, b"{}")
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~UMASK  # not mkstemp's 0600
    os.chmod(p, 0o640)
    atomic_write(p, b"{} ")
    assert stat.S_IMODE(p.stat().st_mode) == 0o640


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_a_new_file_follows_the_umask_of_the_moment_it_is_written(tmp_path: Path, umask: int) -> None:
    import os
    import stat

    old = os.umask(umask)  # set after qnpipe.io.atomic was imported, as a notebook or a caller may
    try:
        atomic_write(tmp_path / "out.csv", b"a,b\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.csv").stat().st_mode) == 0o666 & ~umask


def test_errors_name_the_file_never_the_temporary_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    target = tmp_path / "f.json"
    with pytest.raises(FileNotFoundError) as e:
        atomic_write(tmp_path / "no" / "f.json", b"x")
    assert e.value.filename == str(tmp_path / "no" / "f.json")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        atomic_write(target, b"x")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert str(target) in str(e.value) and ".tmp" not in str(e.value)
    assert not list(tmp_path.iterdir())
    with pytest.raises(OSError) as e, atomic_file(target):
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / "source"))
    assert e.value.filename == str(tmp_path / "source")  # the caller's own error is left as it is
