"""Tests of logprob_client.ray (the service as Ray actors) in the Ray
environment (scripts/setup-ray.sh, ctest py_ray_*), on loopback only
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray's nodes 127.0.0.1), without
the dashboard and with small object stores:

- GoldenTest: a local Ray instance with 2 CPU workers scores every golden
  case bitwise as a ``logprob-server --workers 2`` started directly
  (``client()`` and ``aio_client()``); binaries it cannot find are named
  with the node and the places searched; then
  ``ray.kill`` of a worker actor: requests get UNAVAILABLE, Ray restarts the
  actor, the pool re-forms and scores the same bits again, as after a
  worker process killed on its own (its actor ends and restarts); ``stop()``
  leaves no process of the service.
- TwoNodeTest: two Ray nodes (ray.cluster_utils.Cluster), SPREAD
  placement, a head declared by shape, filled from the driver and then
  updated; the workers (one per node) fetch every slice from the
  front-end (--fetch-lm-heads always: the path of nodes that do not share
  the front-end's store) and score each version as a direct server
  holding the same weights does; then a worker's node dies, Ray places
  its bundle on a new node and restarts the actor there, and the pool
  scores the committed version again.
- ReaperTest: the actors' folder reaper without Ray: it removes the
  folders once its actor's pipe has closed and the actor's process has
  exited, then exits.
- RayStartTest: a cluster started as operators do (``ray start --head``,
  on a non-loopback address of this host when it has one; its workers
  without the tests' PYTHONPATH), the test a driver of it
  (``ray.init(address=...)``): the actors run without the package on
  their path and score the golden cases; the front-end listens on the
  port chosen; a client on this host reaches it over loopback and sends
  its inputs through shared memory without a warning; a taken port is
  named; the actors' folders are 0700 and removed by ``stop()``, and also
  after a driver killed with SIGKILL (with the service's processes).
"""

import asyncio
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import unittest
import warnings

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before ray is imported: nodes on 127.0.0.1
# Every cluster of these tests (and the processes they start) uses one token
# of their own: none from ~/.ray, and a local ray.init (which turns token
# mode on for the rest of the process) does not lock the driver out of the
# next cluster.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)

import numpy as np

import support
from support import BIN_DIR, GOLDEN_DIR, LOGITS_CASES, Golden, Server, compare, free_port, temp_dir, wait_for

import grpc
import ray
from logprob_client import LogprobError, RetryPolicy, safetensors
from logprob_client import logprob_pb2 as pb2
from logprob_client import LogprobClient
from logprob_client.ray import DeclaredHead, LogprobService
from logprob_client._internal.tensors import float32_to_bf16_bits

