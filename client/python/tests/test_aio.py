"""Tests of the asyncio client (logprob_client.aio.LogprobClient) against
live logprob-server processes: golden cases, 16 concurrent calls on one
channel, splitting, retries, the overall deadline, and cancellation seen by
the server."""

import asyncio
import time
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare

import grpc
from logprob_client import LogprobError, RetryPolicy
from logprob_client import aio


class AioTest(unittest.IsolatedAsyncioTestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, metrics=True)
        cls.addClassCleanup(cls.server.close)
        cls.split_server = Server(workers=1, extra=["--max-tokens-per-request", "100"])
        cls.addClassCleanup(cls.split_server.close)

    async def asyncSetUp(self):
        # IsolatedAsyncioTestCase runs the loop in debug mode, which logs every
        # slow callback (numpy work on a busy machine); not what is tested here.
        asyncio.get_running_loop().set_debug(False)

    async def test_golden_cases(self):
        async with aio.LogprobClient(self.server.address) as c:
            self.assertTrue(await c.health())
            info = await c.server_info()
            self.assertEqual(info.workers, 2)
            for name in LOGITS_CASES:
                with self.subTest(case=name):
                    g = Golden(name)
                    res = await c.score(**g.score_kwargs())
                    self.assertEqual(compare(g.expected, res.outputs), "")
                    self.assertEqual((res.num_parts, res.attempts), (1, 1))

    async def test_sixteen_concurrent_calls_share_one_channel(self):
        cases = [Golden(name) for name in LOGITS_CASES]
        async with aio.LogprobClient(self.server.address) as c:
            channel = c._channel
            before = self.ok_requests()
            jobs = [cases[i % len(cases)] for i in range(16)]
            results = await asyncio.gather(
                *(c.score(request_id="aio-%d" % i, **g.score_kwargs()) for i, g in enumerate(jobs))
            )
            self.assertIs(c._channel, channel)
        for i, (g, res) in enumerate(zip(jobs, results)):
            self.assertEqual(res.id, "aio-%d" % i)
            self.assertEqual(compare(g.expected, res.outputs), "", g.name)
        # Cases over chunk_above (llama_vocab_bf16, odd_vocab_f16) went as ScoreChunked.
        self.assertEqual(self.ok_requests() - before, 16)

    def ok_requests(self):
        return sum(self.server.metric("logprob_requests_total", code="OK", method=m) for m in ("Score", "ScoreChunked"))

    async def test_split_batch(self):
        g = Golden("basic_f32")  # 4 sequences of 64 tokens, 100 tokens per request
        async with aio.LogprobClient(self.split_server.address) as c:
            res = await c.score(**g.score_kwargs())
        self.assertEqual(res.num_parts, 4)
        self.assertEqual(compare(g.expected, res.outputs), "")

    async def test_server_errors_and_bounded_retries(self):
        g = Golden("sampling_f32")
        kw = g.score_kwargs()
        async with aio.LogprobClient(self.server.address) as c:
            bad = kw["input_ids"].copy()
            bad[1, 3] = 10 ** 6
            with self.assertRaises(LogprobError) as cm:
                await c.score(**dict(kw, input_ids=bad))
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertEqual(cm.exception.attempts, 1)
            self.assertIn("sequence 1", cm.exception.message)
        # Nothing listening: UNAVAILABLE, sent exactly max_attempts times with the policy's backoffs.
        events = []
        retry = RetryPolicy(max_attempts=3, initial_backoff=0.05, multiplier=2.0, jitter=0.0)
        async with aio.LogprobClient("127.0.0.1:%d" % support.free_port(), retry=retry,
                                     on_retry=lambda *a: events.append(a)) as c:
            with self.assertRaises(LogprobError) as cm:
                await c.score_request(_tiny_request())
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(cm.exception.attempts, 3)
        self.assertEqual([(a, code, round(d, 6)) for a, code, _, d in events],
                         [(1, grpc.StatusCode.UNAVAILABLE, 0.05), (2, grpc.StatusCode.UNAVAILABLE, 0.1)])

    async def test_retry_until_the_server_starts(self):
        # The call is retried while nothing listens; the server is started
        # once the client has seen a failure, and the call then succeeds.
        port = support.free_port()
        g = Golden("sampling_f32")
        failed = asyncio.Event()
        loop = asyncio.get_running_loop()
        events = []

        def on_retry(*a):
            events.append(a)
            failed.set()

        retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.2)
        started = {}
        async with aio.LogprobClient("127.0.0.1:%d" % port, retry=retry, timeout=120, on_retry=on_retry) as c:
            task = asyncio.ensure_future(c.score(**g.score_kwargs()))
            await asyncio.wait_for(failed.wait(), 60)
            try:
                started["server"] = await loop.run_in_executor(None, lambda: Server(workers=1, port=port))
                res = await asyncio.wait_for(task, 120)
            finally:
                if "server" in started:
                    started["server"].close()
        self.assertEqual(compare(g.expected, res.outputs), "")
        self.assertGreater(len(events), 0)
        self.assertTrue(all(e[1] == grpc.StatusCode.UNAVAILABLE for e in events), events)
        # Retries of GetServerInfo (fetched first) and of Score are both in events.
        self.assertLessEqual(res.attempts, len(events) + 1)

    async def test_timeout_bounds_the_whole_call_across_retries(self):
        # 1000 attempts would take minutes; the 1 s timeout ends the call.
        retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.1, jitter=0.0)
        async with aio.LogprobClient("127.0.0.1:%d" % support.free_port(), retry=retry, timeout=1.0) as c:
            t0 = time.monotonic()
            with self.assertRaises(LogprobError) as cm:
                await c.score_request(_tiny_request())
            elapsed = time.monotonic() - t0
        self.assertIn(cm.exception.code, (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))
        self.assertGreater(cm.exception.attempts, 1)
        self.assertLess(cm.exception.attempts, 1000)
        self.assertLess(elapsed, 30)  # generous: not 1000 attempts
        # A per-call timeout on a large request: DEADLINE_EXCEEDED.
        big = np.zeros((16, 64, 4096), dtype=np.float32)
        async with aio.LogprobClient(self.server.address) as c:
            await c.server_info()
            with self.assertRaises(LogprobError) as cm:
                await c.score(logits=big, input_ids=np.zeros((16, 64), dtype=np.int64), timeout=0.001)
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)

    async def test_cancelling_the_task_cancels_the_call_on_the_server(self):
        # One Score message (chunking off; test_transport.AioChunkedTest cancels a ScoreChunked call).
        async with aio.LogprobClient(self.server.address, timeout=600) as c:
            c.chunk_above = -1
            await c.server_info()
            self.assertTrue(await support.cancel_on_server(self.server, c, "Score"),
                            "the slow request always finished before it could be cancelled")


