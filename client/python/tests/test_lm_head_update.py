"""lm_head updates on live servers: outputs after an update are bitwise
those of a server started with the new weights; requests report and pin
versions; retained versions; each bad update is refused and changes
nothing; updates are off by default."""
import asyncio
import fcntl
import os
import re
import shutil
import signal
import subprocess
import threading
import unittest
from unittest import mock
import warnings

import grpc
import numpy as np

from support import (BIN_DIR, GOLDEN_DIR, Golden, Server, compare, hashed_head, pid_namespace_prefix, temp_dir, wait_for,
                     worker_pids)
from logprob_client import LogprobClient, LogprobError
from logprob_client import aio, safetensors
from logprob_client._internal import base
from logprob_client._internal._proto import pb2

V, H, T = 301, 64, 24


def weights(seed):
    return np.random.default_rng(seed).standard_normal((V, H)).astype(np.float32) * 0.2


def save(path, w):
    safetensors.save(path, {"lm_head.weight": w})
    return path


HIDDEN = np.random.default_rng(7).standard_normal((T, H)).astype(np.float32)
IDS = (np.arange(T) * 37 % V).astype(np.int64)


def score(client, **kw):
    return client.score(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=np.array([0, 10, T]), entropy=True, topk=5,
                        **kw)


def same(a, b):
    for name in ("token_logprobs", "entropy", "topk_logprobs", "topk_indices"):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


class UpdateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("lm_head_update")
        cls.update_dir = os.path.join(cls.dir, "updates")
        os.makedirs(cls.update_dir)
        cls.w0, cls.w1, cls.w2 = weights(1), weights(2), weights(3)
        cls.p0 = save(os.path.join(cls.dir, "w0.safetensors"), cls.w0)
        cls.p1 = save(os.path.join(cls.update_dir, "w1.safetensors"), cls.w1)
        cls.ref = save(os.path.join(cls.dir, "ref.safetensors"), weights(9))
        cls.server = Server(workers=2, extra=[
            "--lm-head", "policy=" + cls.p0, "--lm-head", "reference=" + cls.ref, "--allow-lm-head-updates",
            "--lm-head-retain", "2", "--lm-head-update-dir", cls.update_dir])
        # Servers started with each version: the outputs an update must reproduce bitwise.
        cls.expect = {}
        for name, w in (("w1", cls.w1), ("w2", cls.w2)):
            path = save(os.path.join(cls.dir, name + "-start.safetensors"), w)
            with Server(workers=2, extra=["--lm-head", path]) as s, s.client() as c:
                cls.expect[name] = score(c)

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def test_updates_from_pieces_and_files_score_as_a_server_started_with_them(self):
        with self.server.client() as c:
            ref_before = score(c, head="reference")
            before = score(c, head="policy")
            self.assertEqual((before.head, before.head_version), ("policy", "initial"))
            with self.server.client(shared_memory=False) as pieces:
                self.assertEqual(pieces.update_lm_head("policy", self.w1, version="pieces-1"), "pieces-1")
            after = score(c, head="policy")
            self.assertEqual(after.head_version, "pieces-1")
            same(after, self.expect["w1"])
            # Same host: through the client's shared-memory region (the
            # server's metrics count it: no PutLmHeadRows bytes in pieces).
            self.assertEqual(c.update_lm_head("policy", self.w2, version="shm-2"), "shm-2")
            self.assertTrue(c._shm and c._shm._all and c._shm.failed is None, "shared memory should be in use")
            same(score(c, head="policy"), self.expect["w2"])
            # In many puts, the client copying each into one of two regions
            # while the server takes the one before: the same weights. Puts
            # through shared memory are of UPDATE_REGION_BYTES, puts in
            # pieces of UPDATE_PUT_BYTES (each PutLmHeadRows call counted).
            def counted(client):
                return mock.patch.object(client, "_put_lm_head_rows_raw", wraps=client._put_lm_head_rows_raw)

            with mock.patch.object(base, "UPDATE_REGION_BYTES", 7 * self.w1[:1].nbytes), \
                    mock.patch.object(base, "UPDATE_PUT_BYTES", 11 * self.w1[:1].nbytes):
                with counted(c) as shm_puts:
                    self.assertEqual(c.update_lm_head("policy", self.w1, version="shm-puts"), "shm-puts")
                self.assertEqual(shm_puts.call_count, -(-V // 7))
                same(score(c, head="policy"), self.expect["w1"])
                with self.server.client(shared_memory=False) as pieces, counted(pieces) as piece_puts:
                    self.assertEqual(pieces.update_lm_head("policy", self.w2, version="pieces-puts"), "pieces-puts")
                self.assertEqual(piece_puts.call_count, -(-V // 11))
                same(score(c, head="policy"), self.expect["w2"])

            async def aio_update():  # the asyncio client waits for each copy off its loop
                async with aio.LogprobClient(self.server.address) as a:
                    return await a.update_lm_head("policy", self.w2, version="shm-puts-aio"), a._shm

            with mock.patch.object(base, "UPDATE_REGION_BYTES", 7 * self.w2[:1].nbytes):
                version, aio_shm = asyncio.run(aio_update())
            self.assertEqual(version, "shm-puts-aio")
            self.assertTrue(aio_shm and aio_shm.failed is None, "the asyncio client used shared memory")
            same(score(c, head="policy"), self.expect["w2"])
            self.assertEqual(c.update_lm_head("policy", self.w1, version="shm-3"), "shm-3")
            # A file under --lm-head-update-dir, through the raw API.
            upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                head="policy", version="file-1", vocab_size=V, hidden_size=H, dtype=pb2.F32,
                sha256=hashed_head(c, "policy").sha256))
            c._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                update_id=upd.update_id, file=pb2.LmHeadFile(path="w1.safetensors")))]))
            committed = c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
            self.assertEqual(committed.version, "file-1")
            self.assertEqual(list(committed.retained_versions), ["file-1", "shm-3"])
            same(score(c, head="policy"), self.expect["w1"])
            # Row ranges from two senders, in any order.
            upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                head="policy", version="ranges-2", vocab_size=V, hidden_size=H, dtype=pb2.F32))
            for r0, r1 in ((150, V), (0, 150)):
                rows = np.ascontiguousarray(self.w2[r0:r1])
                c._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                    update_id=upd.update_id, row_begin=r0,
                    rows=pb2.Tensor(name="rows", dtype=pb2.F32, shape=list(rows.shape), data=rows.tobytes())))]))
            c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
            now = score(c, head="policy")
            self.assertEqual(now.head_version, "ranges-2")
            same(now, self.expect["w2"])
            # Retained: the previous version may be pinned, the one before is gone.
            same(score(c, head="policy", head_version="file-1"), self.expect["w1"])
            with self.assertRaises(LogprobError) as e:
                score(c, head="policy", head_version="shm-3")
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertEqual(e.exception.reason, "LM_HEAD_VERSION_UNAVAILABLE")
            self.assertIn("ranges-2", e.exception.message)
            # The reference head was never touched.
            same(score(c, head="reference"), ref_before)
            # Re-sending a committed (head, version, sha256) does nothing.
            sha = hashed_head(c, "policy").sha256
            self.assertEqual(c.update_lm_head("policy", self.w2, version="ranges-2", sha256=sha), "ranges-2")

    def test_bad_updates_are_refused_and_change_nothing(self):
        with self.server.client() as c:
            stub = c._stub
            current = hashed_head(c, "policy")
            before = score(c, head="policy")

            def code(fn):
                with self.assertRaises(grpc.RpcError) as e:
                    fn()
                return e.exception.code(), e.exception.details()

            begin = lambda **kw: stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(**dict(
                dict(head="policy", version="bad", vocab_size=V, hidden_size=H, dtype=pb2.F32), **kw)))
            self.assertEqual(code(lambda: begin(head="nope"))[0], grpc.StatusCode.NOT_FOUND)
            c_, msg = code(lambda: begin(hidden_size=H + 1))
            self.assertEqual(c_, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("[%d, %d]" % (V, H), msg)
            self.assertEqual(code(lambda: begin(dtype=pb2.BF16))[0], grpc.StatusCode.INVALID_ARGUMENT)
            self.assertEqual(code(lambda: begin(version="a/b"))[0], grpc.StatusCode.INVALID_ARGUMENT)
            # sha256 mismatch: aborted at commit.
            upd = begin(sha256="0" * 64)
            rows = np.ascontiguousarray(weights(5))
            put = lambda u, r0, arr: stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                update_id=u, row_begin=r0,
                rows=pb2.Tensor(name="rows", dtype=pb2.F32, shape=list(arr.shape), data=arr.tobytes())))]))
            put(upd.update_id, 0, rows)
            c_, msg = code(lambda: stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id)))
            self.assertEqual(c_, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("sha256", msg)
            # Retried, the Commit answers the same outcome (never NOT_FOUND).
            c_, msg = code(lambda: stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id)))
            self.assertEqual(c_, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("sha256", msg)
            # Rows missing, rows twice, a second update of the head while one is open.
            upd = begin()
            put(upd.update_id, 0, rows[:100])
            self.assertEqual(code(lambda: put(upd.update_id, 50, rows[50:60]))[0], grpc.StatusCode.INVALID_ARGUMENT)
            self.assertEqual(code(lambda: begin(version="other"))[0], grpc.StatusCode.FAILED_PRECONDITION)
            c_, msg = code(lambda: stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id)))
            self.assertEqual(c_, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("[100, %d)" % V, msg)
            stub.AbortLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
            # Files outside the update directory, directly or through a symlink.
            link = os.path.join(self.update_dir, "escape.safetensors")
            if not os.path.exists(link):
                os.symlink(self.p0, link)
            for path in ("../w0.safetensors", "escape.safetensors", self.p0):
                upd = begin()
                c_, _ = code(lambda: stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                    update_id=upd.update_id, file=pb2.LmHeadFile(path=path)))])))
                self.assertEqual(c_, grpc.StatusCode.PERMISSION_DENIED, path)
                stub.AbortLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
            after = {h.name: h for h in c.lm_heads()}["policy"]
            self.assertEqual((after.version, after.sha256), (current.version, current.sha256))
            same(score(c, head="policy"), before)

    def test_names_break_no_log_line_and_long_ones_are_invalid_argument_not_resource_exhausted(self):
        # Issue 32 finding 7: one rule for heads and versions (updates and
        # requests), logs escape what they print, errors cut long echoes.
        with self.server.client() as c:
            stub = c._stub
            begin = lambda **kw: stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(**dict(
                dict(head="policy", version="ok", vocab_size=V, hidden_size=H, dtype=pb2.F32), **kw)))
            for kw in (dict(version="v1\nFORGED-LINE status=OK"), dict(version="v\x001"),
                       dict(head="policy\nFORGED-LINE status=OK"), dict(version="v" * 10240),
                       dict(head="h" * 10240)):
                with self.assertRaises(grpc.RpcError) as e:
                    begin(**kw)
                self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, str(kw)[:100])
                self.assertLess(len(e.exception.details()), 512)
                self.assertNotIn("\n", e.exception.details())
            # Scoring requests name heads under the same rule.
            for kw in (dict(head="h" * 10240), dict(head_version="v" * 10240), dict(head="policy\nFORGED-LINE")):
                with self.assertRaises(LogprobError) as e:
                    score(c, **kw)
                self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            # An update id (any bytes) is echoed escaped and cut.
            with self.assertRaises(grpc.RpcError) as e:
                stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id="x\nFORGED-LINE" + "y" * 10240))
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            # The client checks the same rule before sending anything.
            for head, version in (("policy", "v" * 129), ("policy", "a b"), ("p\n", "ok"), ("", "ok")):
                with self.assertRaises(ValueError):
                    c.update_lm_head(head, self.w1, version=version)
            self.assertTrue(base.VERSION_NAME_RE.fullmatch("v" * 128))
        log = self.server.log()
        self.assertIn("FORGED-LINE", log)  # logged, escaped on its line
        self.assertNotIn("\nFORGED-LINE", log)


