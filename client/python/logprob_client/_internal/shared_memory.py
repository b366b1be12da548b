"""Shared-memory inputs: a client on the server's host hands its tensors over
through POSIX shared memory instead of inside the gRPC message
(``RegisterSharedMemory`` and ``Tensor.shared_memory`` in
``proto/logprob/v1/logprob.proto``).

Both clients (``LogprobClient`` and ``aio.LogprobClient``) use it on their own
when ``GetServerInfo`` reports shared-memory inputs and a ``host_id`` equal to
this process's (``host_id()``), unless ``shared_memory=False``. Each request's
tensors are copied once (``np.copyto``) into a region of this client: a
``/dev/shm`` object it created (mode 0600), reserved with ``posix_fallocate``
and pre-faulted, registered once and reused. Concurrent calls each lease a
region of their own (the pool grows; a region too small is replaced by one of
the next power of two). The server copies the bytes out with ``pread`` when it
plans the request's batch: do not change a request's arrays' region while the
call runs (the client only writes a region it leased).

A region the server does not know any more (its session was idle longer than
``ServerInfo.shared_memory_idle_timeout_seconds``) gives NOT_FOUND: the part is
sent again after registering anew. If registering fails because the server
cannot use this client's regions at all (e.g. it runs in a container with its
own /dev/shm: NOT_FOUND; PERMISSION_DENIED, FAILED_PRECONDITION, ...), the
client warns once and sends inline from then on. Any other failure to get a
region (the server's region caps: RESOURCE_EXHAUSTED; UNAVAILABLE; a full
/dev/shm here) sends that one call inline, with a warning, and changes nothing
for later calls.

Registering a region proves write access to it (``docs/security.md``): the
object holds ``PROOF_BYTES`` more than the region's usable bytes, the server
answers ``RegisterSharedMemory`` with a random challenge and where to write it
(the object's last ``PROOF_BYTES``), the client writes it there and calls
``ConfirmSharedMemory``; only then does the server read the region. A server
that answers no challenge needs no confirmation.

``SharedMemoryInputs``'s methods are operations of the sans-I/O core
(``ops.py``): the client that owns it performs their RPCs.
"""

import concurrent.futures
import hashlib
import mmap
import os
import secrets
import threading
import warnings
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import grpc
import numpy as np

from ..errors import LogprobError, has_reason
from ._proto import pb2
from .channel import Metadata
from .ops import Ops, Rpc, Work
from .retry import error_of
from .splitter import Input

T = TypeVar("T")

SESSION_METADATA = "logprob-shm-session"
# Bytes of the proof of write access past a region's usable bytes (the
# challenge of RegisterSharedMemoryResponse).
PROOF_BYTES = 32
_ALIGN = 64
_MIN_REGION = 1 << 20
_PAGE = mmap.PAGESIZE

# Registration failures that mean the server cannot use this client's
# regions at all: shared memory is then off for the client.
_OFF_CODES = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)

# [(name, wire_dtype, array)]: the tensors of one request.
Tensors = Sequence[Input]
# What SharedMemoryInputs.send calls to send the request: an operation
# taking (ScoreRequest, metadata), returning (response, sends).
SendOp = Callable[[Any, Metadata], Ops[Tuple[Any, int]]]


def host_id() -> str:
    """This host's shared-memory identity, computed as the server computes
    ``ServerInfo.host_id``: the first 32 hex digits of
    SHA-256("<boot_id>:<st_dev of /dev/shm>"). "" if neither can be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().split()[0]
    except (OSError, IndexError):
        boot_id = ""
    try:
        dev = str(os.stat("/dev/shm").st_dev)
    except OSError:
        dev = ""
    if not boot_id and not dev:
        return ""
    return hashlib.sha256(("%s:%s" % (boot_id, dev)).encode()).hexdigest()[:32]


def usable(info: Any) -> bool:
    """True when the server described by ``info`` (``ServerInfo``) takes
    shared-memory inputs and shares this process's /dev/shm."""
    return bool(info.shared_memory_inputs) and bool(info.host_id) and info.host_id == host_id()


_COPIER: "Optional[concurrent.futures.ThreadPoolExecutor]" = None
_COPIER_LOCK = threading.Lock()


def _copier() -> "concurrent.futures.ThreadPoolExecutor":
    """The threads ``send_each`` copies on (created on first use)."""
    global _COPIER
    with _COPIER_LOCK:
        if _COPIER is None:
            _COPIER = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="logprob-shm-copy")
        return _COPIER


