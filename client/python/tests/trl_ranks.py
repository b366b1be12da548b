"""One rank of a 2-process GRPO job (``torchrun --nproc_per_node 2``, gloo,
CPU), run by test_trl_ranks.GrpoDdpTest: GRPO (test_trl.run_grpo: 3
steps, num_iterations 2, beta 0.1) with the service, then the same
without it; writes ``OUT/rank<R>.json``: each run's logged loss and KL,
the routed calls (head, version, tokens), pushes, run id, the
no-gradient calls that reached TRL's kernel, and the line use_service
logged.

Usage: trl_ranks.py OUT_DIR MODEL_DIR SERVER_ADDRESS
"""

import json
import logging
import os
import sys

from logprob_client import LogprobClient

import test_trl


class Lines(logging.Handler):
    """Keeps the messages logged."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def summary(trainer, log, adapter):
    return {
        "steps": [{"loss": h["loss"], "kl": h["kl"]} for h in test_trl.step_logs(trainer)],
        "no_grad_in_trl": sum(1 for r in log.records if r["no_grad"] and r["reached_trl"]),
        "no_grad": sum(1 for r in log.records if r["no_grad"]),
        "calls": [] if adapter is None else [[c.head, c.version, c.tokens] for c in adapter.calls],
        "routed": {} if adapter is None else dict(adapter.routed),
        "pushes": None if adapter is None else adapter.pushes,
        "run": None if adapter is None else adapter.run,
        "policy_version": None if adapter is None else adapter.policy_version,
    }


def main():
    out_dir, model_dir, address = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    lines = Lines()
    logging.getLogger("logprob_client.trl").addHandler(lines)
    logging.getLogger("logprob_client.trl").setLevel(logging.INFO)
    with LogprobClient(address, timeout=120) as client:
        service = test_trl.run_grpo(model_dir, os.path.join(out_dir, "service"), False, client)
    plain = test_trl.run_grpo(model_dir, os.path.join(out_dir, "plain"), True)
    out = {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "logged": lines.messages,
           "service": summary(*service[:3]), "plain": summary(*plain[:3])}
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
