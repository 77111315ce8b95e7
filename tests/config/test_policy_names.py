"""A built-in eviction policy is accepted under the spellings users write: `s3-fifo` (the paper's) is `s3fifo`."""

from __future__ import annotations

import pytest

from qnpipe import config
from qnpipe.config import load
from qnpipe.errors import ConfigError


@pytest.mark.parametrize(("given", "want"), [
    ("s3fifo", config.EvictPolicy.S3FIFO), ("s3-fifo", config.EvictPolicy.S3FIFO), ("S3-FIFO", config.EvictPolicy.S3FIFO),
    ("s3_fifo", config.EvictPolicy.S3FIFO), ("LRU", config.EvictPolicy.LRU), ("Sieve", config.EvictPolicy.SIEVE),
])
def test_policy_name_spellings(given: str, want: config.EvictPolicy) -> None:
    assert load(overrides={"pool.evict_policy": given}).pool.evict_policy is want
    assert load(env={"EVICT_POLICY": given}).pool.evict_policy is want


def test_a_plug_in_spec_is_kept_as_written_and_a_near_miss_still_fails() -> None:
    assert load(overrides={"pool.evict_policy": "tests.plugin_lru:LRUish"}).pool.evict_policy == "tests.plugin_lru:LRUish"
    with pytest.raises(ConfigError, match="s3-fif"):
        load(overrides={"pool.evict_policy": "s3-fif"})
