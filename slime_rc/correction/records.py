"""The records that pass between the stages of the correction engine (see ``slime_rc.correction.engine``).

Shapes: this rank holds ``N`` tokens of ``B`` packed sequences (``slime_rc.correction.packed``); ``[N]`` is per
token, ``[B]`` per sequence.  ``r = pi_train / pi_rollout``; "valid" tokens are loss tokens with finite log-probs.
Dicts keyed by ``str`` are keyed by ``RejectionCriterion.option``, in ``config.rs`` order (an option given twice
keeps its first place and the values of its last criterion, as the metric names do).

=================  ==========================================  ======================================================
record             produced by                                 consumed by
=================  ==========================================  ======================================================
PackedBatch        engine (validated inputs)                   every stage
TokenStats         1. token_stats.token_statistics             1's reductions (reductions.token_reductions)
TokenReductions    1. reductions.token_reductions              2, 4, batch totals
SequenceStats      2. sequence_stats.sequence_statistics       3, batch totals, the result's ``sequences``
SequenceDecisions  3. weights.sequence_decisions               4, batch totals, the non-finite error, ``sequences``
TokenWeights       4. weights.token_weights                    batch totals, 5. weights.batch_normalize, ``keep_mask``
BatchTotals        metrics.batch_totals (collectives 2 and 3)  5. weights.batch_normalize, metrics.finish_metrics
=================  ==========================================  ======================================================

What crosses ranks travels in records too: :class:`SequenceSums` (collective 1) and the totals records
:class:`TokenTotals`, :class:`SequenceTotals`, :class:`Extremes` (collectives 2 and 3) hold one value per field,
this rank's before the reduction and the reduced one after it (same record type).  :func:`leaves` flattens a record
into the reducer's vector and :func:`with_leaves` puts the reduced values back, both in field order: **field order
is the layout of the collective's vector**, so a new field goes where its value should sit in it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

# A field of a totals record: before the reduction a 0-d tensor (TokenTotals, Extremes) or a ``[B]`` per-sequence
# term (SequenceTotals, SequenceExtremes); after it its position (an int) in the reduced vector (BatchTotals).
Number = Union[torch.Tensor, int, float]


# ---- flattening records into the reducer's vectors ---------------------------------------------------------------
_FIELDS: Dict[type, Optional[Tuple[str, ...]]] = {}


def _fields_of(cls: type) -> Optional[Tuple[str, ...]]:
    """A record type's field names (None for anything else), cached: the walks below run on the hot path."""
    try:
        return _FIELDS[cls]
    except KeyError:
        names = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None
        _FIELDS[cls] = names
        return names


def leaves(record: Any) -> List[Any]:
    """The values of a record in field order, entering nested records and dicts; ``None`` (absent) is skipped."""
    out: List[Any] = []

    def walk(x):
        names = _fields_of(type(x))
        if names is not None:
            d = x.__dict__
            for name in names:
                if d[name] is not None:
                    walk(d[name])
        elif type(x) is dict:
            for v in x.values():
                if v is not None:
                    walk(v)
        else:
            out.append(x)

    walk(record)
    return out


def with_leaves(record: Any, values: Iterable[Any]) -> Any:
    """A copy of ``record`` whose leaves (see :func:`leaves`) are replaced by ``values``, in the same order."""
    it = iter(values)

    def build(x):
        names = _fields_of(type(x))
        if names is not None:
            d = x.__dict__
            fields = {name: None if d[name] is None else build(d[name]) for name in names}
            if torch.compiler.is_compiling():  # (torch 2.11's dynamo cannot trace __dict__.update: a graph break)
                return type(x)(**fields)
            new = object.__new__(type(x))  # the fields are set directly: no __init__ per record on the hot path
            new.__dict__.update(fields)
            return new
        if type(x) is dict:
            return {k: None if v is None else build(v) for k, v in x.items()}
        return next(it)

    out = build(record)
    if next(it, None) is not None:
        raise ValueError("with_leaves: more values than leaves")
    return out


