"""Named presets: the estimator + mode combinations of ``rollout_corr_math.md`` and of current verl.

Plain functions of their thresholds returning flat settings (the setting keys of :mod:`slime_rc.config.knobs`), so
that ``--rollout-correction-preset NAME`` is the lowest layer and any flag or YAML key overrides a single setting of
it.  Build one with ``RolloutCorrectionConfig.preset(NAME, **thresholds)`` (``RolloutCorrectionConfig.NAME(...)``
is a deprecated alias of it) or use it as a layer (:func:`slime_rc.config.stack.preset_layer`).

Thresholds are ratio bounds on ``r = pi_train / pi_rollout``: a number is the upper bound (lower = 1/upper),
``"lo_hi"`` gives both; the k3 presets bound a divergence from above.  ``*_geo_rs`` is ``seq_mean_k1`` (the
geometric mean ratio, with ``geometric`` as its older spelling), ``*_k3_rs`` is ``seq_mean_k3``.
"""

from __future__ import annotations

from typing import Callable, Dict

from slime_rc.config._text import Threshold, split_threshold
from slime_rc.config.rejection import RS_OPTIONS

DECOUPLED = {"use_rollout_logprobs": False, "loss_type": "ppo_clip"}
BYPASS_PPO = {"use_rollout_logprobs": True, "loss_type": "ppo_clip"}
BYPASS_PG = {"use_rollout_logprobs": True, "loss_type": "reinforce"}


def _is(level: str, threshold: Threshold) -> dict:
    """IS weights at ``level``: a number truncates at it; ``"lo_hi"`` masks outside [lo, hi] (IcePop)."""
    upper, lower = split_threshold("threshold", threshold)
    if lower is None:
        return {"use_tis": True, "tis_level": level, "tis_mode": "truncate", "tis_upper_bound": upper}
    return {"use_tis": True, "tis_level": level, "tis_mode": "mask", "tis_lower_bound": lower, "tis_upper_bound": upper}


def _rs(option: str, threshold: Threshold) -> dict:
    if RS_OPTIONS[option][2] != "k1":  # a divergence bound: one number ("lo_hi" is refused downstream)
        return {"use_rs": True, "rs_level": option, "rs_upper_bound": threshold}
    upper, lower = split_threshold("rs_threshold", threshold)
    return {"use_rs": True, "rs_level": option, "rs_upper_bound": upper,
            **({} if lower is None else {"rs_lower_bound": lower})}


NO_IS = {"use_tis": False}
NO_RS = {"use_rs": False}


# ---- rollout_corr_math.md §3.7 ----------------------------------------------------------------------------------
def decoupled_token_is(threshold: Threshold = 2.0) -> dict:
    """Decoupled PPO + token-level truncated IS (Token-TIS)."""
    return {**DECOUPLED, **_is("token", threshold), **NO_RS}


def decoupled_seq_is(threshold: Threshold = 2.0) -> dict:
    """Decoupled PPO + sequence-level truncated IS (Seq-TIS)."""
    return {**DECOUPLED, **_is("sequence", threshold), **NO_RS}


def decoupled_seq_is_rs(is_threshold: Threshold = 2.0, rs_threshold: Threshold = 2.0) -> dict:
    """Decoupled PPO + sequence IS + sequence RS (Seq-MIS): sequences whose ratio leaves the band are dropped."""
    return {**DECOUPLED, **_is("sequence", is_threshold), **_rs("sequence", rs_threshold)}


def decoupled_geo_rs(rs_threshold: Threshold = "0.999_1.001", veto_threshold: float = 1e-4) -> dict:
    """Decoupled PPO + geometric RS + veto (Geo-RS), no IS weights."""
    return {**DECOUPLED, **NO_IS, **_rs("geometric", rs_threshold), "rs_veto_threshold": veto_threshold}


