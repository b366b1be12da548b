"""Helpers of the Python client tests: a live logprob-server child process on
a free loopback port, the golden cases, and the SPEC comparison
(``2e-4 + 2e-5 * |expected|``, ids exact, -inf where expected).

Environment (set by ctest, see tests/CMakeLists.txt): ``LOGPROB_BIN_DIR``
(the built logprob-server / logprob-worker), ``LOGPROB_GOLDEN_DIR``,
``LOGPROB_CHUNK_CODEC_GOLDEN_DIR`` (the golden parts of the chunk codec).
"""

import asyncio
import atexit
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(SOURCE_ROOT, "client", "python"))

from logprob_client import LogprobClient  # noqa: E402
from logprob_client import safetensors  # noqa: E402

BIN_DIR = os.environ.get("LOGPROB_BIN_DIR", os.path.join(SOURCE_ROOT, "build", "bin"))
GOLDEN_DIR = os.environ.get("LOGPROB_GOLDEN_DIR", os.path.join(SOURCE_ROOT, "tests", "data", "golden"))
CHUNK_CODEC_GOLDEN_DIR = os.environ.get("LOGPROB_CHUNK_CODEC_GOLDEN_DIR",
                                        os.path.join(SOURCE_ROOT, "tests", "data", "chunk_codec"))
LOGITS_CASES = ["basic_f32", "llama_vocab_bf16", "odd_vocab_f16", "sampling_f32", "packed_bf16", "top1_ties_bf16"]


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TEMP_DIRS = []


def _remove_temp_dirs(pid=os.getpid()):
    # Only the process that made them removes them (a forked child exits through os._exit anyway).
    if os.getpid() == pid:
        for d in _TEMP_DIRS:
            shutil.rmtree(d, ignore_errors=True)


atexit.register(_remove_temp_dirs)


def temp_dir(prefix):
    """A fresh per-process temporary folder (ctest runs tests in parallel),
    removed with everything in it when the test process exits (a failed
    test's folder too: its log lines are in the test's output)."""
    d = tempfile.mkdtemp(prefix="%s_%d_" % (prefix, os.getpid()))
    _TEMP_DIRS.append(d)
    return d


