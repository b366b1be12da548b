"""Conversions between numpy / torch arrays and ``logprob.v1.Tensor`` messages.

Wire format (``proto/logprob/v1/logprob.proto``): raw little-endian bytes,
a dtype (F32, BF16, F16, I32, I64) and a shape.

numpy has no bfloat16. A bf16 array is accepted as

- a ``uint16`` numpy array holding the raw bf16 bits, tagged with
  ``dtype="bf16"`` (the ``*_dtype`` argument of ``LogprobClient.score``);
- an ``ml_dtypes.bfloat16`` array (when ``ml_dtypes`` is installed);
- a ``torch.bfloat16`` tensor (when ``torch`` is installed).

Float arrays can also be converted on the way: ``dtype="bf16"`` on a
float32 array rounds it to bf16 (round to nearest even), ``"f16"`` casts to
float16, ``"f32"`` casts to float32. float64 input needs an explicit
``dtype`` (``"f32"``: rounded to float32), as the service has no float64
(``logprob-client`` refuses float64 files too): a float64 array passed
as is raises TypeError rather than losing precision silently.
"""

from typing import Any, Dict, Optional, Tuple

import numpy as np
import numpy.typing as npt

from ._proto import pb2

F32: int = pb2.F32
BF16: int = pb2.BF16
F16: int = pb2.F16
I32: int = pb2.I32
I64: int = pb2.I64

# A numpy array of any dtype and shape.
Array = npt.NDArray[Any]

_FLOAT_NAMES: Dict[str, int] = {
    "f32": F32,
    "float32": F32,
    "fp32": F32,
    "bf16": BF16,
    "bfloat16": BF16,
    "f16": F16,
    "float16": F16,
    "fp16": F16,
    "half": F16,
}

# numpy dtype of each wire dtype (BF16 as its raw uint16 bits).
NUMPY_DTYPE: Dict[int, np.dtype[Any]] = {
    F32: np.dtype("<f4"),
    BF16: np.dtype("<u2"),
    F16: np.dtype("<f2"),
    I32: np.dtype("<i4"),
    I64: np.dtype("<i8"),
}

DTYPE_SIZE: Dict[int, int] = {k: v.itemsize for k, v in NUMPY_DTYPE.items()}


def is_torch(x: Any) -> bool:
    """True for a torch tensor (checked without importing torch)."""
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach")


def _is_ml_bf16(arr: Array) -> bool:
    return bool(arr.dtype.name == "bfloat16")


def as_numpy(x: Any) -> Tuple[Array, bool]:
    """Returns ``(array, is_bf16)`` for a numpy array, array-like or torch
    tensor, without copying what is already in host memory: a CPU torch
    tensor (contiguous or not) becomes a numpy view of its memory; a tensor
    on another device is copied to the host (``.cpu()``). A bf16 torch or
    ml_dtypes array comes back as a ``uint16`` view of its raw bits with
    ``is_bf16=True`` (no float conversion)."""
    if is_torch(x):
        import torch  # only reached when x is a torch tensor

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            return _host_view(t.view(torch.int16)).view(np.uint16), True
        return _host_view(t), False
    arr = np.asarray(x)
    if _is_ml_bf16(arr):
        return arr.view(np.uint16), True
    return arr, False


def _host_view(t: Any) -> Array:
    """A numpy view of a CPU tensor's memory, through DLPack rather than
    ``Tensor.numpy()``: ``numpy()`` marks the tensor's storage not
    resizable for good, and FSDP2 frees an unsharded parameter's storage
    after the backward (``resize_(0)``), so an lm_head that FSDP2 held whole
    when it was pushed failed there ("Trying to resize storage that is not
    resizable"). What DLPack does not export (bool before numpy 1.25)
    goes through ``numpy()``."""
    try:
        arr: Array = np.from_dlpack(t)
    except (BufferError, RuntimeError, TypeError):
        arr = t.numpy()
    return arr


def float32_to_bf16_bits(a: Any) -> Array:
    """Rounds a float32 array to bfloat16 (nearest even; NaN stays NaN) and
    returns the raw ``uint16`` bits."""
    a = np.ascontiguousarray(a, dtype="<f4")
    u = a.view("<u4").astype(np.uint64)
    rounded: Array = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype("<u2")
    return rounded


def bf16_bits_to_float32(bits: Any) -> Array:
    """float32 values of raw bfloat16 bits (a ``uint16`` array); exact."""
    bits = np.asarray(bits, dtype="<u2")
    values: Array = (bits.astype("<u4") << 16).view("<f4")
    return values


