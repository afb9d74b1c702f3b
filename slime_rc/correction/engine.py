"""The rollout-correction engine: IS weights, rejection (keep) mask and mismatch metrics for packed sequences.

:func:`compute_rollout_correction` runs five stages over ``N`` tokens of ``B`` sequences on this rank
(``r = pi_train / pi_rollout``; ``stages.py``, eagerly or compiled: ``compiled.py``), each a function whose output
is a typed record (``records.py``), after the ranks agree on the settings and their sequence counts
(``reducer.agree``, a host-side exchange; ``agreement.py``):

1. per token (``token_stats.py``): ``log r`` (fp32), validity (loss token with finite log-probs), token-level
   rejections (token RS criteria, token IS mask mode, veto flags), bounded token weights -> ``TokenStats``; reduced
   at once (``reductions.py``) to this rank's per-sequence sums (valid-token count, ``sum log r``,
   ``sum log pi_rollout``, counts of flagged tokens, k2/k3 sums/maxima) and the token columns' batch totals
   (histogram, extremes, moments) -> ``TokenReductions``: after this only the token keep flags and weights are read;
2. per sequence (``sequence_stats.py``): the local sums combined by the reducer (collective 1) -> ``SequenceStats``;
3. sequence decisions (``weights.py``): sequence/geometric IS weights, sequence RS, veto, mask mode, non-finite
   rejection -> ``SequenceDecisions``;
4. per token (``weights.py``): keep mask and IS weights -> ``TokenWeights``; then the batch totals and quantile
   histogram and extremes (``metrics.py``, collective 2) -> ``BatchTotals``;
5. batch normalization by the global mean weight (``weights.py``) and the metrics (``metrics.py``).

Only ``reducer.py`` talks to other ranks; no Python loop runs over sequences and no tensor of size N crosses ranks.
Nothing is read on the host while it computes: the value checks wait in one ``DeferredChecks`` (``checks.py``), read
once at the end with ``on_nonfinite='error'`` and never with ``'reject'``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.compiled import compiled_stages, use_compiled
from slime_rc.correction.packed import BAD_INPUT_SUMMARY, check_packed_metadata, describe_bad_input
from slime_rc.correction.reducer import LocalReducer, as_reducer
from slime_rc.correction.stages import correction_stages, packed_batch
from slime_rc.correction.token_stats import NONFINITE_SUMMARY, describe_nonfinite


@dataclass
class CorrectionResult:
    """Output of :func:`compute_rollout_correction`.

    ``is_weights``: ``[N]`` float32, detached; the bounded (and batch-normalized) IS weight of each kept token,
    0 on tokens that are masked or rejected; ``None`` when IS is off.
    ``keep_mask``: ``[N]`` float32 0/1: loss tokens that survive RS, veto, mask mode and non-finite rejection.
    ``metrics``: metric name -> 0-d float64 tensor (names in ``slime_rc.correction.metrics.METRICS``), global over the
    reducer's batch group.
    ``sequences``: per-sequence ``[B]`` float64 statistics, global over the sequence group: ``valid_tokens``,
    ``log_ratio_sum``, ``train_log_prob_mean``, ``rollout_log_prob_mean``, ``is_weight`` (bounded sequence weight,
    or mean token weight at token level; absent when IS is off), ``kept`` (1 if any token of it is kept).
    """

    is_weights: Optional[torch.Tensor]
    keep_mask: torch.Tensor
    metrics: Dict[str, torch.Tensor]
    sequences: Dict[str, torch.Tensor] = field(default_factory=dict)

    def prefixed(self, prefix: str = "rollout_corr/") -> Dict[str, torch.Tensor]:
        return {prefix + k: v for k, v in self.metrics.items()}


def compute_rollout_correction(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    reducer: Optional[LocalReducer] = None,
    checks: Optional[DeferredChecks] = None,
    compiled: Optional[bool] = None,
) -> CorrectionResult:
    """IS weights, keep mask and metrics for packed sequences.

    Args:
        train_log_probs: ``[N]`` log pi_train of each token (pi_old in decoupled mode, pi_theta in bypass mode).
        rollout_log_probs: ``[N]`` log pi_rollout of the same tokens.
        loss_mask: ``[N]`` 0/1 or bool; 0 marks prompt, padding and tool tokens.
        cu_seqlens: ``[B+1]`` int64 sequence boundaries (see ``slime_rc.correction.packed``).
        config: the validated :class:`RolloutCorrectionConfig`.
        reducer: combines statistics across ranks (``slime_rc.correction.reducer``); None for one process.  Under context
            parallelism each rank passes its own tokens of every sequence, in any order within the sequence.
        checks: where the value checks go (``slime_rc.correction.checks``): malformed ``cu_seqlens`` / ``loss_mask``
            values and, with ``on_nonfinite='error'``, non-finite log-probs on loss tokens.  None: the engine reads
            them itself, once, at the end (no read with ``on_nonfinite='reject'``).  A caller that checks more
            (a policy loss) passes its own and calls ``raise_if_any()`` once for all of them.
        compiled: run stages 1-5 through ``torch.compile`` (``compiled.py``; the first call of a config compiles,
            ~10-60 s on a CPU).  None (default): as the environment variable ``SLIME_RC_COMPILE`` says (``1`` on;
            unset or ``0`` off).

    Host reads: none, but that one deferred check; every tensor is created on the inputs' device.
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise ValueError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}; "
                         f"build one with RolloutCorrectionConfig(...) or RolloutCorrectionConfig.from_dict(d)")
    reducer = as_reducer(reducer)
    cu_seqlens = check_packed_metadata(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    reducer.agree("compute_rollout_correction", config, cu_seqlens.numel() - 1)  # 0. ranks agree (host-side)
    if use_compiled(compiled):
        out = compiled_stages(config, train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, reducer)
    else:
        out = correction_stages(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens, config, reducer)
    # deferred checks on global counts (after collective 2): every rank of the batch group raises together
    own = checks is None
    checks = DeferredChecks(read=config.on_nonfinite == "error") if own else checks
    checks.add(out.malformed, BAD_INPUT_SUMMARY,
               lambda: describe_bad_input(loss_mask, cu_seqlens, train_log_probs.numel()))
    if out.nonfinite is not None:
        checks.add(out.nonfinite, NONFINITE_SUMMARY, lambda: describe_nonfinite(
            packed_batch(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)[0], out.nonfinite_sequences))
    if own:
        checks.raise_if_any()
    return CorrectionResult(
        is_weights=out.is_weights,
        keep_mask=out.keep_mask,
        metrics=dict(zip(out.metric_names, out.metric_values.unbind())),  # views of one vector: read in one copy
        sequences=out.sequences,
    )

