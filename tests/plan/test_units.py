"""Memory sizes: GB = GiB = 2^30 bytes, as the config's *_gb fields."""

from __future__ import annotations

import pytest

from qnpipe.errors import ConfigError
from qnpipe.plan.units import parse_memory


@pytest.mark.parametrize(("text", "n"), [("8GB", 8 * 2**30), ("8GiB", 8 * 2**30), ("8G", 8 * 2**30),
                                         ("8g", 8 * 2**30), ("8000MB", 8000 * 2**20), ("0.5 GB", 2**29),
                                         ("512MiB", 2**29), ("1TB", 2**40), ("123456", 123456), ("64KB", 65536)])
def test_sizes(text: str, n: int) -> None:
    assert parse_memory(text) == n


@pytest.mark.parametrize("text", ["", "GB", "8 XB", "-1GB", "8iB", "0", "1e3GB", "nanGB", "99999999TB"])
def test_bad_sizes_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--memory"):
        parse_memory(text)
