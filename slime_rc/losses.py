"""Policy losses with rollout correction, on packed 1-D tokens (pure torch; no Megatron needed).

Modes (``config.mode`` / ``config.loss_type``, rollout_corr_math.md §3), per loss token t, with
``A`` the advantage, ``rho = exp(clamp(log pi_theta - log pi_old, +-safety_bound))`` (the ratio floor, see
:func:`compute_policy_loss`) and ``w`` the engine's IS weight (detached):

* standard PPO:      ``l_t = max(-A rho, -A clip(rho, 1 - eps, 1 + eps_high))``, pi_old recomputed, no correction;
* decoupled PPO:     ``l_t = w * max(...)`` with ``w`` from pi_old / pi_rollout, RS/veto/mask drop tokens;
* bypass PPO:        pi_old := pi_rollout, ``l_t = max(...)`` (IS weights diagnostics only), RS/veto/mask drop tokens;
* bypass REINFORCE:  ``l_t = -w * log pi_theta * A`` with ``w`` from pi_theta / pi_rollout (engine, detached); the
  value of ``log pi_theta`` floored at :data:`LOG_PROB_FLOOR` (the gradient is untouched).

Dual clip (``eps_clip_c``): for ``A < 0``, ``l_t = min(l_t, -A c)``.  IS weights never carry gradient; a rejected
token contributes exactly zero loss and zero gradient (its inputs are replaced before any arithmetic, so a NaN
there cannot leak into the gradient); a batch where everything is rejected gives a finite zero loss.  With
``on_nonfinite='reject'`` a non-finite value (or an advantage past :data:`ADVANTAGE_OVERFLOW_LIMIT`) on a kept token
rejects its whole sequence, as the engine does.

Aggregation (``config.loss_agg``): ``token_mean`` = ``sum_t l_t / D`` over the batch; ``sample_mean`` = mean over
samples of ``sum_{t in i} l_t / D_i``, over samples with ``D_i > 0``.  The denominators ``D`` count kept tokens, or
every loss token with ``rejected_in_denominator`` (then rejected tokens dilute the mean).

Under CP/DP each rank passes its own tokens and a reducer; the returned loss is **this rank's share**: the shares
of all ranks of the reducer's batch group add up to the single-process loss.  ``normalizer`` may carry denominators
computed once for a larger batch (the global batch, before the first micro-batch; see :func:`loss_normalizer`),
then the loss makes no collective call.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.correction.packed import broadcast_to_tokens, segment_sum, segment_sums
from slime_rc.correction.reducer import LocalReducer, as_reducer


# The floor of log pi_theta's *value* in the REINFORCE term -w * log pi_theta * A: far below any log-prob a sampler
# can produce for a token it sampled (exp(-104) is already 0 in float32), far above SGLang's fp32 sentinel
# finfo.min = -3.4e38, which times |A| > 1 overflowed to inf.  Values at or above it are untouched (bit-identical);
# below it the value is the floor while the gradient stays the exact REINFORCE gradient -w * A (it never depends on
# the value).  A token the floor touches counts in pg_clipfrac.
LOG_PROB_FLOOR = -1e4

# A kept token whose loss term or gradient could leave float32 (max 3.4e38) -- |A| * max(rho, 1 + eps_high, c) *
# max(w, 1) for PPO, |A| * max(|log pi_theta| (floored), 1) * max(w, 1) for REINFORCE, a bound on every intermediate
# of the forward and backward pass -- at or past this limit: the advantage is absurd (a defect upstream).
# on_nonfinite='error' raises naming advantages, the sample and the position; 'reject' rejects its sequence and
# counts the token in pg_nonfinite_tokens.  The margin of ~2^8 below float32's max covers the aggregation.
ADVANTAGE_OVERFLOW_LIMIT = 1e36


@dataclass(frozen=True)
class LossNormalizer:
    """Loss denominators: ``tokens`` (0-d, D of the batch), ``sequences`` (0-d, samples with D_i > 0) and
    ``per_sequence`` (``[B]``, D_i of each sequence the tokens belong to)."""

    tokens: torch.Tensor
    sequences: torch.Tensor
    per_sequence: torch.Tensor


def loss_normalizer(count_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                    reducer: Optional[LocalReducer] = None) -> LossNormalizer:
    """Denominators of the tokens counted by ``count_mask [N]`` (1 = counts), global over the reducer's groups:
    one ``combine_sequences`` (D_i over CP) and one ``sum_totals`` (D and the sample count over DP x CP)."""
    check_token_shapes("loss_normalizer", (("count_mask", count_mask),))
    reducer = as_reducer(reducer)
    per_seq, _ = reducer.combine_sequences(segment_sum(count_mask.double(), cu_seqlens)[:, None],
                                           torch.zeros(cu_seqlens.numel() - 1, 0, dtype=torch.float64,
                                                       device=count_mask.device))
    per_seq = per_seq[:, 0]
    live = (per_seq > 0).sum() if reducer.counts_sequences else torch.zeros((), dtype=torch.int64,
                                                                            device=count_mask.device)
    totals = reducer.sum_totals(torch.stack([count_mask.double().sum(), live.double()]))
    return LossNormalizer(tokens=totals[0], sequences=totals[1], per_sequence=per_seq)


def _normalizer_dropping(count_mask: torch.Tensor, bad: torch.Tensor, cu_seqlens: torch.Tensor,
                         reducer: Optional[LocalReducer], keep_in_denominator: bool
                         ) -> Tuple[LossNormalizer, torch.Tensor]:
    """:func:`loss_normalizer` of ``count_mask`` without the sequences holding a ``bad`` token (``[N]`` bool) on
    any rank (with ``keep_in_denominator`` -- ``rejected_in_denominator`` -- they still count), and those sequences
    (``[B]`` bool): the bad counts ride along in the normalizer's own ``combine_sequences`` (no extra collective),
    so every CP rank of a sequence drops it."""
    reducer = as_reducer(reducer)
    b = cu_seqlens.numel() - 1
    local = segment_sums([count_mask.double(), bad.double()], cu_seqlens)  # [2, B]
    combined, _ = reducer.combine_sequences(local.t().contiguous(),
                                            torch.zeros(b, 0, dtype=torch.float64, device=count_mask.device))
    drop = combined[:, 1] > 0
    if keep_in_denominator:
        per_seq, counted = combined[:, 0], count_mask
    else:
        per_seq = torch.where(drop, 0.0, combined[:, 0])
        counted = count_mask.bool() & ~broadcast_to_tokens(drop, cu_seqlens, count_mask.numel())
    live = (per_seq > 0).sum() if reducer.counts_sequences else torch.zeros((), dtype=torch.int64,
                                                                            device=count_mask.device)
    totals = reducer.sum_totals(torch.stack([counted.double().sum(), live.double()]))
    return LossNormalizer(tokens=totals[0], sequences=totals[1], per_sequence=per_seq), drop


def check_token_shapes(where: str, named: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> int:
    """The token count ``N`` of the per-token inputs ``named`` (``(argument, tensor or None)``, None skipped): each
    must be a tensor of exactly shape ``[N]``.  Nothing is broadcast: an advantage of shape ``[N, 1]`` against
    ``[N]`` tokens, or one log-prob against eight tokens, would silently scale or smear the loss.  ``N`` is the
    length most of the 1-D inputs share (ties: the ``loss_mask``'s, else the first's), so the message names the odd
    one out.  Shapes only (metadata): no host read.  ``ValueError`` naming the argument, its shape and ``[N]``."""
    given = [(name, t) for name, t in named if t is not None]
    if not given:
        return 0
    for name, t in given:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor of shape [N] (one value per packed token), "
                             f"got {type(t).__name__}")
    lengths = [t.shape[0] for _, t in given if t.dim() == 1]
    if not lengths:  # no 1-D input at all: name the first, expecting one dimension
        name, t = given[0]
        raise ValueError(f"{where}: {name} has shape {list(t.shape)}, expected [N] (1-D, one value per packed "
                         f"token); flatten padded [B, T] batches and pass cu_seqlens")
    counts = Counter(lengths)
    top = max(counts.values())
    mask_n = dict(given).get("loss_mask")
    preferred = [mask_n.shape[0]] if mask_n is not None and mask_n.dim() == 1 else []
    n = next(length for length in preferred + lengths if counts[length] == top)
    agree = [name for name, t in given if tuple(t.shape) == (n,)]
    for name, t in given:
        if tuple(t.shape) == (n,):
            continue
        if t.numel() == n:
            fix = f"reshape it to [{n}] (e.g. {name}.reshape(-1))"
        elif name == "advantages":
            fix = "repeat each sample's advantage over its tokens"
        else:
            fix = "pass it for the same packed tokens as the others"
        like = f" like {', '.join(agree)}" if agree else ""
        raise ValueError(f"{where}: {name} has shape {list(t.shape)}, expected [{n}]: every per-token input holds "
                         f"exactly one value per packed token (N = {n}{like}), and nothing is broadcast; {fix}")
    return n


def _token_coefficients(normalizer: LossNormalizer, config: RolloutCorrectionConfig, cu_seqlens: torch.Tensor,
                        n_tokens: int) -> torch.Tensor:
    """``[N]`` float32 c_t so that the loss is sum_t c_t l_t (0 where a denominator is 0)."""
    if config.loss_agg == "token_mean":  # 1 / max(D, 1) in float64, then float32: no host read
        coef = 1.0 / normalizer.tokens.to(torch.float64).clamp(min=1.0)
        return coef.float().to(cu_seqlens.device).expand(n_tokens)
    per_seq = torch.where(normalizer.per_sequence > 0, 1.0 / normalizer.per_sequence.clamp(min=1.0), 0.0)
    per_seq = per_seq / normalizer.sequences.to(per_seq.dtype).clamp(min=1.0)
    return broadcast_to_tokens(per_seq, cu_seqlens, n_tokens).float()


def _first_bad(values: torch.Tensor, where: torch.Tensor, cu_seqlens: torch.Tensor) -> str:
    """Slow path (raising anyway): ``sample i, position p (token t) = value`` of the first non-finite kept value."""
    bad = torch.nonzero(where & ~torch.isfinite(values.detach()))
    t = int(bad[0, 0])
    i = int(torch.searchsorted(cu_seqlens.to(torch.int64), torch.tensor(t, device=cu_seqlens.device), right=True)) - 1
    return (f"sample {i}, position {t - int(cu_seqlens[i])} (packed token {t}) = {float(values.detach()[t])}; "
            f"{bad.shape[0]} such value(s)")


def add_value_checks(checks: DeferredChecks, keep: torch.Tensor, cu_seqlens: torch.Tensor, named,
                     where: str = "the correction keeps") -> None:
    """``on_nonfinite='error'``: a deferred flag per named ``[N]`` tensor holding NaN/inf on a kept token (a kept
    token's value reaches the loss; ``where`` says which tokens ``keep`` marks).  No host read here;
    :meth:`DeferredChecks.raise_if_any` reads them once."""
    for name, values, fix in named:
        if values is None:
            continue
        bad = (keep & ~torch.isfinite(values.detach())).sum()
        checks.add(bad, f"{name} holds NaN/inf on loss tokens {where}; {fix}",
                   lambda name=name, values=values, fix=fix: (
                       f"{name} holds NaN/inf on a loss token {where}: "
                       f"{_first_bad(values, keep, cu_seqlens)}; {fix}"))


_OVERFLOW_SUMMARY = ("advantages holds a value whose loss term overflows float32 on a loss token the correction "
                     f"keeps (|A| x factor >= {ADVANTAGE_OVERFLOW_LIMIT:g}); such an advantage is a defect upstream: "
                     "fix or normalize the advantages, or set on_nonfinite='reject' to reject and count such "
                     "sequences")


def _overflow_message(overflow: torch.Tensor, adv32: torch.Tensor, log_factor: torch.Tensor,
                      cu_seqlens: torch.Tensor, ppo: bool, weighted: bool) -> str:
    """Slow path (raising anyway): the first token whose advantage overflows, with its sample and position."""
    bad = torch.nonzero(overflow)
    t = int(bad[0, 0])
    i = int(torch.searchsorted(cu_seqlens.to(torch.int64), torch.tensor(t, device=cu_seqlens.device), right=True)) - 1
    factor = ("max(ratio, 1 + eps_clip_high, eps_clip_c)" if ppo else "max(|log pi_theta|, 1)") + \
        (" x max(IS weight, 1)" if weighted else "")
    return (f"advantages holds a value whose loss term overflows float32 on a loss token the correction keeps: "
            f"sample {i}, position {t - int(cu_seqlens[i])} (packed token {t}) = {float(adv32[t]):g}; "
            f"|A| x {factor} = {math.exp(float(log_factor[t])) * abs(float(adv32[t])):.3g} >= "
            f"{ADVANTAGE_OVERFLOW_LIMIT:g} (float32 overflows at 3.4e38); {bad.shape[0]} such value(s); "
            f"such an advantage is a defect upstream: fix or normalize the advantages, or set "
            f"on_nonfinite='reject' to reject and count such sequences")


def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: Optional[torch.Tensor],
    rollout_log_probs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    reducer: Optional[LocalReducer] = None,
    correction: Optional[CorrectionResult] = None,
    normalizer: Optional[LossNormalizer] = None,
    checks: Optional[DeferredChecks] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` for packed tokens.

    Args:
        log_probs: ``[N]`` log pi_theta (carries the gradient).
        old_log_probs: ``[N]`` log pi_old recomputed by the trainer (standard and decoupled modes); ignored in
            bypass mode, where pi_old := pi_rollout.
        rollout_log_probs: ``[N]`` log pi_rollout; needed whenever anything is corrected, in bypass mode, and for
            ``get_mismatch_metrics``.
        advantages, loss_mask: ``[N]``; cu_seqlens: ``[B+1]``.  Every per-token input (and a given
            ``correction``'s ``keep_mask`` / ``is_weights``) must have exactly shape ``[N]``: nothing is broadcast,
            a mismatch raises ``ValueError`` naming the argument, its shape and ``[N]`` (:func:`check_token_shapes`).
        reducer: for CP/DP (see module docstring).  correction: the engine's result for these tokens computed
            beforehand (decoupled mode's pre-step path); normalizer: precomputed denominators.
        checks: a :class:`~slime_rc.correction.checks.DeferredChecks` to add this call's value checks (and the
            engine's) to; the caller then calls its ``raise_if_any()``.  Without it the call makes its own and reads
            it once at the end (one host read with ``on_nonfinite='error'``, none with ``'reject'``).
    Returns:
        the loss (0-d, this rank's share) and metrics: the engine's (``rollout_corr/...``) plus ``pg_loss``,
        ``pg_clipfrac`` (kept tokens whose PPO term was clipped, by the PPO clip, the dual clip or the ratio floor)
        and ``ppo_kl`` (log pi_old - log pi_theta, within the floor), aggregated like the loss (this rank's share);
        with ``on_nonfinite='reject'`` also ``pg_nonfinite_tokens`` (this rank's count of kept tokens holding a
        NaN/inf ``log_probs``, ``advantages`` or pi_old, or an overflowing advantage, whose sequences the loss
        rejected; the engine counts what it rejects itself).  In REINFORCE ``pg_clipfrac`` counts the tokens the
        log-prob floor touched.

    The ratio floor: in the PPO loss ``log rho = log pi_theta - log pi_old`` is clamped to ``+-config.safety_bound``
    (20 by default, the engine's bound; verl clamps at 20 too) before ``exp``.  Within the bound nothing changes;
    beyond it rho is the constant ``e^{+-bound}`` (no gradient through it), so finite log-probs that overflow
    ``exp`` -- SGLang's fp32 floor ``finfo.min`` = -3.4e38 or -1e4 as a rollout log-prob -- give a finite loss and
    gradient.  The REINFORCE term floors the value of log pi_theta at :data:`LOG_PROB_FLOOR` (-1e4; the gradient
    -w * A is unchanged).  Non-finite values are not clamped: ``on_nonfinite='error'`` raises ``ValueError`` naming
    the tensor, the sample and the position; ``'reject'`` rejects the token's whole sequence (zero loss and gradient)
    and counts the token.  A finite advantage whose loss term or gradient could overflow float32 (see
    :data:`ADVANTAGE_OVERFLOW_LIMIT`) is treated the same way, the error naming ``advantages``.  Under CP the
    per-sequence rejection rides in the denominators' ``combine_sequences`` when the call computes them; with a
    precomputed ``normalizer`` it covers this rank's tokens of the sequence (no collective).
    """
    bypass = config.mode == "bypass"
    # shapes first (metadata only, no host read): a [N, 1] or [1] input would broadcast silently below
    check_token_shapes("compute_policy_loss", (
        ("log_probs", log_probs), ("old_log_probs", None if bypass else old_log_probs),
        ("rollout_log_probs", rollout_log_probs), ("advantages", advantages), ("loss_mask", loss_mask),
        ("correction.keep_mask", None if correction is None else correction.keep_mask),
        ("correction.is_weights", None if correction is None else correction.is_weights)))
    mask = loss_mask.bool()
    if bypass or config.corrects or config.get_mismatch_metrics:
        if rollout_log_probs is None:
            raise ValueError(f"rollout_log_probs is None but mode={config.mode!r} with "
                             f"{config.correction_summary() or 'get_mismatch_metrics'} needs them; pass the rollout "
                             f"engine's log-probs (or use mode='standard' without metrics).")
    if not bypass and old_log_probs is None:
        raise ValueError(f"old_log_probs is None in mode={config.mode!r}: pass the recomputed log pi_old, or use "
                         f"bypass mode (--use-rollout-logprobs) where pi_old := pi_rollout.")
    old = rollout_log_probs if bypass else old_log_probs
    old_name = "rollout_log_probs" if bypass else "old_log_probs"
    ppo = config.loss_type != "reinforce"
    reject = config.on_nonfinite == "reject"
    own_checks = checks is None
    if own_checks:
        checks = DeferredChecks(read=not reject)

    run_engine = correction is None and (config.corrects or config.get_mismatch_metrics)
    fix = ("a NaN/inf there makes the loss NaN: fix its source, or set on_nonfinite='reject' to reject and count "
           "such tokens")
    engine_checked = ()
    if run_engine and not reject:
        # the tensors the engine reads are checked first, on every loss token as the engine checks them, so that the
        # message names this call's argument (the engine would call pi_old / pi_theta 'train_log_probs')
        engine_checked = ("log_probs" if bypass else "old_log_probs", "rollout_log_probs")
        add_value_checks(checks, mask, cu_seqlens, (
            (engine_checked[0], log_probs if bypass else old_log_probs, fix),
            ("rollout_log_probs", rollout_log_probs, fix)), where="(loss_mask = 1)")
    if run_engine:
        train = log_probs.detach() if bypass else old_log_probs
        correction = compute_rollout_correction(train, rollout_log_probs, mask, cu_seqlens, config, reducer=reducer,
                                                checks=checks)
    keep = mask if correction is None else correction.keep_mask.bool()
    # the values that reach the loss on a kept token: pi_theta, A and (PPO) pi_old
    used = (("log_probs", log_probs), ("advantages", advantages)) + (((old_name, old),) if ppo else ())
    if reject:
        finite = torch.isfinite(log_probs.detach())
        for _, values in used[1:]:
            finite = finite & torch.isfinite(values.detach())
        live = keep & finite
    else:
        # error mode: a non-finite value on a kept token raises through the value checks, which are added before
        # the overflow check below (the first flag set wins), so no second isfinite pass is needed to exclude it
        live = keep
    adv32 = advantages.detach().float()  # the loss's precision: a float64 advantage past 3.4e38 is inf here
    w_applied = correction is not None and config.is_weights_applied and correction.is_weights is not None
    # absurd finite advantages: a bound on every intermediate of the token's loss term and gradient (log domain, no
    # overflow here), see ADVANTAGE_OVERFLOW_LIMIT; non-finite tokens are the other checks' (or rejected)
    lp_d = torch.where(live, log_probs.detach().float(), 0.0)
    if ppo:
        log_factor = (lp_d - torch.where(live, old.detach().float(), 0.0)).clamp(-config.safety_bound,
                                                                                 config.safety_bound)
        upper = 1.0 + (config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip)
        log_factor = log_factor.clamp(min=math.log(max(upper, config.eps_clip_c or 1.0)))
    else:
        log_factor = torch.log(lp_d.clamp(min=LOG_PROB_FLOOR).abs().clamp(min=1.0))
    if w_applied:
        log_factor = log_factor + torch.log(correction.is_weights.detach().float().clamp(min=1.0))
    overflow = live & (torch.log(adv32.abs()) + log_factor >= math.log(ADVANTAGE_OVERFLOW_LIMIT))
    nonfinite = None
    if reject:
        # a kept token with a non-finite value (the engine drops only what it sees) or an overflowing advantage
        # rejects its whole sequence, as the engine does: a sequence-level weight or mean has no meaning with a hole
        nonfinite = (keep & ~finite) | overflow
        if normalizer is None:  # the sequence flags ride in the normalizer's collective: every CP rank agrees
            normalizer, drop_seq = _normalizer_dropping(mask if config.rejected_in_denominator else keep, nonfinite,
                                                        cu_seqlens, reducer, config.rejected_in_denominator)
        else:  # precomputed denominators, no collective: this rank's tokens of the sequence
            drop_seq = segment_sum(nonfinite.double(), cu_seqlens) > 0
        keep = keep & ~broadcast_to_tokens(drop_seq, cu_seqlens, keep.numel())
    else:
        add_value_checks(checks, keep, cu_seqlens,
                         [(name, values, fix) for name, values in used if name not in engine_checked])
        checks.add(overflow.sum(), _OVERFLOW_SUMMARY,
                   lambda: _overflow_message(overflow, adv32, log_factor, cu_seqlens, ppo, w_applied))
    if normalizer is None:
        normalizer = loss_normalizer(mask if config.rejected_in_denominator else keep, cu_seqlens, reducer)

    # Rejected and masked tokens get neutral inputs before any arithmetic: exactly zero loss and gradient there.
    lp = torch.where(keep, log_probs, torch.zeros((), dtype=log_probs.dtype, device=log_probs.device))
    adv = torch.where(keep, advantages.float(), 0.0)
    if config.loss_type == "reinforce":
        w = correction.is_weights if w_applied else None
        # the floor of log pi_theta's value (LOG_PROB_FLOOR): below it the value is the floor, the gradient stays
        # the identity (the REINFORCE gradient -w * A never depends on the value); above it nothing changes
        lp32 = lp.float()
        clipped = keep & (lp32.detach() < LOG_PROB_FLOOR)
        lp32 = torch.where(clipped, (lp32 - lp32.detach()) + LOG_PROB_FLOOR, lp32)
        per_token = -(lp32 * adv) * (1.0 if w is None else w.detach())
        log_rho = torch.zeros_like(adv)
    else:
        # the floor: log rho clamped to +-safety_bound before exp (as the engine and verl do), so that finite
        # log-probs that overflow exp() -- SGLang's fp32 floor -3.4e38, or -1e4 -- keep rho, the loss and the gradient
        # finite.  It acts only beyond the bound (nothing changes within it); past it rho is the constant e^+-bound
        # (no gradient), and the token counts in pg_clipfrac.
        bound = config.safety_bound
        raw_log_rho = lp.float() - torch.where(keep, old.float(), 0.0).detach()
        log_rho = raw_log_rho.clamp(-bound, bound)
        rho = torch.exp(log_rho)
        unclipped, clipped_term = -adv * rho, -adv * rho.clamp(1.0 - config.eps_clip, upper)
        per_token = torch.maximum(unclipped, clipped_term)
        clipped = keep & ((clipped_term > unclipped) | (raw_log_rho.detach().abs() > bound))
        if config.eps_clip_c is not None:
            dual = -adv * config.eps_clip_c
            clipped = clipped | (keep & (adv < 0) & (per_token > dual))
            per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)
        if w_applied:
            per_token = per_token * correction.is_weights.detach()
    per_token = torch.where(keep, per_token, 0.0)

    coef = _token_coefficients(normalizer, config, cu_seqlens, lp.numel())
    loss = (per_token * coef).sum()
    metrics = {  # aggregated like the loss
        "pg_loss": loss.detach(),
        "pg_clipfrac": (clipped.float() * coef).sum(),
        "ppo_kl": (torch.where(keep, -log_rho.detach(), 0.0) * coef).sum(),
    }
    if nonfinite is not None:  # on_nonfinite='reject': this rank's count (with 'error' such a token raises)
        metrics["pg_nonfinite_tokens"] = nonfinite.sum().float()
    if correction is not None:
        metrics.update(correction.prefixed())
    if own_checks:
        checks.raise_if_any()  # the one host read of the call (none with on_nonfinite='reject')
    return loss, metrics
