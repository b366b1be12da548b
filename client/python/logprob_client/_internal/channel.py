"""Channel settings shared by the sync and asyncio clients: TLS credentials,
the bearer token's metadata and the channel options, read and checked once;
``open_sync()`` / ``open_aio()`` make the ``grpc`` / ``grpc.aio`` channel."""

import warnings
from typing import Any, List, Optional, Sequence, Tuple

import grpc

from ..errors import InvalidInputError

Metadata = Optional[Tuple[Tuple[str, str], ...]]


def _read_file(what: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InvalidInputError("%s %s: cannot read: %s" % (what, path, e.strerror)) from None
    if not data:
        raise InvalidInputError("%s %s: the file is empty" % (what, path))
    return data


def _check_token(token: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise InvalidInputError("%s: the token is empty" % where)
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise InvalidInputError("%s: the token holds a character that is not printable ASCII" % where)
    return token


def _token_of(what: str, token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    """The checked token given as ``what`` or read from ``what``_file (None: neither)."""
    if token is not None and token_file is not None:
        raise InvalidInputError("give %s or %s_file, not both" % (what, what))
    if token_file is not None:
        return _check_token(_read_file(what + "_file", token_file).decode("latin-1"), "%s_file %s" % (what, token_file))
    return _check_token(token, what) if token is not None else None


def _bearer(token: Optional[str]) -> Metadata:
    return (("authorization", "Bearer " + token),) if token else None


# gRPC name-resolver schemes a target may start with (passed on as is).
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def check_target(target: str) -> str:
    """``target`` when it is a gRPC target this client can dial:
    ``HOST:PORT`` (``[V6]:PORT`` for IPv6), or a gRPC resolver URI
    (``unix:/path``, ``dns:///HOST:PORT``, ...). Raises InvalidInputError
    saying what to change for the usual slips: a URL scheme
    (``http://HOST:PORT``) or a missing port."""
    if not isinstance(target, str) or not target.strip():
        raise InvalidInputError("target must be 'HOST:PORT' (e.g. '127.0.0.1:50051'), got %r" % (target,))
    target = target.strip()
    lower = target.lower()
    if lower.startswith(_GRPC_SCHEMES):
        return target
    if "://" in target:
        scheme, _, rest = target.partition("://")
        rest = rest.rstrip("/")
        tls = " (for TLS pass tls_ca=..., a URL scheme does not turn it on)" if scheme.lower() in ("https", "grpcs") else ""
        raise InvalidInputError(
            "target %r: drop the scheme, give 'HOST:PORT' such as %r%s" % (target, rest or "127.0.0.1:50051", tls)
        )
    if target.startswith("["):
        host, sep, port = target.partition("]:")
        if not sep:
            raise InvalidInputError("target %r: add the port, e.g. '%s]:50051'" % (target, target.rstrip("]")))
    else:
        host, sep, port = target.rpartition(":")
        if not sep:
            raise InvalidInputError("target %r: add the port, e.g. '%s:50051'" % (target, target))
        if ":" in host:
            raise InvalidInputError("target %r: put an IPv6 address in brackets, e.g. '[%s]:%s'" % (target, host, port))
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError("target %r: the port must be a number in 1..65535, got %r" % (target, port))
    if not host.strip("[]"):
        raise InvalidInputError("target %r: add the host, e.g. '127.0.0.1:%s'" % (target, port))
    return target


class ChannelSettings:
    """What a channel to ``target`` needs (arguments as in
    ``LogprobClient``). Raises InvalidInputError for a target that is not
    ``HOST:PORT`` (``check_target``), unreadable or empty
    TLS / token files, an empty token, or ``tls_cert`` without ``tls_key``;
    warns when a token would travel without TLS."""

    def __init__(
        self,
        target: str,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        channel_options: Sequence[Tuple[str, Any]] = (),
        update_token: Optional[str] = None,
        update_token_file: Optional[str] = None,
    ) -> None:
        self.target = check_target(target)
        token = _token_of("token", token, token_file)
        update_token = _token_of("update_token", update_token, update_token_file)
        # Scoring calls send the scoring token, else the update token (it may
        # also score); update calls the update token, else the scoring token.
        self.metadata: Metadata = _bearer(token or update_token)
        self.update_metadata: Metadata = _bearer(update_token or token)
        token = token or update_token

        options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            # Quick reconnects to a server that comes back. (Not
            # grpc.min_reconnect_backoff_ms: gRPC also takes it as the time a
            # connection attempt, TLS handshake included, may last.)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        self.credentials = None
        if any(x for x in (tls_ca, tls_cert, tls_key, tls_server_name)):
            if bool(tls_cert) != bool(tls_key):
                raise InvalidInputError("tls_cert and tls_key go together (mutual TLS)")
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_file("tls_ca", tls_ca) if tls_ca else None,
                private_key=_read_file("tls_key", tls_key) if tls_key else None,
                certificate_chain=_read_file("tls_cert", tls_cert) if tls_cert else None,
            )
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
        options.extend(channel_options)
        self.options = options
        if token and self.credentials is None:
            warnings.warn("logprob_client: bearer token without TLS: the token is sent in plaintext", stacklevel=3)

    def open_sync(self) -> grpc.Channel:
        """A new ``grpc.Channel``."""
        if self.credentials is not None:
            return grpc.secure_channel(self.target, self.credentials, options=self.options)
        return grpc.insecure_channel(self.target, options=self.options)

    def open_aio(self) -> "grpc.aio.Channel":
        """A new ``grpc.aio.Channel`` (call from the event loop's thread)."""
        if self.credentials is not None:
            return grpc.aio.secure_channel(self.target, self.credentials, options=self.options)
        return grpc.aio.insecure_channel(self.target, options=self.options)
