"""The lm_head gradient steps of the service (docs/gradients.md): reading a
step's dL/dW [V, H] and dL/db [V] sums (``ReadHeadGradients``, answered in
pieces of a few MiB, assembled here into one float32 array) and closing the
step (``CloseHeadGradientStep``). Written once as operations of the
sans-I/O core (``ops.py``); the sync and asyncio clients perform them."""

from typing import Any, Optional, Tuple

import grpc
import numpy as np

from ..errors import LogprobError
from ._proto import pb2
from .ops import Ops, retried

READ_METHOD = "/logprob.v1.LogprobService/ReadHeadGradients"


class HeadGradients:
    """One step's sums as read: ``weight`` float32 [rows, H] (rows
    ``row_begin`` .. ``row_begin + len(weight)`` of dL/dW), ``bias``
    float32 [rows] or None (a head without a bias), and what the sums
    cover: ``head``, ``head_version``, ``micro_batches`` (backwards added),
    ``tokens`` (their token rows), ``vocab_size`` (V)."""

    def __init__(self, weight: Any, bias: Optional[Any], row_begin: int, head: str, head_version: str,
                 micro_batches: int, tokens: int, vocab_size: int) -> None:
        self.weight = weight
        self.bias = bias
        self.row_begin = row_begin
        self.head = head
        self.head_version = head_version
        self.micro_batches = micro_batches
        self.tokens = tokens
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        return "HeadGradients(head=%r, version=%r, weight=%s, bias=%s, micro_batches=%d, tokens=%d)" % (
            self.head, self.head_version, list(self.weight.shape),
            None if self.bias is None else list(self.bias.shape), self.micro_batches, self.tokens)


class GradientAssembler:
    """Writes the pieces of one ReadHeadGradients answer into one array per
    sum, checking that they arrive in order, cover the rows asked and no
    more (INTERNAL otherwise)."""

    def __init__(self, row_begin: int, row_end: int) -> None:
        self._begin, self._end = row_begin, row_end
        self._next = row_begin
        self._first: Any = None
        self._weight: Any = None
        self._bias: Any = None

    def feed(self, piece: Any) -> None:
        if self._first is None:
            self._first = piece
            end = self._end if self._end or self._begin else piece.vocab_size
            self._end = end
            rows = end - self._begin
            self._weight = np.empty((rows, piece.hidden_size), dtype=np.float32)
            self._bias = np.empty((rows,), dtype=np.float32) if piece.has_bias else None
        H = self._weight.shape[1]
        w = np.frombuffer(piece.weight, dtype="<f4")
        n = w.size // H if H else 0
        if piece.row_begin != self._next or w.size != n * H or self._next + n > self._end:
            raise LogprobError(grpc.StatusCode.INTERNAL, "ReadHeadGradients: piece of rows %d+%d out of order "
                               "(expected row %d of [%d, %d))" % (piece.row_begin, n, self._next, self._begin,
                                                                   self._end))
        at = self._next - self._begin
        self._weight[at:at + n] = w.reshape(n, H)
        if self._bias is not None:
            b = np.frombuffer(piece.bias, dtype="<f4")
            if b.size != n:
                raise LogprobError(grpc.StatusCode.INTERNAL, "ReadHeadGradients: a piece's bias has %d of %d rows"
                                   % (b.size, n))
            self._bias[at:at + n] = b
        self._next += n

    def result(self) -> HeadGradients:
        if self._first is None or self._next != self._end:
            raise LogprobError(grpc.StatusCode.INTERNAL, "ReadHeadGradients ended at row %d of [%d, %d)" % (
                self._next, self._begin, self._end))
        f = self._first
        return HeadGradients(self._weight, self._bias, self._begin, f.head, f.head_version, int(f.micro_batches),
                             int(f.tokens), int(f.vocab_size))


def _span(rows: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    if rows is None:
        return 0, 0
    begin, end = int(rows[0]), int(rows[1])
    if begin < 0 or end < begin:
        raise ValueError("rows must be (begin, end) with 0 <= begin <= end, got %r" % (rows,))
    return begin, end


class ReadGradients:
    """``method`` (the unary-stream ReadHeadGradients of a ``grpc``
    channel), called like a unary one: ``call(request, timeout=,
    metadata=)`` returns the assembled ``HeadGradients``."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def __call__(self, request: Any, timeout: Optional[float] = None, metadata: Any = None) -> HeadGradients:
        assembler = GradientAssembler(request.row_begin, request.row_end)
        for piece in self._method(request, timeout=timeout, metadata=metadata):
            assembler.feed(piece)
        return assembler.result()


class AioReadGradients:
    """The asyncio twin of ``ReadGradients`` (a ``grpc.aio`` channel's
    method); cancelling the awaiting task cancels the RPC."""

    def __init__(self, method: Any) -> None:
        self._method = method

    async def __call__(self, request: Any, timeout: Optional[float] = None, metadata: Any = None) -> HeadGradients:
        assembler = GradientAssembler(request.row_begin, request.row_end)
        call = self._method(request, timeout=timeout, metadata=metadata)
        try:
            async for piece in call:
                assembler.feed(piece)
        finally:
            call.cancel()
        return assembler.result()


def open_method(channel: Any) -> Any:
    """ReadHeadGradients of ``channel`` (grpc or grpc.aio): responses parsed."""
    return channel.unary_stream(READ_METHOD, request_serializer=pb2.ReadHeadGradientsRequest.SerializeToString,
                                response_deserializer=pb2.HeadGradientsChunk.FromString)


def read_ops(client: Any, step: str, head: str, rows: Optional[Tuple[int, int]], timeout: Any) -> Ops[HeadGradients]:
    """``read_head_gradients``: the step's sums (retried: a read changes
    nothing)."""
    begin, end = _span(rows)
    req = pb2.ReadHeadGradientsRequest(gradient_step=str(step), head=str(head or ""), row_begin=begin, row_end=end)
    got, _ = yield from retried(client._read_gradients_rpc, req, client._attempts(client._deadline(timeout)),
                                client._metadata)
    return got  # type: ignore[no-any-return]


def close_ops(client: Any, step: str, timeout: Any) -> Ops[None]:
    """``close_gradient_step`` (retried: closing a closed step is OK)."""
    req = pb2.CloseHeadGradientStepRequest(gradient_step=str(step))
    yield from retried(client._stub.CloseHeadGradientStep, req, client._attempts(client._deadline(timeout)),
                       client._metadata)
