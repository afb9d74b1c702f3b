"""Typed, validated configuration of the rollout-correction estimator family.

Every ratio in this project is ``r = pi_train / pi_rollout`` (``pi_train`` is pi_old in decoupled mode and
pi_theta in bypass mode).  Every bound below is a bound on such a ratio, except the upper bound of the
k2/k3 rejection options, which bounds a divergence (a number >= 0).

The config is validated once, when it is built; the engine trusts it afterwards.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence, Union

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "clip", "mask")
NONFINITE_POLICIES = ("error", "reject")
# How the loss uses the correction (rollout_corr_math.md §3): who plays pi_old, and which policy loss.
MODES = ("standard", "decoupled", "bypass")
LOSS_TYPES = ("ppo_clip", "reinforce")
# How per-token losses become one number: mean over each sample's tokens then over samples (slime's default), or
# one mean over all tokens of the batch (slime's --calculate-per-token-loss).
LOSS_AGGREGATIONS = ("sample_mean", "token_mean")

# Rejection options.  Each is (granularity, aggregate, statistic):
#   granularity "token" rejects single tokens, "sequence" rejects whole sequences;
#   aggregate is how the per-token statistic becomes a per-sequence one;
#   statistic "k1" is the log-ratio log r, "k2" is (log r)^2 / 2, "k3" is r - 1 - log r.
# "k1" options are bounded as ratios: exp(statistic) must lie in [lower, upper].
# "k2"/"k3" options are divergences (>= 0): the statistic must be <= upper.
RS_OPTIONS = {
    "token": ("token", "token", "k1"),
    "sequence": ("sequence", "sum", "k1"),
    "geometric": ("sequence", "mean", "k1"),
    "token_k1": ("token", "token", "k1"),
    "token_k2": ("token", "token", "k2"),
    "token_k3": ("token", "token", "k3"),
    "seq_sum_k1": ("sequence", "sum", "k1"),
    "seq_sum_k2": ("sequence", "sum", "k2"),
    "seq_sum_k3": ("sequence", "sum", "k3"),
    "seq_mean_k1": ("sequence", "mean", "k1"),
    "seq_mean_k2": ("sequence", "mean", "k2"),
    "seq_mean_k3": ("sequence", "mean", "k3"),
    "seq_max_k2": ("sequence", "max", "k2"),
    "seq_max_k3": ("sequence", "max", "k3"),
}

Threshold = Union[float, int, str]


def _closest(name: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def _positive_finite(name: str, value: Any, hint: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number; {hint}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {hint}")
    return value


@dataclass(frozen=True)
class RejectionCriterion:
    """One rejection-sampling rule.  Several criteria are ANDed: a token is kept only if every one keeps it.

    ``option``: a key of :data:`RS_OPTIONS`.  ``upper``/``lower``: for k1 options (``token``, ``sequence``,
    ``geometric``, ``*_k1``) bounds on the ratio exp(statistic), ``lower`` defaulting to ``1/upper``; for
    k2/k3 options ``upper`` bounds the divergence and ``lower`` must stay unset.
    """

    option: str
    upper: float
    lower: Optional[float] = None

    def __post_init__(self):
        if self.option not in RS_OPTIONS:
            raise ValueError(
                f"rs_level={self.option!r} is not a rejection option; choose from {', '.join(RS_OPTIONS)}."
                + _closest(str(self.option), RS_OPTIONS)
            )
        hint = f"set the bound of rejection option {self.option!r} to e.g. 2.0"
        upper = _positive_finite(f"rs upper bound for {self.option!r}", self.upper, hint)
        object.__setattr__(self, "upper", upper)
        if self.statistic == "k1":
            lower = 1.0 / upper if self.lower is None else _positive_finite(
                f"rs lower bound for {self.option!r}", self.lower, "use a ratio such as 0.5")
            if not lower < upper:
                raise ValueError(
                    f"rs bounds for {self.option!r}: lower={lower} must be < upper={upper}; "
                    f"write them as 'lower_upper', e.g. '0.5_2.0'.")
            object.__setattr__(self, "lower", lower)
        elif self.lower is not None:
            raise ValueError(
                f"rejection option {self.option!r} bounds a divergence (>= 0) from above only; "
                f"got lower={self.lower!r}. Give a single upper bound such as 0.01, or use a *_k1 option "
                f"for a two-sided ratio band.")

    @property
    def granularity(self) -> str:
        return RS_OPTIONS[self.option][0]

    @property
    def aggregate(self) -> str:
        return RS_OPTIONS[self.option][1]

    @property
    def statistic(self) -> str:
        return RS_OPTIONS[self.option][2]

    @property
    def log_bounds(self) -> tuple[float, float]:
        """Bounds in the space the statistic lives in: log-ratio for k1, the divergence itself for k2/k3."""
        if self.statistic == "k1":
            return math.log(self.lower), math.log(self.upper)
        return -math.inf, self.upper


def parse_number(what: str, value: Any) -> Any:
    """A string as a float, refusing what Python's ``float`` would misread (``"2_0"`` is 20.0 there); other
    values are returned as they are (validated where they are used)."""
    if not isinstance(value, str):
        return value
    try:
        if "_" in value:
            raise ValueError
        return float(value)
    except ValueError:
        raise ValueError(f"{what}={value!r} is not a number") from None


def split_threshold(what: str, threshold: Threshold) -> tuple[Threshold, Optional[float]]:
    """``2.0`` -> (upper=2.0, lower=None); ``"0.5_2.0"`` -> (upper=2.0, lower=0.5).  ``what`` names the setting
    in the error message."""
    if isinstance(threshold, str) and "_" in threshold:
        lo, _, hi = threshold.strip().partition("_")
        try:
            return parse_number(what, hi), parse_number(what, lo)
        except ValueError:
            raise ValueError(f"{what}={threshold!r} is not a number or 'lower_upper' with one underscore "
                             f"(e.g. '0.5_2.0')") from None
    return parse_number(what, threshold), None


def parse_rejection_criteria(
    levels: Union[str, Sequence[str], None],
    upper: Union[Threshold, Sequence[Threshold], None],
    lower: Optional[float] = None,
) -> tuple[RejectionCriterion, ...]:
    """Build criteria from slime/verl style settings.

    ``levels``: ``"geometric"``, ``"token,seq_mean_k3"`` or a list.  ``upper``: one threshold shared by every
    option, or a comma list / list with one per option; a threshold is a number or ``"lower_upper"``.
    ``lower``: a plain lower ratio bound for the k1 options whose threshold does not carry one.
    """
    if levels is None or levels == "" or levels == []:
        return ()
    names = [s.strip() for s in levels.split(",")] if isinstance(levels, str) else [str(s).strip() for s in levels]
    names = list(dict.fromkeys(n for n in names if n))  # de-duplicate, keep order
    if upper is None:
        raise ValueError(
            f"rejection sampling on {','.join(names)!r} needs a threshold: set rs_upper_bound "
            f"(e.g. 2.0 for ratio options, '0.999_1.001' for geometric, 0.01 for k2/k3 options).")
    if isinstance(upper, str):
        thresholds: list = [t.strip() for t in upper.split(",")]
    elif isinstance(upper, (list, tuple)):
        thresholds = list(upper)
    else:
        thresholds = [upper]
    if len(thresholds) == 1:
        thresholds = thresholds * len(names)
    if len(thresholds) != len(names):
        raise ValueError(
            f"rs thresholds {upper!r}: give one threshold shared by all {len(names)} options {names} "
            f"or exactly one per option (comma separated).")
    out, lower_used = [], False
    for name, thr in zip(names, thresholds):
        if name not in RS_OPTIONS:
            raise ValueError(
                f"rs_level={name!r} is not a rejection option; choose from {', '.join(RS_OPTIONS)}."
                + _closest(name, RS_OPTIONS))
        hi, lo = split_threshold(f"rs threshold for {name!r}", thr)
        if RS_OPTIONS[name][2] == "k1" and lo is None and lower is not None:
            lo, lower_used = lower, True
        out.append(RejectionCriterion(name, hi, lo))
    if lower is not None and not lower_used:
        raise ValueError(
            f"rs_lower_bound={lower!r} has no effect on {','.join(names)!r}: it applies to ratio (k1) options whose "
            f"threshold carries no 'lower_upper' band, and k2/k3 options bound a divergence from above only. Drop "
            f"it, or write the band into the threshold (e.g. '0.5_2.0').")
    return tuple(out)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
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

    is_level: Optional[str] = None
    is_mode: str = "truncate"
    is_upper_bound: float = 2.0
    is_lower_bound: Optional[float] = None
    is_batch_normalize: bool = False
    rs: tuple[RejectionCriterion, ...] = ()
    veto_threshold: Optional[float] = None
    safety_bound: float = 20.0
    on_nonfinite: str = "error"
    rejected_in_denominator: bool = False
    quantile_bins_per_octave: int = 128
    mode: Optional[str] = None
    loss_type: str = "ppo_clip"
    get_mismatch_metrics: bool = False
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    eps_clip_c: Optional[float] = None
    loss_agg: str = "sample_mean"

    def __post_init__(self):
        if self.is_level is not None and self.is_level not in IS_LEVELS:
            raise ValueError(
                f"is_level={self.is_level!r} is not an IS level; use one of {IS_LEVELS} or None (no IS weights)."
                + _closest(str(self.is_level), IS_LEVELS))
        if self.is_mode not in IS_MODES:
            raise ValueError(
                f"is_mode={self.is_mode!r} is not an IS mode; use one of {IS_MODES}." + _closest(str(self.is_mode), IS_MODES))
        upper = _positive_finite("is_upper_bound", self.is_upper_bound, "a typical value is 2.0")
        object.__setattr__(self, "is_upper_bound", upper)
        if self.is_lower_bound is not None:
            lower = _positive_finite("is_lower_bound", self.is_lower_bound, "leave it unset for 1/is_upper_bound")
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
            veto = _positive_finite("veto_threshold", self.veto_threshold, "typical values are 1e-4 to 1e-6")
            if veto >= 1.0:
                raise ValueError(
                    f"veto_threshold={veto} must be < 1: it rejects sequences holding a token whose ratio "
                    f"pi_train/pi_rollout is below it (typical values 1e-4 to 1e-6).")
            object.__setattr__(self, "veto_threshold", veto)
        bound = _positive_finite("safety_bound", self.safety_bound, "the default is 20.0")
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
                             + _closest(str(self.loss_type), LOSS_TYPES))
        corrects = self.corrects
        mode = self.mode if self.mode is not None else ("decoupled" if corrects else "standard")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not an operating mode; use one of {MODES}." + _closest(str(mode), MODES))
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
        eps = _positive_finite("eps_clip", self.eps_clip, "a typical value is 0.2")
        object.__setattr__(self, "eps_clip", eps)
        if eps >= 1:
            raise ValueError(f"eps_clip={eps} must be < 1: the PPO ratio is clipped to [1 - eps_clip, ...].")
        if self.eps_clip_high is not None:
            object.__setattr__(self, "eps_clip_high", _positive_finite(
                "eps_clip_high", self.eps_clip_high, "leave it unset for eps_clip, or e.g. 0.28 (clip-higher)"))
        if self.eps_clip_c is not None:
            c = _positive_finite("eps_clip_c", self.eps_clip_c, "the dual-clip bound is typically 3.0")
            if c <= 1:
                raise ValueError(f"eps_clip_c={c} must be > 1 (dual clip caps -A * ratio at -A * c for A < 0).")
            object.__setattr__(self, "eps_clip_c", c)
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg={self.loss_agg!r} is not an aggregation; use one of {LOSS_AGGREGATIONS}."
                             + _closest(str(self.loss_agg), LOSS_AGGREGATIONS))
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

    # --- construction from dictionaries -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RolloutCorrectionConfig":
        """Build from one mapping in any accepted spelling: this class's field names, slime's keys (``use_tis,
        tis_level, rs_upper_bound, ...``; ``mis_*`` and ``tis_clip``/``tis_clip_low`` aliases), verl's keys
        (``rollout_is, rollout_is_threshold, rollout_rs, bypass_mode, loss_type, ...``) and the mode keys
        (``mode``, ``loss_type``, ``use_rollout_logprobs``, ``use_rollout_correction``).  Unknown keys raise
        ``ValueError`` naming the key and the closest valid one.  See :mod:`slime_rc.config.layers`.
        """
        from slime_rc.config.layers import Layer, resolve
        return resolve([Layer.from_mapping(d)]).config

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rs"] = [dict(option=c.option, upper=c.upper, lower=c.lower) for c in self.rs]
        return d

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "RolloutCorrectionConfig":
        """The preset ``name`` of :mod:`slime_rc.config.presets` with keyword overrides for its thresholds; each preset is
        also a classmethod of its own name (``RolloutCorrectionConfig.decoupled_seq_is(threshold=3.0)``)."""
        from slime_rc.config.layers import preset_layer, resolve
        try:
            return resolve([preset_layer(name, **overrides)]).config
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("preset ") else f"preset {name!r}: {e}") from None

