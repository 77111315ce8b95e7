"""Model-free guesses (qnpipe.replay.model_free): transition table, oracle recall, previous token."""

from __future__ import annotations

import numpy as np

from qnpipe.replay.model_free import TransitionTable, oracle_guess, previous_guess, top_by_score


def test_transition_table_ranks_what_followed_most_often() -> None:
    t = TransitionTable((0, 2, 3), num_experts=6)
    assert t.next_of == {0: 2, 2: 3}
    # token routes [layer 0 -> layer 2]: 1 -> 4 three times, 1 -> 5 once
    for nxt in (4, 4, 4, 5):
        t.learn(0, np.array([[1]]), np.array([[nxt]]))
    ids, scores = t.guess(0, np.array([[1]]), width=3)  # type: ignore[misc]
    assert ids.tolist() == [[4, 5]]  # only the two ever seen: no guess of something unseen
    assert np.allclose(scores, [[0.75, 0.25]])
    assert t.guess(0, np.array([[2]]), width=3) is None  # nothing ever followed expert 2
    assert t.guess(3, np.array([[1]]), width=3) is None  # the last MoE layer predicts nothing


def test_transition_learns_whole_steps_and_sums_over_a_tokens_experts() -> None:
    t = TransitionTable((0, 1), num_experts=8)
    steps = [[(0, (0, 1)), (1, (6, 7))], [(0, (0, 2)), (1, (5, 6))]]  # top-2, one token per step
    t.learn_steps(steps, top_k=2)
    assert t.counts[0][0, 6] == 2 and t.counts[0][1, 7] == 1 and t.counts[0][2, 5] == 1
    ids, scores = t.guess(0, np.array([[0, 1]]), width=2)  # type: ignore[misc]
    # from 0: 6 x2, 7, 5; from 1: 6, 7 -> 6 (3), 7 (2), 5 (1)
    assert ids.tolist() == [[6, 7]] and np.isclose(scores.sum(), 5 / 6)


def test_top_by_score_breaks_ties_by_expert_id_and_trims_to_non_zero() -> None:
    ids, scores = top_by_score(np.array([[0.0, 0.5, 0.5, 0.0], [0.1, 0.0, 0.0, 0.0]]), width=3)
    assert ids.tolist() == [[1, 2], [0, 1]] and scores.tolist() == [[0.5, 0.5], [0.1, 0.0]]


def test_oracle_recall_is_exact_at_the_ends_and_seeded_in_between() -> None:
    truth = np.array([[i, i + 1, i + 2] for i in range(0, 60, 3)])  # 20 tokens, top-3, 64 experts
    ids, scores = oracle_guess(truth, 64, 1.0, np.random.default_rng(0))
    assert (ids == truth).all() and (scores == 1).all()
    ids, _ = oracle_guess(truth, 64, 0.0, np.random.default_rng(0))
    assert not any(set(row) & set(t) for row, t in zip(ids.tolist(), truth.tolist(), strict=True))
    assert all(len(set(row)) == 3 for row in ids.tolist())  # still distinct experts per token
    a = oracle_guess(truth, 64, 0.5, np.random.default_rng(7))[0]
    b = oracle_guess(truth, 64, 0.5, np.random.default_rng(7))[0]
    assert (a == b).all()
    kept = np.mean([len(set(r) & set(t)) / 3 for r, t in zip(a.tolist(), truth.tolist(), strict=True)])
    assert 0.3 < kept < 0.7


def test_oracle_with_no_other_expert_keeps_the_truth() -> None:
    ids, _ = oracle_guess(np.array([[0, 1]]), 2, 0.0, np.random.default_rng(0))
    assert sorted(ids[0].tolist()) == [0, 1]


def test_previous_guess_repeats_the_last_token_for_every_token() -> None:
    ids, scores = previous_guess((1, 2, 3, 4), tokens=3, top_k=2)
    assert ids.tolist() == [[3, 4]] * 3 and scores.shape == (3, 2)
