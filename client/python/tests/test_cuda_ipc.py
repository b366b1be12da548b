"""CUDA IPC inputs of the Python client (logprob_client/_internal/cuda_ipc.py):

- DecisionTest (no server): the decision both clients make, with fakes (a
  tensor-like object claiming ``is_cuda``, ServerInfo messages with and
  without the feature, of this host or another), and the request bytes of a
  part carrying a CUDA IPC reference;
- CpuServerTest: against a CPU server (which reports ``cuda_ipc_inputs``
  false), a fake CUDA tensor is sent as bytes with the results of numpy
  input; a hand-made reference is refused with FAILED_PRECONDITION saying
  why and what to send instead, a malformed one with INVALID_ARGUMENT; a
  client made to send a reference (patched decision and export) gets the
  refusal and sends that call again as bytes, leaving the client's
  ``cuda_ipc`` as it was (sync and asyncio);
- GpuTest (skipped without a CUDA device and a CUDA build): a torch CUDA
  tensor scored through a ``--backend cuda`` server by CUDA IPC is bitwise
  the result of sending its bytes, and matches the golden expectation;
- UpdateRowsTest: ``update_lm_head`` with a CUDA weight makes the same
  decision (``cuda_ipc.offered``); against a CPU server with updates a
  reference is refused (FAILED_PRECONDITION, CUDA_IPC_UNAVAILABLE, "send the
  rows as bytes") and the client sends the rows again as bytes, sync and
  asyncio; host weights never export;
- GpuUpdateTest (skipped like GpuTest): a head updated from a torch CUDA
  tensor by CUDA IPC scores bitwise as a server started with those weights.
"""

import asyncio
import contextlib
import os
import unittest
import warnings

import hashlib

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import BIN_DIR, GOLDEN_DIR, Golden, Server, compare, temp_dir

from logprob_client import LogprobError
from logprob_client import aio
from logprob_client import lm_head_update, safetensors
from logprob_client._internal import cuda_ipc, shared_memory
from logprob_client import logprob_pb2 as pb2
from logprob_client._internal.request import Limits, ScoreCall

import grpc

