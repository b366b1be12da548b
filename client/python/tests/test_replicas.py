"""Every replica on the same weights (issue 31 item 6): two front-ends behind
one address score with an update's version after update_lm_head_replicas
(bitwise as a server started with the new weights); a replica that is down
is reported by name and the version re-sent finishes the update; a
front-end started later with --lm-head-sync-from pulls the newest version
from its peers and serves nothing (health NOT_SERVING, hidden-states
requests UNAVAILABLE) until it holds it."""
import asyncio
import hashlib
import json
import os
import threading
import unittest
from concurrent import futures

import grpc
import numpy as np

from support import SOURCE_ROOT, Server, free_port, temp_dir, wait_for
from logprob_client import LogprobClient, LogprobError, RetryPolicy, safetensors
from logprob_client._internal._proto import pb2, pb2_grpc
from logprob_client.replicas import (ReplicaUpdateError, parse_target, resolve_replicas, update_lm_head_replicas,
                                     update_lm_head_replicas_async, weight_sha256)

V, H, T = 211, 32, 20
HIDDEN = np.random.default_rng(5).standard_normal((T, H)).astype(np.float32)
IDS = (np.arange(T) * 29 % V).astype(np.int64)


def weights(seed):
    return np.random.default_rng(seed).standard_normal((V, H)).astype(np.float32) * 0.2


def save(path, w):
    safetensors.save(path, {"lm_head.weight": w})
    return path


def score(client, **kw):
    return client.score(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=np.array([0, 8, T]), entropy=True, topk=4,
                        head="policy", **kw)


def same(a, b):
    for name in ("token_logprobs", "entropy", "topk_logprobs", "topk_indices"):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def requests_ok(server):
    return server.metric("logprob_requests_total", method="Score", code="OK")


class ResolveTest(unittest.TestCase):
    def test_targets_resolve_to_every_replica(self):
        self.assertEqual(resolve_replicas("ipv4:127.0.0.1:1,127.0.0.1:2"), ["127.0.0.1:1", "127.0.0.1:2"])
        self.assertEqual(resolve_replicas(["a:1", "b:2", "a:1"]), ["a:1", "b:2"])
        self.assertEqual(resolve_replicas("a:1, b:2"), ["a:1", "b:2"])
        self.assertEqual(resolve_replicas("dns:///127.0.0.1:5"), ["127.0.0.1:5"])
        self.assertIn("127.0.0.1:7", resolve_replicas("dns:///localhost:7"))
        for bad in ("a", "ipv4:a", [], ["a:1", "dns:///b:2"], "dns:///nonexistent.invalid:1"):
            with self.assertRaises(ValueError, msg=repr(bad)):
                resolve_replicas(bad)

    def test_the_target_grammar_shared_with_the_server(self):
        # The cases the server's --lm-head-sync-from parser is tested
        # against too (tests/lm_head_peer_sync_test.cc, ReplicaTargetGolden).
        with open(os.path.join(SOURCE_ROOT, "tests", "data", "replica_targets", "targets.json")) as f:
            cases = json.load(f)["cases"]
        self.assertGreaterEqual(len(cases), 10)
        for case in cases:
            if case.get("error"):
                with self.assertRaises(ValueError, msg=repr(case["target"])):
                    parse_target(case["target"])
            else:
                self.assertEqual(parse_target(case["target"]), (case["kind"], case["addresses"]), case["target"])


