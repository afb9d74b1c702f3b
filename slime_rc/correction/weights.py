"""IS weights and the keep mask: stages 3 (sequence decisions), 4 (per-token keep mask and weights) and 5's batch
normalization.  This is the file that answers "where is the IS weight computed?".

With ``r_t = pi_train / pi_rollout`` per token, ``S = sum_t log r_t`` over a sequence's ``T`` valid tokens and
``b`` the safety bound (default 20):

* token level:      ``w_t = bound(exp(clamp(log r_t, -b, b)))``  (``bounded_weight``, applied in stage 1 so that
  collective 1 can sum it per sequence);
* sequence level:   ``w_i = bound(exp(clamp(S, -b, b)))``, spread over the sequence's tokens;
* geometric level:  ``w_i = bound(exp(clamp(S / T, -b, b)))``, spread likewise;

where ``bound`` is the IS mode: ``truncate`` ``min(w, upper)``, ``clip`` ``clamp(w, lower, upper)``, ``mask``
leaves ``w`` as it is and rejects the tokens (token level) or sequences whose raw ratio lies outside
``[lower, upper]`` instead.  A sequence is dropped whole for a non-finite token (``on_nonfinite='reject'``), veto,
a sequence RS criterion or sequence mask mode; a token is kept if it is valid, no token-level rule rejects it and
its sequence is not dropped.  The weights the loss sees are ``w * keep``, divided by the batch's mean kept weight
under ``is_batch_normalize``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.packed import moments64, tracing
from slime_rc.correction.records import BatchTotals, PackedBatch, SequenceDecisions, SequenceStats, \
    TokenReductions, TokenWeights


def outside(stat: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """``stat < lo or stat > hi`` (bool, same shape): the rejection test of RS criteria and IS mask mode, with
    bounds in the statistic's own space (log-ratio for ratio bounds); ``lo = -inf`` tests the upper bound only."""
    if lo == -math.inf:
        return stat > hi
    return (stat < lo) | (stat > hi)


class Comparisons:
    """The threshold tests of one call's tokens, each computed once: ``stat < b`` / ``stat > b`` as ``[N]`` float32
    0/1, shared by every rule and metric that asks for the same test (a token RS band and the IS bounds' fractions
    often test ``log r`` against the same bounds).  The flags it hands out are shared: never modify them in place."""

    def __init__(self):
        self._done: List[Tuple[torch.Tensor, object, float, torch.Tensor]] = []

    def test(self, compare, stat: torch.Tensor, bound: float) -> torch.Tensor:
        for s, c, b, flag in self._done:
            if s is stat and c is compare and b == bound:
                return flag
        if tracing():  # compiled: no buffer (out= would make inductor write one)
            flag = compare(stat, bound).to(stat.dtype)
        else:
            flag = compare(stat, bound, out=torch.empty_like(stat))
        self._done.append((stat, compare, bound, flag))
        return flag


def outside_flag(stat: torch.Tensor, lo: float, hi: float, valid: torch.Tensor,
                 comparisons: Comparisons) -> torch.Tensor:
    """:func:`outside` over ``[N]`` float32 tokens as float32 0/1, for valid tokens only (``valid``: float32 0/1;
    invalid tokens hold ``stat = 0``, so the product is needed only when 0 itself lies outside the bounds).
    Comparisons written into float32 and unions as sums (the two tests are disjoint): on CPU a comparison into
    bool, a bool union or a bool->float conversion is several times slower than float arithmetic.  Each test is
    taken from (or added to) ``comparisons``, so the result may be one of its flags: never modify it in place."""
    tests = [(torch.gt, hi)] if lo == -math.inf else [(torch.lt, lo)] if hi == math.inf else \
        [(torch.lt, lo), (torch.gt, hi)]
    flags = [comparisons.test(compare, stat, b) for compare, b in tests]
    flag = flags[0] if len(flags) == 1 else flags[0] + flags[1]
    return flag * valid if (lo > 0 or hi < 0) else flag


def bounded_weight(ratio: torch.Tensor, config: RolloutCorrectionConfig) -> torch.Tensor:
    """The IS mode applied to safety-bounded ratios (any shape): ``truncate`` ``min(r, is_upper_bound)``, ``clip``
    ``clamp(r, is_lower, is_upper_bound)``; ``mask`` returns ``r`` unchanged (mask mode rejects rather than bounds)."""
    if config.is_mode == "truncate":
        return ratio.clamp(max=config.is_upper_bound)
    if config.is_mode == "clip":
        return ratio.clamp(config.is_lower, config.is_upper_bound)
    return ratio


