"""The one place where flags, YAML files, presets and dictionaries become a :class:`RolloutCorrectionConfig`.

Every source is first translated into the same flat *settings*: slime's key set plus the mode and engine keys
(:data:`SETTINGS`).  Sources are stacked as :class:`Layer` objects, lowest precedence first —
default < preset < YAML < flag (:data:`KINDS`; inside slime, which copies the YAML onto ``args`` after
parsing: default < preset < flag < YAML, :data:`SLIME_KINDS`) — and :func:`resolve` merges them key by key,
remembers which layer set each key, refuses settings that a higher layer made dead (``--tis-level`` while IS is
off) and builds the config.  :func:`near_miss` tells a typo of one of these keys from another plugin's key.

Accepted spellings of one mapping (:meth:`Layer.from_mapping`), in three families that must not be mixed for
the same setting:

* slime: ``use_tis, use_rs, tis_level, tis_mode, tis_lower_bound, tis_upper_bound, tis_batch_normalize,
  rs_level, rs_lower_bound, rs_upper_bound, rs_veto_threshold``; ``mis_*`` (slime's mis.yaml) and
  ``tis_clip`` / ``tis_clip_low`` (slime's older flags) as aliases; the mode keys ``use_rollout_logprobs``,
  ``use_rollout_correction``, ``get_mismatch_metrics``, ``loss_type`` and the engine keys
  ``safety_bound, on_nonfinite, rejected_in_denominator, quantile_bins_per_octave``; and the attributes the
  ``--rollout-correction-*`` flags set (``rollout_correction_loss_type``, ``rollout_correction_safety_bound``,
  ...), the spelling for a YAML slime copies onto ``args`` (where ``loss_type`` is slime's own key);
* this project's field names: ``is_level, is_mode, is_upper_bound, is_lower_bound, is_batch_normalize, rs,
  veto_threshold, mode``;
* verl: ``rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold,
  rollout_rs_threshold_lower, rollout_token_veto_threshold, bypass_mode, use_policy_gradient, loss_type`` and
  the older framework keys ``rollout_is_level, rollout_is_mode, rollout_is_threshold_lower,
  rollout_is_veto_threshold`` (with ``rollout_is: true|false``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from slime_rc.config.schema import RejectionCriterion, RolloutCorrectionConfig, parse_rejection_criteria, split_threshold
from slime_rc.config.presets import PRESETS

# The flat settings every source is translated to.
IS_KEYS = ("tis_level", "tis_mode", "tis_upper_bound", "tis_lower_bound", "tis_batch_normalize")
RS_KEYS = ("rs_level", "rs_upper_bound", "rs_lower_bound")
ENGINE_KEYS = ("safety_bound", "on_nonfinite", "rejected_in_denominator", "quantile_bins_per_octave")
MODE_KEYS = ("use_rollout_logprobs", "use_rollout_correction", "loss_type", "get_mismatch_metrics")
LOSS_KEYS = ("eps_clip", "eps_clip_high", "eps_clip_c", "loss_agg")
SETTINGS = ("use_tis",) + IS_KEYS + ("use_rs",) + RS_KEYS + ("rs_veto_threshold",) + MODE_KEYS + ENGINE_KEYS \
    + LOSS_KEYS

BOOL_SETTINGS = {"use_tis", "use_rs", "tis_batch_normalize", "use_rollout_logprobs", "use_rollout_correction",
                 "get_mismatch_metrics", "rejected_in_denominator", "calculate_per_token_loss"}

# Precedence of the layer kinds, lowest first: this project's launches (slime-rc train, Megatron's
# extra_args_provider, plain argparse) ...
KINDS = ("default", "preset", "yaml", "flag", "dict")
# ... and slime's, where the --custom-config-path YAML is copied onto args AFTER parsing, so it beats the flags.
SLIME_KINDS = ("default", "preset", "flag", "yaml", "dict")


def _closest(name: str, choices) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of neighbours."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def near_miss(key: str, known: Iterable[str]) -> Optional[str]:
    """The key of ``known`` that ``key`` is probably a typo of, or ``None``.

    ``None`` when ``key`` is itself in ``known`` or is not close to any of them.  Close means a small edit
    distance (insertions, deletions, substitutions, swapped neighbours; case and ``-`` for ``_`` ignored):
    none for keys of up to 4 characters (only ``RS`` -> ``rs``), at most 1 edit up to 11 characters
    (``use_tiss`` -> ``use_tis``, ``tis_levle`` -> ``tis_level``), at most 2 beyond (``rs_veto_treshold`` ->
    ``rs_veto_threshold``, ``tis_uper_bound`` -> ``tis_upper_bound``).  Ties go to the first closest key in
    ``known``'s order.

    The cutoff is tight on purpose: slime copies ONE ``--custom-config-path`` YAML onto ``args`` for every
    plugin, so a YAML read by slime-rc also holds slime's, Megatron-LM's and other plugins' keys
    (``use_kl_loss``, ``kl_coef``, ``eps_clip``, ``use_opsm``, ``loss_type``, ``advantage_estimator``, ...),
    which must be ignored, not flagged.  tests/config/test_arguments_in_slime.py checks every arg name of slime's parser (and
    Megatron-LM's ``test_mode``, 2 edits from ``tis_mode``: why 9-11 characters allow only 1 edit).
    """
    known = list(known)
    if key in known:
        return None
    norm = key.lower().replace("-", "_")
    limit = 0 if len(norm) <= 4 else 1 if len(norm) <= 11 else 2
    best, best_d = None, limit + 1
    for k in known:
        cand = k.lower().replace("-", "_")
        if abs(len(cand) - len(norm)) >= best_d:
            continue
        d = _edit_distance(norm, cand)
        if d < best_d:
            best, best_d = k, d
    return best


# ---- spellings -> settings ----------------------------------------------------------------------------------
def _is_threshold(value):
    """verl's ``rollout_is_threshold``: a number caps the weight; ``"lo_hi"`` is IcePop (mask mode)."""
    if value is None:
        return {}
    upper, lower = split_threshold("rollout_is_threshold", value)
    return {"tis_upper_bound": upper} if lower is None else {"tis_mode": "mask", "tis_lower_bound": lower,
                                                             "tis_upper_bound": upper}


