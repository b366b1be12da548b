"""lm_head updates of a replicated deployment: several front-ends behind
one address (a Kubernetes Deployment's pods behind a Service) each hold
their own copy of every head, so an update must reach each of them.

``update_lm_head_replicas`` resolves every replica behind a target and
commits the update on each one (concurrently), with the weight's SHA-256
computed once and sent to all of them, so that a version committed on some
replicas can be re-sent: a replica that holds it answers at once
(``already_committed``), the others take it. It raises
``ReplicaUpdateError`` naming the replicas that did not commit and why,
leaving the ones that did. A replica started later catches up from its
peers by itself (``logprob-server --lm-head-sync-from``); see
docs/lm-head-updates.md "What replicas see".

Example::

    from logprob_client.replicas import update_lm_head_replicas

    update_lm_head_replicas("dns:///logprob-headless.logprob.svc:50051", "policy",
                            model.lm_head.weight, version="step-13", token_file="/var/run/token")
"""

import asyncio
import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Union

import grpc

from .errors import InvalidInputError, LogprobError
from .lm_head_update import weight_sha256

__all__ = ["parse_target", "resolve_replicas", "weight_sha256", "ReplicaUpdateError", "update_lm_head_replicas",
           "update_lm_head_replicas_async"]

Target = Union[str, Sequence[str]]


# The target grammar, shared with the server's --lm-head-sync-from
# (common/replica_target.h); both are tested against
# tests/data/replica_targets/targets.json, which writes it down.
_SCHEMES = (("ipv4:", "listed"), ("ipv6:", "listed"), ("dns:///", "dns"), ("dns:", "dns"))


def _host_port(address: str) -> "tuple[str, str]":
    """``(host, port)`` of ``HOST:PORT`` / ``[V6]:PORT``; InvalidInputError otherwise."""
    bracketed = address.startswith("[")
    if bracketed:
        host, sep, port = address[1:].partition("]:")
    else:
        host, sep, port = address.rpartition(":")
    bad_host = any(c in "/[]" or c.isspace() or (c == ":" and not bracketed) for c in host)
    if not sep or not host or bad_host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise InvalidInputError("replica %r: give HOST:PORT (or [IPv6]:PORT)" % (address,))
    return host, port


def _unique_addresses(parts: Sequence[str], target: Any) -> List[str]:
    """``parts``, each checked to be ``HOST:PORT``, duplicates removed, order
    kept; InvalidInputError for a malformed one or none at all."""
    out: List[str] = []
    for p in parts:
        _host_port(p)
        if p not in out:
            out.append(p)
    if not out:
        raise InvalidInputError("target %r names no replica" % (target,))
    return out


def parse_target(target: str) -> "tuple[str, List[str]]":
    """``(kind, addresses)`` of a target string: kind ``"listed"``
    (``ipv4:`` / ``ipv6:``), ``"dns"`` (``dns:`` / ``dns:///``) or
    ``"plain"``; the ``HOST:PORT`` addresses, duplicates removed, order
    kept. Raises InvalidInputError for a malformed target or none."""
    t = target.strip()
    kind = "plain"
    for prefix, k in _SCHEMES:
        if t.startswith(prefix):
            kind, t = k, t[len(prefix):]
            break
    return kind, _unique_addresses([p.strip() for p in t.split(",") if p.strip()], target)


def _address(ip: str, port: str) -> str:
    return "[%s]:%s" % (ip, port) if ipaddress.ip_address(ip).version == 6 else "%s:%s" % (ip, port)


def resolve_replicas(target: Target) -> List[str]:
    """The addresses of every replica behind ``target``, each dialable
    alone (the grammar of tests/data/replica_targets/targets.json, the
    server's ``--lm-head-sync-from`` too): a list of ``HOST:PORT`` (taken
    as given); ``"ipv4:A:P,B:P"`` / ``"ipv6:[A]:P,..."`` (the listed
    addresses); ``"dns:///HOST:PORT"`` or ``"dns:HOST:PORT"`` (every A/AAAA
    record of each HOST, ``socket.getaddrinfo``: a Kubernetes headless
    Service gives one per ready pod); a string of comma-separated
    ``HOST:PORT`` (taken as given: a ClusterIP Service name is one
    address, use the headless Service with ``dns:///``). Duplicates
    removed, order kept. Raises InvalidInputError for a malformed target or
    a DNS name that resolves to nothing."""
    if not isinstance(target, str):
        return _unique_addresses([str(p).strip() for p in target], target)
    kind, parts = parse_target(target)
    if kind != "dns":
        return parts
    out: List[str] = []
    for p in parts:
        host, port = _host_port(p)
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise InvalidInputError("target %r: %s resolves to no address (%s)" % (target, host, e)) from None
        for info in infos:
            a = _address(str(info[4][0]), port)
            if a not in out:
                out.append(a)
    return out


