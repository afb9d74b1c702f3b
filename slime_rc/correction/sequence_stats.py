"""Stage 2 of the engine: per-sequence statistics, combined over the sequence group (collective 1).

Each rank sums its own tokens of each sequence (:func:`local_sequence_sums`, part of stage 1's reductions;
``segment_sums``: every column at once, ``k x [N] -> [k, B]``, float64) into the columns of :class:`SequenceSums`,
and takes the per-sequence max of the k2/k3 terms that a ``max`` criterion needs; :func:`sequence_statistics`: the
reducer's ``combine_sequences`` adds the sums and maxes the maxima over the ranks holding pieces of the same
sequences (the context-parallel group).  Every rank of the group then holds bit-identical ``[B]`` statistics, from
which the per-sequence means follow: ``T = max(n, 1)``, ``S / T``, mean log pi_train ``(S + sum log pi_rollout) / T``
and mean log pi_rollout.  Only ``O(B)`` values cross ranks.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.packed import segment_max, segment_sums
from slime_rc.correction.records import PackedBatch, SequenceStats, SequenceSums, TokenReductions, TokenStats, \
    leaves, with_leaves
from slime_rc.correction.reducer import LocalReducer


def local_sequence_sums(batch: PackedBatch, tokens: TokenStats) -> Tuple[SequenceSums, Dict[str, torch.Tensor]]:
    """This rank's per-sequence sums of its :class:`TokenStats` columns (:class:`SequenceSums`, ``[B]`` each) and
    option -> ``[B]`` maxima of the k2/k3 terms that a ``max`` criterion needs (part of stage 1's reductions)."""
    # the [N] columns, in SequenceSums field order; whether a column exists depends only on the config, so every
    # rank sends the same columns
    layout = SequenceSums(
        valid_tokens=tokens.valid,
        log_ratio=tokens.log_ratio,
        rollout_log_prob=tokens.rollout_log_probs,
        nonfinite_tokens=tokens.nonfinite,
        veto_tokens=tokens.veto,
        rs_token_rejections=dict(tokens.rs_token),
        is_mask_tokens=tokens.is_mask,
        rs_token_rejected=tokens.rs_rejected,
        token_rejected=tokens.rejected,
        is_weight=tokens.is_weight,
        k_sums=dict(tokens.k_sum_terms),
    )
    # [k, B], in field order.  Compiled, only sum log pi_rollout is summed in float32 blocks (see segment_sums):
    # S = sum log r is signed (and exponentiated at sequence level), and the per-sequence means of the token weights
    # and of k2/k3 have metrics that are standard deviations over sequences, which cancel what the sums share
    exact = (tokens.log_ratio,) + tuple(t for t in (tokens.is_weight, *tokens.k_sum_terms.values()) if t is not None)
    local_sums = segment_sums(leaves(layout), batch.cu_seqlens, tokens.counts, exact=exact)
    maxes: Dict[str, torch.Tensor] = {}
    if tokens.k_max_terms:
        seq_of = batch.sequence_ids.long()  # scatter_reduce_ takes int64 indices: converted once for every column
        maxes = {option: segment_max(v, seq_of, batch.n_seqs) for option, v in tokens.k_max_terms.items()}
    return with_leaves(layout, local_sums.unbind()), maxes


def sequence_statistics(batch: PackedBatch, reductions: TokenReductions, config: RolloutCorrectionConfig,
                        reducer: LocalReducer) -> SequenceStats:
    """Stage 2 (collective 1): :class:`SequenceStats` from this rank's reduced token columns."""
    n_seqs, dev = batch.n_seqs, batch.device
    local = reductions.local
    local_sums = torch.stack(leaves(local), 1)  # [B, k], the collective's layout
    if reductions.k_maxes:
        local_maxes = torch.stack(list(reductions.k_maxes.values()), 1)
    else:
        local_maxes = torch.zeros(n_seqs, 0, dtype=torch.float64, device=dev)
    sums, maxes = reducer.combine_sequences(local_sums, local_maxes)
    total = with_leaves(local, sums.unbind(1))

    n = total.valid_tokens
    n_safe = n.clamp(min=1)
    return SequenceStats(
        sums=total,
        k_maxes=dict(zip(reductions.k_maxes, maxes.unbind(1))),
        local=local,
        has_tokens=n > 0,
        valid_tokens_min1=n_safe,
        log_ratio_mean=total.log_ratio / n_safe,
        train_log_prob_mean=(total.log_ratio + total.rollout_log_prob) / n_safe,
        rollout_log_prob_mean=total.rollout_log_prob / n_safe,
    )
