"""Reading a torch `.pt` file (the zip format of `torch.save`) without torch: zipfile, numpy, a restricted unpickler.

The pickle may build only dicts, lists, tuples, scalars, strings, OrderedDicts and tensors of
plain dtypes (`torch._utils._rebuild_tensor_v2` over a `torch.*Storage`); any other global is
refused, so a third party's file cannot run code. Tensors come back as numpy arrays.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from qnpipe.errors import TraceImportError

_STORAGES = {"LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
             "ByteStorage": np.uint8, "BoolStorage": np.bool_, "FloatStorage": np.float32,
             "DoubleStorage": np.float64, "HalfStorage": np.float16}


class _Storage:
    def __init__(self, dtype: type) -> None:
        self.dtype = dtype


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                    *_: Any) -> np.ndarray:
    if not size:
        return storage[offset:offset + 1].reshape(()).copy()
    need = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n)
    if need > storage.size:
        raise ValueError(f"a tensor of size {size} needs {need} elements, its storage has {storage.size}")
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=tuple(s * storage.itemsize for s in stride))
    return np.array(view)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        self._zip = archive
        self._prefix = prefix

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only plain tensors and containers)")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.80}")
        _, storage, key, _location, numel = pid
        buf = self._zip.read(f"{self._prefix}/data/{key}")
        arr = np.frombuffer(buf, dtype=np.dtype(storage.dtype).newbyteorder("<"))
        if arr.size < numel:
            raise pickle.UnpicklingError(f"storage {key} holds {arr.size} elements, {numel} announced")
        return arr[:numel]


def load(path: Path) -> Any:
    """The object a `torch.save` wrote to `path`, tensors as numpy arrays; TraceImportError names the file."""
    try:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise TraceImportError(f"{path}: not a torch zip file (no single data.pkl in the archive)")
            prefix = pkl[0].rpartition("/")[0]
            order = f"{prefix}/byteorder"
            if order in z.namelist() and z.read(order).strip() not in (b"little", b""):
                raise TraceImportError(f"{path}: byte order {z.read(order).strip().decode()!r}: only little-endian")
            return _Unpickler(z.read(pkl[0]), z, prefix).load()
    except TraceImportError:
        raise
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError) as e:
        raise TraceImportError(f"{path}: not a readable torch zip file ({e})") from None
    except (pickle.UnpicklingError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise TraceImportError(f"{path}: corrupt torch pickle ({e})") from None
    except OSError as e:
        raise TraceImportError(f"{path}: cannot read ({e.strerror or e})") from None
