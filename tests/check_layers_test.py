#!/usr/bin/env python3
"""scripts/check_layers.py on the tree (no violation) and on copies of
server/ and worker/ with a deliberate wrong include each (which must be
found, named by file and line): core -> transport, anything -> client/, a
gRPC header in the core, a file outside the rooms; comm -> scoring,
scoring -> heads, heads -> the service, the worker -> server/."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CHECK = os.path.join(ROOT, "scripts", "check_layers.py")


def run(root):
    return subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)


class CheckLayersTest(unittest.TestCase):
    def test_the_tree_keeps_its_layers(self):
        r = run(ROOT)
        self.assertEqual(r.returncode, 0, r.stderr)

    def assert_found(self, top, rel, line, message):
        """A copy of TOP/ (server or worker) with `line` put first in REL is refused, at REL:1, with `message`."""
        with self.subTest(top=top, rel=rel, line=line), tempfile.TemporaryDirectory() as tmp:
            for d in ("server", "worker"):
                if d == top:
                    shutil.copytree(os.path.join(ROOT, d), os.path.join(tmp, d))
                else:
                    os.makedirs(os.path.join(tmp, d))
            path = os.path.join(tmp, top, rel)
            text = open(path).read()
            open(path, "w").write(line + "\n" + text)
            r = run(tmp)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("%s/%s:1: " % (top, rel), r.stderr)
            self.assertIn(message, r.stderr)

    def test_each_wrong_include_is_found(self):
        for rel, line, message in [
            ("core/scoring_core.cc", '#include "server/transport/auth.h"', "server/core may not include"),
            ("core/scoring_core.cc", '#include "server/metrics/metrics.h"', "server/core may not include"),
            ("heads/lm_heads.cc", '#include "server/core/admission.h"', "server/heads may not include"),
            ("pool/worker_pool.cc", '#include "server/core/planner.h"', "server/pool may not include"),
            ("transport/auth.cc", '#include "client/commands.h"', "does not depend on the CLI"),
            ("core/batcher.cc", '#include "grpcpp/channel.h"', "no gRPC type below transport"),
            ("core/batcher.cc", '#include "worker/kernels/lm_head_gemm.h"', "only server/app includes its kernels"),
            ("app/main.cc", '#include "worker/scoring/backend.h"', "only server/app includes its kernels"),
        ]:
            self.assert_found("server", rel, line, message)

    def test_each_wrong_worker_include_is_found(self):
        for rel, line, message in [
            ("comm/communicator.cc", '#include "worker/scoring/backend.h"', "worker/comm may not include"),
            ("scoring/scorer.cc", '#include "worker/heads/lm_head_registry.h"', "worker/scoring may not include"),
            ("heads/lm_head_registry.cc", '#include "worker/worker_service.h"', "worker/heads may not include"),
            ("scoring/scorer.cc", '#include "server/core/planner.h"', "depends on neither the server"),
        ]:
            self.assert_found("worker", rel, line, message)

    def test_a_file_outside_the_rooms_is_found(self):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(os.path.join(ROOT, "server"), os.path.join(tmp, "server"))
            open(os.path.join(tmp, "server", "loose.cc"), "w").write("int x;\n")
            r = run(tmp)
            self.assertEqual(r.returncode, 1)
            self.assertIn("server/loose.cc: a server file outside the rooms", r.stderr)


if __name__ == "__main__":
    unittest.main()
