"""A Gated DeltaNet cache that can keep its state after every token of a step (speculative verify).

The recurrent state is a running sum with no "remove the last token", so a verify step over
`[y_n, d_1 … d_K]` keeps the state after each of its tokens; rollback to "the first `keep`
tokens processed" then sets the conv window and the recurrent state to that token's copies
(docs/model.md, "MTP speculation"). Recording computes the recurrence one token at a time,
the very ops a one-token decode step runs, so the kept states equal plain decoding's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import gated_delta_update


class StepCache(ArraysCache):
    """`ArraysCache(size=2)` (conv window, recurrent state) that records per-token states while `recording`."""

    def __init__(self) -> None:
        super().__init__(size=2)
        self.recording = False
        self.conv_in: mx.array | None = None  # [B, K_c - 1 + S, C]: the window before the step, then its rows
        self.states: list[mx.array] = []  # recurrent state after each token of the recorded step

    def record(self, conv_in: mx.array, q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
               A_log: mx.array, dt_bias: mx.array, state: mx.array | None,
               mask: mx.array | None) -> tuple[mx.array, mx.array]:
        """`gated_delta_update` over the step's tokens one at a time, keeping every state."""
        self.conv_in = conv_in
        self.states = []
        outs = []
        assert q.shape[1] > 0
        for t in range(q.shape[1]):
            out, state = gated_delta_update(
                q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1], b[:, t:t + 1], A_log, dt_bias, state,
                None if mask is None else mask[:, t:t + 1])
            outs.append(out)
            self.states.append(state)
        assert state is not None
        return mx.concatenate(outs, axis=1), state

    def rollback(self, keep: int) -> None:
        """Back to the state after the first `keep` tokens (>= 1) of the recorded step."""
        assert self.conv_in is not None and 1 <= keep <= len(self.states), (keep, len(self.states))
        width = self.conv_in.shape[1] - len(self.states)  # K_c - 1
        self[0] = mx.contiguous(self.conv_in[:, keep:keep + width, :])
        self[1] = self.states[keep - 1]
        self.forget()

    def forget(self) -> None:
        self.recording = False
        self.conv_in = None
        self.states = []
