#!/usr/bin/env python3
"""Top-k knowledge distillation with a Hugging Face teacher and student.

Two small randomly initialised ``LlamaForCausalLM`` models (config built
here, same vocabulary and hidden size, different seeds: no download), a
"teacher" and a "student", run the same padded batch. Their final hidden
states (the last entry of ``output_hidden_states``, after the final norm) go
to ONE logprob-server that holds both ``lm_head``s as named heads:

    logprob-server --workers 2 --backend cpu \\
        --lm-head teacher=TEACHER.safetensors --lm-head student=STUDENT.safetensors

1. the teacher's top-k: ``score(..., head="teacher", topk=K)`` returns the K
   largest logprobs of each position and their token ids;
2. the student's logprobs at the teacher's ids: ``score(..., head="student",
   gather_indices=teacher_ids)`` returns ``gathered_logprobs`` (docs/SPEC.md:
   logprobs at given ids);
3. the forward KL over the top-k, per token, in torch:
   ``sum_k p_T(k) (log p_T(k) - log p_S(k))``.

Everything is checked against the models' own ``model(...).logits`` in
float64 (log-softmax, ``torch.topk``, gather), and the script prints the
largest difference of the teacher's top-k logprobs, the student's gathered
logprobs and the KL. In a trainer the student's logprobs at the teacher's
ids come from its own forward pass (with gradient); the service's
``gathered_logprobs`` are what an evaluation or a no-gradient loss term uses.

The server is started from ``--bin-dir`` (default: ``build/bin`` of this
repository) and stopped at the end. Run it in the examples' environment
(``bash scripts/setup-examples.sh``: transformers from PyPI, Debian's torch):

    .venv-examples/bin/python examples/distill_topk.py

Exit status 0 when every output is within the tolerance (1e-4, as in
examples/hf_logprobs.py: float32 weights and hidden states, f32 GEMM on the
server), 1 when one is not, 2 when something is missing.
"""

import os
import sys
import tempfile
import time

# first: it sets up the environment
from example_support import (example_parser, have_transformers, save_lm_head, start_server,  # noqa: E402
                             stop_server, tiny_llama, wait_ready)

import torch  # noqa: E402

from logprob_client import LogprobClient  # noqa: E402

TOLERANCE = 1e-4  # float32 weights and hidden states, f32 GEMM on the server (see examples/hf_logprobs.py)


