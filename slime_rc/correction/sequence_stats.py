"""Stage 2 of the engine: per-sequence statistics, combined over the sequence group (collective 1).

Each rank sums its own tokens of each sequence (``segment_sum``: ``[N] -> [B]``, float64) into the columns of
:class:`SequenceSums`, and takes the per-sequence max of the k2/k3 terms that a ``max`` criterion needs; the
reducer's ``combine_sequences`` adds the sums and maxes the maxima over the ranks holding pieces of the same
sequences (the context-parallel group).  Every rank of the group then holds bit-identical ``[B]`` statistics, from
which the per-sequence means follow: ``T = max(n, 1)``, ``S / T``, mean log pi_train ``(S + sum log pi_rollout) / T``
and mean log pi_rollout.  Only ``O(B)`` values cross ranks.
"""

from __future__ import annotations

from typing import Optional

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.packed import segment_max, segment_sum
from slime_rc.correction.records import FlaggedTokens, PackedBatch, SequenceStats, SequenceSums, TokenStats, leaves, \
    with_leaves
from slime_rc.correction.reducer import LocalReducer


def sequence_statistics(batch: PackedBatch, tokens: TokenStats, config: RolloutCorrectionConfig,
                        reducer: LocalReducer) -> SequenceStats:
    """Stage 2 (collective 1): :class:`SequenceStats` from this rank's :class:`TokenStats`."""
    cu, n_seqs, dev = batch.cu_seqlens, batch.n_seqs, batch.device
    zeros_b = torch.zeros(n_seqs, dtype=torch.float64, device=dev)

    def seq_sum(values: Optional[torch.Tensor]) -> torch.Tensor:
        return zeros_b if values is None else segment_sum(values, cu)

    def count(rule: Optional[FlaggedTokens]) -> Optional[torch.Tensor]:
        # Rare events (veto, rejections) skip the prefix sum on a rank that has none; whether the column exists
        # depends only on the config, so every rank sends the same columns.
        return None if rule is None else seq_sum(rule.flags if rule.count else None)

    is_weight = tokens.is_weight
    if is_weight is not None and tokens.n_invalid:
        is_weight = torch.where(tokens.valid, is_weight, 0.0)
    local = SequenceSums(
        valid_tokens=seq_sum(tokens.valid),
        log_ratio=seq_sum(tokens.log_ratio64),
        rollout_log_prob=seq_sum(tokens.rollout_log_probs),
        nonfinite_tokens=seq_sum(tokens.nonfinite),
        veto_tokens=count(tokens.veto),
        rs_token_rejections={option: count(rule) for option, rule in tokens.rs_token.items()},
        is_mask_tokens=count(tokens.is_mask),
        rs_token_rejected=count(tokens.rs_rejected),
        token_rejected=count(tokens.rejected),
        is_weight=None if is_weight is None else seq_sum(is_weight),
        k_sums={option: seq_sum(v) for option, v in tokens.k_sum_terms.items()},
    )
    local_sums = torch.stack(leaves(local), 1)  # [B, k], columns in SequenceSums field order
    if tokens.k_max_terms:
        local_maxes = torch.stack([segment_max(v, cu) for v in tokens.k_max_terms.values()], 1)
    else:
        local_maxes = torch.zeros(n_seqs, 0, dtype=torch.float64, device=dev)
    sums, maxes = reducer.combine_sequences(local_sums, local_maxes)
    total = with_leaves(local, sums.unbind(1))

    n = total.valid_tokens
    n_safe = n.clamp(min=1)
    return SequenceStats(
        sums=total,
        k_maxes=dict(zip(tokens.k_max_terms, maxes.unbind(1))),
        local_valid_tokens=local_sums[:, 0],
        has_tokens=n > 0,
        valid_tokens_min1=n_safe,
        log_ratio_mean=total.log_ratio / n_safe,
        train_log_prob_mean=(total.log_ratio + total.rollout_log_prob) / n_safe,
        rollout_log_prob_mean=total.rollout_log_prob / n_safe,
    )