def _tiny_request():
    from logprob_client import logprob_pb2 as pb2
    from logprob_client._internal.tensors import F32, I64, to_tensor

    return pb2.ScoreRequest(id="tiny", inputs=[to_tensor("logits", F32, np.zeros((1, 2, 4), np.float32)),
                                               to_tensor("input_ids", I64, np.zeros((1, 2), np.int64))])


if __name__ == "__main__":
    unittest.main()


class AioLoopTest(unittest.TestCase):
    """The asyncio client belongs to the event loop it was made on: used
    from another loop it raises an error that says so, before sending."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=1, metrics=True)
        cls.addClassCleanup(cls.server.close)

    def score_calls(self):
        """Score calls the server has answered, any status."""
        return sum(v for labels, v in self.server.samples("logprob_requests_total") if labels.get("method") == "Score")

    def test_a_call_from_another_loop_says_so(self):
        g = Golden("basic_f32")
        home = asyncio.new_event_loop()
        self.addCleanup(home.close)

        async def make():
            c = aio.LogprobClient(self.server.address)
            return c, await c.score(**g.score_kwargs())

        client, res = home.run_until_complete(make())
        self.assertEqual(compare(g.expected, res.outputs), "")
        before = self.score_calls()
        self.assertGreaterEqual(before, 1)

        for name, call in (("server_info", lambda c: c.server_info(refresh=True)),
                           ("score", lambda c: c.score(**g.score_kwargs())),
                           ("close", lambda c: c.close())):
            with self.subTest(call=name):
                with self.assertRaises(RuntimeError) as cm:
                    asyncio.run(call(client))
                self.assertIn("used from another event loop than the one it was created on", str(cm.exception))
                self.assertIn("create the client inside the loop that uses it", str(cm.exception))
        with self.assertRaises(RuntimeError):  # an async iterator too, at its first step
            asyncio.run(client.score_stream([g.score_kwargs()]).__anext__())
        self.assertEqual(self.score_calls(), before, "nothing was sent from the other loops")
        # Its own loop still works, and closes it.
        res = home.run_until_complete(client.score(**g.score_kwargs()))
        self.assertEqual(compare(g.expected, res.outputs), "")
        self.assertEqual(self.score_calls(), before + 1)
        home.run_until_complete(client.close())

    def test_a_client_made_outside_any_loop_refuses_asyncio_run(self):
        # The mistake of asyncio.run(main(LogprobClient(...))): grpc.aio binds
        # the channel to asyncio's current loop, not to the one asyncio.run()
        # starts.
        current = asyncio.new_event_loop()
        self.addCleanup(current.close)
        asyncio.set_event_loop(current)
        self.addCleanup(asyncio.set_event_loop, None)
        client = aio.LogprobClient(self.server.address)

        async def use(c):
            return await c.health()

        with self.assertRaises(RuntimeError) as cm:
            asyncio.run(use(client))
        self.assertIn("another event loop", str(cm.exception))
        # On the loop it was made for it works.
        self.assertTrue(current.run_until_complete(use(client)))
        current.run_until_complete(client.close())
