#!/usr/bin/env python3
"""The server's and the worker's layers, checked: each folder of server/
(a room) may include only the rooms below it, and nothing of the server
includes client/ (the CLI), a gRPC header below transport, or the worker
(but app, which may include worker/kernels/ to choose the pool's CPU
kernel); each folder of
worker/ likewise (comm <- scoring <- heads <- the service at worker/'s top;
cuda/ and kernels/ implement the seams), and the worker includes neither
server/ nor client/. The rooms and their allowed dependencies are written
once, here; server/CMakeLists.txt and worker/CMakeLists.txt link the same
libraries (a room's library links exactly the rooms listed for it).

    python3 scripts/check_layers.py [ROOT]     exit 1 naming each violation

The lint step runs it (scripts/lint.sh); ctest's layers_lint runs it on
the tree and on a copy with a deliberate wrong include, which must fail.
"""
import os
import re
import sys

# room -> the rooms it may include (besides itself and common/, proto).
ALLOWED = {
    "app": {"transport", "core", "inputs", "pool", "heads", "metrics"},
    "transport": {"core", "inputs", "pool", "heads", "metrics"},
    "core": {"inputs", "pool", "heads"},  # metrics through observers (CoreObservers)
    "inputs": set(),
    "heads": {"inputs"},
    "pool": set(),
    "metrics": set(),
}
# Rooms whose files may include gRPC headers: the public port (transport),
# the internal plane (pool: workers' stubs, the control service) and the
# wiring (app). The scoring core, its inputs, the heads and the metrics are
# transport-free.
GRPC_ROOMS = {"app", "transport", "pool"}

# worker room -> the worker rooms it may include ("." : the files at
# worker/'s top: main, the service, the backend factory, may include all).
WORKER_ALLOWED = {
    ".": {"comm", "scoring", "heads", "cuda", "kernels", "gradients"},
    "gradients": {"scoring", "comm", "kernels"},
    "heads": {"scoring", "comm", "kernels"},
    "scoring": {"comm", "kernels"},
    "comm": {"kernels"},
    "cuda": {"scoring", "comm", "kernels"},
    "kernels": set(),
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def violations(root):
    """Every violation under ROOT/server, as 'file:line: message'."""
    out = []
    server = os.path.join(root, "server")
    for dirpath, _, names in os.walk(server):
        rel_dir = os.path.relpath(dirpath, server)
        for name in sorted(names):
            if not name.endswith((".h", ".cc")):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel_dir == ".":
                out.append("%s: a server file outside the rooms (%s)" % (rel, ", ".join(sorted(ALLOWED))))
                continue
            room = rel_dir.split(os.sep)[0]
            if room not in ALLOWED:
                out.append("%s: unknown room server/%s (scripts/check_layers.py ALLOWED)" % (rel, room))
                continue
            text = open(path, encoding="utf-8").read()
            for m in INCLUDE.finditer(text):
                target = m.group(1)
                line = text.count("\n", 0, m.start()) + 1
                where = "%s:%d" % (rel, line)
                if target.startswith("client/"):
                    out.append("%s: server/%s includes %s: the server does not depend on the CLI" % (where, room, target))
                elif target.startswith("server/"):
                    other = target.split("/")[1]
                    if other != room and other not in ALLOWED[room]:
                        out.append("%s: server/%s may not include %s (server/%s may include: %s)" %
                                   (where, room, target, room, ", ".join(sorted(ALLOWED[room])) or "none"))
                elif target.startswith("worker/") and not (room == "app" and target.startswith("worker/kernels/")):
                    out.append("%s: server/%s includes %s: of the worker, only server/app includes its kernels "
                               "(the pool's CPU kernel choice)" % (where, room, target))
                elif target.startswith("grpcpp/") and room not in GRPC_ROOMS:
                    out.append("%s: server/%s includes %s: no gRPC type below transport" % (where, room, target))
    return out + worker_violations(root)


def worker_violations(root):
    """Every violation under ROOT/worker, as 'file:line: message'."""
    out = []
    worker = os.path.join(root, "worker")
    for dirpath, _, names in os.walk(worker):
        rel_dir = os.path.relpath(dirpath, worker)
        room = rel_dir.split(os.sep)[0]
        for name in sorted(names):
            if not name.endswith((".h", ".cc", ".cu", ".cuh")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if room not in WORKER_ALLOWED:
                out.append("%s: unknown room worker/%s (scripts/check_layers.py WORKER_ALLOWED)" % (rel, room))
                continue
            text = open(os.path.join(dirpath, name), encoding="utf-8").read()
            for m in INCLUDE.finditer(text):
                target = m.group(1)
                where = "%s:%d" % (rel, text.count("\n", 0, m.start()) + 1)
                if target.startswith(("server/", "client/")):
                    out.append("%s: the worker includes %s: it depends on neither the server nor the CLI" %
                               (where, target))
                elif target.startswith("worker/"):
                    parts = target.split("/")
                    other = parts[1] if len(parts) > 2 else "."
                    if other != room and other not in WORKER_ALLOWED[room]:
                        out.append("%s: worker/%s may not include %s (worker/%s may include: %s)" %
                                   (where, room, target, room, ", ".join(sorted(WORKER_ALLOWED[room])) or "none"))
    return out


def main(argv):
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    found = violations(root)
    for v in found:
        print(v, file=sys.stderr)
    if found:
        print("check_layers: %d include(s) against the layers (docs/architecture.md)" % len(found),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