def _rollout_is(value):
    """verl: a level or null; the older framework: true (apply weights) / false (metrics only)."""
    if isinstance(value, bool):
        return {"use_tis": True} if value else {"use_tis": False, "get_mismatch_metrics": True}
    return {"use_tis": False} if value is None else {"use_tis": True, "tis_level": value}


def _rs_criteria(value):
    """This project's ``rs`` field (criteria or their ``to_dict`` mappings) as slime RS settings."""
    if isinstance(value, str):
        raise ValueError(f"rs={value!r}: give rejection options as strings through the slime keys use_rs / "
                         f"rs_level / rs_upper_bound, or build criteria with parse_rejection_criteria.")
    crits = [RejectionCriterion(**c) if isinstance(c, Mapping) else c for c in (value or ())]
    if not crits:
        return {"use_rs": False}
    for c in crits:
        if not isinstance(c, RejectionCriterion):
            raise ValueError(f"rs entries must be RejectionCriterion or {{option, upper, lower}} mappings, got {c!r}")
    thresholds = [f"{c.lower!r}_{c.upper!r}" if c.statistic == "k1" else repr(c.upper) for c in crits]
    return {"use_rs": True, "rs_level": ",".join(c.option for c in crits), "rs_upper_bound": ",".join(thresholds)}


def _mode(value):
    if value == "bypass":
        return {"use_rollout_logprobs": True}
    if value in ("standard", "decoupled"):
        return {"use_rollout_logprobs": False, "use_rollout_correction": value == "decoupled"}
    if value is None:
        return {}
    raise ValueError(f"mode={value!r} is not an operating mode; use one of standard, decoupled, bypass."
                     + _closest(str(value), ("standard", "decoupled", "bypass")))


def _rename(key: str) -> Callable[[Any], dict]:
    return lambda value: {key: value}


