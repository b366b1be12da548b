#!/usr/bin/env python3
"""Soak test: a logprob-server with 2 CPU workers and an lm_head under mixed
load for SECONDS while workers are SIGKILLed and SIGSTOPped, then checks
(docs/testing.md, "Soak"):

- every request succeeded with outputs bitwise equal to the reference of
  its input (computed once per distinct input, up front, on the same
  server before any fault), or failed with UNAVAILABLE, DEADLINE_EXCEEDED
  or CANCELLED while overlapping a fault window ([fault, recovery observed
  as a re-formed pool and health SERVING, + GRACE]); cancellations and
  deadlines the load causes on purpose are classified as such;
- the front-end's and workers' VmRSS in the second half stay within the
  memory bound of the flags (docs/serving.md "Memory sizing");
- the front-end's file descriptors and threads are flat (last quarter vs
  first quarter, small slack);
- /metrics logprob_requests_total agrees with what the clients saw;
- lm_head updates run all along, back and forth between two weights (a
  new version each time): every hidden-states answer matches the reference
  of the weights of the version it names, every committed update is what
  serves next, and an update fails only with a retryable code inside a
  fault window (then the soak sends it again under a new version).

Prints a summary and exits 1 with the reasons on any violation (2 on a
setup error). Usage: soak.py [SECONDS] (default 60); environment as for the
Python client tests (LOGPROB_BIN_DIR, PYTHONPATH with the stubs)."""

import argparse
import asyncio
import collections
import os
import random
import shutil
import signal
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python", "tests"))

from support import Server, temp_dir, wait_for, worker_pids  # noqa: E402
from logprob_client import LogprobError, RetryPolicy, safetensors  # noqa: E402
from logprob_client import aio  # noqa: E402

V, H = 4096, 256  # the lm_head; logits inputs have V columns too
WORKERS = 2
MAX_REQUEST_BYTES = 64 << 20
MAX_QUEUE_BYTES = 256 << 20
HIDDEN_CHUNK_TOKENS = 128  # the server's default, used by the worker bound
STOP_SECONDS = 6.0  # SIGSTOP length: above keepalive 1 s + 2.5 s timeout (common/keepalive.h)
GRACE = 2.0  # seconds after the observed recovery still inside a fault window
PERIOD = 60.0  # one SIGKILL and one SIGSTOP per period
FD_SLACK, THREAD_SLACK = 8, 16
NO_RETRY = RetryPolicy(max_attempts=1)  # one RPC per call, so /metrics can be matched
TIMEOUT = 30.0  # the clients' deadline: a request hung this long fails DEADLINE_EXCEEDED
FAULT_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
UPDATE_PERIOD = 2.0  # seconds between lm_head updates
# An update a fault ends: the worker loading it died (UNAVAILABLE, ABORTED),
# or the pool was re-forming (FAILED_PRECONDITION: not serving).
UPDATE_FAULT_CODES = FAULT_CODES + ("ABORTED", "FAILED_PRECONDITION")
OUTPUTS = ("token_logprobs", "entropy", "topk_logprobs", "topk_indices")