def _region_forgotten(e: LogprobError) -> bool:
    """True when ``e`` says the server does not know the call's region
    (NOT_FOUND with reason SHARED_MEMORY_REGION_NOT_REGISTERED): register
    it again and resend. Another NOT_FOUND (an unknown head) is the call's
    own answer."""
    return e.code == grpc.StatusCode.NOT_FOUND and has_reason(e, pb2.SHARED_MEMORY_REGION_NOT_REGISTERED)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class _Region:
    """One ``/dev/shm`` object of this process, mapped read-write: ``size``
    usable bytes, then ``PROOF_BYTES`` for the proof of write access."""

    def __init__(self, size: int) -> None:
        self.size = size
        total = size + PROOF_BYTES
        self.shm_name = "/logprob-py-%d-%s" % (os.getpid(), secrets.token_hex(8))
        self.name = "py-" + secrets.token_hex(6)  # the name registered with the server
        path = "/dev/shm" + self.shm_name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            # Reserve the pages: a full /dev/shm fails here, not as SIGBUS on a write.
            os.posix_fallocate(fd, 0, total)
            self.mm = mmap.mmap(fd, total)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self._finalizer = weakref.finalize(self, _unlink, path)
        # Pre-fault: one write per page, so requests pay no page faults.
        view = np.frombuffer(self.mm, dtype=np.uint8)
        view[::_PAGE] = 0
        del view

    def write(self, tensors: Tensors) -> List[Any]:
        """Copies ``[(name, wire_dtype, array)]`` one after another (64-byte
        aligned); returns their ``Tensor`` messages with references."""
        out, at = [], 0
        for name, dt, arr in tensors:
            n = int(arr.nbytes)
            if n:
                dst = np.frombuffer(self.mm, dtype=arr.dtype, count=arr.size, offset=at).reshape(arr.shape)
                np.copyto(dst, arr, casting="no")
                del dst
            t = pb2.Tensor(name=name, dtype=dt, shape=[int(d) for d in arr.shape])
            t.shared_memory.region = self.name
            t.shared_memory.offset = at
            t.shared_memory.byte_size = n
            out.append(t)
            at += _aligned(n)
        return out

    def prove(self, challenge: bytes, offset: int) -> None:
        """Writes the registration's ``challenge`` at ``offset`` (past the
        usable bytes, where the server reads it back on confirmation)."""
        if len(challenge) != PROOF_BYTES or not self.size <= offset <= len(self.mm) - PROOF_BYTES:
            raise OSError(
                "RegisterSharedMemory answered a challenge of %d bytes at offset %d of a %d-byte object"
                % (len(challenge), offset, len(self.mm))
            )
        self.mm[offset : offset + PROOF_BYTES] = challenge

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # a view still exists; the mapping goes with it
            pass
        self._finalizer()


