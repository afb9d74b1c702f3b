"""Streaming analysis of a log-prob dump: the engine per chunk, additive totals merged across chunks.

A dump larger than memory is read in chunks of whole samples (about ``chunk_tokens`` tokens each).  Every decision
of :func:`slime_rc.compute_rollout_correction` is per token or per sequence, and a sequence never straddles two
chunks; only batch normalization and the metrics are batch-level, and every metric is a ratio of additive totals
(sums and counts) or an extreme.  So each chunk's metric times its denominator is that chunk's total, totals add
up, and the merged metric equals the engine's metric on the whole dump as one batch (up to float64 summation
order, ~1e-12 relative).  Nothing here decides IS weights or rejections: those come from the engine, per preset.

What is merged how (:func:`merge_rule`):

* token means (``kl``, ``k3_kl``, ...): ``sum_c metric_c * valid_tokens_c / sum_c valid_tokens_c``;
* sequence means (``log_ppl_diff``, ``chi2_seq + 1``, ...): the same with valid sequences;
* fractions of loss tokens / loss sequences / kept tokens: the same with those counts;
* extremes (``rollout_is_max``, ``log_ppl_diff_min``, ...): max / min over chunks that have any;
* standard deviations and ESS: from the merged first and second moments (``E[w^2] = mean^2 / ESS``);
* quantiles: from the summed histogram of ``slime_rc.correction.quantiles`` (integer counts: exact across chunks).

Besides the engine, one token-level pass per chunk (:meth:`DumpAnalysis._token_pass`) adds the breakdowns by
rollout-token probability and by sample length and the log-ratio histograms: plain sums of ``-log r``,
``k3 = r - 1 - log r`` and ``|log r|`` with the engine's validity and clamping.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from slime_rc.config.schema import RS_OPTIONS, RolloutCorrectionConfig
from slime_rc.correction.engine import compute_rollout_correction
from slime_rc.correction.metrics import METRICS
from slime_rc.correction.packed import cu_seqlens_from_lengths, segment_sum
from slime_rc.config.presets import PRESETS
from slime_rc.correction.quantiles import QUANTILES, histogram, num_bins, quantiles_from_histogram
from slime_rc.config.resolution import Layer, preset_layer, resolve
from slime_rc.tools.dump import FLOOR_LOG_PROB


def _div(a: float, b: float) -> float:
    """``a / b``, 0 for an empty denominator (host floats: the analysis runs offline, on the CPU)."""
    return a / b if b > 0 else 0.0


DEFAULT_CHUNK_TOKENS = 1_000_000
# A token whose ratio pi_train/pi_rollout is below this is "catastrophic" (the presets' veto threshold).
CATASTROPHIC_RATIO = 1e-4
# Breakdown edges.  Lengths are loss tokens per sample; probabilities are pi_rollout of the token.
LENGTH_EDGES = (32, 128, 512, 2048, 8192)
PROB_EDGES = (1e-3, 1e-2, 1e-1, 0.5, 0.9)
# Presets the recommendation may pick; each also gets a "+ veto" variant evaluated by the engine.
CANDIDATES = ("bypass_ppo_clip", "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs",
              "decoupled_geo_rs_seq_tis", "decoupled_geo_rs", "ppo_is_bypass", "bypass_pg_is",
              "bypass_pg_geo_rs_seq_tis", "pg_rs")


def analysis_config(safety_bound: float = 20.0) -> RolloutCorrectionConfig:
    """The configuration of the top-level metrics: token-level IS with the upper bound at ``exp(safety_bound)``
    (so the weights are the raw, safety-bounded ratios: their mean, ESS, extremes and quantiles describe the
    mismatch itself) and veto at :data:`CATASTROPHIC_RATIO` (counts catastrophic tokens)."""
    return RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=math.exp(safety_bound),
                                   veto_threshold=CATASTROPHIC_RATIO, safety_bound=safety_bound)


def with_veto(name: str) -> RolloutCorrectionConfig:
    """Preset ``name`` with ``--rs-veto-threshold CATASTROPHIC_RATIO`` on top (built like a launch line)."""
    return resolve([preset_layer(name), Layer.from_mapping({"rs_veto_threshold": CATASTROPHIC_RATIO},
                                                           kind="flag")]).config


def engine_key(c: RolloutCorrectionConfig) -> tuple:
    """What the engine's output depends on: presets that differ only in the loss (mode, loss type, denominator)
    give identical weights, keep masks and metrics, so they share one engine run."""
    return (c.is_level, c.is_mode, c.is_upper_bound, c.is_lower, c.is_batch_normalize, c.rs, c.veto_threshold,
            c.safety_bound, c.on_nonfinite, c.quantile_bins_per_octave)


# ---- merging the engine's metrics ------------------------------------------------------------------------------
_TOKEN_MEANS = {"kl", "k3_kl", "train_rollout_logprob_abs_diff", "rollout_is_ratio_fraction_high",
                "rollout_is_ratio_fraction_low", "rollout_is_catastrophic_token_fraction",
                "rollout_rs_masked_fraction", "rollout_is_masked_fraction"}
_SEQ_MEANS = {"training_log_ppl", "training_ppl", "rollout_log_ppl", "rollout_ppl", "log_ppl_diff",
              "log_ppl_abs_diff", "ppl_ratio", "rollout_is_seq_mean", "rollout_is_seq_fraction_high",
              "rollout_is_seq_fraction_low"}
_LOSS_TOKEN_MEANS = {"rejected_token_fraction", "nonfinite_token_fraction"}
_LOSS_SEQ_MEANS = {"rejected_seq_fraction", "nonfinite_seq_fraction", "rollout_is_veto_fraction",
                   "rollout_rs_seq_masked_fraction", "rollout_is_seq_masked_fraction"}
_EXTREMES = {"log_ppl_diff_max": ("max", "seqs"), "log_ppl_diff_min": ("min", "seqs"),
             "rollout_is_max": ("max", "tokens"), "rollout_is_min": ("min", "tokens"),
             "rollout_is_seq_max": ("max", "seqs"), "rollout_is_seq_min": ("min", "seqs"),
             "rollout_is_seq_max_deviation": ("max", "seqs")}
_ALWAYS = {n for n, (when, _) in METRICS.items() if when == "always"}  # the same for every configuration
_DERIVED = {"rollout_is_std", "rollout_is_eff_sample_size", "rollout_is_seq_std"}
_QUANTILE = re.compile(r"^rollout_is_p\d+$")


# verl's per-option RS statistics (suffix -> (kind, denominator); "*" = "tokens" for a token criterion, "seqs" for a
# sequence one, whose token statistics are its per-sequence value weighted by the sequence's valid tokens)
_RS_STATISTICS = {"_mean": ("mean", "tokens"), "_max": ("max", "*"), "_min": ("min", "*"),
                  "_fraction_high": ("mean", "*"), "_fraction_low": ("mean", "*"),
                  "_seq_mean": ("mean", "seqs"), "_seq_std": ("derived", ""), "_seq_max": ("max", "seqs"),
                  "_seq_min": ("min", "seqs"), "_seq_max_deviation": ("max", "seqs"),
                  "_seq_fraction_high": ("mean", "seqs"), "_seq_fraction_low": ("mean", "seqs")}
# longest first: "token_k1" before "token"
_RS_PREFIXES = [(f"rollout_rs_{o}", o) for o in sorted(RS_OPTIONS, key=len, reverse=True)]


def _rs_statistic(name: str) -> Optional[Tuple[str, str]]:
    """``(option, suffix)`` of one of verl's per-option RS statistics, else None."""
    for prefix, option in _RS_PREFIXES:
        if name.startswith(prefix) and name[len(prefix):] in _RS_STATISTICS:
            return option, name[len(prefix):]
    return None