def final_hidden_and_logits(model, input_ids, attention_mask):
    """The model's final hidden states [B, S, H] (the lm_head's input) and
    its logits [B, S, V], without gradient."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1], out.logits


def forward_kl_topk(teacher_topk_logprobs, student_logprobs_at_ids, renormalise_student):
    """Forward KL(teacher || student) over the teacher's top-k, per token:
    sum_k p_T(k) (log p_T(k) - log p_S(k)).

    The teacher's top-k is renormalised over its k entries (log_softmax of
    the k full-vocabulary logprobs: the same as of the k logits), as
    NeMo-RL's DistillationLossFn does with ``teacher_topk_logits``. The
    student: renormalised over the same k ids too (``renormalise_student``,
    NeMo-RL's default ``zero_outside_topk=False``), or its full-vocabulary
    logprobs at those ids (``zero_outside_topk=True``; the forward KL has no
    tail term)."""
    log_pt = torch.log_softmax(teacher_topk_logprobs, dim=-1)
    log_ps = torch.log_softmax(student_logprobs_at_ids, dim=-1) if renormalise_student else student_logprobs_at_ids
    return (log_pt.exp() * (log_pt - log_ps)).sum(-1)


def main():
    parser = example_parser(__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=1031, help="vocabulary size (uneven slices over 2 workers)")
    parser.add_argument("--seq", type=int, default=24, help="padded sequence length")
    parser.add_argument("--topk", type=int, default=8, help="K of the teacher's top-k")
    parser.add_argument("--seed", type=int, default=0, help="teacher seed (the student's is seed + 1)")
    args = parser.parse_args()
    if not have_transformers("distill_topk"):
        return 2

    teacher = tiny_llama(args.seed, args.vocab)
    student = tiny_llama(args.seed + 1, args.vocab)

    # A padded batch, right padding: lengths S, S - 3, S // 2.
    g = torch.Generator().manual_seed(args.seed + 2)
    b, s, k = 3, args.seq, args.topk
    input_ids = torch.randint(0, args.vocab, (b, s), generator=g)
    lengths = torch.tensor([s, s - 3, s // 2])
    attention_mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
    # Position t (row t scores input_ids[:, t + 1]) is scored when t + 1 lies within the sequence.
    scored = torch.arange(s - 1)[None, :] + 1 < lengths[:, None]  # [B, S - 1]

    t_hidden, t_logits = final_hidden_and_logits(teacher, input_ids, attention_mask)
    s_hidden, s_logits = final_hidden_and_logits(student, input_ids, attention_mask)

    with tempfile.TemporaryDirectory(prefix="distill_topk_") as folder:
        heads = {name: save_lm_head(model, os.path.join(folder, name + ".safetensors"))
                 for name, model in (("teacher", teacher), ("student", student))}
        server, address, log_path = start_server(args.bin_dir, heads, folder, "distill_topk")
        try:
            with LogprobClient(address, timeout=120) as client:
                if not wait_ready(client, server, log_path, "distill_topk", "named heads (--lm-head NAME=PATH)"):
                    return 2
                info = client.server_info(refresh=True)
                names = sorted(h.name for h in getattr(info, "lm_heads", []) or [])
                if names != ["student", "teacher"]:
                    print("distill_topk: the server's heads are %s, not teacher and student" % names,
                          file=sys.stderr)
                    return 2
                t0 = time.monotonic()
                # 1. The teacher's top-k logprobs and ids: [B, S - 1, K] each.
                t_res = client.score(hidden_states=t_hidden, input_ids=input_ids, attention_mask=attention_mask,
                                     head="teacher", topk=k)
                teacher_logp, teacher_ids = t_res.topk_logprobs, t_res.topk_indices
                # 2. The student's logprobs at the teacher's ids: [B, S - 1, K].
                s_res = client.score(hidden_states=s_hidden, input_ids=input_ids, attention_mask=attention_mask,
                                     head="student", gather_indices=teacher_ids)
                student_at_ids = s_res.gathered_logprobs
                seconds = time.monotonic() - t0
                assert (t_res.head, s_res.head) == ("teacher", "student"), (t_res.head, s_res.head)
        finally:
            stop_server(server)

    # 3. The forward KL over the teacher's top-k, from the service's outputs.
    kl = forward_kl_topk(teacher_logp.double(), student_at_ids.double(), renormalise_student=True)
    kl_full = forward_kl_topk(teacher_logp.double(), student_at_ids.double(), renormalise_student=False)

    # The reference: each model's logits in float64, next_token alignment.
    ref_t = torch.log_softmax(t_logits.double()[:, :-1], dim=-1)  # [B, S - 1, V]
    ref_s = torch.log_softmax(s_logits.double()[:, :-1], dim=-1)
    ref_t_values, ref_t_ids = ref_t.topk(k, dim=-1)
    ref_kl = forward_kl_topk(ref_t_values, ref_s.gather(-1, ref_t_ids), renormalise_student=True)
    ref_kl_full = forward_kl_topk(ref_t_values, ref_s.gather(-1, ref_t_ids), renormalise_student=False)

    diffs = {
        "teacher top-k logprobs": (teacher_logp.double() - ref_t_values).abs()[scored].max().item(),
        # Top-k ids: the same ids, except where two candidates tie within the
        # tolerance (then either is right): the teacher's float64 logprobs at
        # the service's ids must equal the reference's top-k values.
        "teacher at service ids": (ref_t.gather(-1, teacher_ids) - ref_t_values).abs()[scored].max().item(),
        # The student's logprobs at the ids that were asked for (the service's).
        "student gathered": (student_at_ids.double() - ref_s.gather(-1, teacher_ids)).abs()[scored].max().item(),
        "forward KL": (kl - ref_kl).abs()[scored].max().item(),
        "forward KL (student full)": (kl_full - ref_kl_full).abs()[scored].max().item(),
    }
    same_ids = (teacher_ids == ref_t_ids)[scored].float().mean().item()
    distinct = bool((teacher_ids.sort(-1).values.diff(dim=-1) != 0).all(-1)[scored].all())
    n = scored.sum()
    print("one server, heads %s, 2 CPU workers; teacher top-%d and student gathered logprobs of %d positions "
          "in %.3f s" % (names, k, int(n), seconds))
    print("  forward KL(teacher || student) over the teacher's top-%d, mean per token: %.4f (student renormalised "
          "over the k ids), %.4f (student full-vocabulary logprobs)"
          % (k, (kl * scored).sum() / n, (kl_full * scored).sum() / n))
    print("  teacher's top-%d mass: mean %.3f" % (k, (teacher_logp.double().exp().sum(-1) * scored).sum() / n))
    for what, d in diffs.items():
        print("  max |service - models' logits in float64| %-26s %.3g" % (what, d))
    print("  teacher top-%d ids equal to the reference's: %.1f %% of positions; ids distinct per position: %s"
          % (k, 100 * same_ids, distinct))
    worst = max(diffs.values())
    ok = worst <= TOLERANCE and distinct
    print("largest difference %.3g: %s (tolerance %g)" % (worst, "OK" if ok else "FAILED", TOLERANCE))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
