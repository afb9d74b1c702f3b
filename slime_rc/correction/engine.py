"""The rollout-correction engine: IS weights, rejection (keep) mask and mismatch metrics for packed sequences.

Pipeline of one call (``N`` tokens of ``B`` sequences on this rank; ``r = pi_train / pi_rollout``):

1. per token: ``log r`` (fp32), validity (loss token with finite log-probs), token-level decisions
   (token RS criteria, token IS mask mode, veto flags);
2. per sequence (local pieces -> reducer, collective 1): valid-token count, ``sum log r``, ``sum log pi_rollout``,
   counts of flagged tokens, k2/k3 sums/maxima for the RS options that need them;
3. per sequence (now global): sequence/geometric IS weights, sequence RS, veto, mask mode -> keep decisions;
4. per token: keep mask and IS weights; batch totals and histogram (collective 2), extremes (collective 3);
5. batch normalization by the global mean weight and the metrics (``slime_rc.correction.metrics``).

No Python loop runs over sequences and no tensor of size N crosses ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.metrics import Totals, finish_metrics
from slime_rc.correction.packed import broadcast_to_tokens, check_packed_inputs, first_nonfinite, segment_max, segment_sum
from slime_rc.correction.quantiles import histogram
from slime_rc.correction.reducer import LocalReducer, as_reducer


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


# Perplexity is exp(-mean log-prob), not a ratio: it gets no safety bound, only a float64 overflow guard.
_PPL_EXP_MAX = 700.0


def _k_stat(kind: str, lr_clamped: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Per-token divergence: k2 = (log r)^2 / 2, k3 = r - 1 - log r (both >= 0)."""
    if kind == "k2":
        return 0.5 * lr_clamped * lr_clamped
    return ratio - 1.0 - lr_clamped


