"""Autopin's engine side (`pool.autopin`): load the heat, pin the hottest experts, save the heat.

At start-up `Autopin.open` reads the heat file (`Config.autopin_usage_path()`,
qnpipe.io.heat_file) and `plan` names each layer's experts to pin
(qnpipe.policy.heat.autopin_plan). While the engine runs the pool counts heat at every
acquire (`PoolPolicy.heat`); every `pool.autopin_save_every_forwards` forwards the pool
actor calls `after_forward`, which hands a copy of the counts to `run_saver`, a trio task
that writes it in a worker thread (the trio loop never waits for the disk); `save_final`
writes it once more when the pipeline closes. A location that cannot be written is
reported once (`HeatFileWarning`) and the engine keeps running.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Mapping

import attrs
import trio

from qnpipe.config import Config
from qnpipe.io.heat_file import Counts, HeatFileWarning, load_heat, save_heat
from qnpipe.policy.heat import Heat, autopin_plan


@attrs.define(eq=False)
class Autopin:
    path: str
    model_id: str
    top_k: int
    budget_frac: float
    save_every: int
    heat: Heat
    explicit_path: bool = False  # pool.autopin_usage_file was set (else the default beside the store)
    saves: int = 0
    _warned: bool = False
    _tx: trio.MemorySendChannel[Counts] | None = None
    _rx: trio.MemoryReceiveChannel[Counts] | None = None

    @classmethod
    def open(cls, cfg: Config, model_id: str, top_k: int, *, num_experts: int | None = None,
             layers: Collection[int] | None = None) -> Autopin | None:
        """Autopin for this config (None when `pool.autopin` is off), with the saved heat loaded.

        `num_experts` and `layers` (the MoE layers, and the MTP layer) are the model's: a heat
        file naming an expert or layer outside them is ignored with a warning (a zero start),
        never pinned (that would read a record the store does not have).
        """
        pool_cfg = cfg.pool
        if not pool_cfg.autopin:
            return None
        path = cfg.autopin_usage_path()
        heat = Heat(load_heat(path, model_id, num_experts=num_experts, layers=layers))
        return cls(path, model_id, top_k, pool_cfg.autopin_budget_frac, pool_cfg.autopin_save_every_forwards, heat,
                   explicit_path=bool(pool_cfg.autopin_usage_file))

    def plan(self, capacities: Mapping[int, int]) -> dict[int, list[int]]:
        return autopin_plan(self.heat, capacities, self.top_k, self.budget_frac)

    # ----------------------------------------------------------------- saving

    def after_forward(self) -> None:
        """The pool's hook after each ForwardDone: every `save_every` forwards, queue a save (never waits)."""
        if self.heat.forwards % self.save_every or self._tx is None:
            return
        try:
            self._tx.send_nowait(self.heat.snapshot())
        except trio.WouldBlock:  # a save is queued already; the next one carries newer counts
            pass

    async def run_saver(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write each queued snapshot in a worker thread, until cancelled."""
        self._tx, self._rx = trio.open_memory_channel[Counts](1)
        task_status.started()
        async with self._rx:
            async for counts in self._rx:
                await self._save(counts)

    async def save_final(self) -> None:
        """Write the heat as it is now (at close); shielded, so a cancelled close still saves."""
        with trio.CancelScope(shield=True):
            await self._save(self.heat.snapshot())

    async def _save(self, counts: Counts) -> None:
        err = await trio.to_thread.run_sync(self._write, counts)
        if err is None:
            self.saves += 1
        elif not self._warned:
            self._warned = True
            hint = "" if self.explicit_path else " (pool.autopin_usage_file puts it elsewhere)"
            warnings.warn(f"{self.path}: cannot save the autopin heat ({err}); the engine goes on without "
                          f"saving it{hint}", HeatFileWarning, stacklevel=1)

    def _write(self, counts: Counts) -> OSError | None:
        try:
            save_heat(self.path, self.model_id, counts)
        except OSError as e:
            return e
        return None

