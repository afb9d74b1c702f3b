"""The engine's stages 1-5 (``engine.py``'s docstring) as one function of tensors: :func:`correction_stages`.

``engine.compute_rollout_correction`` checks the inputs' metadata and lets the ranks agree (host-side), then runs
it eagerly or compiled (``compiled.py``), then reads the deferred checks.  What it returns is tensors and the metric
names only, so that the compiled form returns it from its graphs.
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.metrics import batch_totals, finish_metrics
from slime_rc.correction.packed import packed_inputs, token_sequence_ids
from slime_rc.correction.records import PackedBatch
from slime_rc.correction.reducer import LocalReducer
from slime_rc.correction.reductions import token_reductions
from slime_rc.correction.sequence_stats import sequence_statistics
from slime_rc.correction.weights import batch_normalize, sequence_decisions, token_weights


class StageOutputs(NamedTuple):
    """What :func:`correction_stages` returns: tensors and the metric names only (the compiled form returns it from
    its graphs).  ``malformed`` / ``nonfinite``: 0-d global counts for the deferred checks (``nonfinite`` and
    ``nonfinite_sequences``, ``[B]`` bool, only with ``on_nonfinite='error'``); the rest as in
    :class:`CorrectionResult` (``metric_values``: one ``[M]`` float64 vector in the order of ``metric_names``)."""

    is_weights: Optional[torch.Tensor]
    keep_mask: torch.Tensor
    metric_names: Tuple[str, ...]
    metric_values: torch.Tensor
    sequences: Dict[str, torch.Tensor]
    malformed: torch.Tensor
    nonfinite: Optional[torch.Tensor]
    nonfinite_sequences: Optional[torch.Tensor]


def packed_batch(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens) -> Tuple[PackedBatch, torch.Tensor]:
    """The :class:`PackedBatch` of checked inputs and their 0-d ``malformed`` flag (``packed.packed_inputs``)."""
    train, rollout, mask, cu, malformed = packed_inputs(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    return PackedBatch(train, rollout, mask, cu, lengths=cu[1:] - cu[:-1],
                       sequence_ids=token_sequence_ids(cu, train.numel())), malformed  # cu is well formed (clamped)


def correction_stages(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                      cu_seqlens: torch.Tensor, config: RolloutCorrectionConfig,
                      reducer: LocalReducer) -> StageOutputs:
    """Stages 1-5 (``engine.py``'s docstring) on inputs whose metadata ``packed.check_packed_metadata`` has
    checked, after the ranks agreed; tensor operations and the reducer's two collectives only, no host read
    (``compiled.py`` traces it whole)."""
    batch, malformed = packed_batch(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    tokens = token_reductions(batch, config)                                    # 1. per token, reduced
    seqs = sequence_statistics(batch, tokens, config, reducer)                  # 2. per sequence (collective 1)
    decisions = sequence_decisions(seqs, config)                                # 3. sequence decisions
    kept = token_weights(batch, tokens, decisions)                              # 4. keep mask and weights
    totals = batch_totals(batch, tokens, seqs, decisions, kept, config, reducer, malformed.double())  # (collective 2)
    weights, norm = batch_normalize(kept, totals, config)                       # 5. batch normalization
    names, values = finish_metrics(totals, config, norm)                        # 5. metrics
    sequences = {
        "valid_tokens": seqs.sums.valid_tokens,
        "log_ratio_sum": seqs.sums.log_ratio,
        "train_log_prob_mean": seqs.train_log_prob_mean,
        "rollout_log_prob_mean": seqs.rollout_log_prob_mean,
        "kept": decisions.kept.double(),
    }
    if config.is_enabled:
        w = decisions.sequence_weight
        sequences["is_weight"] = w if norm is None else w / norm
    error = config.on_nonfinite == "error"
    return StageOutputs(
        is_weights=None if weights is None else weights.detach(),
        keep_mask=kept.keep,
        metric_names=tuple(names),
        metric_values=values,
        sequences=sequences,
        malformed=totals.value(totals.tokens.malformed),
        nonfinite=totals.value(totals.tokens.nonfinite) if error else None,
        nonfinite_sequences=decisions.nonfinite if error else None,
    )