class Server:
    """``logprob-server --listen 127.0.0.1:PORT --workers N --backend cpu``
    plus ``extra`` flags, started and waited on (health SERVING, up to 90 s)
    over a client made with ``client_kwargs`` (TLS for a TLS server).
    ``prefix``: a command the server runs under (e.g. ``unshare ...``)."""

    def __init__(self, workers=1, extra=(), client_kwargs=None, port=None, wait=True, metrics=False, prefix=()):
        self.workers = workers
        self.prefix = list(prefix)
        self.extra = list(extra)
        self.metrics_port = free_port() if metrics else None
        if metrics:
            self.extra += ["--metrics-listen", "127.0.0.1:%d" % self.metrics_port]
        self.port = port or free_port()
        self.address = "127.0.0.1:%d" % self.port
        self.log_dir = temp_dir("pyclient_server")
        self.log_path = os.path.join(self.log_dir, "server.log")
        self.proc = None
        self._client_kwargs = dict(client_kwargs or {})
        self.start(wait)

    def start(self, wait=True):
        args = self.prefix + [
            os.path.join(BIN_DIR, "logprob-server"),
            "--listen",
            self.address,
            "--workers",
            str(self.workers),
            "--backend",
            "cpu",
        ] + self.extra
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        if wait:
            try:
                self.wait_serving()
            except BaseException:
                self.close()
                raise

    def wait_serving(self, seconds=90):
        with LogprobClient(self.address, **self._client_kwargs) as c:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("logprob-server exited with %s:\n%s" % (self.proc.returncode, self.log()))
                if c.health(wait=1.0):
                    return
        log = self.log()
        raise RuntimeError("logprob-server %s did not become SERVING:\n%s" % (self.address, log))

    def metrics(self):
        """The /metrics scrape (Prometheus text) of a server started with metrics=True."""
        url = "http://127.0.0.1:%d/metrics" % self.metrics_port
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def samples(self, name):
        """[(labels, value)] of every sample of ``name`` in the /metrics
        scrape (labels: a dict)."""
        out = []
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if "{" in head:
                metric, _, rest = head.partition("{")
                got = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
                got = {k: v.strip('"') for k, v in got.items()}
            else:
                metric, got = head, {}
            if metric == name:
                out.append((got, float(value)))
        return out

    def metric(self, name, **labels):
        """Value of the sample ``name{labels}`` (labels matched exactly, in
        any order) in the /metrics scrape; 0.0 when absent."""
        want = {k: str(v) for k, v in labels.items()}
        return next((value for got, value in self.samples(name) if got == want), 0.0)

    def log(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self):
        """SIGTERM, then wait (SIGKILL after 30 s). Under a ``prefix``
        (``unshare --fork`` does not pass signals on), the server, its
        child, gets the SIGTERM too."""
        if self.proc is not None and self.proc.poll() is None:
            if self.prefix:
                try:
                    with open("/proc/%d/task/%d/children" % (self.proc.pid, self.proc.pid)) as f:
                        children = [int(c) for c in f.read().split()]
                except OSError:
                    children = []
                for child in children:
                    try:
                        os.kill(child, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()
        self.proc = None

    def close(self):
        self.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def client(self, **kwargs):
        kw = dict(self._client_kwargs)
        kw.update(kwargs)
        return LogprobClient(self.address, **kw)


class Golden:
    """A golden case: ``inputs`` / ``expected`` ({name: ndarray}, BF16 as
    uint16 bits), ``dtypes`` of the inputs, and the score() keyword options
    from its metadata (like tests/test_support.cc LoadGolden)."""

    def __init__(self, name):
        self.name = name
        self.inputs, meta = safetensors.load(os.path.join(GOLDEN_DIR, name + ".safetensors"))
        self.expected, _ = safetensors.load(os.path.join(GOLDEN_DIR, name + ".expected.safetensors"))
        self.dtypes = meta["__dtypes__"]
        self.meta = meta
        o = {}
        if meta.get("alignment") == "same_position":
            o["alignment"] = "same_position"
        if meta.get("temperature"):
            o["temperature"] = float(meta["temperature"])
        if meta.get("sampling_top_k"):
            o["sampling_top_k"] = int(meta["sampling_top_k"])
        if meta.get("sampling_top_p"):
            o["sampling_top_p"] = float(meta["sampling_top_p"])
        if meta.get("topk"):
            o["topk"] = int(meta["topk"])
        o["entropy"] = "entropy" in self.expected
        for name in ("log_sum_sq_probs", "mean_logits", "is_top1"):
            if name in self.expected:
                o[name] = True
        self.options = o

    def rows_name(self):
        return "logits" if "logits" in self.inputs else "hidden_states"

    def score_kwargs(self):
        """Keyword arguments of LogprobClient.score for this case."""
        kw = dict(self.options)
        rows = self.rows_name()
        kw[rows] = self.inputs[rows]
        if self.dtypes[rows] == "BF16":
            kw["dtype"] = "bf16"
        for name in ("input_ids", "cu_seqlens", "seq_lens", "gather_indices"):
            if name in self.inputs:
                kw[name] = self.inputs[name]
        return kw


def worker_pids(server):
    """The worker processes of ``server`` (a ``Server``): its children."""
    pids = []
    for f in glob.glob("/proc/%d/task/*/children" % server.proc.pid):
        try:
            with open(f) as fh:
                pids += [int(p) for p in fh.read().split()]
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(set(pids))


def wait_for(predicate, what, timeout=60.0):
    """Polls ``predicate()`` until it is true (returns its value); fails
    with ``what`` after ``timeout`` seconds. For waiting on observable
    state (metrics, logs), never as a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %g s waiting for %s" % (timeout, what))
        time.sleep(0.01)


def hashed_head(client, name, timeout=120.0):
    """The ``lm_heads()`` entry of head ``name`` once its sha256 is known:
    an update that announced none is hashed in the background after its
    commit (the listing shows "" until then)."""
    def known():
        h = [x for x in client.lm_heads() if x.name == name][0]
        return h if h.sha256 else None
    return wait_for(known, "the sha256 of lm_head %s" % name, timeout)


async def until(predicate, what, timeout=120.0):
    """``wait_for`` for asyncio tests: polls ``predicate`` (run in the
    loop's executor: it may scrape /metrics) until it is true."""
    deadline = time.monotonic() + timeout
    loop = asyncio.get_running_loop()
    while not await loop.run_in_executor(None, predicate):
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %g s waiting for %s" % (timeout, what))
        await asyncio.sleep(0.01)


async def cancel_on_server(server, client, method):
    """Starts ``client.score`` (an aio client of ``server``, started with
    metrics=True) of a request slow on the server (top-p over V = 65536,
    f32: 64 MB, then 256 MB if it finished too soon), cancels the awaiting
    task once the server holds the request, and returns True once the
    server counts it ``logprob_requests_total{code="CANCELLED",
    method=method}`` (and logs status=CANCELLED); False when it always
    finished before it could be cancelled. The task must end in
    CancelledError."""
    rng = np.random.default_rng(5)
    V = 65536

    def ended(code):
        return server.metric("logprob_requests_total", code=code, method=method)

    for T in (256, 1024):
        logits = rng.standard_normal((T, V), dtype=np.float32)
        ids = rng.integers(0, V, T)
        before, ok_before = ended("CANCELLED"), ended("OK")
        task = asyncio.ensure_future(client.score(logits=logits, input_ids=ids, cu_seqlens=np.arange(0, T + 1, 128),
                                                  sampling_top_p=0.9, entropy=True))
        # Wait until the server holds the request (admitted, unanswered).
        await until(lambda: task.done() or server.metric("logprob_inflight_requests") >= 1,
                    "the slow request to reach the server")
        if task.done():
            continue
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the cancelled task returned a result")
        # The server counts the request when it ends: CANCELLED, or OK when it
        # finished first. (Other RPCs, e.g. RegisterSharedMemory, count apart.)
        await until(lambda: ended("CANCELLED") > before or ended("OK") > ok_before,
                    "the server to count the %s request CANCELLED" % method)
        if ended("CANCELLED") > before:
            # The request's log line is written after its metrics are recorded.
            await until(lambda: "status=CANCELLED" in server.log(),
                        "the server to log the %s request status=CANCELLED" % method)
            return True
    return False


def as_numpy_outputs(outputs):
    """{name: ndarray} of a ScoreResult's outputs, numpy or torch (CPU)."""
    return {k: (v.numpy() if hasattr(v, "numpy") and not isinstance(v, np.ndarray) else v) for k, v in outputs.items()}


def compare(expected, got):
    """'' when every expected output is in ``got`` ({name: ndarray}) with the
    same shape and dtype (is_top1: bool for an expected I32) and within the
    SPEC tolerance (ids and is_top1 exact, infinities equal); else a description of the first mismatches."""
    errors = []
    for name, e in expected.items():
        g = got.get(name)
        if g is None:
            errors.append("missing output %s" % name)
            continue
        if g.shape != e.shape:
            errors.append("%s: %s %s, expected %s %s" % (name, g.dtype, g.shape, e.dtype, e.shape))
            continue
        if e.dtype.kind == "i" and g.dtype == np.bool_:  # is_top1: I32 0/1 in the files, bool from the clients
            e = e != 0
        elif g.dtype != e.dtype:
            errors.append("%s: %s %s, expected %s %s" % (name, g.dtype, g.shape, e.dtype, e.shape))
            continue
        if e.dtype.kind in "ib":
            bad = np.argwhere(e != g)
        else:
            e64, g64 = e.astype(np.float64), g.astype(np.float64)
            inf = np.isinf(e64)
            with np.errstate(invalid="ignore"):
                ok = np.where(inf, e64 == g64, np.abs(e64 - g64) <= 2e-4 + 2e-5 * np.abs(e64))
            bad = np.argwhere(~ok)
        for idx in bad[:5]:
            idx = tuple(int(i) for i in idx)
            errors.append("%s%s: expected %r got %r" % (name, list(idx), e[idx], g[idx]))
    return "\n".join(errors)


def pid_namespace_prefix():
    """``unshare`` arguments that run a command as PID 1 of a fresh PID
    namespace (as a container's entry point), killed with unshare; None
    when this machine does not allow it."""
    for prefix in (["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"],
                   ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]):
        try:
            r = subprocess.run(prefix + ["sh", "-c", "test $$ = 1"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return None
