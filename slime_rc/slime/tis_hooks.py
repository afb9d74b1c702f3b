"""The TIS functions slime loads by dotted path (``--custom-tis-function-path``); ``custom_tis`` re-exports them
under the paths users write.  Each takes exactly what slime's policy loss passes and returns what it expects
(:mod:`slime_rc.slime.tis_contract`); each has a plain form (per-sample lists, one process) and a ``_with_cp`` form
(this CP rank's tokens, full-length masks: what slime calls).

* ``compute_mis_weights``: slime's example ``mis.py`` contract (IS + RS + veto + batch norm + the ``mis_*``
  metrics).  Its settings are THE resolution of slime's keys (:func:`slime_rc.slime.settings.hook_config`, the one
  every entry point uses), applied with slime's example semantics (:mod:`slime_rc.slime.mis`); with a config
  resolved at launch, a preset, or settings slime's example cannot express (k1/k2/k3 options, comma lists, engine
  settings), slime-rc's engine (:func:`slime_rc.compute_rollout_correction`) with its per-token metric names.
  Two slime defects are not copied (``use_rs`` without ``use_tis``, the veto without ``use_rs``): a warning says
  so at the first call.
* ``compute_tis_weights``: slime's vanilla truncated IS, ``w = clamp(r, tis_clip_low, tis_clip)``; masks unchanged.
* ``compute_icepop_weights``: slime's IcePop, ``w = r`` inside ``[tis_clip_low, tis_clip]``, else 0; masks
  unchanged.  Under a launch config the band is that config's IS bounds: still IcePop's band, never a clamp.
* ``compute_metrics_only``: monitoring only (``--get-mismatch-metrics``): slime's mismatch set under ``mis_*``,
  ``pg_loss`` and the masks returned as they came (slime's loss and gradient bit-identical); a correcting setting
  is refused with the fix.

Under context parallelism the per-sequence statistics are combined over the CP group with one all-gather of
``B x k`` float64 values (slime's example all-reduces every full sequence twice, see docs/slime.md); the
elementwise TIS and IcePop need no collective.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Any, Optional

import torch

from slime_rc.slime.mis import SAFETY_BOUND, add_nonfinite_check, slime_mis
from slime_rc.slime.settings import SlimeMisSettings, beyond_slime, get, hook_config, mis_settings
from slime_rc.slime.tis_contract import engine_compute, launch_config, run_lists, run_with_cp

METRICS_ONLY_PATH = "custom_tis.metrics_only.compute_metrics_only_with_cp"


def _lists(compute, train_log_probs, rollout_log_probs, loss_masks):
    return run_lists(compute, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     loss_masks=loss_masks)


def _with_cp(compute, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
             prefix=""):
    return run_with_cp(compute, pg_loss=pg_loss, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                       loss_masks=loss_masks, total_lengths=total_lengths, response_lengths=response_lengths,
                       prefix=prefix)


# ---- slime's example mis.py ---------------------------------------------------------------------------------------
def compute_mis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """slime's non-CP form: ``(weights list | None, modified masks, {name: per-sample list})`` with slime's metric
    names without the ``mis_`` prefix (as slime's example returns them)."""
    return _lists(_mis_compute(args), train_log_probs, rollout_log_probs, loss_masks)


def compute_mis_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                response_lengths, **kwargs: Any):
    """``(pg_loss * weights, full-length modified masks, {mis_name: [N]})``; ``pg_loss`` and the log-probs are this
    CP rank's tokens (zigzag), ``loss_masks`` full response length."""
    compute = _mis_compute(args)
    return _with_cp(compute, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                    response_lengths, prefix="mis_" if compute.slime else "")


def _mis_compute(args):
    config = launch_config(args)
    if config is None:
        reason = beyond_slime(args)
        if reason:
            config = hook_config(args)
            _note_engine(reason)
    if config is not None:
        compute = engine_compute(config)
        compute.slime = False
        return compute
    check_shared_yaml(get(args, "custom_config_path"))
    return slime_compute(mis_settings(args))


