"""A resolved :class:`~slime_rc.RolloutCorrectionConfig` as the attributes slime's ``args`` carries.

A function written to slime's TIS contract (``--custom-tis-function-path``, e.g. slime's example
``examples/train_infer_mismatch_helper/mis.py``) reads its settings off ``args``: ``args.tis_upper_bound``,
``args.rs_level``, ``args.use_tis`` ...  In slime they are slime's flags and the ``--custom-config-path`` YAML keys
set onto ``args``.  When slime-rc runs such a function (``slime_rc.megatron.loss``, ``slime-rc train``) the
function gets a *copy* of the caller's ``args`` (:func:`with_slime_attributes`) with these attributes set to the
values slime-rc resolved (flags > YAML > preset > defaults, ``slime_rc.config.resolution``), so that the function computes
what the loss uses -- never the ``None`` of a flag that was not given.

The mapping inverts the knob table (:mod:`slime_rc.config.knobs`: slime key -> config field):

=========================  =============================================================================================
slime attribute            value
=========================  =============================================================================================
use_tis                    ``is_level is not None``
tis_level                  ``is_level`` (None without IS)
tis_mode                   ``is_mode``
tis_upper_bound / tis_clip ``is_upper_bound`` (always a number: slime's example computes ``1 / tis_upper_bound``)
tis_lower_bound            ``is_lower`` (the resolved lower bound: ``is_lower_bound`` or ``1 / is_upper_bound``)
tis_clip_low               ``is_lower`` in clip / mask mode, ``0`` in truncate mode (slime's ``vanilla_tis_function``
                           clamps to ``[tis_clip_low, tis_clip]``; 0 is slime's "no lower clip")
tis_batch_normalize        ``is_batch_normalize``
use_rs                     ``bool(rs)``
rs_level, rs_upper_bound,  one criterion: its option (the k1 aliases ``token_k1`` / ``seq_sum_k1`` / ``seq_mean_k1`` as
rs_lower_bound             slime's ``token`` / ``sequence`` / ``geometric``), its upper and lower bound as numbers (lower
                           None for k2/k3).  Several criteria (slime's keys cannot express them; slime's example
                           refuses them): the comma strings ``slime_rc.config.stack`` reads, ``rs_level="token,seq_max_k2"``,
                           ``rs_upper_bound="0.5_2.0,0.01"`` (``lower_upper`` bands), ``rs_lower_bound`` None.
                           No RS: all three None
rs_veto_threshold          ``veto_threshold`` (slime's example applies the veto only with ``use_rs``)
get_mismatch_metrics       ``get_mismatch_metrics``
use_rollout_logprobs       ``mode == "bypass"``
calculate_per_token_loss   ``loss_agg == "token_mean"``
eps_clip, eps_clip_high,   ``eps_clip``, ``eps_clip_high`` (resolved: ``eps_clip`` when unset, as slime resolves it),
eps_clip_c                 ``eps_clip_c``
=========================  =============================================================================================

Not mapped: slime's ``loss_type`` is slime's loss selector (``policy_loss`` / ``custom_loss``), not our
``loss_type``; the engine-only fields (``safety_bound``, ``on_nonfinite``, ``rejected_in_denominator``,
``quantile_bins_per_octave``) have no slime key.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Dict

from slime_rc.config.knobs import KNOB_FLAGS, MIS_KEYS
from slime_rc.config.schema import RolloutCorrectionConfig

# the k1 options slime's own level names stand for (same statistic, same aggregation)
SLIME_LEVEL = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}

# slime's mis keys and the attributes of the setting flags slime defines itself (--tis-clip, --eps-clip, ...)
SLIME_ATTRIBUTES = tuple(dict.fromkeys(MIS_KEYS + tuple(f.dest for f in KNOB_FLAGS if f.slime_defines)))


def _rs_attributes(config: RolloutCorrectionConfig) -> Dict[str, Any]:
    crits = config.rs
    if not crits:
        return {"rs_level": None, "rs_upper_bound": None, "rs_lower_bound": None}
    if len(crits) == 1:
        c = crits[0]
        return {"rs_level": SLIME_LEVEL.get(c.option, c.option), "rs_upper_bound": c.upper,
                "rs_lower_bound": c.lower if c.statistic == "k1" else None}
    thresholds = [f"{c.lower!r}_{c.upper!r}" if c.statistic == "k1" else repr(c.upper) for c in crits]
    return {"rs_level": ",".join(SLIME_LEVEL.get(c.option, c.option) for c in crits),
            "rs_upper_bound": ",".join(thresholds), "rs_lower_bound": None}


def slime_attributes(config: RolloutCorrectionConfig) -> Dict[str, Any]:
    """slime's ``args`` attributes (:data:`SLIME_ATTRIBUTES`) for a resolved config (table in the module
    docstring).  ``RolloutCorrectionConfig.from_dict`` of the result, without the aliases ``tis_clip`` /
    ``tis_clip_low``, gives the config back (except ``loss_type`` and the engine-only fields)."""
    if not isinstance(config, RolloutCorrectionConfig):
        raise TypeError(f"slime_attributes(config): config must be a RolloutCorrectionConfig (e.g. "
                        f"slime_rc.config_from_args(args)), got {type(config).__name__}")
    lower = config.is_lower
    return {
        "use_tis": config.is_enabled,
        "tis_level": config.is_level,
        "tis_mode": config.is_mode,
        "tis_upper_bound": config.is_upper_bound,
        "tis_lower_bound": lower,
        "tis_clip": config.is_upper_bound,
        "tis_clip_low": 0.0 if config.is_mode == "truncate" else lower,
        "tis_batch_normalize": config.is_batch_normalize,
        "use_rs": bool(config.rs),
        **_rs_attributes(config),
        "rs_veto_threshold": config.veto_threshold,
        "get_mismatch_metrics": config.get_mismatch_metrics,
        "use_rollout_logprobs": config.mode == "bypass",
        "calculate_per_token_loss": config.loss_agg == "token_mean",
        "eps_clip": config.eps_clip,
        "eps_clip_high": config.eps_clip_high if config.eps_clip_high is not None else config.eps_clip,
        "eps_clip_c": config.eps_clip_c,
    }


def with_slime_attributes(args: Any, config: RolloutCorrectionConfig) -> argparse.Namespace:
    """A copy of ``args`` (an ``argparse.Namespace`` / any object with ``__dict__``, a mapping, or None) as an
    ``argparse.Namespace`` carrying :func:`slime_attributes` ``(config)`` and ``rollout_correction_config =
    config`` (what the ``custom_tis`` adapters read); the caller's other attributes are kept.  ``args`` itself is
    never modified."""
    if args is None:
        base: Dict[str, Any] = {}
    elif isinstance(args, dict):
        base = dict(args)
    elif hasattr(args, "__dict__"):
        base = dict(vars(args))
    else:
        raise TypeError(f"with_slime_attributes(args): args must be an argparse.Namespace, an object with "
                        f"attributes, a dict or None; got {type(args).__name__}")
    out = argparse.Namespace(**{k: copy.copy(v) if isinstance(v, (list, dict, set)) else v for k, v in base.items()})
    for key, value in slime_attributes(config).items():
        setattr(out, key, value)
    out.rollout_correction_config = config
    return out
