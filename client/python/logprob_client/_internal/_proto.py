"""Locating (or generating) the Python stubs of ``proto/logprob/v1/logprob.proto``.

The stubs are generated code and are not committed. They are found, in order:

0. in ``logprob_client/_generated`` of an installed package (``pip install
   ./client/python`` generates them there at build time, see setup.py);
1. already importable as ``logprob.v1.logprob_pb2`` (e.g. ``PYTHONPATH``
   holds ``build/python``, which the CMake target ``logprob_python_stubs``
   fills with ``protoc --python_out`` and ``grpc_python_plugin``);
2. in the folder named by the environment variable ``LOGPROB_PY_STUBS_DIR``;
3. in ``build/python`` of the source tree this package sits in
   (``client/python/logprob_client`` -> ``../../../build/python``);
4. generated now, from ``LOGPROB_PROTO_DIR`` (default: ``proto/`` of that
   source tree), with ``protoc`` and ``grpc_python_plugin`` (Debian
   ``protobuf-compiler`` and ``protobuf-compiler-grpc``) into a cache folder
   (``$XDG_CACHE_HOME/logprob_client/<hash>`` or ``~/.cache/...``), keyed by
   the hash of the ``.proto`` file so an edited proto is regenerated.
"""

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, List, Optional, Tuple

# (logprob_pb2, logprob_pb2_grpc): generated modules, untyped.
Stubs = Tuple[Any, Any]

_PROTO_REL = os.path.join("logprob", "v1", "logprob.proto")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # logprob_client/
_SOURCE_ROOT = os.path.normpath(os.path.join(_PACKAGE, "..", "..", ".."))


def _try_import() -> Optional[Stubs]:
    try:
        pb2 = importlib.import_module("logprob.v1.logprob_pb2")
        pb2_grpc = importlib.import_module("logprob.v1.logprob_pb2_grpc")
        return pb2, pb2_grpc
    except ImportError:
        return None


def _has_stubs(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "logprob", "v1", "logprob_pb2.py")) and os.path.isfile(
        os.path.join(folder, "logprob", "v1", "logprob_pb2_grpc.py")
    )


def _import_from(folder: str) -> Optional[Stubs]:
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # A namespace package "logprob" imported before recomputes its __path__
    # from sys.path, so it finds logprob/v1 in `folder` now.
    importlib.invalidate_caches()
    return _try_import()


def _generate(proto_dir: str) -> str:
    proto = os.path.join(proto_dir, _PROTO_REL)
    with open(proto, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    cache_root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = os.path.join(cache_root, "logprob_client", digest)
    if _has_stubs(out):
        return out
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise ImportError(
            "logprob_client: the generated stubs (logprob.v1.logprob_pb2) are not importable and cannot be "
            "generated: protoc and grpc_python_plugin are needed (Debian: protobuf-compiler "
            "protobuf-compiler-grpc); or build the CMake target logprob_python_stubs and put build/python "
            "on PYTHONPATH, or set LOGPROB_PY_STUBS_DIR"
        )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=digest + ".", dir=os.path.dirname(out))
    try:
        subprocess.run(
            [
                protoc,
                "--proto_path=" + proto_dir,
                "--python_out=" + tmp,
                "--grpc_python_out=" + tmp,
                "--plugin=protoc-gen-grpc_python=" + plugin,
                proto,
            ],
            check=True,
            capture_output=True,
        )
        try:
            os.rename(tmp, out)  # atomic; another process may have won the race
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImportError("logprob_client: protoc failed on %s: %s" % (proto, e.stderr.decode(errors="replace")))
    return out


def _packaged() -> Optional[Stubs]:
    if not os.path.isfile(os.path.join(_PACKAGE, "_generated", "logprob_pb2_grpc.py")):
        return None
    from .._generated import logprob_pb2, logprob_pb2_grpc

    return logprob_pb2, logprob_pb2_grpc


def load() -> Stubs:
    """Returns the modules ``(logprob_pb2, logprob_pb2_grpc)``; raises ImportError."""
    found = _packaged() or _try_import()
    if found:
        return found
    candidates: List[str] = []
    if os.environ.get("LOGPROB_PY_STUBS_DIR"):
        candidates.append(os.environ["LOGPROB_PY_STUBS_DIR"])
    candidates.append(os.path.join(_SOURCE_ROOT, "build", "python"))
    for folder in candidates:
        if _has_stubs(folder):
            found = _import_from(folder)
            if found:
                return found
    proto_dir = os.environ.get("LOGPROB_PROTO_DIR") or os.path.join(_SOURCE_ROOT, "proto")
    if not os.path.isfile(os.path.join(proto_dir, _PROTO_REL)):
        raise ImportError(
            "logprob_client: logprob.v1.logprob_pb2 is not importable and %s does not exist; build the CMake "
            "target logprob_python_stubs (build/python) or set LOGPROB_PY_STUBS_DIR / LOGPROB_PROTO_DIR"
            % os.path.join(proto_dir, _PROTO_REL)
        )
    found = _import_from(_generate(proto_dir))
    if not found:
        raise ImportError("logprob_client: generated stubs could not be imported")
    return found


pb2, pb2_grpc = load()
