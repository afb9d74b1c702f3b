"""Monitoring only, inside slime: the mismatch metrics under slime's ``mis_*`` names, the loss left as it is.

slime refuses ``--get-mismatch-metrics`` without a TIS function (``custom_tis_function_path must be set when
get_mismatch_metrics is set``).  This one corrects nothing::

    --get-mismatch-metrics --custom-tis-function-path custom_tis.metrics_only.compute_metrics_only_with_cp

It returns slime's ``pg_loss`` itself and the loss masks unchanged, so slime's loss and gradient are bit-identical
to the same run without the two flags, and the mismatch set slime's example ``mis.py`` logs when nothing is
corrected (``mis_training_log_ppl``, ``mis_rollout_log_ppl``, ``mis_kl``, ``mis_k3_kl``, ``mis_log_ppl_diff``,
``mis_chi2_token``, ``mis_chi2_seq``, ...; :data:`slime_rc.slime.mis.MISMATCH_METRICS`).  Under context parallelism
the per-sequence values are combined over the CP group as ``custom_tis.mis`` does.  A setting that asks for a
correction (``--use-tis``, ``use_rs`` in the YAML, a preset) is refused with the fix: this function would ignore it.
"""

from __future__ import annotations

from typing import Any

from slime_rc.slime.settings import SlimeMisSettings, get

from custom_tis._contract import run_lists, run_with_cp
from custom_tis.mis import slime_compute

PATH = "custom_tis.metrics_only.compute_metrics_only_with_cp"
# settings that would correct something: (attribute on slime's args, what it asks for)
CORRECTING = (("use_tis", "importance sampling"), ("use_rs", "rejection sampling"),
              ("rollout_correction_preset", "a correction preset"),
              ("rollout_correction_config", "a correction config"))


def compute_metrics_only(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """slime's non-CP form: ``(None, the masks unchanged, {name: per-sample list})`` (names without ``mis_``, as
    slime's example returns them)."""
    return run_lists(_compute(args), train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     loss_masks=loss_masks)


def compute_metrics_only_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                 response_lengths, **kwargs: Any):
    """``(pg_loss, the full-length masks unchanged, {mis_name: [N]})``: ``pg_loss`` is returned as it came."""
    return run_with_cp(_compute(args), pg_loss=pg_loss, train_log_probs=train_log_probs,
                       rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                       response_lengths=response_lengths, prefix="mis_")


def _compute(args):
    for name, what in CORRECTING:
        value = get(args, name)
        if value not in (None, False):
            raise ValueError(f"{PATH}: args.{name}={value!r} asks for {what}, which this monitoring-only function "
                             f"would ignore; drop it to log the metrics only, or use "
                             f"--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp to correct")
    return slime_compute(SlimeMisSettings())  # nothing corrected: slime's example returns before IS / RS
