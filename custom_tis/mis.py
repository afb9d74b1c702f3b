"""slime's ``mis.py`` contract (IS + RS + veto + mismatch metrics) as a thin adapter over slime_rc's engine.

Use with ``--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp``.  ``args`` carries the slime
keys ``use_tis, use_rs, tis_level, rs_level, tis_mode, tis_lower_bound, tis_upper_bound, rs_lower_bound,
rs_upper_bound, rs_veto_threshold, tis_batch_normalize`` (or slime's ``mis_*`` spellings); missing or None
attributes are left at the engine's defaults, other attributes are ignored.
"""

from __future__ import annotations

from typing import Any

from ._contract import config_from_args, correct_samples, correct_samples_with_cp


def compute_mis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights | None, modified_masks, metrics)``: per-sample lists; weights None when IS is off."""
    return correct_samples(config_from_args(args), train_log_probs=train_log_probs,
                           rollout_log_probs=rollout_log_probs, loss_masks=loss_masks)


def compute_mis_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                response_lengths, **kwargs: Any):
    """``(pg_loss * weights, CP-local modified_masks, flat local metrics)``; log-probs are CP-local (zigzag),
    ``loss_masks`` full length."""
    return correct_samples_with_cp(config_from_args(args), pg_loss=pg_loss, train_log_probs=train_log_probs,
                                   rollout_log_probs=rollout_log_probs, loss_masks=loss_masks,
                                   total_lengths=total_lengths, response_lengths=response_lengths)
