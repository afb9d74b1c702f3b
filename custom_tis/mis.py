"""slime's ``mis.py`` contract (IS + RS + veto + batch norm + mismatch metrics) for slime's TIS-function hook.

Launch line: ``--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp --custom-config-path mis.yaml``.

Which semantics apply:

* slime's keys on ``args`` (slime's YAML keys set as attributes, or the flags our parser hook adds under the same
  names): slime's example ``mis.py`` (:mod:`slime_rc.slime.mis`) with slime's defaults
  (:mod:`slime_rc.slime.settings`); metrics under slime's ``mis_*`` names.  Two slime defects are not copied
  (``use_rs`` without ``use_tis``, the veto without ``use_rs``): a warning says so at the first call.
* a config resolved at launch by slime-rc (``args.rollout_correction_config``), a
  ``--rollout-correction-preset``, or settings slime's example cannot express (the k1/k2/k3 rejection options,
  ``"lo_hi"`` bands, comma lists): slime-rc's engine (:func:`slime_rc.compute_rollout_correction`), metrics under
  the engine's per-token names (``kl``, ``is_weight``, ...).

Under context parallelism the per-sequence statistics are combined over the CP group with one all-gather of
``B x k`` float64 values (slime's example all-reduces every full sequence twice, see docs/slime.md).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

from slime_rc.slime.mis import slime_mis
from slime_rc.slime.settings import MIS_KEYS, beyond_slime, engine_keys, get, mis_settings

from custom_tis._contract import engine_compute, launch_config, run_lists, run_with_cp


def compute_mis_weights(args, *, train_log_probs, rollout_log_probs, loss_masks):
    """slime's non-CP form: ``(weights list | None, modified masks, {name: per-sample list})`` with slime's metric
    names without the ``mis_`` prefix (as slime's example returns them)."""
    return run_lists(_compute(args), train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                     loss_masks=loss_masks)


def compute_mis_weights_with_cp(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                response_lengths, **kwargs: Any):
    """``(pg_loss * weights, full-length modified masks, {mis_name: [N]})``; ``pg_loss`` and the log-probs are this
    CP rank's tokens (zigzag), ``loss_masks`` full response length."""
    compute = _compute(args)
    return run_with_cp(compute, pg_loss=pg_loss, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
                       loss_masks=loss_masks, total_lengths=total_lengths, response_lengths=response_lengths,
                       prefix="mis_" if compute.slime else "")


def _compute(args):
    config = launch_config(args)
    if config is None:
        reason = beyond_slime(args)
        if reason:
            config = _engine_config(args)
            _note_engine(reason)
    if config is not None:
        compute = engine_compute(config)
        compute.slime = False
        return compute
    check_shared_yaml(get(args, "custom_config_path"))
    return slime_compute(mis_settings(args))


def slime_compute(settings):
    """``compute`` for :func:`run_with_cp` / :func:`run_lists` with slime's example semantics
    (:func:`slime_rc.slime.mis.slime_mis`) under ``settings``."""

    def compute(batch, reducer, checks):
        r = slime_mis(settings, batch.train, batch.rollout, batch.mask, batch.cu_seqlens, reducer=reducer,
                      describe_token=batch.describe, checks=checks)
        return r.weights, r.keep, r.seq_keep, r.metrics
    compute.slime = True
    return compute


def _engine_config(args):
    keys = {k: get(args, k) for k in MIS_KEYS if get(args, k) is not None}
    keys.update(engine_keys(args))
    try:
        return _resolve_engine(get(args, "rollout_correction_preset"), tuple(sorted(keys.items())))
    except TypeError:  # an unhashable value: resolve without the cache (it reports the bad value)
        return _resolve_engine.__wrapped__(get(args, "rollout_correction_preset"), tuple(sorted(keys.items())))


@functools.lru_cache(maxsize=32)
def _resolve_engine(preset, items):
    """slime-rc's config for a preset (lowest) and the keys on ``args``; cached: slime calls once per micro-batch."""
    from slime_rc.config.resolution import Layer, preset_layer, resolve

    layers = [preset_layer(preset)] if preset else []
    layers.append(Layer.from_mapping(dict(items), kind="yaml", where="slime's args"))
    return resolve(layers).config


@functools.lru_cache(maxsize=None)
def _note_engine(reason: str) -> None:
    warnings.warn(f"slime-rc: {reason} goes beyond slime's example mis.py; custom_tis.mis applies slime-rc's engine "
                  f"(its semantics and metric names, docs/slime.md) for these settings.", UserWarning, stacklevel=4)


@functools.lru_cache(maxsize=16)
def check_shared_yaml(path: Optional[str]) -> None:
    """slime copies ONE YAML onto ``args`` for every plugin: keys slime-rc does not know are someone else's and are
    ignored, but what slime-rc's loader refuses in a slime YAML (a near-miss of one of our keys such as
    ``tis_uper_bound``, a quoted number, ``1e-4``) is refused here too, before the first step uses it."""
    if path and os.path.isfile(str(path)):
        from slime_rc.config.yaml_config import load_yaml_layer

        load_yaml_layer(str(path), slime=True)
