"""Reading a torch `.pt` file (the zip format of `torch.save`) without torch: zipfile, numpy, a restricted unpickler.

The pickle may build only dicts, lists, tuples, scalars, strings, OrderedDicts and tensors of
plain dtypes (`torch._utils._rebuild_tensor_v2` over a `torch.*Storage`); any other global is
refused, so a third party's file cannot run code. Tensors come back as numpy arrays.

Nothing the file says is trusted before it is checked against the bytes actually there: a
member's declared size is taken from the import's byte budget before it is read (and the read
is capped at it); a tensor's storage offset, sizes and strides must be non-negative and every
element they reach must lie inside its storage, before any view is made; a tensor cannot have
more elements than its storage (no zero-stride expansions), and its copy is taken from the
budget too; the pickle's memo indices are checked before unpickling (one opcode can otherwise
ask for gigabytes).
"""

from __future__ import annotations

import collections
import io
import lzma
import math
import pickle
import pickletools
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

import numpy as np

from qnpipe.errors import TraceImportError
from qnpipe.trace.importers.common import MAX_BYTES, Budget, open_regular

_STORAGES = {"LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
             "ByteStorage": np.uint8, "BoolStorage": np.bool_, "FloatStorage": np.float32,
             "DoubleStorage": np.float64, "HalfStorage": np.float16}
_MAX_DIMS = 16
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


class _Storage:
    __slots__ = ("dtype",)

    def __init__(self, dtype: type) -> None:
        self.dtype = dtype


class _Loaded:
    """A storage read from the archive: its key (for messages) and its elements."""

    __slots__ = ("array", "key")

    def __init__(self, key: str, array: np.ndarray) -> None:
        self.key = key
        self.array = array


class _Corrupt(Exception):
    """A check of the pickle's tensors failed (the message says which); load() adds the file's name."""


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_memo(data: bytes) -> None:
    """Walk the pickle's opcodes: a memo index beyond the opcodes seen would make the unpickler allocate it."""
    try:
        for n, (op, arg, _pos) in enumerate(pickletools.genops(data)):
            if op.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg <= n):
                raise _Corrupt(f"memo index {arg} at opcode {n}: a pickle puts at most one memo entry per opcode")
    except (ValueError, UnicodeDecodeError) as e:  # an unknown opcode, a truncated argument
        raise _Corrupt(str(e)) from None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, read: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._read = read  # member name -> bytes, capped and taken from the budget
        self._budget: Budget | None = None
        self._storages: dict[str, _Loaded] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only plain tensors and containers)")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)
                and isinstance(pid[2], str)):
            raise pickle.UnpicklingError(f"unsupported persistent id (a {type(pid).__name__}, not a storage)")
        _, storage, key, _location, numel = pid
        if not any(storage.dtype is t for t in _STORAGES.values()):  # a BUILD opcode can set a slot
            raise _Corrupt(f"storage {key}: dtype {storage.dtype!r:.40} is not a plain torch storage's")
        dtype = np.dtype(storage.dtype).newbyteorder("<")
        if not _int(numel) or numel < 0:
            raise _Corrupt(f"storage {key}: {numel!r:.40} elements announced")
        if key in self._storages:  # torch's pickles name a storage once per tensor that views it
            got = self._storages[key].array
            if got.dtype != dtype or got.size != numel:
                raise _Corrupt(f"storage {key}: read as {got.size} {got.dtype}, then as {numel} {dtype}")
            return self._storages[key]
        buf = self._read(f"data/{key}")
        if len(buf) % dtype.itemsize or len(buf) // dtype.itemsize < numel:
            raise _Corrupt(f"storage {key}: {len(buf)} bytes, {numel} elements of {dtype.itemsize} bytes announced")
        loaded = _Loaded(key, np.frombuffer(buf, dtype=dtype, count=numel))
        self._storages[key] = loaded
        return loaded

    def _rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> np.ndarray:
        if not isinstance(storage, _Loaded):
            raise _Corrupt(f"a tensor over a {type(storage).__name__}, not a storage")
        where = f"storage {storage.key}"
        if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) <= _MAX_DIMS
                and all(map(_int, size)) and all(map(_int, stride))):
            raise _Corrupt(f"{where}: size {size!r:.80} and stride {stride!r:.80}: want two tuples of as many "
                           f"integers (at most {_MAX_DIMS})")
        if not _int(offset) or offset < 0:
            raise _Corrupt(f"{where}: storage offset {offset!r:.40} (want an integer >= 0)")
        if any(n < 0 for n in size) or any(s < 0 for s in stride):
            raise _Corrupt(f"{where}: size {size}, stride {stride}: negative")
        arr = storage.array
        numel = math.prod(size)
        if numel > arr.size:  # a zero-stride expansion: a capture has none, and it could ask for terabytes
            raise _Corrupt(f"{where}: a tensor of size {size} has {numel} elements, its storage {arr.size}")
        if numel == 0:
            if offset > arr.size:
                raise _Corrupt(f"{where}: storage offset {offset} beyond its {arr.size} elements")
            return np.zeros(size, dtype=arr.dtype)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if last >= arr.size:
            raise _Corrupt(f"{where}: a tensor at storage offset {offset}, size {size}, stride {stride} reaches "
                           f"element {last}, its storage has {arr.size} elements")
        assert self._budget is not None
        self._budget.take(numel * arr.itemsize, where)
        # Every byte the view touches is inside arr[offset:last + 1] (checked above); a size-1 dimension's
        # stride is never used, so it is zeroed rather than trusted.
        strides = tuple(s * arr.itemsize if n > 1 else 0 for n, s in zip(size, stride, strict=True))
        return np.array(np.lib.stride_tricks.as_strided(arr[offset:last + 1], shape=size, strides=strides,
                                                        writeable=False))

    def load_within(self, budget: Budget) -> Any:
        self._budget = budget
        return self.load()