def merge_rule(name: str) -> Optional[Tuple[str, str]]:
    """``(kind, denominator)`` of a metric name, None when chunk values cannot be merged exactly
    (``rollout_is_batch_norm_factor``: a per-batch normalization; ``rollout_rs_<option>_std``: the spread of the
    statistic clamped into the band, whose mean no metric reports)."""
    if name in _TOKEN_MEANS or re.fullmatch(r"rollout_rs_\w+(?<!_seq)_masked_fraction", name):
        return "mean", "tokens"
    rs = _rs_statistic(name)
    if rs is not None:
        kind, den = _RS_STATISTICS[rs[1]]
        return kind, (("tokens" if RS_OPTIONS[rs[0]][0] == "token" else "seqs") if den == "*" else den)
    if name in _SEQ_MEANS:
        return "mean", "seqs"
    if name == "chi2_token":
        return "mean+1", "tokens"  # chi2 + 1 = E[r^2] is the additive part
    if name == "chi2_seq":
        return "mean+1", "seqs"
    if name in _LOSS_TOKEN_MEANS:
        return "mean", "loss_tokens"
    if name in _LOSS_SEQ_MEANS or re.fullmatch(r"rollout_rs_\w+_seq_masked_fraction", name):
        return "mean", "loss_seqs"
    if name == "rollout_is_mean":
        return "mean", "kept"
    if name in _EXTREMES:
        return _EXTREMES[name]
    if name in _DERIVED:
        return "derived", ""
    if _QUANTILE.match(name):
        return "quantile", "tokens"
    return None