def geo_rs_seq_tis(is_threshold: Threshold = 2.0, rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Decoupled PPO + geometric filter + sequence truncated IS (Geo-RS-Seq-TIS)."""
    return {**DECOUPLED, **_is("sequence", is_threshold), **_rs("geometric", rs_threshold)}


def ppo_is_bypass(threshold: Threshold = 2.0) -> dict:
    """Bypass PPO (pi_old := pi_rollout); token IS as diagnostics only (the PPO ratio already corrects)."""
    return {**BYPASS_PPO, **_is("token", threshold), **NO_RS}


def pg_is(threshold: Threshold = 2.0) -> dict:
    """Bypass REINFORCE + sequence truncated IS."""
    return {**BYPASS_PG, **_is("sequence", threshold), **NO_RS}


def pg_rs(rs_threshold: Threshold = "0.999_1.001", veto_threshold: float = 1e-4) -> dict:
    """Bypass REINFORCE + geometric RS + veto, no IS weights."""
    return {**BYPASS_PG, **NO_IS, **_rs("geometric", rs_threshold), "rs_veto_threshold": veto_threshold}


def pg_geo_rs_seq_tis(is_threshold: Threshold = 2.0, rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Bypass REINFORCE + geometric filter + sequence truncated IS."""
    return {**BYPASS_PG, **_is("sequence", is_threshold), **_rs("geometric", rs_threshold)}


def disabled() -> dict:
    """No correction: standard PPO with the mismatch metrics still computed (metrics only)."""
    return {"use_rollout_logprobs": False, "loss_type": "ppo_clip", **NO_IS, **NO_RS, "get_mismatch_metrics": True}


# ---- current verl names ------------------------------------------------------------------------------------------
def bypass_ppo_clip() -> dict:
    """Bypass PPO, nothing else: the PPO ratio pi_theta/pi_rollout is the correction."""
    return {**BYPASS_PPO, **NO_IS, **NO_RS}


def bypass_ppo_clip_geo_rs(rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Bypass PPO + geometric RS."""
    return {**BYPASS_PPO, **NO_IS, **_rs("seq_mean_k1", rs_threshold)}


def bypass_ppo_clip_k3_rs(rs_threshold: float = 0.01) -> dict:
    """Bypass PPO + sequence-mean k3 RS (rejects sequences whose mean k3 divergence exceeds the threshold)."""
    return {**BYPASS_PPO, **NO_IS, **_rs("seq_mean_k3", rs_threshold)}


def bypass_pg_is(threshold: Threshold = 2.0) -> dict:
    """Bypass REINFORCE + sequence truncated IS."""
    return {**BYPASS_PG, **_is("sequence", threshold), **NO_RS}


def bypass_pg_geo_rs(rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Bypass REINFORCE + geometric RS, no IS weights."""
    return {**BYPASS_PG, **NO_IS, **_rs("seq_mean_k1", rs_threshold)}


def bypass_pg_geo_rs_seq_tis(is_threshold: Threshold = 2.0, rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Bypass REINFORCE + geometric RS + sequence truncated IS."""
    return {**BYPASS_PG, **_is("sequence", is_threshold), **_rs("seq_mean_k1", rs_threshold)}


def bypass_pg_geo_rs_token_tis(is_threshold: Threshold = 2.0, rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Bypass REINFORCE + geometric RS + token truncated IS."""
    return {**BYPASS_PG, **_is("token", is_threshold), **_rs("seq_mean_k1", rs_threshold)}


def decoupled_geo_rs_seq_tis(is_threshold: Threshold = 2.0, rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Decoupled PPO + geometric RS + sequence truncated IS."""
    return {**DECOUPLED, **_is("sequence", is_threshold), **_rs("seq_mean_k1", rs_threshold)}


def decoupled_geo_rs_token_tis(is_threshold: Threshold = 2.0, rs_threshold: Threshold = "0.999_1.001") -> dict:
    """Decoupled PPO + geometric RS + token truncated IS."""
    return {**DECOUPLED, **_is("token", is_threshold), **_rs("seq_mean_k1", rs_threshold)}


def decoupled_k3_rs(rs_threshold: float = 0.01) -> dict:
    """Decoupled PPO + sequence-mean k3 RS, no IS weights."""
    return {**DECOUPLED, **NO_IS, **_rs("seq_mean_k3", rs_threshold)}


def decoupled_k3_rs_seq_tis(is_threshold: Threshold = 2.0, rs_threshold: float = 0.01) -> dict:
    """Decoupled PPO + sequence-mean k3 RS + sequence truncated IS."""
    return {**DECOUPLED, **_is("sequence", is_threshold), **_rs("seq_mean_k3", rs_threshold)}


def decoupled_k3_rs_token_tis(is_threshold: Threshold = 2.0, rs_threshold: float = 0.01) -> dict:
    """Decoupled PPO + sequence-mean k3 RS + token truncated IS."""
    return {**DECOUPLED, **_is("token", is_threshold), **_rs("seq_mean_k3", rs_threshold)}


def _icepop(threshold: float, threshold_lower: float) -> dict:
    # IcePop zeroes the weight of out-of-band tokens but keeps them in the loss mean: a masked token counts in
    # the denominator with zero gradient.
    return {**_is("token", f"{threshold_lower!r}_{threshold!r}"), **NO_RS, "rejected_in_denominator": True}


def decoupled_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> dict:
    """Decoupled PPO + token IcePop: weight r inside [lower, upper], 0 outside (still in the denominator)."""
    return {**DECOUPLED, **_icepop(threshold, threshold_lower)}


def bypass_pg_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> dict:
    """Bypass REINFORCE + token IcePop."""
    return {**BYPASS_PG, **_icepop(threshold, threshold_lower)}


PRESETS: Dict[str, Callable[..., dict]] = {f.__name__: f for f in (
    decoupled_token_is, decoupled_seq_is, decoupled_seq_is_rs, decoupled_geo_rs, geo_rs_seq_tis, ppo_is_bypass,
    pg_is, pg_rs, pg_geo_rs_seq_tis, disabled,
    bypass_ppo_clip, bypass_ppo_clip_geo_rs, bypass_ppo_clip_k3_rs, bypass_pg_is, bypass_pg_geo_rs,
    bypass_pg_geo_rs_seq_tis, bypass_pg_geo_rs_token_tis, decoupled_geo_rs_seq_tis, decoupled_geo_rs_token_tis,
    decoupled_k3_rs, decoupled_k3_rs_seq_tis, decoupled_k3_rs_token_tis, decoupled_token_icepop,
    bypass_pg_token_icepop,
)}

