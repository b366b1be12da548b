"""torch tensors in, torch tensors out (Debian's python3-torch): every
input dtype (f32, bf16, f16), contiguous or not, against the float64 numpy
reference; outputs' dtype, shape and device; numpy in still gives numpy."""

import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import Golden, Server, as_numpy_outputs, compare
import reference

from logprob_client import aio, bf16_bits_to_float32, float32_to_bf16_bits
from logprob_client._internal.tensors import BF16, F32, float_array

try:
    import torch
except ImportError:  # scripts/install-deps.sh installs python3-torch
    torch = None


@unittest.skipIf(torch is None, "torch is not installed (Debian: python3-torch)")
class TorchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2)
        cls.addClassCleanup(cls.server.close)
        cls.client = cls.server.client()
        cls.addClassCleanup(cls.client.close)
        rng = np.random.default_rng(11)
        cls.B, cls.S, cls.V = 3, 10, 3000  # > wire.FILL_MIN_BYTES: requests filled in place
        cls.logits = (rng.standard_normal((cls.B, cls.S, cls.V)) * 2).astype(np.float32)
        cls.ids = rng.integers(0, cls.V, size=(cls.B, cls.S)).astype(np.int64)
        cls.seq_lens = np.array([10, 7, 4], dtype=np.int64)

    def check_torch_result(self, res, ref, device="cpu"):
        self.assertEqual(set(res.outputs), set(ref))
        for name, t in res.outputs.items():
            self.assertIsInstance(t, torch.Tensor, name)
            self.assertEqual(t.device.type, device, name)
            self.assertEqual(tuple(t.shape), ref[name].shape, name)
            self.assertEqual(t.dtype, torch.int64 if name == "topk_indices" else torch.float32, name)
        self.assertEqual(compare(ref, as_numpy_outputs(res.outputs)), "")

    def test_a_tensor_read_stays_resizable(self):
        # FSDP2 frees an unsharded parameter's storage after the backward
        # (resize_(0)): reading a weight for a push (a numpy view, no copy)
        # must not make its storage not resizable, as Tensor.numpy() does.
        for dtype, wire in ((torch.float32, F32), (torch.bfloat16, BF16)):
            w = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype)
            got, arr = float_array("weight", w)
            self.assertEqual((got, arr.shape), (wire, (3, 4)))
            self.assertEqual(arr.ctypes.data, w.data_ptr())  # a view, not a copy
            del arr
            storage = w.untyped_storage() if hasattr(w, "untyped_storage") else w.storage()
            storage.resize_(0)  # RuntimeError "Trying to resize storage that is not resizable" after numpy()

    def test_extra_outputs_are_float32_and_bool_tensors(self):
        logits = torch.from_numpy(self.logits)
        res = self.client.score(logits=logits, input_ids=torch.from_numpy(self.ids), seq_lens=self.seq_lens,
                                log_sum_sq_probs=True, mean_logits=True, is_top1=True)
        self.assertEqual(res.is_top1.dtype, torch.bool)
        self.assertEqual(res.log_sum_sq_probs.dtype, torch.float32)
        self.assertEqual(res.mean_logits.dtype, torch.float32)
        ref = reference.score_padded(self.logits, self.ids, self.seq_lens, extras=True)
        ref.pop("entropy")
        self.assertEqual(compare(ref, as_numpy_outputs(res.outputs)), "")

    def test_dtypes_contiguous_and_not(self):
        base = torch.from_numpy(self.logits)
        ids = torch.from_numpy(self.ids)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = base.to(dtype)
            # The values the server sees: x rounded to its dtype, in float32.
            rounded = x.to(torch.float32).numpy()
            ref = reference.score_padded(rounded, self.ids, self.seq_lens, topk=4)
            # Non-contiguous views with the same values: a transposed copy
            # transposed back, and every other row of a wider tensor.
            transposed = x.transpose(0, 1).contiguous().transpose(0, 1)
            wide = torch.zeros((self.B, self.S, 2 * self.V), dtype=dtype)
            wide[:, :, ::2] = x
            strided = wide[:, :, ::2]
            for layout, t in (("contiguous", x), ("transposed", transposed), ("strided", strided)):
                with self.subTest(dtype=str(dtype), layout=layout):
                    self.assertEqual(t.is_contiguous(), layout == "contiguous")
                    res = self.client.score(logits=t, input_ids=ids, seq_lens=torch.from_numpy(self.seq_lens),
                                            entropy=True, topk=4)
                    self.check_torch_result(res, ref)

    def test_packed_bf16_golden_and_ids_as_torch(self):
        g = Golden("packed_bf16")
        kw = g.score_kwargs()
        kw.pop("dtype")
        bits = kw.pop("logits")
        t = torch.from_numpy(bf16_bits_to_float32(bits)).to(torch.bfloat16)
        res = self.client.score(logits=t, input_ids=torch.from_numpy(kw.pop("input_ids").astype(np.int64)),
                                cu_seqlens=torch.from_numpy(kw.pop("cu_seqlens").astype(np.int32)), **kw)
        self.assertEqual(compare(g.expected, as_numpy_outputs(res.outputs)), "")
        self.assertIsInstance(res.token_logprobs, torch.Tensor)

    def test_numpy_in_numpy_out_views_the_response(self):
        res = self.client.score(logits=self.logits, input_ids=self.ids, entropy=True)
        ref = reference.score_padded(self.logits, self.ids)
        self.assertEqual(compare(ref, res.outputs), "")
        for arr in res.outputs.values():
            self.assertIsInstance(arr, np.ndarray)
            self.assertFalse(arr.flags.writeable)  # a view of the response's bytes
            root = arr
            while isinstance(root, np.ndarray):
                root = root.base
            self.assertIsInstance(root, memoryview)  # of the bytes gRPC received
            self.assertIsInstance(root.obj, bytes)

    def test_requires_grad_and_the_aio_client(self):
        import asyncio

        x = torch.from_numpy(self.logits).requires_grad_(True)
        ref = reference.score_padded(self.logits, self.ids)
        ref.pop("entropy")
        self.check_torch_result(self.client.score(logits=x, input_ids=self.ids), ref)

        async def run():
            async with aio.LogprobClient(self.server.address) as c:
                return await c.score(logits=x, input_ids=torch.from_numpy(self.ids))

        self.check_torch_result(asyncio.run(run()), ref)

    @unittest.skipUnless(torch is not None and torch.cuda.is_available(), "no CUDA device")
    def test_cuda_tensor_in_cuda_tensor_out(self):
        x = torch.from_numpy(self.logits).to(torch.bfloat16).cuda()
        ref = reference.score_padded(x.float().cpu().numpy(), self.ids)
        ref.pop("entropy")
        self.check_torch_result(self.client.score(logits=x, input_ids=self.ids), ref, device="cuda")

    def test_one_copy_on_the_way_out(self):
        # The encoded arrays are views of the caller's memory (bf16: its
        # bits as uint16, no float conversion); the message holds the one copy.
        x = torch.from_numpy(self.logits).to(torch.bfloat16).transpose(0, 1)
        dt, arr = float_array("logits", x)
        self.assertEqual(dt, BF16)
        self.assertTrue(np.shares_memory(arr, x.view(torch.int16).numpy()))
        np.testing.assert_array_equal(arr, x.contiguous().view(torch.int16).numpy().view(np.uint16))
        np.testing.assert_array_equal(bf16_bits_to_float32(arr), x.float().numpy())
        dt, arr = float_array("logits", torch.from_numpy(self.logits)[:, ::2])
        self.assertEqual(dt, F32)
        self.assertTrue(np.shares_memory(arr, self.logits))
        np.testing.assert_array_equal(float32_to_bf16_bits(self.logits), float_array("l", self.logits, "bf16")[1])


if __name__ == "__main__":
    unittest.main()