# ---- 3. sequence-level decisions ---------------------------------------------------------------------------------
def sequence_decisions(seqs: SequenceStats, config: RolloutCorrectionConfig) -> SequenceDecisions:
    """Stage 3: per-sequence IS weights and rejections from the global per-sequence statistics (all ``[B]``)."""
    sums, has_tokens, n_safe = seqs.sums, seqs.has_tokens, seqs.valid_tokens_min1
    bound = config.safety_bound

    nonfinite = sums.nonfinite_tokens > 0
    drop = nonfinite.clone() if config.on_nonfinite == "reject" else torch.zeros_like(nonfinite)
    vetoed = None
    if sums.veto_tokens is not None:
        vetoed = sums.veto_tokens > 0
        drop |= vetoed

    rs_flags, rs_values = {}, {}
    rs_dropped = torch.zeros_like(drop)
    rs_any = torch.zeros_like(drop)
    for c in config.rs:
        if c.granularity == "token":
            flags = sums.rs_token_rejections[c.option] > 0  # sequences that lost at least one token to it
            # the sequence's mean token statistic (a metric only): S / T for k1, mean k2/k3 otherwise
            stat = seqs.log_ratio_mean if c.statistic == "k1" else sums.k_sums[c.option] / n_safe
        else:
            if c.statistic == "k1":
                stat = sums.log_ratio if c.aggregate == "sum" else seqs.log_ratio_mean
            elif c.aggregate == "max":
                stat = seqs.k_maxes[c.option]
            else:
                stat = sums.k_sums[c.option] if c.aggregate == "sum" else sums.k_sums[c.option] / n_safe
            flags = has_tokens & outside(stat, *c.log_bounds)
            rs_dropped |= flags
        rs_flags[c.option] = flags
        rs_values[c.option] = torch.where(has_tokens, stat, 0.0)  # a max over no token is -inf: 0 instead
        rs_any |= flags
    if config.rs:
        drop |= rs_dropped

    is_mask = raw = w_seq = w_report = None
    if config.is_level in ("sequence", "geometric"):
        raw = sums.log_ratio if config.is_level == "sequence" else seqs.log_ratio_mean
        w_seq = w_report = bounded_weight(torch.exp(raw.clamp(-bound, bound)), config)
        if config.is_mode == "mask":
            is_mask = has_tokens & outside(raw, math.log(config.is_lower), math.log(config.is_upper_bound))
            drop |= is_mask
    elif config.is_level == "token":
        raw = seqs.log_ratio_mean  # the raw counterpart of the mean token weight: the geometric-mean ratio
        w_report = sums.is_weight / n_safe
        if config.is_mode == "mask":
            is_mask = sums.is_mask_tokens > 0

    kept_tokens = sums.valid_tokens - sums.token_rejected if sums.token_rejected is not None else sums.valid_tokens
    kept = has_tokens & ~drop & (kept_tokens > 0)
    return SequenceDecisions(nonfinite=nonfinite, vetoed=vetoed, rs_flags=rs_flags, rs_dropped=rs_dropped,
                             rs_any=rs_any, rs_values=rs_values, is_mask=is_mask, raw_log_ratio=raw, is_weight=w_seq,
                             sequence_weight=w_report, drop=drop, kept=kept)


# ---- 4. per-token keep mask and weights ----------------------------------------------------------------------------
def token_weights(batch: PackedBatch, tokens: TokenReductions, decisions: SequenceDecisions) -> TokenWeights:
    """Stage 4: ``keep = token keep x sequence not dropped`` and ``weights = w * keep`` (``[N]`` float32), with the
    sums of the kept weights and of their squares (see :func:`keep_and_weights`)."""
    keep, weights, kept_sum, kept_sq_sum = keep_and_weights(
        batch.sequence_ids, (~decisions.drop).float(), tokens.keep, tokens.is_weight,
        None if decisions.is_weight is None else decisions.is_weight.float())
    return TokenWeights(keep=keep, weights=weights, kept_sum=kept_sum, kept_sq_sum=kept_sq_sum)


def keep_and_weights(sequence_ids: torch.Tensor, not_dropped: torch.Tensor, token_keep: torch.Tensor,
                     token_weight: Optional[torch.Tensor], sequence_weight: Optional[torch.Tensor]):
    """``(keep, weights, sum of weights, sum of squared weights)``: ``keep = token_keep x not_dropped[sequence]``
    (``[N]`` float32 0/1); ``weights = token_weight x keep`` at token level, ``sequence_weight[sequence] x keep`` at
    sequence/geometric level (``[N]`` float32; None and None sums when IS is off); the sums 0-d float64 over all
    N tokens (the kept ones: the rest are 0), for the IS mean/std/ESS metrics and batch normalization.
    ``sequence_ids``: ``[N]`` int32; ``not_dropped``, ``sequence_weight``: ``[B]`` float32."""
    keep = not_dropped.index_select(0, sequence_ids).mul_(token_keep)
    if token_weight is not None:
        weights = token_weight * keep
    elif sequence_weight is not None:
        weights = sequence_weight.index_select(0, sequence_ids).mul_(keep)
    else:
        return keep, None, None, None
    kept_sum, kept_sq_sum = moments64(weights, square=True)
    return keep, weights, kept_sum, kept_sq_sum


# ---- 5. batch normalization ------------------------------------------------------------------------------------
def batch_normalize(kept: TokenWeights, totals: BatchTotals,
                    config: RolloutCorrectionConfig) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(weights / norm, norm)`` (``kept.weights`` divided in place: the call's own buffer, read last by the batch
    totals) with ``norm`` (0-d float64) the global mean kept weight (mean over kept tokens at
    token level, over kept sequences at sequence/geometric level); ``(weights, None)`` when batch normalization is
    off."""
    if not (config.is_enabled and config.is_batch_normalize):
        return kept.weights, None
    where = totals.tokens if config.is_level == "token" else totals.seqs
    denom_w, denom_n = totals.value(where.weights.kept_sum), totals.value(where.kept)
    mean_w = denom_w / denom_n.clamp(min=1.0)  # counts: 0 kept means a zero numerator too
    # nothing kept (or weights all zero): leave weights as they are rather than divide by zero
    norm = torch.where(mean_w > 0, mean_w, 1.0)
    # in place: the batch totals (the last readers of the weights before normalization) are done
    return kept.weights.div_(norm), norm
