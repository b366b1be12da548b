#!/usr/bin/env python3
"""scripts/check_layers.py on the tree (no violation) and on copies of
server/ with a deliberate wrong include each (which must be found, named by
file and line): core -> transport, anything -> client/, a gRPC header in
the core, and a file outside the rooms."""
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

    def test_each_wrong_include_is_found(self):
        cases = [
            ("core/scoring_core.cc", '#include "server/transport/auth.h"', "server/core may not include"),
            ("heads/lm_heads.cc", '#include "server/core/admission.h"', "server/heads may not include"),
            ("pool/worker_pool.cc", '#include "server/core/planner.h"', "server/pool may not include"),
            ("transport/auth.cc", '#include "client/commands.h"', "does not depend on the CLI"),
            ("core/batcher.cc", '#include "grpcpp/channel.h"', "no gRPC type below transport"),
        ]
        for rel, line, message in cases:
            with self.subTest(rel=rel, line=line), tempfile.TemporaryDirectory() as tmp:
                shutil.copytree(os.path.join(ROOT, "server"), os.path.join(tmp, "server"))
                path = os.path.join(tmp, "server", rel)
                text = open(path).read()
                open(path, "w").write(line + "\n" + text)
                r = run(tmp)
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn("server/%s:1: " % rel, r.stderr)
                self.assertIn(message, r.stderr)

    def test_a_file_outside_the_rooms_is_found(self):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(os.path.join(ROOT, "server"), os.path.join(tmp, "server"))
            open(os.path.join(tmp, "server", "loose.cc"), "w").write("int x;\n")
            r = run(tmp)
            self.assertEqual(r.returncode, 1)
            self.assertIn("server/loose.cc: a server file outside the rooms", r.stderr)


if __name__ == "__main__":
    unittest.main()
