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

import functools
import math
from typing import Dict, List, Optional, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction import packed
from slime_rc.correction.packed import upload
from slime_rc.correction.quantiles import QUANTILES, histogram, quantiles_from_histogram
from slime_rc.correction.records import (BatchTotals, CriterionTotals, Extremes, PackedBatch, RsExtremes,
                                         RsSequenceTotals, RsTokenTotals, SequenceDecisions, SequenceExtremes,
                                         SequenceStats, SequenceTotals, SequenceWeightTotals, TokenColumnTotals,
                                         TokenReductions, TokenStats, TokenTotals, TokenWeights, TokenWeightTotals,
                                         leaves, register_type, with_leaves)
from slime_rc.correction.reducer import LocalReducer
from slime_rc.correction.weights import outside_flag

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
    # verl's per-option statistics (rollout_corr_helper.compute_rs_metrics) of the criterion's statistic s: log r
    # for k1 (unclamped, as tested; verl's k1 is -log r), k2/k3 as the criterion computes them.  Token criteria:
    # s_t per valid token, v_i = the sequence's mean s_t; sequence criteria: v_i the tested per-sequence value,
    # which every valid token of the sequence carries in the token statistics.
    "rollout_rs_<option>_mean": ("RS on", "token mean of s (sequence criteria: of v_i, each sequence weighted by "
                                          "its valid tokens)"),
    "rollout_rs_<option>_max": ("RS on", "max of s over valid tokens (sequence criteria: of v_i over valid "
                                         "sequences)"),
    "rollout_rs_<option>_min": ("RS on", "min of s over valid tokens (sequence criteria: of v_i over valid "
                                         "sequences)"),
    "rollout_rs_<option>_std": ("RS on", "token standard deviation (divide by n) of s clamped into the criterion's "
                                         "band [lower, upper] ([0, upper] for k2/k3); 0 for < 2 valid tokens"),
    "rollout_rs_<option>_fraction_high": ("RS on", "fraction of valid tokens with s above the upper bound "
                                                   "(sequence criteria: of valid sequences with v_i above it)"),
    "rollout_rs_<option>_fraction_low": ("RS on, k1 options", "fraction of valid tokens with s below the lower "
                                                              "bound (sequence criteria: of valid sequences)"),
    "rollout_rs_<option>_seq_mean": ("RS on", "mean over valid sequences of v_i"),
    "rollout_rs_<option>_seq_std": ("RS on", "standard deviation over valid sequences of v_i (divide by n - 1, "
                                             "as verl's torch.std); 0 for < 2 sequences"),
    "rollout_rs_<option>_seq_max": ("RS on", "max over valid sequences of v_i"),
    "rollout_rs_<option>_seq_min": ("RS on", "min over valid sequences of v_i"),
    "rollout_rs_<option>_seq_max_deviation": ("RS on", "max over valid sequences of |v_i| (deviation from the "
                                                       "ideal 0)"),
    "rollout_rs_<option>_seq_fraction_high": ("RS on", "fraction of valid sequences with v_i above the upper "
                                                       "bound"),
    "rollout_rs_<option>_seq_fraction_low": ("RS on, k1 options", "fraction of valid sequences with v_i below the "
                                                                  "lower bound"),
    # veto
    "rollout_is_veto_fraction": ("veto on", "fraction of sequences vetoed (some token ratio < veto threshold)"),
    "rollout_is_catastrophic_token_fraction": ("veto on", "fraction of valid tokens with ratio < veto threshold"),
}


# ---- batch totals: collectives 2 (SUM) and 3 (MAX) ---------------------------------------------------------------
# Perplexity is exp(-mean log-prob), not a ratio: it gets no safety bound, only a float64 overflow guard.
_PPL_EXP_MAX = 700.0


def token_column_totals(tokens: TokenStats, config: RolloutCorrectionConfig) -> TokenColumnTotals:
    """The totals of this rank's ``[N]`` token columns that do not depend on the sequence decisions (see
    :class:`TokenColumnTotals`): stage 1's reductions, taken before collective 1 (``reductions.token_reductions``)."""
    bound = config.safety_bound
    valid_extremes, sums = _ValidExtremes(tokens), _TokenSums(tokens.valid.numel())
    lr, valid = tokens.log_ratio, tokens.valid
    raw_above = raw_below = hist = raw_extremes = None
    if config.is_enabled and config.is_level == "token":
        # invalid tokens hold lr == 0: they can only count when a bound sits on the wrong side of 1
        raw_above = sums.count(outside_flag(lr, -math.inf, math.log(config.is_upper_bound), valid,
                                            tokens.comparisons))
        raw_below = sums.count(outside_flag(lr, math.log(config.is_lower), math.inf, valid, tokens.comparisons))
        hist = histogram(lr, config.quantile_bins_per_octave, bound)  # invalid tokens in the centre bin
        # extremes of clamp(lr) over valid tokens: those of lr, clamped (clamping is monotone, so it commutes with
        # max); -inf (none) stays -inf.  One pass shared with a k1 token RS criterion's extremes of lr.
        pair = valid_extremes.of(lr)
        raw_extremes = torch.where(pair > -math.inf, pair.clamp(-bound, bound), pair)
    rs_bands, rs_extremes = _rs_token_totals(tokens, config, valid_extremes, sums)
    totals = TokenColumnTotals(
        abs_log_ratio_sum=sums.sum(lr, torch.abs),
        clamped_log_ratio_sum=sums.sum(tokens.clamped_log_ratio),
        # sums of r and r^2 over valid tokens: invalid tokens hold r = 1 exactly, so their count comes off after
        ratio_sum_all=sums.sum(tokens.ratio),
        ratio_sq_sum_all=sums.sum_sq(tokens.ratio),
        raw_above=raw_above, raw_below=raw_below,
        rs_bands=rs_bands,
        histogram=hist, raw_extremes=raw_extremes, rs_extremes=rs_extremes)
    values = leaves(totals)
    return with_leaves(totals, sums.resolve(values))


