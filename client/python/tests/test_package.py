"""``pip install ./client/python`` into a fresh virtual environment (with
Debian's grpcio / protobuf / numpy as system site packages, offline: no
build isolation, no index), then the installed package, outside the source
tree and without PYTHONPATH, scores a golden case against a live server,
with the sync and the asyncio client."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import unittest

import numpy as np

import support
from support import Golden, Server, compare, temp_dir

# Run by the venv's interpreter: score one golden case, print the outputs as JSON.
SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import logprob_client
    from logprob_client import LogprobClient, aio, safetensors

    address, case = sys.argv[1], sys.argv[2]
    inputs, meta = safetensors.load(case)
    kw = dict(logits=inputs["logits"], input_ids=inputs["input_ids"], dtype="bf16", cu_seqlens=inputs["cu_seqlens"],
              topk=int(meta.get("topk") or 0))
    kw.update(json.loads(sys.argv[3]))  # the golden case's per-token extras (log_sum_sq_probs, ...)
    with LogprobClient(address) as c:
        sync = c.score(**kw)

    async def run():
        async with aio.LogprobClient(address) as c:
            return await c.score(**kw)

    res = asyncio.run(run())
    print(json.dumps({
        "module": logprob_client.__file__,
        "stubs": logprob_client.logprob_pb2.__name__,
        "sync": {k: v.tolist() for k, v in sync.outputs.items()},
        "aio": {k: v.tolist() for k, v in res.outputs.items()},
    }))
    """
)


class PackageTest(unittest.TestCase):
    def test_pip_install_into_a_fresh_venv_and_score(self):
        d = temp_dir("pyclient_package")
        self.addCleanup(shutil.rmtree, d, True)
        # A copy of what a checkout holds (client/python and proto/), so that
        # the test can tell that installing writes nothing into it.
        src = os.path.join(d, "src")
        shutil.copytree(os.path.join(support.SOURCE_ROOT, "client", "python"), os.path.join(src, "client", "python"),
                        ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "_generated", "tests"))
        shutil.copytree(os.path.join(support.SOURCE_ROOT, "proto"), os.path.join(src, "proto"))
        venv = os.path.join(d, "venv")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LOGPROB_", "PIP_"))}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

        def run(*cmd, cwd=d):
            out = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            self.assertEqual(out.returncode, 0, "%s:\n%s\n%s" % (" ".join(cmd), out.stdout[-3000:], out.stderr[-3000:]))
            return out.stdout

        run(sys.executable, "-m", "venv", "--system-site-packages", venv)
        python = os.path.join(venv, "bin", "python")
        # Offline: setuptools / wheel / the dependencies are Debian's (system site packages).
        before = sorted(os.listdir(os.path.join(src, "client", "python")))
        run(python, "-m", "pip", "install", "--no-build-isolation", "--no-index", os.path.join(src, "client", "python"))
        # The install leaves the checkout as it was: no build/, no *.egg-info (setup.py builds in a temporary folder).
        self.assertEqual(sorted(os.listdir(os.path.join(src, "client", "python"))), before)

        g = Golden("packed_bf16")
        server = Server(workers=1)
        self.addCleanup(server.close)
        case = os.path.join(support.GOLDEN_DIR, "packed_bf16.safetensors")
        extras = {k: v for k, v in g.options.items() if k in ("log_sum_sq_probs", "mean_logits", "is_top1")}
        got = json.loads(run(python, "-c", SCRIPT, server.address, case, json.dumps(extras), cwd=venv).splitlines()[-1])
        self.assertTrue(got["module"].startswith(venv), got["module"])
        self.assertEqual(got["stubs"], "logprob_client._generated.logprob_pb2")
        for which in ("sync", "aio"):
            outputs = {k: np.asarray(got[which][k], dtype=e.dtype) for k, e in g.expected.items() if k in got[which]}
            self.assertEqual(compare(g.expected, outputs), "", which)
        # The package carries its type information.
        site = run(python, "-c", "import logprob_client, os; print(os.path.dirname(logprob_client.__file__))").strip()
        self.assertTrue(os.path.isfile(os.path.join(site, "py.typed")))


if __name__ == "__main__":
    unittest.main()