class MetricMerger:
    """Merges one configuration's per-chunk engine metrics into whole-dump metrics (see the module docstring).

    ``add(metrics, denominators)``: ``metrics`` name -> float of one chunk; ``denominators``: that chunk's
    ``tokens`` (valid tokens), ``seqs`` (valid sequences), ``loss_tokens``, ``loss_seqs`` and ``kept`` (tokens
    the engine kept).  ``finish(histogram)`` -> name -> float; the quantiles only when given the summed histogram
    the engine reads them from (token level: of token log r; sequence level: of the clamped sum log r of each
    sample, counted once per token), else they are left out and listed in ``unmerged``.
    """

    def __init__(self):
        self.names: List[str] = []
        self._seen: set = set()
        self.unmerged: set = set()
        self.sums: Dict[str, float] = defaultdict(float)
        self.den: Dict[str, float] = defaultdict(float)
        self.ext: Dict[str, float] = {}
        self.config: Optional[RolloutCorrectionConfig] = None

    def add(self, metrics: Dict[str, float], den: Dict[str, float]) -> None:
        for k, v in den.items():
            self.den[k] += v
        for name, value in metrics.items():
            rule = merge_rule(name)
            if rule is None:
                self.unmerged.add(name)
                continue
            if name not in self._seen:
                self._seen.add(name)
                self.names.append(name)
            kind, d = rule
            if kind == "mean":
                self.sums[name] += value * den[d]
            elif kind == "mean+1":
                self.sums[name] += (value + 1.0) * den[d] if den[d] > 0 else 0.0
            elif kind in ("max", "min") and den[d] > 0:  # the engine reports 0 for an empty set: skip those
                old = self.ext.get(name)
                self.ext[name] = value if old is None else (max(old, value) if kind == "max" else min(old, value))
        if "rollout_is_eff_sample_size" in metrics:
            # E[w^2] over kept tokens: ESS = mean^2 / E[w^2] (ESS 0 <=> E[w^2] 0, weights >= 0)
            mean, ess = metrics["rollout_is_mean"], metrics["rollout_is_eff_sample_size"]
            self.sums["_w_sq"] += (mean * mean / ess if ess > 0 else 0.0) * den["kept"]
        if "rollout_is_seq_std" in metrics:
            mean, std = metrics["rollout_is_seq_mean"], metrics["rollout_is_seq_std"]
            self.sums["_seq_w_sq"] += (std * std + mean * mean) * den["seqs"]
        for name in metrics:
            if name.endswith("_seq_std") and name.startswith("rollout_rs_"):
                # E[v^2] over the chunk's n sequences: its _seq_std divides by n - 1 (0 for n < 2)
                n, mean, std = den["seqs"], metrics[name[:-4] + "_mean"], metrics[name]
                self.sums[name + "_sq"] += std * std * max(n - 1.0, 0.0) + mean * mean * n

    def finish(self, hist: Optional[torch.Tensor] = None) -> Dict[str, float]:
        c = self.config
        out = {}
        for name in self.names:
            kind, d = merge_rule(name)
            if kind == "mean":
                out[name] = _div(self.sums[name], self.den[d])
            elif kind == "mean+1":
                out[name] = self.sums[name] / self.den[d] - 1.0 if self.den[d] > 0 else 0.0
            elif kind in ("max", "min"):
                out[name] = self.ext.get(name, 0.0)
        if "rollout_is_eff_sample_size" in self.names:
            mean, msq = out["rollout_is_mean"], _div(self.sums["_w_sq"], self.den["kept"])
            out["rollout_is_std"] = math.sqrt(max(msq - mean * mean, 0.0))
            out["rollout_is_eff_sample_size"] = mean * mean / msq if msq > 0 else 0.0
        if "rollout_is_seq_std" in self.names:
            mean, msq = out["rollout_is_seq_mean"], _div(self.sums["_seq_w_sq"], self.den["seqs"])
            out["rollout_is_seq_std"] = math.sqrt(max(msq - mean * mean, 0.0))
        for name in self.names:
            if name.endswith("_seq_std") and name.startswith("rollout_rs_"):
                base, n = name[:-4], self.den["seqs"]
                mean, top, bottom = out[base + "_mean"], out[base + "_max"], out[base + "_min"]
                var = max(_div(self.sums[name + "_sq"], n) - mean * mean, 0.0) * _div(n, n - 1.0)
                out[name] = math.sqrt(var) if n > 1 and top != bottom else 0.0  # equal values: 0, as the engine
        quantile_names = [n for n in self.names if _QUANTILE.match(n)]
        if quantile_names and hist is not None and c is not None:
            qs = quantiles_from_histogram(hist, c.quantile_bins_per_octave, c.safety_bound).tolist()
            for q, v in zip(QUANTILES, qs):
                out[f"rollout_is_p{round(q * 100)}"] = math.exp(v) if self.den["tokens"] > 0 else 0.0
        elif quantile_names:
            self.unmerged.update(quantile_names)
        return {n: out[n] for n in self.names if n in out}