def _member(z: zipfile.ZipFile, info: zipfile.ZipInfo, budget: Budget, where: str) -> bytes:
    """The member's bytes: its declared size taken from `budget` first, the read capped at that size."""
    budget.take(info.file_size, where)
    with z.open(info) as f:
        data = f.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise TraceImportError(f"{where}: {len(data)} bytes, {info.file_size} declared")
    return data


def load(path: Path, budget: Budget | None = None) -> Any:
    """The object a `torch.save` wrote to `path`, tensors as numpy arrays; TraceImportError names the file.

    What is read (members, tensor copies) is taken from `budget` (default: MAX_BYTES for this file),
    whose limit also caps the file's size.
    """
    budget = budget or Budget(MAX_BYTES)
    f: IO[bytes] = open_regular(path, budget.limit)
    try:
        with f, zipfile.ZipFile(f) as z:
            infos = {i.filename: i for i in z.infolist()}
            pkl = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise TraceImportError(f"{path}: not a torch zip file (no single data.pkl in the archive)")
            prefix = pkl[0].rpartition("/")[0]

            def full(name: str) -> str:
                return f"{prefix}/{name}" if prefix else name

            def read(name: str) -> bytes:
                if full(name) not in infos:
                    raise _Corrupt(f"no member {full(name)} in the archive")
                return _member(z, infos[full(name)], budget, f"{path}: {full(name)}")

            if full("byteorder") in infos:
                order = read("byteorder").strip()
                if order not in (b"little", b""):
                    raise TraceImportError(f"{path}: byte order {order[:20]!r}: only little-endian")
            data = read("data.pkl")
            _check_memo(data)
            return _Unpickler(data, read).load_within(budget)
    except TraceImportError:
        raise
    except _Corrupt as e:
        raise TraceImportError(f"{path}: corrupt torch file ({e})") from None
    except RecursionError:
        raise TraceImportError(f"{path}: corrupt torch pickle (nested too deeply)") from None
    except (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, NotImplementedError, RuntimeError) as e:
        # RuntimeError: an encrypted member
        raise TraceImportError(f"{path}: not a readable torch zip file ({type(e).__name__}: {e})"[:400]) from None
    except (pickle.UnpicklingError, KeyError, ValueError, TypeError, AttributeError, IndexError, OverflowError) as e:
        raise TraceImportError(f"{path}: corrupt torch pickle ({e})"[:400]) from None
    except OSError as e:
        raise TraceImportError(f"{path}: cannot read ({e.strerror or e})") from None
