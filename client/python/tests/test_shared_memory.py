"""Shared-memory inputs of the Python client (logprob_client/shared_memory.py)
against live servers: used on its own on the same host, bitwise the inline
results, one region per concurrent call, regions removed on close(),
re-registered after the server expired an idle session, inline when the
server has shared-memory inputs off."""

import os
import threading
import time
import unittest
import urllib.request
import warnings

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare, free_port

from logprob_client import logprob_pb2 as pb2
from logprob_client import shared_memory


def metric(port, series):
    """The value of ``series`` on http://127.0.0.1:PORT/metrics, or None."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
        for line in f.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    return None


def wait_for_metric(test, port, series, want, seconds=60):
    deadline = time.monotonic() + seconds
    last = None
    while time.monotonic() < deadline:
        last = metric(port, series)
        if last == want:
            return
        time.sleep(0.02)
    test.fail("%s did not reach %s within %d s (last %s)" % (series, want, seconds, last))


def region_names(client):
    """The regions the client's session has registered (ListSharedMemory)."""
    shm = client._shm
    reply = client._stub.ListSharedMemory(pb2.ListSharedMemoryRequest(), timeout=30, metadata=shm.metadata)
    return sorted(r.name for r in reply.regions)


class SharedMemoryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.metrics_port = free_port()
        cls.server = Server(
            workers=2,
            extra=["--metrics-listen", "127.0.0.1:%d" % cls.metrics_port, "--shared-memory-idle-timeout", "2s"],
        )

    @classmethod
    def tearDownClass(cls):
        cls.server.close()

    def test_golden_cases_through_shared_memory_are_bitwise_inline(self):
        with self.server.client() as shm_client, self.server.client(shared_memory=False) as inline_client:
            self.assertEqual(shm_client.server_info().host_id, shared_memory.host_id())
            for name in LOGITS_CASES:
                with self.subTest(case=name):
                    g = Golden(name)
                    got = shm_client.score(**g.score_kwargs())
                    ref = inline_client.score(**g.score_kwargs())
                    self.assertEqual(compare(g.expected, got.outputs), "")
                    for k, v in ref.outputs.items():
                        self.assertTrue(np.array_equal(v, got.outputs[k], equal_nan=True), k)
            self.assertIsInstance(shm_client._shm, shared_memory.SharedMemoryInputs)
            self.assertFalse(inline_client._shm)
            self.assertEqual(len(region_names(shm_client)), 1, "one reused region for sequential calls")
            wait_for_metric(self, self.metrics_port, "logprob_shared_memory_regions", 1)
        # close() unregistered it.
        wait_for_metric(self, self.metrics_port, "logprob_shared_memory_regions", 0)

    def test_concurrent_calls_lease_their_own_regions(self):
        g = Golden("llama_vocab_bf16")
        results, errors = [], []

        def run(client):
            try:
                results.append(client.score(**g.score_kwargs()))
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        with self.server.client() as client:
            threads = [threading.Thread(target=run, args=(client,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(errors, [])
            self.assertEqual(len(results), 4)
            for r in results:
                self.assertEqual(compare(g.expected, r.outputs), "")
            self.assertGreaterEqual(len(region_names(client)), 1)

    def test_idle_session_expires_and_the_client_registers_again(self):
        g = Golden("basic_f32")
        with self.server.client() as client:
            self.assertEqual(compare(g.expected, client.score(**g.score_kwargs()).outputs), "")
            # The server's reaper drops the session after 2 s without calls.
            wait_for_metric(self, self.metrics_port, "logprob_shared_memory_regions", 0)
            res = client.score(**g.score_kwargs())
            self.assertEqual(compare(g.expected, res.outputs), "")
            self.assertEqual(len(region_names(client)), 1)


class SharedMemoryOffTest(unittest.TestCase):
    def test_server_without_shared_memory_inputs_gets_inline_bytes(self):
        server = Server(workers=1, extra=["--shared-memory-inputs=false"])
        try:
            with server.client() as client, warnings.catch_warnings():
                warnings.simplefilter("error")
                self.assertFalse(client.server_info().shared_memory_inputs)
                g = Golden("basic_f32")
                self.assertEqual(compare(g.expected, client.score(**g.score_kwargs()).outputs), "")
                self.assertIsNone(client._shm)
        finally:
            server.close()

    def test_host_id_matches_the_definition(self):
        hid = shared_memory.host_id()
        self.assertEqual(len(hid), 32)
        self.assertTrue(all(c in "0123456789abcdef" for c in hid))
        self.assertTrue(os.path.exists("/dev/shm"))


if __name__ == "__main__":
    unittest.main()