# input key -> (family, translator).  Families must not be mixed for one setting.
SPELLINGS: Dict[str, Tuple[str, Callable[[Any], dict]]] = {
    **{k: ("slime", _rename(k)) for k in SETTINGS},
    **{f"mis_{k}": ("slime", _rename(f"tis_{k}")) for k in ("level", "mode", "lower_bound", "upper_bound",
                                                             "batch_normalize")},
    "mis_veto_threshold": ("slime", _rename("rs_veto_threshold")),
    "tis_clip": ("slime", _rename("tis_upper_bound")),
    "tis_clip_low": ("slime", _rename("tis_lower_bound")),
    "calculate_per_token_loss": ("slime", lambda v: {"loss_agg": "token_mean" if v else "sample_mean"}),
    # the attributes the --rollout-correction-* flags set, so that a YAML slime copies onto args sets what the
    # flag sets (in a slime YAML, loss_type is slime's own key)
    "rollout_correction_loss_type": ("slime", _rename("loss_type")),
    "rollout_correction_rejected_in_denominator": ("slime", _rename("rejected_in_denominator")),
    "rollout_correction_safety_bound": ("slime", _rename("safety_bound")),
    "rollout_correction_on_nonfinite": ("slime", _rename("on_nonfinite")),
    "rollout_correction_quantile_bins": ("slime", _rename("quantile_bins_per_octave")),
    "is_level": ("own", lambda v: {"use_tis": v is not None, **({"tis_level": v} if v is not None else {})}),
    "is_mode": ("own", _rename("tis_mode")),
    "is_upper_bound": ("own", _rename("tis_upper_bound")),
    "is_lower_bound": ("own", _rename("tis_lower_bound")),
    "is_batch_normalize": ("own", _rename("tis_batch_normalize")),
    "rs": ("own", _rs_criteria),
    "veto_threshold": ("own", _rename("rs_veto_threshold")),
    "mode": ("own", _mode),
    "rollout_is": ("verl", _rollout_is),
    "rollout_is_threshold": ("verl", _is_threshold),
    "rollout_is_batch_normalize": ("verl", _rename("tis_batch_normalize")),
    "rollout_rs": ("verl", lambda v: {"use_rs": v is not None, **({"rs_level": v} if v is not None else {})}),
    "rollout_rs_threshold": ("verl", _rename("rs_upper_bound")),
    "rollout_rs_threshold_lower": ("verl", _rename("rs_lower_bound")),
    "rollout_token_veto_threshold": ("verl", _rename("rs_veto_threshold")),
    "bypass_mode": ("verl", _rename("use_rollout_logprobs")),
    "use_policy_gradient": ("verl", lambda v: {"loss_type": "reinforce" if v else "ppo_clip"}),
    "rollout_is_level": ("verl", _rename("tis_level")),
    "rollout_is_mode": ("verl", _rename("tis_mode")),
    "rollout_is_threshold_lower": ("verl", _rename("tis_lower_bound")),
    "rollout_is_veto_threshold": ("verl", _rename("rs_veto_threshold")),
}
# Spellings that are the same word in two families (loss_type is slime's and verl's).
_SHARED = {"loss_type"}


@dataclass
class Layer:
    """One source of settings: ``values`` (setting -> value) and, per setting, the user-facing name it was given
    under (``--tis-upper-bound``, ``rollout_is_threshold``, ...) for messages and ``slime-rc config``."""

    kind: str
    where: str = ""
    values: Dict[str, Any] = field(default_factory=dict)
    names: Dict[str, str] = field(default_factory=dict)
    raw: Dict[str, Any] = field(default_factory=dict)  # setting -> the value as the user wrote it
    ignored: List[str] = field(default_factory=list)  # keys of a slime YAML that are not slime-rc's

    @property
    def rank(self) -> int:
        return KINDS.index(self.kind)

    def label(self, key: str) -> str:
        name = self.names.get(key, key)
        if self.kind == "flag":
            return name
        if self.kind == "yaml":
            return f"{name} in {self.where}"
        if self.kind == "preset":
            return f"preset {self.where}"
        return name

    def given(self, key: str) -> str:
        """``--tis-level='token'`` / ``rollout_is='token' in f.yaml``: what the user wrote, for messages."""
        name = self.names.get(key, key)
        text = f"{name}={self.raw.get(key, self.values.get(key))!r}"
        return {"yaml": f"{text} in {self.where}", "preset": f"{text} of preset {self.where}"}.get(self.kind, text)

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], kind: str = "dict", where: str = "",
                     name: Callable[[str], str] = lambda k: k) -> "Layer":
        """Translate one mapping in any accepted spelling.  ``name`` turns an input key into what the user
        wrote (a flag spelling for flags).  Raises ``ValueError`` on unknown keys and on two spellings of one
        setting that disagree or come from different families."""
        layer = cls(kind, where)
        family_of: Dict[str, Tuple[str, str]] = {}
        for key, value in d.items():
            if key not in SPELLINGS:
                raise ValueError(
                    f"unknown rollout-correction key {name(key)!r}{' in ' + where if where else ''}."
                    + _closest(key, SPELLINGS) + f" Valid keys: {', '.join(sorted(SPELLINGS))}.")
            family, translate = SPELLINGS[key]
            if isinstance(value, bool) or value is None:
                pass
            elif key in BOOL_SETTINGS or key in ("bypass_mode", "use_policy_gradient", "rollout_is_batch_normalize",
                                                 "is_batch_normalize", "rollout_correction_rejected_in_denominator"):
                # "false" (a string) would be truthy and switch the feature on
                raise ValueError(f"{name(key)}={value!r}{' in ' + where if where else ''} must be true or false.")
            for setting, v in translate(value).items():
                if setting in layer.values:
                    other, other_family = family_of[setting]
                    if layer.values[setting] != v:
                        raise ValueError(f"both {name(other)!r} and {name(key)!r} are set "
                                         f"({d[other]!r} vs {value!r}); keep one.")
                    if family != other_family and not {key, other} & _SHARED:
                        raise ValueError(f"{name(other)!r} and {name(key)!r} both set the same thing in two "
                                         f"spellings; use one spelling.")
                layer.values[setting] = v
                layer.names[setting] = name(key)
                layer.raw[setting] = value
                family_of[setting] = (key, family)
        return layer