LM_HEAD = os.path.join(GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")


class FakeCudaTensor:
    """A tensor-like object that claims to live on a GPU; its values come
    from a numpy array (``__array__``, what the bytes path reads)."""

    is_cuda = True

    def __init__(self, arr):
        self.arr = np.asarray(arr)
        self.shape = self.arr.shape
        self.ndim = self.arr.ndim

    def data_ptr(self):
        return 0

    def dim(self):
        return self.ndim

    def numel(self):
        return int(self.arr.size)

    def element_size(self):
        return int(self.arr.itemsize)

    def __array__(self, dtype=None, copy=None):
        return self.arr if dtype is None else self.arr.astype(dtype)


def info(feature, host):
    return pb2.ServerInfo(cuda_ipc_inputs=feature, host_id=host, max_request_bytes=1 << 30,
                          max_tokens_per_request=1 << 20)


class DecisionTest(unittest.TestCase):
    def test_uses_cuda_ipc_only_when_everything_holds(self):
        here = shared_memory.host_id()
        self.assertTrue(here, "this test needs /proc/sys/kernel/random/boot_id or /dev/shm")
        gpu = FakeCudaTensor(np.zeros((2, 4), np.float32))
        cpu = np.zeros((2, 4), np.float32)
        self.assertTrue(cuda_ipc.use_cuda_ipc(True, info(True, here), "hidden_states", gpu))
        # Each condition alone turns it off.
        self.assertFalse(cuda_ipc.use_cuda_ipc(False, info(True, here), "hidden_states", gpu), "option off")
        self.assertFalse(cuda_ipc.use_cuda_ipc(True, info(False, here), "hidden_states", gpu), "server without it")
        self.assertFalse(cuda_ipc.use_cuda_ipc(True, info(True, "0" * 32), "hidden_states", gpu), "another host")
        self.assertFalse(cuda_ipc.use_cuda_ipc(True, info(True, ""), "hidden_states", gpu), "no host id")
        self.assertFalse(cuda_ipc.use_cuda_ipc(True, info(True, here), "logits", gpu), "logits")
        self.assertFalse(cuda_ipc.use_cuda_ipc(True, info(True, here), "hidden_states", cpu), "host array")
        self.assertFalse(cuda_ipc.use_cuda_ipc(True, info(True, here), "hidden_states", None), "no tensor")
        # An old server's ServerInfo has no such field at all.
        self.assertFalse(cuda_ipc.server_accepts(object.__new__(type("Old", (), {"host_id": here}))))

    def test_client_option_and_per_call_override(self):
        client_on = object.__new__(aio.LogprobClient)
        client_on.cuda_ipc = True
        gpu = FakeCudaTensor(np.zeros((2, 4), np.float32))
        opts = {"hidden_states": gpu, "cuda_ipc": False}
        self.assertFalse(client_on._cuda_ipc_candidate(opts))
        self.assertNotIn("cuda_ipc", opts, "the per-call option is consumed")
        self.assertTrue(client_on._cuda_ipc_candidate({"hidden_states": gpu}))
        client_on.cuda_ipc = False
        self.assertFalse(client_on._cuda_ipc_candidate({"hidden_states": gpu}))
        self.assertTrue(client_on._cuda_ipc_candidate({"hidden_states": gpu, "cuda_ipc": True}))

    def test_a_part_with_a_reference_carries_it_instead_of_the_bytes(self):
        # A part built by hand as ScoreCall.parts builds it on a GPU machine.
        hidden = np.zeros((5, 8), np.float32)
        call = ScoreCall("r1", None, np.arange(5), hidden_states=hidden, cu_seqlens=[0, 5])
        rows = call.inputs.rows
        small = [t for t in call.inputs.tensors if t[0] != "hidden_states"]
        from logprob_client._internal import splitter
        from logprob_client._internal.request import Part

        dev = FakeCudaTensor(np.zeros((5, 8), np.float32))  # what export() sees of a contiguous CUDA tensor
        ref = cuda_ipc.Export(dev, pb2.F32, b"h" * 64, 4096, "GPU-test", allocation_bytes=8192)
        part = Part("r1", splitter.Inputs(small, call.inputs.options, rows=rows), 1, 1, False, cuda_ipc=ref)
        req = pb2.ScoreRequest.FromString(part.serialized(1 << 20))
        by_name = {t.name: t for t in req.inputs}
        self.assertEqual(sorted(by_name), ["cu_seqlens", "hidden_states", "input_ids"])
        h = by_name["hidden_states"]
        self.assertEqual((h.dtype, list(h.shape), h.data), (pb2.F32, [5, 8], b""))
        self.assertEqual((h.cuda_ipc.handle, h.cuda_ipc.offset, h.cuda_ipc.byte_size, h.cuda_ipc.device_uuid,
                          h.cuda_ipc.allocation_bytes), (b"h" * 64, 4096, 160, "GPU-test", 8192))
        self.assertEqual(np.frombuffer(by_name["input_ids"].data, np.int64).tolist(), [0, 1, 2, 3, 4])
        with self.assertRaises(ValueError):
            cuda_ipc.Export(dev, pb2.F32, b"short", 0)

    def test_update_rows_make_the_same_decision(self):
        here = shared_memory.host_id()
        gpu = FakeCudaTensor(np.zeros((3, 4), np.float32))
        for enabled, inf, x, want in (
                (True, info(True, here), gpu, True),
                (False, info(True, here), gpu, False),
                (True, info(False, here), gpu, False),
                (True, info(True, "0" * 32), gpu, False),
                (True, info(True, here), np.zeros((3, 4), np.float32), False)):
            self.assertEqual(cuda_ipc.offered(enabled, inf, x), want)
            self.assertEqual(cuda_ipc.use_cuda_ipc(enabled, inf, "hidden_states", x), want)

    def test_update_rows_by_reference_carry_it_instead_of_bytes(self):
        dev = FakeCudaTensor(np.zeros((3, 4), np.uint16))  # a contiguous [3, 4] bf16 CUDA tensor, as export() sees it
        ref = cuda_ipc.Export(dev, pb2.BF16, b"r" * 64, 512, "GPU-x", allocation_bytes=536)
        parts = list(lm_head_update.lm_head_ipc_parts("u1", 7, ref))
        self.assertEqual(len(parts), 1, "one part: no pieces follow a reference")
        rows = pb2.LmHeadRowsPart.FromString(parts[0]).rows
        self.assertEqual((rows.update_id, rows.row_begin), ("u1", 7))
        t = rows.rows
        self.assertEqual((t.name, t.dtype, list(t.shape), t.data), ("rows", pb2.BF16, [3, 4], b""))
        self.assertEqual((t.cuda_ipc.handle, t.cuda_ipc.offset, t.cuda_ipc.byte_size, t.cuda_ipc.device_uuid,
                          t.cuda_ipc.allocation_bytes), (b"r" * 64, 512, 24, "GPU-x", 536))
        # The scoring request's encoding is unchanged.
        h = pb2.ScoreRequest.FromString(ref.encoded).inputs[0]
        self.assertEqual((h.name, h.cuda_ipc.byte_size), ("hidden_states", 24))

    def test_sampling_filters_send_bytes(self):
        # The filtered path exchanges full logits rows through host memory:
        # a call with sampling_top_k or sampling_top_p never takes the device
        # path, even when the client decided for CUDA IPC.
        hidden = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
        for filters in ({"sampling_top_k": 20}, {"sampling_top_p": 0.9}):
            call = ScoreCall("r3", None, np.arange(5), hidden_states=hidden, cu_seqlens=[0, 5], cuda_ipc=True,
                             **filters)
            self.assertFalse(call._on_device, filters)
            parts = call.parts(Limits(pb2.ServerInfo(max_request_bytes=1 << 20)))
            self.assertTrue(all(p.cuda_ipc is None for p in parts), filters)
            self.assertTrue(np.array_equal(parts[0].inputs.get("hidden_states")[2], hidden), filters)

    def test_too_many_tokens_fall_back_to_bytes(self):
        # A call over max_tokens_per_request is split, which only bytes can be:
        # the device rows are copied to the host (a fake: its numpy values).
        hidden = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
        call = ScoreCall("r2", None, np.arange(6), hidden_states=hidden, cu_seqlens=[0, 3, 6])
        call._on_device = True
        call.inputs = type(call.inputs)(call.inputs.tensors[1:], call.inputs.options,
                                        rows=("hidden_states", pb2.F32, FakeCudaTensor(hidden)))
        limits = Limits(pb2.ServerInfo(max_request_bytes=1 << 20, max_tokens_per_request=3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parts = call.parts(limits)
        messages = [str(w.message) for w in caught]
        self.assertTrue(any("max_tokens_per_request" in m for m in messages), messages)
        self.assertEqual(len(parts), 2)
        self.assertTrue(all(p.cuda_ipc is None for p in parts))
        got = np.concatenate([p.inputs.get("hidden_states")[2] for p in parts])
        self.assertTrue(np.array_equal(got, hidden))


class CpuServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD])

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def test_server_info_and_fake_cuda_tensor_go_as_bytes(self):
        g = Golden("hidden_bf16")
        with self.server.client() as client:
            i = client.server_info()
            self.assertFalse(i.cuda_ipc_inputs, "CPU workers")
            self.assertEqual(i.host_id, shared_memory.host_id())
            kw = g.score_kwargs()
            ref = client.score(**kw)
            self.assertEqual(compare(g.expected, ref.outputs), "")
            kw["hidden_states"] = FakeCudaTensor(kw["hidden_states"])
            got = client.score(**kw)
            for k, v in ref.outputs.items():
                self.assertTrue(np.array_equal(v, got.outputs[k], equal_nan=True), k)

    def test_a_refused_reference_goes_again_as_bytes(self):
        # The client believes the server takes CUDA IPC (patched decision and
        # export, a fake device tensor): the CPU server refuses the reference
        # and the call is sent again with bytes. The fallback is the call's
        # alone: the client's cuda_ipc stays True (a client shared by threads
        # or tasks is not changed by one call), so the next call sends a
        # reference again.
        g = Golden("hidden_bf16")
        kw = g.score_kwargs()
        real = (cuda_ipc.server_accepts, cuda_ipc.device_rows, cuda_ipc.export)
        exported = []

        def fake_export(t, dt):
            exported.append(t)
            return cuda_ipc.Export(t, dt, b"\x01" * 64, 0)

        cuda_ipc.server_accepts = lambda info: True
        cuda_ipc.device_rows = lambda x, dtype=None: (pb2.BF16, x)
        cuda_ipc.export = fake_export
        try:
            with self.server.client() as client:
                ref = client.score(**dict(kw, cuda_ipc=False))
                self.assertEqual(exported, [])
                fake = dict(kw, hidden_states=FakeCudaTensor(kw["hidden_states"]))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    got = client.score(**fake)
                self.assertEqual(len(exported), 1, "sent by reference first")
                self.assertTrue(any("CPU backend" in str(w.message) for w in caught), [str(w.message) for w in caught])
                self.assertTrue(client.cuda_ipc, "the client's option is unchanged by one call's fallback")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    again = client.score(**fake)
                self.assertEqual(len(exported), 2, "the next call sends a reference again")
                self.assertTrue(client.cuda_ipc)
                for res in (got, again):
                    for k, v in ref.outputs.items():
                        self.assertTrue(np.array_equal(v, res.outputs[k], equal_nan=True), k)

            async def run_aio():
                async with aio.LogprobClient(self.server.address) as client:
                    first = await client.score(**fake)
                    second = await client.score(**fake)
                    return [first, second], client.cuda_ipc

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results, still = asyncio.run(run_aio())
            self.assertEqual(len(exported), 4, "the asyncio client sent a reference in each call too")
            self.assertTrue(still)
            for res in results:
                for k, v in ref.outputs.items():
                    self.assertTrue(np.array_equal(v, res.outputs[k], equal_nan=True), k)
        finally:
            cuda_ipc.server_accepts, cuda_ipc.device_rows, cuda_ipc.export = real

    def _request(self, g, handle=b"\x01" * 64, byte_size=None, name="hidden_states", offset=0, allocation_bytes=0):
        req = pb2.ScoreRequest(id="ipc")
        for key in ("hidden_states", "input_ids", "cu_seqlens", "seq_lens"):
            if key not in g.inputs:
                continue
            arr = g.inputs[key]
            dt = {"BF16": pb2.BF16, "I64": pb2.I64, "I32": pb2.I32, "F32": pb2.F32}[g.dtypes[key]]
            t = req.inputs.add(name=key, dtype=dt, shape=list(arr.shape))
            if key == name:
                t.cuda_ipc.handle = handle
                t.cuda_ipc.byte_size = arr.nbytes if byte_size is None else byte_size
                t.cuda_ipc.offset = offset
                t.cuda_ipc.allocation_bytes = allocation_bytes
            else:
                t.data = arr.tobytes()
        return req

    def test_references_are_refused_with_the_reason(self):
        g = Golden("hidden_bf16")
        with self.server.client() as client:
            with self.assertRaises(LogprobError) as e:
                client.score_request(self._request(g))
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertEqual(e.exception.reason, "CUDA_IPC_UNAVAILABLE")
            self.assertIn("CPU backend", str(e.exception))
            self.assertIn("send the hidden states as bytes", str(e.exception))
            for bad, what in (
                (self._request(g, handle=b"\x01" * 63), "63 bytes"),
                (self._request(g, byte_size=2), "byte_size is 2"),
                (self._request(g, name="input_ids"), "only accepted for \"hidden_states\""),
                # Past the allocation's size the client sent (it ends 2 bytes early).
                (self._request(g, offset=256, allocation_bytes=256 + g.inputs["hidden_states"].nbytes - 2),
                 "bytes [256, 256 + %d) are outside the allocation of %d bytes (allocation_bytes)"
                 % (g.inputs["hidden_states"].nbytes, 256 + g.inputs["hidden_states"].nbytes - 2)),
            ):
                with self.subTest(what=what):
                    with self.assertRaises(LogprobError) as e:
                        client.score_request(bad)
                    self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                    self.assertEqual(e.exception.reason, "", "a malformed reference is no reason to fall back")
                    self.assertIn(what, str(e.exception))


class UpdateRowsTest(unittest.TestCase):
    """update_lm_head with a CUDA weight against a CPU server that takes
    updates: the server refuses the reference, the rows go again as bytes."""

    @classmethod
    def setUpClass(cls):
        cls.golden = safetensors.load(LM_HEAD)[0]["lm_head.weight"]  # uint16 bf16 bits
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD, "--allow-lm-head-updates"])

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def weights(self, seed):
        return (self.golden ^ np.uint16(seed)).astype(np.uint16)  # other bf16 bits of the same shape

    def head(self, client):
        return [h for h in client.lm_heads() if h.name == "default"][0]

    def test_a_refused_reference_goes_again_as_bytes(self):
        real = (cuda_ipc.server_accepts, cuda_ipc.device_rows, cuda_ipc.export)
        exported = []

        def fake_export(t, dt):
            exported.append(t)
            return cuda_ipc.Export(t, dt, b"\x01" * 64, 0)

        cuda_ipc.server_accepts = lambda info: True
        cuda_ipc.device_rows = lambda x, dtype=None, name="hidden_states": (pb2.BF16, x)
        cuda_ipc.export = fake_export
        try:
            with self.server.client() as client:
                w = self.weights(1)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    self.assertEqual(client.update_lm_head("default", FakeCudaTensor(w), version="ipc-1",
                                                           dtype="bf16"), "ipc-1")
                self.assertEqual(len(exported), 1, "sent by reference first")
                messages = [str(m.message) for m in caught]
                self.assertTrue(any("CPU backend" in m and "send the rows as bytes" in m for m in messages), messages)
                self.assertTrue(client.cuda_ipc, "the client's option is unchanged by one update's fallback")
                h = support.hashed_head(client, "default")
                self.assertEqual((h.version, h.sha256), ("ipc-1", hashlib.sha256(w.tobytes()).hexdigest()))
                # A host weight never takes the device path.
                self.assertEqual(client.update_lm_head("default", self.weights(2), version="host", dtype="bf16"),
                                 "host")
                self.assertEqual(len(exported), 1)

            async def run_aio():
                async with aio.LogprobClient(self.server.address) as client:
                    version = await client.update_lm_head("default", FakeCudaTensor(self.weights(3)),
                                                          version="ipc-aio", dtype="bf16")
                    return version, [h for h in await client.lm_heads() if h.name == "default"][0]

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                version, h = asyncio.run(run_aio())
            self.assertEqual(len(exported), 2, "the asyncio client sent a reference too")
            with self.server.client() as client:
                h = support.hashed_head(client, "default")
            self.assertEqual((version, h.version, h.sha256),
                             ("ipc-aio", "ipc-aio", hashlib.sha256(self.weights(3).tobytes()).hexdigest()))
        finally:
            cuda_ipc.server_accepts, cuda_ipc.device_rows, cuda_ipc.export = real

    def test_a_raw_reference_is_refused_with_the_reason_and_changes_nothing(self):
        with self.server.client() as client:
            before = self.head(client)
            V, H = self.golden.shape
            upd = client._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                head="default", version="raw", vocab_size=V, hidden_size=H, dtype=pb2.BF16))
            rows = pb2.Tensor(name="rows", dtype=pb2.BF16, shape=[V, H])
            rows.cuda_ipc.handle = b"\x01" * 64
            rows.cuda_ipc.byte_size = V * H * 2
            with self.assertRaises(grpc.RpcError) as e:
                client._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                    update_id=upd.update_id, rows=rows))]))
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("send the rows as bytes", e.exception.details())
            reasons = [v for k, v in (e.exception.trailing_metadata() or ()) if k == "logprob-error-reason"]
            self.assertEqual(reasons, ["CUDA_IPC_UNAVAILABLE"])
            # Nothing was taken: the same rows come as bytes and commit.
            w = self.weights(4)
            client._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                update_id=upd.update_id,
                rows=pb2.Tensor(name="rows", dtype=pb2.BF16, shape=[V, H], data=w.tobytes())))]))
            self.assertEqual(self.head(client).version, before.version, "nothing changes before the commit")
            client._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
            self.assertEqual(support.hashed_head(client, "default").sha256, hashlib.sha256(w.tobytes()).hexdigest())


