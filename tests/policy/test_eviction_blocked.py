"""How CLOCK, SIEVE, ARC and S3-FIFO pass over blocked experts (held, pinned, loading), case by case.

Each case is worked out by hand from the rule in the policy's module doc (and docs/pool.md);
with nothing blocked the same policies are libCacheSim's (tests/policy/test_libcachesim.py).
"""

from __future__ import annotations

from qnpipe.policy.eviction_arc import ARC
from qnpipe.policy.eviction_hand import Clock, Sieve
from qnpipe.policy.eviction_s3fifo import S3FIFO


def test_clock_passes_a_held_expert_keeping_its_bit() -> None:
    c = Clock()
    for tick, e in enumerate((0, 1, 2), start=1):
        c.inserted(e, tick)
    c.accessed(0, 4)
    c.accessed(1, 5)
    # The hand: 0 has its bit (cleared, to the back), 1 is held (to the back, bit kept), 2 has none: the victim.
    assert c.victim([0, 2], -1) == 2
    assert c.pick((), {1: 1}, (), 3) == 2
    assert list(c.count.items()) == [(2, 0), (0, 0), (1, 1)]
    c.removed(2)
    c.inserted(3, 6)
    # Nothing blocked now: 0 (no bit) is at the hand.
    assert c.pick((), (), (), 4) == 0


def test_sieve_skips_a_loading_expert_and_its_hand_stays() -> None:
    s = Sieve()
    for tick, e in enumerate((0, 1, 2, 3), start=1):
        s.inserted(e, tick)
    s.accessed(0, 5)
    s.accessed(2, 6)
    # From the oldest: 0 visited (cleared), 1 loading (skipped, still unvisited), 2 visited (cleared), 3: victim.
    assert s.pick({1}, (), (), 4) == 3
    assert s.visited == {0: False, 1: False, 2: False, 3: False} and s.hand == 3
    s.removed(3)  # the victim was the newest: the next search starts from the oldest
    assert s.hand == 0
    s.inserted(4, 7)
    assert s.pick((), (), (), 5) == 0


def test_arc_takes_the_other_list_when_the_named_one_is_all_held() -> None:
    a = ARC(2)
    a.inserted(0, 1)
    a.accessed(0, 2)  # T2 = [0]
    a.inserted(1, 3)  # T1 = [1]
    # REPLACE names T1 (|T1| = 1 > p = 0), whose only expert is held: T2's 0 goes, into B2.
    assert a.pick((), {1: 1}, (), 2) == 0
    a.removed(0)
    a.inserted(2, 4)
    assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2)) == ([1, 2], [], [], [0])
    # 0 again: a B2 hit (p stays 0), T1's least recent, 1, goes into B1, and 0 comes back into T2.
    assert a.pick((), (), (), 0) == 1
    a.removed(1)
    a.inserted(0, 5)
    assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2), a.p) == ([2], [0], [1], [], 0.0)


def test_arc_t1_alone_full_evicts_its_least_recent_evictable_without_a_ghost() -> None:
    a = ARC(2)
    a.inserted(0, 1)
    a.inserted(1, 2)  # T1 = [0, 1] fills the cache, B1 empty
    assert a.pick((), (), {0}, 2) == 1  # 0 pinned: the next least recent of T1
    a.removed(1)
    assert not a.b1 and not a.b2


def test_s3fifo_rotates_a_held_small_expert_and_evicts_from_main() -> None:
    s = S3FIFO(10)  # small 1, main 9, ghost 9
    assert (s.small_size, s.main_size, s.ghost_size) == (1, 9, 9)
    for tick, e in enumerate(range(10), start=1):
        s.inserted(e, tick)  # 0 into small; small full before any eviction: 1..9 into main
    assert list(s.small) == [0] and list(s.main) == list(range(1, 10))
    s.accessed(0, 11)
    s.accessed(0, 12)
    # Small's 0 has 2 accesses: it moves to main, small runs empty, main's oldest (1, count 0) is the victim.
    assert s.pick((), (), (), 10) == 1
    s.removed(1)
    s.inserted(10, 13)  # after an eviction, a new expert goes into small
    assert list(s.small) == [10] and list(s.main) == [*range(2, 10), 0] and not s.ghost
    # 10 held: small has nothing evictable, main gives the victim; 10 stays in small, no ghost entry.
    assert s.pick((), {10: 1}, (), 11) == 2
    s.removed(2)
    s.inserted(11, 14)
    assert list(s.small) == [10, 11] and not s.ghost
    # Nothing blocked, main within its share: small's oldest, 10 (count 0), is evicted into the ghost.
    assert s.pick((), (), (), 12) == 10
    s.removed(10)
    assert list(s.ghost) == [10]