def batch_totals(batch: PackedBatch, reductions: TokenReductions, seqs: SequenceStats, decisions: SequenceDecisions,
                 kept: TokenWeights, config: RolloutCorrectionConfig, reducer: LocalReducer,
                 malformed: torch.Tensor) -> BatchTotals:
    """The totals behind every metric and batch normalization, global over the reducer's batch group.

    One float64 vector goes through collective 2 (SUM): the :class:`TokenTotals` (sums over this rank's tokens, and
    ``malformed``, this rank's input-check flag), the quantile histogram (IS on) and the :class:`SequenceTotals`
    (sums of per-sequence terms, counted by one rank per sequence group); one through collective 3 (MAX): the
    :class:`Extremes`.  Everything stays on the device: no host read.  The token columns were reduced before
    (``reductions``) and the kept weights summed in stage 4 (``kept``): no ``[N]`` tensor is read here.
    """
    column_totals = reductions.totals
    local = with_leaves(seqs.local, _sum_columns(leaves(seqs.local), batch))  # this rank's token counts and sums
    n_invalid = batch.n_tokens - local.valid_tokens
    # kept tokens: those no token rule rejected, in sequences not dropped (exact float64 counts, no pass over N)
    kept_per_seq = seqs.local.valid_tokens if seqs.local.token_rejected is None else \
        seqs.local.valid_tokens - seqs.local.token_rejected
    kept_tokens = (kept_per_seq * ~decisions.drop).sum() if batch.n_seqs else n_invalid * 0
    weight_totals, hist, (raw_max, raw_neg_min) = (None, None, (None, None))
    if config.is_enabled:
        weight_totals, hist = _is_totals(column_totals, seqs, decisions, kept, config, n_invalid)
        if column_totals.raw_extremes is not None:
            raw_max, raw_neg_min = column_totals.raw_extremes.unbind()
    rs_token_stats: Dict[str, RsTokenTotals] = {}
    for c in config.rs:
        if c.granularity == "token":  # the band sums with the statistic's sum, from this rank's sequence sums
            band = column_totals.rs_bands[c.option]
            rs_token_stats[c.option] = RsTokenTotals(
                local.log_ratio if c.statistic == "k1" else local.k_sums[c.option], band.band_sum,
                band.band_sq_sum, band.above)
    rs_token_extremes = {option: RsExtremes(*pair.unbind(), None) for option, pair in column_totals.rs_extremes.items()}
    token = TokenTotals(
        valid=local.valid_tokens, loss=local.valid_tokens + local.nonfinite_tokens, kept=kept_tokens,
        log_ratio_sum=local.log_ratio, abs_log_ratio_sum=column_totals.abs_log_ratio_sum,
        clamped_log_ratio_sum=column_totals.clamped_log_ratio_sum,
        ratio_sum_all=column_totals.ratio_sum_all,
        ratio_sq_sum_all=column_totals.ratio_sq_sum_all,
        invalid=n_invalid, nonfinite=local.nonfinite_tokens,
        veto=local.veto_tokens,
        rs_criteria=dict(local.rs_token_rejections),
        is_mask=local.is_mask_tokens,
        malformed=malformed,
        weights=weight_totals,
        rs_stats=rs_token_stats,
    )
    terms, extreme_columns = _sequence_terms(seqs, decisions, config)
    columns = leaves(extreme_columns)
    if batch.n_seqs:
        maxima = torch.stack(columns, 1).masked_fill(~seqs.has_tokens[:, None], -math.inf).amax(0).unbind()
    else:
        maxima = torch.full((len(columns),), -math.inf, dtype=torch.float64, device=batch.device).unbind()
    extremes = Extremes(token_raw_max=raw_max, token_raw_neg_min=raw_neg_min,
                        sequences=with_leaves(extreme_columns, maxima), rs_tokens=rs_token_extremes)
    return _reduce(token, hist, terms, extremes, reducer, batch, config)


@register_type  # a leaf of the records while the sums wait (see records.register_type)
class _Sum:
    """A sum :class:`_TokenSums` computes later: of column ``index``, of its squares if ``square``."""

    __slots__ = ("index", "square")

    def __init__(self, index: int, square: bool):
        self.index, self.square = index, square


_STACK_TOKENS = 1 << 14
_EXACT_FLOAT32_COUNT = 1 << 24  # float32 holds every integer up to 2**24