LM_HEAD = os.path.join(GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")
CASES = LOGITS_CASES + ["hidden_bf16"]
RAY_NODE = dict(include_dashboard=False, object_store_memory=80 * 1024 * 1024)
NO_RETRY = RetryPolicy(max_attempts=1)


def outputs_of(result):
    """{name: ndarray} of a ScoreResult (numpy in, numpy out)."""
    return {k: np.asarray(v) for k, v in result.outputs.items()}


def assert_same_bits(test, want, got, what):
    test.assertEqual(sorted(want), sorted(got), what)
    for name in want:
        test.assertEqual(want[name].dtype, got[name].dtype, "%s %s" % (what, name))
        test.assertEqual(want[name].tobytes(), got[name].tobytes(), "%s %s differs bitwise" % (what, name))


def service_processes(marker):
    """pids of live processes whose command line contains ``marker`` (the
    service's unique address), from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % entry, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open("/proc/%s/stat" % entry) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and "logprob-" in cmd and state != "Z":
            pids.append(int(entry))
    return pids


def control_address(service):
    """The front-end's control address (in every worker's command line)."""
    fe = service.processes()[0]
    return "%s:%d" % (fe["node_ip"], fe["ports"][1])


class GoldenTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # The actors find the binaries through bin_dir= only (the missing-binary test).
        os.environ.pop("LOGPROB_BIN_DIR", None)
        # A node of its own, whatever other cluster this host runs (address
        # "local": never the one ray_current_cluster or RAY_ADDRESS names).
        ray.init(address="local", num_cpus=3, logging_level="ERROR", **RAY_NODE)
        cls.addClassCleanup(ray.shutdown)
        cls.direct = Server(workers=2, extra=["--lm-head", LM_HEAD])
        cls.addClassCleanup(cls.direct.close)
        with cls.direct.client() as c:
            cls.want = {name: outputs_of(c.score(**Golden(name).score_kwargs())) for name in CASES}

    def start(self):
        service = LogprobService.start(workers=2, backend="cpu", heads={"default": LM_HEAD}, bin_dir=BIN_DIR,
                                       client_kwargs={"timeout": 120})
        self.addCleanup(service.stop)
        service.wait_ready(180)
        return service

    def score_all(self, service, what):
        with service.client() as c:
            for name in CASES:
                g = Golden(name)
                got = outputs_of(c.score(**g.score_kwargs()))
                self.assertEqual(compare(g.expected, got), "", "%s %s" % (what, name))
                assert_same_bits(self, self.want[name], got, "%s %s" % (what, name))

    def test_golden_kill_restart_stop(self):
        service = self.start()
        procs = service.processes()
        self.assertEqual(len(procs), 3)
        self.assertTrue(all(p["returncode"] is None for p in procs), procs)
        self.score_all(service, "ray")

        async def aio_score():
            async with service.aio_client() as c:
                return outputs_of(await c.score(**Golden("hidden_bf16").score_kwargs()))

        assert_same_bits(self, self.want["hidden_bf16"], asyncio.run(aio_score()), "aio_client hidden_bf16")
        marker = control_address(service)
        # The front-end (--control-listen) and the workers (--frontend) name the control address.
        self.assertEqual(sorted(service_processes(marker)), sorted(p["pid"] for p in procs))
        # The internal plane's pool secret: one value for the front-end and
        # its workers, each in a file only this user can read, never in argv.
        secrets_read = set()
        for p in procs:
            path = p["argv"][p["argv"].index("--internal-secret-file") + 1]
            self.assertEqual(os.stat(path).st_mode & 0o077, 0, path)
            self.assertEqual(os.stat(os.path.dirname(path)).st_mode & 0o077, 0, path)
            with open(path) as f:
                secrets_read.add(f.read())
        self.assertEqual(len(secrets_read), 1)
        self.assertFalse(any(s in " ".join(p["argv"]) for s in secrets_read for p in procs))

        # ray.kill of a worker actor: its process dies with it, requests get
        # UNAVAILABLE until Ray restarts the actor and the pool re-forms.
        killed = procs[1]["pid"]
        ray.kill(service.workers[0], no_restart=False)
        # ray.kill only asks Ray: until the process is gone, the old worker
        # may still answer (a run under ASan saw no UNAVAILABLE at all).
        wait_for(lambda: not os.path.exists("/proc/%d" % killed) or killed not in service_processes(marker),
                 "the killed worker actor's process to exit", timeout=120)
        # Its folder goes with it (the reaper); the restarted actor makes its own.
        wait_for(lambda: not any(os.path.exists(d) for d in procs[1]["dirs"]),
                 "the killed worker actor's folder to be removed", timeout=120)
        g = Golden("basic_f32")
        codes = []

        def served_again():
            try:
                with service.client(retry=NO_RETRY, timeout=30) as c:
                    c.score(**g.score_kwargs())
                return True
            except LogprobError as e:
                codes.append(e.code)
                return False

        wait_for(served_again, "the pool to re-form after ray.kill of a worker actor", timeout=180)
        self.assertIn(grpc.StatusCode.UNAVAILABLE, codes)
        self.assertEqual(set(codes), {grpc.StatusCode.UNAVAILABLE}, codes)
        self.assertFalse(os.path.exists("/proc/%d" % killed) and killed in service_processes(marker))
        # The pool re-formed once the restarted process joined; the driver's
        # handle may still see the actor as restarting (a call then fails:
        # {"error": ...}, seen under ASan), so wait for its info.
        wait_for(lambda: "pid" in service.processes()[1], "the restarted worker actor to answer info()", timeout=120)
        restarted = service.processes()[1]
        self.assertNotEqual(restarted["pid"], killed)
        self.assertTrue(all(os.path.isdir(d) for d in restarted["dirs"]), restarted["dirs"])
        self.assertIsNone(restarted["returncode"])
        self.score_all(service, "after the restart")

        # A worker process that dies on its own (SIGKILL) ends its actor,
        # which Ray restarts with a new process.
        victim = service.processes()[2]["pid"]
        os.kill(victim, signal.SIGKILL)
        codes.clear()
        wait_for(lambda: served_again() and service.processes()[2]["pid"] != victim,
                 "Ray to restart the actor of a worker process killed with SIGKILL", timeout=180)
        self.assertTrue(set(codes) <= {grpc.StatusCode.UNAVAILABLE}, codes)
        self.score_all(service, "after the process restart")

        # stop(): no process of the service is left.
        fe_pid = procs[0]["pid"]
        pids = [p["pid"] for p in service.processes()]
        service.stop()
        self.assertEqual(service_processes(marker), [])
        self.assertEqual([p for p in pids + [fe_pid] if os.path.exists("/proc/%d/cmdline" % p)
                          and p in service_processes("logprob-")], [])

    def test_missing_binaries_are_named(self):
        empty = temp_dir("ray_no_binaries")
        self.addCleanup(os.rmdir, empty)
        with self.assertRaises(RuntimeError) as cm:
            LogprobService.start(workers=1, backend="cpu", bin_dir=empty)
        text = str(cm.exception)
        self.assertIn("logprob-server not found on node 127.0.0.1", text)
        self.assertIn(empty, text)
        self.assertIn("bin_dir", text)
        # Nothing is left reserved: the placement group start made is removed.
        wait_for(lambda: all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()),
                 "the failed start's placement group to be removed")


class ArgumentsTest(unittest.TestCase):
    """Bad arguments are ValueError naming the argument, before Ray is asked anything."""

    def test_bad_arguments_are_named(self):
        for kwargs, words in (({"workers": 0}, "workers"), ({"workers": 1, "backend": "tpu"}, "backend"),
                              ({"workers": 1, "placement": "ANYWHERE"}, "placement"),
                              ({"workers": 1, "fetch_lm_heads": "sometimes"}, "fetch_lm_heads"),
                              ({"workers": 1, "port": 65536}, "port"), ({"workers": 1, "port": -1}, "port"),
                              ({"workers": 1, "heads": {"policy": 42}}, "heads['policy']"),
                              ({"workers": 1, "heads": {"policy": DeclaredHead(0, 8)}}, "vocab_size"),
                              ({"workers": 1, "heads": {"policy": DeclaredHead(8, 8, "f64")}}, "dtype")):
            with self.subTest(kwargs=kwargs):
                with self.assertRaises(ValueError) as cm:
                    LogprobService.start(**kwargs)
                self.assertIn(words, str(cm.exception))

    def test_declared_head_flag(self):
        self.assertEqual(DeclaredHead(151936, 4096).flag("policy"), "policy=151936x4096:bf16")
        self.assertEqual(DeclaredHead(10, 4, "F32").flag("r"), "r=10x4:f32")


class ReaperTest(unittest.TestCase):
    """The actors' folder reaper (logprob_client/_ray_reaper.py) on its own:
    when its actor ends (the pipe's write end closes) it waits for the
    actor's process, then removes the folders and exits."""

    def test_removes_the_folders_after_the_actor_and_its_process(self):
        from logprob_client._ray_actor import _REAPER_SOURCE
        folders = [temp_dir("ray_reaper") for _ in range(2)]
        for d in folders:
            self.addCleanup(shutil.rmtree, d, True)
            with open(os.path.join(d, "file"), "w") as f:
                f.write("x")
        process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        self.addCleanup(process.wait)
        self.addCleanup(process.kill)
        read_end, write_end = os.pipe()
        reaper = subprocess.Popen([sys.executable, "-I", "-c", _REAPER_SOURCE, str(process.pid), str(read_end)]
                                  + folders, pass_fds=(read_end,), start_new_session=True)
        os.close(read_end)
        self.assertEqual(reaper.wait(30), 0)  # detached: the intermediate process exits at once
        os.close(write_end)  # the actor ends; its process still runs
        self.assertTrue(all(os.path.exists(d) for d in folders))
        process.stdin.close()  # the process ends
        process.wait()
        wait_for(lambda: not any(os.path.exists(d) for d in folders), "the reaper to remove the folders", 30)
        wait_for(lambda: not [c for d in folders for c in live_command_lines(d)], "the reaper to exit", 30)


class TwoNodeTest(unittest.TestCase):
    V, H = 1000, 64

    @classmethod
    def setUpClass(cls):
        from ray.cluster_utils import Cluster
        # The driver's head node runs no actor; each worker gets a node of its
        # own (SPREAD), so one can be removed while the front-end's stays.
        cls.cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, **RAY_NODE))
        cls.addClassCleanup(cls.cluster.shutdown)
        cls.nodes = [cls.cluster.add_node(num_cpus=1, **RAY_NODE) for _ in range(2)]
        ray.init(address=cls.cluster.address, logging_level="ERROR")
        cls.addClassCleanup(ray.shutdown)
        cls.dir = temp_dir("ray_two_nodes")
        rng = np.random.default_rng(33)
        cls.h = rng.standard_normal((12, cls.H)).astype(np.float32)
        cls.ids = rng.integers(0, cls.V, 12)
        cls.cu = np.array([0, 5, 12])

    def weights(self, seed):
        """A [V, H] bf16 head (uint16 bits) and a safetensors file of it."""
        w = float32_to_bf16_bits(np.random.default_rng(seed).standard_normal((self.V, self.H)).astype(np.float32))
        path = os.path.join(self.dir, "head-%d.safetensors" % seed)
        safetensors.save(path, {"lm_head.weight": w}, bf16=["lm_head.weight"])
        return w, path

    def direct_scores(self, path):
        """What a directly started 2-worker server with the head in ``path`` answers."""
        with Server(workers=2, extra=["--lm-head", "policy=" + path]) as s, s.client() as c:
            return outputs_of(c.score(hidden_states=self.h, input_ids=self.ids, cu_seqlens=self.cu, head="policy",
                                      entropy=True, topk=3))

    def test_declared_head_filled_and_updated_across_nodes(self):
        service = LogprobService.start(workers=2, backend="cpu", placement="SPREAD",
                                       heads={"policy": DeclaredHead(self.V, self.H, "bf16")}, bin_dir=BIN_DIR,
                                       fetch_lm_heads="always", client_kwargs={"timeout": 120})
        self.addCleanup(service.stop)
        service.wait_ready(180)
        workers = service.processes()[1:]
        self.assertEqual(len({w["node_id"] for w in workers}), 2, "SPREAD put both workers on one node")
        with service.client() as c:
            with self.assertRaises(LogprobError) as cm:
                c.score(hidden_states=self.h, input_ids=self.ids, cu_seqlens=self.cu, head="policy")
            self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("declared", str(cm.exception))
            for seed, version in ((1, "step-1"), (2, "step-2")):
                w, path = self.weights(seed)
                self.assertEqual(c.update_lm_head("policy", w, dtype="bf16", version=version), version)
                res = c.score(hidden_states=self.h, input_ids=self.ids, cu_seqlens=self.cu, head="policy",
                              entropy=True, topk=3)
                self.assertEqual(res.head_version, version)
                assert_same_bits(self, self.direct_scores(path), outputs_of(res), version)
        # Every worker loaded each version from the front-end, not from the store file.
        for actor in service.workers:
            log = ray.get(actor.log_tail.remote(20000))
            for version in ("step-1", "step-2"):
                self.assertRegex(log, r"loaded lm_head policy version %s: .* fetched from the front-end" % version)

        # A dead node: Ray places the bundle of its worker on a new node and
        # restarts the actor there; the pool re-forms and the new worker
        # loads the committed version from the front-end.
        fe_node = service.processes()[0]["node_id"]
        victim = next(i for i, w in enumerate(workers) if w["node_id"] != fe_node)
        spare = self.cluster.add_node(num_cpus=1, **RAY_NODE)
        dead = next(n for n in self.nodes if n.node_id == workers[victim]["node_id"])
        self.cluster.remove_node(dead)
        want = self.direct_scores(path)

        def scored_on_the_new_node():
            try:
                with service.client(retry=NO_RETRY, timeout=30) as c:
                    res = c.score(hidden_states=self.h, input_ids=self.ids, cu_seqlens=self.cu, head="policy",
                                  entropy=True, topk=3)
                return res if service.processes()[1 + victim].get("node_id") == spare.node_id else None
            except LogprobError:
                return None

        res = wait_for(scored_on_the_new_node, "the pool to re-form on the node that replaced a dead one",
                       timeout=240)
        self.assertEqual(res.head_version, "step-2")
        assert_same_bits(self, want, outputs_of(res), "after the node's death")
        log = ray.get(service.workers[victim].log_tail.remote(20000))
        self.assertRegex(log, r"loaded lm_head policy version step-2: .* fetched from the front-end")


