"""Writes into slot memory in flight, counted for the forward's speculation (qnpipe.model.speculate)."""

from __future__ import annotations

import threading


class SlotWrites:
    """Counts the writes into slot memory: `begin` before a batch of reads scatters into slots,
    `end` after its last byte landed (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch = 0  # batches begun
        self.in_flight = 0

    def begin(self) -> None:
        with self._lock:
            self.epoch += 1
            self.in_flight += 1

    def end(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def quiet(self) -> int | None:
        """The epoch when no write is in flight, else None. Read the epoch first: a write that begins
        after it bumps it (seen at `confirm`), one that began before and is running shows in `in_flight`."""
        epoch = self.epoch
        return epoch if self.in_flight == 0 else None
