"""The configuration record: :class:`RolloutCorrectionConfig`, a frozen dataclass validated when it is built.

Every ratio in this project is ``r = pi_train / pi_rollout`` (``pi_train`` is pi_old in decoupled mode and
pi_theta in bypass mode).  Every bound below is a bound on such a ratio, except the upper bound of the
k2/k3 rejection options, which bounds a divergence (a number >= 0).

The config is validated once, when it is built; the engine trusts it afterwards.  Its fields and defaults come from
the knob table (:mod:`slime_rc.config.knobs`), its rejection criteria from :mod:`slime_rc.config.rejection`;
``from_dict`` and ``preset`` stack layers with :mod:`slime_rc.config.stack`, which this module sits above (no
import runs back: ``stack`` builds whatever class it is handed).  The names of the vocabulary (``IS_LEVELS``,
``RS_OPTIONS``, ``parse_rejection_criteria``, ...) are re-exported here for the modules that import them from here.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional

from slime_rc.config._text import Threshold, did_you_mean, parse_number, positive_finite, split_threshold
from slime_rc.config.knobs import (FIELD_DEFAULTS, IS_LEVELS, IS_MODES, LOSS_AGGREGATIONS, LOSS_TYPES, MODES,
                                   NONFINITE_POLICIES)
from slime_rc.config.presets import PRESETS
from slime_rc.config.rejection import RS_OPTIONS, RejectionCriterion, parse_rejection_criteria
from slime_rc.config.stack import Layer, Stack, preset_layer

__all__ = ["IS_LEVELS", "IS_MODES", "LOSS_AGGREGATIONS", "LOSS_TYPES", "MODES", "NONFINITE_POLICIES", "RS_OPTIONS",
           "RejectionCriterion", "RolloutCorrectionConfig", "Threshold", "parse_number", "parse_rejection_criteria",
           "split_threshold"]


def _preset_alias(name: str, settings: Callable[..., dict]) -> classmethod:
    params = list(inspect.signature(settings).parameters)

    def build(cls, *args, **kwargs):
        if len(args) > len(params):
            raise TypeError(f"preset {name}() takes at most {len(params)} threshold arguments ({', '.join(params)})")
        twice = set(params[:len(args)]) & set(kwargs)
        if twice:
            raise TypeError(f"preset {name}(): {', '.join(sorted(twice))} given both by position and by keyword")
        return cls.preset(name, **dict(zip(params, args)), **kwargs)
    build.__name__ = build.__qualname__ = name
    build.__doc__ = (f"Preset ``{name}``: {settings.__doc__}\n\nDeprecated alias: use "
                     f"``RolloutCorrectionConfig.preset({name!r}, ...)``.")
    return classmethod(build)


# RolloutCorrectionConfig.decoupled_seq_is(threshold=3.0) & co.: one deprecated alias per preset of
# slime_rc.config.presets, each RolloutCorrectionConfig.preset(name, ...); a base class built from that table.
_PresetAliases = type("_PresetAliases", (), {n: _preset_alias(n, fn) for n, fn in PRESETS.items()})


@dataclass(frozen=True)
class RolloutCorrectionConfig(_PresetAliases):
    """What the correction computes.  Validated on construction; invalid values raise ``ValueError``.

    IS (importance sampling) weights, with ``is_level`` None meaning no weights:
      * ``is_level``: ``token`` (w_t = r_t), ``sequence`` (w = prod_t r_t), ``geometric`` (w = (prod_t r_t)^(1/T)).
      * ``is_mode``: ``truncate`` caps at ``is_upper_bound``; ``clip`` clamps to [lower, upper]; ``mask`` keeps the
        weight inside [lower, upper] and rejects the token/sequence outside it.
      * ``is_lower_bound``: defaults to ``1 / is_upper_bound``.
      * ``is_batch_normalize``: divide weights by their mean over the global batch (token mean for token level,
        sequence mean for sequence/geometric level), taken over what the loss keeps.
    RS (rejection sampling): ``rs`` criteria, ANDed.  Pure RS without IS is allowed.
    ``veto_threshold``: reject a whole sequence if any token has an unclamped ratio below it.
    ``safety_bound``: log-ratios (and log-ratio sums/means) are clamped to +-this before ``exp``.
    ``on_nonfinite``: NaN/inf log-probs on loss tokens raise (``error``) or reject their sequence (``reject``).
    ``rejected_in_denominator``: whether rejected tokens still count in the loss denominator (default no:
      rejection removes them from the loss entirely; ``True`` reproduces "gradient dilution" of other systems).
    ``quantile_bins_per_octave``: resolution of the streaming quantile metrics (see ``slime_rc.correction.quantiles``).

    Operating mode (what ``pi_train`` is, and the policy loss):
      * ``mode``: ``standard`` (PPO on pi_theta/pi_old, pi_old recomputed, no correction), ``decoupled`` (pi_old
        recomputed; IS/RS correct pi_rollout -> pi_old), ``bypass`` (pi_old := pi_rollout, no recompute pass).
        Unset (None) resolves to ``decoupled`` when any IS/RS/veto is configured, else ``standard``.
      * ``loss_type``: ``ppo_clip``, or ``reinforce`` (bypass only: -stopgrad(w) * log pi_theta * A with
        w = pi_theta/pi_rollout from the engine).  In bypass + ``ppo_clip`` the PPO ratio already is
        pi_theta/pi_rollout, so IS weights are diagnostics only (``is_weights_applied`` is False); rejection
        (RS, veto, mask mode) still applies.
      * ``get_mismatch_metrics``: compute the mismatch metrics even when nothing is corrected.

    Policy loss (:func:`slime_rc.compute_policy_loss`): ``eps_clip`` / ``eps_clip_high`` (default: ``eps_clip``)
    clip the PPO ratio to [1 - eps_clip, 1 + eps_clip_high]; ``eps_clip_c`` (> 1, optional) is the dual-clip
    bound for negative advantages; ``loss_agg`` is ``sample_mean`` or ``token_mean``.
    """

    # the defaults are declared in the knob table (slime_rc.config.knobs; `slime-rc config` prints them)
    is_level: Optional[str] = FIELD_DEFAULTS["is_level"]
    is_mode: str = FIELD_DEFAULTS["is_mode"]
    is_upper_bound: float = FIELD_DEFAULTS["is_upper_bound"]
    is_lower_bound: Optional[float] = FIELD_DEFAULTS["is_lower_bound"]
    is_batch_normalize: bool = FIELD_DEFAULTS["is_batch_normalize"]
    rs: tuple[RejectionCriterion, ...] = FIELD_DEFAULTS["rs"]
    veto_threshold: Optional[float] = FIELD_DEFAULTS["veto_threshold"]
    safety_bound: float = FIELD_DEFAULTS["safety_bound"]
    on_nonfinite: str = FIELD_DEFAULTS["on_nonfinite"]
    rejected_in_denominator: bool = FIELD_DEFAULTS["rejected_in_denominator"]
    quantile_bins_per_octave: int = FIELD_DEFAULTS["quantile_bins_per_octave"]
    mode: Optional[str] = FIELD_DEFAULTS["mode"]
    loss_type: str = FIELD_DEFAULTS["loss_type"]
    get_mismatch_metrics: bool = FIELD_DEFAULTS["get_mismatch_metrics"]
    eps_clip: float = FIELD_DEFAULTS["eps_clip"]
    eps_clip_high: Optional[float] = FIELD_DEFAULTS["eps_clip_high"]
    eps_clip_c: Optional[float] = FIELD_DEFAULTS["eps_clip_c"]
    loss_agg: str = FIELD_DEFAULTS["loss_agg"]

    def __post_init__(self):
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise ValueError(
                f"is_level={self.is_level!r} is not an IS level; use one of {IS_LEVELS} or None (no IS weights)."
                + did_you_mean(str(self.is_level), IS_LEVELS))
        if self.is_mode not in IS_MODES:
            raise ValueError(
                f"is_mode={self.is_mode!r} is not an IS mode; use one of {IS_MODES}." + did_you_mean(str(self.is_mode), IS_MODES))
        upper = positive_finite("is_upper_bound", self.is_upper_bound,
                                "a typical value is 2.0 (a band's lower end goes in is_lower_bound)")
        object.__setattr__(self, "is_upper_bound", upper)
        if self.is_lower_bound is not None:
            lower = positive_finite("is_lower_bound", self.is_lower_bound, "leave it unset for 1/is_upper_bound")
            if not lower < upper:
                raise ValueError(
                    f"is_lower_bound={lower} must be < is_upper_bound={upper}; "
                    f"lower it or leave it unset (it defaults to 1/upper = {1 / upper:g}).")
            object.__setattr__(self, "is_lower_bound", lower)
        elif self.is_mode != "truncate" and not 1.0 / upper < upper:
            raise ValueError(
                f"is_upper_bound={upper} must be > 1 when is_lower_bound is unset (the lower bound defaults to "
                f"1/upper = {1 / upper:g}); raise it or set is_lower_bound explicitly.")
        rs = self.rs
        if isinstance(rs, RejectionCriterion):
            rs = (rs,)
        rs = tuple(rs or ())
        for c in rs:
            if not isinstance(c, RejectionCriterion):
                raise ValueError(
                    f"rs entries must be RejectionCriterion, got {c!r}; build them with "
                    f"slime_rc.parse_rejection_criteria('token', 2.0).")
        object.__setattr__(self, "rs", rs)
        if self.veto_threshold is not None:
            veto = positive_finite("veto_threshold", self.veto_threshold, "typical values are 1e-4 to 1e-6")
            if veto >= 1.0:
                raise ValueError(
                    f"veto_threshold={veto} must be < 1: it rejects sequences holding a token whose ratio "
                    f"pi_train/pi_rollout is below it (typical values 1e-4 to 1e-6).")
            object.__setattr__(self, "veto_threshold", veto)
        bound = positive_finite("safety_bound", self.safety_bound, "the default is 20.0")
        if bound > 80:
            raise ValueError(f"safety_bound={bound} would overflow float32 exp(); use at most 80 (default 20).")
        object.__setattr__(self, "safety_bound", bound)
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r}: use 'error' (raise, naming sample and position) or "
                f"'reject' (drop the sequence and count it).")
        if not isinstance(self.quantile_bins_per_octave, int) or self.quantile_bins_per_octave not in (
                16, 32, 64, 128, 256, 512, 1024):
            raise ValueError(
                f"quantile_bins_per_octave={self.quantile_bins_per_octave!r} must be a power of two in [16, 1024].")
        self._validate_mode()

    def _validate_mode(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} is not a policy loss; use one of {LOSS_TYPES}."
                             + did_you_mean(str(self.loss_type), LOSS_TYPES))
        corrects = self.corrects
        mode = self.mode if self.mode is not None else ("decoupled" if corrects else "standard")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not an operating mode; use one of {MODES}." + did_you_mean(str(mode), MODES))
        if mode == "standard" and corrects:
            raise ValueError(
                "mode='standard' applies no correction (pi_old is recomputed and pi_rollout is ignored), but "
                f"{self.correction_summary()} is set; use mode='decoupled' to correct pi_rollout -> pi_old, "
                "mode='bypass' to use the rollout log-probs as pi_old, or drop the IS/RS settings.")
        if mode == "decoupled" and not corrects:
            raise ValueError(
                "mode='decoupled' needs something to correct: set IS (is_level / use_tis), RS (rs / use_rs) or "
                "veto_threshold; without them it is standard PPO (mode='standard').")
        if self.loss_type == "reinforce" and mode != "bypass":
            raise ValueError(
                f"loss_type='reinforce' needs mode='bypass' (got mode={mode!r}): the REINFORCE weight "
                "pi_theta/pi_rollout needs the rollout log-probs as pi_old (--use-rollout-logprobs / "
                "bypass_mode: true); for the recomputed pi_old use loss_type='ppo_clip'.")
        eps = positive_finite("eps_clip", self.eps_clip, "a typical value is 0.2")
        object.__setattr__(self, "eps_clip", eps)
        if eps >= 1:
            raise ValueError(f"eps_clip={eps} must be < 1: the PPO ratio is clipped to [1 - eps_clip, ...].")
        if self.eps_clip_high is not None:
            object.__setattr__(self, "eps_clip_high", positive_finite(
                "eps_clip_high", self.eps_clip_high, "leave it unset for eps_clip, or e.g. 0.28 (clip-higher)"))
        if self.eps_clip_c is not None:
            c = positive_finite("eps_clip_c", self.eps_clip_c, "the dual-clip bound is typically 3.0")
            if c <= 1:
                raise ValueError(f"eps_clip_c={c} must be > 1 (dual clip caps -A * ratio at -A * c for A < 0).")
            object.__setattr__(self, "eps_clip_c", c)
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg={self.loss_agg!r} is not an aggregation; use one of {LOSS_AGGREGATIONS}."
                             + did_you_mean(str(self.loss_agg), LOSS_AGGREGATIONS))
        if not isinstance(self.get_mismatch_metrics, bool):
            raise ValueError(f"get_mismatch_metrics={self.get_mismatch_metrics!r} must be true or false.")
        object.__setattr__(self, "mode", mode)

    def correction_summary(self) -> str:
        """``is_level='token' and rs='geometric'``: what this config corrects, for messages."""
        parts = [f"is_level={self.is_level!r}"] if self.is_enabled else []
        parts += [f"rs={','.join(c.option for c in self.rs)!r}"] if self.rs else []
        parts += [f"veto_threshold={self.veto_threshold!r}"] if self.veto_threshold is not None else []
        return " and ".join(parts)

    # --- derived settings -------------------------------------------------------------------------------------
    @property
    def is_enabled(self) -> bool:
        return self.is_level is not None

    @property
    def is_lower(self) -> float:
        """The resolved lower IS bound (``1/upper`` when unset)."""
        return self.is_lower_bound if self.is_lower_bound is not None else 1.0 / self.is_upper_bound

    @property
    def corrects(self) -> bool:
        """Whether any IS weight, rejection criterion or veto is configured."""
        return self.is_enabled or bool(self.rs) or self.veto_threshold is not None

    @property
    def is_weights_applied(self) -> bool:
        """Whether IS weights multiply the loss.  False in bypass + ppo_clip, where the PPO ratio
        pi_theta/pi_rollout already is the importance weight (the weights are then diagnostics only)."""
        return self.is_enabled and not (self.mode == "bypass" and self.loss_type == "ppo_clip")

    @property
    def needs_rollout_log_probs(self) -> bool:
        """Whether the loss needs the rollout log-probs at all."""
        return self.corrects or self.mode == "bypass" or self.get_mismatch_metrics

    @property
    def rejects(self) -> bool:
        """Whether anything can remove tokens from the loss."""
        return bool(self.rs) or self.veto_threshold is not None or (
            self.is_enabled and self.is_mode == "mask") or self.on_nonfinite == "reject"

    # --- construction from dictionaries and presets -----------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RolloutCorrectionConfig":
        """Build from one mapping in any accepted spelling: this class's field names, slime's keys (``use_tis,
        tis_level, rs_upper_bound, ...``; ``mis_*`` and ``tis_clip``/``tis_clip_low`` aliases), verl's keys
        (``rollout_is, rollout_is_threshold, rollout_rs, bypass_mode, loss_type, ...``) and the mode keys
        (``mode``, ``loss_type``, ``use_rollout_logprobs``, ``use_rollout_correction``).  Unknown keys raise
        ``ValueError`` naming the key and the closest valid one.  See :mod:`slime_rc.config.knobs`.
        A setting that cannot act beside the others of ``d`` (``eps_clip`` with ``loss_type='reinforce'``, ...)
        builds silently here: ``to_dict()`` of any config holds every key, dead or not, and reads back with
        ``from_dict``; ``slime-rc config`` on a YAML file, and the launch, print the note.
        """
        return Stack([Layer.from_mapping(d)]).build(cls)

    @classmethod
    def from_yaml(cls, path: str, *, slime: bool = False) -> "RolloutCorrectionConfig":
        """Build from a YAML file in slime's or verl's dialect (``--custom-config-path``), as every entry point reads
        it (:func:`slime_rc.config.yaml_config.load_yaml_layer`): slime's example ``mis.yaml`` gives the settings
        slime's example applies.  ``slime``: read it as slime does (keys that are not slime-rc's are other plugins'
        and ignored, instead of refused)."""
        from slime_rc.config.yaml_config import load_yaml_layer

        return Stack([load_yaml_layer(path, slime=slime)]).build(cls)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rs"] = [dict(option=c.option, upper=c.upper, lower=c.lower) for c in self.rs]
        return d

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "RolloutCorrectionConfig":
        """The preset ``name`` of :mod:`slime_rc.config.presets` with keyword overrides for its thresholds
        (``RolloutCorrectionConfig.preset("decoupled_seq_is", threshold=3.0)``)."""
        try:
            return Stack([preset_layer(name, **overrides)]).build(cls)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("preset ") else f"preset {name!r}: {e}") from None
