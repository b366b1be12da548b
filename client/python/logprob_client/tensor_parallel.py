"""One lm_head update sent by every rank of a tensor-parallel group, each its
own vocabulary shard (docs/lm-head-updates.md, "Tensor-parallel senders"),
over ``torch.distributed``: rank 0 of the group begins the update and
broadcasts its handle (``broadcast_object_list``: the update id, the
update's capability, reaches the group's ranks only), every rank puts its
rows with its own client, the ranks gather their outcomes (the barrier),
and rank 0 commits, or aborts when any put failed. Every rank returns the
committed version or raises the same error.

Example (Megatron-style vocabulary-parallel ``lm_head``: rank r holds rows
``[r * V / tp, (r + 1) * V / tp)``)::

    from logprob_client import LogprobClient
    from logprob_client.tensor_parallel import push_lm_head_shard

    client = LogprobClient("logprob:50051")          # one per rank
    shard = model.lm_head.weight.detach()            # this rank's [V / tp, H]
    version = push_lm_head_shard(client, shard, row_begin=tp_rank * shard.shape[0], vocab_size=V,
                                 version="step-%d" % step, head="policy", group=tp_group,
                                 src=tp_group_first_global_rank)
"""

from typing import Any, List, Optional

from ._internal.ranks import attempt, value
from .client import LogprobClient

__all__ = ["push_lm_head_shard"]


def push_lm_head_shard(client: LogprobClient, shard: Any, row_begin: int, vocab_size: int, version: str,
                       head: str = "policy", group: Any = None, src: int = 0, sha256: Optional[str] = None,
                       timeout: Any = "default") -> str:
    """Sends ``shard`` (``[n, H]``: torch tensor on the CPU or a GPU, or a
    numpy array) as rows ``[row_begin, row_begin + n)`` of ``head``'s
    ``[vocab_size, H]`` weight, version ``version``, together with the
    other ranks of ``group`` (a ``torch.distributed`` process group; None:
    the default group), which call it at the same time with their shards;
    the shards must cover ``[0, vocab_size)`` exactly once (leave out the
    padding rows of a padded vocabulary). ``src``: the global rank of the
    group's rank 0, which begins and commits (0 for the default group).
    The weight's dtype is rank 0's shard's (other ranks' shards are
    converted to it). ``sha256`` (of the whole weight) is checked at the
    commit. Returns the committed version on every rank. Raises
    LogprobError on every rank (the same code and message) when the
    update failed; a failed put aborts the update (the current version
    keeps serving). Blocking, collective: every rank of the group must
    call it."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    outcome: List[Any] = [None]
    if rank == 0:
        outcome[0] = attempt(lambda: client.begin_lm_head_update(
            head, version=version, vocab_size=vocab_size, hidden_size=int(shard.shape[1]), dtype=shard.dtype,
            sha256=sha256, timeout=timeout))
    dist.broadcast_object_list(outcome, src=src, group=group)
    update = value(outcome[0])
    put = attempt(lambda: client.put_lm_head_rows(update, row_begin, shard, timeout=timeout))
    puts: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(puts, put, group=group)  # every rank has put its rows (or failed)
    if rank == 0:
        failed = [(r, p) for r, p in enumerate(puts) if p[0] != "ok"]
        if failed:
            attempt(lambda: client.abort_lm_head_update(update, timeout=timeout))
            r, (_, code, message) = failed[0]
            outcome[0] = ("error", code, "rank %d of the tensor-parallel group: %s" % (r, message))
        else:
            outcome[0] = attempt(lambda: client.commit_lm_head_update(update, timeout=timeout))
    dist.broadcast_object_list(outcome, src=src, group=group)
    return str(value(outcome[0]))