# ---- inputs ----------------------------------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """The validated inputs of one call (``slime_rc.correction.packed.packed_inputs``).

    ``train`` / ``rollout``: ``[N]`` float32 log pi_train / log pi_rollout.  ``mask``: ``[N]`` float32 0/1 loss
    mask.
    ``cu_seqlens``: ``[B+1]`` int64 sequence boundaries.  ``lengths``: ``[B]`` int64 tokens of each sequence here.
    ``sequence_ids``: ``[N]`` int32 sequence of each token (``packed.token_sequence_ids``), built once per call for
    every ``[B] -> [N]`` gather (``values.index_select(0, sequence_ids)``).
    """

    train: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: torch.Tensor
    sequence_ids: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.train.numel()

    @property
    def n_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.train.device


# ---- stage 1 ---------------------------------------------------------------------------------------------------
@dataclass
class TokenStats:
    """Stage 1: per-token quantities of this rank.  Every flag is ``[N]`` float32 0/1 (sums and products of
    flags are counts and intersections; on CPU float arithmetic is several times faster than bool's).

    ``valid``: loss token with finite log-probs.
    ``log_ratio``: ``[N]`` float32 ``log r = log pi_train - log pi_rollout``, unclamped; 0 on invalid tokens.
    ``clamped_log_ratio``: ``[N]`` float32 ``clamp(log r, -safety_bound, safety_bound)``.
    ``ratio``: ``[N]`` float32 ``exp(clamped_log_ratio)``, the safety-bounded ratio; exactly 1 on invalid tokens.
    ``rollout_log_probs``: ``[N]`` float32 log pi_rollout, 0 on invalid tokens.
    ``nonfinite``: loss tokens with a NaN/inf log-prob.
    ``veto``: valid tokens whose unclamped ratio is below ``veto_threshold``; None without veto.
    ``rs_token``: option -> valid tokens rejected by that token-level RS criterion.
    ``is_mask``: valid tokens whose ratio leaves ``[is_lower, is_upper_bound]`` under token-level mask mode, else
        None.
    ``rs_rejected``: union of ``rs_token``; None without token-level RS criteria.
    ``rejected``: union of ``rs_token`` and ``is_mask``; None when neither exists.
    ``keep``: valid tokens that no token-level rule rejects (``valid - rejected``).
    ``is_weight``: ``[N]`` float32 bounded token IS weight ``weights.bounded_weight(ratio)`` on valid tokens, 0 on
        invalid ones (token-level IS only, else None); the keep mask is applied in stage 4.
    ``k_sum_terms``: option -> ``[N]`` float32 per-token k2/k3 (0 on invalid tokens) of each sequence criterion that
        sums or averages it and of each token k2/k3 criterion (its per-sequence mean is a metric); ``k_max_terms``:
        the same with -inf on invalid tokens for the criteria that take the max.
    ``comparisons``: the :class:`slime_rc.correction.weights.Comparisons` behind the flags, for the metrics' own
    threshold tests (its flags are shared: never modified in place).
    ``counts``: the flag tensors above (``packed.segment_sums`` sums them as counts, exactly in float32).
    """

    valid: torch.Tensor
    log_ratio: torch.Tensor
    clamped_log_ratio: torch.Tensor
    ratio: torch.Tensor
    rollout_log_probs: torch.Tensor
    nonfinite: torch.Tensor
    veto: Optional[torch.Tensor]
    rs_token: Dict[str, torch.Tensor]
    is_mask: Optional[torch.Tensor]
    rs_rejected: Optional[torch.Tensor]
    rejected: Optional[torch.Tensor]
    keep: torch.Tensor
    is_weight: Optional[torch.Tensor]
    k_sum_terms: Dict[str, torch.Tensor]
    k_max_terms: Dict[str, torch.Tensor]
    comparisons: Any
    counts: Tuple[torch.Tensor, ...] = ()


@dataclass
class TokenColumnTotals:
    """Totals of this rank's ``[N]`` token columns that the sequence decisions do not change (0-d float64 unless
    said; the token-level parts of :class:`TokenTotals` and :class:`Extremes`).

    ``abs_log_ratio_sum`` / ``clamped_log_ratio_sum``: sums of ``|log r|`` / ``clamp(log r)`` over valid tokens.
    ``ratio_sum_all`` / ``ratio_sq_sum_all``: sums of the bounded ``r`` / ``r^2`` over all N tokens (invalid ones
    hold ``r = 1``).  ``rs_bands``: option -> :class:`RsTokenTotals` of a token-level RS criterion, without
    ``stat_sum`` (None).  ``rs_extremes``: option -> ``[2]`` (max of ``s_t``, max of ``-s_t``) over valid tokens.
    Token-level IS only (else None): ``raw_above`` / ``raw_below`` valid tokens whose raw ratio lies above
    ``is_upper_bound`` / below ``is_lower``; ``histogram`` ``[num_bins]`` counts of ``log r`` over all N tokens
    (the invalid ones, ``log r = 0``, in the centre bin: the batch totals take them out); ``raw_extremes`` ``[2]``
    (max of ``clamp(log r)``, max of ``-clamp(log r)``) over valid tokens, -inf when there are none.
    """

    abs_log_ratio_sum: Number
    clamped_log_ratio_sum: Number
    ratio_sum_all: Number
    ratio_sq_sum_all: Number
    raw_above: Optional[Number]
    raw_below: Optional[Number]
    rs_bands: Dict[str, "RsTokenTotals"]
    histogram: Optional[torch.Tensor]
    raw_extremes: Optional[torch.Tensor]
    rs_extremes: Dict[str, torch.Tensor]


@dataclass
class TokenReductions:
    """Stage 1 reduced: what the later stages read of this rank's token columns, taken in one place before
    collective 1 (``reductions.token_reductions``).

    ``local``: this rank's :class:`SequenceSums` (``[B]`` each, before collective 1).  ``k_maxes``: option ->
    ``[B]`` this rank's max of k2/k3 per sequence (-inf where it holds no valid token) for the sequence criteria
    with aggregate ``max``.  ``totals``: :class:`TokenColumnTotals`.  ``keep`` / ``is_weight``: the ``[N]``
    :class:`TokenStats` fields of those names, which stage 4 turns into the keep mask and weights.
    """

    local: "SequenceSums"
    k_maxes: Dict[str, torch.Tensor]
    totals: TokenColumnTotals
    keep: torch.Tensor
    is_weight: Optional[torch.Tensor]


# ---- stage 2 ---------------------------------------------------------------------------------------------------
@dataclass
class SequenceSums:
    """Per-sequence ``[B]`` float64 sums over a sequence's valid tokens (flagged tokens for the counts).

    Built from this rank's tokens, then summed over the sequence group by collective 1: the fields, in order, are
    the columns of its ``[B, k]`` matrix.  Optional fields exist (else None) when the config needs them; a rule
    with no flagged token on this rank contributes a zero column, so every rank sends the same columns.

    ``valid_tokens``: valid tokens.  ``log_ratio``: ``S = sum log r`` (unclamped).  ``rollout_log_prob``:
    ``sum log pi_rollout``.  ``nonfinite_tokens``: loss tokens with a NaN/inf log-prob.  ``veto_tokens``: tokens
    below the veto threshold.  ``rs_token_rejections``: option -> tokens rejected by that token-level criterion.
    ``is_mask_tokens``: tokens rejected by token-level mask mode.  ``rs_token_rejected``: tokens rejected by any
    token-level RS criterion.  ``token_rejected``: tokens rejected by any token-level rule.  ``is_weight``: sum of
    bounded token IS weights (token-level IS).  ``k_sums``: option -> sum of k2/k3 (sequence criteria, sum/mean,
    and token k2/k3 criteria).
    """

    valid_tokens: torch.Tensor
    log_ratio: torch.Tensor
    rollout_log_prob: torch.Tensor
    nonfinite_tokens: torch.Tensor
    veto_tokens: Optional[torch.Tensor]
    rs_token_rejections: Dict[str, torch.Tensor]
    is_mask_tokens: Optional[torch.Tensor]
    rs_token_rejected: Optional[torch.Tensor]
    token_rejected: Optional[torch.Tensor]
    is_weight: Optional[torch.Tensor]
    k_sums: Dict[str, torch.Tensor]


@dataclass
class SequenceStats:
    """Stage 2: per-sequence statistics, global over the sequence group (all ``[B]`` float64 unless said).

    ``sums``: :class:`SequenceSums` after collective 1.  ``k_maxes``: option -> max of k2/k3 over the sequence's
    valid tokens (-inf if none) for the sequence criteria with aggregate ``max`` (the max part of collective 1).
    ``local``: this rank's :class:`SequenceSums` (before collective 1): their sums over sequences are this rank's
    token totals, and ``local.valid_tokens`` weights the token-weighted batch totals of a per-sequence value, so
    that they are exact after the SUM over ranks.
    ``has_tokens``: ``[B]`` bool, ``valid_tokens > 0``.  ``valid_tokens_min1``: ``T = max(valid_tokens, 1)``, the
    divisor of every per-sequence mean.  ``log_ratio_mean``: ``S / T``, log of the geometric-mean ratio.
    ``train_log_prob_mean`` / ``rollout_log_prob_mean``: mean log pi_train / log pi_rollout over valid tokens.
    """

    sums: SequenceSums
    k_maxes: Dict[str, torch.Tensor]
    local: SequenceSums
    has_tokens: torch.Tensor
    valid_tokens_min1: torch.Tensor
    log_ratio_mean: torch.Tensor
    train_log_prob_mean: torch.Tensor
    rollout_log_prob_mean: torch.Tensor


# ---- stages 3 and 4 --------------------------------------------------------------------------------------------
@dataclass
class SequenceDecisions:
    """Stage 3: what happens to each sequence (``[B]``; identical on every rank of a sequence group).

    ``nonfinite``: bool, has a loss token with a NaN/inf log-prob.  ``vetoed``: bool, has a token below the veto
    threshold (None without veto).  ``rs_flags``: option -> bool, lost >= 1 token to that criterion (whole
    sequence for a sequence criterion).  ``rs_dropped``: bool, rejected whole by a sequence RS criterion.
    ``rs_any``: bool, lost >= 1 token to RS.  ``rs_values``: option -> float64 the criterion's per-sequence
    statistic (the value a sequence criterion tests; for a token criterion the sequence's mean token statistic),
    0 on sequences without valid tokens (the RS statistics metrics).
    ``is_mask``: bool, lost tokens to IS mask mode (None unless mask mode).
    ``raw_log_ratio``: float64 log of the raw (unbounded) sequence ratio the IS level reports: ``S`` at sequence
    level, ``S / T`` at geometric and token level; None when IS is off.
    ``is_weight``: float64 bounded sequence IS weight ``bounded_weight(exp(clamp(raw_log_ratio)))`` that stage 4
    spreads over the sequence's tokens (sequence/geometric level, else None).
    ``sequence_weight``: float64 the sequence's reported IS weight: ``is_weight``, or at token level the mean
    bounded token weight ``SequenceSums.is_weight / T``; None when IS is off.
    ``drop``: bool, rejected whole (non-finite with ``on_nonfinite='reject'``, veto, sequence RS, sequence mask).
    ``kept``: bool, has valid tokens, is not dropped and keeps >= 1 token.
    """

    nonfinite: torch.Tensor
    vetoed: Optional[torch.Tensor]
    rs_flags: Dict[str, torch.Tensor]
    rs_dropped: torch.Tensor
    rs_any: torch.Tensor
    rs_values: Dict[str, torch.Tensor]
    is_mask: Optional[torch.Tensor]
    raw_log_ratio: Optional[torch.Tensor]
    is_weight: Optional[torch.Tensor]
    sequence_weight: Optional[torch.Tensor]
    drop: torch.Tensor
    kept: torch.Tensor


@dataclass
class TokenWeights:
    """Stage 4: ``keep`` ``[N]`` float32 0/1 (token kept in the loss) and ``weights`` ``[N]`` float32 IS weight of
    each kept token (0 elsewhere) before batch normalization (``weights.batch_normalize`` then divides this buffer in
    place); ``kept_sum`` / ``kept_sq_sum``: 0-d float64 sums of ``weights`` / their squares over this rank's tokens
    (the batch totals' :class:`TokenWeightTotals`).  The last three are None when IS is off."""

    keep: torch.Tensor
    weights: Optional[torch.Tensor]
    kept_sum: Optional[torch.Tensor] = None
    kept_sq_sum: Optional[torch.Tensor] = None


# ---- batch totals (collectives 2 and 3) ------------------------------------------------------------------------
@dataclass
class TokenWeightTotals:
    """IS part of :class:`TokenTotals`: ``kept_sum`` / ``kept_sq_sum``: sum of ``w`` / ``w^2`` over kept tokens
    (before batch normalization); ``raw_above`` / ``raw_below``: valid tokens whose raw ratio (token level) or raw
    sequence ratio (sequence/geometric level, counted per token) lies above ``is_upper_bound`` / below ``is_lower``."""

    kept_sum: Number
    kept_sq_sum: Number
    raw_above: Number
    raw_below: Number


@dataclass
class RsTokenTotals:
    """One token-level RS criterion's statistic ``s_t`` (its per-token statistic: ``log r`` unclamped for k1,
    k2/k3 on the clamped ``log r``) over valid tokens, for verl's ``rollout_rs_<option>_*`` statistics:
    ``stat_sum`` sum of ``s_t``; ``band_sum`` / ``band_sq_sum`` sums of ``c_t`` / ``c_t^2`` with ``c_t`` = ``s_t``
    clamped into the criterion's band ``[lo, hi]`` (lo = 0 for k2/k3: verl's ``_std``); ``above`` tokens with
    ``s_t > hi`` (k1 only: for k2/k3 they are the criterion's rejections, counted in ``TokenTotals.rs_criteria``)."""

    stat_sum: Number
    band_sum: Number
    band_sq_sum: Number
    above: Optional[Number]


@dataclass
class TokenTotals:
    """Sums over tokens: each rank counts its own tokens, collective 2 (SUM over the batch group) adds them up.

    ``valid`` / ``loss`` / ``kept`` / ``invalid``: token counts.  ``log_ratio_sum``, ``abs_log_ratio_sum``,
    ``clamped_log_ratio_sum``: sums of ``log r``, ``|log r|``, ``clamp(log r)`` over valid tokens.
    ``ratio_sum_all`` / ``ratio_sq_sum_all``: sums of the bounded ``r`` / ``r^2`` over all N tokens, invalid ones
    holding ``r = 1`` (see the properties).  ``nonfinite``, ``veto``, ``rs_criteria`` (option -> count, token-level
    criteria), ``is_mask`` (token-level mask mode): tokens flagged by each rule.  ``malformed``: non-zero on a rank
    whose ``cu_seqlens`` / ``loss_mask`` values are malformed (summed so that every rank raises together).
    ``weights``: IS on only.  ``rs_stats``: option -> :class:`RsTokenTotals` (token-level RS criteria).
    """

    valid: Number
    loss: Number
    kept: Number
    log_ratio_sum: Number
    abs_log_ratio_sum: Number
    clamped_log_ratio_sum: Number
    ratio_sum_all: Number
    ratio_sq_sum_all: Number
    invalid: Number
    nonfinite: Number
    veto: Optional[Number]
    rs_criteria: Dict[str, Number]
    is_mask: Optional[Number]
    malformed: Number
    weights: Optional[TokenWeightTotals]
    rs_stats: Dict[str, RsTokenTotals]

    @property
    def ratio_sum(self) -> Number:
        """Sum of the bounded ratio over valid tokens (the invalid ones held exactly 1)."""
        return self.ratio_sum_all - self.invalid

    @property
    def ratio_sq_sum(self) -> Number:
        return self.ratio_sq_sum_all - self.invalid


@dataclass
class CriterionTotals:
    """One RS criterion's part of :class:`SequenceTotals`: ``tokens`` rejected (sequence criteria only: a
    token-level criterion's token count is in :class:`TokenTotals`) and ``seqs`` that lost >= 1 token to it."""

    tokens: Optional[Number]
    seqs: Number


@dataclass
class RsSequenceTotals:
    """One RS criterion's per-sequence statistic ``v_i`` (``SequenceDecisions.rs_values``) over valid sequences, for
    verl's ``rollout_rs_<option>_*`` statistics: ``value`` / ``value_sq`` sums of ``v_i`` / ``v_i^2``; ``above`` /
    ``below`` sequences with ``v_i > hi`` / ``v_i < lo`` (``below``: k1 only).  Sequence criteria only (else None):
    ``token_sum`` ``n_i v_i``, ``band_sum`` / ``band_sq_sum`` ``n_i c_i`` / ``n_i c_i^2`` with ``n_i`` the valid
    tokens and ``c_i`` = ``v_i`` clamped into the band (verl spreads the sequence value over its tokens)."""

    value: Number
    value_sq: Number
    above: Number
    below: Optional[Number]
    token_sum: Optional[Number]
    band_sum: Optional[Number]
    band_sq_sum: Optional[Number]


@dataclass
class SequenceWeightTotals:
    """IS part of :class:`SequenceTotals`, over valid sequences of the sequence weight ``w_i``
    (``SequenceDecisions.sequence_weight``): ``kept_sum`` sum of ``w_i`` over kept sequences (sequence/geometric
    level only: the batch-normalization numerator there), ``weight`` / ``weight_sq`` sums of ``w_i`` / ``w_i^2``,
    ``above`` / ``below`` sequences whose raw ratio lies above ``is_upper_bound`` / below ``is_lower``."""

    kept_sum: Optional[Number]
    weight: Number
    weight_sq: Number
    above: Number
    below: Number


@dataclass
class SequenceTotals:
    """Sums over sequences of per-sequence terms (``[B]`` before the reduction): every rank of a sequence group
    holds the same terms, so exactly one of them (``reducer.counts_sequences``) counts them in collective 2.

    ``nonfinite`` / ``veto``: sequences with a non-finite / vetoed token.  ``rs_criteria``: per RS criterion.
    ``rs_tokens``: tokens rejected by RS (a dropped sequence's valid tokens, else its token-criteria rejections).
    ``rs_seqs``: sequences that lost >= 1 token to RS.  ``is_mask_tokens`` (sequence-level mask mode) /
    ``is_mask_seqs``: tokens / sequences lost to mask mode.  ``valid`` / ``loss`` / ``kept`` / ``rejected``:
    sequences with a valid token / with a loss token / kept / with loss tokens but not kept.  With
    ``m_t, m_r`` the mean log pi_train / pi_rollout of a sequence and ``d = m_r - m_t``: ``train_log_ppl = -m_t``,
    ``train_ppl = exp(-m_t)``, ``rollout_log_ppl``, ``rollout_ppl`` the same for ``m_r``, ``log_ppl_diff = d``,
    ``log_ppl_abs_diff = |d|``, ``ppl_ratio = exp(d)``, ``seq_ratio_sq = exp(2 S)`` (each over valid sequences).
    ``rs_stats``: option -> :class:`RsSequenceTotals` (every RS criterion).
    """

    nonfinite: Number
    veto: Optional[Number]
    rs_criteria: Dict[str, CriterionTotals]
    rs_tokens: Optional[Number]
    rs_seqs: Optional[Number]
    is_mask_tokens: Optional[Number]
    is_mask_seqs: Optional[Number]
    valid: Number
    loss: Number
    kept: Number
    rejected: Number
    train_log_ppl: Number
    train_ppl: Number
    rollout_log_ppl: Number
    rollout_ppl: Number
    log_ppl_diff: Number
    log_ppl_abs_diff: Number
    ppl_ratio: Number
    seq_ratio_sq: Number
    weights: Optional[SequenceWeightTotals]
    rs_stats: Dict[str, RsSequenceTotals]


@dataclass
class RsExtremes:
    """Maxima of one RS criterion's statistic: ``max`` of it, ``neg_min`` of its negation, ``abs_max`` of its
    absolute value (per-sequence ``v_i`` only: verl's ``_seq_max_deviation``; None for the token extremes)."""

    max: Number
    neg_min: Number
    abs_max: Optional[Number]


@dataclass
class SequenceExtremes:
    """Maxima over valid sequences (-inf if none) of per-sequence values: ``[B]`` columns, reduced to this rank's
    maxima, then collective 3 (MAX).  A minimum travels as the max of the negated value (``*_neg_min``).

    ``log_ppl_diff_*``: of ``d``.  ``raw_*``: of the raw sequence log-ratio (sequence/geometric IS only).
    ``weight_max``, ``weight_neg_min``, ``weight_max_dev``: of ``w_i``, ``-w_i`` and ``|w_i - 1|`` (IS on).
    ``rs_stats``: option -> :class:`RsExtremes` of the criterion's per-sequence statistic ``v_i``.
    """

    log_ppl_diff_max: Number
    log_ppl_diff_neg_min: Number
    raw_max: Optional[Number]
    raw_neg_min: Optional[Number]
    weight_max: Optional[Number]
    weight_neg_min: Optional[Number]
    weight_max_dev: Optional[Number]
    rs_stats: Dict[str, RsExtremes]


@dataclass
class Extremes:
    """Batch maxima, collective 3 (MAX over the batch group); an empty local set contributes -inf.

    ``token_raw_max`` / ``token_raw_neg_min``: max of ``clamp(log r)`` / of its negation over valid tokens
    (token-level IS only).  ``sequences``: the per-sequence extremes.  ``rs_tokens``: option ->
    :class:`RsExtremes` of a token-level RS criterion's per-token statistic over valid tokens.
    """

    token_raw_max: Optional[Number]
    token_raw_neg_min: Optional[Number]
    sequences: SequenceExtremes
    rs_tokens: Dict[str, RsExtremes]

    @property
    def raw_max(self) -> Optional[Number]:
        """Max of the raw log-ratio the IS level reports (token or sequence)."""
        return self.token_raw_max if self.token_raw_max is not None else self.sequences.raw_max

    @property
    def raw_neg_min(self) -> Optional[Number]:
        return self.token_raw_neg_min if self.token_raw_neg_min is not None else self.sequences.raw_neg_min


@dataclass
class BatchTotals:
    """Everything the metrics and batch normalization need, global over the batch group, on the device.

    ``sums``: ``[K]`` float64, the reduced :class:`TokenTotals` then :class:`SequenceTotals` (collective 2);
    ``maxes``: ``[E]`` float64, the reduced :class:`Extremes` (collective 3); ``tokens`` / ``seqs`` / ``extremes``:
    those records with each leaf replaced by its position (a Python int) in ``sums`` / ``maxes``, so that a value is
    ``sums[totals.tokens.kept]`` and the metrics read many at once with index arithmetic.  ``histogram``:
    ``[num_bins]`` float64 counts of the raw log-ratio (``slime_rc.correction.quantiles``), IS on only.
    """

    tokens: TokenTotals
    seqs: SequenceTotals
    extremes: Extremes
    sums: torch.Tensor
    maxes: torch.Tensor
    histogram: Optional[torch.Tensor]

    def value(self, position: int) -> torch.Tensor:
        """One reduced total (0-d float64) by its position in ``sums``."""
        return self.sums[position]


def register_type(cls: type) -> type:
    """Looks up a record's (or a leaf type's) fields ahead: torch.compile (``compiled.py``) traces the walks above,
    and follows a lookup in a dict that no longer changes (it cannot follow ``dataclasses.fields``, and a dict that
    grows would make it compile again).  Every record here and the leaf types are registered at import."""
    _fields_of(cls)
    return cls


for _type in [v for v in list(globals().values()) if isinstance(v, type) and dataclasses.is_dataclass(v)] + \
        [torch.Tensor, dict, int, float, bool]:
    register_type(_type)
