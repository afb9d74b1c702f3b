"""Truncated IS with slime's ``--use-tis`` semantics (slime's built-in ``vanilla_tis_function``).

Per token ``w = clamp(r, tis_clip_low, tis_clip)`` with ``r = exp(log pi_train - log pi_rollout)``; masks are
returned unchanged (nothing is rejected); metrics ``tis`` (= r), ``tis_clipfrac`` (w != r), ``tis_abs`` (|r - 1|).
``args.tis_clip`` defaults to 2.0 and ``args.tis_clip_low`` to 0 (slime's flag defaults).  Elementwise: no
collective under context parallelism.  ``exp`` acts on the log-ratio clamped to +-20 (slime's is unbounded and
overflows to inf past 88).

With a config resolved at launch by slime-rc (``args.rollout_correction_config``) slime-rc's engine applies instead.
"""

from __future__ import annotations

from typing import Any

from custom_tis._contract import engine_compute, launch_config, run_lists, run_with_cp
from custom_tis.icepop import ratio_compute


def _compute(args):
    config = launch_config(args)
    if config is not None:
        return engine_compute(config)
    return ratio_compute(args, band=False)


def compute_tis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights, masks, metrics)``: per-sample lists (masks are the loss masks: nothing is rejected)."""
    return run_lists(_compute(args), train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     loss_masks=loss_masks)


def compute_tis_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                response_lengths, **kwargs: Any):
    """``(pg_loss * weights, full-length masks, {tis, tis_clipfrac, tis_abs: [N]})``."""
    return run_with_cp(_compute(args), pg_loss=pg_loss, train_log_probs=train_log_probs,
                       rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                       response_lengths=response_lengths)
