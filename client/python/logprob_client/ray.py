"""The scoring service started inside a Ray cluster, from the trainer's driver.

``LogprobService.start`` places one front-end (``logprob-server
--external-workers N``) and N workers (``logprob-worker --frontend ...
--advertise-host <node IP>``) as Ray actors in a placement group, one
worker per bundle (``resources_per_worker``, e.g. ``{"GPU": 1}``: the worker
process sees the GPU Ray assigned to its actor through
``CUDA_VISIBLE_DEVICES``). Each actor owns its process: the process dies
with the actor (``PR_SET_PDEATHSIG``), and its folders (its log, the
front-end's lm_head store under /dev/shm) are removed by a reaper process
once both are gone, so ``ray.kill``, the end of the job and a killed
driver leave no process and no folder behind (a dead node, no process).
Worker actors are restartable (``max_restarts``): Ray starts a killed
worker again, it joins the front-end, and the pool re-forms with the
committed head versions (docs/cluster.md). Nodes need no shared folder:
heads may be declared by shape (``DeclaredHead``) and filled from the
driver with ``client().update_lm_head``, and workers that cannot read a
head's file fetch their slice from the front-end (``logprob-worker
--fetch-lm-heads``).

The front-end listens on ``port`` (default: a free one) on every address
of its node; ``client()`` reaches it over loopback from the same host, so
that its inputs may go through shared memory. The actors' code
(``_ray_actor``) travels with them, so nodes (e.g. of a ``ray start``
cluster) need Ray and the binaries but not this package.

Install with ``pip install 'logprob-client[ray]'`` where the driver runs;
the binaries come from the project's image (``PATH``), or ``bin_dir`` /
``LOGPROB_BIN_DIR`` on every node. Example::

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

import secrets
import socket
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

from . import _ray_actor, aio
from .client import LogprobClient

__all__ = ["DeclaredHead", "LogprobService", "PLACEMENTS"]

#: Placement strategies of the workers' placement group (Ray's names).
PLACEMENTS = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")



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


def _is_address_here(ip: str) -> bool:
    """True when ``ip`` is an address of this machine (of this network
    namespace): loopback, or one a socket can bind."""
    if ip.startswith("127.") or ip == "::1":
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


# The actor's code travels with the actor class (pickled by value): a node
# needs neither this package nor its stubs on its PYTHONPATH.
ray.cloudpickle.register_pickle_by_value(_ray_actor)
_RemoteProcess = ray.remote(_ray_actor._ProcessActor)


def _has_flag(args: Sequence[str], name: str) -> bool:
    """Whether ``args`` give flag ``name`` (dashes or underscores, ``--f V``
    or ``--f=V``)."""
    spellings = {"--" + name, "--" + name.replace("-", "_")}
    return any(a.split("=", 1)[0] in spellings for a in args)


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
                 client_kwargs: Optional[Mapping[str, Any]] = None, listen_wildcard: bool = False) -> None:
        self.frontend = frontend
        self.workers = workers
        self.placement_group = pg
        self._owns_pg = owns_pg
        self.address = address
        self._listen_wildcard = listen_wildcard
        self._client_kwargs = dict(client_kwargs or {})
        self._stopped = False

    def client_address(self) -> str:
        """The front-end's address for a client in this process: over
        loopback (``127.0.0.1:PORT``) when the front-end listens on every
        address (``listen_wildcard``) and its node's IP is an address of
        this machine, so the server takes this client as local and its
        inputs may go through shared memory; else ``address``."""
        host, _, port = self.address.rpartition(":")
        if self._listen_wildcard and _is_address_here(host.strip("[]")):
            return "%s:%s" % ("[::1]" if ":" in host else "127.0.0.1", port)
        return self.address

    def _client_args(self, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
        """``client_kwargs`` of start updated by ``kwargs``; a TLS client
        reaching the front-end over loopback still verifies the node's name."""
        kw = dict(self._client_kwargs)
        kw.update(kwargs)
        if kw.get("tls_ca") and not kw.get("tls_server_name") and self.client_address() != self.address:
            kw["tls_server_name"] = self.address.rpartition(":")[0].strip("[]")
        return kw

    @classmethod
    def start(cls, workers: int, backend: str = "cuda", heads: Optional[Mapping[str, HeadSpec]] = None,
              resources_per_worker: Optional[Mapping[str, float]] = None, placement: str = "PACK",
              placement_group: Any = None, server_args: Sequence[str] = (), worker_args: Sequence[str] = (),
              bin_dir: Optional[str] = None, max_restarts: int = -1, fetch_lm_heads: str = "always",
              placement_timeout: float = 600.0, client_kwargs: Optional[Mapping[str, Any]] = None,
              port: int = 0, listen_wildcard: bool = True) -> "LogprobService":
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
        ``port``: the front-end's public port (0, the default: a free port
        of its node); ``listen_wildcard``: the front-end listens on every
        address of its node (True, the default: clients on that host reach
        it over loopback, which shared-memory inputs need; ``client()``
        does so) or on the node's IP only. The actors' code travels with
        them (nodes need only Ray and the binaries, no ``PYTHONPATH``).
        Each actor's folders (its log; the front-end's lm_head store,
        under /dev/shm unless ``server_args`` give
        ``--lm-head-store-dir``) are removed when it ends, also when the
        driver is killed.
        Raises ValueError for bad arguments, TimeoutError when the placement
        group cannot be placed within ``placement_timeout`` s, and
        RuntimeError (with the process's output) when the front-end fails
        to start, e.g. FileNotFoundError's text for missing binaries or a
        ``port`` that is taken."""
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
        if not 0 <= port <= 65535:
            raise ValueError("port must be 0 (a free port) or 1..65535, got %d" % port)
        resources = dict(resources_per_worker or ({"GPU": 1} if backend == "cuda" else {"CPU": 1}))
        # The internal plane's secret, made here and handed to the actors
        # through Ray (docs/security.md "The internal plane").
        pool_secret = secrets.token_hex(32)
        server = ["--listen", "{listen_host}:{port0}", "--control-listen", "{node_ip}:{port1}",
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
        if declared and not _has_flag(server_args, "allow-lm-head-updates"):
            server.append("--allow-lm-head-updates")
        if not _has_flag(server_args, "lm-head-store-dir"):
            # A folder of the actor's, so that it goes with the actor however the actor ends.
            server += ["--lm-head-store-dir", "{store_dir}"]
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
                "logprob-server", server, bin_dir, [port, 0], False, pool_secret, listen_wildcard)
            try:
                fe = ray.get(frontend.info.remote())
            except ray.exceptions.RayActorError as e:
                raise RuntimeError("the logprob-server actor failed to start: %s" % e) from e
            control = "%s:%d" % (fe["node_ip"], fe["ports"][1])
            worker = ["--frontend", control, "--advertise-host", "{node_ip}", "--backend", backend,
                      "--fetch-lm-heads", fetch_lm_heads, "--internal-secret-file", "{secret_file}"] + list(worker_args)
            actors = [_RemoteProcess.options(max_restarts=max_restarts, scheduling_strategy=in_bundle(i),
                                             **_split_resources(resources)).remote(
                "logprob-worker", worker, bin_dir, (), True, pool_secret)
                      for i in range(workers)]
        except BaseException:
            if owns_pg:
                _remove_placement_group(pg)
            raise
        return cls(frontend, actors, pg, owns_pg, "%s:%d" % (fe["node_ip"], fe["ports"][0]), client_kwargs,
                   listen_wildcard)

    def client(self, **kwargs: Any) -> LogprobClient:
        """A ``LogprobClient`` of the front-end (``client_kwargs`` of start,
        updated by ``kwargs``), at ``client_address()``."""
        return LogprobClient(self.client_address(), **self._client_args(kwargs))

    def aio_client(self, **kwargs: Any) -> aio.LogprobClient:
        """An asyncio ``logprob_client.aio.LogprobClient`` of the front-end
        (as ``client``)."""
        return aio.LogprobClient(self.client_address(), **self._client_args(kwargs))

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
