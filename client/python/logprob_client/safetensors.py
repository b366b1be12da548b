"""Minimal safetensors reading and writing with numpy (no dependency on the
``safetensors`` package), for scripts and tests. BF16 tensors are read as
their raw ``uint16`` bits (see ``tensors.bf16_bits_to_float32``)."""

import json
import struct
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ._internal.tensors import Array

__all__ = ["load", "save"]

_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items() if k != "BF16"}


def load(path: str) -> Tuple[Dict[str, Array], Dict[str, Any]]:
    """Returns ``(tensors, metadata)``: ``{name: ndarray}`` (BF16 as uint16
    bits, with the dtype name in ``dtypes``) and the ``__metadata__`` dict.
    The dtype names by tensor are in ``metadata["__dtypes__"]``."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    meta: Dict[str, Any] = dict(header.pop("__metadata__", {}) or {})
    tensors: Dict[str, Array] = {}
    dtypes: Dict[str, str] = {}
    for name, info in header.items():
        b0, b1 = info["data_offsets"]
        dt = np.dtype(_DTYPES[info["dtype"]])
        tensors[name] = np.frombuffer(raw, dtype=dt, count=(b1 - b0) // dt.itemsize, offset=base + b0).reshape(
            info["shape"]
        )
        dtypes[name] = info["dtype"]
    meta["__dtypes__"] = dtypes
    return tensors, meta


def save(path: str, tensors: Mapping[str, Any], metadata: Optional[Mapping[Any, Any]] = None,
         bf16: Collection[str] = ()) -> None:
    """Writes ``{name: ndarray}``; names in ``bf16`` are uint16 bf16 bits."""
    header: Dict[str, Any] = {}
    blobs: List[bytes] = []
    off = 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dt = "BF16" if name in bf16 else _NAMES[arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype]
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)
