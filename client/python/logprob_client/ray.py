"""The scoring service started inside a Ray cluster, from the trainer's driver.

``LogprobService.start`` places one front-end (``logprob-server
--external-workers N``) and N workers (``logprob-worker --frontend ...
--advertise-host <node IP>``) as Ray actors in a placement group, one
worker per bundle (``resources_per_worker``, e.g. ``{"GPU": 1}``: the worker
process sees the GPU Ray assigned to its actor through
``CUDA_VISIBLE_DEVICES``). Each actor owns its process: the process dies
with the actor (``PR_SET_PDEATHSIG``), so ``ray.kill``, a dead node, the end
of the job and a killed driver leave no process behind. Worker actors are
restartable (``max_restarts``): Ray starts a killed worker again, it joins
the front-end, and the pool re-forms with the committed head versions
(docs/cluster.md). Nodes need no shared folder: heads may be declared by
shape (``DeclaredHead``) and filled from the driver with
``client().update_lm_head``, and workers that cannot read a head's file
fetch their slice from the front-end (``logprob-worker --fetch-lm-heads``).

Install with ``pip install 'logprob-client[ray]'``; the binaries come from
the project's image (``PATH``), or ``bin_dir`` / ``LOGPROB_BIN_DIR`` on
every node. Example::

    import ray
    from logprob_client.ray import DeclaredHead, LogprobService

    ray.init()
    service = LogprobService.start(workers=4, backend="cuda",
                                   heads={"policy": DeclaredHead(151936, 4096, "bf16")})
    service.wait_ready(600)
    client = service.client()
    client.update_lm_head("policy", model.lm_head.weight, version="step-0")
    ...
    service.stop()

docs/deployment.md ("Ray") says when to use it rather than the StatefulSet.
"""

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

try:
    import ray
    from ray.util.placement_group import placement_group as _make_placement_group
    from ray.util.placement_group import remove_placement_group as _remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("logprob_client.ray needs Ray: pip install 'logprob-client[ray]' (or scripts/setup-ray.sh "
                      "in a checkout)") from e

from . import aio
from .client import LogprobClient

__all__ = ["DeclaredHead", "LogprobService", "PLACEMENTS"]

#: Placement strategies of the workers' placement group (Ray's names).
PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class DeclaredHead:
    """A head declared by shape and dtype (``logprob-server --lm-head-declare
    NAME=VxH:DTYPE``): no checkpoint file any node must see; it serves once
    the first ``update_lm_head`` fills it (requests before get
    FAILED_PRECONDITION). ``dtype``: "bf16", "f16" or "f32"."""

    vocab_size: int
    hidden_size: int
    dtype: str = "bf16"

    def flag(self, name: str) -> str:
        """The ``--lm-head-declare`` value for head ``name``."""
        if self.vocab_size <= 0 or self.hidden_size <= 0:
            raise ValueError("DeclaredHead %s: vocab_size and hidden_size must be > 0, got %d x %d"
                             % (name, self.vocab_size, self.hidden_size))
        if self.dtype.lower() not in ("bf16", "f16", "f32"):
            raise ValueError("DeclaredHead %s: dtype %r is not bf16, f16 or f32" % (name, self.dtype))
        return "%s=%dx%d:%s" % (name, self.vocab_size, self.hidden_size, self.dtype.lower())


#: A head of ``LogprobService.start(heads=...)``: a checkpoint path as the
#: front-end's node sees it (``--lm-head NAME=PATH[:TENSOR]``), or a
#: ``DeclaredHead``.
HeadSpec = Union[str, DeclaredHead]


def _node_ip() -> str:
    """The IP address of the Ray node this process runs on (the node's
    NodeManagerAddress: what Ray's other nodes reach it at)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


def _find_binary(program: str, bin_dir: Optional[str]) -> str:
    """``program`` in ``bin_dir``, ``LOGPROB_BIN_DIR`` or ``PATH``, on this
    node; FileNotFoundError naming the node and the places searched."""
    places = [d for d in (bin_dir, os.environ.get("LOGPROB_BIN_DIR")) if d]
    for d in places:
        path = os.path.join(d, program)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(program)
    if found:
        return found
    raise FileNotFoundError(
        "%s not found on node %s (searched %s and PATH=%s): run the workers in the logprob-service image, or "
        "pass bin_dir= / set LOGPROB_BIN_DIR to the folder holding logprob-server and logprob-worker on every node"
        % (program, _node_ip(), ", ".join(places) or "no bin_dir", os.environ.get("PATH", "")))


def _free_port(host: str) -> int:
    """A TCP port of ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor's process exits,
    and a process group of its own (stop() signals the group)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(127)  # never run a process that could outlive its actor
    os.setsid()