def kill_a_worker_and_wait_for_the_pool(server, client):
    """SIGKILLs one worker, then waits until the pool was re-formed and serves."""
    restarts = server.metric("logprob_worker_restarts_total")
    os.kill(worker_pids(server)[0], signal.SIGKILL)
    wait_for(lambda: server.metric("logprob_worker_restarts_total") > restarts, "the pool to re-form", 120)
    wait_for(lambda: client.health(wait=1.0), "SERVING after the re-formation", 120)


class FaultTest(unittest.TestCase):
    """Worker deaths around updates; the time-out and the memory cap."""

    def setUp(self):
        self.dir = temp_dir("lm_head_faults")
        self.w0, self.w1 = weights(1), weights(2)
        p0 = save(os.path.join(self.dir, "w0.safetensors"), self.w0)
        with Server(workers=2, extra=["--lm-head", p0]) as s, s.client() as c:
            self.expect0 = score(c)
        with Server(workers=2, extra=["--lm-head", save(os.path.join(self.dir, "w1.safetensors"), self.w1)]) as s, \
                s.client() as c:
            self.expect1 = score(c)
        self.server = Server(workers=2, metrics=True, extra=[
            "--lm-head", p0, "--allow-lm-head-updates", "--lm-head-update-timeout", "1s"])
        self.addCleanup(self.server.close)

    def test_a_worker_killed_during_an_update_fails_it_and_the_old_version_serves(self):
        with self.server.client() as c:
            upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                head="default", version="v1", vocab_size=V, hidden_size=H, dtype=pb2.F32))
            c._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                update_id=upd.update_id, rows=pb2.Tensor(name="rows", dtype=pb2.F32, shape=[V, H],
                                                         data=self.w1.tobytes())))]))
            kill_a_worker_and_wait_for_the_pool(self.server, c)
            # The update either failed at commit (the pool changed under it)
            # or loads on the re-formed pool: whichever, every answer after it
            # is bitwise one version's, and that version is the one reported.
            try:
                c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
                committed = True
            except grpc.RpcError as e:
                self.assertIn(e.code(), (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                                         grpc.StatusCode.NOT_FOUND), e.details())
                committed = False
            r = score(c)
            self.assertEqual(r.head_version, "v1" if committed else "initial")
            same(r, self.expect1 if committed else self.expect0)

    def test_a_worker_killed_after_a_commit_comes_back_with_the_committed_version(self):
        with self.server.client() as c:
            self.assertEqual(c.update_lm_head("default", self.w1, version="v1"), "v1")
            same(score(c), self.expect1)
            kill_a_worker_and_wait_for_the_pool(self.server, c)
            r = score(c)
            self.assertEqual(r.head_version, "v1")
            same(r, self.expect1)

    def test_an_update_without_progress_times_out_and_one_over_the_memory_cap_is_refused(self):
        with self.server.client() as c:
            upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                head="default", version="slow", vocab_size=V, hidden_size=H, dtype=pb2.F32))

            def ended():
                try:
                    c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
                except grpc.RpcError as e:
                    # Its outcome (a Commit after the end answers it), not NOT_FOUND.
                    return e.code() == grpc.StatusCode.ABORTED and "no progress" in e.details()
                return False

            wait_for(ended, "the idle update to be aborted", 60)
            self.assertEqual(self.server.metric("logprob_lm_head_updates_total", head="default", outcome="timeout"), 1)
            same(score(c), self.expect0)
        d = temp_dir("lm_head_cap")
        p0 = save(os.path.join(d, "w0.safetensors"), self.w0)
        per_worker = (V + 1) // 2 * H * 4
        with Server(workers=2, extra=["--lm-head", p0, "--allow-lm-head-updates",
                                      "--lm-head-memory-bytes", str(per_worker + per_worker // 2)]) as s, \
                s.client() as c:
            with self.assertRaises(LogprobError) as e:
                c.update_lm_head("default", self.w1, version="v1")
            self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("--lm-head-memory-bytes", e.exception.message)


class ConcurrentUpdateTest(unittest.TestCase):
    def test_requests_during_back_and_forth_updates_each_match_the_version_they_report(self):
        d = temp_dir("lm_head_concurrent")
        w = {"a": weights(1), "b": weights(2)}
        expect = {}
        for k in w:
            with Server(workers=2, extra=["--lm-head", save(os.path.join(d, k + ".safetensors"), w[k])]) as s, \
                    s.client() as c:
                expect[k] = score(c)
        with Server(workers=2, extra=["--lm-head", os.path.join(d, "a.safetensors"), "--lm-head-version", "a-0",
                                      "--allow-lm-head-updates", "--lm-head-retain", "2"]) as s:
            stop = threading.Event()
            errors = []
            seen = set()

            def scorer():
                with s.client() as c:
                    while not stop.is_set():
                        try:
                            r = score(c)
                            same(r, expect[r.head_version[0]])
                            seen.add(r.head_version)
                            # Pinned to what it just got: that version, or gone.
                            try:
                                p = score(c, head_version=r.head_version)
                                self.assertEqual(p.head_version, r.head_version)
                                same(p, expect[r.head_version[0]])
                            except LogprobError as e:
                                self.assertEqual(e.code, grpc.StatusCode.FAILED_PRECONDITION)
                        except BaseException as e:  # reported below
                            errors.append(e)
                            return

            threads = [threading.Thread(target=scorer) for _ in range(3)]
            for t in threads:
                t.start()
            try:
                wait_for(lambda: "a-0" in seen or errors, "a scorer to see a-0")
                with s.client() as c:
                    for i in range(1, 7):
                        k = "b" if i % 2 else "a"
                        version = "%s-%d" % (k, i)
                        self.assertEqual(c.update_lm_head("default", w[k], version=version), version)
                        # Scored with it before the next update (on a busy machine
                        # all six could otherwise commit before a scorer's next call).
                        wait_for(lambda: version in seen or errors, "a scorer to see %s" % version)
            finally:
                stop.set()
                for t in threads:
                    t.join()
            if errors:
                raise errors[0]
            self.assertEqual(seen, {"a-0", "b-1", "a-2", "b-3", "a-4", "b-5", "a-6"})


class CliTest(unittest.TestCase):
    def test_update_lm_head_and_heads_commands(self):
        d = temp_dir("lm_head_cli")
        p0 = save(os.path.join(d, "w0.safetensors"), weights(1))
        w1 = weights(2)
        # The new weight as a tied checkpoint (no lm_head.weight).
        p1 = os.path.join(d, "w1.safetensors")
        safetensors.save(p1, {"model.embed_tokens.weight": w1})
        with Server(workers=2, extra=["--lm-head", save(os.path.join(d, "w1-start.safetensors"), w1)]) as s, \
                s.client() as c:
            expect = score(c)
        cli = os.path.join(BIN_DIR, "logprob-client")
        with Server(workers=2, extra=["--lm-head", "policy=" + p0, "--allow-lm-head-updates"]) as s, s.client() as c:
            r = subprocess.run([cli, "update-lm-head", "--server", s.address, "--head", "policy", "--version", "cli-1",
                                "--input", p1, "--rows-per-call", "100"], capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("policy version cli-1 sha256 ", r.stdout)
            self.assertIn("%d/%d rows" % (V, V), r.stderr)  # progress, 4 calls of <= 100 rows
            self.assertEqual(r.stderr.count(" rows ("), 4, r.stderr)
            got = score(c)
            self.assertEqual(got.head_version, "cli-1")
            same(got, expect)
            r = subprocess.run([cli, "heads", "--server", s.address], capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("policy  version cli-1  retained [cli-1]  [%d, %d] F32" % (V, H), r.stdout)
            # A missing checkpoint is a bad input (2); the server's refusal is 1.
            r = subprocess.run([cli, "update-lm-head", "--server", s.address, "--head", "policy", "--version", "x",
                                "--input", os.path.join(d, "nope.safetensors")], capture_output=True, text=True,
                               timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            r = subprocess.run([cli, "update-lm-head", "--server", s.address, "--head", "other", "--version", "x",
                                "--input", p1], capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("NOT_FOUND", r.stderr)


def rss(pid):
    """(RssAnon, VmRSS) of process ``pid`` in bytes, from /proc/PID/status."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out["RssAnon"], out["VmRSS"]


class ConvertedCopyTest(unittest.TestCase):
    """Issue 34: on a CPU without a bf16 matmul (oneDNN held to AVX2) the
    bf16 precision multiplies in f32, and the weights used to be converted
    into a fresh copy per version. Now each worker keeps its slice as
    mapped from the store and converts one column tile at a time, so
    back-to-back updates leave its anonymous memory where it was: the
    (retain + 1) versions' converted bytes are 0, within a slack of half a
    version's slice (allocator and gRPC noise). With a converted copy per
    version it grows by a whole slice per held version past the first."""

    def test_back_to_back_updates_leave_the_workers_memory_bounded(self):
        vocab, hidden, retain, updates = 16384, 1024, 2, 6
        d = temp_dir("lm_head_rss")
        rng = np.random.default_rng(5)
        heads = [rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.05 for _ in range(2)]
        with mock.patch.dict(os.environ, {"ONEDNN_MAX_CPU_ISA": "AVX2"}):
            server = Server(workers=2, extra=[
                "--lm-head", save(os.path.join(d, "w0.safetensors"), heads[0]), "--lm-head-precision", "bf16",
                "--allow-lm-head-updates", "--lm-head-retain", str(retain)])
        with server as s, s.client() as c:
            # The path under test: bf16 operands on an f32 GEMM, weights converted per tile.
            self.assertIn("oneDNN f32 GEMM, bf16 operands, F32 weights converted per tile", s.log())
            hidden_states = np.random.default_rng(6).standard_normal((8, hidden)).astype(np.float32)
            ids = np.arange(8, dtype=np.int64)

            def scored(version):
                r = c.score(hidden_states=hidden_states, input_ids=ids, cu_seqlens=np.array([0, 8]))
                self.assertEqual(r.head_version, version)

            scored("initial")  # the GEMM's scratch and tile buffers are allocated
            pids = worker_pids(s)
            self.assertEqual(len(pids), 2)
            before = {pid: rss(pid) for pid in pids}
            slice_bytes = vocab // 2 * hidden * 4  # one worker's slice of one version (F32), mapped
            slack = slice_bytes // 2
            for i in range(updates):
                self.assertEqual(c.update_lm_head("default", heads[(i + 1) % 2], version="v%d" % i), "v%d" % i)
                scored("v%d" % i)

            def bounded():
                now = {pid: rss(pid) for pid in pids}
                return all(now[p][0] - before[p][0] <= slack and
                           now[p][1] - before[p][1] <= (retain + 1) * slice_bytes + slack for p in pids), now

            try:
                wait_for(lambda: bounded()[0], "the workers' memory to settle within the bound", 30)
            except AssertionError:
                now = bounded()[1]
                self.fail("workers' (RssAnon, VmRSS) grew past the bound (RssAnon <= before + %d; VmRSS <= before + "
                          "%d): before %s, after %s" % (slack, (retain + 1) * slice_bytes + slack, before, now))


class OneWorkerTest(unittest.TestCase):
    def test_an_update_on_one_worker_scores_as_a_server_started_with_it(self):
        d = temp_dir("lm_head_one")
        w1 = weights(2)
        with Server(workers=1, extra=["--lm-head", save(os.path.join(d, "w1.safetensors"), w1)]) as s, \
                s.client() as c:
            expect = score(c)
        with Server(workers=1, extra=["--lm-head", save(os.path.join(d, "w0.safetensors"), weights(1)),
                                      "--allow-lm-head-updates"]) as s, s.client() as c:
            self.assertEqual(c.update_lm_head("default", w1, version="v1"), "v1")
            r = score(c)
            self.assertEqual(r.head_version, "v1")
            same(r, expect)

    def test_an_update_with_a_bias_and_scalars_scores_as_a_server_started_with_them(self):
        # The head's transform pushed with the update (bias, logit_scale,
        # final_logit_softcapping) against a server started on a file with
        # lm_head.bias and the scalars as flags: bitwise the same answers.
        d = temp_dir("lm_head_transform")
        w1 = weights(2)
        b1 = np.random.default_rng(5).standard_normal(V).astype(np.float32)
        path = os.path.join(d, "w1b.safetensors")
        safetensors.save(path, {"lm_head.weight": w1, "lm_head.bias": b1})
        with Server(workers=1, extra=["--lm-head", path, "--lm-head-logit-scale", "4",
                                      "--lm-head-softcap", "5"]) as s, s.client() as c:
            expect = score(c)
            (h,) = c.lm_heads()
            self.assertEqual((h.has_bias, h.logit_scale, h.final_logit_softcapping), (True, 4.0, 5.0))
        with Server(workers=1, extra=["--lm-head", save(os.path.join(d, "w0.safetensors"), weights(1)),
                                      "--allow-lm-head-updates"]) as s, s.client() as c:
            (h,) = c.lm_heads()
            self.assertEqual((h.has_bias, h.logit_scale, h.final_logit_softcapping), (False, 1.0, 0.0))
            with self.assertRaises(LogprobError) as e:
                c.update_lm_head("default", w1, version="bad", final_logit_softcapping=-1.0)
            self.assertIn("final_logit_softcapping", str(e.exception))
            self.assertEqual(c.update_lm_head("default", w1, version="v1", bias=b1, logit_scale=4.0,
                                              final_logit_softcapping=5.0), "v1")
            (h,) = c.lm_heads()
            self.assertEqual((h.version, h.has_bias, h.logit_scale, h.final_logit_softcapping), ("v1", True, 4.0, 5.0))
            same(score(c), expect)
            # The next update without them keeps the head's transform.
            self.assertEqual(c.update_lm_head("default", w1, version="v2"), "v2")
            (h,) = c.lm_heads()
            self.assertEqual((h.version, h.has_bias, h.logit_scale, h.final_logit_softcapping), ("v2", True, 4.0, 5.0))
            same(score(c), expect)


class StreamHeadTest(unittest.TestCase):
    """score_stream (sync and asyncio) keeps head and head_version on every
    request it rebuilds (issue 31): a prepared ScoreRequest without an id
    used to lose them and be scored with the default head."""

    def test_score_stream_keeps_the_head_and_the_pinned_version(self):
        from logprob_client._internal.tensors import F32, I64, to_tensor
        d = temp_dir("stream_head")
        pol = save(os.path.join(d, "policy.safetensors"), weights(1))
        ref = save(os.path.join(d, "reference.safetensors"), weights(9))
        cu = np.array([0, 10, T], np.int64)
        with Server(workers=1, extra=["--lm-head", "policy=" + pol, "--lm-head", "reference=" + ref]) as s, \
                s.client() as c:
            want = c.score(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=cu, head="reference")
            other = c.score(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=cu, head="policy")
            self.assertFalse(np.array_equal(np.asarray(want["token_logprobs"]), np.asarray(other["token_logprobs"])))

            def prepared():
                return pb2.ScoreRequest(head="reference", head_version="initial", inputs=[
                    to_tensor("hidden_states", F32, HIDDEN), to_tensor("input_ids", I64, IDS),
                    to_tensor("cu_seqlens", I64, cu)])

            items = [prepared(), dict(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=cu, head="reference",
                                      head_version="initial")]
            got = list(c.score_stream(items))
            self.assertEqual(len(got), 2)
            for r in got:
                self.assertEqual((r.head, r.head_version), ("reference", "initial"))
                np.testing.assert_array_equal(np.asarray(r["token_logprobs"]), np.asarray(want["token_logprobs"]))

            async def aio_stream():
                async with aio.LogprobClient(s.address) as a:
                    return [r async for r in a.score_stream([prepared()])]

            (r,) = asyncio.run(aio_stream())
            self.assertEqual((r.head, r.head_version), ("reference", "initial"))
            np.testing.assert_array_equal(np.asarray(r["token_logprobs"]), np.asarray(want["token_logprobs"]))
            # A pinned version the server does not hold fails: the pin was sent.
            bad = prepared()
            bad.head_version = "nope"
            (err,) = list(c.score_stream([bad], return_exceptions=True))
            self.assertIsInstance(err, LogprobError)
            self.assertIn("nope", err.message)


class UpdatesOffTest(unittest.TestCase):
    def test_updates_are_off_unless_allowed(self):
        d = temp_dir("lm_head_off")
        path = save(os.path.join(d, "w.safetensors"), weights(1))
        with Server(extra=["--lm-head", path]) as s, s.client() as c:
            self.assertFalse(c.server_info().lm_head_updates)
            with self.assertRaises(LogprobError) as e:
                c.update_lm_head("default", weights(2), version="v1")
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertEqual(e.exception.reason, "LM_HEAD_UPDATES_DISABLED")
            r = score(c)
            self.assertEqual((r.head, r.head_version), ("default", "initial"))


class GoldenUpdateTest(unittest.TestCase):
    """The golden hidden-states case after an update to its lm_head: within
    the SPEC tolerance of the float64 expected outputs and bitwise those of
    a server started with that lm_head, for every source of rows (pieces,
    shared memory, a file under --lm-head-update-dir, row ranges from two
    senders), on 1 and 2 workers, token- and vocab-parallel."""

    CONFIGS = ((1, "auto"), (2, "token"), (2, "vocab"))

    @classmethod
    def setUpClass(cls):
        cls.case = Golden("hidden_bf16")
        golden_head = os.path.join(GOLDEN_DIR, cls.case.meta["lm_head"])
        cls.golden_w = safetensors.load(golden_head)[0]["lm_head.weight"]  # uint16 bf16 bits
        cls.dir = temp_dir("lm_head_golden")
        cls.update_dir = os.path.join(cls.dir, "updates")
        os.makedirs(cls.update_dir)
        shutil.copy(golden_head, os.path.join(cls.update_dir, "golden.safetensors"))
        # The start version: other bf16 weights of the same shape.
        rng = np.random.default_rng(5)
        magnitude = rng.integers(0x3c00, 0x3e00, size=cls.golden_w.shape, dtype=np.uint16)  # 2^-7 .. 2^-3
        cls.other_w = magnitude | (rng.integers(0, 2, size=magnitude.shape, dtype=np.uint16) << 15)
        cls.start = os.path.join(cls.dir, "start.safetensors")
        safetensors.save(cls.start, {"lm_head.weight": cls.other_w}, bf16=["lm_head.weight"])

    def score(self, client):
        return client.score(**self.case.score_kwargs())

    def check(self, result, version, expect):
        self.assertEqual(result.head_version, version)
        got = {k: np.asarray(v) for k, v in result.outputs.items()}
        self.assertEqual(compare(self.case.expected, got), "")
        for name, e in expect.outputs.items():
            np.testing.assert_array_equal(got[name], np.asarray(e), err_msg=name)

    def put_ranges(self, stub, update_id, r0, r1):
        rows = np.ascontiguousarray(self.golden_w[r0:r1])
        stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
            update_id=update_id, row_begin=r0,
            rows=pb2.Tensor(name="rows", dtype=pb2.BF16, shape=list(rows.shape), data=rows.tobytes())))]))

    def test_every_source_scores_the_golden_case_as_a_server_started_with_its_lm_head(self):
        vocab, hidden = self.golden_w.shape
        for workers, parallelism in self.CONFIGS:
            with self.subTest(workers=workers, parallelism=parallelism):
                # Two servers' bits are compared: the pool's bf16 CPU kernel is
                # pinned, not measured at each start (a near tie, or a loaded
                # machine, can pick the other kernel, which sums in another
                # order; docs/serving.md --lm-head-cpu-kernel).
                flags = ["--parallelism", parallelism, "--lm-head-cpu-kernel", "widen"]
                with Server(workers=workers, extra=flags + ["--lm-head", os.path.join(
                        GOLDEN_DIR, self.case.meta["lm_head"])]) as s, s.client() as c:
                    expect = self.score(c)
                self.assertEqual(compare(self.case.expected, {k: np.asarray(v) for k, v in expect.outputs.items()}),
                                 "")
                with Server(workers=workers, extra=flags + [
                        "--lm-head", self.start, "--allow-lm-head-updates",
                        "--lm-head-update-dir", self.update_dir]) as s, \
                        s.client() as c, s.client(shared_memory=False) as pieces:
                    self.assertNotEqual(compare(self.case.expected,
                                                {k: np.asarray(v) for k, v in self.score(c).outputs.items()}), "",
                                        "the start weights must score differently")
                    self.assertEqual(pieces.update_lm_head("default", self.golden_w, version="pieces", dtype="bf16"),
                                     "pieces")
                    self.check(self.score(c), "pieces", expect)
                    c.update_lm_head("default", self.other_w, version="other-1", dtype="bf16")
                    self.assertEqual(c.update_lm_head("default", self.golden_w, version="shm", dtype="bf16"), "shm")
                    self.assertTrue(c._shm and c._shm._all and c._shm.failed is None,
                                    "shared memory should be in use")
                    self.check(self.score(c), "shm", expect)
                    c.update_lm_head("default", self.other_w, version="other-2", dtype="bf16")
                    upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                        head="default", version="file", vocab_size=vocab, hidden_size=hidden, dtype=pb2.BF16))
                    c._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                        update_id=upd.update_id, file=pb2.LmHeadFile(path="golden.safetensors")))]))
                    c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
                    self.check(self.score(c), "file", expect)
                    c.update_lm_head("default", self.other_w, version="other-3", dtype="bf16")
                    # Two senders (two clients, two threads), each its half of the vocabulary.
                    upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                        head="default", version="ranges", vocab_size=vocab, hidden_size=hidden, dtype=pb2.BF16))
                    half = vocab // 2 + 3
                    errors = []

                    def send(stub, r0, r1):
                        try:
                            self.put_ranges(stub, upd.update_id, r0, r1)
                        except grpc.RpcError as e:  # pragma: no cover - reported below
                            errors.append(e)
                    senders = [threading.Thread(target=send, args=(c._stub, half, vocab)),
                               threading.Thread(target=send, args=(pieces._stub, 0, half))]
                    for t in senders:
                        t.start()
                    for t in senders:
                        t.join()
                    self.assertEqual(errors, [])
                    c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
                    self.check(self.score(c), "ranges", expect)


class UnconfirmedRegionTest(unittest.TestCase):
    """Update rows from shared memory follow the rule of scoring inputs: a
    region whose registration never proved write access (the challenge
    written into the object, ConfirmSharedMemory) is never read."""

    def test_rows_from_an_unconfirmed_region_are_refused_and_change_nothing(self):
        d = temp_dir("lm_head_unconfirmed")
        w0 = weights(1)
        shm_name = "/logprob-update-test-%d" % os.getpid()
        byte_size = V * H * 4
        fd = os.open("/dev/shm" + shm_name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.pwrite(fd, weights(2).tobytes(), 0)
            os.ftruncate(fd, byte_size + 32)
            with Server(extra=["--lm-head", save(os.path.join(d, "w0.safetensors"), w0),
                               "--allow-lm-head-updates"]) as s, s.client() as c:
                before = score(c)
                md = (("logprob-shm-session", "unconfirmed-update-session-0123"),)
                reply = c._stub.RegisterSharedMemory(pb2.RegisterSharedMemoryRequest(
                    name="rows", shm_name=shm_name, byte_size=byte_size), metadata=md)
                self.assertEqual(len(reply.challenge), 32)
                upd = c._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                    head="default", version="stolen", vocab_size=V, hidden_size=H, dtype=pb2.F32))
                rows = pb2.Tensor(name="rows", dtype=pb2.F32, shape=[V, H])
                rows.shared_memory.region, rows.shared_memory.offset, rows.shared_memory.byte_size = \
                    "rows", 0, byte_size
                with self.assertRaises(grpc.RpcError) as e:
                    c._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(
                        update_id=upd.update_id, rows=rows))]), metadata=md)
                self.assertEqual(e.exception.code(), grpc.StatusCode.PERMISSION_DENIED)
                self.assertIn("not confirmed", e.exception.details())
                with self.assertRaises(grpc.RpcError) as e:
                    c._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id=upd.update_id))
                self.assertNotIn("stolen", [h.version for h in c.lm_heads()])
                after = score(c)
                self.assertEqual(after.head_version, "initial")
                same(after, before)
        finally:
            os.close(fd)
            os.unlink("/dev/shm" + shm_name)


class UpdateAuthTest(unittest.TestCase):
    """With --auth-token-file, updates need the token like any call: every
    update RPC without it is UNAUTHENTICATED and nothing changes."""

    def test_updates_need_the_bearer_token(self):
        d = temp_dir("lm_head_auth")
        token = os.path.join(d, "token")
        with open(token, "w") as f:
            f.write("update-token-0123456789\n")
        w1 = weights(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the token over plaintext loopback
            with Server(extra=["--lm-head", save(os.path.join(d, "w0.safetensors"), weights(1)),
                               "--allow-lm-head-updates", "--auth-token-file", token],
                        client_kwargs={"token": "update-token-0123456789"}) as s, \
                    s.client() as c, LogprobClient(s.address) as anonymous:
                before = score(c)
                with self.assertRaises(LogprobError) as e:
                    anonymous.update_lm_head("default", w1, version="v1")
                self.assertEqual(e.exception.code, grpc.StatusCode.UNAUTHENTICATED)
                for call in (lambda: anonymous._stub.BeginLmHeadUpdate(pb2.BeginLmHeadUpdateRequest(
                                 head="default", version="v1", vocab_size=V, hidden_size=H, dtype=pb2.F32)),
                             lambda: anonymous._stub.CommitLmHeadUpdate(pb2.LmHeadUpdateRef(update_id="x")),
                             lambda: anonymous._stub.AbortLmHeadUpdate(pb2.LmHeadUpdateRef(update_id="x")),
                             lambda: anonymous._stub.PutLmHeadRows(iter([pb2.LmHeadRowsPart(
                                 rows=pb2.LmHeadRows(update_id="x"))]))):
                    with self.assertRaises(grpc.RpcError) as e:
                        call()
                    self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                same(score(c), before)
                self.assertEqual(score(c).head_version, "initial")
                self.assertEqual(c.update_lm_head("default", w1, version="v1"), "v1")
                self.assertEqual(score(c).head_version, "v1")

    def test_a_scoring_token_cannot_update_and_the_update_token_can(self):
        """--update-token-file: the scoring token is PERMISSION_DENIED on
        updates (naming the update right) and changes nothing; a client with
        ``update_token`` updates (its rows through a shared-memory session
        of its own) and scores with either token; the asyncio client too."""
        d = temp_dir("lm_head_update_token")
        paths = {}
        for name, value in (("token", "scoring-token-0123456789"), ("update", "update-token-9876543210")):
            paths[name] = os.path.join(d, name)
            with open(paths[name], "w") as f:
                f.write(value + "\n")
        w1, w2 = weights(2), weights(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tokens over plaintext loopback
            with Server(extra=["--lm-head", save(os.path.join(d, "w0.safetensors"), weights(1)),
                               "--allow-lm-head-updates", "--auth-token-file", paths["token"],
                               "--update-token-file", paths["update"]],
                        client_kwargs={"token_file": paths["token"]}) as s, s.client() as scorer, \
                    s.client(update_token_file=paths["update"]) as updater:
                before = score(scorer)
                with self.assertRaises(LogprobError) as e:
                    scorer.update_lm_head("default", w1, version="v1")
                self.assertEqual(e.exception.code, grpc.StatusCode.PERMISSION_DENIED)
                self.assertIn("BeginLmHeadUpdate needs the update right", e.exception.message)
                self.assertNotIn("scoring-token", e.exception.message)
                self.assertEqual(score(scorer).head_version, "initial")
                same(score(updater), before)  # the updater scores with its scoring token (and its region)
                self.assertEqual(updater.update_lm_head("default", w1, version="v1"), "v1")
                if updater._shm is not None:  # on this host: the rows went through the update session's region
                    self.assertIsNot(updater._update_shm, updater._shm)
                after = score(scorer)
                self.assertEqual(after.head_version, "v1")
                self.assertFalse(np.array_equal(np.asarray(after["token_logprobs"]),
                                                np.asarray(before["token_logprobs"])))

                async def by_update_token_only():
                    async with aio.LogprobClient(s.address, update_token="update-token-9876543210") as c:
                        self.assertEqual(await c.update_lm_head("default", w2, version="v2"), "v2")
                        r = await c.score(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=np.array([0, T]))
                        return r.head_version

                self.assertEqual(asyncio.run(by_update_token_only()), "v2")


if __name__ == "__main__":
    unittest.main()


def store_folders(root):
    """The front-ends' store folders under ``root`` (their names)."""
    return sorted(n for n in os.listdir(root) if n.startswith("logprob-lm-heads-"))


def lock_is_free(path):
    """Whether nobody holds an flock on ``path`` (taken and given back)."""
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


class StoreFolderTest(unittest.TestCase):
    """The store survives containers (issue 31 item 5): each front-end
    start has its own locked store folder; a restart with the same PID
    removes its dead predecessor's; two front-ends on one root never share
    a file and both score their own updates."""

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("store_folder")
        cls.w0, cls.w1, cls.w2 = weights(1), weights(2), weights(3)
        cls.p0 = save(os.path.join(cls.dir, "w0.safetensors"), cls.w0)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def server(self, root, **kw):
        return Server(workers=1, extra=["--lm-head", "policy=" + self.p0, "--allow-lm-head-updates",
                                        "--lm-head-store-dir", root], **kw)

    def test_a_restarted_pid_1_front_end_removes_its_dead_predecessors_store(self):
        prefix = pid_namespace_prefix()
        if prefix is None:
            self.skipTest("this machine cannot make a PID namespace (unshare --pid --fork --mount-proc, also with "
                          "--user --map-root-user)")
        root = os.path.join(self.dir, "restart")
        first = self.server(root, prefix=prefix)
        try:
            with first.client() as c:
                self.assertEqual(c.update_lm_head("policy", self.w1, version="v1"), "v1")
            [dead] = store_folders(root)
            self.assertTrue(dead.startswith("logprob-lm-heads-1-"), dead)  # PID 1 in its namespace
            self.assertTrue(any(n.endswith(".safetensors") for n in os.listdir(os.path.join(root, dead))))
            first.proc.kill()  # as a container's runtime does: no clean-up
            first.proc.wait()
        finally:
            first.close()
        # unshare --kill-child SIGKILLs the namespace's PID 1 as it dies, but
        # that server leaves (and drops its lock) a moment later: wait for it.
        wait_for(lambda: lock_is_free(os.path.join(root, dead, ".lock")), "the killed front-end's store lock")
        self.assertEqual(store_folders(root), [dead], "a killed front-end leaves its store")
        with self.server(root, prefix=prefix) as second:
            [alive] = store_folders(root)
            self.assertNotEqual(alive, dead)
            self.assertTrue(alive.startswith("logprob-lm-heads-1-"), alive)
            self.assertIn("removed 1 stale lm_head store(s)", second.log())
            with second.client() as c:
                self.assertEqual(c.update_lm_head("policy", self.w2, version="v1"), "v1")

    def test_two_front_ends_on_one_root_write_distinct_files_and_score_their_own_updates(self):
        root = os.path.join(self.dir, "shared")
        with Server(workers=1, extra=["--lm-head", save(os.path.join(self.dir, "w1.safetensors"), self.w1)]) as s1, \
                s1.client() as c1, \
                Server(workers=1, extra=["--lm-head", save(os.path.join(self.dir, "w2.safetensors"), self.w2)]) as s2, \
                s2.client() as c2:
            expect = {"w1": score(c1), "w2": score(c2)}
        with self.server(root, metrics=True) as a, self.server(root, metrics=True) as b, \
                a.client() as ca, b.client() as cb:
            # The same head and version name on both: the same file name
            # within each store, which must not be one file. a's put loses
            # its answer once (UNAVAILABLE after the server took the rows):
            # the client sends it again and the server answers it as the first.
            class Lost(grpc.RpcError):
                def code(self):
                    return grpc.StatusCode.UNAVAILABLE

                def details(self):
                    return "the answer was lost"

            real, calls = ca._put_lm_head_rows_raw, []

            def answer_lost_once(parts, *args, **kwargs):
                response = real(parts, *args, **kwargs)
                calls.append(response.rows_received)
                if len(calls) == 1:
                    raise Lost()
                return response

            ca._put_lm_head_rows_raw = answer_lost_once
            self.assertEqual(ca.update_lm_head("policy", self.w1, version="step-1"), "step-1")
            self.assertEqual(calls, [V, V], "the put is sent again and counted once")
            self.assertEqual(cb.update_lm_head("policy", self.w2, version="step-1"), "step-1")
            folders = store_folders(root)
            self.assertEqual(len(folders), 2, folders)
            files = [os.path.join(root, f, n) for f in folders for n in os.listdir(os.path.join(root, f))
                     if n.endswith(".safetensors")]
            self.assertEqual(len(files), 2, files)
            self.assertNotEqual(os.stat(files[0]).st_ino, os.stat(files[1]).st_ino)
            same(score(ca, head="policy"), expect["w1"])
            same(score(cb, head="policy"), expect["w2"])
            # The store's bytes: a metric and in ServerInfo (the file's blocks).
            for server, client in ((a, ca), (b, cb)):
                wait_for(lambda: server.metric("logprob_lm_head_store_bytes") >= V * H * 4, "the store's bytes metric")
                self.assertGreaterEqual(client.server_info(refresh=True).lm_head_store_bytes, V * H * 4)
            # Update ids (32 hex digits, the capability to put and commit) never reach the log.
            for server in (a, b):
                self.assertIn("update to version step-1", server.log())
                self.assertIsNone(re.search(r"\b[0-9a-f]{32}\b", server.log()), server.log())
        self.assertEqual(store_folders(root), [], "a front-end that stops removes its store")
