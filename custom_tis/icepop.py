"""IcePop with slime's semantics (slime's built-in ``icepop_function``).

Per token ``w = r`` when ``tis_clip_low <= r <= tis_clip``, else 0; masks are returned unchanged (a zero weight
zeroes the token's loss; slime's denominators keep it).  Metrics ``tis`` (= r), ``tis_clipfrac`` (w != r),
``tis_abs`` (|r - 1|).  ``args.tis_clip`` defaults to 2.0 and ``args.tis_clip_low`` to 0 (slime's flag defaults).
Elementwise: no collective under context parallelism.

With a config resolved at launch by slime-rc (``args.rollout_correction_config``) the band is that config's IS bounds
(its lower bound as given, 0 unset) -- still IcePop's band: weights outside it are zeroed, never clamped.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slime_rc.slime.mis import SAFETY_BOUND, add_nonfinite_check
from slime_rc.slime.settings import get

from custom_tis._contract import launch_config, run_lists, run_with_cp


def _bound(args, key: str, default: float) -> float:
    value = get(args, key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key}={value!r} must be a finite number >= 0 (slime's --{key.replace('_', '-')}).")
    return float(value)


def clip_bounds(args) -> tuple:
    """``(tis_clip_low, tis_clip)``: slime's flags on ``args`` (defaults 0 and 2.0), or, with a config resolved at
    launch (``args.rollout_correction_config``), the same two settings as that config holds them (its IS upper bound
    and its lower bound as given, 0 when unset: slime's ``--tis-clip-low`` default)."""
    config = launch_config(args)
    if config is not None:
        return (config.is_lower_bound or 0.0), config.is_upper_bound
    return _bound(args, "tis_clip_low", 0.0), _bound(args, "tis_clip", 2.0)


def ratio_compute(args, *, band: bool):
    """``compute`` for the contract helpers: slime's vanilla TIS (``band=False``: clamp) or IcePop (``band=True``:
    zero outside the band), from ``args.tis_clip`` / ``args.tis_clip_low`` (:func:`clip_bounds`)."""
    low, high = clip_bounds(args)
    if not low <= high:
        raise ValueError(f"tis_clip_low={low} must be <= tis_clip={high}.")

    def compute(batch, reducer, checks):
        lr = batch.train - batch.rollout
        on_loss = batch.mask != 0
        bad = on_loss & ~torch.isfinite(lr)
        # deferred (read once by the caller): elementwise, so only this rank can hold it and no peer waits
        add_nonfinite_check(checks, bad, lambda j: batch.describe(j),
                            "Fix the log-prob source or mask such tokens out of loss_masks.")
        r = torch.exp(torch.where(torch.isfinite(lr), lr, 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND))
        w = torch.where((r >= low) & (r <= high), r, 0.0) if band else r.clamp(low, high)
        metrics = {"tis": r, "tis_clipfrac": (w != r).float(), "tis_abs": (r - 1).abs()}
        return w, batch.mask, torch.ones(len(batch.lengths), dtype=torch.bool, device=r.device), metrics
    return compute


def _compute(args):
    return ratio_compute(args, band=True)  # IcePop's band whoever resolved the bounds: one meaning


def compute_icepop_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights, masks, metrics)``: per-sample lists (masks unchanged)."""
    return run_lists(_compute(args), train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     loss_masks=loss_masks)


def compute_icepop_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                   response_lengths, **kwargs: Any):
    """``(pg_loss * weights, full-length masks, {tis, tis_clipfrac, tis_abs: [N]})``."""
    return run_with_cp(_compute(args), pg_loss=pg_loss, train_log_probs=train_log_probs,
                       rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                       response_lengths=response_lengths)