def parse_float_dtype(dtype: Any) -> Optional[int]:
    """Wire dtype of a name ("f32", "bf16", "f16", "float32", ...), a numpy
    dtype, or a wire dtype value; None stays None."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        key = dtype.lower()
        if key.startswith("torch."):
            key = key[len("torch."):]
        if key in _FLOAT_NAMES:
            return _FLOAT_NAMES[key]
        raise ValueError("unknown float dtype %r (use 'f32', 'bf16' or 'f16')" % (dtype,))
    if isinstance(dtype, int) and dtype in (F32, BF16, F16):
        return dtype
    if is_torch(dtype) or type(dtype).__module__ == "torch":
        return parse_float_dtype(str(dtype))
    name = np.dtype(dtype).name
    if name in _FLOAT_NAMES:
        return _FLOAT_NAMES[name]
    raise ValueError("unsupported float dtype %r (use 'f32', 'bf16' or 'f16')" % (dtype,))


def float64_refused(name: str) -> TypeError:
    """The error for float64 scores sent without a ``dtype``."""
    return TypeError(
        "'%s' is float64, which the service does not take (f32, bf16 or f16): pass dtype='f32' to send it "
        "rounded to float32 (or convert it first, e.g. .astype(np.float32) / .float())" % name
    )


def float_array(name: str, x: Any, dtype: Any = None) -> Tuple[int, Array]:
    """Converts ``x`` (scores: logits or hidden states) into
    ``(wire_dtype, little-endian array)``; BF16 as uint16 bits. Without a
    dtype conversion the array is ``x``'s memory (possibly strided), so
    that ``to_tensor`` makes the only copy.

    ``dtype`` (optional): the wire dtype to send ("f32", "bf16", "f16").
    A ``uint16`` array is only accepted with ``dtype="bf16"`` (raw bits).
    """
    arr, is_bf16 = as_numpy(x)
    want = parse_float_dtype(dtype)
    if is_bf16:
        if want not in (None, BF16):
            arr = bf16_bits_to_float32(arr)
            is_bf16 = False
        else:
            return BF16, arr.astype("<u2", copy=False)
    kind = arr.dtype.kind
    if kind == "u" and arr.dtype.itemsize == 2:
        if want == BF16:
            return BF16, arr.astype("<u2", copy=False)
        raise TypeError("'%s' is a uint16 array: pass dtype='bf16' if it holds raw bfloat16 bits" % name)
    if kind != "f":
        raise TypeError("'%s' must be a float array (f32, bf16 or f16), got dtype %s" % (name, arr.dtype))
    if want is None:
        if arr.dtype.itemsize > 4:
            raise float64_refused(name)
        want = F16 if arr.dtype.itemsize == 2 else F32
    if want == BF16:
        return BF16, float32_to_bf16_bits(arr.astype("<f4", copy=False))
    return want, arr.astype(NUMPY_DTYPE[want], copy=False)


def int_array(name: str, x: Any) -> Tuple[int, Array]:
    """Converts ``x`` (ids, lengths) into ``(wire_dtype, array)``: int32
    stays I32, int64 stays I64, other integer (and bool) types become I64."""
    arr, is_bf16 = as_numpy(x)
    if is_bf16 or arr.dtype.kind not in "iub":
        raise TypeError("'%s' must be an integer array, got dtype %s" % (name, "bfloat16" if is_bf16 else arr.dtype))
    if arr.dtype.kind == "i" and arr.dtype.itemsize == 4:
        return I32, arr.astype("<i4", copy=False)
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError("'%s' holds values that do not fit int64" % name)
    return I64, arr.astype("<i8", copy=False)


def to_tensor(name: str, wire_dtype: int, arr: Array) -> Any:
    """A ``logprob.v1.Tensor`` holding ``arr`` (already in the wire dtype,
    contiguous or not): ``tobytes`` is the one copy of the caller's data
    (row-major, whatever ``arr``'s strides). An empty array leaves ``data``
    unset, as ``wire.encode_request`` does (``data`` is one choice of the
    ``source`` oneof, where setting it to empty bytes would be sent)."""
    t = pb2.Tensor(name=name, dtype=wire_dtype, shape=[int(d) for d in arr.shape])
    if arr.size:
        t.data = arr.astype(NUMPY_DTYPE[wire_dtype], copy=False).tobytes(order="C")
    return t


def from_tensor(t: Any) -> Array:
    """numpy array of a ``logprob.v1.Tensor`` (or a ``wire.WireTensor``):
    a read-only view of its data (``np.frombuffer``, no copy); BF16
    converted to float32 values.
    Raises ValueError when the bytes do not match the shape."""
    if t.dtype not in NUMPY_DTYPE:
        raise ValueError("output '%s' has unsupported dtype %d" % (t.name, t.dtype))
    dt = NUMPY_DTYPE[t.dtype]
    shape = tuple(int(d) for d in t.shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if n * dt.itemsize != len(t.data):
        raise ValueError(
            "output '%s' has %d bytes; shape %s of %s needs %d"
            % (t.name, len(t.data), list(shape), pb2.DType.Name(t.dtype), n * dt.itemsize)
        )
    data = t.data  # bytes (a protobuf message) or a memoryview (wire.WireTensor), viewed by the array
    arr = np.frombuffer(data, dtype=dt).reshape(shape)
    if t.dtype == BF16:
        return bf16_bits_to_float32(arr).reshape(shape)
    return arr