class _ProcessActor:
    """A Ray actor owning one logprob- process on its node. The process is
    started in ``__init__``, so a restarted actor (``max_restarts``) starts
    it again. ``args`` may hold ``{node_ip}`` and ``{port0}``, ``{port1}``
    (free ports of the node, chosen here). Its output goes to a log file on
    the node (``log_tail``; one per actor, appended to across restarts). With ``exit_with_process``, the actor exits
    when its process does (other than by ``stop``), so that Ray restarts
    it (``max_restarts``) and with it the process."""

    def __init__(self, program: str, args: Sequence[str], bin_dir: Optional[str], ports: int = 0,
                 exit_with_process: bool = False, pool_secret: Optional[str] = None) -> None:
        self._ip = _node_ip()
        self._ports = [_free_port(self._ip) for _ in range(ports)]
        # One folder per actor, kept across its restarts (the log goes on),
        # private to this user (it holds the pool secret).
        self._dir = os.path.join(tempfile.gettempdir(),
                                 "logprob-ray-%s-%s" % (program, ray.get_runtime_context().get_actor_id()))
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        os.chmod(self._dir, 0o700)
        subst = {"{node_ip}": self._ip}
        subst.update({"{port%d}" % i: str(p) for i, p in enumerate(self._ports)})
        if pool_secret is not None:
            # The pool secret came through Ray's own channel (the actor's
            # arguments); the process reads it from a 0600 file, never argv.
            secret_file = os.path.join(self._dir, "pool-secret")
            fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(pool_secret)
            subst["{secret_file}"] = secret_file
        argv = [_find_binary(program, bin_dir)]
        for a in args:
            for k, v in subst.items():
                a = a.replace(k, v)
            argv.append(a)
        self._argv = argv
        self._log_path = os.path.join(self._dir, "output.log")
        self._stopping = False
        with open(self._log_path, "ab") as log:
            # Ray runs an actor's __init__ and methods (max_concurrency 1) on
            # its process's main thread, so PR_SET_PDEATHSIG fires when the
            # actor process ends, not when some thread of it does.
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=_die_with_parent)
        if exit_with_process:
            threading.Thread(target=self._exit_with_process, daemon=True).start()

    def _exit_with_process(self) -> None:
        """Ends the actor's process when the owned process ends unasked."""
        code = self._proc.wait()
        if not self._stopping:
            sys.stderr.write("logprob_client.ray: %s exited with status %s; ending the actor so Ray restarts it\n%s"
                             % (self._argv[0], code, self.log_tail()))
            sys.stderr.flush()
            os._exit(1)

    def info(self) -> Dict[str, Any]:
        """node_ip, ports, pid, argv, returncode (None while running),
        node_id, log (the output file on the node)."""
        return {"node_ip": self._ip, "ports": list(self._ports), "pid": self._proc.pid, "argv": list(self._argv),
                "returncode": self._proc.poll(), "node_id": ray.get_runtime_context().get_node_id(),
                "log": self._log_path}

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The last ``max_bytes`` of the process's output."""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - max_bytes))
                return f.read().decode(errors="replace")
        except OSError as e:
            return "(no log: %s)" % e

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM to the process group, SIGKILL after ``timeout`` s; the
        exit status. Removes the log folder."""
        self._stopping = True
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            except ProcessLookupError:
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
        return self._proc.returncode


_RemoteProcess = ray.remote(_ProcessActor)


def _split_resources(resources: Mapping[str, float]) -> Dict[str, Any]:
    """Ray actor options for one bundle's ``resources``."""
    custom = {k: float(v) for k, v in resources.items() if k not in ("CPU", "GPU")}
    opts: Dict[str, Any] = {"num_cpus": float(resources.get("CPU", 0)), "num_gpus": float(resources.get("GPU", 0))}
    if custom:
        opts["resources"] = custom
    return opts


