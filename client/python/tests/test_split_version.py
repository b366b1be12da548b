"""A split score() across an lm_head commit (issue 31 item 3), sync and
asyncio, on a live server retaining one version: the parts after the first
are pinned to the first part's version; when an update commits between two
parts (a hook of the client between parts, no sleeping) that version is
released, and the whole call starts again on the new version (every part
re-scored, the first unpinned); a second release fails the call with
reason LM_HEAD_VERSION_UNAVAILABLE naming both versions. Parts answered
by two versions (a streamed item's) are never joined."""
import asyncio
import os
import unittest

import grpc
import numpy as np

from support import Server, temp_dir
from logprob_client import LogprobError, safetensors
from logprob_client import aio

V, H = 211, 64
LENS = [7, 5, 9, 6]
CU = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int64)
T = int(CU[-1])
HIDDEN = np.random.default_rng(11).standard_normal((T, H)).astype(np.float32)
IDS = (np.arange(T) * 31 % V).astype(np.int64)
# Room for one sequence's hidden states (<= 9 x 64 x 4 bytes) and ids per
# request, not two: the call goes as one part per sequence.
MAX_REQUEST_BYTES = 3000


def weights(seed):
    return np.random.default_rng(seed).standard_normal((V, H)).astype(np.float32) * 0.2


def call_kwargs():
    return dict(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=CU, head="policy", entropy=True)


class Recorder:
    """The client's between-parts hook: records (part index, the version the
    part was sent with) and, after the first part of the attempts listed in
    ``commit_on`` (1-based), commits the next version with ``updater``."""

    def __init__(self, updater, versions, commit_on):
        self.updater, self.versions, self.commit_on = updater, list(versions), set(commit_on)
        self.sent = []
        self.attempt = 0

    def __call__(self, part):
        index, _ = part.where
        if index == 1:
            self.attempt += 1
        self.sent.append((index, part.inputs.head_version))
        if index == 1 and self.attempt in self.commit_on:
            version, w = self.versions.pop(0)
            self.updater.update_lm_head("policy", w, version=version)


class SplitAcrossCommitTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("split_version")
        cls.w = [weights(s) for s in range(5)]
        path = os.path.join(cls.dir, "w0.safetensors")
        safetensors.save(path, {"lm_head.weight": cls.w[0]})
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + path, "--allow-lm-head-updates",
                                              "--lm-head-retain", "1"])

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def setUp(self):
        self.updater = self.server.client()
        self.addCleanup(self.updater.close)

    def current(self):
        return self.updater.lm_heads()[0].version

    def again(self):
        """The same split call on the current version, nothing committed
        between its parts (the reference)."""
        with self.server.client(max_request_bytes=MAX_REQUEST_BYTES) as c:
            return c.score(**call_kwargs())

    def check_restarted(self, result, recorder, old, new):
        n = len(LENS)
        self.assertEqual(result.num_parts, n)
        self.assertEqual((result.head, result.head_version), ("policy", new))
        # Attempt 1: part 1 (version `old` current), then part 2 pinned to `old`
        # failed (released) before any hook; attempt 2: every part again, the
        # first unpinned, the others pinned to the version it got.
        self.assertEqual(recorder.sent, [(1, "")] + [(1, "")] + [(i, new) for i in range(2, n + 1)])
        ref = self.again()
        self.assertEqual(ref.head_version, new)
        for name in ("token_logprobs", "entropy"):
            np.testing.assert_array_equal(np.asarray(result[name]), np.asarray(ref[name]), err_msg=name)
        self.assertNotEqual(old, new)

    def test_sync_split_call_restarts_once_on_the_new_version_then_fails_naming_both(self):
        with self.server.client(max_request_bytes=MAX_REQUEST_BYTES) as c:
            old = self.current()
            before = c.score(**call_kwargs())
            self.assertEqual((before.num_parts, before.head_version), (len(LENS), old))
            recorder = Recorder(self.updater, [("sync-a", self.w[1])], commit_on=[1])
            c._after_part = recorder
            result = c.score(**call_kwargs())
            self.check_restarted(result, recorder, old, "sync-a")
            self.assertFalse(np.array_equal(np.asarray(result["token_logprobs"]),
                                            np.asarray(before["token_logprobs"])))

            recorder = Recorder(self.updater, [("sync-b", self.w[2]), ("sync-c", self.w[3])], commit_on=[1, 2])
            c._after_part = recorder
            with self.assertRaises(LogprobError) as e:
                c.score(**call_kwargs())
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertEqual(e.exception.reason, "LM_HEAD_VERSION_UNAVAILABLE")
            # Attempt 1 was pinned to sync-a (released by sync-b), attempt 2 to sync-b (released by sync-c).
            self.assertIn("version 'sync-a'", e.exception.message)
            self.assertIn("again on version 'sync-b'", e.exception.message)
            self.assertEqual(recorder.sent, [(1, ""), (1, "")])
            # A version the caller pinned is never replaced: its release fails at once.
            recorder = Recorder(self.updater, [("sync-d", self.w[4])], commit_on=[1])
            c._after_part = recorder
            with self.assertRaises(LogprobError) as e:
                c.score(head_version="sync-c", **call_kwargs())
            self.assertEqual(e.exception.reason, "LM_HEAD_VERSION_UNAVAILABLE")
            self.assertEqual(recorder.sent, [(1, "sync-c")])

    def test_parts_scored_with_two_versions_are_never_joined(self):
        # score() pins its parts; a streamed item's parts are in flight at
        # once, so their answers may come from two versions: refused.
        from logprob_client._internal._proto import pb2
        from logprob_client._internal.request import ScoreCall

        call = ScoreCall("r", **call_kwargs())
        answers = [pb2.ScoreResponse(id="r-%d" % i, head="policy", head_version=v) for i, v in
                   enumerate(["v1", "v1", "v2", "v1"])]
        with self.assertRaises(LogprobError) as e:
            call.result(answers, len(answers))
        self.assertEqual(e.exception.code, grpc.StatusCode.ABORTED)
        self.assertIn("'v1', 'v2'", e.exception.message)

    def test_asyncio_split_call_restarts_once_on_the_new_version_then_fails_naming_both(self):
        async def run():
            async with aio.LogprobClient(self.server.address, max_request_bytes=MAX_REQUEST_BYTES) as c:
                old = self.current()
                recorder = Recorder(self.updater, [("aio-a", self.w[1])], commit_on=[1])
                c._after_part = recorder  # it blocks the loop while it commits: nothing else runs here
                result = await c.score(**call_kwargs())
                self.check_restarted(result, recorder, old, "aio-a")
                c._after_part = Recorder(self.updater, [("aio-b", self.w[2]), ("aio-c", self.w[3])],
                                         commit_on=[1, 2])
                with self.assertRaises(LogprobError) as e:
                    await c.score(**call_kwargs())
                self.assertEqual(e.exception.reason, "LM_HEAD_VERSION_UNAVAILABLE")
                self.assertIn("version 'aio-a'", e.exception.message)
                self.assertIn("again on version 'aio-b'", e.exception.message)

        asyncio.run(run())


if __name__ == "__main__":
    unittest.main()