# ---- the analysis ------------------------------------------------------------------------------------------------
def _bucket_labels(edges, fmt) -> List[str]:
    out = [f"< {fmt(edges[0])}"]
    out += [f"{fmt(a)} - {fmt(b)}" for a, b in zip(edges[:-1], edges[1:])]
    return out + [f">= {fmt(edges[-1])}"]


LENGTH_LABELS = _bucket_labels(LENGTH_EDGES, lambda x: f"{x:d}")
PROB_LABELS = ["p " + s for s in _bucket_labels(PROB_EDGES, lambda x: f"{x:g}")]
# columns of the breakdown accumulators
_LEN_COLS = ("samples", "tokens", "neg_lr", "k3", "abs_lr", "abs_seq_lr", "clamped", "seq_ratio_sq")
_PROB_COLS = ("tokens", "samples", "neg_lr", "k3", "abs_lr")


class DumpAnalysis:
    """Accumulates a dump chunk by chunk: ``add_chunk(samples)`` for lists of :class:`slime_rc.tools.dump.Sample`,
    then ``finish()`` -> the report dictionary (see :func:`slime_rc.tools.analyze.analyze`)."""

    def __init__(self, presets: Iterable[str] = tuple(PRESETS), safety_bound: float = 20.0):
        self.base_config = analysis_config(safety_bound)
        self.bound = safety_bound
        self.bins = self.base_config.quantile_bins_per_octave
        self.preset_configs = {n: RolloutCorrectionConfig.preset(n) for n in presets}
        self.veto_configs = {n: with_veto(n) for n in CANDIDATES
                             if n in self.preset_configs and self.preset_configs[n].veto_threshold is None}
        self.engine_configs: Dict[tuple, RolloutCorrectionConfig] = {}
        for c in list(self.preset_configs.values()) + list(self.veto_configs.values()):
            self.engine_configs.setdefault(engine_key(c), c)
        self.base = MetricMerger()
        self.base.config = self.base_config
        self.mergers = {k: MetricMerger() for k in self.engine_configs}
        for k, c in self.engine_configs.items():
            self.mergers[k].config = c
        n = num_bins(self.bins, self.bound)
        self.hist = torch.zeros(n, dtype=torch.float64)  # token log r over valid tokens (the engine's quantiles)
        self.geo_hist = torch.zeros(n, dtype=torch.float64)  # per-sample geometric-mean log r (Geo-RS statistic)
        self.seq_hist = torch.zeros(n, dtype=torch.float64)  # clamped sum log r per sample, x its tokens (Seq-IS)
        self.by_length = torch.zeros(len(LENGTH_EDGES) + 1, len(_LEN_COLS), dtype=torch.float64)
        self.by_prob = torch.zeros(len(PROB_EDGES) + 1, len(_PROB_COLS), dtype=torch.float64)
        self._len_edges = torch.tensor(LENGTH_EDGES, dtype=torch.float64)
        self._prob_edges = torch.tensor([math.log(p) for p in PROB_EDGES], dtype=torch.float64)
        self._log_catastrophic = math.log(CATASTROPHIC_RATIO)
        self.catastrophic = torch.zeros(2, dtype=torch.float64)  # tokens with r < CATASTROPHIC_RATIO: count, k3 sum
        self.samples = self.response_tokens = self.chunks = 0
        self.max_length = 0
        self.files: Dict[str, int] = {}
        self.steps: set = set()
        self.modes: Counter = Counter()
        self.floor_tokens = self.floor_samples = 0  # loss tokens skipped: a log-prob at the float floor
        self.floor_where: Optional[str] = None  # file:line of the first such sample

    # -- one chunk ---------------------------------------------------------------------------------------------
    def add_chunk(self, samples: List) -> None:
        """``samples``: whole samples, packed here into one batch ``[N]`` with ``cu_seqlens`` ``[B+1]``."""
        if not samples:
            return
        lengths = [len(s) for s in samples]
        train = torch.cat([s.train_log_probs for s in samples])
        rollout = torch.cat([s.rollout_log_probs for s in samples])
        mask = torch.cat([s.loss_mask for s in samples])
        cu = cu_seqlens_from_lengths(lengths)
        # a log-prob at the float floor (-3.4e38: a stand-in for -inf) is no measurement: skip the token, count it
        floor = mask & ((train <= FLOOR_LOG_PROB) | (rollout <= FLOOR_LOG_PROB))
        if bool(floor.any()):
            per_seq = segment_sum(floor.double(), cu)
            self.floor_tokens += int(floor.sum())
            self.floor_samples += int((per_seq > 0).sum())
            if self.floor_where is None:
                self.floor_where = samples[int(torch.nonzero(per_seq > 0)[0, 0])].where
            mask = mask & ~floor
        for s in samples:
            self.files[s.path] = self.files.get(s.path, 0) + 1
            if s.step is not None:
                self.steps.add(s.step)
            mode = s.extra.get("mode")
            if isinstance(mode, str):
                self.modes[mode] += 1
        self.samples += len(samples)
        self.response_tokens += int(cu[-1])
        self.chunks += 1

        base = compute_rollout_correction(train, rollout, mask, cu, self.base_config)
        n_i = base.sequences["valid_tokens"]
        den = {"tokens": float(n_i.sum()), "seqs": float((n_i > 0).sum()), "loss_tokens": float(mask.sum()),
               "loss_seqs": float((segment_sum(mask, cu) > 0).sum())}
        self.base.add(_floats(base.metrics), dict(den, kept=float(base.keep_mask.sum(dtype=torch.float64))))
        for key, config in self.engine_configs.items():
            out = compute_rollout_correction(train, rollout, mask, cu, config)
            self.mergers[key].add(_floats(out.metrics), dict(den, kept=float(out.keep_mask.sum(dtype=torch.float64))))
        self._token_pass(train, rollout, mask, cu, base.sequences)

    def _token_pass(self, train, rollout, mask, cu, seqs) -> None:
        """Breakdowns and histograms: ``[N]`` float32 log-probs, ``[N]`` bool mask, the engine's per-sequence
        ``valid_tokens`` / ``log_ratio_sum`` ``[B]``.  Token statistics use the engine's definitions: ``log r``
        in float32, valid = loss token with finite log-probs, ``r = exp(clamp(log r, +-bound))``."""
        b = self.bound
        valid = mask & torch.isfinite(train) & torch.isfinite(rollout)
        lr = torch.where(valid, train - rollout, 0.0)
        lr_c = lr.clamp(-b, b)
        lr64, lr_c64 = lr.double(), lr_c.double()
        k3 = torch.where(valid, torch.exp(lr_c).double() - 1.0 - lr_c64, 0.0)
        abs_lr = lr64.abs()
        lr_valid = lr[valid]
        self.hist += histogram(lr_valid, self.bins, b)
        # catastrophic tokens (the veto's test: unclamped log r below the threshold) dominate token means out of
        # proportion (k3 = r - 1 - log r ~ 10.5 at r = 1e-5); the recommendation judges severity without them,
        # as the veto drops them
        cat = valid & (lr < self._log_catastrophic)
        self.catastrophic += torch.stack([cat.sum().double(), k3[cat].sum()])

        # by rollout probability: bucket of each valid token, and the samples that hold one
        n_seq = cu.numel() - 1
        seq_of_token = torch.repeat_interleave(torch.arange(n_seq), cu[1:] - cu[:-1])[valid]
        nb = len(PROB_EDGES) + 1
        pb = torch.bucketize(rollout[valid].double(), self._prob_edges, right=True)
        self.by_prob[:, 0] += torch.bincount(pb, minlength=nb).double()
        for j, w in ((2, -lr64), (3, k3), (4, abs_lr)):
            self.by_prob[:, j] += torch.bincount(pb, weights=w[valid], minlength=nb)
        present = torch.bincount(seq_of_token * nb + pb, minlength=n_seq * nb).view(n_seq, nb) > 0
        self.by_prob[:, 1] += present.sum(0).double()

        # by sample length (valid tokens): sequence statistics from the engine plus per-sequence token sums
        n_i, s_i = seqs["valid_tokens"].contiguous(), seqs["log_ratio_sum"].contiguous()
        has = n_i > 0
        lb = torch.bucketize(n_i, self._len_edges, right=True)[has]
        s_c = s_i.clamp(-b, b)
        per_seq = [torch.ones_like(n_i), n_i, -s_i, segment_sum(k3, cu), segment_sum(abs_lr, cu), s_i.abs(),
                   (s_i.abs() >= b).double(), torch.exp(2 * s_c)]
        for j, w in enumerate(per_seq):
            self.by_length[:, j] += torch.bincount(lb, weights=w[has], minlength=len(LENGTH_EDGES) + 1)
        if bool(has.any()):
            self.max_length = max(self.max_length, int(n_i.max()))
            self.geo_hist += histogram((s_i[has] / n_i[has]).float(), self.bins, b)
            self.seq_hist += histogram(s_c[has], self.bins, b, weights=n_i[has])

    # -- the report ----------------------------------------------------------------------------------------------
    def quantile(self, hist: torch.Tensor, qs) -> List[float]:
        """Log-space quantiles ``qs`` of one of the histograms."""
        return quantiles_from_histogram(hist, self.bins, self.bound, qs=tuple(qs)).tolist()

    def finish(self) -> dict:
        metrics = self.base.finish(self.hist)
        tokens, seqs = self.base.den["tokens"], self.base.den["seqs"]
        report = {
            "dump": {
                "files": len(self.files), "steps": sorted(self.steps), "samples": self.samples,
                "response_tokens": self.response_tokens, "loss_tokens": int(self.base.den["loss_tokens"]),
                "valid_tokens": int(tokens), "valid_samples": int(seqs),
                "mean_length": _div(tokens, seqs), "max_length": self.max_length,
                "modes": dict(self.modes), "chunks": self.chunks,
                "seq_clamp_fraction": _div(float(self.by_length[:, 6].sum()), seqs),
            },
            **metrics,
            "quantiles": {f"p{round(q * 100)}": metrics.get(f"rollout_is_p{round(q * 100)}", 0.0)
                          for q in QUANTILES},
            "ess": metrics.get("rollout_is_eff_sample_size", 0.0),
            "by_length": self._length_rows(),
            "by_probability": self._prob_rows(),
            "presets": self._preset_rows(),
            "veto_variants": {n: self._row(n, c) for n, c in self.veto_configs.items()},
        }
        report["geometric_band_95"] = self._geometric_band(0.025, 0.975)
        n_cat, k3_cat = self.catastrophic.tolist()
        report["catastrophic_tokens"] = int(n_cat)
        report["k3_kl_excluding_catastrophic"] = _div(float(self.by_prob[:, 3].sum()) - k3_cat, tokens - n_cat)
        if self.floor_tokens:  # only then: a report of a clean dump keeps its keys
            report["dump"]["skipped_floor_tokens"] = self.floor_tokens
            report["dump"]["skipped_floor_samples"] = self.floor_samples
            report["dump"]["first_floor_sample"] = self.floor_where
        report["_histogram"] = self.hist
        report["_bins"] = (self.bins, self.bound)
        return report

    def _geometric_band(self, q_lo: float, q_hi: float) -> List[float]:
        """A ratio band ``[lower, upper]`` around 1 holding the ``q_lo..q_hi`` quantiles of the samples' geometric-mean
        ratio ``exp(S/T)``: each histogram quantile is pushed past its bin's outer edge (bins span at most
        ``|x| / bins_per_octave``) and rounded outward to 6 decimals, so the band holds at least those samples."""
        if self.base.den["seqs"] <= 0:
            return [1.0, 1.0]
        widen = 1.0 + 1.0 / self.bins
        lo, hi = (math.exp(x * widen) for x in self.quantile(self.geo_hist, (q_lo, q_hi)))
        lower, upper = min(lo, 1.0 / hi), max(hi, 1.0 / lo)
        return [math.floor(lower * 1e6) / 1e6, math.ceil(upper * 1e6) / 1e6]

    def _length_rows(self) -> List[dict]:
        rows = []
        for label, lo, v in zip(LENGTH_LABELS, (0,) + LENGTH_EDGES, self.by_length.tolist()):
            d = dict(zip(_LEN_COLS, v))
            if d["samples"] == 0:
                continue
            rows.append({"bucket": label, "min_length": lo, "samples": int(d["samples"]), "tokens": int(d["tokens"]),
                         "kl": _div(d["neg_lr"], d["tokens"]), "k3_kl": _div(d["k3"], d["tokens"]),
                         "mean_abs_log_ratio": _div(d["abs_lr"], d["tokens"]),
                         "mean_abs_seq_log_ratio": d["abs_seq_lr"] / d["samples"],
                         "seq_clamp_fraction": d["clamped"] / d["samples"],
                         "chi2_seq": d["seq_ratio_sq"] / d["samples"] - 1.0})
        return rows

    def _prob_rows(self) -> List[dict]:
        total = self.by_prob.sum(0).tolist()
        rows = []
        for label, lo, v in zip(PROB_LABELS, (0.0,) + PROB_EDGES, self.by_prob.tolist()):
            d = dict(zip(_PROB_COLS, v))
            if d["tokens"] == 0:
                continue
            rows.append({"bucket": label, "min_prob": lo, "tokens": int(d["tokens"]),
                         "token_share": _div(d["tokens"], total[0]), "samples": int(d["samples"]),
                         "kl": _div(d["neg_lr"], d["tokens"]), "k3_kl": _div(d["k3"], d["tokens"]),
                         "k3_share": _div(d["k3"], total[3]), "mean_abs_log_ratio": _div(d["abs_lr"], d["tokens"])})
        return rows

    def _row(self, name: str, c: RolloutCorrectionConfig) -> dict:
        m = self.mergers[engine_key(c)].finish({"token": self.hist, "sequence": self.seq_hist}.get(c.is_level))
        return {"mode": c.mode, "loss_type": c.loss_type, "is": describe_is(c), "rs": describe_rs(c),
                "veto": c.veto_threshold, "is_weights_applied": c.is_weights_applied,
                "rejected_token_fraction": m["rejected_token_fraction"],
                "rejected_seq_fraction": m["rejected_seq_fraction"],
                "ess": m.get("rollout_is_eff_sample_size") if c.is_enabled else None,
                "metrics": {k: v for k, v in m.items() if k not in _ALWAYS or k.startswith("rejected")}}

    def _preset_rows(self) -> Dict[str, dict]:
        return {n: self._row(n, c) for n, c in self.preset_configs.items()}


def describe_is(c: RolloutCorrectionConfig) -> str:
    if not c.is_enabled:
        return "-"
    if c.is_mode == "truncate":
        return f"{c.is_level} <= {c.is_upper_bound:g}"
    return f"{c.is_level} {c.is_mode} [{c.is_lower:g}, {c.is_upper_bound:g}]"


def describe_rs(c: RolloutCorrectionConfig) -> str:
    return "; ".join(f"{r.option} [{r.lower:g}, {r.upper:g}]" if r.statistic == "k1" else f"{r.option} <= {r.upper:g}"
                     for r in c.rs) or "-"


def _floats(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    names = list(metrics)
    values = torch.stack([metrics[n] for n in names]).tolist() if names else []
    return dict(zip(names, values))
