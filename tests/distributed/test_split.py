"""The layer split (pure) and the ranks' message header."""

from __future__ import annotations

import numpy as np
import pytest

from qnpipe.errors import ConfigError
from qnpipe.plan.layer_split import split_layers


def test_the_old_path_names_the_same_functions() -> None:
    import qnpipe.live.parallel.split as old
    import qnpipe.plan.layer_split as new

    assert (old.split_layers, old.tensor_bytes, old.model_layer_bytes) == (
        new.split_layers, new.tensor_bytes, new.model_layer_bytes)


def test_equal_layers_split_evenly_and_cover_every_layer() -> None:
    assert split_layers([10] * 8, 2) == [(0, 4), (4, 8)]
    assert split_layers([10] * 8, 3) in ([(0, 3), (3, 6), (6, 8)], [(0, 3), (3, 5), (5, 8)], [(0, 2), (2, 5), (5, 8)])
    assert split_layers([10] * 8, 1) == [(0, 8)]


def test_the_split_minimises_the_largest_rank_counting_embedding_and_head() -> None:
    # A heavy embedding on rank 0 moves layers to the last rank, and the other way round.
    assert split_layers([10] * 8, 2, first_extra=20) == [(0, 3), (3, 8)]
    assert split_layers([10] * 8, 2, last_extra=20) == [(0, 5), (5, 8)]
    # Uneven layers: the largest share is as small as it can be.
    parts = split_layers([50, 1, 1, 1, 1, 50], 2)
    assert max(sum([50, 1, 1, 1, 1, 50][lo:hi]) for lo, hi in parts) == 52


def test_more_ranks_than_layers_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="3 ranks for a model of 2 decoder layers"):
        split_layers([1, 1], 3)


def test_the_header_round_trips_with_exact_sampler_floats() -> None:
    from qnpipe.live.parallel.ring import Header, Op

    h = Header(Op.STEP, rows=7, kind=3, fresh=True, dtype=1, seed=2**40 + 3, temperature=0.7, top_p=0.95,
               ids=12, keep=2, depth=3)
    raw = np.array(h.encode())
    assert raw.dtype == np.int64 and raw.nbytes == 88
    assert Header.decode(raw) == h
