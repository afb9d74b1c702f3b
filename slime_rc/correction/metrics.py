"""Metric names, their definitions, and their computation from reduced batch totals.

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
from typing import Dict, Optional

import torch

from slime_rc.correction.quantiles import QUANTILES, quantiles_from_histogram

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


class Totals:
    """Collects named batch totals (summed across ranks) and extremes (maxed across ranks).

    Values are gathered into one float64 vector per kind so that a call costs one collective each, and are
    read back to Python floats in one transfer: the metric formulas then cost no tensor operations.
    """

    def __init__(self, device):
        self.device = device
        self._sum_names, self._sum_values = [], []  # 0-d tensors or Python numbers
        self._vec_names, self._vec_values = [], []  # [k] float64 tensors
        self._max_names, self._max_values = [], []

    def add(self, name: str, value) -> None:
        self._sum_names.append(name)
        self._sum_values.append(value)

    def add_many(self, names, values: torch.Tensor) -> None:
        """``values``: ``[len(names)]`` tensor of totals."""
        self._vec_names.append(list(names))
        self._vec_values.append(values.to(torch.float64).reshape(-1))

    def add_histogram(self, values: torch.Tensor) -> None:
        self._vec_names.append(None)
        self._vec_values.append(values.to(torch.float64).reshape(-1))

    def add_max(self, name: str, value) -> None:
        """``value`` None (an empty local batch) contributes -inf."""
        self._max_names.append(name)
        self._max_values.append(-math.inf if value is None else value)

    @staticmethod
    def _vector(names, values, device):
        """Order: tensor-valued entries (one stack), then Python numbers (one tensor)."""
        tn = [n for n, v in zip(names, values) if isinstance(v, torch.Tensor)]
        tv = [v for v in values if isinstance(v, torch.Tensor)]  # 0-d; stack promotes them to float64
        pn = [n for n, v in zip(names, values) if not isinstance(v, torch.Tensor)]
        pv = [float(v) for v in values if not isinstance(v, torch.Tensor)]
        parts = ([torch.stack(tv).double()] if tv else []) + [torch.tensor(pv, dtype=torch.float64, device=device)]
        return tn + pn, torch.cat(parts)

    def reduce(self, reducer):
        """-> (dict name -> Python float, histogram tensor or None)."""
        names, head = self._vector(self._sum_names, self._sum_values, self.device)
        parts = [head] + self._vec_values
        sums = reducer.sum_totals(torch.cat(parts))
        chunks = sums.split([p.numel() for p in parts])
        out = dict(zip(names, chunks[0].tolist()))
        hist = None
        for vec_names, chunk in zip(self._vec_names, chunks[1:]):
            if vec_names is None:
                hist = chunk
            else:
                out.update(zip(vec_names, chunk.tolist()))
        if self._max_values:
            names, vec = self._vector(self._max_names, self._max_values, self.device)
            out.update(zip(names, reducer.max_totals(vec).tolist()))
        return out, hist


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _fin(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _exp(x: float, bound: float) -> float:
    return math.exp(min(max(x, -bound), bound))


def finish_metrics(t: Dict[str, float], hist: Optional[torch.Tensor], config,
                   norm: Optional[float]) -> Dict[str, float]:
    """Metric values (Python floats) from reduced totals."""
    tokens, seqs, loss_tokens, all_seqs = t["tokens"], t["valid_seqs"], t["loss_tokens"], t["loss_seqs"]
    m = {
        "training_log_ppl": _div(t["train_log_ppl"], seqs),
        "training_ppl": _div(t["train_ppl"], seqs),
        "rollout_log_ppl": _div(t["rollout_log_ppl"], seqs),
        "rollout_ppl": _div(t["rollout_ppl"], seqs),
        "log_ppl_diff": _div(t["log_ppl_diff"], seqs),
        "log_ppl_abs_diff": _div(t["log_ppl_abs_diff"], seqs),
        "log_ppl_diff_max": _fin(t["log_ppl_diff_max"]),
        "log_ppl_diff_min": _fin(-t["log_ppl_diff_neg_min"]),
        "ppl_ratio": _div(t["ppl_ratio"], seqs),
        "kl": _div(-t["lr_sum"], tokens),
        "k3_kl": _div(t["ratio_sum"] - tokens - t["lr_c_sum"], tokens),
        "chi2_token": _div(t["ratio_sq_sum"], tokens) - 1.0 if tokens > 0 else 0.0,
        "chi2_seq": _div(t["seq_ratio_sq"], seqs) - 1.0 if seqs > 0 else 0.0,
        "train_rollout_logprob_abs_diff": _div(t["lr_abs_sum"], tokens),
        "rejected_token_fraction": _div(loss_tokens - t["kept_tokens"], loss_tokens),
        "rejected_seq_fraction": _div(t["rejected_seqs"], all_seqs),
    }
    if config.on_nonfinite == "reject":
        m["nonfinite_token_fraction"] = _div(t["nonfinite_tokens"], loss_tokens)
        m["nonfinite_seq_fraction"] = _div(t["nonfinite_seqs"], all_seqs)
    if config.is_enabled:
        bound = config.safety_bound
        n = t["kept_tokens"]
        mean = _div(t["w_kept_sum"], n)
        mean_sq = _div(t["w_kept_sq_sum"], n)
        m["rollout_is_mean"] = mean
        m["rollout_is_std"] = math.sqrt(max(mean_sq - mean * mean, 0.0))
        m["rollout_is_eff_sample_size"] = mean * mean / mean_sq if mean_sq > 0 else 0.0
        any_tokens = tokens > 0
        m["rollout_is_min"] = _exp(_fin(-t["raw_neg_min"]), bound) if any_tokens else 0.0
        m["rollout_is_max"] = _exp(_fin(t["raw_max"]), bound) if any_tokens else 0.0
        qs = quantiles_from_histogram(hist, config.quantile_bins_per_octave, bound).tolist()
        for q, v in zip(QUANTILES, qs):
            m[f"rollout_is_p{round(q * 100)}"] = math.exp(v) if any_tokens else 0.0
        m["rollout_is_ratio_fraction_high"] = _div(t["raw_above"], tokens)
        m["rollout_is_ratio_fraction_low"] = _div(t["raw_below"], tokens)
        seq_mean = _div(t["is_seq_w"], seqs)
        m["rollout_is_seq_mean"] = seq_mean
        m["rollout_is_seq_std"] = math.sqrt(max(_div(t["is_seq_w_sq"], seqs) - seq_mean * seq_mean, 0.0))
        m["rollout_is_seq_min"] = _fin(-t["is_seq_neg_min"])
        m["rollout_is_seq_max"] = _fin(t["is_seq_max"])
        m["rollout_is_seq_max_deviation"] = _fin(t["is_seq_max_dev"])
        m["rollout_is_seq_fraction_high"] = _div(t["is_seq_above"], seqs)
        m["rollout_is_seq_fraction_low"] = _div(t["is_seq_below"], seqs)
        if norm is not None:
            m["rollout_is_batch_norm_factor"] = norm
        if config.is_mode == "mask":
            m["rollout_is_masked_fraction"] = _div(t["rollout_is_mask_tokens"], tokens)
            m["rollout_is_seq_masked_fraction"] = _div(t["rollout_is_mask_seqs"], all_seqs)
    if config.rs:
        m["rollout_rs_masked_fraction"] = _div(t["rollout_rs_tokens"], tokens)
        m["rollout_rs_seq_masked_fraction"] = _div(t["rollout_rs_seqs"], all_seqs)
        for c in config.rs:
            name = f"rollout_rs_{c.option}"
            m[name + "_masked_fraction"] = _div(t[name + "_tokens"], tokens)
            m[name + "_seq_masked_fraction"] = _div(t[name + "_seqs"], all_seqs)
    if config.veto_threshold is not None:
        m["rollout_is_veto_fraction"] = _div(t["rollout_is_veto_seqs"], all_seqs)
        m["rollout_is_catastrophic_token_fraction"] = _div(t["veto_tokens"], tokens)
    return m