class _TokenSums:
    """Sums and sums of squares of ``[N]`` float32 token columns (or of an elementwise ``transform`` of one), in
    float64.  :meth:`sum` / :meth:`sum_sq` hand out placeholders and :meth:`resolve` computes them (a column asked for
    twice is summed once).  Up to ``_STACK_TOKENS`` tokens (a micro-batch: kernel launches are the cost) from one
    ``[k, N]`` float64 stack of the columns: a handful of ops whatever k.  Past it each column where it lies
    (:func:`packed.moments64`): converted to float64 once, in pieces, for both its sum and its sum of squares, the
    transform applied piece by piece -- no ``k x N`` copy and no transformed ``[N]`` buffer (either would raise the
    peak memory per token; the columns themselves live until the call ends anyway)."""

    def __init__(self, n_tokens: int):
        self.stacked = not packed.tracing() and n_tokens <= min(packed.MATRIX_TOKENS, _STACK_TOKENS)
        self.columns: List[Tuple[torch.Tensor, object]] = []  # (column, transform or None), distinct
        self.squared: List[bool] = []

    def _add(self, column: torch.Tensor, square: bool, transform):
        for i, (c, f) in enumerate(self.columns):
            if c is column and f is transform:
                self.squared[i] |= square
                return _Sum(i, square)
        self.columns.append((column, transform))
        self.squared.append(square)
        return _Sum(len(self.columns) - 1, square)

    def sum(self, column: torch.Tensor, transform=None) -> _Sum:
        """The float64 sum of ``column`` (of ``transform(column)``: an elementwise float32 map such as ``abs``)."""
        return self._add(column, False, transform)

    def sum_sq(self, column: torch.Tensor, transform=None) -> _Sum:
        return self._add(column, True, transform)

    def count(self, flags: torch.Tensor):
        """The sum of ``[N]`` float32 0/1 ``flags``: past the stack, summed at once in float32 (every partial sum is
        an integer below 2**24, so exact) and converted -- no float64 copy of the column."""
        if not self.stacked and flags.numel() < _EXACT_FLOAT32_COUNT:
            return flags.sum().double()
        return self._add(flags, False, None)

    def resolve(self, values: List) -> List:
        """``values`` with every placeholder replaced by its 0-d float64 sum."""
        if not self.columns:
            return values
        if not self.stacked:
            moments = [packed.moments64(c, f, sq) for (c, f), sq in zip(self.columns, self.squared)]
            return [(moments[v.index][1] if v.square else moments[v.index][0]) if isinstance(v, _Sum) else v
                    for v in values]
        # the squared columns first, so that their squares are one slice of the matrix; stacked straight into
        # float64 (no float32 stack and copy); a transformed column is made whole here (a micro-batch's)
        order = sorted(range(len(self.columns)), key=lambda i: not self.squared[i])
        row = {i: r for r, i in enumerate(order)}
        first = self.columns[0][0]
        m = torch.empty(len(order), first.numel(), dtype=torch.float64, device=first.device)
        torch.stack([c if f is None else f(c) for c, f in (self.columns[i] for i in order)], out=m)
        n_sq = sum(self.squared)
        plain, squares = m.sum(1).unbind(), (m[:n_sq] * m[:n_sq]).sum(1).unbind()  # (mul: faster than pow)
        done = {(i, False): plain[row[i]] for i in order}
        done.update({(i, True): squares[row[i]] for i in order[:n_sq]})
        return [done[(v.index, v.square)] if isinstance(v, _Sum) else v for v in values]


def _sum_columns(columns: List[torch.Tensor], batch: PackedBatch) -> List[torch.Tensor]:
    """``k x [B] -> k x 0-d``: column sums in one op."""
    if not batch.n_seqs:
        return list(torch.zeros(len(columns), dtype=torch.float64, device=batch.device).unbind())
    return list(torch.stack(columns).sum(1).unbind())


