"""Vanilla truncated IS (slime's ``--use-tis`` flags) through slime_rc's engine: per-token weight
``clamp(r, tis_clip_low, tis_clip)``, no rejection.

``args.tis_clip`` (default 2.0) is the upper bound; ``args.tis_clip_low`` (default 0) > 0 clamps from below too
(engine mode ``clip``), 0 means no lower bound (engine mode ``truncate``).
"""

from __future__ import annotations

from typing import Any

from ._contract import config_from_args, launch_config, correct_samples, correct_samples_with_cp, get_arg


def tis_config(args):
    """The launch-resolved config when ``args`` went through ``slime_rc.config_from_args``, else this
    adapter's own reading of ``args`` (below)."""
    resolved = launch_config(args)
    if resolved is not None:
        return resolved
    low = float(get_arg(args, "tis_clip_low", 0.0))
    return config_from_args({}, use_tis=True, tis_level="token", tis_mode="clip" if low > 0 else "truncate",
                            tis_upper_bound=float(get_arg(args, "tis_clip", 2.0)),
                            tis_lower_bound=low if low > 0 else None)


def compute_tis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights, masks, metrics)``: per-sample lists (masks are the loss masks: nothing is rejected)."""
    return correct_samples(tis_config(args), train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                           loss_masks=loss_masks)


def compute_tis_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                response_lengths, **kwargs: Any):
    """``(pg_loss * weights, CP-local masks, flat local metrics)``."""
    return correct_samples_with_cp(tis_config(args), pg_loss=pg_loss, train_log_probs=train_log_probs,
                                   rollout_log_probs=rollout_log_probs, loss_masks=loss_masks,
                                   total_lengths=total_lengths, response_lengths=response_lengths)
