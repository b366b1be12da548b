"""Build step of the logprob-client package (metadata: pyproject.toml).

The gRPC stubs of ``proto/logprob/v1/logprob.proto`` are generated while the
package is built, into ``logprob_client/_generated`` of the build (never of
the source tree), with, in order of preference:

1. ``protoc`` and ``grpc_python_plugin`` on PATH (Debian bookworm:
   ``protobuf-compiler`` 3.21.12 and ``protobuf-compiler-grpc`` 1.51.1, the
   same versions as the ``python3-protobuf`` / ``python3-grpcio`` runtimes);
2. the ``grpc_tools.protoc`` module (PyPI ``grpcio-tools``), for machines
   without Debian's compilers. Debian's own ``python3-grpc-tools`` (1.14.1)
   bundles protoc 3.5.1, which rejects the proto ("Explicit 'optional'
   labels are disallowed in the Proto3 syntax": proto3 ``optional`` needs
   protoc >= 3.15), so it is not a choice on bookworm.

Generated code is not committed: it must match the protobuf runtime it
runs on, and the proto is the one source of truth. ``grpc_python_plugin``
imports the messages as ``from logprob.v1 import logprob_pb2``; that line
is rewritten to a relative import so the package carries its own stubs and
installs no top-level ``logprob`` package.

The proto is found in ``LOGPROB_PROTO_DIR`` or ``../../proto`` of this
folder (the repository's ``proto/``).
"""

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_REL = os.path.join("logprob", "v1", "logprob.proto")
GRPC_IMPORT = re.compile(r"^from logprob\.v1 import logprob_pb2 as ", re.M)


def proto_dir():
    d = os.environ.get("LOGPROB_PROTO_DIR") or os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
    if not os.path.isfile(os.path.join(d, PROTO_REL)):
        sys.exit("logprob-client: %s not found; build from a checkout of the repository or set "
                 "LOGPROB_PROTO_DIR to its proto/ folder" % os.path.join(d, PROTO_REL))
    return d


def run_protoc(src, out):
    """Writes logprob/v1/logprob_pb2{,_grpc}.py of ``src`` under ``out``."""
    args = ["--proto_path=" + src, "--python_out=" + out, "--grpc_python_out=" + out, os.path.join(src, PROTO_REL)]
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        cmd = [protoc, "--plugin=protoc-gen-grpc_python=" + plugin] + args
    else:
        try:
            import grpc_tools  # noqa: F401
        except ImportError:
            sys.exit("logprob-client: generating the gRPC stubs needs protoc and grpc_python_plugin (Debian: "
                     "apt-get install protobuf-compiler protobuf-compiler-grpc) or the grpcio-tools package")
        cmd = [sys.executable, "-m", "grpc_tools.protoc"] + args
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit("logprob-client: %s failed:\n%s" % (" ".join(cmd), result.stderr))


def generate(package_dir):
    """Writes the stubs into ``package_dir``/_generated (a package)."""
    src = proto_dir()
    tmp = tempfile.mkdtemp(prefix="logprob_stubs_")
    try:
        run_protoc(src, tmp)
        gen = os.path.join(package_dir, "_generated")
        os.makedirs(gen, exist_ok=True)
        v1 = os.path.join(tmp, "logprob", "v1")
        shutil.copyfile(os.path.join(v1, "logprob_pb2.py"), os.path.join(gen, "logprob_pb2.py"))
        with open(os.path.join(v1, "logprob_pb2_grpc.py")) as f:
            code, n = GRPC_IMPORT.subn("from . import logprob_pb2 as ", f.read())
        if n != 1:
            sys.exit("logprob-client: unexpected logprob_pb2_grpc.py (%d imports of logprob.v1.logprob_pb2)" % n)
        with open(os.path.join(gen, "logprob_pb2_grpc.py"), "w") as f:
            f.write(code)
        with open(os.path.join(gen, "__init__.py"), "w") as f:
            f.write('"""gRPC stubs of logprob/v1/logprob.proto, generated when the package was built."""\n')
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [os.path.join(gen, n) for n in ("__init__.py", "logprob_pb2.py", "logprob_pb2_grpc.py")]


class BuildPyWithStubs(build_py):
    """build_py, then the stubs into the built package."""

    def run(self):
        super().run()
        self._stubs = generate(os.path.join(self.build_lib, "logprob_client"))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + list(getattr(self, "_stubs", []))


# Build outputs (build/, *.egg-info) go to a temporary folder, removed when
# this process ends, so that `pip install ./client/python` leaves the
# checkout as it was. `python setup.py build --build-base DIR` still wins.
_SCRATCH = tempfile.mkdtemp(prefix="logprob_client_build_")
atexit.register(shutil.rmtree, _SCRATCH, True)

setup(
    cmdclass={"build_py": BuildPyWithStubs},
    options={"build": {"build_base": os.path.join(_SCRATCH, "build")}, "egg_info": {"egg_base": _SCRATCH}},
)
