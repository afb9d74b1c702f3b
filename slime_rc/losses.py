"""Policy losses with rollout correction, on packed 1-D tokens (pure torch; no Megatron needed).

Modes (``config.mode`` / ``config.loss_type``, rollout_corr_math.md §3), per loss token t, with
``A`` the advantage, ``rho = exp(clamp(log pi_theta - log pi_old, +-safety_bound))`` (the ratio floor, see
:func:`compute_policy_loss`) and ``w`` the engine's IS weight (detached):

* standard PPO:      ``l_t = max(-A rho, -A clip(rho, 1 - eps, 1 + eps_high))``, pi_old recomputed, no correction;
* decoupled PPO:     ``l_t = w * max(...)`` with ``w`` from pi_old / pi_rollout, RS/veto/mask drop tokens;
* bypass PPO:        pi_old := pi_rollout, ``l_t = max(...)`` (IS weights diagnostics only), RS/veto/mask drop tokens;
* bypass REINFORCE:  ``l_t = -w * log pi_theta * A`` with ``w`` from pi_theta / pi_rollout (engine, detached).

Dual clip (``eps_clip_c``): for ``A < 0``, ``l_t = min(l_t, -A c)``.  IS weights never carry gradient; a rejected
token contributes exactly zero loss and zero gradient (its inputs are replaced before any arithmetic, so a NaN
there cannot leak into the gradient); a batch where everything is rejected gives a finite zero loss.

Aggregation (``config.loss_agg``): ``token_mean`` = ``sum_t l_t / D`` over the batch; ``sample_mean`` = mean over
samples of ``sum_{t in i} l_t / D_i``, over samples with ``D_i > 0``.  The denominators ``D`` count kept tokens, or
every loss token with ``rejected_in_denominator`` (then rejected tokens dilute the mean).

Under CP/DP each rank passes its own tokens and a reducer; the returned loss is **this rank's share**: the shares
of all ranks of the reducer's batch group add up to the single-process loss.  ``normalizer`` may carry denominators
computed once for a larger batch (the global batch, before the first micro-batch; see :func:`loss_normalizer`),
then the loss makes no collective call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.correction.packed import broadcast_to_tokens, segment_sum
from slime_rc.correction.reducer import LocalReducer, as_reducer


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
    return broadcast_to_tokens(per_seq, cu_seqlens[1:] - cu_seqlens[:-1], n_tokens).float()


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
        with ``on_nonfinite='reject'`` also ``pg_nonfinite_tokens`` (this rank's count of kept tokens the loss
        rejected for a NaN/inf ``log_probs``, ``advantages`` or pi_old; the engine counts what it rejects itself).

    The ratio floor: in the PPO loss ``log rho = log pi_theta - log pi_old`` is clamped to ``+-config.safety_bound``
    (20 by default, the engine's bound; verl clamps at 20 too) before ``exp``.  Within the bound nothing changes;
    beyond it rho is the constant ``e^{+-bound}`` (no gradient through it), so finite log-probs that overflow
    ``exp`` -- SGLang's fp32 floor ``finfo.min`` = -3.4e38 or -1e4 as a rollout log-prob -- give a finite loss and
    gradient.  Non-finite values are not clamped: ``on_nonfinite='error'`` raises ``ValueError`` naming the tensor,
    the sample and the position; ``'reject'`` rejects the token (zero loss and gradient) and counts it.
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
    nonfinite = None
    if reject:  # drop a kept token with a non-finite value here too (the engine drops only what it sees) and count it
        finite = torch.isfinite(log_probs.detach())
        for _, values in used[1:]:
            finite = finite & torch.isfinite(values.detach())
        nonfinite = keep & ~finite
        keep = keep & finite
    else:
        add_value_checks(checks, keep, cu_seqlens,
                         [(name, values, fix) for name, values in used if name not in engine_checked])
    if normalizer is None:
        normalizer = loss_normalizer(mask if config.rejected_in_denominator else keep, cu_seqlens, reducer)

    # Rejected and masked tokens get neutral inputs before any arithmetic: exactly zero loss and gradient there.
    lp = torch.where(keep, log_probs, torch.zeros((), dtype=log_probs.dtype, device=log_probs.device))
    adv = torch.where(keep, advantages.float(), 0.0)
    if config.loss_type == "reinforce":
        w = correction.is_weights if (correction is not None and config.is_weights_applied) else None
        per_token = -(lp.float() * adv) * (1.0 if w is None else w.detach())
        clipped = torch.zeros_like(keep)
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
        upper = 1.0 + (config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip)
        unclipped, clipped_term = -adv * rho, -adv * rho.clamp(1.0 - config.eps_clip, upper)
        per_token = torch.maximum(unclipped, clipped_term)
        clipped = keep & ((clipped_term > unclipped) | (raw_log_rho.detach().abs() > bound))
        if config.eps_clip_c is not None:
            dual = -adv * config.eps_clip_c
            clipped = clipped | (keep & (adv < 0) & (per_token > dual))
            per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)
        if correction is not None and config.is_weights_applied:
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
