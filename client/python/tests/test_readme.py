"""The README's quick start, run as written against a live server, so the
first commands a newcomer copies cannot rot.

ReadmeQuickStartTest reads README.md's "Quick start" section and runs its
code blocks in order from the repository root: the ``sh`` block that starts
``logprob-server``, the ``python`` snippet (saved as ``quickstart.py`` and
run with ``PYTHONPATH=client/python``, as the README's next block says),
and the ``sh`` block of the command-line client. Only what must differ in
a test is replaced: the port ``50051`` by a free one (tests run in
parallel), ``build/bin/`` by the binaries under test (``LOGPROB_BIN_DIR``),
``/tmp/scores.safetensors`` by a temporary file and ``python3`` (and the
README's ``/usr/bin/python3``) by this interpreter. It checks each step's
exit status and what it printed or wrote: the snippet's ``[2, 31]``
logprobs and its top-k ids, the CLI's outputs against the golden case's
expected token logprobs, and that the snippet stops with its message when
``health()`` answers False.
"""

import os
import re
import subprocess
import sys
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import BIN_DIR, GOLDEN_DIR, SOURCE_ROOT, compare, free_port, temp_dir

from logprob_client import LogprobClient, safetensors

README = os.path.join(SOURCE_ROOT, "README.md")


def quick_start_blocks():
    """``[(language, code)]`` of the fenced blocks of README.md's "Quick
    start" section, in order."""
    with open(README) as f:
        text = f.read()
    m = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        raise AssertionError("README.md has no '## Quick start' section")
    return re.findall(r"^```(\w+)\n(.*?)^```", m.group(1), re.S | re.M)


class ReadmeQuickStartTest(unittest.TestCase):
    def setUp(self):
        self.dir = temp_dir("readme")
        self.port = free_port()
        self.server = None

    def tearDown(self):
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()

    def adapt(self, code):
        """``code`` with this test's port, binaries, output file and python."""
        code = code.replace("127.0.0.1:50051", "127.0.0.1:%d" % self.port)
        code = code.replace("build/bin/", BIN_DIR.rstrip("/") + "/")
        code = code.replace("/tmp/scores.safetensors", os.path.join(self.dir, "scores.safetensors"))
        return re.sub(r"(?<![\w/])python3 ", sys.executable + " ", code)

    def run_sh(self, code, timeout=180):
        return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=SOURCE_ROOT, capture_output=True,
                              text=True, timeout=timeout)

    def test_the_quick_start_runs_as_written(self):
        blocks = quick_start_blocks()
        langs = [lang for lang, _ in blocks]
        self.assertEqual(langs[:4], ["sh", "python", "sh", "sh"], "the Quick start's blocks changed: %s" % langs)
        (_, server_cmd), (_, snippet), (_, run_snippet), (_, cli) = blocks[:4]

# 1. The server, in the background(the README leaves it running).
        self.assertIn("logprob-server", server_cmd)
        log = open(os.path.join(self.dir, "server.log"), "wb")
        self.server = subprocess.Popen(["bash", "-c", "exec " + self.adapt(server_cmd).replace("\\\n", " ")],
                                       cwd=SOURCE_ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()

# 2. The Python snippet as quickstart.py, run as the README says
#(from the repository root, PYTHONPATH = client / python).
        with open(os.path.join(SOURCE_ROOT, "quickstart.py"), "w") as f:
            f.write(snippet.replace("127.0.0.1:50051", "127.0.0.1:%d" % self.port))
        self.addCleanup(os.remove, os.path.join(SOURCE_ROOT, "quickstart.py"))
        env_line = run_snippet.strip().split("#")[0].strip()
        # Debian's python3 by its path: a python3 of pyenv or conda on PATH lacks grpcio.
        self.assertRegex(env_line, r"^PYTHONPATH=client/python /usr/bin/python3 quickstart\.py$")
        env_line = env_line.replace("/usr/bin/python3 ", sys.executable + " ")
        out = self.run_sh(self.adapt(env_line))
        self.assertEqual(out.returncode, 0, "quickstart.py failed:\n%s\n%s" % (out.stdout, out.stderr))
#print(res.token_logprobs.shape, res.entropy.mean(), res.topk_indices[0, 0])
        self.assertRegex(out.stdout, r"torch\.Size\(\[2, 31\]\) tensor\(-?\d+\.\d+.*\) tensor\(\[\s*\d+(,\s+\d+){3}\]")

# 3. The command - line client : health, then score a golden file.
        out = self.run_sh(self.adapt(cli))
        self.assertEqual(out.returncode, 0, "the CLI block failed:\n%s\n%s" % (out.stdout, out.stderr))
        written = re.search(r"--output (\S+)", self.adapt(cli)).group(1)
        tensors, _ = safetensors.load(written)
        expected, _ = safetensors.load(os.path.join(GOLDEN_DIR, "hidden_bf16.expected.safetensors"))
        got = {"token_logprobs": np.asarray(tensors["token_logprobs"])}
        self.assertEqual(compare({"token_logprobs": expected["token_logprobs"]}, got), "")
        self.assertIn("entropy", tensors)
        self.assertEqual(np.asarray(tensors["topk_indices"]).shape[-1], 8)

# The snippet checks health()'s answer: against a port nothing listens on
# it stops with its message (wait shortened from 60 s).
        with open(os.path.join(SOURCE_ROOT, "quickstart.py"), "w") as f:
            dead = "127.0.0.1:%d" % free_port()
            self.assertIn("client.health(wait=60)", snippet)
            f.write(snippet.replace("127.0.0.1:50051", dead).replace("client.health(wait=60)", "client.health(wait=1)"))
        out = self.run_sh(env_line)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("no logprob-server SERVING at %s" % dead, out.stderr)
        # Its own message, not an exception out of the snippet. (grpc 1.51's
        # connectivity thread may print a traceback of its own when the
        # channel closes right after the wait: not the snippet's.)
        self.assertNotIn("quickstart.py", out.stderr)

#The server the README started answers health.
        with LogprobClient("127.0.0.1:%d" % self.port) as c:
            self.assertTrue(c.health(wait=10))


if __name__ == "__main__":
    unittest.main()
