"""``slime-rc study estimators``: bias and variance of the rollout-correction estimators against an exact gradient.

The toy problem (docs/estimators.md has the derivations):

* policy: ``T`` positions, ``K`` actions, independent per-position softmaxes ``pi_t = softmax(theta[t])``,
  ``theta`` ``[T, K]`` with i.i.d. N(0, 1) entries.  ``log pi(tau) = sum_t log pi_t(a_t)``.
* reward: multiplicative partial credit ``R(tau) = prod_t f_t(a_t)``, ``f_t(k) = exp(beta [k == c_t]) / m_t`` with
  ``c_t = argmax_k theta[t, k]`` the "correct" token and ``m_t = E_{pi_t}[exp(beta [a == c_t])]`` (a constant
  fixed at theta) so that ``J = E_pi[R] = 1`` at every ``T``.  ``log R`` is additive, ``R`` is not: token-level IS
  is biased exactly because ``E[R | a_t]`` depends multiplicatively on the distribution of every other token.
* exact gradient: ``g[t, k] = dJ/dtheta[t, k] = pi_t(k) (f_t(k) - 1)``  (``[T, K]``).
* rollout policy: ``mu_t = softmax(theta[t] + s_t eps[t])``: noise on the logits, ``eps`` ``[T, K]`` i.i.d.
  N(0, 1) per seed, its size ``s_t`` set per position so that ``KL(mu_t || pi_t) = delta^2 / 2`` exactly at every
  position (``s_t ~= delta / sd_pi(eps_t)`` for small ``delta``); ``delta`` is the mismatch size, and the per-token
  mismatch is the same at every position and length.
* estimators, from ``N`` sequences ``tau_i ~ mu`` with per-token coefficients ``c_it`` (IS weight x keep mask, both
  from :func:`slime_rc.compute_rollout_correction` with the estimator's preset):

      g_hat = 1/D sum_i (R_i - b) sum_t c_it (e_{a_it} - pi_t),    e_{a_it} - pi_t = d log pi_t(a_it) / d theta[t]

  ``b = J = 1`` (a constant baseline, the same for every estimator and sample), ``D`` = number of kept sequences
  (the loss's default: rejected sequences leave the denominator, ``rejected_in_denominator=False``).

Problems are nested: the problem of length ``T`` is the first ``T`` positions of the longest one, and the samples of
length ``T`` are prefixes of the longest samples (the same uniforms drive every mismatch size), so curves over ``T``
and ``delta`` share their random numbers and differ only by what changed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.engine import compute_rollout_correction

PROG = "slime-rc study estimators"
NUM_ACTIONS = 4
BETA = 0.25  # reward sharpness: each correct token multiplies R by e^beta (before normalization)
BASELINE = 1.0  # = J, the exact on-policy value (R is normalized so that E_pi[R] = 1)
UNCAPPED = 1e30  # "no truncation": only the engine's +-safety_bound clamp on log rho bounds the weight

DEFAULTS = dict(lengths=(2, 4, 8, 16, 32, 64), mismatch=(0.05, 0.2, 0.5), samples=256, replications=256, seeds=3,
                cap=2.0, geo_band="0.95_1.05")
QUICK = dict(lengths=(2, 8, 32), mismatch=(0.05, 0.5), samples=128, replications=40, seeds=1)

# Largest tensor handed to the engine at once (tokens): bounds memory; calls are independent because no
# estimator here uses batch normalization.
_CHUNK_TOKENS = 1 << 18


# ---- the problem -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One instance: policy, rollout policy and reward of ``T`` positions and ``K`` actions (float64).

    ``log_pi``, ``log_mu``, ``log_f``: ``[T, K]``; ``correct``: ``[T]`` int64.
    """

    log_pi: torch.Tensor
    log_mu: torch.Tensor
    log_f: torch.Tensor
    correct: torch.Tensor

    @property
    def length(self) -> int:
        return self.log_pi.shape[0]

    def prefix(self, length: int) -> "Problem":
        """The first ``length`` positions: itself a complete problem (each position is normalized on its own)."""
        return Problem(self.log_pi[:length], self.log_mu[:length], self.log_f[:length], self.correct[:length])

    def exact_gradient(self) -> torch.Tensor:
        """``[T, K]``: ``J = prod_s E_{pi_s}[f_s]`` (``f`` held fixed), so ``dJ/dtheta[t, k] = J / E_{pi_t}[f_t] *
        pi_t(k) (f_t(k) - E_{pi_t}[f_t]) = pi_t(k) (f_t(k) - 1)`` since every ``E_{pi_s}[f_s] = 1``."""
        return self.log_pi.exp() * (self.log_f.exp() - 1.0)

    def kl_per_token(self) -> torch.Tensor:
        """``[T]``: KL(mu_t || pi_t) = E_mu[-log rho_t], the mean of ``-log rho`` that the engine sees."""
        return (self.log_mu.exp() * (self.log_mu - self.log_pi)).sum(-1)

    def chi2_per_token(self) -> torch.Tensor:
        """``[T]``: chi^2(pi_t || mu_t) = E_mu[rho_t^2] - 1 = Var_mu(rho_t).

        Positions are independent, so ``Var_mu(prod_t rho_t) = prod_t (1 + chi2_t) - 1`` (the ``seq_chi2`` column)."""
        return torch.exp(torch.logsumexp(2 * self.log_pi - self.log_mu, -1)) - 1.0


