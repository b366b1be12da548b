"""docs/rl-frameworks.md's TRL recipe, run as written, so that the commands
an RL team copies cannot rot (as test_readme.py does for the README's
quick start).

TrlRecipeTest reads the first ``sh`` block of the page's "## TRL" section
and runs its commands from the repository root: the setup line is checked
to be ``bash scripts/setup-trl.sh`` and not run (the ``trl_venv`` fixture
ran it; this interpreter is that environment's), the ``logprob-server``
command (declared heads) in the background, then ``examples/trl_grpo.py``
against it. Only what must differ in a test is replaced: the hub model id
by a tiny local model made here (CI has no hub) and the declared shape by
that model's ``VxH``, the port ``50051`` by a free one (tests run in
parallel), ``build/bin/`` by the binaries under test (``LOGPROB_BIN_DIR``),
``build/python`` by the generated stubs on this ``PYTHONPATH`` and
``.venv-trl/bin/python`` by this interpreter. It checks the example's exit
status (0: the service answered exactly the no-gradient calls, the pushes
as expected), what it printed, the line the adapter logged and the heads
the server holds afterwards (both filled by the adapter's pushes). The
command of its "### Several processes" part (the example in 2 processes
under ``accelerate launch --multi_gpu --num_processes 2``, which on a host
without GPUs runs them on the CPU over gloo, against that server) runs
the same way, ``.venv-trl/bin/accelerate`` being this interpreter's
``accelerate.commands.accelerate_cli``.

Run in the TRL environment (ctest py_trl_TrlRecipeTest).
"""

import os
import re
import shlex
import subprocess
import sys
import unittest

import support  # noqa: F401  (puts client/python on sys.path)
from support import BIN_DIR, SOURCE_ROOT, free_port, temp_dir
import tiny_models

from logprob_client import LogprobClient

DOC = os.path.join(SOURCE_ROOT, "docs", "rl-frameworks.md")
HUB_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
HUB_SHAPE = "151936x896"


def trl_recipe(subsection=None):
    """The commands of the first ``sh`` block of the "## TRL" section, or
    of its ``### subsection`` (continuation lines joined, comments
    dropped)."""
    with open(DOC) as f:
        text = f.read()
    m = re.search(r"^## TRL\n(.*?)(?=^## )", text, re.S | re.M)
    if not m:
        raise AssertionError("docs/rl-frameworks.md has no '## TRL' section")
    section = m.group(1)
    if subsection is not None:
        m = re.search(r"^### %s\n(.*?)(?=^##)" % re.escape(subsection), section, re.S | re.M)
        if not m:
            raise AssertionError("the TRL section has no '### %s'" % subsection)
        section = m.group(1)
    block = re.search(r"^```sh\n(.*?)^```", section, re.S | re.M)
    if not block:
        raise AssertionError("the TRL section has no sh block")
    joined = block.group(1).replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in joined.splitlines() if line.strip()]


def stubs_dir():
    """The folder of the generated Python stubs this run imports."""
    from logprob_client._internal._proto import pb2  # .../logprob/v1/logprob_pb2.py

    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(pb2.__file__))))