def host_address():
    """A non-loopback IPv4 address of this machine (its default route's),
    else 127.0.0.1."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: nothing is sent
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def listening_ports(pid):
    """The TCP ports process ``pid`` listens on (its sockets in
    /proc/PID/fd matched against /proc/PID/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open("/proc/%d/net/%s" % (pid, table)) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def live_command_lines(word):
    """Command lines of live processes holding ``word``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/cmdline" % entry, "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if word in cmd:
                found.append(cmd)
    return found


class RayStartTest(unittest.TestCase):
    """A cluster of ``ray start --head`` (its workers see no PYTHONPATH of
    the tests), this process its driver."""

    @classmethod
    def setUpClass(cls):
        cls.ip = host_address()
        cls.tmp = temp_dir("ray_start")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, True)
        gcs = "%s:%d" % (cls.ip, free_port())
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOGPROB_BIN_DIR")}
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        cls.head = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", "--node-ip-address", cls.ip, "--port", gcs.rsplit(":", 1)[1],
             "--num-cpus", "3", "--include-dashboard", "false", "--disable-usage-stats",
             "--object-store-memory", str(RAY_NODE["object_store_memory"]), "--temp-dir", cls.tmp],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        cls.addClassCleanup(cls.stop_head)
        address_file = os.path.join(cls.tmp, "ray_current_cluster")
        wait_for(lambda: cls.head.poll() is not None or os.path.exists(address_file), "ray start --head", 120)
        if cls.head.poll() is not None:
            raise AssertionError("ray start --head exited with status %s" % cls.head.returncode)
        ray.init(address=gcs, logging_level="ERROR")
        cls.addClassCleanup(ray.shutdown)

    @classmethod
    def stop_head(cls):
        cls.head.terminate()  # ray start --block stops its node's processes
        try:
            cls.head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(cls.head.pid, signal.SIGKILL)
            cls.head.wait()

    def assert_private_folders(self, procs):
        for p in procs:
            self.assertEqual(len(p["dirs"]), 2 if p is procs[0] else 1, p["dirs"])
            for d in p["dirs"]:
                self.assertEqual(stat.S_IMODE(os.stat(d).st_mode), 0o700, d)

    def test_scores_on_the_chosen_port_with_shared_memory(self):
        port = free_port()
        service = LogprobService.start(workers=2, backend="cpu", heads={"default": LM_HEAD}, bin_dir=BIN_DIR,
                                       port=port, client_kwargs={"timeout": 120})
        self.addCleanup(service.stop)
        service.wait_ready(180)
        self.assertEqual(service.address, "%s:%d" % (self.ip, port))
        procs = service.processes()
        fe = procs[0]
        self.assertEqual(fe["ports"][0], port)
        self.assertIn("0.0.0.0:%d" % port, fe["argv"])
        self.assertIn(port, listening_ports(fe["pid"]))
        # The front-end's lm_head store is a folder of its actor, in memory.
        store = fe["argv"][fe["argv"].index("--lm-head-store-dir") + 1]
        self.assertEqual(store, fe["dirs"][1])
        self.assertTrue(store.startswith("/dev/shm/"), store)
        self.assert_private_folders(procs)

        # A client on this host reaches the front-end over loopback: the
        # server takes it as local, its inputs go through shared memory.
        self.assertEqual(service.client_address(), "127.0.0.1:%d" % port)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with service.client() as c:
                for name in CASES:
                    g = Golden(name)
                    self.assertEqual(compare(g.expected, outputs_of(c.score(**g.score_kwargs()))), "", name)
                self.assertIsNone(c._shm.failed)
                regions = c._stub.ListSharedMemory(pb2.ListSharedMemoryRequest(), timeout=30,
                                                   metadata=c._shm.metadata).regions
                self.assertTrue(regions, "no shared-memory region registered")
        self.assertEqual([str(w.message) for w in caught], [])
        if self.ip != "127.0.0.1":
            # The node's IP is not loopback to the server: shared memory is refused there.
            # The warning says what to do.
            with self.assertWarnsRegex(UserWarning, "PERMISSION_DENIED.*not local.*connect to 127.0.0.1:PORT"), \
                    LogprobClient(service.address, timeout=120) as c:
                c.score(**Golden("basic_f32").score_kwargs())

        dirs = [d for p in procs for d in p["dirs"]]
        service.stop()
        self.assertEqual([d for d in dirs if os.path.exists(d)], [])

    def test_taken_port_is_named(self):
        with socket.socket() as taken:
            taken.bind(("0.0.0.0", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with self.assertRaises(RuntimeError) as cm:
                LogprobService.start(workers=1, backend="cpu", bin_dir=BIN_DIR, port=port)
        self.assertIn("port %d of 0.0.0.0 is not free on node %s" % (port, self.ip), str(cm.exception))
        wait_for(lambda: all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()),
                 "the failed start's placement group to be removed")

    def test_killed_driver_leaves_nothing(self):
        """A driver killed with SIGKILL: Ray ends its actors, their
        processes die with them (PR_SET_PDEATHSIG) and their reapers
        remove the actors' folders (the store in /dev/shm, the logs)."""
        code = """
import json, sys
import ray
from logprob_client.ray import LogprobService
ray.init(address=%r, logging_level="ERROR")
s = LogprobService.start(workers=1, backend="cpu", heads={"default": %r}, bin_dir=%r)
s.wait_ready(180)
print(json.dumps(s.processes()), flush=True)
sys.stdin.read()  # until killed
""" % (ray.get_runtime_context().gcs_address, LM_HEAD, BIN_DIR)
        driver = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        self.addCleanup(driver.stdout.close)
        self.addCleanup(driver.stdin.close)
        self.addCleanup(driver.wait)
        self.addCleanup(driver.kill)
        line = driver.stdout.readline()
        self.assertTrue(line, "the driver ended before its service served")
        procs = json.loads(line)
        pids = [p["pid"] for p in procs]
        dirs = [d for p in procs for d in p["dirs"]]
        for d in dirs:  # should the test fail
            self.addCleanup(shutil.rmtree, d, True)
        self.assertEqual(len(pids), 2)
        self.assert_private_folders(procs)
        self.assertTrue(all(os.path.exists(d) for d in dirs))
        # The front-end's lm_head store (its folder for this start) is in its actor's folder.
        store = procs[0]["dirs"][1]
        self.assertEqual(len(glob.glob(os.path.join(store, "logprob-lm-heads-%d-*" % pids[0]))), 1)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        wait_for(lambda: not [p for p in pids if p in service_processes("logprob-")],
                 "the killed driver's logprob- processes to exit", timeout=120)
        wait_for(lambda: not [d for d in dirs if os.path.exists(d)],
                 "the killed driver's actors' folders to be removed", timeout=120)
        self.assertEqual(glob.glob("/dev/shm/logprob-lm-heads-%d-*" % pids[0]), [])
        # The reapers are gone too.
        wait_for(lambda: not [c for d in dirs for c in live_command_lines(d)],
                 "the reapers of the killed driver's actors to exit", timeout=60)


if __name__ == "__main__":
    unittest.main()
