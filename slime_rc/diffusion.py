"""Rollout correction for diffusion RL (FlowGRPO): per-SDE-step log-probs over a short window.

A diffusion sample contributes one log-prob per SDE step of its window, so a batch is ``(B, W)`` with ``W`` small
(usually 2).  This module maps that layout onto the packed engine (:func:`slime_rc.compute_rollout_correction`) and
adds no IS/RS arithmetic of its own: every weight, rejection and metric below is the engine's.

* **decoupled mode** (:func:`compute_diffusion_rollout_correction`, once per global batch): each sample's window is
  one packed sequence of ``W`` tokens, ``r_ij = pi_old / pi_rollout`` at step ``j``.  A sequence-level option
  therefore sees the whole window: ``rollout_is=sequence`` gives ``w_i = bound(prod_j r_ij)``, ``seq_mean_k1``
  tests ``exp(mean_j log r_ij)``.  The result is the combined, detached ``rollout_is_weights (B, W)`` the loss
  multiplies by: IS weight x keep (keep alone when IS is off); 0 means rejected (diffusion has no padding).
* **bypass mode** (:func:`compute_diffusion_step_correction`, per SDE step inside the loss): step ``j``'s ``(B,)``
  log-probs, ``r_i = pi_theta / pi_rollout``, each sample its own length-1 sequence.  Every RS option then tests the
  same number ``log r_i`` (token, sum and mean of one value agree), and sequence IS is the step's own ratio.  With
  ``ppo_clip`` the PPO ratio already is ``pi_theta / pi_rollout``: IS weights are diagnostics only
  (``config.is_weights_applied`` is False) and only rejection reaches the gradient.
* :func:`compute_diffusion_step_loss`: FlowGRPO's per-step policy loss on :func:`slime_rc.compute_policy_loss`.

Metric names are the engine's (``slime_rc.correction.metrics.METRICS``) under two prefixes that never overlap:
``rollout_corr/`` for the decoupled once-per-batch correction (pi_old vs pi_rollout) and ``actor/rollout_corr/``
for bypass mode's per-step correction (pi_theta vs pi_rollout), so neither can overwrite the other in a logger.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.losses import compute_policy_loss
from slime_rc.correction.reducer import LocalReducer

DECOUPLED_PREFIX = "rollout_corr/"
STEP_PREFIX = "actor/rollout_corr/"

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class DiffusionCorrection:
    """Result of :func:`compute_diffusion_rollout_correction` (shapes ``(B, W)``) or
    :func:`compute_diffusion_step_correction` (shapes ``(B,)``).

    ``rollout_is_weights``: float32, detached: what the per-element loss is multiplied by: the bounded (and
    batch-normalized) IS weight times ``keep_mask`` when ``config.is_weights_applied``, ``keep_mask`` alone otherwise
    (IS off, or bypass + ``ppo_clip``).  0 = rejected.
    ``keep_mask``: float32 0/1 after RS, veto, mask mode and non-finite rejection.
    ``is_weights``: the engine's IS weights (0 where rejected), detached; ``None`` when IS is off.  In bypass +
    ``ppo_clip`` they are diagnostics only and do not enter ``rollout_is_weights``.
    ``metrics``: prefixed engine metric name -> 0-d float64 tensor, global over the reducer's batch group.
    ``result``: the engine's :class:`~slime_rc.CorrectionResult` on the flattened ``(B*W,)`` tokens.
    """

    rollout_is_weights: torch.Tensor
    keep_mask: torch.Tensor
    is_weights: Optional[torch.Tensor]
    metrics: Dict[str, torch.Tensor]
    result: CorrectionResult


# ---- input checks -----------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, ndim: int, fix: str) -> torch.Tensor:
    want = "(B, W)" if ndim == 2 else "(B,)"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {want}, got {type(t).__name__}; {fix}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {want}, got {t.dim()}-D shape {tuple(t.shape)}; {fix}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name} has dtype {t.dtype}; pass floating-point log-probs of shape {want}")
    return t


def _check_same_shape(ref_name: str, ref: torch.Tensor, name: str, t: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; both must "
                         f"hold the same samples (and SDE steps) in the same order")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; move them to one device")


def _first_nonfinite(named) -> Optional[str]:
    """Where the first NaN/inf of the named tensors is, as ``old_log_probs[3, 1] = nan (sample 3, SDE step 1)``."""
    for name, t in named:
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            idx = [int(i) for i in torch.nonzero(bad)[0]]
            where = f"sample {idx[0]}" + (f", SDE step {idx[1]}" if len(idx) == 2 else "")
            return (f"{name}[{', '.join(map(str, idx))}] = {float(t[tuple(idx)])} ({where}; {int(bad.sum())} "
                    f"non-finite value(s) in {name})")
    return None


def _rephrased(named, call):
    """``call()``, with the engine's non-finite error re-phrased with this API's argument names, sample and SDE
    step (the slow path: it reads the inputs to find the first bad value)."""
    try:
        return call()
    except ValueError as e:
        if not str(e).startswith("non-finite"):
            raise
        where = _first_nonfinite(named) or "on another rank's samples (this rank's inputs are finite)"
        raise ValueError(
            f"non-finite log-prob: {where}. Fix the log-prob source, or set on_nonfinite='reject' (YAML: "
            f"on_nonfinite: reject) to give such samples weight 0 and count them in 'nonfinite_seq_fraction'."
        ) from None


def _run_engine(train: torch.Tensor, rollout: torch.Tensor, config: RolloutCorrectionConfig, reducer,
                named, checks: Optional[DeferredChecks] = None) -> CorrectionResult:
    """The engine on ``(B, W)`` (or ``(B,)`` as ``(B, 1)``) inputs: sample ``i`` is packed sequence ``i``.

    Non-finite inputs under ``on_nonfinite='error'`` are left for the engine to find: it raises on every rank of the
    batch group together (after its totals collective), so a bad value on one rank cannot leave the others waiting
    in a collective.  The message is then re-phrased with this API's argument names, sample and SDE step.  The
    engine's checks are deferred: read once here (one host read with 'error', none with 'reject'), or added to the
    caller's ``checks`` (the caller reads them, through :func:`_rephrased`).
    """
    b, w = train.shape
    cu = torch.arange(b + 1, dtype=torch.int64, device=train.device) * w
    mask = torch.ones(b * w, dtype=torch.bool, device=train.device)
    own = checks is None
    if own:  # (a config that is not a RolloutCorrectionConfig is named by the engine)
        checks = DeferredChecks(read=getattr(config, "on_nonfinite", "error") == "error")
    res = _rephrased(named, lambda: compute_rollout_correction(train.reshape(-1), rollout.reshape(-1), mask, cu,
                                                               config, reducer=reducer, checks=checks))
    if own:
        _rephrased(named, checks.raise_if_any)
    return res


def _outputs(res: CorrectionResult, config: RolloutCorrectionConfig, shape, prefix: str) -> DiffusionCorrection:
    keep = res.keep_mask.reshape(shape)
    is_w = None if res.is_weights is None else res.is_weights.reshape(shape)
    combined = is_w if config.is_weights_applied else keep
    return DiffusionCorrection(rollout_is_weights=combined.detach(), keep_mask=keep, is_weights=is_w,
                               metrics=res.prefixed(prefix), result=res)


def _check_step_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or prefix == DECOUPLED_PREFIX:
        raise ValueError(
            f"prefix={prefix!r}: per-step (bypass) metrics must not share the decoupled correction's namespace "
            f"{DECOUPLED_PREFIX!r} — pi_theta-vs-rollout values would overwrite pi_old-vs-rollout ones in the logger. "
            f"Keep the default {STEP_PREFIX!r} or use e.g. 'actor/rollout_corr/step0/'.")


# ---- decoupled mode: once per global batch ----------------------------------------------------------------------
def compute_diffusion_rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    reducer: Optional[LocalReducer] = None,
) -> DiffusionCorrection:
    """Decoupled mode's correction of a diffusion batch: pi_rollout -> pi_old over each sample's SDE window.

    Args:
        old_log_probs: ``(B, W)`` log pi_old of each sample's ``W`` SDE steps (the trainer's recompute).
        rollout_log_probs: ``(B, W)`` log pi_rollout of the same steps (the rollout backend's).
        config: ``mode`` ``decoupled`` (or ``standard``, metrics only); bypass mode corrects per step instead.
        reducer: for data parallelism, each rank passing its own samples (``slime_rc.correction.reducer``); metrics and batch
            normalization are then over the reducer's global batch.  None for one process.

    With ``log r_ij = clamp(log pi_old_ij - log pi_rollout_ij, +-20)``: ``is_level='token'`` gives
    ``w_ij = bound(r_ij)``, ``'sequence'`` ``w_ij = bound(exp(sum_j log r_ij))``, ``'geometric'``
    ``w_ij = bound(exp(mean_j log r_ij))``; sequence RS options (``seq_mean_k1``, ...) keep or reject the whole
    window, token options single steps.

    Returns:
        :class:`DiffusionCorrection` with ``(B, W)`` tensors; ``rollout_is_weights`` is what FlowGRPO multiplies its
        per-element loss by; metrics are named ``rollout_corr/<engine name>``.
    """
    if isinstance(config, RolloutCorrectionConfig) and config.mode == "bypass":
        raise ValueError(
            "config.mode='bypass': bypass mode skips the once-per-batch correction (pi_old := pi_rollout, so "
            "old == rollout would be a no-op) and corrects each SDE step inside the loss; use "
            "compute_diffusion_step_correction / compute_diffusion_step_loss, or set bypass_mode: false.")
    fix = "stack each sample's SDE-window log-probs into (B, W), e.g. torch.stack(per_step, dim=1)"
    old = _check_tensor("old_log_probs", old_log_probs, 2, fix)
    rollout = _check_tensor("rollout_log_probs", rollout_log_probs, 2, fix)
    _check_same_shape("old_log_probs", old, "rollout_log_probs", rollout)
    if old.shape[1] == 0:
        raise ValueError(f"old_log_probs has shape {tuple(old.shape)}: W = 0 SDE steps per sample; pass at least "
                         f"one step per sample (the SDE window, typically W = 2)")
    res = _run_engine(old, rollout, config, reducer, (("old_log_probs", old), ("rollout_log_probs", rollout)))
    return _outputs(res, config, old.shape, DECOUPLED_PREFIX)


# ---- bypass mode: per SDE step ----------------------------------------------------------------------------------
def compute_diffusion_step_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    reducer: Optional[LocalReducer] = None,
    prefix: str = STEP_PREFIX,
) -> DiffusionCorrection:
    """Bypass mode's correction of one SDE step: pi_rollout -> pi_theta, each sample on its own.

    Args:
        log_probs: ``(B,)`` log pi_theta of step ``j`` (the current policy; read detached).
        rollout_log_probs: ``(B,)`` log pi_rollout of step ``j``.
        config: ``mode='bypass'``.
        reducer: as in :func:`compute_diffusion_rollout_correction` (metrics and batch normalization global).  A
            reducer makes collectives inside the loss: every rank must then evaluate the same number of steps.
        prefix: metric-name prefix; anything but the decoupled ``rollout_corr/``.

    ``log r_i = clamp(log pi_theta_i - log pi_rollout_i, +-20)``; every IS level gives ``w_i = bound(r_i)`` and every
    RS option tests ``log r_i`` (k1) or its k2/k3 divergence.

    Returns:
        :class:`DiffusionCorrection` with ``(B,)`` tensors; ``rollout_is_weights`` is ``keep_mask`` in bypass +
        ``ppo_clip`` (IS diagnostics only) and IS weight x keep with ``loss_type='reinforce'``.
    """
    return _step_correction(log_probs, rollout_log_probs, config, reducer, prefix)


def _step_correction(log_probs, rollout_log_probs, config, reducer, prefix,
                     checks: Optional[DeferredChecks] = None) -> DiffusionCorrection:
    _check_step_prefix(prefix)
    if isinstance(config, RolloutCorrectionConfig) and config.mode != "bypass":
        raise ValueError(
            f"config.mode={config.mode!r}: the per-step correction is bypass mode's (pi_train = pi_theta). In "
            f"decoupled mode correct once per global batch with compute_diffusion_rollout_correction(old_log_probs "
            f"(B, W), rollout_log_probs (B, W), config) and pass its weights to compute_diffusion_step_loss.")
    fix = "pass one SDE step's log-probs, e.g. log_probs[:, j] of a (B, W) batch"
    lp = _check_tensor("log_probs", log_probs, 1, fix)
    rollout = _check_tensor("rollout_log_probs", rollout_log_probs, 1, fix)
    _check_same_shape("log_probs", lp, "rollout_log_probs", rollout)
    res = _run_engine(lp.detach()[:, None], rollout[:, None], config, reducer,
                      (("log_probs", lp), ("rollout_log_probs", rollout)), checks)
    return _outputs(res, config, lp.shape, prefix)


# ---- the per-step policy loss -----------------------------------------------------------------------------------
def compute_diffusion_step_loss(
    log_probs: torch.Tensor,
    old_log_probs: Optional[torch.Tensor],
    rollout_log_probs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    rollout_is_weights: Optional[torch.Tensor] = None,
    reducer: Optional[LocalReducer] = None,
    prefix: str = STEP_PREFIX,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """FlowGRPO's policy loss of one SDE step ``j``, through :func:`slime_rc.compute_policy_loss`.

    Args:
        log_probs: ``(B,)`` log pi_theta of step ``j`` (carries the gradient).
        old_log_probs: ``(B,)`` recomputed log pi_old of step ``j`` (standard/decoupled); ignored in bypass mode.
        rollout_log_probs: ``(B,)`` log pi_rollout of step ``j``; needed in bypass mode only.
        advantages: ``(B,)`` per-sample advantages.
        config: the run's config; ``mode`` picks the path.
        rollout_is_weights: decoupled (and standard) mode: ``(B,)`` column ``j`` of
            :func:`compute_diffusion_rollout_correction`'s ``rollout_is_weights``; 0 = rejected.  Required in
            decoupled mode, refused in bypass mode (computed here per step).
        reducer: as in :func:`slime_rc.compute_policy_loss` (the loss is then this rank's share).
        prefix: prefix of the per-step correction metrics (bypass mode).

    Per kept sample, with ``rho_i = exp(log pi_theta_i - log pi_old_i)`` (pi_old := pi_rollout in bypass mode):
    ``l_i = max(-A_i rho_i, -A_i clip(rho_i, 1 - eps, 1 + eps_high))`` (x ``w_ij`` when IS weights are applied;
    ``-w_i A_i log pi_theta_i`` for bypass REINFORCE).  Rejected samples give exactly 0 loss and 0 gradient.

    Denominator: ``loss = sum_kept l_i / D`` with ``D`` = the number of kept samples (default), or ``D = B`` with
    ``config.rejected_in_denominator=True`` — the plain ``mean()`` over the batch of verl's diffusion loss, where
    rejection dilutes the gradient by kept/total.  Each step is one "token" per sample, so ``loss_agg`` makes no
    difference here.

    Returns:
        ``(loss, metrics)``: the 0-d loss of this step and ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, plus in bypass
        mode the step's correction metrics under ``prefix``.
    """
    _check_step_prefix(prefix)
    if not isinstance(config, RolloutCorrectionConfig):
        raise ValueError(f"config must be a RolloutCorrectionConfig, got {type(config).__name__}; build one with "
                         f"RolloutCorrectionConfig(...) or RolloutCorrectionConfig.from_dict(d)")
    fix = "pass one SDE step's values, e.g. x[:, j] of a (B, W) batch"
    lp = _check_tensor("log_probs", log_probs, 1, fix)
    adv = advantages
    if not isinstance(adv, torch.Tensor) or adv.dim() != 1:
        shape = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(f"advantages must be a (B,) tensor (one advantage per sample), got {shape}; {fix}")
    _check_same_shape("log_probs", lp, "advantages", adv)
    b = lp.shape[0]
    cu = torch.arange(b + 1, dtype=torch.int64, device=lp.device)
    ones = torch.ones(b, dtype=torch.bool, device=lp.device)
    metrics: Dict[str, torch.Tensor] = {}
    checks = DeferredChecks(read=config.on_nonfinite == "error")  # the whole step's checks: read once, at the end
    named = (("log_probs", lp),)

    if config.mode == "bypass":
        if rollout_is_weights is not None:
            raise ValueError(
                "rollout_is_weights given in bypass mode: bypass mode corrects each SDE step here (pi_theta vs "
                "pi_rollout); the once-per-batch weights belong to decoupled mode. Drop the argument, or set "
                "bypass_mode: false.")
        if rollout_log_probs is None:
            raise ValueError("rollout_log_probs is None in bypass mode: pass the (B,) rollout log-probs of this SDE "
                             "step; they play pi_old.")
        step = _step_correction(lp, rollout_log_probs, config, reducer, prefix, checks)
        named = (("log_probs", lp), ("rollout_log_probs", rollout_log_probs))
        # The engine's own metrics would come back named rollout_corr/*, the decoupled namespace: keep them out.
        correction = replace(step.result, metrics={})
        metrics.update(step.metrics)
        old = None
    else:
        if old_log_probs is None:
            raise ValueError(f"old_log_probs is None in mode={config.mode!r}: pass the recomputed (B,) log pi_old of "
                             f"this SDE step, or use bypass mode (bypass_mode: true).")
        old = _check_tensor("old_log_probs", old_log_probs, 1, fix)
        _check_same_shape("log_probs", lp, "old_log_probs", old)
        if rollout_log_probs is not None:
            _check_same_shape("log_probs", lp, "rollout_log_probs",
                              _check_tensor("rollout_log_probs", rollout_log_probs, 1, fix))
        if rollout_is_weights is None:
            if config.mode == "decoupled":
                raise ValueError(
                    "rollout_is_weights is None in decoupled mode: compute them once per global batch with "
                    "compute_diffusion_rollout_correction(old_log_probs (B, W), rollout_log_probs (B, W), config) "
                    "and pass column j of .rollout_is_weights for SDE step j.")
            keep = ones
            weights = None
        else:
            w = rollout_is_weights
            if not isinstance(w, torch.Tensor) or w.dim() != 1:
                shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
                raise ValueError(f"rollout_is_weights must be (B,) (column j of the (B, W) decoupled weights), got "
                                 f"{shape}; pass rollout_is_weights[:, j]")
            _check_same_shape("log_probs", lp, "rollout_is_weights", w)
            w = w.detach().float()
            checks.add((~torch.isfinite(w) | (w < 0)).any(),
                       "rollout_is_weights holds negative or non-finite values; pass the weights of "
                       "compute_diffusion_rollout_correction unchanged (0 = rejected)")
            keep = w > 0  # no padding in diffusion: a zero weight is a rejection
            weights = w if config.is_weights_applied else None
        correction = CorrectionResult(is_weights=weights, keep_mask=keep.float(), metrics={})
    # rollout_log_probs is only read in bypass mode once a correction is given; the policy loss checks that it is
    # present whenever the config corrects, so stand in pi_old for it elsewhere.
    rollout = rollout_log_probs if config.mode == "bypass" else (
        rollout_log_probs if rollout_log_probs is not None else old)
    loss, loss_metrics = compute_policy_loss(lp, old, rollout, adv, ones, cu, config, reducer=reducer,
                                             correction=correction, checks=checks)
    _rephrased(named, checks.raise_if_any)  # one host read with on_nonfinite='error', none with 'reject'
    metrics.update(loss_metrics)
    return loss, metrics