def _is_totals(column_totals: TokenColumnTotals, seqs: SequenceStats, decisions: SequenceDecisions, kept: TokenWeights,
               config: RolloutCorrectionConfig, n_invalid: torch.Tensor):
    """IS on: the :class:`TokenWeightTotals` and the ``[num_bins]`` histogram of the raw log-ratio (token level: the
    token columns' histogram with the invalid tokens taken out of the centre bin, where their ``log r = 0`` put
    them; sequence/geometric level: the raw sequence log-ratio, counted once per valid token)."""
    bound, bins = config.safety_bound, config.quantile_bins_per_octave
    if config.is_level == "token":
        raw_above, raw_below = column_totals.raw_above, column_totals.raw_below
        hist = column_totals.histogram.clone()  # (the reductions' own: a caller may hold them)
        hist[hist.numel() // 2] -= n_invalid
    else:
        log_hi, log_lo = math.log(config.is_upper_bound), math.log(config.is_lower)
        # token-weighted sums of a per-sequence value use this rank's token counts: exact after the SUM
        local_n, raw = seqs.local.valid_tokens, decisions.raw_log_ratio
        raw_above = (local_n * (raw > log_hi)).sum()
        raw_below = (local_n * (raw < log_lo)).sum()
        hist = histogram(raw.clamp(-bound, bound), bins, bound, weights=local_n)
    return TokenWeightTotals(kept.kept_sum, kept.kept_sq_sum, raw_above, raw_below), hist


class _ValidExtremes:
    """``[max, -min]`` of a ``[N]`` token statistic over this rank's valid tokens (``[2]`` float64; -inf when there
    are none), each statistic computed once per call (the IS raw extremes and a k1 token RS criterion's are both
    those of ``log r``).  Exact: invalid tokens are replaced by -inf (then +inf), so no finite stand-in can collide
    with an unclamped ``log r``."""

    def __init__(self, tokens: TokenStats):
        self.valid = tokens.valid
        self._is_valid: Optional[torch.Tensor] = None
        self._done: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def of(self, stat: torch.Tensor) -> torch.Tensor:
        for seen, pair in self._done:
            if seen is stat:
                return pair
        if stat.numel():
            if self._is_valid is None:
                self._is_valid = self.valid > 0
            # one [N] buffer for both: stat where valid, -inf (then +inf) elsewhere
            masked = torch.where(self._is_valid, stat, -math.inf)
            top = masked.max()
            out = None if packed.tracing() else masked  # (compiled: no buffer at all)
            bottom = torch.where(self._is_valid, stat, stat.new_full((), math.inf), out=out).min()
            pair = torch.stack([top, bottom.neg()]).double()
        else:  # no tokens on this rank (a shape, not a value: no read)
            pair = torch.full((2,), -math.inf, dtype=torch.float64, device=stat.device)
        self._done.append((stat, pair))
        return pair


def _band(c) -> Tuple[float, float]:
    """The band verl clamps an RS statistic into for its ``_std``: ``[lo, hi]`` of a k1 criterion (log-ratio
    space), ``[0, upper]`` for k2/k3 (a divergence has no lower bound)."""
    lo, hi = c.log_bounds
    return (0.0 if lo == -math.inf else lo), hi


def _rs_token_totals(tokens: TokenStats, config: RolloutCorrectionConfig, valid_extremes: _ValidExtremes,
                     sums: _TokenSums):
    """Token-level RS criteria: option -> :class:`RsTokenTotals` without ``stat_sum`` (this rank's band sums
    over valid tokens and the k1 count above the band), and option -> ``[2]`` (max of ``s_t``, max of ``-s_t``)
    over valid tokens (-inf when there are none)."""
    bands: Dict[str, RsTokenTotals] = {}
    extremes: Dict[str, torch.Tensor] = {}
    valid = tokens.valid
    for c in config.rs:
        if c.granularity != "token":
            continue
        k1 = c.statistic == "k1"
        # the statistic the criterion tests (0 on invalid tokens): log r unclamped for k1, k2/k3 otherwise
        stat = tokens.log_ratio if k1 else tokens.k_sum_terms[c.option]
        lo, hi = _band(c)
        if lo > 0 or hi < 0:  # 0 (an invalid token) lies outside the band: clamping moved it, put it back
            column, band = stat.clamp(lo, hi).mul_(valid), None
        else:  # clamped piece by piece as it is summed (the same function for both sums: clamped once in a stack)
            column, band = stat, functools.partial(torch.clamp, min=lo, max=hi)
        bands[c.option] = RsTokenTotals(  # stat_sum: batch_totals takes it from the sequence sums
            stat_sum=None, band_sum=sums.sum(column, band), band_sq_sum=sums.sum_sq(column, band),
            above=sums.count(outside_flag(stat, -math.inf, hi, valid, tokens.comparisons)) if k1 else None)
        extremes[c.option] = valid_extremes.of(stat)
    return bands, extremes


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
    # the eight perplexity terms as rows of one [8, B] matrix (a few ops for all of them), over valid sequences:
    # -m_t, -m_r, d, |d|, then exp of -m_t, -m_r (overflow guard), d and 2 S (safety bound)
    logs = torch.cat([torch.stack([mean_train, mean_rollout]).neg_(), log_ppl_diff[None]])
    lo, hi, scale = _ppl_bounds(bound, logs.device)
    exps = torch.cat([logs, sums.log_ratio[None]]).clamp_(lo, hi).mul_(scale).exp_()
    ppl = torch.cat([logs, log_ppl_diff.abs()[None], exps]).mul_(has_tokens).unbind()

    weights = None
    w = raw = None
    if config.is_enabled:
        w, raw = decisions.sequence_weight, decisions.raw_log_ratio
        log_hi, log_lo = math.log(config.is_upper_bound), math.log(config.is_lower)
        weights = SequenceWeightTotals(
            kept_sum=torch.where(decisions.kept, w, 0.0) if seq_level else None,
            weight=w * has_tokens, weight_sq=w * w * has_tokens,
            above=has_tokens & (raw > log_hi), below=has_tokens & (raw < log_lo))
    rs_stats, rs_extremes = _rs_sequence_terms(seqs, decisions, config)
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
        train_log_ppl=ppl[0],
        train_ppl=ppl[4],
        rollout_log_ppl=ppl[1],
        rollout_ppl=ppl[5],
        log_ppl_diff=ppl[2],
        log_ppl_abs_diff=ppl[3],
        ppl_ratio=ppl[6],
        seq_ratio_sq=ppl[7],
        weights=weights,
        rs_stats=rs_stats,
    )
    seq_raw = raw if seq_level else None
    extreme_columns = SequenceExtremes(
        log_ppl_diff_max=log_ppl_diff, log_ppl_diff_neg_min=-log_ppl_diff,
        raw_max=seq_raw, raw_neg_min=None if seq_raw is None else -seq_raw,
        weight_max=w, weight_neg_min=None if w is None else -w, weight_max_dev=None if w is None else (w - 1).abs(),
        rs_stats=rs_extremes)
    return terms, extreme_columns