class LogprobService:
    """A front-end and its workers running as Ray actors (see the module's
    docstring). Made by ``start``; ``address`` is the front-end's
    ``host:port`` (its node's IP). Methods are not thread-safe."""

    def __init__(self, frontend: Any, workers: List[Any], pg: Any, owns_pg: bool, address: str,
                 client_kwargs: Optional[Mapping[str, Any]] = None) -> None:
        self.frontend = frontend
        self.workers = workers
        self.placement_group = pg
        self._owns_pg = owns_pg
        self.address = address
        self._client_kwargs = dict(client_kwargs or {})
        self._stopped = False

    @classmethod
    def start(cls, workers: int, backend: str = "cuda", heads: Optional[Mapping[str, HeadSpec]] = None,
              resources_per_worker: Optional[Mapping[str, float]] = None, placement: str = "PACK",
              placement_group: Any = None, server_args: Sequence[str] = (), worker_args: Sequence[str] = (),
              bin_dir: Optional[str] = None, max_restarts: int = -1, fetch_lm_heads: str = "always",
              placement_timeout: float = 600.0, client_kwargs: Optional[Mapping[str, Any]] = None
              ) -> "LogprobService":
        """Starts the service in the connected Ray cluster (``ray.init``
        first) and returns at once; ``wait_ready`` waits until it serves.

        ``workers``: N; ``backend``: "cuda" or "cpu"; ``heads``: {name:
        checkpoint path on the front-end's node, or ``DeclaredHead``}
        (declared heads add ``--allow-lm-head-updates``);
        ``resources_per_worker``: one bundle per worker (default ``{"GPU":
        1}`` for cuda, ``{"CPU": 1}`` for cpu); ``placement``: the
        placement group's strategy (``PLACEMENTS``), or an existing
        ``placement_group`` with N bundles (not removed by ``stop``); the
        front-end runs in bundle 0 using no resources. ``server_args`` /
        ``worker_args``: more flags of logprob-server / logprob-worker;
        ``bin_dir``: where the binaries are on every node (else
        ``LOGPROB_BIN_DIR``, then ``PATH``); ``max_restarts``: Ray restarts
        of each worker actor (-1: unlimited); ``fetch_lm_heads``: the
        workers' ``--fetch-lm-heads`` (always, the default: a Ray node's
        file at the front-end's path may be another job's; auto; never).
        Raises ValueError for bad arguments, TimeoutError when the placement
        group cannot be placed within ``placement_timeout`` s, and
        RuntimeError (with the process's output) when the front-end fails
        to start, e.g. FileNotFoundError's text for missing binaries."""
        if workers < 1:
            raise ValueError("workers must be >= 1, got %d" % workers)
        if backend not in ("cuda", "cpu"):
            raise ValueError("backend must be 'cuda' or 'cpu', got %r" % (backend,))
        if placement_group is None and placement not in PLACEMENTS:
            raise ValueError("placement must be one of %s, got %r" % (", ".join(PLACEMENTS), placement))
        if placement_group is not None and len(placement_group.bundle_specs) < workers:
            raise ValueError("placement_group has %d bundles; %d workers need one each"
                             % (len(placement_group.bundle_specs), workers))
        if fetch_lm_heads not in ("auto", "always", "never"):
            raise ValueError("fetch_lm_heads must be auto, always or never, got %r" % (fetch_lm_heads,))
        resources = dict(resources_per_worker or ({"GPU": 1} if backend == "cuda" else {"CPU": 1}))
        # The internal plane's secret, made here and handed to the actors
        # through Ray (docs/security.md "The internal plane").
        pool_secret = secrets.token_hex(32)
        server = ["--listen", "{node_ip}:{port0}", "--control-listen", "{node_ip}:{port1}",
                  "--external-workers", str(workers), "--backend", backend, "--internal-secret-file", "{secret_file}"]
        declared = False
        for name, spec in (heads or {}).items():
            if isinstance(spec, DeclaredHead):
                server += ["--lm-head-declare", spec.flag(name)]
                declared = True
            elif isinstance(spec, str):
                server += ["--lm-head", "%s=%s" % (name, spec)]
            else:
                raise ValueError("heads[%r]: a checkpoint path or a DeclaredHead, got %r" % (name, spec))
        if declared and "--allow-lm-head-updates" not in server_args:
            server.append("--allow-lm-head-updates")
        server += list(server_args)

        owns_pg = placement_group is None
        pg = placement_group
        if owns_pg:
            pg = _make_placement_group([dict(resources) for _ in range(workers)], strategy=placement)
        try:
            ready, _ = ray.wait([pg.ready()], timeout=placement_timeout)
            if not ready:
                raise TimeoutError("the placement group of %d bundles %s (%s) was not placed in %g s: the cluster "
                                   "lacks the resources (available: %s)"
                                   % (workers, resources, placement, placement_timeout, ray.available_resources()))

            def in_bundle(i: int) -> Any:
                return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)

            frontend = _RemoteProcess.options(num_cpus=0, max_restarts=0, scheduling_strategy=in_bundle(0)).remote(
                "logprob-server", server, bin_dir, 2, False, pool_secret)
            try:
                fe = ray.get(frontend.info.remote())
            except ray.exceptions.RayActorError as e:
                raise RuntimeError("the logprob-server actor failed to start: %s" % e) from e
            control = "%s:%d" % (fe["node_ip"], fe["ports"][1])
            worker = ["--frontend", control, "--advertise-host", "{node_ip}", "--backend", backend,
                      "--fetch-lm-heads", fetch_lm_heads, "--internal-secret-file", "{secret_file}"] + list(worker_args)
            actors = [_RemoteProcess.options(max_restarts=max_restarts, scheduling_strategy=in_bundle(i),
                                             **_split_resources(resources)).remote("logprob-worker", worker, bin_dir, 0, True,
                                                                                  pool_secret)
                      for i in range(workers)]
        except BaseException:
            if owns_pg:
                _remove_placement_group(pg)
            raise
        return cls(frontend, actors, pg, owns_pg, "%s:%d" % (fe["node_ip"], fe["ports"][0]), client_kwargs)

    def client(self, **kwargs: Any) -> LogprobClient:
        """A ``LogprobClient`` of the front-end (``client_kwargs`` of start,
        updated by ``kwargs``)."""
        kw = dict(self._client_kwargs)
        kw.update(kwargs)
        return LogprobClient(self.address, **kw)

    def aio_client(self, **kwargs: Any) -> aio.LogprobClient:
        """An asyncio ``logprob_client.aio.LogprobClient`` of the front-end."""
        kw = dict(self._client_kwargs)
        kw.update(kwargs)
        return aio.LogprobClient(self.address, **kw)

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Waits until the front-end reports SERVING (every worker joined
        and loaded the heads). RuntimeError with its output when the
        front-end process exited, or with the error of a worker actor Ray
        will not restart; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                if c.health(wait=min(2.0, max(0.1, deadline - time.monotonic()))):
                    return
                try:
                    fe = ray.get(self.frontend.info.remote())
                except ray.exceptions.RayActorError as e:  # never restarted: its versions were in its store
                    raise RuntimeError("the logprob-server actor is dead (start a new service): %s" % e) from e
                for i, a in enumerate(self.workers):
                    try:
                        ray.get(a.info.remote(), timeout=30)
                    except ray.exceptions.ActorDiedError as e:  # not restarted (e.g. no binary on its node)
                        raise RuntimeError("worker actor %d is dead: %s" % (i, e)) from e
                    except ray.exceptions.GetTimeoutError:
                        pass  # restarting
                if fe["returncode"] is not None:
                    raise RuntimeError("logprob-server exited with status %s:\n%s"
                                       % (fe["returncode"], ray.get(self.frontend.log_tail.remote())))
                if time.monotonic() >= deadline:
                    raise TimeoutError("the service at %s did not become SERVING in %g s; logprob-server's "
                                       "output:\n%s" % (self.address, timeout,
                                                        ray.get(self.frontend.log_tail.remote())))

    def processes(self) -> List[Dict[str, Any]]:
        """``info()`` of the front-end, then of each worker actor (node_ip,
        pid, returncode, node_id, ...); a dead actor's entry is
        ``{"error": text}``."""
        out = []
        for a in [self.frontend] + self.workers:
            try:
                out.append(ray.get(a.info.remote(), timeout=60))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                out.append({"error": str(e)})
        return out

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the workers, then the front-end (SIGTERM, SIGKILL after
        ``timeout`` s), kills their actors and removes the placement group
        ``start`` made. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for a in self.workers + [self.frontend]:
            try:
                ray.get(a.stop.remote(timeout), timeout=timeout + 30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # gone already: its process died with it
            ray.kill(a, no_restart=True)
        if self._owns_pg:
            _remove_placement_group(self.placement_group)

    def __enter__(self) -> "LogprobService":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
