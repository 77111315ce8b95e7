"""Fixtures of the reader's tests that start reads from a loop (test_reader_start.py, test_reader_start_at.py)."""

from __future__ import annotations

import pytest
from test_reader import write_store
from test_reader_start import Notify


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """A small store (tests/io/test_reader.py's `write_store`), once per module: (root, index)."""
    root = tmp_path_factory.mktemp("store")
    return root, write_store(root)


@pytest.fixture
def note():
    """A wake-up pair (`Notify`), closed after the test."""
    n = Notify()
    yield n
    n.close()