class TrlRecipeTest(unittest.TestCase):
    def setUp(self):
        self.dir = temp_dir("trl_recipe")
        self.port = free_port()
        self.model = os.path.join(self.dir, "model")
        tiny_models.save_model("qwen2", self.model, seed=2)
        self.address = "127.0.0.1:%d" % self.port
        self.server = None

    def tearDown(self):
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()

    def adapt(self, command):
        """``command`` with this test's port, binaries, stubs, interpreter and model."""
        shape = "%dx%d" % (tiny_models.VOCAB, tiny_models.HIDDEN)
        command = command.replace(HUB_MODEL, self.model).replace(HUB_SHAPE, shape)
        command = command.replace("127.0.0.1:50051", "127.0.0.1:%d" % self.port)
        command = command.replace("build/bin/", BIN_DIR.rstrip("/") + "/")
        command = command.replace("client/python:build/python", "client/python:" + stubs_dir())
        command = command.replace(".venv-trl/bin/python ", sys.executable + " ")
        command = command.replace(".venv-trl/bin/accelerate ",
                                  sys.executable + " -m accelerate.commands.accelerate_cli ")
        return command

    def start_server(self, server_cmd):
        """The recipe's server command, adapted, in the background; waits
        until it serves and checks its heads are declared, empty."""
        log = open(os.path.join(self.dir, "server.log"), "wb")
        self.server = subprocess.Popen(["bash", "-c", "exec " + self.adapt(server_cmd).rstrip("&").strip()],
                                       cwd=SOURCE_ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        with LogprobClient(self.address) as c:
            self.assertTrue(c.health(wait=90), "the recipe's server did not become SERVING")
            declared = {h.name: h for h in c.lm_heads()}
            self.assertEqual({n: h.version for n, h in declared.items()}, {"policy": "", "reference": ""})

    def run_example(self, command, **env_vars):
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", **env_vars)
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", self.adapt(command)], cwd=SOURCE_ROOT, env=env,
                             capture_output=True, text=True, timeout=240)
        self.assertEqual(out.returncode, 0, "the recipe's example failed:\n%s\n%s"
                         % (out.stdout[-3000:], out.stderr[-5000:]))
        return out

    def policy_versions(self, run):
        """Checks the heads the server holds after a run (policy: run's steps
        2 and 0; reference: pushed)."""
        with LogprobClient(self.address) as c:
            heads = {h.name: h for h in c.lm_heads()}
        self.assertEqual(heads["policy"].version, "%s-step-2" % run)
        self.assertEqual(list(heads["policy"].retained_versions), ["%s-step-2" % run, "%s-step-0" % run])
        self.assertTrue(heads["reference"].version.startswith("ref-"), heads["reference"].version)

    def test_the_recipe_runs_as_written(self):
        commands = trl_recipe()
        self.assertEqual(len(commands), 3, commands)
        setup, server_cmd, example = commands
        self.assertEqual(setup, "bash scripts/setup-trl.sh")
        # The server as written: declared heads of the hub model's shape, full build/bin path.
        self.assertTrue(server_cmd.startswith("build/bin/logprob-server "), server_cmd)
        self.assertTrue(server_cmd.endswith("&"), server_cmd)
        self.assertIn("--lm-head-declare policy=%s:" % HUB_SHAPE, server_cmd)
        self.assertIn("--lm-head-declare reference=%s:" % HUB_SHAPE, server_cmd)
        self.assertIn("--model %s" % HUB_MODEL, example)
        self.assertIn("--bf16", example)

        self.start_server(server_cmd)
        out = self.run_example(example)
        self.assertIn("answered by the service: {'policy': 2, 'reference': 2}; policy pushes: 2", out.stdout)
        logged = [line for line in out.stderr.splitlines() if line.startswith("logprob_client.trl: ")]
        self.assertEqual(len(logged), 1, out.stderr[-3000:])
        run = re.search(r"pushed as '([0-9a-f]{8})-step-\{step\}'", logged[0]).group(1)
        self.policy_versions(run)
        self.assertIn(shlex.quote("{run}-step-{step}"), example)

    def test_several_processes_as_written(self):
        """The "Several processes" command: the example in 2 DDP processes
        under ``accelerate launch`` (gloo: no GPUs here) against the
        recipe's server."""
        (command,) = trl_recipe("Several processes")
        words = " ".join(command.split())
        self.assertIn(".venv-trl/bin/accelerate launch --multi_gpu --num_processes 2 ", words)
        self.assertIn("examples/trl_grpo.py --server 127.0.0.1:50051", words)
        self.assertIn("--model %s" % HUB_MODEL, words)
        self.start_server(trl_recipe()[1])
        out = self.run_example(command, CUDA_VISIBLE_DEVICES="")  # the CPU, also on a host with one GPU
        for rank in range(2):
            self.assertIn("[rank %d] answered by the service: {'policy': 2, 'reference': 2}; policy pushes: 2"
                          % rank, out.stdout)
        logged = [line for line in out.stderr.splitlines() if "logprob_client.trl: " in line]
        self.assertEqual(len(logged), 2, out.stderr[-3000:])
        runs = {re.search(r"pushed as '([0-9a-f]{8})-step-\{step\}'", line).group(1) for line in logged}
        self.assertEqual(len(runs), 1, logged)  # rank 0's run id on both ranks
        self.assertTrue(all("2 processes: each push is a collective" in line for line in logged), logged)
        self.policy_versions(runs.pop())


if __name__ == "__main__":
    unittest.main()
