"""Python client of the logprob scoring service (``logprob.v1.LogprobService``).

Scores numpy / torch batches of logits or hidden states for RL rollout
workers: token logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1,
top-k and gathered logprobs (semantics in
docs/SPEC.md), splitting batches larger than the server's limits into
requests of whole sequences, retrying UNAVAILABLE / RESOURCE_EXHAUSTED with
exponential backoff and jitter within one deadline per call, over TLS /
mutual TLS with a bearer token. ``logprob_client.LogprobClient`` is
synchronous (thread-safe); ``logprob_client.aio.LogprobClient`` is the
asyncio twin. torch tensors in give torch tensors out (on the input's
device); numpy in gives numpy out.

Example::

    import numpy as np
    from logprob_client import LogprobClient

    with LogprobClient("127.0.0.1:50051", timeout=30) as client:
        res = client.score(logits=logits,          # [B, S, V] f32/f16/bf16
                           input_ids=input_ids,    # [B, S]
                           seq_lens=lengths,       # [B] (optional)
                           entropy=True, topk=4)
        res.token_logprobs   # [B, S - 1] float32
        res.entropy          # [B, S - 1]
        res.topk_indices     # [B, S - 1, 4] int64
"""

from ._internal._proto import pb2 as logprob_pb2
from ._internal._proto import pb2_grpc as logprob_pb2_grpc
from ._internal.distill import DistillResult
from ._internal.lm_head_sender import LmHeadUpdateHandle
from ._internal.request import DEFAULT_MAX_REQUEST_BYTES, REQUEST_FILL
from ._internal.result import ScoreResult, split_sequences
from ._internal.retry import RetryPolicy
from ._internal.tensors import bf16_bits_to_float32, float32_to_bf16_bits
from .client import LogprobClient
from .errors import InvalidInputError, LogprobError

__all__ = [
    "LogprobClient",
    "RetryPolicy",
    "ScoreResult",
    "DistillResult",
    "LogprobError",
    "InvalidInputError",
    "LmHeadUpdateHandle",
    "split_sequences",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
    "logprob_pb2",
    "logprob_pb2_grpc",
    "REQUEST_FILL",
    "DEFAULT_MAX_REQUEST_BYTES",
]
