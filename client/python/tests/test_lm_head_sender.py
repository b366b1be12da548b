"""Tensor-parallel senders of one lm_head update (issue 31 item 9): two
processes, each with its own client (rank 0 sync, rank 1 asyncio), send the
two vocabulary halves of one update begun by rank 0, which commits after a
barrier; the head then scores bitwise as a server started with the whole
weight. Also: abort, an already committed version, and a handle that keeps
its capability out of its repr."""
import asyncio
import multiprocessing
import os
import pickle
import unittest

import grpc
import numpy as np

from support import Server, hashed_head, temp_dir
from logprob_client import LmHeadUpdateHandle, LogprobClient, LogprobError, aio, safetensors

V, H, T = 301, 64, 24
HALF = 150
HIDDEN = np.random.default_rng(7).standard_normal((T, H)).astype(np.float32)
IDS = (np.arange(T) * 37 % V).astype(np.int64)
CU = np.array([0, 10, T], np.int64)
WAIT = 120.0  # seconds a rank waits for the other (a generous bound, not a sleep)


def weights(seed):
    return np.random.default_rng(seed).standard_normal((V, H)).astype(np.float32) * 0.2


def score(client, **kw):
    return client.score(hidden_states=HIDDEN, input_ids=IDS, cu_seqlens=CU, head="policy", entropy=True, topk=5,
                        **kw)


def same(a, b):
    for name in ("token_logprobs", "entropy", "topk_logprobs", "topk_indices"):
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def rank_main(rank, address, version, seed, conn, barrier, results):
    """One tensor-parallel rank: its own client, its own half of the rows."""
    try:
        w = weights(seed)
        if rank == 0:
            with LogprobClient(address) as c:
                update = c.begin_lm_head_update("policy", version=version, vocab_size=V, hidden_size=H, dtype="f32")
                conn.send(update)  # as torch.distributed.broadcast_object_list would: pickled
                c.put_lm_head_rows(update, 0, w[:HALF])
                barrier.wait(WAIT)  # every rank has put its rows
                results.put((rank, "ok", c.commit_lm_head_update(update)))
        else:
            if not conn.poll(WAIT):
                raise TimeoutError("rank 0 sent no update")
            update = conn.recv()
            if update is None:
                raise RuntimeError("rank 0 failed before it sent the update")
            import torch  # a trainer's shard is a tensor

            async def put():
                async with aio.LogprobClient(address, shared_memory=False) as a:  # its rows in pieces
                    await a.put_lm_head_rows(update, HALF, torch.from_numpy(w[HALF:]))

            asyncio.run(put())
            barrier.wait(WAIT)
            results.put((rank, "ok", ""))
    except BaseException as e:  # reported to the test; the other rank is released
        barrier.abort()
        if rank == 0:
            conn.send(None)
        results.put((rank, "error", "%s: %s" % (type(e).__name__, e)))


def dist_rank_main(rank, address, init_file, version, seed, row_begins, results):
    """One rank of a torch.distributed (gloo) group running
    ``push_lm_head_shard`` with its own client; ``row_begins[rank]`` is
    where its shard starts (the halves, or a bad start to make it fail)."""
    try:
        import torch
        import torch.distributed as dist
        from logprob_client.tensor_parallel import push_lm_head_shard

        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
        try:
            w = torch.from_numpy(weights(seed))
            shard = w[:HALF] if rank == 0 else w[HALF:]
            with LogprobClient(address) as c:
                got = push_lm_head_shard(c, shard, row_begins[rank], V, version, head="policy")
            results.put((rank, "ok", got))
        finally:
            dist.destroy_process_group()
    except LogprobError as e:
        results.put((rank, e.code.name, e.message))
    except BaseException as e:
        results.put((rank, "error", "%s: %s" % (type(e).__name__, e)))


