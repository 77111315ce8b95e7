"""What a streamed model adds to the live engine, on either tier: the store, the reader, the slot arrays."""

from __future__ import annotations

from typing import Any

import attrs

from qnpipe.io.reader import ExpertReader
from qnpipe.io.slot_writes import SlotWrites
from qnpipe.io.store import ExpertStore
from qnpipe.model.slots import LayerSlots


@attrs.define
class Streaming:
    """What a streamed model adds: the store, the reader, and the slot arrays per MoE layer."""

    store: ExpertStore
    reader: ExpertReader
    slots: dict[int, LayerSlots]
    capacities: dict[int, int]
    mtp: Any = None  # the MTP layer's record layout and its reader (qnpipe.live.mtp.mtp_store.MtpLayer) when it streams
    # Every write into `slots` (the live device's reads) is counted here: the forward's speculation reads it.
    writes: SlotWrites = attrs.field(factory=SlotWrites)

    def close(self) -> None:
        self.reader.close()
        self.store.close()
        if self.mtp is not None:
            self.mtp.close()