class ReplicaUpdateError(LogprobError):
    """An update committed on some replicas, or none. Attributes:
    ``committed`` (addresses that hold the version now), ``failed``
    (address -> the exception that stopped it there), ``version``,
    ``sha256``. ``code`` / ``reason`` are those of the first failure. Send
    the same version again (same weight, so the same sha256) to finish:
    the replicas that hold it answer at once."""

    def __init__(self, head: str, version: str, sha256: str, committed: List[str],
                 failed: Dict[str, BaseException]) -> None:
        self.head = head
        self.version = version
        self.sha256 = sha256
        self.committed = committed
        self.failed = failed
        first = next(iter(failed.values()))
        code = first.code if isinstance(first, LogprobError) else grpc.StatusCode.UNKNOWN
        why = "; ".join("%s: %s" % (a, e) for a, e in failed.items())
        total = len(committed) + len(failed)
        message = ("lm_head %r version %r committed on %d of %d replicas (%s); not on %s. Send the same version "
                   "again to finish (replicas that hold it do nothing)"
                   % (head, version, len(committed), total, ", ".join(committed) or "none", why))
        super().__init__(code, message, reason=first.reason if isinstance(first, LogprobError) else "")


def _update_args(version: str, sha256: str, timeout: Any, dtype: Any, bias: Any, logit_scale: Optional[float],
                 final_logit_softcapping: Optional[float]) -> Dict[str, Any]:
    return dict(version=version, sha256=sha256, timeout=timeout, dtype=dtype, bias=bias, logit_scale=logit_scale,
                final_logit_softcapping=final_logit_softcapping)


def _outcome(head: str, version: str, sha256: str, replicas: List[str], results: List[Any]) -> str:
    failed = {a: r for a, r in zip(replicas, results) if isinstance(r, BaseException)}
    if failed:
        committed = [a for a, r in zip(replicas, results) if not isinstance(r, BaseException)]
        raise ReplicaUpdateError(head, version, sha256, committed, failed)
    return version


def update_lm_head_replicas(target: Target, head: str, weight: Any, *, version: str, sha256: Optional[str] = None,
                            timeout: Any = "default", dtype: Any = None, bias: Any = None,
                            logit_scale: Optional[float] = None, final_logit_softcapping: Optional[float] = None,
                            **client_args: Any) -> str:
    """``LogprobClient.update_lm_head`` on every replica behind ``target``
    (``resolve_replicas``), concurrently, one client per replica made with
    ``client_args`` (``timeout`` of the client, TLS, ``token`` /
    ``token_file``, ``retry``, ``shared_memory``, ...; ``tls_server_name``
    when the certificates name the Service, not the pods' addresses).
    ``sha256`` (default: ``weight_sha256``) goes to every replica. Returns
    the version once every replica committed it; raises
    ReplicaUpdateError (which replicas did not commit, and why) otherwise,
    InvalidInputError for a bad target or weight."""
    from .client import LogprobClient

    replicas = resolve_replicas(target)
    digest = sha256 or weight_sha256(weight, dtype)
    args = _update_args(version, digest, timeout, dtype, bias, logit_scale, final_logit_softcapping)

    def one(address: str) -> Any:
        try:
            with LogprobClient(address, **client_args) as client:
                return client.update_lm_head(head, weight, **args)
        except Exception as e:  # reported per replica
            return e

    with ThreadPoolExecutor(max_workers=len(replicas)) as pool:
        results = list(pool.map(one, replicas))
    return _outcome(head, version, digest, replicas, results)


async def update_lm_head_replicas_async(target: Target, head: str, weight: Any, *, version: str,
                                        sha256: Optional[str] = None, timeout: Any = "default", dtype: Any = None,
                                        bias: Any = None, logit_scale: Optional[float] = None,
                                        final_logit_softcapping: Optional[float] = None, **client_args: Any) -> str:
    """``update_lm_head_replicas`` with ``logprob_client.aio.LogprobClient``
    (one per replica, made on the running loop), the replicas updated
    concurrently; DNS and the SHA-256 run off the event loop."""
    from .aio import LogprobClient

    loop = asyncio.get_running_loop()
    replicas = await loop.run_in_executor(None, resolve_replicas, target)
    digest = sha256 if sha256 else await loop.run_in_executor(None, weight_sha256, weight, dtype)
    args = _update_args(version, digest, timeout, dtype, bias, logit_scale, final_logit_softcapping)

    async def one(address: str) -> Any:
        async with LogprobClient(address, **client_args) as client:
            return await client.update_lm_head(head, weight, **args)

    results = await asyncio.gather(*(one(a) for a in replicas), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancellation and the like are not a replica's failure
    return _outcome(head, version, digest, replicas, list(results))