_PPL_BOUNDS: Dict[tuple, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _ppl_bounds(bound: float, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[4, 1]`` float64 clamp bounds and scales of the exponentiated perplexity terms (-m_t, -m_r: at most
    ``_PPL_EXP_MAX``; d and S: +-``bound``; S is doubled after the clamp), uploaded once per bound and device."""
    return packed.process_cached(_PPL_BOUNDS, (bound, str(device)), 64, lambda: tuple(
        upload(v, torch.float64, device).view(4, 1) for v in (
            [-math.inf, -math.inf, -bound, -bound], [_PPL_EXP_MAX, _PPL_EXP_MAX, bound, bound], [1.0, 1.0, 1.0, 2.0])))


def _rs_sequence_terms(seqs: SequenceStats, decisions: SequenceDecisions, config: RolloutCorrectionConfig):
    """Every RS criterion's ``[B]`` terms of its per-sequence statistic ``v_i`` (``decisions.rs_values``, 0 on
    sequences without valid tokens): option -> :class:`RsSequenceTotals` summands (valid sequences; the token-
    weighted ones for sequence criteria, with the global token counts ``n_i``) and option -> :class:`RsExtremes`
    columns (``v_i``, ``-v_i``, ``|v_i|``; batch_totals leaves out the sequences without valid tokens)."""
    has_tokens, n = seqs.has_tokens, seqs.sums.valid_tokens
    totals: Dict[str, RsSequenceTotals] = {}
    extremes: Dict[str, RsExtremes] = {}
    for c in config.rs:
        v = decisions.rs_values[c.option]
        lo, hi = c.log_bounds
        token_sum = band_sum = band_sq_sum = None
        if c.granularity == "sequence":
            # verl gives each token its sequence's value: token-weighted sums (n_i = 0 off the valid sequences)
            band = v.clamp(*_band(c))
            token_sum, band_sum, band_sq_sum = n * v, n * band, n * band * band
        totals[c.option] = RsSequenceTotals(
            value=v, value_sq=v * v,  # v = 0 on sequences without valid tokens
            above=has_tokens & (v > hi), below=has_tokens & (v < lo) if c.statistic == "k1" else None,
            token_sum=token_sum, band_sum=band_sum, band_sq_sum=band_sq_sum)
        extremes[c.option] = RsExtremes(v, -v, v.abs())
    return totals, extremes


def _pack(values: List[torch.Tensor], device) -> torch.Tensor:
    """One float64 vector of 0-d tensors, in the order of ``values`` (the collectives add / take the maximum
    position by position, so the order is the same on every rank)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    # stack promotes (bool, int64, float32 -> the widest), but converts each value on its own: the engine hands in
    # float64 values only (then one kernel copies them all)
    return torch.stack(values).to(torch.float64)


def _positions(record, start: int = 0):
    """A copy of ``record`` whose leaves are their positions ``start, start + 1, ...`` in the reduced vector."""
    return with_leaves(record, range(start, start + len(leaves(record))))


def _reduce(token: TokenTotals, hist: Optional[torch.Tensor], terms: SequenceTotals, extremes: Extremes,
            reducer: LocalReducer, batch: PackedBatch, config: RolloutCorrectionConfig) -> BatchTotals:
    """The last collective: this rank's totals and extremes -> the batch's, as two float64 vectors on the device
    and records of the positions in them (no per-value tensor is made: the metrics read them by index)."""
    dev = batch.device
    head = _pack(leaves(token), dev)
    columns = leaves(terms)
    # Sequence-level totals are identical on every rank of a sequence group: exactly one rank counts them.
    if batch.n_seqs and reducer.counts_sequences:
        seq_sums = torch.stack(columns, 1).sum(0, dtype=torch.float64)
    else:
        seq_sums = torch.zeros(len(columns), dtype=torch.float64, device=dev)
    parts = [head, seq_sums] + ([hist] if hist is not None else [])  # the histogram last: sums[:k] are the scalars
    sums, maxes = reducer.reduce_totals(torch.cat(parts), _pack(leaves(extremes), dev))  # the last collective
    k = head.numel() + seq_sums.numel()
    positions = packed.process_cached(_POSITIONS, config, 256, lambda: (  # which leaves exist depends on the config only
        _positions(token), _positions(terms, head.numel()), _positions(extremes)))
    return BatchTotals(*positions, sums=sums[:k], maxes=maxes, histogram=sums[k:] if hist is not None else None)


_POSITIONS: Dict[RolloutCorrectionConfig, tuple] = {}


class _Linear:
    """A linear combination of reduced totals (position -> coefficient), to build the metric plan with."""

    def __init__(self, terms: Dict[int, float]):
        self.terms = terms

    @classmethod
    def of(cls, position: Optional[int]) -> "_Linear":
        return cls({} if position is None else {position: 1.0})

    def __add__(self, other: "_Linear") -> "_Linear":
        out = dict(self.terms)
        for k, v in other.terms.items():
            out[k] = out.get(k, 0.0) + v
        return _Linear(out)

    def __neg__(self) -> "_Linear":
        return _Linear({k: -v for k, v in self.terms.items()})

    def __sub__(self, other: "_Linear") -> "_Linear":
        return self + (-other)


class _MetricPlan:
    """What :func:`finish_metrics` computes for one config, as index tensors and one ``[2M, K]`` matrix on the
    device: ``M`` quotients ``num / den`` (0 where ``den = 0``; plus an offset, -1 for chi^2) whose numerators
    and denominators are linear in the reduced totals, extremes (0 when not finite), and the few nonlinear IS
    values.  Built once per config and device (cached), so a call runs a fixed, small number of kernels."""

    def __init__(self, t: BatchTotals, config: RolloutCorrectionConfig, device):
        P = _Linear.of
        tok, seq, ext = t.tokens, t.seqs, t.extremes
        tokens, seqs, loss_tokens, all_seqs = P(tok.valid), P(seq.valid), P(tok.loss), P(seq.loss)
        ratios = {  # name -> (numerator, denominator, offset)
            "training_log_ppl": (P(seq.train_log_ppl), seqs, 0.0),
            "training_ppl": (P(seq.train_ppl), seqs, 0.0),
            "rollout_log_ppl": (P(seq.rollout_log_ppl), seqs, 0.0),
            "rollout_ppl": (P(seq.rollout_ppl), seqs, 0.0),
            "log_ppl_diff": (P(seq.log_ppl_diff), seqs, 0.0),
            "log_ppl_abs_diff": (P(seq.log_ppl_abs_diff), seqs, 0.0),
            "ppl_ratio": (P(seq.ppl_ratio), seqs, 0.0),
            "kl": (-P(tok.log_ratio_sum), tokens, 0.0),
            # sums of r over valid tokens: the invalid ones held r = 1 exactly
            "k3_kl": (P(tok.ratio_sum_all) - P(tok.invalid) - tokens - P(tok.clamped_log_ratio_sum), tokens, 0.0),
            "chi2_token": (P(tok.ratio_sq_sum_all) - P(tok.invalid), tokens, -1.0),
            "chi2_seq": (P(seq.seq_ratio_sq), seqs, -1.0),
            "train_rollout_logprob_abs_diff": (P(tok.abs_log_ratio_sum), tokens, 0.0),
            "rejected_token_fraction": (loss_tokens - P(tok.kept), loss_tokens, 0.0),
            "rejected_seq_fraction": (P(seq.rejected), all_seqs, 0.0),
        }
        extremes = {  # name -> (position in the maxima, sign)
            "log_ppl_diff_max": (ext.sequences.log_ppl_diff_max, 1.0),
            "log_ppl_diff_min": (ext.sequences.log_ppl_diff_neg_min, -1.0),
        }
        if config.on_nonfinite == "reject":
            ratios["nonfinite_token_fraction"] = (P(tok.nonfinite), loss_tokens, 0.0)
            ratios["nonfinite_seq_fraction"] = (P(seq.nonfinite), all_seqs, 0.0)
        self.is_enabled = config.is_enabled
        if config.is_enabled:
            w, sw = tok.weights, seq.weights
            ratios["rollout_is_mean"] = (P(w.kept_sum), P(tok.kept), 0.0)
            ratios["_mean_sq"] = (P(w.kept_sq_sum), P(tok.kept), 0.0)
            ratios["rollout_is_ratio_fraction_high"] = (P(w.raw_above), tokens, 0.0)
            ratios["rollout_is_ratio_fraction_low"] = (P(w.raw_below), tokens, 0.0)
            ratios["rollout_is_seq_mean"] = (P(sw.weight), seqs, 0.0)
            ratios["_seq_mean_sq"] = (P(sw.weight_sq), seqs, 0.0)
            ratios["rollout_is_seq_fraction_high"] = (P(sw.above), seqs, 0.0)
            ratios["rollout_is_seq_fraction_low"] = (P(sw.below), seqs, 0.0)
            extremes["_log_min"] = (ext.raw_neg_min, -1.0)
            extremes["_log_max"] = (ext.raw_max, 1.0)
            extremes["rollout_is_seq_min"] = (ext.sequences.weight_neg_min, -1.0)
            extremes["rollout_is_seq_max"] = (ext.sequences.weight_max, 1.0)
            extremes["rollout_is_seq_max_deviation"] = (ext.sequences.weight_max_dev, 1.0)
            if config.is_mode == "mask":
                is_mask_tokens = tok.is_mask if tok.is_mask is not None else seq.is_mask_tokens
                ratios["rollout_is_masked_fraction"] = (P(is_mask_tokens), tokens, 0.0)
                ratios["rollout_is_seq_masked_fraction"] = (P(seq.is_mask_seqs), all_seqs, 0.0)
        if config.rs:
            ratios["rollout_rs_masked_fraction"] = (P(seq.rs_tokens), tokens, 0.0)
            ratios["rollout_rs_seq_masked_fraction"] = (P(seq.rs_seqs), all_seqs, 0.0)
            for c in config.rs:
                name = f"rollout_rs_{c.option}"
                count = tok.rs_criteria.get(c.option)
                count = count if count is not None else seq.rs_criteria[c.option].tokens
                ratios[name + "_masked_fraction"] = (P(count), tokens, 0.0)
                ratios[name + "_seq_masked_fraction"] = (P(seq.rs_criteria[c.option].seqs), all_seqs, 0.0)
                _rs_statistics(name, c, t, ratios, extremes, tokens, seqs)
        if config.veto_threshold is not None:
            ratios["rollout_is_veto_fraction"] = (P(seq.veto), all_seqs, 0.0)
            ratios["rollout_is_catastrophic_token_fraction"] = (P(tok.veto), tokens, 0.0)

        # RS standard deviations: (name, names of the mean, the mean square, the max and the min of the values,
        # count's position, n/(n-1) or not, the band the values are clamped into)
        rs_stds = []
        for c in config.rs:
            o = f"rollout_rs_{c.option}"
            rs_stds += [(o + "_std", f"_{o}_std_m1", f"_{o}_std_m2", o + "_max", o + "_min", tok.valid, 0.0,
                         _band(c)),
                        (o + "_seq_std", o + "_seq_mean", f"_{o}_seq_std_m2", o + "_seq_max", o + "_seq_min",
                         seq.valid, 1.0, (-math.inf, math.inf))]
        rs_stds = list({r[0]: r for r in rs_stds}.values())  # an option given twice: once

        k, m = t.sums.numel(), len(ratios)
        matrix = [[0.0] * k for _ in range(2 * m)]
        for i, (num, den, _) in enumerate(ratios.values()):
            for row, expr in ((i, num), (m + i, den)):
                for pos, coef in expr.terms.items():
                    matrix[row][pos] += coef
        self.matrix = upload(matrix, torch.float64, device)
        self.offset = upload([off for _, _, off in ratios.values()], torch.float64, device)
        self.ext_index = upload([pos for pos, _ in extremes.values()], torch.int64, device)
        self.ext_sign = upload([sign for _, sign in extremes.values()], torch.float64, device)
        self.valid = tok.valid
        # the vector finish_metrics assembles: quotients, extremes, then (IS on) std, seq std, ESS, the ratio
        # extremes and quantiles, the batch-normalization factor; names in that order ("_..." are internal)
        names = list(ratios) + list(extremes)
        if config.is_enabled:
            self.pairs = upload([[names.index("rollout_is_mean"), names.index("rollout_is_seq_mean")],
                                 [names.index("_mean_sq"), names.index("_seq_mean_sq")]], torch.int64, device)
            self.log_extremes = upload([names.index("_log_min"), names.index("_log_max")], torch.int64, device)
            names += ["rollout_is_std", "rollout_is_seq_std", "rollout_is_eff_sample_size", "rollout_is_min",
                      "rollout_is_max"] + [f"rollout_is_p{round(q * 100)}" for q in QUANTILES]
            if config.is_batch_normalize:
                names.append("rollout_is_batch_norm_factor")
        self.rs_moments = self.rs_count = self.rs_unbiased = self.rs_band = None
        if rs_stds:
            self.rs_moments = upload([[names.index(r[i]) for r in rs_stds] for i in (1, 2, 3, 4)], torch.int64,
                                     device)
            self.rs_count = upload([r[5] for r in rs_stds], torch.int64, device)
            self.rs_unbiased = upload([r[6] for r in rs_stds], torch.float64, device)
            self.rs_band = upload([[r[7][0] for r in rs_stds], [r[7][1] for r in rs_stds]], torch.float64, device)
            names += [r[0] for r in rs_stds]
        position = {name: i for i, name in enumerate(names)}
        self.names = [name for name in _order(config) if name in position]
        self.order = upload([position[name] for name in self.names], torch.int64, device)
        self.n_ratios = m


_PLANS: Dict[tuple, _MetricPlan] = {}


def _plan(t: BatchTotals, config: RolloutCorrectionConfig) -> _MetricPlan:
    """The cached plan of ``config`` on this device (positions depend on the config only)."""
    key = (config, t.sums.device, t.sums.numel(), t.maxes.numel())
    return packed.process_cached(_PLANS, key, 256, lambda: _MetricPlan(t, config, t.sums.device))


def finish_metrics(t: BatchTotals, config: RolloutCorrectionConfig,
                   norm: Optional[torch.Tensor]) -> Tuple[List[str], torch.Tensor]:
    """``(names, values)``: the metric names (in :data:`METRICS` order) and their values, one float64 vector on the
    device, from the reduced batch totals; ``norm``: the batch normalization factor (None when off).  A fixed, small
    number of kernels whatever the config: one matrix-vector product gives every numerator and denominator."""
    plan = _plan(t, config)
    m = plan.n_ratios
    nd = plan.matrix @ t.sums
    num, den = nd[:m], nd[m:]
    some = den > 0
    quotients = torch.where(some, num / torch.where(some, den, 1.0) + plan.offset, 0.0)
    ext = t.maxes[plan.ext_index] * plan.ext_sign
    parts = [quotients, torch.nan_to_num(ext, nan=0.0, posinf=0.0, neginf=0.0)]  # extremes of empty sets: 0
    flat = torch.cat(parts) if plan.is_enabled or plan.rs_moments is not None else None
    if plan.is_enabled:
        mean, mean_sq = flat[plan.pairs]  # [2]: token level, sequence level
        parts.append((mean_sq - mean * mean).clamp(min=0.0).sqrt())
        # ESS; no weight mass (E[w^2] = 0) means E[w] = 0 too (w >= 0): 0 / tiny = 0
        parts.append(mean[:1] * mean[:1] / mean_sq[:1].clamp(min=1e-300))
        bound = config.safety_bound
        log_q = quantiles_from_histogram(t.histogram, config.quantile_bins_per_octave, bound)
        logs = torch.cat([flat[plan.log_extremes].clamp(-bound, bound), log_q])
        parts.append(torch.where(t.sums[plan.valid] > 0, logs.exp(), 0.0))
        if norm is not None:
            parts.append(norm.reshape(1).to(torch.float64))
    if plan.rs_moments is not None:
        # RS standard deviations from the first two moments; over n sequences verl's torch.std divides by n - 1
        mean, mean_sq, top, bottom = flat[plan.rs_moments]  # [R] each
        n = t.sums[plan.rs_count]
        bessel = 1.0 + plan.rs_unbiased / (n - 1.0).clamp(min=1.0)  # n / (n - 1) where unbiased, else 1
        var = (mean_sq - mean * mean).clamp(min=0.0) * bessel
        # values that are all equal (their clamped extremes are) have std 0 exactly, not the rounding of
        # E[x^2] - E[x]^2 (~1e-8 |x| after the sqrt, which would also depend on the summation order)
        lo, hi = plan.rs_band
        spread = torch.minimum(torch.maximum(top, lo), hi) != torch.minimum(torch.maximum(bottom, lo), hi)
        parts.append(torch.where((n > 1) & spread, var.sqrt(), 0.0))  # verl: 0 below two values
    return plan.names, torch.cat(parts)[plan.order]


_PER_OPTION = [name.replace("<option>", "{}") for name in METRICS if "<option>" in name]


def _order(config: RolloutCorrectionConfig) -> List[str]:
    """Metric names in the order of :data:`METRICS`, each RS option's names together in ``config.rs`` order
    (an option given twice keeps its first place); names a config does not report are dropped by the plan."""
    names = []
    for name in METRICS:
        if name == "rollout_rs_<option>_masked_fraction":
            for c in config.rs:
                names += [template.format(c.option) for template in _PER_OPTION]
        elif "<option>" not in name:
            names.append(name)
    return list(dict.fromkeys(names))


def _rs_statistics(name: str, c, t: BatchTotals, ratios: dict, extremes: dict, tokens: _Linear,
                   seqs: _Linear) -> None:
    """Adds criterion ``c``'s verl statistics (see :data:`METRICS`) to the plan's ``ratios`` and ``extremes``;
    ``tokens`` / ``seqs``: the valid tokens / sequences.  ``_*_m1`` / ``_*_m2``: the moments behind the stds."""
    P = _Linear.of
    tok, seq = t.tokens, t.seqs
    sq, sx = seq.rs_stats[c.option], t.extremes.sequences.rs_stats[c.option]
    k1 = c.statistic == "k1"
    if c.granularity == "token":
        st, tx = tok.rs_stats[c.option], t.extremes.rs_tokens[c.option]
        rejected = P(tok.rs_criteria[c.option])  # above + below: the two tests are disjoint
        above = P(st.above) if k1 else rejected  # k2/k3: nothing lies below a divergence's 0
        ratios[name + "_mean"] = (P(st.stat_sum), tokens, 0.0)
        ratios[f"_{name}_std_m1"] = (P(st.band_sum), tokens, 0.0)
        ratios[f"_{name}_std_m2"] = (P(st.band_sq_sum), tokens, 0.0)
        ratios[name + "_fraction_high"] = (above, tokens, 0.0)
        if k1:
            ratios[name + "_fraction_low"] = (rejected - above, tokens, 0.0)
        extremes[name + "_max"] = (tx.max, 1.0)
        extremes[name + "_min"] = (tx.neg_min, -1.0)
    else:  # the per-sequence value stands for each of its tokens; extremes and fractions are per sequence
        ratios[name + "_mean"] = (P(sq.token_sum), tokens, 0.0)
        ratios[f"_{name}_std_m1"] = (P(sq.band_sum), tokens, 0.0)
        ratios[f"_{name}_std_m2"] = (P(sq.band_sq_sum), tokens, 0.0)
        ratios[name + "_fraction_high"] = (P(sq.above), seqs, 0.0)
        if k1:
            ratios[name + "_fraction_low"] = (P(sq.below), seqs, 0.0)
        extremes[name + "_max"] = (sx.max, 1.0)
        extremes[name + "_min"] = (sx.neg_min, -1.0)
    ratios[name + "_seq_mean"] = (P(sq.value), seqs, 0.0)
    ratios[f"_{name}_seq_std_m2"] = (P(sq.value_sq), seqs, 0.0)
    ratios[name + "_seq_fraction_high"] = (P(sq.above), seqs, 0.0)
    if k1:
        ratios[name + "_seq_fraction_low"] = (P(sq.below), seqs, 0.0)
    extremes[name + "_seq_max"] = (sx.max, 1.0)
    extremes[name + "_seq_min"] = (sx.neg_min, -1.0)
    extremes[name + "_seq_max_deviation"] = (sx.abs_max, 1.0)