class SharedMemoryInputs:
    """The regions and session of one client (sync or asyncio), over
    ``stub`` (a ``LogprobServiceStub`` of the client's channel); RPCs take
    ``timeout`` and ``metadata`` (the client's own, e.g. authorization, to
    which the session key is added). Thread-safe.

    ``send`` and ``close`` are operations (``ops.py``) the client drives."""

    def __init__(self, stub: Any, timeout: Optional[float], metadata: Metadata) -> None:
        self._stub = stub
        self._timeout = timeout
        self.session = secrets.token_hex(16)
        self.metadata: Tuple[Tuple[str, str], ...] = tuple(metadata or ()) + ((SESSION_METADATA, self.session),)
        self._lock = threading.Lock()  # held for bookkeeping only, never across I/O
        self._free: List[_Region] = []  # registered regions not leased
        self._all: List[_Region] = []
        self.failed: Optional[BaseException] = None  # the registration error that turned it off

    def _register(self, size: int) -> Ops[_Region]:
        region: _Region = yield Work(_Region, size, nbytes=size)
        try:
            reply = yield Rpc(
                self._stub.RegisterSharedMemory,
                pb2.RegisterSharedMemoryRequest(name=region.name, shm_name=region.shm_name, byte_size=size),
                self._timeout,
                self.metadata,
            )
        except grpc.RpcError:
            region.close()
            raise
        except BaseException:
            # Interrupted (a cancelled task): the server may hold it; close() unregisters it.
            with self._lock:
                self._all.append(region)
            raise
        if not reply.challenge:
            return region  # a server that asks for no proof
        try:
            region.prove(reply.challenge, reply.proof_offset)
            yield Rpc(
                self._stub.ConfirmSharedMemory,
                pb2.ConfirmSharedMemoryRequest(name=region.name),
                self._timeout,
                self.metadata,
            )
        except (grpc.RpcError, OSError):
            yield from self._drop(region)  # best effort: a refused proof removed it already
            raise
        except BaseException:
            with self._lock:
                self._all.append(region)
            raise
        return region

    def _lease(self, nbytes: int) -> Ops[_Region]:
        with self._lock:
            fits = [r for r in self._free if r.size >= nbytes]
            if fits:
                region = min(fits, key=lambda r: r.size)
                self._free.remove(region)
                return region
            small = self._free.pop() if self._free else None
        if small is not None:
            yield from self._drop(small)
        size = _MIN_REGION
        while size < nbytes:
            size *= 2
        region = yield from self._register(size)
        with self._lock:
            self._all.append(region)
        return region

    def _give_back(self, region: _Region) -> None:
        with self._lock:
            self._free.append(region)

    def _drop(self, region: _Region) -> Ops[None]:
        with self._lock:
            if region in self._all:
                self._all.remove(region)
        try:
            yield Rpc(
                self._stub.UnregisterSharedMemory,
                pb2.UnregisterSharedMemoryRequest(name=region.name),
                self._timeout,
                self.metadata,
            )
        except grpc.RpcError:
            pass  # expired already, or the server is gone
        finally:
            region.close()

    def _lease_failed(self, e: BaseException) -> None:
        """Judges a failure to get a region: off for the client when the
        server cannot use its regions at all, else only this call goes
        inline."""
        if isinstance(e, grpc.RpcError):
            code, message = error_of(e)
            why = "%s: %s" % (code.name, message)
            if code in _OFF_CODES:
                self.failed = e
                if code == grpc.StatusCode.PERMISSION_DENIED and "not local" in message:
                    why += (" (the server takes shared memory only from clients that reach it over loopback: on its "
                            "host, connect to 127.0.0.1:PORT or localhost:PORT, which it must listen on, e.g. "
                            "--listen 0.0.0.0:PORT)")
                warnings.warn("logprob_client: shared-memory inputs off, sending inline: " + why, stacklevel=2)
                return
        else:
            why = str(e)
        warnings.warn("logprob_client: no shared-memory region for this call, sending it inline: " + why,
                      stacklevel=2)

    def send(self, inputs: Tensors, call: "Callable[[List[Any], Metadata], Ops[T]]") -> Ops[Optional[T]]:
        """Writes ``inputs`` (``[(name, wire_dtype, array)]``) into a leased
        region and performs ``call(tensors, metadata)``: ``tensors`` are the
        inputs' ``Tensor`` messages referencing the region, ``metadata``
        carries the session; its result is returned. Returns None (nothing
        sent) when shared memory cannot be used; the caller then sends the
        bytes."""
        if self.failed is not None:
            return None
        nbytes = sum(_aligned(int(a.nbytes)) for _, _, a in inputs)
        for again in (False, True):
            try:
                region = yield from self._lease(max(nbytes, 1))
            except (grpc.RpcError, OSError) as e:
                self._lease_failed(e)
                return None
            leased = True
            try:
                tensors = yield Work(region.write, inputs, nbytes=nbytes)
                return (yield from call(tensors, self.metadata))
            except LogprobError as e:
                # The server forgot the region (idle session): register anew,
                # once. Any other error (a NOT_FOUND head too) is the call's.
                if not _region_forgotten(e) or again:
                    raise
                leased = False
                yield from self._drop(region)
            finally:
                if leased:
                    self._give_back(region)
        return None  # not reached: the second try returns or raises

    def send_each(self, batches: Sequence[Tensors],
                  call: "Callable[[int, List[Any], Metadata], Ops[T]]") -> Ops[List[Optional[T]]]:
        """``send`` of each of ``batches`` in turn (``call(i, tensors,
        metadata)``), with the copy of batch i + 1 into a second region, on
        a copying thread (numpy's copy releases the GIL), overlapping the
        call of batch i: a large transfer (an lm_head update's puts) takes
        about the longer of the two instead of their sum. Returns each
        batch's result, None for a batch not sent (shared memory off, or no
        region): the caller sends those as bytes. A region the server
        forgot (NOT_FOUND) sends the remaining batches through ``send``,
        which registers anew."""
        results: List[Optional[T]] = [None] * len(batches)
        if self.failed is not None or not batches:
            return results
        nbytes = max(sum(_aligned(int(a.nbytes)) for _, _, a in b) for b in batches)
        regions: List[_Region] = []
        for _ in range(min(2, len(batches))):
            try:
                regions.append((yield from self._lease(max(nbytes, 1))))
            except (grpc.RpcError, OSError) as e:
                if not regions:
                    self._lease_failed(e)
                    return results
                break
        pending: "Optional[concurrent.futures.Future[List[Any]]]" = None
        resume_at = len(batches)
        try:
            pending = _copier().submit(regions[0].write, batches[0])
            for i in range(len(batches)):
                copied, pending = pending, None
                assert copied is not None  # each iteration's batch was submitted before it
                tensors = yield Work(copied.result, nbytes=nbytes)  # the asyncio client waits off its loop
                if i + 1 < len(batches):
                    if len(regions) > 1:
                        pending = _copier().submit(regions[(i + 1) % 2].write, batches[i + 1])
                try:
                    results[i] = yield from call(i, tensors, self.metadata)
                except LogprobError as e:
                    if not _region_forgotten(e):
                        raise
                    resume_at = i
                    break
                if pending is None and i + 1 < len(batches):  # one region: copy after the call
                    pending = _copier().submit(regions[0].write, batches[i + 1])
        finally:
            if pending is not None:  # a copy into a region must end before the region is leased again
                concurrent.futures.wait([pending])
            if resume_at == len(batches):
                for r in regions:
                    self._give_back(r)
        if resume_at < len(batches):
            for r in regions:  # forgotten by the server
                yield from self._drop(r)
            for i in range(resume_at, len(batches)):
                def again(tensors: List[Any], metadata: Metadata, i: int = i) -> Ops[T]:
                    return call(i, tensors, metadata)

                results[i] = yield from self.send(batches[i], again)
        return results

    def close(self) -> Ops[None]:
        """Unregisters and removes every region (best effort)."""
        with self._lock:
            regions, self._all, self._free = list(self._all), [], []
        for r in regions:
            yield from self._drop(r)
