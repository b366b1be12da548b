"""A RayJob driver (deploy/ray/rayjob.yaml): starts the scoring service in the
job's Ray cluster, one worker per GPU in a placement group, fills a head
declared by shape from the driver, scores with it, updates it, and stops.
A trainer does the same around its optimizer steps (docs/deployment.md "Ray").

    python driver.py --workers 2 --backend cuda --vocab 151936 --hidden 4096
"""

import argparse

import numpy as np

import ray
from logprob_client.ray import DeclaredHead, LogprobService
from logprob_client import float32_to_bf16_bits


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backend", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--placement", default="PACK")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()

    ray.init()  # the RayJob's cluster
    service = LogprobService.start(workers=args.workers, backend=args.backend, placement=args.placement,
                                   heads={"policy": DeclaredHead(args.vocab, args.hidden, "bf16")})
    try:
        service.wait_ready(900)
        rng = np.random.default_rng(0)
        h = rng.standard_normal((64, args.hidden)).astype(np.float32)
        ids = rng.integers(0, args.vocab, 64)
        with service.client(timeout=600) as client:
            for step in range(2):  # a trainer: its lm_head after each optimizer step
                weight = rng.standard_normal((args.vocab, args.hidden)).astype(np.float32) * 0.02
                version = client.update_lm_head("policy", float32_to_bf16_bits(weight), dtype="bf16",
                                                version="step-%d" % step)
                res = client.score(hidden_states=h, input_ids=ids, cu_seqlens=np.array([0, 32, 64]), head="policy",
                                   entropy=True)
                print("version %s: mean token logprob %.4f, mean entropy %.4f"
                      % (version, float(res.token_logprobs.mean()), float(res.entropy.mean())), flush=True)
    finally:
        service.stop()


if __name__ == "__main__":
    main()
