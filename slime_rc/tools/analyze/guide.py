"""The recommendation: rollout_corr_math.md §5.3 (method by scenario) as explicit rules on measured numbers.

Three questions, each answered by a named threshold (documented in docs/analyze.md):

1. *Severity* of the per-token mismatch, from ``k3_kl`` (token mean of ``r - 1 - log r``, >= 0; ``kl`` is a signed
   one-sample estimator and can hide a real gap) and ``chi2_token`` (heavy tails):
   negligible (``k3_kl < NEGLIGIBLE_K3`` and ``chi2_seq < NEGLIGIBLE_CHI2_SEQ``), severe (``k3_kl >= SEVERE_K3`` or
   ``chi2_token >= SEVERE_CHI2_TOKEN``), moderate otherwise.
2. *Length*: a sample's sequence weight is ``exp(S)`` with ``S = sum_t log r``; ``S`` drifts like ``-T * kl`` and
   spreads like ``sqrt(2 * T * k3)`` (delta method: ``Var(log r) ~ 2 k3``), so the raw sequence weights keep an
   effective sample size of about ``exp(-2 * T * k3)``: they collapse beyond ``T* = 1 / (2 * k3)`` tokens, and once
   ``|S|`` reaches the ±20 clamp they saturate altogether (the Length Trap).  Long: the mean sample length is
   ``>= LONG_SEQ_TOKENS`` (CoT / agents), or, under moderate mismatch, ``2 * T * k3 >= LENGTH_TRAP_SPREAD`` or
   samples hit the clamp (the collapse comes from length, not from per-token severity).  Among long samples the
   measured ``chi2_seq >= SEQ_COLLAPSE_CHI2`` (or the clamp) says the sequence weights have already collapsed.
3. *Catastrophic tokens*: any token with ratio ``< CATASTROPHIC_RATIO`` -> veto.  Severity is then judged on
   ``k3_kl_excluding_catastrophic``: a token with ``r = 1e-5`` adds ``~10.5 / N`` to ``k3_kl`` on its own, and the
   veto drops it anyway.

Choice: negligible -> ``bypass_ppo_clip``; moderate short -> Seq-TIS (``decoupled_seq_is``); moderate long ->
Geo-RS-Seq-TIS (``decoupled_geo_rs_seq_tis``), or pure Geo-RS (``decoupled_geo_rs``) once sequence weights have
collapsed; severe short -> Seq-MIS (``decoupled_seq_is_rs``), or Seq-TIS when the dump has no high-weight samples
for Seq-MIS to filter (§5.3: "use Seq-MIS when high-weight samples are likely garbage"; below); severe long ->
Geo-RS (``decoupled_geo_rs``).  A choice that would reject more than ``MAX_REJECTED_FRACTION`` of the dump's tokens or
samples (:mod:`slime_rc.tools.analyze.thresholds`, the level ``slime-rc train`` warns at) gives way to the same IS
weights without its rejection (``SAFER``), with the reason and, for a geometric band, the band that would keep 95%
of the samples.  A dump recorded in bypass mode gets the bypass twin of the choice.  Every number
about what a preset would reject comes from the engine run on the dump (``report["presets"]``), never from a second
implementation.

Rejection that removes almost no IS weight is not worth its cost: a rejected sample leaves the batch (the loss
denominator, GRPO's group baselines) although its weight was ~0 already.  Hence, under severe mismatch on short
samples, Seq-TIS rather than Seq-MIS when fewer than ``SEQ_MIS_HIGH_FRACTION`` of the samples have a sequence ratio
above the upper bound (nothing "high-weight" to reject) and Seq-MIS would remove less than ``SEQ_MIS_WEIGHT_SHARE``
of Seq-TIS's weight mass (its rejections are the low side, which truncated IS already weighs ~0); and no veto on a
sequence-IS choice when it would drop more than ``MAX_VETO_SEQ_FRACTION`` of the samples while they carry less than
``VETO_WEIGHT_SHARE`` of the weight mass (the sequence weight ``prod_t r_t <= r_min * ...`` already suppresses the
catastrophic update the veto exists for, §3.5).  Measured in the collapse study of docs/results.md.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from slime_rc.tools.analyze.accumulate import CATASTROPHIC_RATIO
# MAX_REJECTED_FRACTION: one of the guide's thresholds (docs/analyze.md's table), defined where slime-rc train reads it
from slime_rc.tools.analyze.thresholds import MAX_REJECTED_FRACTION, exceeds, level_sentence  # noqa: F401

NEGLIGIBLE_K3 = 1e-4          # token k3 below this (and chi2_seq below the next): same checkpoint, numerical noise
NEGLIGIBLE_CHI2_SEQ = 0.05    # raw sequence weights within a few % of 1 (their ESS ~ 1/(1+chi2_seq) > 0.95)
SEVERE_K3 = 1e-2              # docs/metrics.md: k3_kl > 1e-2 "investigate"; beyond numerical mismatch
SEVERE_CHI2_TOKEN = 0.25      # token ESS ~ 1/(1+chi2_token) < 0.8, the "healthy" ESS of docs/metrics.md
LONG_SEQ_TOKENS = 1024        # mean loss tokens per sample from which samples count as long (CoT, agents)
LENGTH_TRAP_SPREAD = 1.0      # 2*T*k3 (predicted variance of S = sum log r) above this: length-driven collapse
SEQ_COLLAPSE_CHI2 = 1.0       # chi2_seq above this: raw sequence weights keep under half the batch effective
MIN_ESS = 0.5                 # warn when the recommendation's IS weights keep less effective sample size
MAX_VETO_SEQ_FRACTION = 0.05  # docs/metrics.md: more vetoed samples than this, investigate the engine
SEQ_MIS_HIGH_FRACTION = 0.01  # Seq-MIS only when at least this fraction of samples is above the upper bound ...
SEQ_MIS_WEIGHT_SHARE = 0.01   # ... or its rejections carry at least this share of Seq-TIS's weight mass
VETO_WEIGHT_SHARE = 0.01      # a veto dropping > MAX_VETO_SEQ_FRACTION of samples: kept only above this weight share
SHIFT_LOG_MEDIAN = 0.01       # |log median ratio| above this: every token shifted (temperature / top-p mismatch?)
CONCENTRATION = 2.0           # a probability bucket holding this many times its token share of k3 is reported

BYPASS_TWIN = {"decoupled_token_is": "ppo_is_bypass", "decoupled_seq_is": "bypass_pg_is",
               "decoupled_geo_rs_seq_tis": "bypass_pg_geo_rs_seq_tis", "decoupled_geo_rs": "pg_rs",
               "decoupled_seq_is_rs": None, "bypass_ppo_clip": "bypass_ppo_clip"}
GEOMETRIC_OPTIONS = ("geometric", "seq_mean_k1")


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def weight_share_removed(base: dict, other: dict) -> float:
    """The share of ``base``'s IS weight mass (sum of bounded weights over its kept tokens) that ``other`` -- the
    same IS weights with more rejection -- removes, from two rows of ``report["presets"]`` / ``["veto_variants"]``:
    ``1 - mean_o * kept_o / (mean_b * kept_b)`` with ``mean`` = ``rollout_is_mean`` (over kept tokens) and ``kept``
    = 1 - ``rejected_token_fraction``.  1.0 when ``base`` keeps no weight."""
    def mass(row):
        return row["metrics"]["rollout_is_mean"] * (1.0 - row["rejected_token_fraction"])
    return 1.0 - mass(other) / mass(base) if mass(base) > 0 else 1.0


# a choice that rejects too much -> the same IS weights without its rejection (why, in words)
SAFER = {"decoupled_seq_is_rs": ("decoupled_seq_is", "keeps the same truncated sequence IS weights without rejecting"),
         "decoupled_geo_rs_seq_tis": ("decoupled_seq_is", "keeps the same truncated sequence IS weights without the "
                                                          "geometric filter"),
         "decoupled_geo_rs": ("decoupled_token_is", "weighs each token by its truncated ratio, which does not "
                                                    "compound with length (biased, low variance)")}


def _too_much(row: dict) -> bool:
    """Whether a preset row of ``report["presets"]`` rejects more than the shared level (tokens or samples)."""
    return exceeds(row["rejected_token_fraction"], row["rejected_seq_fraction"])


def _rejected(row: dict) -> str:
    return f"{_pct(row['rejected_token_fraction'])} of tokens and {_pct(row['rejected_seq_fraction'])} of samples"


def _band_advice(report: dict, name: str) -> Optional[str]:
    """How to widen ``name``'s geometric band so that it keeps >= 95% of the dump's samples; None without one."""
    crit = [r for r in report["presets"][name]["rs"].split("; ") if r.split(" ")[0] in GEOMETRIC_OPTIONS]
    if not crit:
        return None
    lo, hi = report["geometric_band_95"]
    return (f"its band {crit[0].split(' ', 1)[1]} is tight for this mismatch; at least 95% of samples have a "
            f"geometric-mean ratio in [{lo}, {hi}] (geometric_band_95): widen it with --rs-upper-bound {lo}_{hi}")


def safer_choice(report: dict, name: str) -> Tuple[str, Optional[str]]:
    """``(preset, reason)``: ``name`` itself (reason None) when the engine says it rejects no more than
    :data:`MAX_REJECTED_FRACTION` of the dump's tokens and samples, else the first preset down the :data:`SAFER`
    chain that does, with a sentence saying why (and how ``name``'s band could be widened instead)."""
    row = report["presets"][name]
    if not _too_much(row):
        return name, None
    safer, why = SAFER.get(name, (None, ""))
    while safer is not None and _too_much(report["presets"][safer]):
        safer, why = SAFER.get(safer, (None, ""))
    if safer is None:
        return name, None  # nothing safer: the warning below says what to do
    band = _band_advice(report, name)
    return safer, (f"{safer} rather than {name}: on this dump {name} would reject {_rejected(row)}, above "
                   f"{level_sentence()} (a rejected sample teaches nothing and leaves its group's baseline); "
                   f"{safer} {why}, and rejects {_rejected(report['presets'][safer])} here"
                   + (f". To keep {name} instead: {band}" if band else ""))


def recommend(report: dict) -> dict:
    """``report``: the dictionary of :func:`slime_rc.tools.analyze.analyze` (metrics, ``dump``, ``presets``,
    ``veto_variants``, ``by_probability``).  Returns ``{"recommended_preset", "flags", "severity",
    "length_regime", "reasons", "warnings", "notes", "alternative"}``; every reason cites the number that
    triggered it and the threshold it was compared with."""
    kl, chi2_tok, chi2_seq = report["kl"], report["chi2_token"], report["chi2_seq"]
    d = report["dump"]
    T, clamp = d["mean_length"], d["seq_clamp_fraction"]
    reasons: List[str] = []
    warnings: List[str] = []
    k3, k3n = report["k3_kl"], "k3_kl"
    if report["catastrophic_tokens"]:
        # the veto removes catastrophic tokens; each weighs ~ -log r in k3, so judge the rest on its own
        k3, k3n = report["k3_kl_excluding_catastrophic"], "k3_kl_excluding_catastrophic"
        reasons.append(f"severity judged without the {report['catastrophic_tokens']} catastrophic token(s) (a veto "
                       f"drops them, a sequence weight makes them ~0; see below): k3_kl = {report['k3_kl']:.3g} with "
                       f"them, {k3:.3g} (k3_kl_excluding_catastrophic) without")

    # 1. severity
    if k3 >= SEVERE_K3 or chi2_tok >= SEVERE_CHI2_TOKEN:
        severity = "severe"
        why = (f"{k3n} = {k3:.3g} per token is at or above {SEVERE_K3:g}, the level beyond a numerical precision "
               f"gap (docs/metrics.md: investigate)" if k3 >= SEVERE_K3 else
               f"chi2_token = {chi2_tok:.3g} is at or above {SEVERE_CHI2_TOKEN:g}, a heavy tail of token ratios "
               f"(token ESS ~ 1/(1+chi2_token) = {1 / (1 + chi2_tok):.2f}, below the healthy 0.8), while {k3n} = "
               f"{k3:.3g}")
        reasons.append(f"severity severe: {why}")
        warnings.append(f"{k3n} = {k3:.3g}, chi2_token = {chi2_tok:.3g}: this is beyond a numerical precision gap; "
                        f"check weight sync / staleness, the sampling temperature (SGLang returns log-softmax of "
                        f"logits / T) and top-p / top-k truncation on both sides")
    elif k3 < NEGLIGIBLE_K3 and chi2_seq < NEGLIGIBLE_CHI2_SEQ:
        severity = "negligible"
        reasons.append(f"severity negligible: {k3n} = {k3:.3g} per token is below {NEGLIGIBLE_K3:g}, the numerical "
                       f"noise of one checkpoint, and chi2_seq = {chi2_seq:.3g} is below {NEGLIGIBLE_CHI2_SEQ:g} (raw "
                       f"sequence weights within a few % of 1): no IS correction needed")
    else:
        severity = "moderate"
        if k3 >= NEGLIGIBLE_K3:
            reasons.append(f"severity moderate: {k3n} = {k3:.3g} per token is between {NEGLIGIBLE_K3:g} (numerical "
                           f"noise) and {SEVERE_K3:g} (beyond a precision gap), and chi2_token = {chi2_tok:.3g} is "
                           f"below {SEVERE_CHI2_TOKEN:g} (no heavy tail of token ratios)")
        else:
            reasons.append(f"severity moderate: {k3n} = {k3:.3g} per token is below {NEGLIGIBLE_K3:g} (numerical "
                           f"noise), but chi2_seq = {chi2_seq:.3g} is at or above {NEGLIGIBLE_CHI2_SEQ:g}: the gap "
                           f"adds up over {T:.0f}-token samples")

    # 2. length
    t_star = LENGTH_TRAP_SPREAD / (2.0 * k3) if k3 > 0 else math.inf
    long_by_length = T >= LONG_SEQ_TOKENS
    trapped = T >= t_star or clamp > 0  # long relative to this mismatch: the length is what spreads S
    long = long_by_length or (severity == "moderate" and trapped)
    collapsed = chi2_seq >= SEQ_COLLAPSE_CHI2 or clamp > 0  # measured: raw sequence weights are degenerate
    physics = (f"S = sum_t log r has mean -T*kl = {-T * kl:.3g} and spread sqrt(2*T*k3) = "
               f"{math.sqrt(2 * T * k3):.3g}, so raw sequence weights exp(S) keep ESS ~ exp(-2*T*k3) = "
               f"{math.exp(-2 * T * k3):.3g}; they collapse once 2*T*k3 reaches {LENGTH_TRAP_SPREAD:g} (ESS ~ e^-1), "
               f"which at this mismatch is beyond T* = {t_star:.4g} tokens; measured chi2_seq = {chi2_seq:.3g} (from "
               f"{SEQ_COLLAPSE_CHI2:g} on, raw sequence weights keep under half the batch effective), "
               f"{_pct(clamp)} of samples have |S| at the ±20 clamp")
    length = f"mean length T = {T:.0f} loss tokens (max {d['max_length']})"
    if severity != "negligible":
        if long_by_length:
            reasons.append(f"long samples: {length} is at or above {LONG_SEQ_TOKENS} tokens, where samples count "
                           f"as long (CoT, agents); {physics}. Geo-RS judges the per-token geometric mean exp(S/T), "
                           f"which does not grow with T")
        elif long:
            reasons.append(f"long for this mismatch (Length Trap): {length} is below {LONG_SEQ_TOKENS} tokens "
                           f"(long whatever the mismatch) but at or above T*: {physics}")
        else:
            reasons.append(f"short samples: {length} is below {LONG_SEQ_TOKENS} tokens (long whatever the mismatch)"
                           + (" and below T*" if severity == "moderate" else "") + f"; {physics}")

    # choice
    if severity == "negligible":
        name = "bypass_ppo_clip"
        reasons.append("bypass_ppo_clip: with negligible mismatch the PPO ratio pi_theta/pi_rollout needs no IS "
                       "weights, and bypass mode (pi_old := pi_rollout) skips the recompute pass (§5.3)")
    elif severity == "moderate" and not long:
        name = "decoupled_seq_is"
        reasons.append(f"Seq-TIS (decoupled_seq_is): for short samples the sequence weight corrects the whole "
                       f"sample without the O(T^2) bias of per-token weights, and truncation at 2 bounds its variance "
                       f"(measured chi2_seq = {chi2_seq:.3g}); Token-TIS (decoupled_token_is) is the lower-variance, "
                       f"biased alternative")
    elif severity == "moderate" and not collapsed:
        name = "decoupled_geo_rs_seq_tis"
        reasons.append(f"Geo-RS-Seq-TIS (decoupled_geo_rs_seq_tis): the geometric filter is length-invariant and "
                       f"the sequence weights are still informative (chi2_seq = {chi2_seq:.3g} < "
                       f"{SEQ_COLLAPSE_CHI2:g}, no sample at the clamp), so truncated sequence IS still debiases")
    elif severity == "moderate":
        name = "decoupled_geo_rs"
        why = (f"chi2_seq = {chi2_seq:.3g} is at or above {SEQ_COLLAPSE_CHI2:g}: the raw sequence weights keep "
               f"under half the batch effective" if chi2_seq >= SEQ_COLLAPSE_CHI2 else f"{_pct(clamp)} of samples have |S| at the ±20 clamp")
        reasons.append(f"Geo-RS (decoupled_geo_rs): sequence weights have collapsed ({why}), so a sequence IS factor "
                       f"would give most samples ~0 weight; pure geometric rejection (with veto) is length-invariant")
    elif not long:
        tis = report["presets"]["decoupled_seq_is"]
        high = tis["metrics"]["rollout_is_seq_fraction_high"]
        share = weight_share_removed(tis, report["presets"]["decoupled_seq_is_rs"])
        tail = (f"a fraction {high:.3g} of samples (rollout_is_seq_fraction_high) have a sequence ratio above the "
                f"upper bound, where {SEQ_MIS_HIGH_FRACTION:g} makes a high-weight tail worth filtering, and "
                f"Seq-MIS's rejections carry {share:.3g} of Seq-TIS's weight mass, where {SEQ_MIS_WEIGHT_SHARE:g} "
                f"makes them matter")
        if high < SEQ_MIS_HIGH_FRACTION and share < SEQ_MIS_WEIGHT_SHARE and (tis["ess"] or 0.0) >= MIN_ESS:
            name = "decoupled_seq_is"
            reasons.append(f"Seq-TIS (decoupled_seq_is), not Seq-MIS: §5.3 uses Seq-MIS \"when high-weight samples are "
                           f"likely garbage\", and here {tail}: its rejections would be the low side, samples that "
                           f"truncated sequence IS already weighs ~0 (ESS {tis['ess']:.3g}), while rejecting them "
                           f"removes {_pct(report['presets']['decoupled_seq_is_rs']['rejected_seq_fraction'])} of the "
                           f"samples from the batch (its loss denominator, GRPO's group baselines)")
        else:
            name = "decoupled_seq_is_rs"
            reasons.append(f"Seq-MIS (decoupled_seq_is_rs): under severe mismatch high-weight samples are likely "
                           f"garbage ({tail}); sequence IS plus rejection of samples whose ratio leaves [0.5, 2] "
                           f"filters that toxic tail (§5.3)")
    else:
        name = "decoupled_geo_rs"
        reasons.append("Geo-RS (decoupled_geo_rs): severe mismatch on long samples: sequence weights are "
                       "meaningless, so reject by the length-invariant geometric mean (with veto)")

    # a choice that rejects more than the level slime-rc train warns at gives way to a safer one, said why
    name, skipped = safer_choice(report, name)
    if skipped:
        reasons.append(skipped)

    # operating mode
    modes = d.get("modes") or {}
    dump_mode = max(modes, key=modes.get) if modes else None
    twin = BYPASS_TWIN.get(name)
    alternative = None
    if name != "bypass_ppo_clip":
        if dump_mode == "bypass" and twin:
            alternative, name = name, twin
            reasons.append(f"operating mode bypass: the dump was recorded in bypass mode ({modes['bypass']} samples "
                           f"with mode=bypass), so the same estimator in bypass REINFORCE: {name} (decoupled "
                           f"equivalent: {alternative})")
        else:
            alternative = twin
            recorded = f"the dump was recorded in {dump_mode} mode; " if dump_mode else ""
            reasons.append(f"operating mode decoupled: {recorded}pi_old is recomputed, so the correction is "
                           f"batch-size invariant" + (f"; {twin} is the bypass twin (skips the recompute pass, faster, "
                                                      f"no batch-size invariance)" if twin else
                                                      "; no bypass preset has this estimator"))

    # 3. catastrophic tokens -> veto
    cat_frac = report.get("rollout_is_catastrophic_token_fraction", 0.0)
    veto_frac = report.get("rollout_is_veto_fraction", 0.0)
    row = report["presets"][name]
    flags = f"--rollout-correction-preset {name}"
    if cat_frac > 0:
        n_cat = round(cat_frac * d["valid_tokens"])
        if row["veto"] is not None:
            reasons.append(f"veto: {n_cat} catastrophic token(s) (ratio < {CATASTROPHIC_RATIO:g}; "
                           f"rollout_is_catastrophic_token_fraction = {cat_frac:.3g}) in {_pct(veto_frac)} of "
                           f"samples; {name} already vetoes at {row['veto']:g}")
        else:
            vetoed = report["veto_variants"][name]
            share = weight_share_removed(row, vetoed) if row["is"].startswith("sequence") else None
            found = (f"{n_cat} catastrophic token(s) (ratio < {CATASTROPHIC_RATIO:g}; "
                     f"rollout_is_catastrophic_token_fraction = {cat_frac:.3g}, rollout_is_min = "
                     f"{report.get('rollout_is_min', 0.0):.3g}) in {_pct(veto_frac)} of samples")
            if share is not None and veto_frac > MAX_VETO_SEQ_FRACTION and share < VETO_WEIGHT_SHARE:
                reasons.append(f"no veto: {found}, but under {name}'s sequence IS weights they carry {share:.3g} of "
                               f"the weight mass, below {VETO_WEIGHT_SHARE:g}: the sequence weight already "
                               f"suppresses the catastrophic update the veto exists for, and vetoing would drop "
                               f"{_pct(vetoed['rejected_seq_fraction'])} of the samples from the batch, more than "
                               f"{_pct(MAX_VETO_SEQ_FRACTION)} (docs/metrics.md: investigate above it)")
            elif _too_much(vetoed):
                reasons.append(f"no veto: {found}, but vetoing would reject {_rejected(vetoed)}, above "
                               f"{level_sentence()}; without it {name} rejects {_rejected(row)}")
            else:
                row = vetoed
                flags += f" --rs-veto-threshold {CATASTROPHIC_RATIO:g}"
                reasons.append(f"veto: {found}: add --rs-veto-threshold {CATASTROPHIC_RATIO:g} to drop those samples")
        if veto_frac > MAX_VETO_SEQ_FRACTION:
            warnings.append(f"{_pct(veto_frac)} of samples hold a catastrophic token, more than "
                            f"{_pct(MAX_VETO_SEQ_FRACTION)} (a veto would drop them; docs/metrics.md: investigate "
                            f"above it): catastrophic tokens are common, investigate the engine")
    else:
        reasons.append(f"no veto needed: no token has a ratio below {CATASTROPHIC_RATIO:g}, the catastrophic level "
                       f"(rollout_is_min = {report.get('rollout_is_min', 0.0):.3g})")

    # what the engine says the choice does to this dump
    ess = row["ess"]
    reasons.append(f"on this dump the engine with {flags.replace('--rollout-correction-preset ', '')} rejects "
                   f"{_pct(row['rejected_token_fraction'])} of tokens and {_pct(row['rejected_seq_fraction'])} of "
                   f"samples" + ("" if ess is None else f", IS effective sample size {ess:.3g}")
                   + ("" if row["is_weights_applied"] or ess is None else " (IS weights diagnostics only)"))
    if _too_much(row):  # no safer preset was left (the fallbacks reject nothing, so only a veto gets here)
        warnings.append(f"{name} rejects {_rejected(row)}, above {level_sentence()}: "
                        + (_band_advice(report, name) or "loosen its bounds") + ", or investigate the mismatch")
    if ess is not None and ess < MIN_ESS:
        warnings.append(f"{name}'s IS weights keep an effective sample size of {ess:.3g}, below {MIN_ESS:g}: "
                        f"the weights are degenerate")

    if len(modes) > 1:
        warnings.append(f"the dump mixes samples recorded in {len(modes)} modes ("
                        + ", ".join(f"{m}: {n}" for m, n in modes.items()) + f"): dumps of different runs or "
                        f"configurations together? the operating mode above follows the most frequent one "
                        f"({dump_mode}); analyze each run's dump on its own")
    if d.get("skipped_floor_tokens"):
        warnings.append(f"{d['skipped_floor_tokens']} loss token(s) in {d['skipped_floor_samples']} sample(s) have a "
                        f"log-prob at the float floor (<= -1e30, a stand-in for -inf; first in "
                        f"{d['first_floor_sample']}) and were left out of every number here: the rollout engine gave "
                        f"them no probability (top-k / top-p truncation?) or the trainer's log-prob underflowed; "
                        f"training sees them clamped at the ±20 bound")
    notes = _notes(report)
    return {"recommended_preset": name, "flags": flags, "severity": severity,
            "length_regime": None if severity == "negligible" else ("long" if long else "short"),
            "reasons": reasons, "warnings": warnings, "notes": notes, "alternative": alternative}


def _notes(report: dict) -> List[str]:
    notes = []
    rows = report["by_probability"]
    hot: Optional[dict] = max(rows, key=lambda r: r["k3_share"] / max(r["token_share"], 1e-300), default=None)
    if hot and hot["k3_share"] >= CONCENTRATION * hot["token_share"] and hot["k3_share"] > 0:
        notes.append(f"{_pct(hot['k3_share'])} of the k3 mismatch sits on tokens with {hot['bucket']} "
                     f"({_pct(hot['token_share'])} of tokens): mismatch concentrates on low-probability tokens "
                     f"(bf16 resolution, sampling truncation)" if hot["min_prob"] < 0.1 else
                     f"{_pct(hot['k3_share'])} of the k3 mismatch sits on tokens with {hot['bucket']} "
                     f"({_pct(hot['token_share'])} of tokens)")
    p50 = report["quantiles"].get("p50", 1.0)
    if p50 > 0 and abs(math.log(p50)) > SHIFT_LOG_MEDIAN:
        notes.append(f"median ratio p50 = {p50:.4g} (|log p50| = {abs(math.log(p50)):.3g} is above "
                     f"{SHIFT_LOG_MEDIAN:g}): every token is shifted, a systematic gap (temperature, top-p, a "
                     f"different checkpoint)")
    return notes
