"""Shared-memory inputs of the Python client (logprob_client/_internal/shared_memory.py)
against live servers: used on its own on the same host, bitwise the inline
results, one region per concurrent call, regions removed on close(),
re-registered after the server expired an idle session, inline when the
server has shared-memory inputs off; a second local user who only knows a
region's object name gets nothing from it (the proof of write access)."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import unittest
import urllib.request
import warnings

import grpc
import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare, free_port, pid_namespace_prefix

from logprob_client import LogprobError
from logprob_client import logprob_pb2 as pb2
from logprob_client._internal import shared_memory


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

    def test_send_each_copies_into_two_regions_and_registers_again_when_forgotten(self):
        # An lm_head update's puts: batch i + 1 is copied into the other
        # region while batch i's call runs; each call must see its own
        # bytes. At batch 2 the call says the server forgot the region
        # (NOT_FOUND): the remaining batches go through fresh regions.
        with self.server.client() as client:
            shm = client._run(client._shared_memory_ops(client._deadline(30)))
            self.assertIsNotNone(shm)
            batches = [[("x", pb2.F32, np.full(300000, i, np.float32))] for i in range(6)]
            seen = []

            def call(i, tensors, metadata):
                ref = tensors[0].shared_memory
                region = [r for r in shm._all if r.name == ref.region][0]
                got = np.frombuffer(region.mm, np.float32, count=300000, offset=ref.offset)
                seen.append((i, ref.region, bool((got == i).all())))
                del got
                if i == 2 and [s[0] for s in seen].count(2) == 1:
                    raise LogprobError(grpc.StatusCode.NOT_FOUND, "region forgotten (test)",
                                       reason=pb2.ErrorReason.Name(pb2.SHARED_MEMORY_REGION_NOT_REGISTERED))
                return "put %d" % i
                yield  # an operation (ops.py): a generator

            results = client._run(shm.send_each(batches, call))
            self.assertEqual(results, ["put %d" % i for i in range(6)])
            self.assertEqual([s[0] for s in seen], [0, 1, 2, 2, 3, 4, 5])
            self.assertTrue(all(s[2] for s in seen), seen)  # every call read its own batch
            self.assertNotEqual(seen[0][1], seen[1][1], "two regions alternate")
            self.assertEqual(seen[2][1], seen[0][1])
            forgotten = {seen[0][1], seen[1][1]}
            self.assertTrue(all(s[1] not in forgotten for s in seen[3:]), seen)

    def test_idle_session_expires_and_the_client_registers_again(self):
        g = Golden("basic_f32")
        with self.server.client() as client:
            self.assertEqual(compare(g.expected, client.score(**g.score_kwargs()).outputs), "")
            # The server's reaper drops the session after 2 s without calls.
            wait_for_metric(self, self.metrics_port, "logprob_shared_memory_regions", 0)
            res = client.score(**g.score_kwargs())
            self.assertEqual(compare(g.expected, res.outputs), "")
            self.assertEqual(len(region_names(client)), 1)


# What a second local user runs against a region of the server's user:
# argv = server address, the victim's shm_name, its byte_size. Prints a
# JSON report of what it got.
_ATTACKER = r"""
import json, os, sys
import grpc
from logprob_client import logprob_pb2 as pb2, logprob_pb2_grpc as pb2_grpc

address, shm_name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {"uid": os.geteuid()}
try:
    os.close(os.open("/dev/shm" + shm_name, os.O_RDONLY))
    out["open"] = "opened"
except OSError as e:
    out["open"] = e.errno
stub = pb2_grpc.LogprobServiceStub(grpc.insecure_channel(address))
md = (("logprob-shm-session", "second-user-session-0123456789"),)

def call(fn):
    try:
        return "OK", fn()
    except grpc.RpcError as e:
        return e.code().name, None

code, reply = call(lambda: stub.RegisterSharedMemory(
    pb2.RegisterSharedMemoryRequest(name="stolen", shm_name=shm_name, byte_size=size), timeout=30, metadata=md))
out["register"] = code
if reply is not None:
    out["challenge"] = len(reply.challenge)
    try:  # the proof needs write access
        fd = os.open("/dev/shm" + shm_name, os.O_WRONLY)
        os.pwrite(fd, reply.challenge, reply.proof_offset)
        os.close(fd)
        out["write"] = "written"
    except OSError as e:
        out["write"] = e.errno
