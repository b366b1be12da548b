"""Listening ports refuse to be shared: a second logprob-server on a busy
port (the API port, or the metrics port) exits non-zero naming it, and the
first keeps serving."""
import os
import subprocess
import unittest

from support import BIN_DIR, Server, free_port


class ExclusivePortTest(unittest.TestCase):
    def test_a_second_server_on_a_busy_port_exits_naming_it(self):
        with Server(metrics=True) as first, first.client() as c:
            cases = [
                (["--listen", first.address], first.address),
                (["--listen", "127.0.0.1:%d" % free_port(), "--metrics-listen",
                  "127.0.0.1:%d" % first.metrics_port], "--metrics-listen"),
            ]
            for flags, named in cases:
                with self.subTest(flags=flags):
                    r = subprocess.run([os.path.join(BIN_DIR, "logprob-server"), "--workers", "1"] + flags,
                                       capture_output=True, text=True, timeout=120)
                    self.assertNotEqual(r.returncode, 0, r.stderr)
                    self.assertIn(named, r.stderr)
                    self.assertIn("in use", r.stderr)
                    self.assertNotIn("SERVING", r.stderr)
            self.assertTrue(c.health(wait=10))


if __name__ == "__main__":
    unittest.main()
