"""IcePop through slime_rc's engine: token-level IS in mask mode.  A token keeps weight ``r`` when
``low <= r <= high``; outside the band its weight is 0 and it is removed from the loss mask.

Bounds: ``args.tis_lower_bound`` (default 0.5) and ``args.tis_upper_bound`` (default 2.0).
"""

from __future__ import annotations

from typing import Any

from ._contract import config_from_args, launch_config, correct_samples, correct_samples_with_cp, get_arg


def icepop_config(args):
    """The launch-resolved config when ``args`` went through ``slime_rc.config_from_args``, else this
    adapter's own reading of ``args`` (below)."""
    resolved = launch_config(args)
    if resolved is not None:
        return resolved
    return config_from_args({}, use_tis=True, tis_level="token", tis_mode="mask",
                            tis_lower_bound=float(get_arg(args, "tis_lower_bound", 0.5)),
                            tis_upper_bound=float(get_arg(args, "tis_upper_bound", 2.0)))


def compute_icepop_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights, modified_masks, metrics)``: per-sample lists."""
    return correct_samples(icepop_config(args), train_log_probs=train_log_probs,
                           rollout_log_probs=rollout_log_probs, loss_masks=loss_masks)


def compute_icepop_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                   response_lengths, **kwargs: Any):
    """``(pg_loss * weights, CP-local modified_masks, flat local metrics)``."""
    return correct_samples_with_cp(icepop_config(args), pg_loss=pg_loss, train_log_probs=train_log_probs,
                                   rollout_log_probs=rollout_log_probs, loss_masks=loss_masks,
                                   total_lengths=total_lengths, response_lengths=response_lengths)