def preset_layer(name: str, **overrides: Any) -> Layer:
    """The settings of preset ``name`` (keyword overrides for its thresholds) as a layer."""
    if name not in PRESETS:
        raise ValueError(f"rollout-correction preset {name!r} does not exist." + _closest(name, PRESETS)
                         + f" Presets: {', '.join(PRESETS)}.")
    try:
        values = PRESETS[name](**overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"preset {name!r}: {e}") from None
    return Layer.from_mapping(values, kind="preset", where=name)


@dataclass
class Resolution:
    """What :func:`resolve` returns: the config, who set each config field, and notes a user should see."""

    config: RolloutCorrectionConfig
    sources: Dict[str, str]
    notes: List[str]


# config field <- the settings it is built from
FIELD_SETTINGS = {
    "is_level": ("use_tis", "tis_level"), "is_mode": ("tis_mode",), "is_upper_bound": ("tis_upper_bound",),
    "is_lower_bound": ("tis_lower_bound",), "is_batch_normalize": ("tis_batch_normalize",),
    "rs": ("use_rs",) + RS_KEYS, "veto_threshold": ("rs_veto_threshold",),
    "mode": ("use_rollout_logprobs", "use_rollout_correction"), "loss_type": ("loss_type",),
    "get_mismatch_metrics": ("get_mismatch_metrics",),
    **{k: (k,) for k in ENGINE_KEYS + LOSS_KEYS},
}


class _Merged:
    """The merged settings and, per setting, the layer that set it; ``order``: the layer kinds, lowest first."""

    def __init__(self, layers: List[Layer], order: Tuple[str, ...] = KINDS):
        self.order = order
        self.values: Dict[str, Any] = {}
        self.owner: Dict[str, Layer] = {}
        for layer in sorted(layers, key=self.layer_rank):
            for key, value in layer.values.items():
                self.values[key], self.owner[key] = value, layer

    def layer_rank(self, layer: Layer) -> int:
        return self.order.index(layer.kind)

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def rank(self, key: str) -> int:
        return self.layer_rank(self.owner[key]) if key in self.owner else 0

    def given(self, key: str) -> str:
        return self.owner[key].given(key)


def resolve(layers: List[Layer], order: Tuple[str, ...] = KINDS) -> Resolution:
    """Merge ``layers`` and build the validated config.  ``order``: the precedence of the layer kinds, lowest
    first (:data:`KINDS`; :data:`SLIME_KINDS` for the resolution slime applies: YAML over flags)."""
    m = _Merged(layers, order)
    _refuse_dead_settings(m)
    try:
        config = RolloutCorrectionConfig(**_config_kwargs(m))  # an unset mode is derived: decoupled iff corrects
    except ValueError as e:
        raise ValueError(_where(str(e), m.owner)) from None
    wanted = m.get("use_rollout_correction")
    if wanted is not None and bool(wanted) != config.corrects:
        raise ValueError(
            f"{m.given('use_rollout_correction')} but "
            + (f"{config.correction_summary()} is configured" if config.corrects else "nothing is configured to "
               "correct")
            + ": " + ("add IS (use_tis) and/or RS (use_rs), or a preset, or drop it." if wanted else
                      "turn IS/RS/veto off (use_tis / use_rs false, no veto), or drop it."))
    notes = []
    if config.is_enabled and not config.is_weights_applied:
        notes.append(
            f"IS weights are diagnostics only: in bypass mode with loss_type='ppo_clip' the PPO ratio "
            f"pi_theta/pi_rollout already is the importance weight, so the {config.is_level}-level weights are "
            f"reported in the metrics but not multiplied into the loss"
            + (" (mask-mode rejection still applies)" if config.is_mode == "mask" else "")
            + ". For explicit IS weights use loss_type='reinforce' (--rollout-correction-loss-type reinforce).")
    return Resolution(config, _sources(m, config), notes)