def make_cases():
    """The distinct inputs: name -> score() keyword arguments."""
    rng = np.random.default_rng(24)
    cases = {}
    for T in (64, 200):
        cases["logits_f32_%d" % T] = dict(logits=rng.standard_normal((T, V), dtype=np.float32),
                                          input_ids=rng.integers(0, V, T), cu_seqlens=np.array([0, T // 3, T]))
        bits = (rng.standard_normal((T, V), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        cases["logits_bf16_%d" % T] = dict(logits=bits, dtype="bf16", input_ids=rng.integers(0, V, T),
                                           cu_seqlens=np.array([0, T]))
    for T in (96, 700):
        cases["hidden_%d" % T] = dict(hidden_states=rng.standard_normal((T, H), dtype=np.float32),
                                      input_ids=rng.integers(0, V, T), cu_seqlens=np.array([0, T // 2, T]))
    for kw in cases.values():
        kw.update(entropy=True, topk=4)
    return cases


# The chunked actor's cases: over its chunk_above, so they go as ScoreChunked.
CHUNK_ABOVE = 512 << 10
LARGE = ("logits_f32_200", "logits_bf16_200", "hidden_700")


class Record:
    """One scoring request as a client saw it."""
    __slots__ = ("actor", "method", "case", "rid", "t0", "t1", "code", "expect", "sent")

    def __init__(self, actor, method, case, rid, t0, t1, code, expect=(), sent=True):
        self.actor, self.method, self.case, self.rid = actor, method, case, rid
        self.t0, self.t1, self.code, self.expect, self.sent = t0, t1, code, expect, sent


class Soak:
    def __init__(self, seconds, faults=True):
        self.seconds = seconds
        self.inject = faults
        self.cases = make_cases()
        self.refs = {}
        self.records = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.windows = []  # [name, start, end or None]
        self.samples = []  # (t, fe_rss, fds, threads, {pid: rss})
        self.violations = []
        self.t_start = None
        # lm_head updates: the two weights, which one each version holds,
        # and what the updater saw: (version, weights, start, end, code).
        self.weights = []
        self.version_weights = {"initial": 0}
        self.updates = []
        self.refs_by_weights = {}

    # -- time and records ------------------------------------------------

    def now(self):
        return time.monotonic() - self.t_start

    def check(self, name, outputs):
        """'OK' when outputs are bitwise the reference's (for hidden states:
        of the weights of the lm_head version the answer names), else
        'MISMATCH ...'."""
        ref = self.refs[name]
        if name.startswith("hidden"):
            version = getattr(outputs, "head_version", "")
            if version not in self.version_weights:
                return "MISMATCH unknown head_version %r" % version
            ref = self.refs_by_weights[self.version_weights[version]][name]
        for k in OUTPUTS:
            a, b = np.asarray(outputs[k]), ref[k]
            if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
                return "MISMATCH %s" % k
        return "OK"

    def add(self, *args, **kw):
        with self.lock:
            self.records.append(Record(*args, **kw))

    def outcome(self, name, fn):
        """(code, sent) of calling fn() -> ScoreResult for case ``name``."""
        try:
            return self.check(name, fn()), True
        except LogprobError as e:
            return e.code.name, e.attempts > 0

    # -- load ------------------------------------------------------------

    def actor(self, name, method, client_kwargs, names, attrs=None):
        """A thread scoring ``names`` in turn with a sync client."""
        def run():
            with self.server.client(retry=NO_RETRY, timeout=TIMEOUT, **client_kwargs) as c:
                for k, v in (attrs or {}).items():
                    setattr(c, k, v)
                for i in range(1 << 62):
                    if self.stop.is_set():
                        return
                    case, rid = names[i % len(names)], "soak-%s-%d" % (name, i)
                    t0 = self.now()
                    code, sent = self.outcome(case, lambda: c.score(request_id=rid, **self.cases[case]))
                    self.add(name, method, case, rid, t0, self.now(), code, sent=sent)
        return run

    def stream_actor(self):
        names = sorted(self.cases)
        with self.server.client(retry=NO_RETRY, timeout=TIMEOUT, shared_memory=False) as c:
            for s in range(1 << 62):
                if self.stop.is_set():
                    return
                batch = [(names[(s + 3 * i) % len(names)], "soak-stream-%d-%d" % (s, i)) for i in range(4)]
                t0 = self.now()
                got = 0
                try:
                    for (case, rid), r in zip(batch, c.score_stream(
                            [dict(self.cases[n], request_id=rid) for n, rid in batch], return_exceptions=True)):
                        code = r.code.name if isinstance(r, LogprobError) else self.check(case, r)
                        self.add("stream", "ScoreStream", case, rid, t0, self.now(), code)
                        got += 1
                except LogprobError as e:  # the stream itself failed: the rest have no answer
                    for case, rid in batch[got:]:
                        self.add("stream", "ScoreStream", case, rid, t0, self.now(), e.code.name, sent=False)

    def aio_actor(self):
        """Concurrent asyncio calls: every 5th cancelled after a random
        moment, every 7th with a deadline too short to be met."""
        async def one(c, i, rng):
            case = sorted(self.cases)[i % len(self.cases)]
            rid = "soak-aio-%d" % i
            expect, kw = (), dict(self.cases[case], request_id=rid)
            if i % 7 == 3:
                expect, kw["timeout"] = ("DEADLINE_EXCEEDED",), rng.uniform(0.001, 0.02)
            t0 = self.now()
            task = asyncio.ensure_future(c.score(**kw))
            if i % 5 == 2:
                expect += ("CANCELLED",)
                await asyncio.sleep(rng.uniform(0, 0.05))
                task.cancel()
            try:
                code, sent = self.check(case, await task), True
            except asyncio.CancelledError:
                code, sent = "CANCELLED", None  # unknown whether it reached the server
            except LogprobError as e:
                code, sent = e.code.name, e.attempts > 0
            self.add("aio", "Score", case, rid, t0, self.now(), code, expect=expect, sent=sent)

        async def lane(c, lane_id):
            rng = random.Random(lane_id)
            i = lane_id
            while not self.stop.is_set():
                await one(c, i, rng)
                i += 4

        async def main():
            async with aio.LogprobClient(self.server.address, retry=NO_RETRY, timeout=TIMEOUT,
                                         shared_memory=False) as c:
                await asyncio.gather(*(lane(c, k) for k in range(4)))

        asyncio.run(main())

    def updater(self):
        """lm_head updates every UPDATE_PERIOD s, back and forth between the
        two weights, each under a new version; a failed one is sent again
        at once under the next version (the soak's retry)."""
        with self.server.client(timeout=TIMEOUT) as c:
            n = 0
            while not self.stop.is_set():
                k = (n + 1) % 2
                version = "soak-%d" % n
                self.version_weights[version] = k
                t0 = self.now()
                try:
                    code = "OK" if c.update_lm_head("default", self.weights[k], version=version) == version \
                        else "WRONG_VERSION"
                except LogprobError as e:
                    code = e.code.name
                with self.lock:
                    self.updates.append((version, k, t0, self.now(), code))
                n += 1
                if code == "OK":
                    self.stop.wait(UPDATE_PERIOD)

    # -- faults, sampling --------------------------------------------------

    def pause(self, until):
        """Sleeps until ``until`` (soak time); False when stopped first."""
        return not self.stop.wait(max(0.0, until - self.now()))

    def recovered(self, window, restarts_before, health):
        """Waits for the re-formed pool and SERVING; closes the window."""
        name = window[0]
        try:
            wait_for(lambda: self.server.metric("logprob_worker_restarts_total") > restarts_before,
                     "the pool to re-form after " + name, 120)
            wait_for(lambda: health.health(wait=1.0), "SERVING after " + name, 120)
        except AssertionError as e:
            self.violations.append(str(e))
            return
        window[2] = self.now() + GRACE

    def faults(self):
        if not self.inject:
            return
        with self.server.client() as health:
            for p in range(max(1, int(self.seconds // PERIOD))):
                base = p * PERIOD if self.seconds >= PERIOD else 0
                span = min(PERIOD, self.seconds)
                if not self.pause(base + 0.25 * span):
                    return
                before = self.server.metric("logprob_worker_restarts_total")
                pid = live_workers(self.server)[0]
                self.windows.append(["SIGKILL worker %d" % pid, self.now(), None])
                os.kill(pid, signal.SIGKILL)
                self.recovered(self.windows[-1], before, health)
                if not self.pause(base + 0.55 * span):
                    return
                before = self.server.metric("logprob_worker_restarts_total")
                pid = live_workers(self.server)[-1]
                self.windows.append(["SIGSTOP %g s worker %d" % (STOP_SECONDS, pid), self.now(), None])
                os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(STOP_SECONDS)  # the fault itself: longer than failure detection
                finally:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:  # the front-end gave up on it and killed it
                        pass
                self.recovered(self.windows[-1], before, health)

    def sampler(self):
        fe = self.server.proc.pid
        while not self.stop.wait(0.5):
            try:
                workers = {p: vm_rss(p) for p in worker_pids(self.server)}
                self.samples.append((self.now(), vm_rss(fe), len(os.listdir("/proc/%d/fd" % fe)),
                                     len(os.listdir("/proc/%d/task" % fe)), workers))
            except (OSError, ValueError):  # a worker that exited between listing and reading
                pass

    # -- the run -----------------------------------------------------------

    def run(self):
        d = temp_dir("soak")
        rng = np.random.default_rng(1)
        head = os.path.join(d, "lm_head.safetensors")
        safetensors.save(head, {"lm_head.weight": (rng.standard_normal((V, H)) * 0.05).astype(np.float32)})
        self.weights = [safetensors.load(head)[0]["lm_head.weight"],
                        (rng.standard_normal((V, H)) * 0.05).astype(np.float32)]
        flags = ["--lm-head", head, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                 "--max-queue-bytes", str(MAX_QUEUE_BYTES), "--allow-lm-head-updates"]
        self.bound = frontend_bound(flags)
        with Server(workers=WORKERS, metrics=True, extra=flags) as self.server:
            with self.server.client(shared_memory=False) as c:
                for name, kw in self.cases.items():
                    self.refs[name] = {k: np.asarray(c.score(**kw)[k]) for k in OUTPUTS}
                # The hidden-states references of each weights, from the server itself.
                for k, version in ((1, "ref-w1"), (0, "ref-w0")):
                    self.version_weights[version] = k
                    c.update_lm_head("default", self.weights[k], version=version)
                    self.refs_by_weights[k] = {}
                    for name, kw in self.cases.items():
                        r = c.score(**kw)
                        if name.startswith("hidden"):
                            assert r.head_version == version, (r.head_version, version)
                            self.refs_by_weights[k][name] = {o: np.asarray(r[o]) for o in OUTPUTS}
            self.base_metrics = self.requests_by_method_code()
            self.t_start = time.monotonic()
            names = sorted(self.cases)
            small = [n for n in names if n not in LARGE]
            threads = [
                self.actor("unary", "Score", dict(shared_memory=False), small),
                self.actor("shm", "Score", dict(shared_memory=True), names),
                self.actor("chunked", "ScoreChunked", dict(shared_memory=False), list(LARGE),
                           dict(chunk_above=CHUNK_ABOVE, piece_bytes=128 << 10)),
                self.stream_actor, self.aio_actor, self.updater, self.faults, self.sampler]
            threads = [threading.Thread(target=guard(self, f), daemon=True) for f in threads]
            for t in threads:
                t.start()
            self.stop.wait(self.seconds)
            self.stop.set()
            self.t_end = self.now()
            for t in threads:
                t.join(300)
                if t.is_alive():
                    self.violations.append("a load thread did not end within 300 s of the stop (hang)")
            try:
                wait_for(lambda: self.server.metric("logprob_inflight_requests") == 0,
                         "the server's in-flight requests to drain", 120)
            except AssertionError as e:
                self.violations.append(str(e))
            self.metrics_now = self.requests_by_method_code()
            with self.server.client() as c:
                self.final_version = [h.version for h in c.lm_heads() if h.name == "default"][0]
            self.server_log = self.server.log()
            with open(self.server.log_path, errors="replace") as f:
                # Pool failures and worker crashes (gloo's "terminate called ...").
                self.pool_events = [line.rstrip() for line in f if " failed: " in line and "generation" in line
                                    or line.startswith(("terminate called", "  what():"))]
            self.log_copy = os.path.join(d, "server.log")
            shutil.copyfile(self.server.log_path, self.log_copy)
        self.records_path = os.path.join(d, "requests.tsv")
        with open(self.records_path, "w") as f:
            f.write("actor\tmethod\tcase\tid\tstart_s\tend_s\tcode\texpected\n")
            for r in sorted(self.records, key=lambda r: r.t0):
                f.write("%s\t%s\t%s\t%s\t%.3f\t%.3f\t%s\t%s\n" %
                        (r.actor, r.method, r.case, r.rid, r.t0, r.t1, r.code, ",".join(r.expect)))
        self.evaluate()
        return self.report()

    def requests_by_method_code(self):
        """{(method, code): count} of logprob_requests_total."""
        return {(labels["method"], labels["code"]): value
                for labels, value in self.server.samples("logprob_requests_total")}

    # -- checks ------------------------------------------------------------

    def in_window(self, r):
        return any(r.t1 >= s and (e is None or r.t0 <= e) for _, s, e in self.windows)

    def classify(self, r):
        if r.code == "OK":
            return "ok"
        if r.code.startswith("MISMATCH"):
            return "violation"
        if r.code in r.expect:
            return "expected " + r.code
        if r.code in FAULT_CODES and self.in_window(r):
            return "fault " + r.code
        return "violation"

    def evaluate(self):
        v = self.violations
        by = collections.Counter()
        for r in self.records:
            cls = self.classify(r)
            by[(r.actor, cls)] += 1
            if cls == "violation" and len(v) < 40:
                v.append("%s %s %s id=%s at %.2f-%.2f s: %s (outside every fault window)" %
                         (r.actor, r.method, r.case, r.rid, r.t0, r.t1, r.code))
        self.by = by
        for actor in ("unary", "shm", "chunked", "stream", "aio"):
            if by[(actor, "ok")] == 0:
                v.append("actor %s had no successful request" % actor)
        # lm_head updates: retryable failures inside fault windows only, at
        # least one commit, and the last commit is what serves at the end.
        committed = [u for u in self.updates if u[4] == "OK"]
        self.update_counts = collections.Counter(u[4] for u in self.updates)
        if not committed:
            v.append("no lm_head update committed")
        for version, _, t0, t1, code in self.updates:
            if code != "OK" and not (code in UPDATE_FAULT_CODES and any(
                    s <= t1 and (e is None or t0 <= e) for _, s, e in self.windows)):
                v.append("lm_head update %s at %.2f-%.2f s: %s (outside every fault window)" % (version, t0, t1, code))
        if committed and self.final_version != committed[-1][0]:
            v.append("the head serves %r at the end, not the last committed update %r" %
                     (self.final_version, committed[-1][0]))
        if self.inject and not self.windows:
            v.append("no fault was injected (run longer than %g s)" % (0.25 * PERIOD))
        # Memory: the second half of the run.
        half = [s for s in self.samples if s[0] >= self.seconds / 2]
        if not half:
            v.append("no memory samples in the second half")
        for t, rss, _, _, workers in half:
            if rss > self.bound["frontend"]:
                v.append("front-end VmRSS %d MiB at %.1f s over its bound %d MiB" %
                         (rss >> 20, t, self.bound["frontend"] >> 20))
                break
        for t, _, _, _, workers in half:
            over = {p: r for p, r in workers.items() if r > self.bound["worker"]}
            if over:
                v.append("worker VmRSS %s MiB at %.1f s over the bound %d MiB" %
                         ({p: r >> 20 for p, r in over.items()}, t, self.bound["worker"] >> 20))
                break
        # File descriptors and threads: last quarter against first quarter.
        q = self.seconds / 4
        first = [s for s in self.samples if s[0] < q]
        last = [s for s in self.samples if s[0] >= self.seconds - q]
        if first and last:
            for i, what, slack in ((2, "file descriptors", FD_SLACK), (3, "threads", THREAD_SLACK)):
                a, b = max(s[i] for s in first), max(s[i] for s in last)
                if b > a + slack:
                    v.append("front-end %s grew: max %d in the first quarter, %d in the last (slack %d)" %
                             (what, a, b, slack))
        else:
            v.append("too few samples to compare the first and last quarters")
        failures = sum(1 for line in self.pool_events if "generation" in line)
        if failures > len(self.windows):
            v.append("the worker pool failed %d times for %d injected faults (see the pool events)" %
                     (failures, len(self.windows)))
        self.check_metrics()

    def check_metrics(self):
        """Per method: the server's count of each code is what the clients
        saw, except that a client-side DEADLINE_EXCEEDED / CANCELLED (racy)
        may have ended as another code on the server, or never reached it:
        each count may exceed the clients' by the racy requests, and the
        DEADLINE_EXCEEDED / CANCELLED ones may fall short by as many. Stream
        and chunked requests have no racy ones: their counts are exact."""
        server = collections.Counter()
        for key, n in self.metrics_now.items():
            server[key] = int(n - self.base_metrics.get(key, 0))
        client = collections.Counter((r.method, "OK" if r.code.startswith("MISMATCH") else r.code)
                                     for r in self.records if r.sent is not False)
        racy = collections.Counter(r.method for r in self.records if r.code in ("DEADLINE_EXCEEDED", "CANCELLED")
                                   and r.sent is not False)
        self.metric_rows = []
        for method in ("Score", "ScoreStream", "ScoreChunked"):
            codes = sorted({c for m, c in list(server) + list(client) if m == method})
            for code in codes:
                s, c = server[(method, code)], client[(method, code)]
                self.metric_rows.append((method, code, c, s))
                # A racy request may end as any code on the server (or never reach it).
                lack = racy[method] if code in ("DEADLINE_EXCEEDED", "CANCELLED") else 0
                ok = c - lack <= s <= c + racy[method]
                if not ok:
                    self.violations.append("/metrics logprob_requests_total{method=%s,code=%s} = %d, clients saw %d"
                                           " (%d racy deadlines/cancellations)" % (method, code, s, c, racy[method]))

    def report(self):
        p = print
        p("soak: %g s of load, %d requests" % (self.t_end, len(self.records)))
        p("requests by actor and outcome:")
        for (actor, cls), n in sorted(self.by.items()):
            p("  %-8s %-28s %6d" % (actor, cls, n))
        p("lm_head updates: %s" % dict(getattr(self, "update_counts", {})))
        p("fault windows (s): " + ", ".join("%s [%.1f, %s]" % (n, s, "%.1f" % e if e else "never recovered")
                                            for n, s, e in self.windows))
        done = sorted(r.t1 for r in self.records)
        if len(done) > 1:
            gap = max(zip(done, done[1:]), key=lambda g: g[1] - g[0])
            p("longest time without an answer: %.2f s (%.2f-%.2f s)" % (gap[1] - gap[0], gap[0], gap[1]))
        if self.records:
            r = max(self.records, key=lambda r: r.t1 - r.t0)
            p("longest request: %s id=%s %.2f s (%.2f-%.2f s, %s)" % (r.actor, r.rid, r.t1 - r.t0, r.t0, r.t1, r.code))
        p("memory bound: front-end %d MiB (logprob-server --print-memory-bound), worker %d MiB (%s)" %
          (self.bound["frontend"] >> 20, self.bound["worker"] >> 20, self.bound["worker_formula"]))
        if self.samples:
            def mm(vals, unit=1):
                return "%d..%d" % (min(vals) // unit, max(vals) // unit)
            half = [s for s in self.samples if s[0] >= self.seconds / 2] or self.samples
            w = [r for s in half for r in s[4].values()]
            p("samples: %d; second half: front-end VmRSS %s MiB, worker VmRSS %s MiB; whole run: fds %s, threads %s" %
              (len(self.samples), mm([s[1] for s in half], 1 << 20), mm(w, 1 << 20) if w else "-",
               mm([s[2] for s in self.samples]), mm([s[3] for s in self.samples])))
        p("pool events (server log):")
        for line in self.pool_events:
            p("  " + line[:300])
        p("/metrics logprob_requests_total vs clients (method code client server):")
        for row in self.metric_rows:
            p("  %-12s %-18s %6d %6d" % row)
        if self.violations:
            p("FAIL: %d violation(s):" % len(self.violations))
            for x in self.violations:
                p("  - " + x)
            p("server log tail:\n" + self.server_log[-2000:])
            p("server log and every request: %s, %s" % (self.log_copy, self.records_path))
            return 1
        p("PASS")
        return 0


def guard(soak, fn):
    """Runs fn; an exception becomes a violation and stops the soak."""
    def run():
        try:
            fn()
        except BaseException as e:  # noqa: B902 - reported, never swallowed
            soak.violations.append("%s raised %r" % (getattr(fn, "__name__", fn), e))
            soak.stop.set()
    return run


def live_workers(server):
    """The server's worker processes that are not zombies, waiting (up to
    60 s) until there are WORKERS of them."""
    def live():
        pids = []
        for p in worker_pids(server):
            try:
                with open("/proc/%d/stat" % p) as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        pids.append(p)
            except OSError:
                pass
        return pids if len(pids) == WORKERS else None
    return wait_for(live, "%d live worker processes" % WORKERS, 60)


def vm_rss(pid):
    """VmRSS of a process, bytes."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError("no VmRSS for pid %d" % pid)


def region_size(n):
    """RegionSize(n) of docs/serving.md: the next power of two >= max(n, 1 MiB)."""
    n = max(n, 1 << 20)
    return 1 << (n - 1).bit_length()


def frontend_bound(flags):
    """The bounds of the flags: the front-end's from ``logprob-server
    --print-memory-bound``; each worker's as docs/serving.md "Memory
    sizing" gives it: worker_base_bytes + 3 lm_head slices ceil(V / W) x H x 4
    (F32 weights; updates: serving, held, loading) + one hidden-states round --hidden-chunk-tokens x V x 4 +
    the payload regions it may map (2 x --max-queue-bytes +
    RegionSize(--max-request-bytes), the front-end's payload part)."""
    import subprocess
    from support import BIN_DIR
    out = subprocess.run([os.path.join(BIN_DIR, "logprob-server"), "--print-memory-bound", "--workers",
                          str(WORKERS)] + flags, check=True, capture_output=True, text=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split(" (")[0].split())
    base = int(fields["worker_base_bytes"])
    # Slices: the version serving, one an in-flight request still holds, and
    # one being loaded (updates; the store file's pages, mapped).
    worker = (base + 3 * -(-V // WORKERS) * H * 4 + HIDDEN_CHUNK_TOKENS * V * 4 + 2 * MAX_QUEUE_BYTES +
              region_size(MAX_REQUEST_BYTES))
    return {"frontend": int(fields["frontend_bytes"]), "worker": worker,
            "worker_formula": "%d MiB base + slice + round + payload regions" % (base >> 20)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seconds", nargs="?", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--no-faults", action="store_true", help="load only (to tell faults' effects from the load's)")
    args = ap.parse_args()
    if args.seconds < 20:
        ap.error("SECONDS must be at least 20 (the faults need room)")
    sys.exit(Soak(args.seconds, faults=not args.no_faults).run())


if __name__ == "__main__":
    main()
