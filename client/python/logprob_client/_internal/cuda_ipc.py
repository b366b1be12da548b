"""CUDA IPC inputs: a client on the server's host whose hidden states are a
torch CUDA tensor sends a CUDA IPC handle of the GPU memory holding them
instead of the bytes (``Tensor.cuda_ipc`` in
``proto/logprob/v1/logprob.proto``); each worker maps the allocation and
reads its rows on its own GPU, so the hidden states never go through host
memory.

Both clients use it on their own (option ``cuda_ipc=True``, the default) when

- the input is ``hidden_states`` and a CUDA tensor (``is_cuda``),
- ``GetServerInfo`` reports ``cuda_ipc_inputs`` (CUDA workers on the
  server's host, flag on) and a ``host_id`` equal to this process's
  (``shared_memory.host_id()``, the same test as shared-memory inputs),
- the call fits one request (``max_tokens_per_request``),
- and the tensor's memory can be exported.

``update_lm_head`` decides the same way (``offered``) for a CUDA weight:
its rows go as one reference (``LmHeadRows.rows.cuda_ipc``), which a worker
on the server's host copies into the update's store file.

Otherwise the tensor is copied to the host (``.cpu()``) and sent as bytes
(inline, in pieces, or through shared memory), as before. A server that
refuses the reference (FAILED_PRECONDITION about CUDA IPC: e.g. its workers
cannot open the handle) gets the call again as bytes
(``ScoreCall.refused``); that fallback is the call's own: the client's
``cuda_ipc`` stays as the caller set it, and later calls try again.

How a tensor is exported (``export``): it is made contiguous in the wire
dtype (a copy on the GPU only when it is not already), the device is
synchronised (``torch.cuda.synchronize``: writes queued on any stream are
done before the server reads), then the CUDA driver, through ``ctypes`` on
``libcuda.so.1``, gives the base and size of the allocation holding it
(``cuMemGetAddressRange``) and that allocation's handle
(``cuIpcGetMemHandle``); the reference is (handle, tensor address - base,
bytes). This works for any ``cudaMalloc``-backed memory, including blocks of
torch's caching allocator, and unlike ``untyped_storage()._share_cuda_()``
it leaves torch's IPC reference counting (meant for a torch consumer that
decrements it) untouched. Memory the driver cannot export (e.g.
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, whose segments are
virtual-memory mappings) makes the call fall back to bytes with a warning.
The tensor (or its contiguous copy) is referenced by the call until the
response has arrived; do not write to it meanwhile.
"""

import ctypes
import threading
import warnings
from typing import Any, Optional, Tuple

from . import shared_memory
from ..errors import has_reason
from ._proto import pb2
from .tensors import BF16, F16, F32, float64_refused, parse_float_dtype

HANDLE_BYTES = 64


class Unavailable(Exception):
    """The tensor cannot be exported (the message says why)."""


def server_accepts(info: Any) -> bool:
    """True when the server described by ``info`` (``ServerInfo``) takes CUDA
    IPC inputs and runs on this host (its ``host_id`` is this process's)."""
    return (
        bool(getattr(info, "cuda_ipc_inputs", False))
        and bool(info.host_id)
        and info.host_id == shared_memory.host_id()
    )


def is_cuda_tensor(x: Any) -> bool:
    """True for a tensor in CUDA memory (torch's ``is_cuda``; duck-typed)."""
    return getattr(x, "is_cuda", False) is True and callable(getattr(x, "data_ptr", None))


def candidate(enabled: Any, hidden_states: Any) -> bool:
    """True when a call may send its hidden states by CUDA IPC, before
    asking the server: ``enabled`` (the ``cuda_ipc`` option) and
    ``hidden_states`` is a CUDA tensor."""
    return bool(enabled) and is_cuda_tensor(hidden_states)


def offered(enabled: Any, info: Any, x: Any) -> bool:
    """True when ``x`` goes to the server described by ``info`` as a CUDA
    IPC reference: ``candidate`` (``enabled`` and ``x`` a CUDA tensor), then
    ``server_accepts`` (CUDA IPC offered, same host). The one decision for
    scoring inputs (``use_cuda_ipc``) and lm_head update rows
    (``update_lm_head``: the server offers CUDA IPC rows exactly where it
    offers CUDA IPC inputs)."""
    return candidate(enabled, x) and server_accepts(info)


def use_cuda_ipc(enabled: Any, info: Any, name: str, x: Any) -> bool:
    """The decision both clients make for one scoring call (``offered``):
    ``name`` is ``hidden_states``, ``x`` is a CUDA tensor, ``enabled`` and
    the server (``info``) accepts CUDA IPC inputs from this host."""
    return name == "hidden_states" and offered(enabled, info, x)