def _refuse_dead_settings(m: _Merged) -> None:
    """A setting is dead when its switch is off and it was set above the layer that turned the switch off.  On one
    command line a setting beside its own switch turned off is a contradiction too (in a file it is a switch
    toggled off with its settings left in place)."""
    for switch, keys, what, verb in (("use_tis", IS_KEYS, "IS weights", "have"),
                                     ("use_rs", RS_KEYS, "rejection sampling", "has")):
        if m.get(switch):
            continue
        for key in keys:
            if key not in m.values:
                continue
            same_line = m.owner[key].kind == "flag" and m.rank(switch) == m.rank(key)
            if m.rank(key) > m.rank(switch) or same_line:
                how = f"it is off ({m.given(switch)})" if switch in m.owner else "nothing enables it"
                raise ValueError(
                    f"{m.given(key)} given without {switch}: {what} {verb} no effect because {how}. "
                    f"Add {_switch_name(m.owner[key], switch)} to enable {what}, or drop it.")


def _config_kwargs(m: _Merged) -> Dict[str, Any]:
    kwargs: Dict[str, Any] = {}
    if m.get("use_tis"):
        kwargs["is_level"] = m.get("tis_level") or "token"
    for key, dst in (("tis_mode", "is_mode"), ("tis_upper_bound", "is_upper_bound"),
                     ("tis_batch_normalize", "is_batch_normalize"), ("rs_veto_threshold", "veto_threshold"),
                     ("loss_type", "loss_type"), ("get_mismatch_metrics", "get_mismatch_metrics"),
                     *((k, k) for k in ENGINE_KEYS + LOSS_KEYS)):
        if m.get(key) is not None:
            kwargs[dst] = m.get(key)
    lower = m.get("tis_lower_bound")
    if lower is not None and lower == 0:
        # slime's --tis-clip-low 0 means "no lower clip": exactly truncate mode
        if (m.get("tis_mode") or "truncate") != "truncate":
            raise ValueError(f"{m.given('tis_lower_bound')} means no lower bound, which only is_mode='truncate' "
                             f"has; give a positive lower bound for mode {m.get('tis_mode')!r}, or leave it unset "
                             f"(1/upper).")
    elif lower is not None:
        kwargs["is_lower_bound"] = lower
    if m.get("use_rs"):
        rs_lower = m.get("rs_lower_bound")
        if "_" in str(m.get("rs_upper_bound")) and m.rank("rs_lower_bound") < m.rank("rs_upper_bound"):
            rs_lower = None  # a 'lower_upper' band given above replaces a lower bound from below
        try:
            kwargs["rs"] = parse_rejection_criteria(m.get("rs_level") or "token", m.get("rs_upper_bound"), rs_lower)
        except ValueError as e:
            raise ValueError(_where(str(e), m.owner)) from None
    if m.get("use_rollout_logprobs"):
        kwargs["mode"] = "bypass"
    return kwargs


def _sources(m: _Merged, config: RolloutCorrectionConfig) -> Dict[str, str]:
    """Config field -> the user-facing name of the highest layer's setting it was built from."""
    sources = {}
    for f in fields(RolloutCorrectionConfig):
        keys = [k for k in FIELD_SETTINGS.get(f.name, ()) if k in m.owner]
        top = max(reversed(keys), key=m.rank) if keys else None  # ties: the detail (tis_level) over its switch
        sources[f.name] = m.owner[top].label(top) if top else "default"
    if config.mode != "bypass" and "use_rollout_correction" not in m.owner:
        # decoupled vs standard follows from whether anything corrects
        sources["mode"] = "derived: decoupled iff IS/RS/veto is set" + (
            f" (not bypass: {sources['mode']})" if sources["mode"] != "default" else "")
    return sources


def _switch_name(layer: Layer, switch: str) -> str:
    """How to turn ``switch`` on in the spelling the user wrote ``layer`` in."""
    if layer.kind == "flag":
        return "--" + switch.replace("_", "-")
    if any(name.startswith("rollout_") for name in layer.names.values()):  # verl spelling
        return {"use_tis": "rollout_is: token (or sequence)", "use_rs": "rollout_rs: <option>"}[switch]
    return f"{switch}: true"


def _where(message: str, owner: Dict[str, Layer]) -> str:
    """Append which user-facing setting produced each config field a validation message names."""
    hits = []
    for fname, keys in FIELD_SETTINGS.items():
        hits += [owner[k].label(k) for k in keys if k in owner and (f"{fname}=" in message or f"{k}=" in message)]
    hits = list(dict.fromkeys(hits))
    return message + (f" (set by {', '.join(hits)})" if hits else "")