def _cuda_ready():
    """Why GpuTest cannot run, or None."""
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no CUDA device for torch"
    if not os.path.exists(os.path.join(BIN_DIR, "cuda_backend_test")):
        return "the build has no CUDA backend"
    return None


@contextlib.contextmanager
def counting_exports():
    """``cuda_ipc.export`` recording every reference it makes: yields the
    list the references are appended to."""
    exported = []
    real_export = cuda_ipc.export

    def counting_export(t, dt):
        ref = real_export(t, dt)
        exported.append(ref)
        return ref

    cuda_ipc.export = counting_export
    try:
        yield exported
    finally:
        cuda_ipc.export = real_export


@unittest.skipIf(_cuda_ready() is not None, "CUDA IPC end to end: %s" % _cuda_ready())
class GpuTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=1, extra=["--backend", "cuda", "--lm-head", LM_HEAD])

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def test_cuda_tensor_by_ipc_is_bitwise_its_bytes(self):
        import torch

        g = Golden("hidden_bf16")
        kw = g.score_kwargs()
        bits = np.ascontiguousarray(kw.pop("hidden_states"))
        kw.pop("dtype", None)
        # Same-position scoring of every row: the IPC request and the bytes
        # request multiply the same rows.
        kw["alignment"] = "same_position"
        hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda()
        with counting_exports() as exported:
            with self.server.client() as client:
                self.assertTrue(client.server_info().cuda_ipc_inputs)
                got = client.score(hidden_states=hidden, **kw)
                self.assertEqual(len(exported), 1, "sent by CUDA IPC")
                ref = client.score(hidden_states=hidden, cuda_ipc=False, **kw)
                self.assertEqual(len(exported), 1, "cuda_ipc=False sends bytes")
                for k, v in ref.outputs.items():
                    self.assertTrue(torch.equal(v.cpu(), got.outputs[k].cpu()), k)
                # The golden alignment (next_token: unscored rows are dropped)
                # matches the expected outputs.
                nt = g.score_kwargs()
                nt.pop("dtype", None)
                nt["hidden_states"] = hidden
                res = client.score(**nt)
                self.assertEqual(len(exported), 2)
                self.assertEqual(compare(g.expected, {k: v.cpu().numpy() for k, v in res.outputs.items()}), "")


