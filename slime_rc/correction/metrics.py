"""Metric names and definitions (:data:`METRICS`), the batch totals behind them (collectives 2 and 3) and the
metrics computed from those totals (stage 5).

Conventions (all metrics are global over the reducer's batch group):
* a *valid token* is a loss token (loss_mask = 1) with finite log-probs; a *valid sequence* has >= 1 valid token;
* ``r = pi_train / pi_rollout``; ``lr = log r`` clamped to the safety bound (+-20) before any ``exp``;
* token means are over all valid tokens, sequence means over valid sequences, whatever was rejected;
* IS mean/std/ESS describe the bounded weights the loss uses (kept tokens, before batch normalization);
  IS min/max/quantiles/fractions describe the raw ratio before bounding (valid tokens);
* a mean or extreme over an empty set is reported as 0.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.quantiles import QUANTILES, histogram, quantiles_from_histogram
from slime_rc.correction.records import (BatchTotals, CriterionTotals, Extremes, Number, PackedBatch, SequenceDecisions,
                                         SequenceExtremes, SequenceStats, SequenceTotals, SequenceWeightTotals,
                                         TokenStats, TokenTotals, TokenWeights, TokenWeightTotals, leaves, with_leaves)
from slime_rc.correction.reducer import LocalReducer

# name -> (when it is reported, definition).  docs/metrics.md is checked against this table by a test.
METRICS = {
    # mismatch (always)
    "training_log_ppl": ("always", "mean over sequences of -mean_t log pi_train"),
    "training_ppl": ("always", "mean over sequences of exp(-mean_t log pi_train)"),
    "rollout_log_ppl": ("always", "mean over sequences of -mean_t log pi_rollout"),
    "rollout_ppl": ("always", "mean over sequences of exp(-mean_t log pi_rollout)"),
    "log_ppl_diff": ("always", "mean over sequences of d_i = mean_t log pi_rollout - mean_t log pi_train "
                               "(= training log-ppl - rollout log-ppl)"),
    "log_ppl_abs_diff": ("always", "mean over sequences of |d_i|"),
    "log_ppl_diff_max": ("always", "max over sequences of d_i"),
    "log_ppl_diff_min": ("always", "min over sequences of d_i"),
    "ppl_ratio": ("always", "mean over sequences of exp(d_i) = training_ppl_i / rollout_ppl_i"),
    "kl": ("always", "token mean of log pi_rollout - log pi_train (KL(rollout || train) estimator k1)"),
    "k3_kl": ("always", "token mean of r - 1 - log r"),
    "chi2_token": ("always", "token mean of r^2, minus 1"),
    "chi2_seq": ("always", "mean over sequences of exp(2 * clamp(sum_t log r)), minus 1"),
    "train_rollout_logprob_abs_diff": ("always", "token mean of |log pi_train - log pi_rollout|"),
    "rejected_token_fraction": ("always", "fraction of loss tokens removed from the loss (RS, veto, mask mode, "
                                          "non-finite)"),
    "rejected_seq_fraction": ("always", "fraction of sequences none of whose tokens stay in the loss"),
    # non-finite inputs (on_nonfinite='reject')
    "nonfinite_token_fraction": ("on_nonfinite=reject", "fraction of loss tokens with a NaN/inf log-prob"),
    "nonfinite_seq_fraction": ("on_nonfinite=reject", "fraction of sequences rejected for NaN/inf log-probs"),
    # IS weights
    "rollout_is_mean": ("IS on", "mean bounded IS weight over kept tokens (before batch normalization)"),
    "rollout_is_std": ("IS on", "standard deviation of the bounded IS weight over kept tokens"),
    "rollout_is_eff_sample_size": ("IS on", "effective sample size fraction (E[w])^2 / E[w^2] over kept tokens"),
    "rollout_is_min": ("IS on", "true batch minimum of the raw ratio (token ratio, or sequence/geometric ratio)"),
    "rollout_is_max": ("IS on", "true batch maximum of the raw ratio (exp of the safety-bounded log-ratio)"),
    "rollout_is_p25": ("IS on", "25th percentile of the raw ratio over valid tokens (streaming histogram)"),
    "rollout_is_p50": ("IS on", "median of the raw ratio over valid tokens"),
    "rollout_is_p75": ("IS on", "75th percentile of the raw ratio over valid tokens"),
    "rollout_is_p95": ("IS on", "95th percentile of the raw ratio over valid tokens"),
    "rollout_is_p99": ("IS on", "99th percentile of the raw ratio over valid tokens"),
    "rollout_is_ratio_fraction_high": ("IS on", "fraction of valid tokens whose raw ratio exceeds the upper bound"),
    "rollout_is_ratio_fraction_low": ("IS on", "fraction of valid tokens whose raw ratio is below the lower bound"),
    "rollout_is_seq_mean": ("IS on", "mean over sequences of the sequence weight (bounded sequence/geometric "
                                     "weight; at token level the sequence's mean bounded token weight)"),
    "rollout_is_seq_std": ("IS on", "standard deviation over sequences of the sequence weight"),
    "rollout_is_seq_min": ("IS on", "minimum over sequences of the sequence weight"),
    "rollout_is_seq_max": ("IS on", "maximum over sequences of the sequence weight"),
    "rollout_is_seq_max_deviation": ("IS on", "maximum over sequences of |sequence weight - 1|"),
    "rollout_is_seq_fraction_high": ("IS on", "fraction of sequences whose raw sequence ratio (geometric mean at "
                                              "token level) exceeds the upper bound"),
    "rollout_is_seq_fraction_low": ("IS on", "fraction of sequences whose raw sequence ratio is below the lower "
                                             "bound"),
    "rollout_is_batch_norm_factor": ("IS on, batch normalization", "global mean weight the weights were divided by"),
    "rollout_is_masked_fraction": ("IS mode mask", "fraction of valid tokens rejected by mask mode"),
    "rollout_is_seq_masked_fraction": ("IS mode mask", "fraction of sequences that lost tokens to mask mode"),
    # rejection sampling
    "rollout_rs_masked_fraction": ("RS on", "fraction of valid tokens rejected by any RS criterion"),
    "rollout_rs_seq_masked_fraction": ("RS on", "fraction of sequences that lost >= 1 token to RS"),
    "rollout_rs_<option>_masked_fraction": ("RS on", "fraction of valid tokens rejected by that criterion"),
    "rollout_rs_<option>_seq_masked_fraction": ("RS on", "fraction of sequences that lost >= 1 token to it"),
    # veto
    "rollout_is_veto_fraction": ("veto on", "fraction of sequences vetoed (some token ratio < veto threshold)"),
    "rollout_is_catastrophic_token_fraction": ("veto on", "fraction of valid tokens with ratio < veto threshold"),
}


# ---- batch totals: collectives 2 (SUM) and 3 (MAX) ---------------------------------------------------------------
# Perplexity is exp(-mean log-prob), not a ratio: it gets no safety bound, only a float64 overflow guard.
_PPL_EXP_MAX = 700.0


def batch_totals(batch: PackedBatch, tokens: TokenStats, seqs: SequenceStats, decisions: SequenceDecisions,
                 kept: TokenWeights, config: RolloutCorrectionConfig, reducer: LocalReducer) -> BatchTotals:
    """The totals behind every metric and batch normalization, global over the reducer's batch group.

    One float64 vector goes through collective 2 (SUM): the :class:`TokenTotals` (sums over this rank's tokens), the
    quantile histogram (IS on) and the :class:`SequenceTotals` (sums of per-sequence terms, counted by one rank per
    sequence group); one through collective 3 (MAX): the :class:`Extremes`.  Then three host reads in all.
    """
    bound = config.safety_bound
    lr64 = tokens.log_ratio64
    ratio64 = tokens.ratio.double()
    weight_totals, hist, (raw_max, raw_neg_min) = \
        _is_token_totals(tokens, seqs, decisions, kept, config) if config.is_enabled else (None, None, (None, None))
    token = TokenTotals(
        valid=int(tokens.n_valid), loss=int(tokens.n_loss_tokens), kept=kept.keep.sum(),
        log_ratio_sum=lr64.sum(), abs_log_ratio_sum=torch.linalg.vector_norm(lr64, 1),
        clamped_log_ratio_sum=lr64.clamp(-bound, bound).sum(),
        # sums of r and r^2 over valid tokens: invalid tokens hold r = 1 exactly, so their count comes off after
        ratio_sum_all=ratio64.sum(), ratio_sq_sum_all=torch.dot(ratio64, ratio64),
        invalid=tokens.n_invalid, nonfinite=tokens.n_nonfinite,
        veto=None if tokens.veto is None else tokens.veto.count,
        rs_criteria={option: rule.count for option, rule in tokens.rs_token.items()},
        is_mask=None if tokens.is_mask is None else tokens.is_mask.count,
        weights=weight_totals,
    )
    terms, extreme_columns = _sequence_terms(seqs, decisions, config)
    columns = leaves(extreme_columns)
    if batch.n_seqs:
        maxima = torch.stack(columns, 1).masked_fill(~seqs.has_tokens[:, None], -math.inf).amax(0).unbind()
    else:
        maxima = [-math.inf] * len(columns)
    extremes = Extremes(token_raw_max=raw_max, token_raw_neg_min=raw_neg_min,
                        sequences=with_leaves(extreme_columns, maxima))
    return _reduce(token, hist, terms, extremes, reducer, batch)


def _is_token_totals(tokens: TokenStats, seqs: SequenceStats, decisions: SequenceDecisions, kept: TokenWeights,
                     config: RolloutCorrectionConfig):
    """IS on: the :class:`TokenWeightTotals`, the ``[num_bins]`` histogram of the raw log-ratio, and the token-level
    raw extremes ``(max, -min)`` of ``clamp(log r)`` over valid tokens (None at sequence level)."""
    bound, bins = config.safety_bound, config.quantile_bins_per_octave
    log_hi, log_lo = math.log(config.is_upper_bound), math.log(config.is_lower)
    w64 = kept.weights.double()
    if config.is_level == "token":
        lr, valid, n_invalid = tokens.log_ratio, tokens.valid, tokens.n_invalid
        # invalid tokens hold lr == 0: they can only count when a bound sits on the wrong side of 1
        above, below = lr > log_hi, lr < log_lo
        raw_above = (above if log_hi >= 0 else above & valid).sum()
        raw_below = (below if log_lo <= 0 else below & valid).sum()
        hist = histogram(lr, bins, bound)
        hist[hist.numel() // 2] -= n_invalid  # ... and land in the centre bin: take them out there
        valid_lr = tokens.clamped_log_ratio if n_invalid == 0 else tokens.clamped_log_ratio[valid]
        lo_hi = valid_lr.aminmax() if valid_lr.numel() else None
        extremes = (lo_hi.max, -lo_hi.min) if lo_hi is not None else (-math.inf, -math.inf)
    else:
        # token-weighted sums of a per-sequence value use this rank's token counts: exact after the SUM
        local_n, raw = seqs.local_valid_tokens, decisions.raw_log_ratio
        raw_above = (local_n * (raw > log_hi)).sum()
        raw_below = (local_n * (raw < log_lo)).sum()
        hist = histogram(raw.clamp(-bound, bound), bins, bound, weights=local_n)
        extremes = (None, None)
    return TokenWeightTotals(w64.sum(), torch.dot(w64, w64), raw_above, raw_below), hist, extremes


def _sequence_terms(seqs: SequenceStats, decisions: SequenceDecisions, config: RolloutCorrectionConfig):
    """``[B]`` per-sequence terms: the :class:`SequenceTotals` summands and the :class:`SequenceExtremes` columns."""
    sums, has_tokens, bound = seqs.sums, seqs.has_tokens, config.safety_bound
    n = sums.valid_tokens
    flags = decisions.rs_flags
    rs_criteria = {c.option: CriterionTotals(tokens=None if c.granularity == "token" else n * flags[c.option],
                                             seqs=flags[c.option]) for c in config.rs}
    rs_tokens = None
    if config.rs:
        # a sequence dropped by a sequence criterion loses all its valid tokens, else what token criteria took
        token_rs = sums.rs_token_rejected if sums.rs_token_rejected is not None else torch.zeros_like(n)
        rs_tokens = torch.where(decisions.rs_dropped, n, token_rs)
    seq_level = config.is_level in ("sequence", "geometric")
    loss = has_tokens | decisions.nonfinite
    mean_train, mean_rollout = seqs.train_log_prob_mean, seqs.rollout_log_prob_mean
    log_ppl_diff = mean_rollout - mean_train  # = log(training_ppl_i / rollout_ppl_i)

    weights = None
    w = raw = None
    if config.is_enabled:
        w, raw = decisions.sequence_weight, decisions.raw_log_ratio
        log_hi, log_lo = math.log(config.is_upper_bound), math.log(config.is_lower)
        weights = SequenceWeightTotals(
            kept_sum=torch.where(decisions.kept, w, 0.0) if seq_level else None,
            weight=w * has_tokens, weight_sq=w * w * has_tokens,
            above=has_tokens & (raw > log_hi), below=has_tokens & (raw < log_lo))
    terms = SequenceTotals(
        nonfinite=decisions.nonfinite,
        veto=decisions.vetoed,
        rs_criteria=rs_criteria,
        rs_tokens=rs_tokens,
        rs_seqs=decisions.rs_any if config.rs else None,
        is_mask_tokens=n * decisions.is_mask if seq_level and decisions.is_mask is not None else None,
        is_mask_seqs=decisions.is_mask,
        valid=has_tokens,
        loss=loss,
        kept=decisions.kept,
        rejected=loss & ~decisions.kept,
        train_log_ppl=-mean_train * has_tokens,
        train_ppl=torch.exp((-mean_train).clamp(max=_PPL_EXP_MAX)) * has_tokens,
        rollout_log_ppl=-mean_rollout * has_tokens,
        rollout_ppl=torch.exp((-mean_rollout).clamp(max=_PPL_EXP_MAX)) * has_tokens,
        log_ppl_diff=log_ppl_diff * has_tokens,
        log_ppl_abs_diff=log_ppl_diff.abs() * has_tokens,
        ppl_ratio=torch.exp(log_ppl_diff.clamp(-bound, bound)) * has_tokens,
        seq_ratio_sq=torch.exp(2 * sums.log_ratio.clamp(-bound, bound)) * has_tokens,
        weights=weights,
    )
    seq_raw = raw if seq_level else None
    extreme_columns = SequenceExtremes(
        log_ppl_diff_max=log_ppl_diff, log_ppl_diff_neg_min=-log_ppl_diff,
        raw_max=seq_raw, raw_neg_min=None if seq_raw is None else -seq_raw,
        weight_max=w, weight_neg_min=None if w is None else -w, weight_max_dev=None if w is None else (w - 1).abs())
    return terms, extreme_columns


def _pack(values: List[Number], device) -> torch.Tensor:
    """One float64 vector of 0-d tensors and Python numbers, in the order of ``values`` (the tensors in one stack,
    the numbers in one host-to-device copy).  The order must not depend on which leaves are tensors: that differs
    between ranks (a rank holding none of some tokens has numbers there), and the collectives add / take the maximum
    position by position."""
    tensors = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    numbers = [i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    out = torch.empty(len(values), dtype=torch.float64, device=device)
    if tensors:
        out[tensors] = torch.stack([values[i] for i in tensors]).double().to(device)
    if numbers:
        out[numbers] = torch.tensor([float(values[i]) for i in numbers], dtype=torch.float64, device=device)
    return out


def _reduce(token: TokenTotals, hist: Optional[torch.Tensor], terms: SequenceTotals, extremes: Extremes,
            reducer: LocalReducer, batch: PackedBatch) -> BatchTotals:
    """Collectives 2 and 3: this rank's totals (records of local values) -> the batch's (records of floats)."""
    dev = batch.device
    head = _pack(leaves(token), dev)
    columns = leaves(terms)
    # Sequence-level totals are identical on every rank of a sequence group: exactly one rank counts them.
    if batch.n_seqs and reducer.counts_sequences:
        seq_sums = torch.stack(columns, 1).sum(0, dtype=torch.float64)
    else:
        seq_sums = torch.zeros(len(columns), dtype=torch.float64, device=dev)
    parts = [head] + ([hist] if hist is not None else []) + [seq_sums]
    sums = reducer.sum_totals(torch.cat(parts))  # collective 2
    chunks = sums.split([p.numel() for p in parts])
    token = with_leaves(token, chunks[0].tolist())
    terms = with_leaves(terms, chunks[-1].tolist())
    extremes = with_leaves(extremes, reducer.max_totals(_pack(leaves(extremes), dev)).tolist())  # collective 3
    return BatchTotals(tokens=token, seqs=terms, extremes=extremes, histogram=chunks[1] if hist is not None else None)


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _fin(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _exp(x: float, bound: float) -> float:
    return math.exp(min(max(x, -bound), bound))


def finish_metrics(t: BatchTotals, config: RolloutCorrectionConfig, norm: Optional[float]) -> Dict[str, float]:
    """Metric values (Python floats, names in :data:`METRICS`) from the reduced batch totals; ``norm``: the batch
    normalization factor (None when off)."""
    tok, seq, ext = t.tokens, t.seqs, t.extremes
    tokens, seqs, loss_tokens, all_seqs = tok.valid, seq.valid, tok.loss, seq.loss
    m = {
        "training_log_ppl": _div(seq.train_log_ppl, seqs),
        "training_ppl": _div(seq.train_ppl, seqs),
        "rollout_log_ppl": _div(seq.rollout_log_ppl, seqs),
        "rollout_ppl": _div(seq.rollout_ppl, seqs),
        "log_ppl_diff": _div(seq.log_ppl_diff, seqs),
        "log_ppl_abs_diff": _div(seq.log_ppl_abs_diff, seqs),
        "log_ppl_diff_max": _fin(ext.sequences.log_ppl_diff_max),
        "log_ppl_diff_min": _fin(-ext.sequences.log_ppl_diff_neg_min),
        "ppl_ratio": _div(seq.ppl_ratio, seqs),
        "kl": _div(-tok.log_ratio_sum, tokens),
        "k3_kl": _div(tok.ratio_sum - tokens - tok.clamped_log_ratio_sum, tokens),
        "chi2_token": _div(tok.ratio_sq_sum, tokens) - 1.0 if tokens > 0 else 0.0,
        "chi2_seq": _div(seq.seq_ratio_sq, seqs) - 1.0 if seqs > 0 else 0.0,
        "train_rollout_logprob_abs_diff": _div(tok.abs_log_ratio_sum, tokens),
        "rejected_token_fraction": _div(loss_tokens - tok.kept, loss_tokens),
        "rejected_seq_fraction": _div(seq.rejected, all_seqs),
    }
    if config.on_nonfinite == "reject":
        m["nonfinite_token_fraction"] = _div(tok.nonfinite, loss_tokens)
        m["nonfinite_seq_fraction"] = _div(seq.nonfinite, all_seqs)
    if config.is_enabled:
        bound = config.safety_bound
        w, sw = tok.weights, seq.weights
        n = tok.kept
        mean = _div(w.kept_sum, n)
        mean_sq = _div(w.kept_sq_sum, n)
        m["rollout_is_mean"] = mean
        m["rollout_is_std"] = math.sqrt(max(mean_sq - mean * mean, 0.0))
        m["rollout_is_eff_sample_size"] = mean * mean / mean_sq if mean_sq > 0 else 0.0
        any_tokens = tokens > 0
        m["rollout_is_min"] = _exp(_fin(-ext.raw_neg_min), bound) if any_tokens else 0.0
        m["rollout_is_max"] = _exp(_fin(ext.raw_max), bound) if any_tokens else 0.0
        qs = quantiles_from_histogram(t.histogram, config.quantile_bins_per_octave, bound).tolist()
        for q, v in zip(QUANTILES, qs):
            m[f"rollout_is_p{round(q * 100)}"] = math.exp(v) if any_tokens else 0.0
        m["rollout_is_ratio_fraction_high"] = _div(w.raw_above, tokens)
        m["rollout_is_ratio_fraction_low"] = _div(w.raw_below, tokens)
        seq_mean = _div(sw.weight, seqs)
        m["rollout_is_seq_mean"] = seq_mean
        m["rollout_is_seq_std"] = math.sqrt(max(_div(sw.weight_sq, seqs) - seq_mean * seq_mean, 0.0))
        m["rollout_is_seq_min"] = _fin(-ext.sequences.weight_neg_min)
        m["rollout_is_seq_max"] = _fin(ext.sequences.weight_max)
        m["rollout_is_seq_max_deviation"] = _fin(ext.sequences.weight_max_dev)
        m["rollout_is_seq_fraction_high"] = _div(sw.above, seqs)
        m["rollout_is_seq_fraction_low"] = _div(sw.below, seqs)
        if norm is not None:
            m["rollout_is_batch_norm_factor"] = norm
        if config.is_mode == "mask":
            m["rollout_is_masked_fraction"] = _div(t.is_mask_tokens, tokens)
            m["rollout_is_seq_masked_fraction"] = _div(seq.is_mask_seqs, all_seqs)
    if config.rs:
        m["rollout_rs_masked_fraction"] = _div(seq.rs_tokens, tokens)
        m["rollout_rs_seq_masked_fraction"] = _div(seq.rs_seqs, all_seqs)
        for c in config.rs:
            name = f"rollout_rs_{c.option}"
            m[name + "_masked_fraction"] = _div(t.rs_tokens(c.option), tokens)
            m[name + "_seq_masked_fraction"] = _div(seq.rs_criteria[c.option].seqs, all_seqs)
    if config.veto_threshold is not None:
        m["rollout_is_veto_fraction"] = _div(seq.veto, all_seqs)
        m["rollout_is_catastrophic_token_fraction"] = _div(tok.veto, tokens)
    return m
