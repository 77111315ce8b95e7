"""The MTP head's experts as a pool layer of their own, read from `mtp.safetensors`.

A qnpipe directory keeps the MTP head in `mtp.safetensors` (HF names, one tensor per expert
and projection). When the experts stream, the head's MoE (layer id `num_hidden_layers`) gets
slots, a capacity and heat like any layer; `mtp_layer_file` describes its record (the
expert's tensors in a fixed order, as a `LayerFile` for `make_layer_slots`), and
`MtpFileDevice` reads an expert by one read per tensor at its offset in the file (straight
into the slot's host views; unaligned offsets go through the reader's bounce buffer).
`RoutedDevice` sends the MTP layer's jobs there and every other job to the store's device.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path

import trio

from qnpipe.errors import CheckpointError
from qnpipe.io.device import DeviceStatistics, ExpertDevice, SlotDest, submit
from qnpipe.io.reader import ExpertReader, ReaderStats, ReadRequest
from qnpipe.io.store_format import LayerFile, Quant, TensorSlot
from qnpipe.model.args import ModelArgs
from qnpipe.model.checkpoint import TensorInfo, read_header
from qnpipe.model.experts import PROJS
from qnpipe.model.load import quant_params
from qnpipe.policy.read_queue import Job

_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "U32": "uint32"}


def _name(expert: int, tensor: str) -> str:
    return f"mtp.layers.0.mlp.experts.{expert}.{tensor}"


def mtp_layer_file(args: ModelArgs, path: Path) -> tuple[LayerFile, dict[str, TensorInfo]]:
    """The MTP experts' record layout (layer `num_hidden_layers`) and the file's tensor table.

    Raises CheckpointError naming the file and tensor when an expert's tensors are missing
    or differ in shape or dtype from expert 0's.
    """
    infos = read_header(path)
    tensors: list[TensorSlot] = []
    quant: dict[str, Quant] = {}
    offset = 0
    for proj in PROJS:
        for part in ("weight", "scales", "biases"):
            first = infos.get(_name(0, f"{proj}.{part}"))
            if first is None:
                if part == "weight":
                    raise CheckpointError(f"{path}: missing tensor {_name(0, f'{proj}.weight')}")
                continue
            if first.dtype not in _DTYPES:
                raise CheckpointError(f"{path}: tensor {_name(0, f'{proj}.{part}')} has dtype {first.dtype}")
            tensors.append(TensorSlot(name=f"{proj}.{part}", dtype=_DTYPES[first.dtype], shape=first.shape,
                                      offset=offset, nbytes=first.nbytes))
            offset += first.nbytes
        scales = infos.get(_name(0, f"{proj}.scales"))
        if scales is not None:
            w = infos[_name(0, f"{proj}.weight")]
            q = quant_params(proj, None, scales.shape, w.shape, args.expert_dims[proj][1])
            assert q is not None
            quant[proj] = Quant(bits=q["bits"], group_size=q["group_size"], mode=q["mode"])
    for e in range(args.num_experts):
        for t in tensors:
            info = infos.get(_name(e, t.name))
            if info is None:
                raise CheckpointError(f"{path}: missing tensor {_name(e, t.name)}")
            if info.shape != t.shape or _DTYPES.get(info.dtype) != t.dtype:
                raise CheckpointError(f"{path}: tensor {_name(e, t.name)} is {info.dtype} {list(info.shape)}, "
                                      f"expert 0's is {t.dtype} {list(t.shape)}")
    lf = LayerFile(layer=args.num_hidden_layers, file=path.name, num_experts=args.num_experts, stride=offset,
                   record_nbytes=offset, file_nbytes=path.stat().st_size, tensors=tuple(tensors),
                   quant=quant or None, checksums=())
    return lf, infos


class MtpFileDevice:
    """`ExpertDevice` for the MTP layer: each expert read tensor by tensor from `mtp.safetensors`."""

    def __init__(self, lf: LayerFile, infos: Mapping[str, TensorInfo], reader: ExpertReader, dest: SlotDest) -> None:
        self._lf = lf
        self._infos = infos
        self._reader = reader
        self._dest = dest

    def requests(self, job: Job) -> list[ReadRequest]:
        bufs = self._dest(job.layer, job.slot)
        out = []
        for t in self._lf.tensors:
            info = self._infos[_name(job.expert, t.name)]
            out.append(ReadRequest(path=str(info.file), offset=info.offset, nbytes=info.nbytes, buf=bufs[t.name],
                                   layer=job.layer, expert=job.expert))
        return out

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        reqs = [r for j in jobs for r in self.requests(j)]
        await trio.to_thread.run_sync(self._reader.read_batch, reqs)
        return [self._lf.record_nbytes] * len(jobs)

    def statistics(self) -> ReaderStats | None:
        return self._reader.statistics()


async def _gather(n: int, parts: list[tuple[list[int], Awaitable[list[int]]]]) -> list[int]:
    """The parts' byte counts in job order; every part is awaited (each may be writing slot memory) before an error is raised."""
    out = [0] * n
    error: BaseException | None = None
    for idx, reading in parts:
        try:
            for i, nb in zip(idx, await reading, strict=True):
                out[i] = nb
        except Exception as e:  # noqa: PERF203 - one per device, at most two
            error = error or e
    if error is not None:
        raise error
    return out


class RoutedDevice:
    """`ExpertDevice` that sends the jobs of `special` layers to their own device, the rest to `default`."""

    def __init__(self, default: ExpertDevice, special: Mapping[int, ExpertDevice]) -> None:
        self._default = default
        self._special = special

    async def read(self, jobs: Sequence[Job]) -> list[int]:
        return await self.submit(jobs)

    def submit(self, jobs: Sequence[Job]) -> Awaitable[list[int]]:
        """Each device's share of the batch, started now where that device can (qnpipe.io.device.submit)."""
        groups: dict[int | None, list[int]] = {}
        for i, j in enumerate(jobs):
            groups.setdefault(j.layer if j.layer in self._special else None, []).append(i)
        parts = [(idx, submit(self._default if layer is None else self._special[layer], [jobs[i] for i in idx]))
                 for layer, idx in groups.items()]
        return _gather(len(jobs), parts)

    def statistics(self) -> DeviceStatistics | None:
        return self._default.statistics()

    def close(self) -> None:
        close = getattr(self._default, "close", None)
        if close is not None:
            close()


class MtpLayer:
    """The streamed MTP layer: its record layout, the file's tensor table, and the reader it owns."""

    def __init__(self, file: LayerFile, infos: Mapping[str, TensorInfo], reader: ExpertReader) -> None:
        self.file = file
        self.infos = infos
        self.reader = reader

    @classmethod
    def open(cls, args: ModelArgs, path: Path, reader: ExpertReader) -> MtpLayer:
        try:
            lf, infos = mtp_layer_file(args, path)
        except BaseException:
            reader.close()
            raise
        return cls(lf, infos, reader)

    @property
    def layer(self) -> int:
        return self.file.layer

    def routed(self, default: ExpertDevice, dest: SlotDest) -> RoutedDevice:
        return RoutedDevice(default, {self.layer: MtpFileDevice(self.file, self.infos, self.reader, dest)})

    def close(self) -> None:
        self.reader.close()
