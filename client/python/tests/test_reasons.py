"""Error reasons end to end (issue 31 item 7), Python side:

- the client's reason table is the generated ``logprob.v1.ErrorReason``
  enum, and no module of the client compares a reason by a string literal;
- a CUDA IPC call refused for another reason (a worker lacking the head:
  FAILED_PRECONDITION, ``LM_HEAD_VERSION_UNAVAILABLE``) is not sent again as
  bytes; only ``CUDA_IPC_UNAVAILABLE`` is (CUDA cannot run here: a fake
  device tensor, as in test_cuda_ipc.DecisionTest);
- a reason in a ScoreStream response, and the reasons of the shared-memory
  RPCs of a live CPU server, reach the caller's error.
"""

import ast
import glob
import os
import unittest
import warnings

import grpc
import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import Server

import logprob_client
from logprob_client import LogprobError, errors
from logprob_client._internal import cuda_ipc
from logprob_client import logprob_pb2 as pb2
from logprob_client._internal.request import ScoreCall, status_error
from logprob_client._internal.retry import reason_of

from test_cuda_ipc import FakeCudaTensor

SESSION = (("logprob-shm-session", "session-reasons-0123456789ab"),)


def error(reason):
    """A FAILED_PRECONDITION LogprobError with ``reason`` (an enum value)."""
    return LogprobError(grpc.StatusCode.FAILED_PRECONDITION, "refused (test)", reason=errors.reason_name(reason))


class ReasonsTest(unittest.TestCase):
    def test_the_reason_table_is_the_proto_enum(self):
        names = set(pb2.ErrorReason.keys())
        self.assertEqual(errors.REASONS, names - {"ERROR_REASON_UNSPECIFIED"})
        self.assertIn("SHARED_MEMORY_REGION_NOT_REGISTERED", errors.REASONS)
        self.assertEqual(errors.reason_name(pb2.CUDA_IPC_UNAVAILABLE), "CUDA_IPC_UNAVAILABLE")
        self.assertEqual(errors.reason_name(0), "")
        self.assertEqual(errors.reason_name(9999), "9999", "a reason newer than this client")
        self.assertTrue(errors.has_reason(error(pb2.AT_CAPACITY), pb2.AT_CAPACITY))
        self.assertFalse(errors.has_reason(error(pb2.AT_CAPACITY), pb2.NO_LM_HEAD))
        self.assertFalse(errors.has_reason(ValueError("x"), pb2.AT_CAPACITY))

    def test_no_module_names_a_reason_by_a_literal(self):
        names = set(pb2.ErrorReason.keys())
        root = os.path.dirname(logprob_client.__file__)
        found = []
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            if "_generated" in path:
                continue
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                    found.append("%s:%d %r" % (os.path.basename(path), node.lineno, node.value))
        self.assertEqual(found, [], "compare reasons through the enum (errors.has_reason)")

    def test_only_a_cuda_ipc_refusal_sends_the_call_again_as_bytes(self):
        real = cuda_ipc.device_rows
        cuda_ipc.device_rows = lambda x, dtype=None: (pb2.F32, x)
        try:
            dev = FakeCudaTensor(np.zeros((5, 8), np.float32))
            call = ScoreCall("r1", None, np.arange(5), hidden_states=dev, cu_seqlens=[0, 5], cuda_ipc=True)
            # The worker lacks the head (or any other refusal): the call is
            # not sent again as bytes, the error is the caller's.
            for reason in (pb2.LM_HEAD_VERSION_UNAVAILABLE, pb2.NO_LM_HEAD, 0):
                self.assertFalse(cuda_ipc.refused(error(reason)), reason)
                self.assertFalse(call.refused(error(reason)), reason)
                self.assertTrue(call._on_device, "still a CUDA IPC reference")
            # A worker that cannot open the handle: the call goes as bytes.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.assertTrue(call.refused(error(pb2.CUDA_IPC_UNAVAILABLE)))
            self.assertFalse(call._on_device)
        finally:
            cuda_ipc.device_rows = real

    def test_a_stream_responses_reason_reaches_the_error(self):
        resp = pb2.ScoreResponse(id="r", status_code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                 status_message="worker 0: this worker holds no lm_head 'default' version 'v2'",
                                 status_reason=pb2.LM_HEAD_VERSION_UNAVAILABLE)
        e = status_error(resp)
        self.assertEqual((e.code, e.reason), (grpc.StatusCode.FAILED_PRECONDITION, "LM_HEAD_VERSION_UNAVAILABLE"))
        self.assertTrue(errors.has_reason(e, pb2.LM_HEAD_VERSION_UNAVAILABLE))
        self.assertFalse(cuda_ipc.refused(e))


class SharedMemoryReasonsTest(unittest.TestCase):
    """The shared-memory RPCs of a live CPU server send their reasons."""

    def test_shared_memory_rpcs_send_their_reasons(self):
        with Server(workers=1) as server, server.client() as client:
            with self.assertRaises(grpc.RpcError) as e:
                client._stub.ConfirmSharedMemory(pb2.ConfirmSharedMemoryRequest(name="never"), metadata=SESSION)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            self.assertEqual(reason_of(e.exception), "SHARED_MEMORY_REGION_NOT_REGISTERED")
            with self.assertRaises(grpc.RpcError) as e:
                client._stub.RegisterSharedMemory(pb2.RegisterSharedMemoryRequest(
                    name="gone", shm_name="/reasons-py-no-such-object", byte_size=4096), metadata=SESSION)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            self.assertEqual(reason_of(e.exception), "SHARED_MEMORY_UNAVAILABLE")
        with Server(workers=1, extra=["--shared-memory-inputs=false"]) as server, server.client() as client:
            with self.assertRaises(grpc.RpcError) as e:
                client._stub.ListSharedMemory(pb2.ListSharedMemoryRequest(), metadata=SESSION)
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertEqual(reason_of(e.exception), "SHARED_MEMORY_UNAVAILABLE")


if __name__ == "__main__":
    unittest.main()