def run_ranks(target, args_of):
    """Runs ``target(rank, *args_of(rank), results)`` in two spawned
    processes; returns their reports, sorted by rank."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC channels
    results = ctx.Queue()
    ranks = [ctx.Process(target=target, args=(r,) + args_of(r, ctx) + (results,)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        return sorted(results.get(timeout=2 * WAIT) for _ in ranks)
    finally:
        for p in ranks:
            p.join(WAIT)
            if p.is_alive():
                p.kill()


class TensorParallelSendersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("lm_head_sender")
        start = os.path.join(cls.dir, "w0.safetensors")
        safetensors.save(start, {"lm_head.weight": weights(1)})
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + start, "--allow-lm-head-updates",
                                              "--lm-head-retain", "2"])
        # A server started with the whole weight: what the update must reproduce bitwise.
        whole = os.path.join(cls.dir, "w2.safetensors")
        safetensors.save(whole, {"lm_head.weight": weights(2)})
        with Server(workers=2, extra=["--lm-head", "policy=" + whole]) as s, s.client() as c:
            cls.expect = score(c)

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def test_two_processes_send_the_halves_of_one_update(self):
        shared = {}

        def args_of(rank, ctx):
            if not shared:
                shared["pipe"], shared["barrier"] = ctx.Pipe(), ctx.Barrier(2)
            return (self.server.address, "tp-2", 2, shared["pipe"][rank], shared["barrier"])

        self.assertEqual(run_ranks(rank_main, args_of), [(0, "ok", "tp-2"), (1, "ok", "")])
        with self.server.client() as c:
            got = score(c)
            self.assertEqual(got.head_version, "tp-2")
            same(got, self.expect)

    def test_push_lm_head_shard_over_torch_distributed(self):
        # A put that fails on one rank (its rows start past the vocabulary):
        # aborted, every rank raises it, the current version keeps serving.
        with self.server.client() as c:
            before = score(c)
        init = os.path.join(temp_dir("tp_init"), "bad")
        reports = run_ranks(dist_rank_main, lambda r, ctx: (self.server.address, init, "tp-bad", 3, (0, V)))
        self.assertEqual([r[:2] for r in reports], [(0, "INVALID_ARGUMENT"), (1, "INVALID_ARGUMENT")])
        for _, _, message in reports:
            self.assertIn("rank 1 of the tensor-parallel group", message)
        with self.server.client() as c:
            same(score(c), before)
        # The halves of the whole weight: bitwise a server started with it.
        init = os.path.join(temp_dir("tp_init"), "good")
        reports = run_ranks(dist_rank_main, lambda r, ctx: (self.server.address, init, "tp-dist-2", 2, (0, HALF)))
        self.assertEqual(reports, [(0, "ok", "tp-dist-2"), (1, "ok", "tp-dist-2")])
        with self.server.client() as c:
            got = score(c)
            self.assertEqual(got.head_version, "tp-dist-2")
            same(got, self.expect)

    def test_asyncio_steps(self):
        async def run():
            async with aio.LogprobClient(self.server.address) as a:
                update = await a.begin_lm_head_update("policy", version="aio-steps", vocab_size=V, hidden_size=H,
                                                      dtype="f32")
                await a.put_lm_head_rows(update, HALF, weights(2)[HALF:])
                await a.put_lm_head_rows(update, 0, weights(2)[:HALF])
                version = await a.commit_lm_head_update(update)
                aborted = await a.begin_lm_head_update("policy", version="aio-aborted", vocab_size=V, hidden_size=H,
                                                       dtype="f32")
                await a.abort_lm_head_update(aborted)
                return version

        self.assertEqual(asyncio.run(run()), "aio-steps")
        with self.server.client() as c:
            got = score(c)
            self.assertEqual(got.head_version, "aio-steps")
            same(got, self.expect)

    def test_abort_already_committed_and_the_handle(self):
        with self.server.client() as c:
            before = score(c)
            update = c.begin_lm_head_update("policy", version="aborted", vocab_size=V, hidden_size=H,
                                            dtype=np.float32)
            self.assertEqual(len(update.update_id), 32)  # 128 bits, hex
            self.assertNotIn(update.update_id, repr(update))
            again = pickle.loads(pickle.dumps(update))
            self.assertIsInstance(again, LmHeadUpdateHandle)
            self.assertEqual((again.update_id, again.head, again.version, again.vocab_size, again.hidden_size),
                             (update.update_id, "policy", "aborted", V, H))
            c.put_lm_head_rows(again, 0, weights(3)[:HALF])
            # Rows missing: the commit fails naming them, and the update stays open.
            with self.assertRaises(LogprobError) as e:
                c.commit_lm_head_update(update)
            self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("first [%d, %d)" % (HALF, V), e.exception.message)
            c.put_lm_head_rows(update, HALF, weights(3)[HALF:])
            c.abort_lm_head_update(update)
            with self.assertRaises(LogprobError) as e:
                c.commit_lm_head_update(update)
            self.assertEqual(e.exception.code, grpc.StatusCode.ABORTED)
            now = score(c)
            self.assertEqual(now.head_version, before.head_version)
            same(now, before)
            # A committed (head, version, sha256) again: nothing to send or commit.
            c.update_lm_head("policy", weights(4), version="same-4")
            sha = hashed_head(c, "policy").sha256  # hashed after the commit: waits for it
            update = c.begin_lm_head_update("policy", version="same-4", vocab_size=V, hidden_size=H, dtype="f32",
                                            sha256=sha)
            self.assertTrue(update.already_committed)
            c.put_lm_head_rows(update, 0, weights(5))  # nothing is sent
            self.assertEqual(c.commit_lm_head_update(update), "same-4")


if __name__ == "__main__":
    unittest.main()
