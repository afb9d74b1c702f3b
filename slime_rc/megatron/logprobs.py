"""Log-probs of the target tokens from vocab-sharded logits, without gathering the vocabulary.

Under tensor parallelism each rank holds logits ``[..., V / tp]`` for its slice of the vocabulary
``[rank * V/tp, (rank + 1) * V/tp)``.  With ``z = logits / temperature`` (the rollout engine's temperature, so both
sides score the same distribution):

    log p(t) = z_t - m - log sum_v exp(z_v - m),      m = max_v z_v   (max over all shards, no gradient)

Two sums cross the shards — ``sum exp`` and the target logit (non-zero on exactly one shard) — each one all-reduce
with an identity backward (Megatron's ``reduce_from_tensor_model_parallel_region``), so every rank gets the gradient
for its own shard.  Nothing is modified in place (``vocab_parallel_cross_entropy`` overwrites fp32 logits).
"""

from __future__ import annotations

import torch


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, *,
                             with_entropy: bool = False):
    """``logits [..., V_local]`` (this rank's vocab shard), ``target [...]`` global token ids -> ``[...]`` float32
    log-probs.  Uses megatron-core's tensor-parallel group when it is initialized with size > 1.

    ``with_entropy``: also the entropy of each position's distribution over the whole vocabulary, ``H = log S -
    U / S`` with ``S = sum exp(z - m)``, ``U = sum exp(z - m) (z - m)`` (one more all-reduce, identity backward):
    returns ``(log_probs, entropy)``."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (use the rollout engine's sampling temperature)")
    z = logits.float() / temperature
    tp_size, tp_rank, group = _tensor_parallel()
    v_local = z.shape[-1]
    with torch.no_grad():
        m = z.max(dim=-1).values
        if tp_size > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted = z - m.unsqueeze(-1)
    start = tp_rank * v_local
    in_shard = (target >= start) & (target < start + v_local)
    local = torch.where(in_shard, target - start, torch.zeros_like(target))
    target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_shard
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    weighted = (exp * shifted).sum(dim=-1) if with_entropy else None
    if tp_size > 1:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
        target_logit = reduce_from_tensor_model_parallel_region(target_logit)
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        if with_entropy:
            weighted = reduce_from_tensor_model_parallel_region(weighted)
    log_probs = target_logit - sum_exp.log()
    if with_entropy:
        return log_probs, sum_exp.log() - weighted / sum_exp
    return log_probs


def _tensor_parallel():
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            size = ps.get_tensor_model_parallel_world_size()
            if size > 1:
                return size, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    except ImportError:
        pass
    return 1, 0, None
