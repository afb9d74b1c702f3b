"""Per-sequence loop reference of :func:`slime_rc.compute_rollout_correction` -- a testing helper, shared by the
tests (``tests/correction/test_engine.py``) and the benchmarks (``benchmarks/bench_correction.py``), which import it
from the package so that neither depends on the other.  Not used by the library itself.

Written the way slime's ``examples/train_infer_mismatch_helper/mis.py`` computes rollout correction: a Python
``for`` loop over samples, one 1-D fp32 tensor per sample, masked means.  It shares no code with the correction
engine (only the config dataclass and the table of rejection options are imported), so the tests can compare the two.

Conventions (from ``slime_rc/correction/metrics.py`` and the spec README):

* ``r = pi_train / pi_rollout``; ``log r`` is clamped to +-``safety_bound`` before any ``exp``;
* a *valid token* is a loss token with finite log-probs, a *valid sequence* has >= 1 valid token, a *loss
  sequence* has >= 1 loss token (valid or not); fractions "of sequences" count loss sequences, sequence means
  are over valid sequences, token means over valid tokens, whatever was rejected;
* the veto, the k1 rejection options and the IS mask mode compare the *unclamped* log-ratio with log bounds;
* quantiles are nearest-rank order statistics (rank ``ceil(q * n)``) of the safety-bounded log-ratios of the
  valid tokens (at sequence/geometric level every valid token carries its sequence's log-ratio statistic);
* a mean or extreme over an empty set is 0.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from slime_rc.config.schema import RS_OPTIONS, RolloutCorrectionConfig

QUANTILES = (0.25, 0.50, 0.75, 0.95, 0.99)


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------
def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    if n == 0:
        return torch.zeros((), dtype=x.dtype)
    return masked_sum(x, mask) / n


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if len(values) else 0.0


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (divide by n)."""
    if not len(values):
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def _frac(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def nearest_rank(values: torch.Tensor, q: float) -> float:
    """Order statistic of rank ``ceil(q * n)`` (1-based) of ``values``; 0 for an empty tensor."""
    n = values.numel()
    if n == 0:
        return 0.0
    rank = max(1, math.ceil(q * n))
    return float(torch.sort(values.double()).values[rank - 1])


def bounded_weight(ratio: torch.Tensor, config: RolloutCorrectionConfig) -> torch.Tensor:
    """truncate: cap above; clip: clamp to [lower, upper]; mask: the ratio itself (rejection happens elsewhere)."""
    if config.is_mode == "truncate":
        return torch.clamp(ratio, max=config.is_upper_bound)
    if config.is_mode == "clip":
        return torch.clamp(ratio, min=config.is_lower, max=config.is_upper_bound)
    return ratio


def divergence(kind: str, log_ratio: torch.Tensor, bound: float) -> torch.Tensor:
    """Per-token statistic of a rejection option: k1 = log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r."""
    if kind == "k1":
        return log_ratio  # compared unclamped
    lr = log_ratio.clamp(-bound, bound)
    if kind == "k2":
        return 0.5 * lr * lr
    return torch.exp(lr) - 1.0 - lr


def criterion_bounds(criterion) -> Tuple[float, float]:
    """(low, high) in the statistic's space: log-ratio bounds for k1, (-inf, upper) for k2/k3."""
    if RS_OPTIONS[criterion.option][2] == "k1":
        lower = criterion.lower if criterion.lower is not None else 1.0 / criterion.upper
        return math.log(lower), math.log(criterion.upper)
    return -math.inf, criterion.upper


def outside(value, low: float, high: float):
    return (value < low) | (value > high)


# ---------------------------------------------------------------------------------------------------------------
# per-sequence pass
# ---------------------------------------------------------------------------------------------------------------
def _one_sequence(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, index: int,
                  config: RolloutCorrectionConfig) -> dict:
    bound = config.safety_bound
    train = train.detach().float()
    rollout = rollout.detach().float()
    loss = mask != 0
    raw_log_ratio = train - rollout
    valid = loss & torch.isfinite(raw_log_ratio)
    n_loss = int(loss.sum())
    n = int(valid.sum())
    n_nonfinite = n_loss - n
    if n_nonfinite and config.on_nonfinite == "error":
        raise ValueError(f"non-finite log-probs in sample {index}")

    valid_f = valid.float()
    log_ratio = torch.where(valid, raw_log_ratio, torch.zeros_like(raw_log_ratio))  # unclamped
    log_ratio_c = log_ratio.clamp(-bound, bound)
    ratio = torch.exp(log_ratio_c)

    s = {"n": n, "n_loss": n_loss, "nonfinite": n_nonfinite > 0, "valid": valid}
    s["lr_valid"] = log_ratio[valid]  # fp32, unclamped
    s["log_ratio_sum"] = float(masked_sum(log_ratio, valid_f))
    s["log_ratio_mean"] = float(masked_mean(log_ratio, valid_f))
    s["train_mean"] = float(masked_mean(torch.where(valid, train, torch.zeros_like(train)), valid_f))
    s["rollout_mean"] = float(masked_mean(torch.where(valid, rollout, torch.zeros_like(rollout)), valid_f))

    drop_sequence = s["nonfinite"] and config.on_nonfinite == "reject"
    token_rejected = torch.zeros_like(valid)

    # veto: any valid token whose unclamped ratio is below the threshold rejects the whole sequence
    s["veto_tokens"] = 0
    s["vetoed"] = False
    if config.veto_threshold is not None:
        catastrophic = valid & (log_ratio < math.log(config.veto_threshold))
        s["veto_tokens"] = int(catastrophic.sum())
        s["vetoed"] = s["veto_tokens"] > 0
        drop_sequence = drop_sequence or s["vetoed"]

    # rejection sampling criteria (ANDed: a token must pass every one)
    s["rs"] = {}
    s["rs_stat"] = {}  # option -> (the statistic of each valid token, the sequence's value or None if n == 0)
    rs_token_rejected = torch.zeros_like(valid)
    rs_sequence_rejected = False
    for c in config.rs:
        granularity, aggregate, kind = RS_OPTIONS[c.option]
        low, high = criterion_bounds(c)
        stat = divergence(kind, log_ratio, bound)
        if granularity == "token":
            flags = valid & outside(stat, low, high)
            rs_token_rejected |= flags
            s["rs"][c.option] = (int(flags.sum()), bool(flags.any()))
            s["rs_stat"][c.option] = (stat[valid], float(masked_mean(stat, valid_f)) if n > 0 else None)
        else:
            flagged = False
            value = None
            if n > 0:
                if aggregate == "sum":
                    value = float(masked_sum(stat, valid_f))
                elif aggregate == "mean":
                    value = float(masked_mean(stat, valid_f))
                else:
                    value = float(stat[valid].max())
                flagged = bool(outside(value, low, high))
            rs_sequence_rejected = rs_sequence_rejected or flagged
            s["rs"][c.option] = (n if flagged else 0, flagged)
            # verl gives every valid token of the sequence the sequence's value
            s["rs_stat"][c.option] = (torch.full((n,), value if value is not None else 0.0), value)
    s["rs_tokens"] = n if rs_sequence_rejected else int(rs_token_rejected.sum())
    s["rs_any"] = any(flag for _, flag in s["rs"].values())
    token_rejected |= rs_token_rejected
    drop_sequence = drop_sequence or rs_sequence_rejected

    # importance weights
    s["is_mask_tokens"] = 0
    s["is_mask_seq"] = False
    weight = None
    if config.is_level == "token":
        weight = bounded_weight(ratio, config)
        if config.is_mode == "mask":
            flags = valid & outside(log_ratio, math.log(config.is_lower), math.log(config.is_upper_bound))
            token_rejected |= flags
            s["is_mask_tokens"] = int(flags.sum())
            s["is_mask_seq"] = bool(flags.any())
        s["seq_weight"] = float(masked_mean(weight, valid_f))
        s["raw_seq_log"] = s["log_ratio_mean"]  # the geometric-mean ratio stands for the sequence
        s["token_raw_log"] = log_ratio_c[valid]
    elif config.is_level in ("sequence", "geometric"):
        raw = s["log_ratio_sum"] if config.is_level == "sequence" else s["log_ratio_mean"]
        seq_ratio = torch.exp(torch.tensor(raw, dtype=torch.float32).clamp(-bound, bound))
        w = float(bounded_weight(seq_ratio, config))
        if config.is_mode == "mask" and n > 0 and outside(raw, math.log(config.is_lower),
                                                          math.log(config.is_upper_bound)):
            s["is_mask_tokens"] = n
            s["is_mask_seq"] = True
            drop_sequence = True
        weight = torch.full_like(ratio, w)
        s["seq_weight"] = w
        s["raw_seq_log"] = raw
        s["token_raw_log"] = torch.full((n,), min(max(raw, -bound), bound))

    keep = valid & ~token_rejected
    if drop_sequence:
        keep = torch.zeros_like(valid)
    s["keep"] = keep.float()
    s["kept"] = bool(keep.any())
    s["weights"] = None if weight is None else weight * s["keep"]
    return s


def _per_sequence(train_list, rollout_list, mask_list, config) -> List[dict]:
    return [_one_sequence(t, r, m, i, config)
            for i, (t, r, m) in enumerate(zip(train_list, rollout_list, mask_list))]


# ---------------------------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------------------------
def reference_correction(
    train_list: Sequence[torch.Tensor],
    rollout_list: Sequence[torch.Tensor],
    mask_list: Sequence[torch.Tensor],
    config: RolloutCorrectionConfig,
) -> Tuple[Optional[List[torch.Tensor]], List[torch.Tensor], Dict[str, float]]:
    """-> (per-sample IS weights or None, per-sample keep masks (fp32 0/1), metrics as Python floats)."""
    seqs = _per_sequence(train_list, rollout_list, mask_list, config)
    bound = config.safety_bound

    valid_seqs = [s for s in seqs if s["n"] > 0]
    loss_seqs = [s for s in seqs if s["n_loss"] > 0]
    n_valid_seqs, n_loss_seqs = len(valid_seqs), len(loss_seqs)
    n_tokens = sum(s["n"] for s in seqs)
    n_loss_tokens = sum(s["n_loss"] for s in seqs)
    n_kept_tokens = sum(float(s["keep"].sum()) for s in seqs)

    lr = torch.cat([s["lr_valid"] for s in seqs]) if seqs else torch.zeros(0)
    lr_c = lr.clamp(-bound, bound)
    r = torch.exp(lr_c)

    def token_mean(x: torch.Tensor) -> float:
        return float(x.double().mean()) if x.numel() else 0.0

    d = [s["rollout_mean"] - s["train_mean"] for s in valid_seqs]
    exp_c = lambda x: math.exp(min(max(x, -bound), bound))  # noqa: E731
    m: Dict[str, float] = {
        "training_log_ppl": _mean([-s["train_mean"] for s in valid_seqs]),
        "training_ppl": _mean([math.exp(-s["train_mean"]) for s in valid_seqs]),
        "rollout_log_ppl": _mean([-s["rollout_mean"] for s in valid_seqs]),
        "rollout_ppl": _mean([math.exp(-s["rollout_mean"]) for s in valid_seqs]),
        "log_ppl_diff": _mean(d),
        "log_ppl_abs_diff": _mean([abs(x) for x in d]),
        "log_ppl_diff_max": max(d) if d else 0.0,
        "log_ppl_diff_min": min(d) if d else 0.0,
        "ppl_ratio": _mean([exp_c(x) for x in d]),
        "kl": token_mean(-lr),
        "k3_kl": token_mean(r - 1 - lr_c),
        "chi2_token": token_mean(r * r) - 1.0 if n_tokens else 0.0,
        "chi2_seq": _mean([exp_c(s["log_ratio_sum"]) ** 2 for s in valid_seqs]) - 1.0 if n_valid_seqs else 0.0,
        "train_rollout_logprob_abs_diff": token_mean(lr.abs()),
        "rejected_token_fraction": _frac(n_loss_tokens - n_kept_tokens, n_loss_tokens),
        "rejected_seq_fraction": _frac(sum(1 for s in loss_seqs if not s["kept"]), n_loss_seqs),
    }
    if config.on_nonfinite == "reject":
        m["nonfinite_token_fraction"] = _frac(sum(s["n_loss"] - s["n"] for s in seqs), n_loss_tokens)
        m["nonfinite_seq_fraction"] = _frac(sum(1 for s in seqs if s["nonfinite"]), n_loss_seqs)

    weights_list = None
    if config.is_enabled:
        weights_list = [s["weights"] for s in seqs]
        kept_w = torch.cat([s["weights"][s["keep"] > 0] for s in seqs]) if seqs else torch.zeros(0)
        kept_w = kept_w.double()
        if kept_w.numel():
            mean_w = float(kept_w.mean())
            mean_w2 = float((kept_w * kept_w).mean())
            m["rollout_is_mean"] = mean_w
            m["rollout_is_std"] = float(kept_w.std(unbiased=False))
            m["rollout_is_eff_sample_size"] = mean_w * mean_w / mean_w2 if mean_w2 > 0 else 0.0
        else:
            m["rollout_is_mean"] = m["rollout_is_std"] = m["rollout_is_eff_sample_size"] = 0.0

        # raw ratios: per token at token level, the sequence statistic carried by each token otherwise
        raw_tokens = torch.cat([s["token_raw_log"] for s in seqs]) if seqs else torch.zeros(0)
        if config.is_level == "token":
            raw_extremes = [float(raw_tokens.min()), float(raw_tokens.max())] if raw_tokens.numel() else []
        else:
            raw_seq = [min(max(s["raw_seq_log"], -bound), bound) for s in valid_seqs]
            raw_extremes = [min(raw_seq), max(raw_seq)] if raw_seq else []
        m["rollout_is_min"] = math.exp(raw_extremes[0]) if raw_extremes else 0.0
        m["rollout_is_max"] = math.exp(raw_extremes[1]) if raw_extremes else 0.0
        for q in QUANTILES:
            m[f"rollout_is_p{round(q * 100)}"] = math.exp(nearest_rank(raw_tokens, q)) if raw_tokens.numel() else 0.0
        log_hi, log_lo = math.log(config.is_upper_bound), math.log(config.is_lower)
        if config.is_level == "token":
            above = sum(int((s["lr_valid"] > log_hi).sum()) for s in seqs)
            below = sum(int((s["lr_valid"] < log_lo).sum()) for s in seqs)
        else:
            above = sum(s["n"] for s in valid_seqs if s["raw_seq_log"] > log_hi)
            below = sum(s["n"] for s in valid_seqs if s["raw_seq_log"] < log_lo)
        m["rollout_is_ratio_fraction_high"] = _frac(above, n_tokens)
        m["rollout_is_ratio_fraction_low"] = _frac(below, n_tokens)

        seq_w = [s["seq_weight"] for s in valid_seqs]
        m["rollout_is_seq_mean"] = _mean(seq_w)
        m["rollout_is_seq_std"] = _std(seq_w)
        m["rollout_is_seq_min"] = min(seq_w) if seq_w else 0.0
        m["rollout_is_seq_max"] = max(seq_w) if seq_w else 0.0
        m["rollout_is_seq_max_deviation"] = max(abs(w - 1) for w in seq_w) if seq_w else 0.0
        m["rollout_is_seq_fraction_high"] = _frac(sum(1 for s in valid_seqs if s["raw_seq_log"] > log_hi),
                                                  n_valid_seqs)
        m["rollout_is_seq_fraction_low"] = _frac(sum(1 for s in valid_seqs if s["raw_seq_log"] < log_lo),
                                                 n_valid_seqs)
        if config.is_mode == "mask":
            m["rollout_is_masked_fraction"] = _frac(sum(s["is_mask_tokens"] for s in seqs), n_tokens)
            m["rollout_is_seq_masked_fraction"] = _frac(sum(1 for s in seqs if s["is_mask_seq"]), n_loss_seqs)

        if config.is_batch_normalize:
            if config.is_level == "token":
                norm = float(kept_w.mean()) if kept_w.numel() else 0.0
            else:
                norm = _mean([s["seq_weight"] for s in seqs if s["kept"]])
            if not norm > 0:
                norm = 1.0  # nothing kept: weights are left as they are
            weights_list = [w / norm for w in weights_list]
            m["rollout_is_batch_norm_factor"] = norm

    if config.rs:
        m["rollout_rs_masked_fraction"] = _frac(sum(s["rs_tokens"] for s in seqs), n_tokens)
        m["rollout_rs_seq_masked_fraction"] = _frac(sum(1 for s in seqs if s["rs_any"]), n_loss_seqs)
        for c in config.rs:
            name = f"rollout_rs_{c.option}"
            m[name + "_masked_fraction"] = _frac(sum(s["rs"][c.option][0] for s in seqs), n_tokens)
            m[name + "_seq_masked_fraction"] = _frac(sum(1 for s in seqs if s["rs"][c.option][1]), n_loss_seqs)
            m.update(_rs_statistics(name, c, seqs))

    if config.veto_threshold is not None:
        m["rollout_is_veto_fraction"] = _frac(sum(1 for s in seqs if s["vetoed"]), n_loss_seqs)
        m["rollout_is_catastrophic_token_fraction"] = _frac(sum(s["veto_tokens"] for s in seqs), n_tokens)

    keep_list = [s["keep"] for s in seqs]
    return weights_list, keep_list, m


def _rs_statistics(name: str, criterion, seqs: List[dict]) -> Dict[str, float]:
    """verl's per-option statistics (``compute_rs_metrics`` in verl's ``rollout_corr_helper.py``), written the way
    verl computes them: a per-token tensor over the valid tokens (a sequence criterion's value repeated over each
    valid token of its sequence) and a list of per-sequence values over the valid sequences (a token criterion's
    per-sequence mean).  The statistic is this project's (k1 = log r, unclamped)."""
    granularity, _, kind = RS_OPTIONS[criterion.option]
    low, high = criterion_bounds(criterion)
    k1 = kind == "k1"
    per_token = torch.cat([s["rs_stat"][criterion.option][0] for s in seqs]) if seqs else torch.zeros(0)
    per_token = per_token.double()
    values = [s["rs_stat"][criterion.option][1] for s in seqs if s["n"] > 0]
    n_tok, n_seq = per_token.numel(), len(values)

    def token_frac(flags) -> float:
        return float(flags.double().mean()) if n_tok else 0.0

    def seq_frac(test) -> float:
        return _frac(sum(1 for v in values if test(v)), n_seq)

    m: Dict[str, float] = {name + "_mean": float(per_token.mean()) if n_tok else 0.0}
    if granularity == "token":
        m[name + "_max"] = float(per_token.max()) if n_tok else 0.0
        m[name + "_min"] = float(per_token.min()) if n_tok else 0.0
        m[name + "_fraction_high"] = token_frac(per_token > high)
        if k1:
            m[name + "_fraction_low"] = token_frac(per_token < low)
    else:
        m[name + "_max"] = max(values) if values else 0.0
        m[name + "_min"] = min(values) if values else 0.0
        m[name + "_fraction_high"] = seq_frac(lambda v: v > high)
        if k1:
            m[name + "_fraction_low"] = seq_frac(lambda v: v < low)
    band = per_token.clamp(low if k1 else 0.0, high)
    m[name + "_std"] = float(band.std(unbiased=False)) if n_tok > 1 else 0.0
    m[name + "_seq_mean"] = _mean(values)
    m[name + "_seq_std"] = float(torch.tensor(values, dtype=torch.float64).std()) if n_seq > 1 else 0.0  # n - 1
    m[name + "_seq_max"] = max(values) if values else 0.0
    m[name + "_seq_min"] = min(values) if values else 0.0
    m[name + "_seq_max_deviation"] = max(abs(v) for v in values) if values else 0.0
    m[name + "_seq_fraction_high"] = seq_frac(lambda v: v > high)
    if k1:
        m[name + "_seq_fraction_low"] = seq_frac(lambda v: v < low)
    return m


def reference_sequences(train_list, rollout_list, mask_list, config) -> Dict[str, List[float]]:
    """Per-sequence statistics matching ``CorrectionResult.sequences`` (``is_weight`` before normalization)."""
    seqs = _per_sequence(train_list, rollout_list, mask_list, config)
    out = {
        "valid_tokens": [float(s["n"]) for s in seqs],
        "log_ratio_sum": [s["log_ratio_sum"] for s in seqs],
        "train_log_prob_mean": [s["train_mean"] for s in seqs],
        "rollout_log_prob_mean": [s["rollout_mean"] for s in seqs],
        "kept": [float(s["kept"]) for s in seqs],
    }
    if config.is_enabled:
        out["is_weight"] = [s["seq_weight"] for s in seqs]
    return out
