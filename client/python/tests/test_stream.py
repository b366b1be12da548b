"""score_stream over the ScoreStream RPC (sync and asyncio): results in
request order, split requests joined, per-request errors in their place
(raised, or returned with return_exceptions=True), one deadline for the
whole stream."""

import asyncio
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare

import grpc
from logprob_client import InvalidInputError, LogprobError, ScoreResult, aio
from logprob_client import logprob_pb2 as pb2
from logprob_client._internal.tensors import F32, I64, to_tensor


class StreamTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--max-tokens-per-request", "100"])
        cls.addClassCleanup(cls.server.close)
        cls.client = cls.server.client()
        cls.addClassCleanup(cls.client.close)
        # basic_f32 (4 x 64 tokens) goes as 4 parts under 100 tokens per request.
        cls.cases = [Golden(n) for n in LOGITS_CASES if n != "llama_vocab_bf16"]
        bad = cls.cases[0].score_kwargs()
        bad["input_ids"] = bad["input_ids"].copy()
        bad["input_ids"][2, 5] = 10 ** 6  # the server refuses it: INVALID_ARGUMENT in the answer
        cls.bad_server = bad
        bad_client = cls.cases[1].score_kwargs()
        bad_client["input_ids"] = bad_client["input_ids"][:, :3]  # refused by the client
        cls.bad_client = bad_client

    def items(self):
        """Golden cases twice, a server-refused request, a client-refused
        one and a prepared ScoreRequest; with what each should give."""
        items, expect = [], []
        for rep in range(2):
            for g in self.cases:
                items.append(dict(g.score_kwargs(), request_id="%s-%d" % (g.name, rep)))
                expect.append(g)
        items.insert(3, self.bad_server)
        expect.insert(3, grpc.StatusCode.INVALID_ARGUMENT)
        items.insert(6, self.bad_client)
        expect.insert(6, InvalidInputError)
        logits = np.zeros((1, 3, 5), np.float32)
        items.append(pb2.ScoreRequest(id="prepared", inputs=[to_tensor("logits", F32, logits),
                                                            to_tensor("input_ids", I64, np.zeros((1, 3), np.int64))]))
        expect.append("prepared")
        return items, expect

    def check(self, outcomes, expect):
        self.assertEqual(len(outcomes), len(expect))
        for i, (got, want) in enumerate(zip(outcomes, expect)):
            if want is InvalidInputError:
                self.assertIsInstance(got, InvalidInputError, i)
                self.assertIn("input_ids", got.message)
            elif isinstance(want, grpc.StatusCode):
                self.assertIsInstance(got, LogprobError, i)
                self.assertEqual(got.code, want)
                # basic_f32 goes as 4 parts of one sequence: the third fails.
                self.assertIn("target 1000000 of sequence 0 at position 5", got.message)
                self.assertEqual(got.part, (3, 4))
            elif want == "prepared":
                self.assertIsInstance(got, ScoreResult)
                self.assertEqual(got.id, "prepared")
                np.testing.assert_allclose(got.token_logprobs, np.full((1, 2), -np.log(5)), rtol=1e-6)
            else:
                self.assertIsInstance(got, ScoreResult, i)
                self.assertTrue(got.id.startswith(want.name), (got.id, want.name))
                self.assertEqual(compare(want.expected, got.outputs), "", got.id)
                if want.name == "basic_f32":
                    self.assertEqual(got.num_parts, 4)

    def test_in_order_with_errors_returned(self):
        items, expect = self.items()
        outcomes = list(self.client.score_stream(iter(items), return_exceptions=True))
        self.check(outcomes, expect)

    def test_first_error_is_raised_in_its_place(self):
        items, expect = self.items()
        got = []
        with self.assertRaises(LogprobError) as cm:
            for res in self.client.score_stream(items):
                got.append(res)
        self.assertEqual(len(got), 3)  # the results before the failing request
        self.check(got, expect[:3])
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        # The client still works (the stream was cancelled, not the channel).
        g = self.cases[0]
        self.assertEqual(compare(g.expected, self.client.score(**g.score_kwargs()).outputs), "")

    def test_an_exception_of_the_requests_iterable_comes_after_the_earlier_results(self):
        g = self.cases[0]

        def items():
            yield g.score_kwargs()
            raise RuntimeError("the rollout source broke")

        got = []
        with self.assertRaises(RuntimeError) as cm:
            for res in self.client.score_stream(items()):
                got.append(res)
        self.assertIn("rollout source", str(cm.exception))
        self.assertEqual(len(got), 1)
        self.assertEqual(compare(g.expected, got[0].outputs), "")

    def test_one_deadline_for_the_whole_stream(self):
        self.client.server_info()
        big = {"logits": np.zeros((1, 64, 1 << 16), np.float32), "input_ids": np.zeros((1, 64), np.int64)}
        with self.assertRaises(LogprobError) as cm:
            list(self.client.score_stream([big] * 4, timeout=0.01))
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

    def test_aio_stream_from_an_async_generator(self):
        items, expect = self.items()

        async def source():
            for item in items:
                yield item

        async def run():
            async with aio.LogprobClient(self.server.address) as c:
                plain = [x async for x in c.score_stream(items, return_exceptions=True)]
                from_async = [x async for x in c.score_stream(source(), return_exceptions=True)]
                raised = []
                with self.assertRaises(LogprobError):
                    async for x in c.score_stream(source()):
                        raised.append(x)
                return plain, from_async, raised

        plain, from_async, raised = asyncio.run(run())
        self.check(plain, expect)
        self.check(from_async, expect)
        self.check(raised, expect[:3])