def device_rows(x: Any, dtype: Any = None, name: str = "hidden_states") -> Tuple[int, Any]:
    """``(wire_dtype, tensor)``: ``x`` as a contiguous CUDA tensor of the wire
    dtype (``dtype``, else x's: float32 / bfloat16 / float16; float64 only
    with an explicit ``dtype``), converted on its GPU. Raises TypeError for
    other dtypes (``name`` names the tensor in messages)."""
    import torch  # only reached for a torch CUDA tensor

    torch_of = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}
    wire_of = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
    t = x.detach()
    want = parse_float_dtype(dtype)
    if want is None:
        if t.dtype == torch.float64:
            raise float64_refused(name)
        if t.dtype not in wire_of:
            raise TypeError("'%s' must be a float tensor (f32, bf16 or f16), got dtype %s" % (name, t.dtype))
        want = wire_of[t.dtype]
    return want, t.to(torch_of[want]).contiguous()


_driver_lock = threading.Lock()
_driver: Any = None


def _libcuda() -> Any:
    """``libcuda.so.1`` through ctypes (loaded once)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise Unavailable("cannot load libcuda.so.1: %s" % (e,)) from None
            lib.cuMemGetAddressRange_v2.argtypes = [
                ctypes.POINTER(ctypes.c_uint64),
                ctypes.POINTER(ctypes.c_size_t),
                ctypes.c_uint64,
            ]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver = lib
        return _driver


def _check(lib: Any, result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise Unavailable("%s: %s (CUresult %d)" % (call, (text.value or b"?").decode(), result))


class Export:
    """A tensor's CUDA IPC reference: ``tensor`` (kept alive while this
    object is), ``handle`` (64 bytes), ``offset`` and ``byte_size`` in the
    allocation, ``device_uuid``, ``allocation_bytes`` (the allocation's
    size, which the server checks the range against; 0: not given);
    ``encoded`` is a serialized ScoreRequest
    holding only the ``hidden_states`` input, appended to the request's
    bytes (protobuf merges repeated fields of concatenated messages)."""

    def __init__(self, tensor: Any, wire_dtype: int, handle: bytes, offset: int, device_uuid: str = "",
                 allocation_bytes: int = 0) -> None:
        if len(handle) != HANDLE_BYTES:
            raise ValueError("a CUDA IPC handle is %d bytes, got %d" % (HANDLE_BYTES, len(handle)))
        self.tensor = tensor
        self.handle = handle
        self.offset = int(offset)
        self.byte_size = int(tensor.numel()) * int(tensor.element_size())
        self.device_uuid = device_uuid
        self.allocation_bytes = int(allocation_bytes)
        self.wire_dtype = wire_dtype
        self.encoded: bytes = pb2.ScoreRequest(inputs=[self.tensor_pb("hidden_states")]).SerializeToString()

    def tensor_pb(self, name: str) -> Any:
        """The ``Tensor`` named ``name`` (the tensor's wire dtype and shape)
        whose source is this reference (``Tensor.cuda_ipc``, no data)."""
        t = pb2.Tensor(name=name, dtype=self.wire_dtype, shape=[int(d) for d in self.tensor.shape])
        t.cuda_ipc.handle = self.handle
        t.cuda_ipc.offset = self.offset
        t.cuda_ipc.byte_size = self.byte_size
        t.cuda_ipc.device_uuid = self.device_uuid
        t.cuda_ipc.allocation_bytes = self.allocation_bytes
        return t


def _device_uuid(device: Any) -> str:
    import torch

    try:
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)  # torch >= 2.1
    except RuntimeError:
        return ""
    return "GPU-%s" % (uuid,) if uuid is not None else ""


def export(tensor: Any, wire_dtype: int) -> Export:
    """The reference of ``tensor`` (contiguous CUDA, from ``device_rows``);
    synchronises its device first. Raises Unavailable when the driver
    cannot export its memory."""
    import torch

    torch.cuda.synchronize(tensor.device)
    lib = _libcuda()
    with torch.cuda.device(tensor.device):
        ptr = int(tensor.data_ptr())
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        _check(lib, lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
        handle = ctypes.create_string_buffer(HANDLE_BYTES)
        _check(lib, lib.cuIpcGetMemHandle(handle, base.value), "cuIpcGetMemHandle")
    return Export(tensor, wire_dtype, handle.raw, ptr - base.value, _device_uuid(tensor.device),
                  allocation_bytes=size.value)


_warned: Optional[str] = None


def warn_fallback(reason: Any) -> None:
    """Warns (once per distinct reason) that a call sends bytes instead."""
    global _warned
    text = str(reason)
    if text != _warned:
        _warned = text
        warnings.warn("logprob_client: CUDA IPC input unavailable, sending the bytes: %s" % text, stacklevel=4)


def refused(error: Any) -> bool:
    """True when ``error`` (a LogprobError) is the server refusing a CUDA IPC
    reference (reason ``CUDA_IPC_UNAVAILABLE``: CPU workers, a client on
    another host, a worker that cannot open the handle): the caller sends
    the bytes instead."""
    return has_reason(error, pb2.CUDA_IPC_UNAVAILABLE)