def _kl_along(theta: torch.Tensor, eps: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[T]``: KL(softmax(theta + scale eps) || softmax(theta)) per position."""
    log_pi = theta.log_softmax(-1)
    log_mu = (theta + scale[:, None] * eps).log_softmax(-1)
    return (log_mu.exp() * (log_mu - log_pi)).sum(-1)


def _calibrated_scale(theta: torch.Tensor, eps: torch.Tensor, target: float) -> torch.Tensor:
    """``[T]``: per-position ``s_t >= 0`` with KL(softmax(theta_t + s_t eps_t) || softmax(theta_t)) = ``target``.

    Bisection: along a line in logit space ``d/ds KL = s Var_{mu_s}(eps) >= 0``, so the KL is monotone in ``s``.  To
    second order ``KL = s^2 Var_pi(eps_t) / 2``, i.e. ``s_t ~= delta / sd_pi(eps_t)``; the search stops at 4x that,
    so a position whose KL saturates below ``target`` (it is bounded by ``-log pi_t(argmax eps_t)``; happens from
    ``delta ~ 0.7``) keeps a moderate scale rather than a near-deterministic ``mu_t``.
    """
    lo = torch.zeros(theta.shape[0], dtype=theta.dtype)
    if target <= 0:
        return lo
    pi = theta.softmax(-1)
    sd = ((pi * eps * eps).sum(-1) - (pi * eps).sum(-1) ** 2).clamp(min=1e-12).sqrt()
    hi = 4 * math.sqrt(2 * target) / sd
    for _ in range(60):
        mid = (lo + hi) / 2
        below = _kl_along(theta, eps, mid) < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return (lo + hi) / 2


def make_problem(length: int, delta: float, seed: int, num_actions: int = NUM_ACTIONS, beta: float = BETA) -> Problem:
    """The problem of ``seed`` truncated to ``length`` positions, with logit noise ``delta`` on the rollout side.

    The same ``seed`` gives the same ``theta``, ``eps`` and correct tokens for every ``length`` and ``delta`` (the
    draws are made for 1024 positions and cut), so problems of different lengths are prefixes of one another.
    """
    if length > 1024:
        raise ValueError(f"length={length}: at most 1024 positions")
    gen = torch.Generator().manual_seed(seed)
    theta = torch.randn(1024, num_actions, generator=gen, dtype=torch.float64)[:length]
    eps = torch.randn(1024, num_actions, generator=gen, dtype=torch.float64)[:length]
    log_pi = theta.log_softmax(-1)
    log_mu = (theta + _calibrated_scale(theta, eps, delta * delta / 2)[:, None] * eps).log_softmax(-1)
    correct = theta.argmax(-1)
    raw = beta * torch.nn.functional.one_hot(correct, num_actions).double()  # log of the unnormalized reward factor
    log_f = raw - torch.logsumexp(log_pi + raw, -1, keepdim=True)  # minus log m_t: E_pi[f_t] = 1
    return Problem(log_pi, log_mu, log_f, correct)


def enumerate_objective(theta: torch.Tensor, log_f: torch.Tensor) -> torch.Tensor:
    """``J(theta) = sum_tau pi_theta(tau) R(tau)`` by enumerating all ``K^T`` sequences (small ``T`` only; tests).

    ``theta``, ``log_f``: ``[T, K]``; the reward factors ``log_f`` are held fixed.  Differentiable in ``theta``.
    """
    length, k = theta.shape
    grids = torch.cartesian_prod(*[torch.arange(k)] * length).reshape(-1, length)  # [K^T, T]
    pos = torch.arange(length)
    log_p = theta.log_softmax(-1)[pos, grids].sum(-1)
    log_r = log_f[pos, grids].sum(-1)
    return torch.exp(log_p + log_r).sum()


# ---- the estimators --------------------------------------------------------------------------------------------
ESTIMATORS = ("none", "token-tis", "seq-tis", "seq-is", "seq-mis", "geo-rs", "geo-rs-seq-tis")
DESCRIPTIONS = {
    "none": "no correction: c = 1",
    "token-tis": "decoupled_token_is(cap): c_t = min(rho_t, C)",
    "seq-tis": "decoupled_seq_is(cap): c = min(prod rho_t, C)",
    "seq-is": "decoupled_seq_is(1e30): c = prod rho_t (log clamped to +-20)",
    "seq-mis": "decoupled_seq_is_rs(cap, cap): c = prod rho_t, sequences outside [1/C, C] rejected",
    "geo-rs": "decoupled_geo_rs(band): c = 1, sequences with geo-mean ratio outside band rejected (+ veto 1e-4)",
    "geo-rs-seq-tis": "geo_rs_seq_tis(cap, band): c = min(prod rho_t, C), geo-mean band rejection",
}


def estimator_configs(cap: float = DEFAULTS["cap"], geo_band: str = DEFAULTS["geo_band"]
                      ) -> Dict[str, Optional[RolloutCorrectionConfig]]:
    """Estimator name -> the preset config whose engine output defines it (``None``: no correction).

    ``cap`` is C of every IS truncation and of the Seq-MIS band [1/C, C]; ``geo_band`` the geometric RS band."""
    preset = RolloutCorrectionConfig.preset
    return {
        "none": None,
        "token-tis": preset("decoupled_token_is", threshold=cap),
        "seq-tis": preset("decoupled_seq_is", threshold=cap),
        "seq-is": preset("decoupled_seq_is", threshold=UNCAPPED),
        "seq-mis": preset("decoupled_seq_is_rs", is_threshold=cap, rs_threshold=cap),
        "geo-rs": preset("decoupled_geo_rs", rs_threshold=geo_band),
        "geo-rs-seq-tis": preset("geo_rs_seq_tis", is_threshold=cap, rs_threshold=geo_band),
    }


def sample_actions(problem: Problem, uniforms: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64 actions from ``mu`` by inverse CDF of ``uniforms`` ``[B, >=T]`` (common random numbers)."""
    cdf = problem.log_mu.exp().cumsum(-1)[:, :-1]  # [T, K-1]; the last bin takes whatever is left
    return (uniforms[:, :problem.length, None] > cdf).sum(-1)


@dataclass(frozen=True)
class Batch:
    """``B = R * N`` sampled sequences of one problem, laid out replication-major, with what every estimator shares.

    ``actions``: ``[B, T]`` int64; ``train_lp`` / ``rollout_lp``: ``[B, T]`` float32 log pi / log mu of the sampled
    tokens (the engine's inputs); ``log_rho``: ``[B]`` float64 ``sum_t log pi_t(a_t) - log mu_t(a_t)``; ``reward``:
    ``[B]`` float64 ``R_i``; ``cell``: ``[B, T]`` int64 index of ``(replication, t, a_it)`` in a flattened
    ``[R, T, K]`` gradient.
    """

    problem: Problem
    replications: int
    actions: torch.Tensor
    train_lp: torch.Tensor
    rollout_lp: torch.Tensor
    log_rho: torch.Tensor
    reward: torch.Tensor
    cell: torch.Tensor

    @classmethod
    def build(cls, problem: Problem, actions: torch.Tensor, replications: int) -> "Batch":
        n_seqs, length = actions.shape
        if n_seqs % replications:
            raise ValueError(f"{n_seqs} sequences do not split into {replications} replications")
        k = problem.log_pi.shape[1]
        pos = torch.arange(length)
        lp, lm = problem.log_pi[pos, actions], problem.log_mu[pos, actions]
        rep = torch.arange(replications).repeat_interleave(n_seqs // replications)
        return cls(problem, replications, actions, lp.float(), lm.float(), (lp - lm).sum(-1),
                   problem.log_f[pos, actions].sum(-1).exp(), (rep[:, None] * length + pos) * k + actions)

    @property
    def samples(self) -> int:
        return self.actions.shape[0] // self.replications


def engine_coefficients(batch: Batch, config: Optional[RolloutCorrectionConfig]):
    """Per-token coefficients from the engine: ``(c [B, T] float64, kept [B] float64, seq_weight [B], log_rho [B])``.

    ``c`` = is_weights (already 0 where rejected) or keep_mask when the config has no IS; ``seq_weight`` is the
    engine's per-sequence weight (sequence weight, or mean token weight at token level) times ``kept``;
    ``log_rho`` the engine's ``sum_t log rho_t`` (unclamped).  ``config=None`` is no correction: all ones.
    """
    n_seqs, length = batch.actions.shape
    if config is None:
        ones = torch.ones(n_seqs, dtype=torch.float64)
        return torch.ones(n_seqs, length, dtype=torch.float64), ones, ones, batch.log_rho
    coeffs, kept, seq_w, lrs = [], [], [], []
    step = max(1, _CHUNK_TOKENS // length)
    mask = torch.ones(min(step, n_seqs) * length)
    for start in range(0, n_seqs, step):  # chunks of sequences, only to bound memory
        lp, lm = batch.train_lp[start:start + step].reshape(-1), batch.rollout_lp[start:start + step].reshape(-1)
        b = lp.numel() // length
        cu = torch.arange(0, b * length + 1, length, dtype=torch.int64)
        out = compute_rollout_correction(lp, lm, mask[:lp.numel()], cu, config)
        c = out.keep_mask if out.is_weights is None else out.is_weights
        coeffs.append(c.double().view(b, length))
        k = out.sequences["kept"]
        kept.append(k)
        seq_w.append(out.sequences["is_weight"] * k if "is_weight" in out.sequences else k)
        lrs.append(out.sequences["log_ratio_sum"])
    return torch.cat(coeffs), torch.cat(kept), torch.cat(seq_w), torch.cat(lrs)


def gradient_estimates(batch: Batch, coeffs: torch.Tensor, kept: torch.Tensor,
                       baseline: float = BASELINE) -> torch.Tensor:
    """``[R, T, K]``: one estimate ``g_hat`` per replication.

    ``g_hat_r = 1/D_r sum_{i in r} (R_i - b) sum_t c_it (e_{a_it} - pi_t)``, ``D_r`` = kept sequences of ``r``
    (at least 1; a replication that keeps nothing estimates 0).  ``coeffs``: ``[B, T]``; ``kept``: ``[B]``.
    """
    n_seqs, length = batch.actions.shape
    reps, n, k = batch.replications, batch.samples, batch.problem.log_pi.shape[1]
    v = coeffs * (batch.reward - baseline)[:, None]  # [B, T]: the scalar in front of each token's score
    # sum_i v_it e_{a_it}: scatter each token's coefficient into its (replication, position, action) cell
    onehot_part = torch.bincount(batch.cell.reshape(-1), weights=v.reshape(-1), minlength=reps * length * k)
    onehot_part = onehot_part.view(reps, length, k)
    mean_part = v.view(reps, n, length).sum(1)[..., None] * batch.problem.log_pi.exp()  # sum_i v_it pi_t
    denom = kept.view(reps, n).sum(1).clamp(min=1.0)
    return (onehot_part - mean_part) / denom[:, None, None]


@dataclass
class Measurement:
    """Statistics of one estimator on one problem, relative to ``||g||`` (``g`` the exact gradient).

    ``bias`` = ||mean_r g_hat_r - g|| / ||g||; ``floor`` = sqrt(tr Cov(g_hat) / R) / ||g||, what ``bias`` reads for
    an unbiased estimator (Monte Carlo noise of the mean); ``variance`` = N E||g_hat - E g_hat||^2 / ||g||^2, the
    per-sample relative variance (an N-sample batch divides it by N); ``rejected`` = fraction of sequences
    rejected; ``ess`` = mean over replications of (sum_i w_i)^2 / (N sum_i w_i^2) of the per-sequence weights.
    """

    bias: float
    floor: float
    variance: float
    rejected: float
    ess: float


def measure(batch: Batch, config: Optional[RolloutCorrectionConfig]) -> Measurement:
    """Run one estimator (``config``; None = no correction) on ``batch``."""
    coeffs, kept, seq_w, _ = engine_coefficients(batch, config)
    est = gradient_estimates(batch, coeffs, kept)
    reps, n = batch.replications, batch.samples
    g = batch.problem.exact_gradient()
    g2 = float((g * g).sum())
    mean = est.mean(0)
    spread = float(((est - mean) ** 2).sum()) / (reps - 1)  # tr Cov of one estimate
    w = seq_w.view(reps, n)
    ess = (w.sum(1) ** 2 / (n * (w * w).sum(1)).clamp(min=1e-300)).mean()
    return Measurement(bias=math.sqrt(float(((mean - g) ** 2).sum()) / g2),
                       floor=math.sqrt(spread / reps / g2),
                       variance=n * spread / g2,
                       rejected=1.0 - float(kept.mean()),
                       ess=float(ess))


def run_study(lengths: Sequence[int], mismatch: Sequence[float], samples: int, replications: int, seeds: int,
              cap: float = DEFAULTS["cap"], geo_band: str = DEFAULTS["geo_band"],
              estimators: Sequence[str] = ESTIMATORS, progress=None) -> dict:
    """Every (mismatch, length) cell, averaged over ``seeds`` problems.  Returns the JSON-ready result."""
    configs = estimator_configs(cap, geo_band)
    lengths = sorted(set(lengths))
    rows = {(d, t): {"mismatch": d, "length": t, "kl_per_token": 0.0, "chi2_per_token": 0.0, "seq_chi2": 0.0,
                     "seq_log_ratio_mean": 0.0, "clamp_fraction": 0.0,
                     "estimators": {e: dict(bias=0.0, floor=0.0, variance=0.0, rejected=0.0, ess=0.0)
                                    for e in estimators}}
            for d in mismatch for t in lengths}
    bound = next(c for c in configs.values() if c is not None).safety_bound
    n_seqs = samples * replications
    for seed in range(seeds):
        # one stream of uniforms per seed, shared by every mismatch size and (as prefixes) every length
        uniforms = torch.rand(n_seqs, max(lengths), generator=torch.Generator().manual_seed(10_000 + seed),
                              dtype=torch.float64)
        for delta in mismatch:
            full = make_problem(max(lengths), delta, seed)
            full_actions = sample_actions(full, uniforms)
            for length in lengths:
                problem = full.prefix(length)
                batch = Batch.build(problem, full_actions[:, :length], replications)
                row = rows[(delta, length)]
                chi2 = problem.chi2_per_token()
                row["kl_per_token"] += float(problem.kl_per_token().mean()) / seeds
                row["chi2_per_token"] += float(chi2.mean()) / seeds
                row["seq_chi2"] += float(torch.expm1(torch.log1p(chi2).sum())) / seeds
                row["seq_log_ratio_mean"] += float(batch.log_rho.mean()) / seeds
                row["clamp_fraction"] += float((batch.log_rho.abs() > bound).double().mean()) / seeds
                for name in estimators:
                    m = measure(batch, configs[name])
                    cell = row["estimators"][name]
                    for key in cell:
                        cell[key] += getattr(m, key) / seeds
            if progress:
                progress(f"seed {seed + 1}/{seeds}, mismatch {delta:g} done")
    return {
        "setup": {"actions": NUM_ACTIONS, "beta": BETA, "baseline": BASELINE, "lengths": lengths,
                  "mismatch": list(mismatch), "samples": samples, "replications": replications, "seeds": seeds,
                  "cap": cap, "geo_band": geo_band, "safety_bound": bound,
                  "estimators": {e: DESCRIPTIONS[e] for e in estimators}},
        "rows": [rows[(d, t)] for d in mismatch for t in lengths],
    }


# ---- output ----------------------------------------------------------------------------------------------------
def _num(x: float) -> str:
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.3g}" if abs(x) >= 1 else f"{x:.3f}"
    return f"{x:.1e}"


def format_tables(result: dict) -> str:
    """Markdown: one table each for bias (with its noise floor), per-sample variance, and rejection / ESS."""
    rows = result["rows"]
    names = list(rows[0]["estimators"]) if rows else []
    head = "| delta | T | KL/token | T·KL | seq χ² | " + " | ".join(names) + " |"
    rule = "|---:|---:|---:|---:|---:|" + "---:|" * len(names)

    def table(title, cell):
        lines = [title, "", head, rule]
        for r in rows:
            lines.append(f"| {r['mismatch']:g} | {r['length']} | {r['kl_per_token']:.3g} | "
                         f"{r['length'] * r['kl_per_token']:.3g} | {_num(r['seq_chi2'])} | "
                         + " | ".join(cell(r["estimators"][n]) for n in names) + " |")
        return "\n".join(lines)

    s = result["setup"]
    out = [
        table("**Relative bias** ‖E ĝ − g‖/‖g‖ (in brackets: the noise floor, what an unbiased one reads)",
              lambda c: f"{_num(c['bias'])} ({_num(c['floor'])})"),
        table("**Per-sample relative variance** N·E‖ĝ − E ĝ‖²/‖g‖²", lambda c: _num(c["variance"])),
        table("**Rejected fraction / ESS fraction** of the sequences", lambda c: f"{_num(c['rejected'])} / "
                                                                               f"{_num(c['ess'])}"),
        f"N = {s['samples']} samples x {s['replications']} replications x {s['seeds']} seeds per cell; cap C = "
        f"{s['cap']:g}, geometric band {s['geo_band']}, K = {s['actions']}, beta = {s['beta']:g}, baseline b = "
        f"{s['baseline']:g}; sequences beyond the ±{s['safety_bound']:g} clamp: "
        f"max {max((r['clamp_fraction'] for r in rows), default=0):.2g}.",
    ]
    return "\n\n".join(out) + "\n"


def plot(result: dict, path: str) -> None:
    """Bias, per-sample variance and rejected fraction against T, one column per mismatch size (matplotlib Agg).

    Bias markers are hollow where the bias is below twice its noise floor (not distinguishable from 0).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    deltas = result["setup"]["mismatch"]
    names = list(rows[0]["estimators"])
    fig, axes = plt.subplots(3, len(deltas), figsize=(3.4 * len(deltas), 7.2), squeeze=False, sharex=True)
    colors = dict(zip(ESTIMATORS, ["k", "C0", "C1", "C2", "C3", "C4", "C5"]))
    markers = dict(zip(ESTIMATORS, ["x", "o", "s", "D", "^", "v", "d"]))
    for j, delta in enumerate(deltas):
        sub = [r for r in rows if r["mismatch"] == delta]
        t = [r["length"] for r in sub]
        for name in names:
            cells = [r["estimators"][name] for r in sub]
            color, marker = colors.get(name, "0.5"), markers.get(name, "o")
            dash = "--" if name in ("seq-is", "geo-rs-seq-tis") else "-"
            for i, key in enumerate(("bias", "variance", "rejected")):
                axes[i, j].plot(t, [c[key] for c in cells], dash, color=color, lw=1.1, label=name)
            for c, x in zip(cells, t):
                hollow = c["bias"] < 2 * c["floor"]
                axes[0, j].plot([x], [c["bias"]], marker, ms=3.5, color=color,
                                mfc="white" if hollow else color)
        kl = sub[0]["kl_per_token"] if sub else 0
        axes[0, j].set_title(f"delta = {delta:g} (KL/token {kl:.1e})", fontsize=9)
        for i in range(3):
            axes[i, j].set_xscale("log", base=2)
            axes[i, j].set_xticks(t, [str(x) for x in t])
            axes[i, j].tick_params(labelsize=7)
            axes[i, j].grid(alpha=0.3, lw=0.5)
        axes[0, j].set_yscale("log")
        axes[1, j].set_yscale("log")
        axes[2, j].set_ylim(-0.03, 1.03)
        axes[2, j].set_xlabel("sequence length T", fontsize=8)
    axes[0, 0].set_ylabel("relative bias\n(hollow: < 2x noise floor)", fontsize=8)
    axes[1, 0].set_ylabel("per-sample relative variance", fontsize=8)
    axes[2, 0].set_ylabel("rejected fraction", fontsize=8)
    axes[0, -1].legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


# ---- command line ----------------------------------------------------------------------------------------------
class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit(2) itself; main() reports and returns 2 instead
        raise _UsageError(message)


def _number_list(flag: str, text: str, kind: type, lo: float, hi: float, example: str) -> list:
    """``"2,4,8"`` -> ``[2, 4, 8]`` of ``kind`` (int or float), each in ``[lo, hi]`` (which also refuses nan)."""
    out = []
    for part in text.split(","):
        try:
            v = kind(part.strip())
        except ValueError:
            raise _UsageError(f"{flag} {text!r}: {part.strip()!r} is not {'an integer' if kind is int else 'a number'}"
                              f"; give a comma list such as {example}") from None
        if not lo <= v <= hi:
            raise _UsageError(f"{flag} {text!r}: {v:g} is out of range; each value must be in [{lo:g}, {hi:g}] "
                              f"(e.g. {example})")
        out.append(v)
    return out


def _count(flag: str, value, lo: int, hi: int, hint: str) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise _UsageError(f"{flag} {value!r} is not an integer; {hint}") from None
    if not lo <= v <= hi:
        raise _UsageError(f"{flag} {v} is out of range [{lo}, {hi}]; {hint}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False, description=(
        "Bias and variance of the rollout-correction estimators (no correction, token-TIS, seq-TIS, seq-IS, "
        "seq-MIS, geo-RS, geo-RS-seq-TIS) against the exact gradient of a toy policy, as functions of the "
        "sequence length T and the mismatch size delta.  See docs/estimators.md."))
    d = DEFAULTS
    p.add_argument("--lengths", help=f"comma list of sequence lengths T in [1, 1024] "
                                     f"(default {','.join(map(str, d['lengths']))})")
    p.add_argument("--mismatch", help=f"comma list of mismatch sizes delta in [0, 2]: KL/token = delta^2/2 "
                                      f"(default {','.join(map(str, d['mismatch']))})")
    p.add_argument("--samples", help=f"sequences N per gradient estimate, >= 2 (default {d['samples']})")
    p.add_argument("--replications", help=f"gradient estimates per cell, >= 2 (default {d['replications']})")
    p.add_argument("--seeds", help=f"number of problem instances (seeds 0..S-1) averaged per cell (default "
                                   f"{d['seeds']})")
    p.add_argument("--cap", help=f"IS truncation / Seq-MIS band C (default {d['cap']:g})")
    p.add_argument("--geo-band", help=f"geometric RS band 'lower_upper' or an upper bound (default {d['geo_band']})")
    p.add_argument("--quick", action="store_true",
                   help="a few seconds: lengths 2,8,32, mismatch 0.05,0.5, 128 samples x 40 replications, 1 seed "
                        "(explicit flags still win)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of markdown tables")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw bias, variance and rejected fraction against T to FILE.png")
    return p


def _resolve(args: argparse.Namespace) -> dict:
    base = {**DEFAULTS, **(QUICK if args.quick else {})}
    lengths = base["lengths"] if args.lengths is None else _number_list("--lengths", args.lengths, int, 1, 1024,
                                                                        "2,4,8")
    mismatch = base["mismatch"] if args.mismatch is None else list(dict.fromkeys(_number_list(
        "--mismatch", args.mismatch, float, 0.0, 2.0, "0.05,0.2,0.5")))
    samples = base["samples"] if args.samples is None else _count(
        "--samples", args.samples, 2, 1 << 20, "give the number of sequences per gradient estimate, e.g. 256")
    replications = base["replications"] if args.replications is None else _count(
        "--replications", args.replications, 2, 1 << 20, "give the number of estimates per cell, e.g. 160")
    seeds = base["seeds"] if args.seeds is None else _count(
        "--seeds", args.seeds, 1, 1000, "give how many problem instances to average, e.g. 3")
    cap = base["cap"]
    if args.cap is not None:
        try:
            cap = float(args.cap)
        except ValueError:
            raise _UsageError(f"--cap {args.cap!r} is not a number; give a truncation bound > 1 such as 2") from None
        if not (math.isfinite(cap) and cap > 1):
            raise _UsageError(f"--cap {args.cap}: must be a finite number > 1 (the band is [1/C, C]); e.g. 2")
    geo_band = base["geo_band"] if args.geo_band is None else args.geo_band
    try:
        estimator_configs(cap, geo_band)
    except ValueError as e:
        hint = "" if "lower_upper" in str(e) else "; give the band as 'lower_upper' such as 0.95_1.05"
        raise _UsageError(f"--geo-band {geo_band!r}: {str(e).rstrip('.')}{hint}") from None
    tokens = samples * replications * max(lengths)
    if tokens > 1 << 25:
        raise _UsageError(f"--samples {samples} x --replications {replications} x max(--lengths) {max(lengths)} "
                          f"= {tokens} tokens per cell; keep it under {1 << 25} (lower one of them)")
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise _UsageError(f"--plot {args.plot!r}: give a .png file name, e.g. --plot estimators.png")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise _UsageError(f"--plot {args.plot!r}: folder {folder} does not exist; create it first")
    return dict(lengths=lengths, mismatch=mismatch, samples=samples, replications=replications, seeds=seeds,
                cap=cap, geo_band=geo_band)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        settings = _resolve(args)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    start = time.perf_counter()
    result = run_study(**settings, progress=lambda msg: print(f"[{time.perf_counter() - start:5.1f}s] {msg}",
                                                              file=sys.stderr))
    result["seconds"] = round(time.perf_counter() - start, 2)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            print(f"{PROG}: error: --plot needs matplotlib; pip install matplotlib", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        sys.stdout.write(format_tables(result))
        print(f"\n{result['seconds']:.1f} s" + (f"; plot written to {args.plot}" if args.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