def _outside(stat: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    if lo == -math.inf:
        return stat > hi
    return (stat < lo) | (stat > hi)


def compute_rollout_correction(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    reducer: Optional[LocalReducer] = None,
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
    """
    if not isinstance(config, RolloutCorrectionConfig):
        raise ValueError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}; "
                         f"build one with RolloutCorrectionConfig(...) or RolloutCorrectionConfig.from_dict(d)")
    reducer = as_reducer(reducer)
    train, rollout, mask, cu = check_packed_inputs(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens)
    n_tokens, n_seqs = train.numel(), cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    bound = config.safety_bound
    dev = train.device

    # ---- 1. per token ---------------------------------------------------------------------------------------
    lr_raw = train - rollout
    valid = mask & (lr_raw.abs() < math.inf)  # NaN or inf on either side makes log r non-finite
    n_loss_tokens = mask.sum()
    n_valid = valid.sum()
    n_bad = int(n_loss_tokens - n_valid)
    n_invalid = n_tokens - int(n_valid)
    if n_invalid:
        lr = torch.where(valid, lr_raw, 0.0)  # zeros keep every sum below finite and exact
        rollout_v = torch.where(valid, rollout, 0.0)
    else:
        lr, rollout_v = lr_raw, rollout
    lr_c = lr.clamp(-bound, bound)
    ratio = torch.exp(lr_c)  # safety-bounded per-token ratio; exactly 1 on invalid tokens
    lr64 = lr.double()  # one float64 copy feeds every sum below (sum(dtype=...) would copy each time)

    # Per-sequence sums (columns of collective 1).  Count columns of rare events (non-finite, veto, rejections)
    # skip the prefix sum when this rank has none; the column set itself depends only on the config, so every
    # rank sends the same shape.
    sum_cols = {"n": valid, "lr": lr64, "rollout": rollout_v, "bad": (mask & ~valid) if n_bad else None}
    max_cols = {}
    token_counts = {"nonfinite_tokens": n_bad}  # local token counts, summed in collective 2

    if config.veto_threshold is not None:
        veto_tokens = valid & (lr < math.log(config.veto_threshold))  # unclamped ratio, before the safety bound
        n_veto = int(veto_tokens.sum())
        sum_cols["veto"] = veto_tokens if n_veto else None
        token_counts["veto_tokens"] = n_veto

    k_cache = {}

    def k_of(kind):
        if kind not in k_cache:
            k_cache[kind] = torch.where(valid, _k_stat(kind, lr_c, ratio), 0.0)
        return k_cache[kind]

    # token-level rejection: RS token criteria and token-level IS mask mode
    is_token = config.is_level == "token"
    rs_token_flags, other_token_flags = [], []
    for c in config.rs:
        if c.granularity == "token":
            stat = lr if c.statistic == "k1" else k_of(c.statistic)
            rs_token_flags.append((f"rollout_rs_{c.option}", valid & _outside(stat, *c.log_bounds)))
    if is_token and config.is_mode == "mask":
        flags = valid & _outside(lr, math.log(config.is_lower), math.log(config.is_upper_bound))
        other_token_flags.append(("rollout_is_mask", flags))

    def union(named_flags):
        out = named_flags[0][1]
        for _, f in named_flags[1:]:
            out = out | f
        return out

    token_keep = valid
    for name, flags in rs_token_flags + other_token_flags:
        count = int(flags.sum())
        token_counts[name + "_tokens"] = count
        sum_cols[name] = flags if count else None
    if rs_token_flags:
        rs_any = union(rs_token_flags)
        count = int(rs_any.sum())
        sum_cols["rs_token_rejected"] = rs_any if count else None
    if rs_token_flags or other_token_flags:
        rejected = union(rs_token_flags + other_token_flags)
        token_keep = valid & ~rejected
        count = int(rejected.sum())
        sum_cols["token_rejected"] = rejected if count else None

    w_token = None
    if is_token:
        if config.is_mode == "truncate":
            w_token = ratio.clamp(max=config.is_upper_bound)
        elif config.is_mode == "clip":
            w_token = ratio.clamp(config.is_lower, config.is_upper_bound)
        else:
            w_token = ratio
        sum_cols["w_token"] = torch.where(valid, w_token, 0.0) if n_invalid else w_token

    # sequence-level k2/k3 statistics for the sequence RS options that need them
    for c in config.rs:
        if c.granularity == "sequence" and c.statistic != "k1":
            if c.aggregate == "max":
                max_cols[c.option] = torch.where(valid, k_of(c.statistic), -math.inf)
            else:
                sum_cols[c.option] = k_of(c.statistic)

    # ---- 2. per-sequence statistics, combined across the sequence group (collective 1) ----------------------
    zeros_b = torch.zeros(n_seqs, dtype=torch.float64, device=dev)
    local_sums = torch.stack([segment_sum(v, cu) if v is not None else zeros_b for v in sum_cols.values()], 1)
    local_maxes = torch.stack([segment_max(v, cu) for v in max_cols.values()], 1) if max_cols else \
        torch.zeros(n_seqs, 0, dtype=torch.float64, device=dev)
    sums, maxes = reducer.combine_sequences(local_sums, local_maxes)
    col = dict(zip(sum_cols, sums.unbind(1)))
    col.update(zip(max_cols, maxes.unbind(1)))
    local_n = local_sums[:, 0]

    # ---- 3. sequence-level decisions ------------------------------------------------------------------------
    n_i = col["n"]
    has_tokens = n_i > 0
    n_safe = n_i.clamp(min=1)
    s_i = col["lr"]  # log of the sequence ratio, unclamped
    g_i = s_i / n_safe  # log of the geometric-mean ratio
    bad_seqs = col["bad"] > 0
    seq_drop = bad_seqs.clone() if config.on_nonfinite == "reject" else torch.zeros_like(bad_seqs)
    seq_terms = {"nonfinite_seqs": bad_seqs}  # per-sequence values, summed over sequences in collective 2
    if "veto" in col:
        vetoed = col["veto"] > 0
        seq_terms["rollout_is_veto_seqs"] = vetoed
        seq_drop |= vetoed
    rs_seq_drop = torch.zeros_like(seq_drop)
    rs_seq_any = torch.zeros_like(seq_drop)
    for c in config.rs:
        name = f"rollout_rs_{c.option}"
        if c.granularity == "token":
            flags = col[name] > 0  # sequences that lost at least one token to this criterion
        else:
            if c.statistic == "k1":
                stat = s_i if c.aggregate == "sum" else g_i
            elif c.aggregate == "max":
                stat = col[c.option]
            else:
                stat = col[c.option] if c.aggregate == "sum" else col[c.option] / n_safe
            flags = has_tokens & _outside(stat, *c.log_bounds)
            rs_seq_drop |= flags
            seq_terms[name + "_tokens"] = n_i * flags
        seq_terms[name + "_seqs"] = flags
        rs_seq_any |= flags
    if config.rs:
        seq_drop |= rs_seq_drop
        rs_tok = col.get("rs_token_rejected", zeros_b)
        seq_terms["rollout_rs_tokens"] = torch.where(rs_seq_drop, n_i, rs_tok)
        seq_terms["rollout_rs_seqs"] = rs_seq_any

    w_seq = raw_seq = None
    if config.is_level in ("sequence", "geometric"):
        raw_seq = s_i if config.is_level == "sequence" else g_i
        w_seq = torch.exp(raw_seq.clamp(-bound, bound))
        lo, hi = config.is_lower, config.is_upper_bound
        if config.is_mode == "truncate":
            w_seq = w_seq.clamp(max=hi)
        elif config.is_mode == "clip":
            w_seq = w_seq.clamp(lo, hi)
        else:
            flags = has_tokens & _outside(raw_seq, math.log(lo), math.log(hi))
            seq_terms["rollout_is_mask_tokens"] = n_i * flags
            seq_terms["rollout_is_mask_seqs"] = flags
            seq_drop |= flags
    elif is_token and config.is_mode == "mask":
        seq_terms["rollout_is_mask_seqs"] = col["rollout_is_mask"] > 0

    kept_tokens_i = n_i - col["token_rejected"] if "token_rejected" in col else n_i
    seq_kept = has_tokens & ~seq_drop & (kept_tokens_i > 0)

    # ---- 4. per-token keep mask and weights ------------------------------------------------------------------
    any_seq_drop = bool(seq_drop.any())
    keep = token_keep & broadcast_to_tokens(~seq_drop, lengths, n_tokens) if any_seq_drop else token_keep
    keep_f = keep.float()
    weights = None
    if is_token:
        weights = w_token * keep_f
    elif w_seq is not None:
        weights = broadcast_to_tokens(w_seq.float(), lengths, n_tokens) * keep_f

    # ---- batch totals (collective 2) and extremes (collective 3) --------------------------------------------
    t = Totals(dev)
    t.add("tokens", int(n_valid))
    t.add("loss_tokens", int(n_loss_tokens))
    t.add("kept_tokens", keep.sum())
    t.add("lr_sum", lr64.sum())
    t.add("lr_abs_sum", torch.linalg.vector_norm(lr64, 1))
    lr_c64 = lr64.clamp(-bound, bound)
    t.add("lr_c_sum", lr_c64.sum())
    # sums of r and r^2 over valid tokens: invalid tokens hold r = 1 exactly, so take their count off after
    ratio64 = ratio.double()
    t.add("ratio_sum_all", ratio64.sum())
    t.add("ratio_sq_sum_all", torch.dot(ratio64, ratio64))
    t.add("invalid_tokens", n_invalid)
    for name, count in token_counts.items():
        t.add(name, count)

    mean_train = (s_i + col["rollout"]) / n_safe
    mean_rollout = col["rollout"] / n_safe
    log_ppl_diff = mean_rollout - mean_train  # = log(training_ppl_i / rollout_ppl_i)
    seq_terms.update({
        "valid_seqs": has_tokens,
        "loss_seqs": has_tokens | bad_seqs,
        "kept_seqs": seq_kept,
        "rejected_seqs": (has_tokens | bad_seqs) & ~seq_kept,
        "train_log_ppl": -mean_train * has_tokens,
        "train_ppl": torch.exp((-mean_train).clamp(max=_PPL_EXP_MAX)) * has_tokens,
        "rollout_log_ppl": -mean_rollout * has_tokens,
        "rollout_ppl": torch.exp((-mean_rollout).clamp(max=_PPL_EXP_MAX)) * has_tokens,
        "log_ppl_diff": log_ppl_diff * has_tokens,
        "log_ppl_abs_diff": log_ppl_diff.abs() * has_tokens,
        "ppl_ratio": torch.exp(log_ppl_diff.clamp(-bound, bound)) * has_tokens,
        "seq_ratio_sq": torch.exp(2 * s_i.clamp(-bound, bound)) * has_tokens,
    })
    seq_maxes = {"log_ppl_diff_max": log_ppl_diff, "log_ppl_diff_neg_min": -log_ppl_diff}

    w_seq_stat = None
    if config.is_enabled:
        w64 = weights.double()
        t.add("w_kept_sum", w64.sum())
        t.add("w_kept_sq_sum", torch.dot(w64, w64))
        log_hi, log_lo = math.log(config.is_upper_bound), math.log(config.is_lower)
        bins = config.quantile_bins_per_octave
        if is_token:
            w_seq_stat = col["w_token"] / n_safe  # mean bounded token weight of each sequence
            raw_seq_stat = g_i  # its raw counterpart: the geometric-mean ratio
            # invalid tokens hold lr == 0: they can only count when a bound sits on the wrong side of 1
            above, below = lr > log_hi, lr < log_lo
            t.add("raw_above", (above if log_hi >= 0 else above & valid).sum())
            t.add("raw_below", (below if log_lo <= 0 else below & valid).sum())
            hist = histogram(lr, bins, bound)
            hist[hist.numel() // 2] -= n_invalid  # ... and land in the centre bin: take them out there
            t.add_histogram(hist)
            valid_lr = lr_c if n_invalid == 0 else lr_c[valid]
            lo_hi = valid_lr.aminmax() if valid_lr.numel() else None
            t.add_max("raw_max", lo_hi.max if lo_hi else None)
            t.add_max("raw_neg_min", -lo_hi.min if lo_hi else None)
        else:
            w_seq_stat, raw_seq_stat = w_seq, raw_seq
            # token-weighted sums of a per-sequence value use this rank's token counts: exact after the SUM
            t.add("raw_above", (local_n * (raw_seq > log_hi)).sum())
            t.add("raw_below", (local_n * (raw_seq < log_lo)).sum())
            t.add_histogram(histogram(raw_seq.clamp(-bound, bound), bins, bound, weights=local_n))
            seq_terms["w_kept_seq_sum"] = torch.where(seq_kept, w_seq, 0.0)
            seq_maxes["raw_max"] = raw_seq
            seq_maxes["raw_neg_min"] = -raw_seq
        seq_terms["is_seq_w"] = w_seq_stat * has_tokens
        seq_terms["is_seq_w_sq"] = w_seq_stat * w_seq_stat * has_tokens
        seq_terms["is_seq_above"] = has_tokens & (raw_seq_stat > log_hi)
        seq_terms["is_seq_below"] = has_tokens & (raw_seq_stat < log_lo)
        seq_maxes["is_seq_max"] = w_seq_stat
        seq_maxes["is_seq_neg_min"] = -w_seq_stat
        seq_maxes["is_seq_max_dev"] = (w_seq_stat - 1).abs()

    # Sequence-level totals are identical on every rank of a sequence group: exactly one rank counts them.
    if n_seqs and reducer.counts_sequences:
        seq_sums = torch.stack(list(seq_terms.values()), 1).sum(0, dtype=torch.float64)
    else:
        seq_sums = torch.zeros(len(seq_terms), dtype=torch.float64, device=dev)
    t.add_many(seq_terms, seq_sums)
    if n_seqs:
        seq_max_vec = torch.stack(list(seq_maxes.values()), 1).masked_fill(~has_tokens[:, None], -math.inf).amax(0)
        for name, v in zip(seq_maxes, seq_max_vec.unbind()):
            t.add_max(name, v)
    else:
        for name in seq_maxes:
            t.add_max(name, None)

    totals, hist = t.reduce(reducer)
    totals["ratio_sum"] = totals["ratio_sum_all"] - totals["invalid_tokens"]
    totals["ratio_sq_sum"] = totals["ratio_sq_sum_all"] - totals["invalid_tokens"]

    if config.on_nonfinite == "error" and totals["nonfinite_tokens"] > 0:
        # every rank of the batch group sees the global count, so all of them raise together
        where = first_nonfinite(train, rollout, mask & ~valid, cu) if n_bad else None
        if where is None:
            first = int(torch.nonzero(bad_seqs)[0, 0]) if bool(bad_seqs.any()) else None
            where = (f"sample {first} (its non-finite tokens are on another rank)" if first is not None
                     else "another rank's batch")
        raise ValueError(
            f"non-finite log-probs on loss tokens: {where}. Fix the log-prob source (SGLang serializes NaN/inf "
            f"as null), or set on_nonfinite='reject' to drop such sequences and count them in the "
            f"'nonfinite_seq_fraction' metric.")

    # ---- 5. batch normalization and metrics ------------------------------------------------------------------
    norm = None
    if config.is_enabled and config.is_batch_normalize:
        if is_token:
            denom_w, denom_n = totals["w_kept_sum"], totals["kept_tokens"]
        else:
            denom_w, denom_n = totals["w_kept_seq_sum"], totals["kept_seqs"]
        mean_w = denom_w / denom_n if denom_n > 0 else 0.0
        # nothing kept (or weights all zero): leave weights as they are rather than divide by zero
        norm = mean_w if mean_w > 0 else 1.0
        weights = weights / norm

    values = finish_metrics(totals, hist, config, norm)
    metrics = dict(zip(values, torch.tensor(list(values.values()), dtype=torch.float64, device=dev).unbind()))
    sequences = {
        "valid_tokens": n_i,
        "log_ratio_sum": s_i,
        "train_log_prob_mean": mean_train,
        "rollout_log_prob_mean": mean_rollout,
        "kept": seq_kept.double(),
    }
    if config.is_enabled:
        sequences["is_weight"] = w_seq_stat if norm is None else w_seq_stat / norm
    return CorrectionResult(
        is_weights=None if weights is None else weights.detach(),
        keep_mask=keep_f,
        metrics=metrics,
        sequences=sequences,
    )