class ReplicasTest(unittest.TestCase):
    """Two front-ends (one CPU worker each) started with the same start-up head."""

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("replicas")
        cls.w0, cls.w1, cls.w2 = weights(1), weights(2), weights(3)
        cls.p0 = save(os.path.join(cls.dir, "w0.safetensors"), cls.w0)
        cls.flags = ["--lm-head", "policy=" + cls.p0, "--allow-lm-head-updates"]
        cls.expect = {}
        for name, w in (("w1", cls.w1), ("w2", cls.w2)):
            path = save(os.path.join(cls.dir, name + ".safetensors"), w)
            with Server(extra=["--lm-head", "policy=" + path]) as s, s.client() as c:
                cls.expect[name] = score(c)
        cls.a = Server(extra=cls.flags, metrics=True)
        cls.b = Server(extra=cls.flags, metrics=True)
        cls.shared = "ipv4:%s,%s" % (cls.a.address, cls.b.address)

    @classmethod
    def tearDownClass(cls):
        cls.a.close()
        cls.b.close()

    def shared_client(self, **kw):
        # Shared memory off: a region registered on one replica is unknown to the others.
        return LogprobClient(self.shared, channel_options=[("grpc.lb_policy_name", "round_robin")],
                             shared_memory=False, **kw)

    def check_every_replica(self, version, expect, servers):
        before = [requests_ok(s) for s in servers]
        with self.shared_client() as c:
            for _ in range(4 * len(servers)):
                r = score(c)
                self.assertEqual((r.head, r.head_version), ("policy", version))
                same(r, expect)
        # round_robin spread them: every replica answered some, each with the new version.
        for s, n in zip(servers, before):
            self.assertGreater(requests_ok(s), n, s.address)
            with s.client() as c:
                r = score(c)
                self.assertEqual(r.head_version, version, s.address)
                same(r, expect)

    def test_1_update_reaches_every_replica_and_a_late_one_catches_up(self):
        with self.shared_client() as c:
            self.assertEqual(score(c).head_version, "initial")
        self.assertEqual(update_lm_head_replicas(self.shared, "policy", self.w1, version="step-1"), "step-1")
        self.check_every_replica("step-1", self.expect["w1"], [self.a, self.b])
        for s in (self.a, self.b):
            with s.client() as c:
                h = [x for x in c.lm_heads() if x.name == "policy"][0]
                self.assertEqual(h.sha256, weight_sha256(self.w1))
                self.assertGreater(h.committed_unix_ms, 0)
        # A third front-end started later pulls step-1 from its peers before it serves.
        with Server(extra=self.flags + ["--lm-head-sync-from", self.shared]) as late:
            self.assertIn("version step-1 pulled from", late.log())
            with late.client() as c:
                r = score(c)
                self.assertEqual(r.head_version, "step-1")
                same(r, self.expect["w1"])
                h = [x for x in c.lm_heads() if x.name == "policy"][0]
                self.assertEqual(h.sha256, weight_sha256(self.w1))

    def test_2_a_replica_down_is_named_and_a_resend_finishes(self):
        dead = "127.0.0.1:%d" % free_port()
        targets = [self.a.address, dead, self.b.address]

        async def update(replicas):
            return await update_lm_head_replicas_async(replicas, "policy", self.w2, version="step-2", timeout=60,
                                                       retry=RetryPolicy(max_attempts=2))

        with self.assertRaises(ReplicaUpdateError) as err:
            asyncio.run(update(targets))
        e = err.exception
        self.assertEqual(e.committed, [self.a.address, self.b.address])
        self.assertEqual(list(e.failed), [dead])
        self.assertEqual(e.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn(dead, str(e))
        self.assertIn("committed on 2 of 3 replicas", str(e))
        # The same version again (here without the dead one) is a no-op where it is committed.
        self.assertEqual(asyncio.run(update([self.a.address, self.b.address])), "step-2")
        self.check_every_replica("step-2", self.expect["w2"], [self.a, self.b])


    def test_3_read_rows_gives_the_version_and_follows_the_update_rules(self):
        with grpc.insecure_channel(self.a.address) as ch:
            stub = pb2_grpc.LogprobServiceStub(ch)
            parts = list(stub.ReadLmHeadRows(pb2.ReadLmHeadRowsRequest(head="policy", row_begin=3, row_end=10)))
            head = parts[0].version
            self.assertEqual((head.row_begin, head.row_end, head.info.vocab_size), (3, 10, V))
            self.assertEqual(head.info.sha256, weight_sha256(self.w2))
            rows = np.frombuffer(b"".join(p.piece.data for p in parts[1:]), np.float32).reshape(7, H)
            np.testing.assert_array_equal(rows, self.w2[3:10])
            for req, code in ((pb2.ReadLmHeadRowsRequest(head="policy", row_end=V + 1), grpc.StatusCode.INVALID_ARGUMENT),
                              (pb2.ReadLmHeadRowsRequest(head="nope"), grpc.StatusCode.NOT_FOUND),
                              (pb2.ReadLmHeadRowsRequest(head="policy", version="gone"),
                               grpc.StatusCode.FAILED_PRECONDITION)):
                with self.assertRaises(grpc.RpcError) as err:
                    list(stub.ReadLmHeadRows(req))
                self.assertEqual(err.exception.code(), code, req)
        # Where updates are off, nothing can be read out either.
        with Server(extra=["--lm-head", "policy=" + self.p0]) as off, grpc.insecure_channel(off.address) as ch:
            with self.assertRaises(grpc.RpcError) as err:
                list(pb2_grpc.LogprobServiceStub(ch).ReadLmHeadRows(pb2.ReadLmHeadRowsRequest(head="policy")))
            self.assertEqual(err.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("--allow-lm-head-updates", err.exception.details())


class _SlowPeer(pb2_grpc.LogprobServiceServicer):
    """A peer holding policy@step-1 (w1) that answers ReadLmHeadRows only
    once `release` is set."""

    def __init__(self, w):
        self.w = w
        self.asked = threading.Event()
        self.release = threading.Event()

    def info(self):
        return pb2.LmHeadInfo(name="policy", version="step-1", retained_versions=["step-1"], vocab_size=V,
                              hidden_size=H, dtype=pb2.F32, sha256=hashlib.sha256(self.w.tobytes()).hexdigest(),
                              source="update", logit_scale=1.0, committed_unix_ms=1)

    def GetServerInfo(self, request, context):
        return pb2.ServerInfo(lm_heads=[self.info()], lm_head_updates=True)

    def ReadLmHeadRows(self, request, context):
        self.asked.set()
        self.release.wait(120)
        yield pb2.LmHeadRowsChunk(version=pb2.LmHeadVersionRows(info=self.info(), row_begin=0, row_end=V))
        data = self.w.tobytes()
        step = 1000
        for off in range(0, len(data), step):
            yield pb2.LmHeadRowsChunk(piece=pb2.TensorPiece(tensor=0, offset=off, data=data[off:off + step]))


class CatchUpGateTest(unittest.TestCase):
    def test_nothing_is_served_until_the_peer_version_arrived(self):
        d = temp_dir("replicas_gate")
        w0, w1 = weights(1), weights(2)
        peer = _SlowPeer(w1)
        grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_LogprobServiceServicer_to_server(peer, grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        grpc_server.start()
        try:
            with Server(extra=["--lm-head", "policy=" + save(os.path.join(d, "w0.safetensors"), w0),
                               "--allow-lm-head-updates", "--lm-head-sync-from", "127.0.0.1:%d" % port],
                        wait=False) as late:
                self.assertTrue(peer.asked.wait(120), late.log())
                with late.client(retry=RetryPolicy(max_attempts=1)) as c:
                    self.assertFalse(c.health())
                    with self.assertRaises(LogprobError) as err:
                        score(c)
                    self.assertEqual(err.exception.code, grpc.StatusCode.UNAVAILABLE)
                    self.assertIn("catching up", err.exception.message)
                    peer.release.set()
                    late.wait_serving()
                    r = score(c)
                    self.assertEqual(r.head_version, "step-1")
                    with Server(extra=["--lm-head", "policy=" + save(os.path.join(d, "w1.safetensors"), w1)]) as ref, \
                            ref.client() as rc:
                        same(r, score(rc))
        finally:
            peer.release.set()
            grpc_server.stop(None)

    def test_with_a_token_the_catch_up_sends_it_and_reading_needs_it(self):
        d = temp_dir("replicas_token")
        token_file = os.path.join(d, "token")
        with open(token_file, "w") as f:
            f.write("replica-secret-token-0123456789\n")
        w1 = weights(2)
        flags = ["--lm-head", "policy=" + save(os.path.join(d, "w0.safetensors"), weights(1)),
                 "--allow-lm-head-updates", "--auth-token-file", token_file]
        auth = {"token_file": token_file}
        with Server(extra=flags, client_kwargs=auth) as a:
            update_lm_head_replicas([a.address], "policy", w1, version="step-1", **auth)
            with grpc.insecure_channel(a.address) as ch:
                with self.assertRaises(grpc.RpcError) as err:
                    list(pb2_grpc.LogprobServiceStub(ch).ReadLmHeadRows(pb2.ReadLmHeadRowsRequest(head="policy")))
                self.assertEqual(err.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            with Server(extra=flags + ["--lm-head-sync-from", a.address], client_kwargs=auth) as late, \
                    late.client() as c:
                r = score(c)
                self.assertEqual(r.head_version, "step-1")
                with a.client() as ac:
                    same(r, score(ac))


if __name__ == "__main__":
    unittest.main()