class StreamAnnouncementTest(unittest.TestCase):
    """A stream announces its largest message (``logprob-request-bytes``),
    which the server holds in its queue before reading each message: the
    smaller of the server's max_request_bytes and STREAM_MESSAGE_BYTES; dict
    items are split to fit it, a prepared ScoreRequest over it is refused
    by the client."""

    def test_the_announced_size_and_what_fits_it(self):
        from logprob_client._internal.request import STREAM_MESSAGE_BYTES, Limits

        big = Limits(pb2.ServerInfo(max_request_bytes=1 << 30)).for_stream()
        self.assertEqual(big.message_bytes, STREAM_MESSAGE_BYTES)
        self.assertEqual(big.max_bytes, int(STREAM_MESSAGE_BYTES * 0.9))
        small = Limits(pb2.ServerInfo(max_request_bytes=100000)).for_stream()
        self.assertEqual((small.message_bytes, small.max_bytes), (100000, 90000))

        server = Server(workers=1, extra=["--max-request-bytes", "100000"])
        self.addCleanup(server.close)
        client = server.client()
        self.addCleanup(client.close)
        rng = np.random.default_rng(7)
        logits = rng.standard_normal((2, 40, 500)).astype(np.float32)  # 160 kB: over one message
        ids = rng.integers(0, 500, (2, 40))
        reference = client.score(logits=logits[:1], input_ids=ids[:1])
        prepared = pb2.ScoreRequest(id="too-big", inputs=[to_tensor("logits", F32, logits),
                                                          to_tensor("input_ids", I64, ids)])
        outcomes = list(client.score_stream([dict(logits=logits, input_ids=ids), prepared],
                                            return_exceptions=True))
        self.assertIsInstance(outcomes[0], ScoreResult, outcomes[0])
        self.assertGreater(outcomes[0].num_parts, 1)
        np.testing.assert_array_equal(outcomes[0].token_logprobs[:1], reference.token_logprobs)
        self.assertIsInstance(outcomes[1], InvalidInputError)
        self.assertIn("over the 100000 this stream announces", outcomes[1].message)


if __name__ == "__main__":
    unittest.main()