@unittest.skipIf(_cuda_ready() is not None, "CUDA IPC update rows end to end: %s" % _cuda_ready())
class GpuUpdateTest(unittest.TestCase):
    """A head updated from a torch CUDA tensor by CUDA IPC (a worker copies
    the rows into the store) scores bitwise as a server started with those
    weights, and its sha256 is the weights' bytes'."""

    def test_update_from_a_cuda_tensor_by_ipc_scores_as_a_server_started_with_it(self):
        self._update_by_ipc(workers=1)

    def test_update_rows_with_two_gloo_workers_on_one_gpu(self):
        # Issue 35 item 5: the update rows copied by CUDA IPC into the store
        # with two workers (Gloo, both on the one GPU) sharing the vocabulary.
        self._update_by_ipc(workers=2, extra=["--comm", "gloo", "--parallelism", "vocab"])

    def _update_by_ipc(self, workers, extra=()):
        import torch

        extra = list(extra)
        g = Golden("hidden_bf16")
        golden = safetensors.load(LM_HEAD)[0]["lm_head.weight"]  # uint16 bf16 bits
        start = os.path.join(temp_dir("cuda_ipc_update"), "start.safetensors")
        safetensors.save(start, {"lm_head.weight": (golden ^ np.uint16(0x5)).astype(np.uint16)},
                         bf16=["lm_head.weight"])
        kw = g.score_kwargs()
        with Server(workers=workers, extra=["--backend", "cuda", "--lm-head", LM_HEAD] + extra) as s, \
                s.client() as c:
            expect = c.score(**kw)
        self.assertEqual(compare(g.expected, expect.outputs), "")
        weight = torch.from_numpy(golden.view(np.int16)).view(torch.bfloat16).cuda()
        with counting_exports() as exported:
            with Server(workers=workers,
                        extra=["--backend", "cuda", "--lm-head", start, "--allow-lm-head-updates"] + extra) as s, \
                    s.client() as c:
                self.assertTrue(c.server_info().cuda_ipc_inputs)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # no fallback to bytes
                    self.assertEqual(c.update_lm_head("default", weight, version="ipc"), "ipc")
                self.assertEqual(len(exported), 1, "sent by CUDA IPC")
                h = support.hashed_head(c, "default")
                self.assertEqual(h.sha256, hashlib.sha256(golden.tobytes()).hexdigest())
                got = c.score(**kw)
                self.assertEqual(got.head_version, "ipc")
                for k, v in expect.outputs.items():
                    self.assertTrue(np.array_equal(np.asarray(v), np.asarray(got.outputs[k]), equal_nan=True), k)


if __name__ == "__main__":
    unittest.main()