req = pb2.ScoreRequest(id="steal")
t = req.inputs.add(name="logits", dtype=pb2.F32, shape=[4, 8])
t.shared_memory.region, t.shared_memory.offset, t.shared_memory.byte_size = "stolen", 0, 128
t = req.inputs.add(name="input_ids", dtype=pb2.I64, shape=[4])
t.shared_memory.region, t.shared_memory.offset, t.shared_memory.byte_size = "stolen", 4096, 32

def score():
    code, resp = call(lambda: stub.Score(req, timeout=30, metadata=md))
    return [code, len(resp.outputs) if resp is not None else 0]

out["score_unconfirmed"] = score()
out["confirm"] = call(lambda: stub.ConfirmSharedMemory(
    pb2.ConfirmSharedMemoryRequest(name="stolen"), timeout=30, metadata=md))[0]
out["score_after"] = score()
print(json.dumps(out))
"""


class SecondUserTest(unittest.TestCase):
    """The attack with a real second uid: needs root (to drop to ``nobody``
    with setpriv) and a source tree ``nobody`` can read; skipped otherwise."""

    def test_second_user_cannot_use_a_region_it_can_only_name(self):
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            self.skipTest("needs root and setpriv(1) to run a second, unprivileged local user")
        import logprob_client

        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        paths.append(os.path.dirname(os.path.dirname(os.path.abspath(logprob_client.__file__))))
        unreadable = [p for p in paths if not _world_readable(p)]
        if unreadable:
            self.skipTest("user nobody cannot read %s" % ", ".join(unreadable))
        server = Server(workers=1)
        try:
            with server.client() as victim:
                g = Golden("basic_f32")
                self.assertEqual(compare(g.expected, victim.score(**g.score_kwargs()).outputs), "")
                shm = victim._shm
                reply = victim._stub.ListSharedMemory(pb2.ListSharedMemoryRequest(), timeout=30, metadata=shm.metadata)
                self.assertEqual(len(reply.regions), 1)
                region = reply.regions[0]
                self.assertTrue(region.confirmed)
                self.assertEqual(os.stat("/dev/shm" + region.shm_name).st_mode & 0o777, 0o600)
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), HOME="/nonexistent",
                           XDG_CACHE_HOME="/nonexistent")
                run = subprocess.run(
                    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", _ATTACKER,
                     "127.0.0.1:%d" % server.port, region.shm_name, str(region.byte_size)],
                    env=env, capture_output=True, text=True, timeout=120)
                self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
                got = json.loads(run.stdout.strip().splitlines()[-1])
                self.assertEqual(got["uid"], 65534)
                self.assertEqual(got["open"], 13, "nobody cannot open the 0600 object itself (EACCES)")
                # The server opens it (it is the owner) but answers only a challenge...
                self.assertEqual(got["register"], "OK")
                self.assertEqual(got["challenge"], 32)
                self.assertEqual(got["write"], 13)
                # ... and nothing computed from the object comes back.
                self.assertEqual(got["score_unconfirmed"], ["PERMISSION_DENIED", 0])
                self.assertEqual(got["confirm"], "PERMISSION_DENIED")
                self.assertEqual(got["score_after"], ["NOT_FOUND", 0])
                # The victim goes on.
                self.assertEqual(compare(g.expected, victim.score(**g.score_kwargs()).outputs), "")
        finally:
            server.close()


def _world_readable(path):
    """True when every folder from / to ``path`` lets others in and read."""
    path = os.path.abspath(path)
    while True:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        if mode & 0o005 != 0o005:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


class StaleRegionsTest(unittest.TestCase):
    """A front-end's start-up removes the shared-memory regions of servers
    that exited (/dev/shm/logprob-PID-N, PID dead), judging PIDs only from
    the initial PID namespace: a front-end in a nested one (a container, or
    ``unshare --pid --mount-proc``) that shares /dev/shm would see every
    PID outside as dead and unlink live servers' regions (it did, through
    an NSpid check that --mount-proc defeats)."""

    def setUp(self):
        self.paths = []

    def tearDown(self):
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def region(self, pid):
        """A stand-in region of process ``pid`` in /dev/shm (its path), last
        modified an hour ago (a region modified within the last minute may
        be one whose creator has not taken its lock yet: never removed)."""
        path = "/dev/shm/logprob-%d-%d" % (pid, 900000 + len(self.paths))
        with open(path, "wb") as f:
            f.write(b"x")
        hour_ago = time.time() - 3600
        os.utime(path, (hour_ago, hour_ago))
        self.paths.append(path)
        return path

    def test_a_nested_pid_namespace_servers_live_regions_survive_a_host_front_ends_start(self):
        # A server in a nested PID namespace that shares /dev/shm names its
        # payload regions by its PID there; that PID names no process here,
        # and a host front-end's clean-up used to unlink them under it. The
        # region's lock (held by its creator) says it is alive.
        prefix = pid_namespace_prefix()
        if prefix is None:
            self.skipTest("this machine cannot make a PID namespace (unshare --pid --fork --mount-proc, also with "
                          "--user --map-root-user)")
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
        # A PID free here for the nested server (and its worker after it).
        base = next(p for p in range(pid_max - 200, pid_max // 2, -7)
                    if not any(os.path.exists("/proc/%d" % q) for q in range(p, p + 8)))
        nested_prefix = prefix + ["sh", "-c", 'echo %d > /proc/sys/kernel/ns_last_pid && "$@"; exit $?' % base, "sh"]
        g = Golden("basic_f32")
        with Server(workers=1, prefix=nested_prefix) as nested:
            with nested.client() as c:
                self.assertEqual(compare(g.expected, c.score(**g.score_kwargs()).outputs), "")
            mine = [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                    if n.startswith("logprob-%d-" % (base + 1)) and n.split("-")[-1].isdigit()]
            self.assertTrue(mine, "the nested server made no payload region named by PID %d:\n%s"
                            % (base + 1, nested.log()))
            self.assertFalse(os.path.exists("/proc/%d" % (base + 1)), "PID %d is alive here" % (base + 1))
            hour_ago = time.time() - 3600
            for path in mine:  # past the clean-up's one-minute grace: only the lock keeps them
                os.utime(path, (hour_ago, hour_ago))
            with Server(workers=1):  # SERVING: its start-up clean-up has run
                pass
            for path in mine:
                self.assertTrue(os.path.exists(path), "the host front-end unlinked %s" % path)
            with nested.client() as c:
                self.assertEqual(compare(g.expected, c.score(**g.score_kwargs()).outputs), "")

    def test_a_front_end_in_a_nested_pid_namespace_keeps_the_regions_of_live_processes_outside(self):
        prefix = pid_namespace_prefix()
        if prefix is None:
            self.skipTest("this machine cannot make a PID namespace (unshare --pid --fork --mount-proc, also with "
                          "--user --map-root-user)")
        # This test's own PID: alive here, no process in the nested
        # namespace, where kill(pid, 0) answers ESRCH.
        live = self.region(os.getpid())
        with Server(workers=1, prefix=prefix) as s:  # SERVING: its start-up clean-up has run
            self.assertTrue(os.path.exists(live), "a nested front-end unlinked %s:\n%s" % (live, s.log()))
            self.assertNotIn("shared memory region(s) left by exited servers", s.log())

    def test_a_front_end_removes_the_regions_of_an_exited_process(self):
        # The same judgement from the initial namespace removes a dead
        # process's region (another front-end starting meanwhile may be the
        # one that does).
        child = subprocess.Popen(["true"])
        child.wait()  # reaped: its PID names no process
        dead = self.region(child.pid)
        live = self.region(os.getpid())
        with Server(workers=1):
            self.assertFalse(os.path.exists(dead), dead)
            self.assertTrue(os.path.exists(live), live)


class UnknownHeadTest(unittest.TestCase):
    def test_an_unknown_head_through_shared_memory_is_answered_at_once(self):
        # The shared-memory path registers its region again and resends only
        # for a region the server forgot (reason
        # SHARED_MEMORY_REGION_NOT_REGISTERED); an unknown head's NOT_FOUND is
        # the call's answer, raised after one attempt (it said "NOT_FOUND
        # after 2 attempts").
        lm_head = os.path.join(support.GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")
        with Server(workers=1, extra=["--lm-head", lm_head]) as s, s.client() as c:
            kwargs = Golden("hidden_bf16").score_kwargs()
            c.score(**kwargs)  # through a region
            self.assertIsNotNone(c._shm)
            self.assertIsNone(c._shm.failed)
            kwargs["head"] = "no-such-head"
            with self.assertRaises(LogprobError) as cm:
                c.score(**kwargs)
            self.assertEqual(cm.exception.code, grpc.StatusCode.NOT_FOUND, cm.exception)
            self.assertEqual(cm.exception.attempts, 1, cm.exception)
            self.assertNotIn("attempts", str(cm.exception))
            self.assertIn("no-such-head", str(cm.exception))


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