def slime_compute(settings: SlimeMisSettings):
    """``compute`` for :func:`run_with_cp` / :func:`run_lists` with slime's example semantics
    (:func:`slime_rc.slime.mis.slime_mis`) under ``settings``."""

    def compute(batch, reducer, checks):
        r = slime_mis(settings, batch.train, batch.rollout, batch.mask, batch.cu_seqlens, reducer=reducer,
                      describe_token=batch.describe, checks=checks)
        return r.weights, r.keep, r.seq_keep, r.metrics
    compute.slime = True
    return compute


@functools.lru_cache(maxsize=None)
def _note_engine(reason: str) -> None:
    warnings.warn(f"slime-rc: {reason} goes beyond slime's example mis.py; custom_tis.mis applies slime-rc's engine "
                  f"(its semantics and metric names, docs/slime.md) for these settings.", UserWarning, stacklevel=5)


@functools.lru_cache(maxsize=16)
def check_shared_yaml(path: Optional[str]) -> None:
    """slime copies ONE YAML onto ``args`` for every plugin: keys slime-rc does not know are someone else's and are
    ignored, but what slime-rc's loader refuses in a slime YAML (a near-miss of one of our keys such as
    ``tis_uper_bound``, a quoted number, ``1e-4``) is refused here too, before the first step uses it."""
    if path and os.path.isfile(str(path)):
        from slime_rc.config.yaml_config import load_yaml_layer

        load_yaml_layer(str(path), slime=True)


# ---- slime's vanilla TIS and IcePop --------------------------------------------------------------------------------
def compute_tis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights, masks, metrics)``: per-sample lists (masks are the loss masks: nothing is rejected)."""
    return _lists(_tis_compute(args), train_log_probs, rollout_log_probs, loss_masks)


def compute_tis_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                response_lengths, **kwargs: Any):
    """``(pg_loss * weights, full-length masks, {tis, tis_clipfrac, tis_abs: [N]})``."""
    return _with_cp(_tis_compute(args), pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                    response_lengths)


def _tis_compute(args):
    config = launch_config(args)
    return engine_compute(config) if config is not None else ratio_compute(args, band=False)


def compute_icepop_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """``(weights, masks, metrics)``: per-sample lists (masks unchanged)."""
    return _lists(ratio_compute(args, band=True), train_log_probs, rollout_log_probs, loss_masks)


def compute_icepop_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                   response_lengths, **kwargs: Any):
    """``(pg_loss * weights, full-length masks, {tis, tis_clipfrac, tis_abs: [N]})``."""
    return _with_cp(ratio_compute(args, band=True), pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                    total_lengths, response_lengths)


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
    zero outside the band), per token ``r = exp(clamp(log r, +-20))`` (slime's is unbounded and overflows past 88);
    metrics ``tis`` (= r), ``tis_clipfrac`` (w != r), ``tis_abs`` (|r - 1|).  Elementwise: no collective."""
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


# ---- monitoring only -----------------------------------------------------------------------------------------------
# settings that would correct something: (attribute on slime's args, what it asks for)
CORRECTING = (("use_tis", "importance sampling"), ("use_rs", "rejection sampling"),
              ("rollout_correction_preset", "a correction preset"),
              ("rollout_correction_config", "a correction config"))


def compute_metrics_only(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """slime's non-CP form: ``(None, the masks unchanged, {name: per-sample list})`` (names without ``mis_``, as
    slime's example returns them)."""
    return _lists(_metrics_only_compute(args), train_log_probs, rollout_log_probs, loss_masks)


def compute_metrics_only_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                 response_lengths, **kwargs: Any):
    """``(pg_loss, the full-length masks unchanged, {mis_name: [N]})``: ``pg_loss`` is returned as it came."""
    return _with_cp(_metrics_only_compute(args), pg_loss, train_log_probs, rollout_log_probs, loss_masks,
                    total_lengths, response_lengths, prefix="mis_")


def _metrics_only_compute(args):
    for name, what in CORRECTING:
        value = get(args, name)
        if name == "rollout_correction_config" and value is not None and not value.corrects:
            continue  # a resolved config that corrects nothing (slime-rc train's --get-mismatch-metrics)
        if value not in (None, False):
            raise ValueError(f"{METRICS_ONLY_PATH}: args.{name}={value!r} asks for {what}, which this monitoring-only "
                             f"function would ignore; drop it to log the metrics only, or use "
                             f"--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp to correct")
    return slime_compute(SlimeMisSettings())  # nothing corrected: slime's example returns before IS / RS
