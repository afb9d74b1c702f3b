"""slime's mis keys read off slime's ``args``, with the defaults and meaning of slime's example ``mis.py``.

slime sets every key of ``--custom-config-path`` (its YAML) as an attribute of ``args`` after parsing, and our
parser hook (:func:`slime_rc.add_rollout_correction_arguments`) puts the flags slime lacks on the same attributes.
So the adapters read one place: ``args.use_tis``, ``args.tis_level``, ... (missing or None = unset).  Which keys
those are, their ``mis_*`` aliases and the default rules below come from the knob table
(:mod:`slime_rc.config.knobs`: the knobs with a ``mis`` rule).

The keys are resolved by THE resolution every entry point uses (:func:`hook_config` ->
:func:`slime_rc.config.resolution.resolve`, whose stack applies slime's rules to slime's keys), and
:func:`slime_settings` is that config as slime's example reads it.  The rules (slime's
``examples/train_infer_mismatch_helper/mis.py`` at 624b824a8):

* ``tis_level`` token, ``tis_mode`` truncate, ``tis_upper_bound`` 2.0 (mis.py has no default and fails on None;
  2.0 is its YAML's value and slime's ``--tis-clip`` default), ``tis_lower_bound`` ``1 / tis_upper_bound``;
* ``rs_level`` defaults to ``tis_level``; unset RS bounds are the IS bounds (``rs_lower_bound`` ->
  ``tis_lower_bound`` -> ``1 / tis_upper_bound``; ``rs_upper_bound`` -> ``tis_upper_bound``);
* bounds must satisfy lower < upper where a band is used (mis.py asserts it).

Where slime's example silently does less than what the user wrote, slime-rc does what was written and warns once
per process, naming slime's behaviour (:data:`DEFECTS`).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from slime_rc.config._text import did_you_mean
from slime_rc.config.knobs import ENGINE_KEYS, IS_LEVELS, IS_MODES, KNOB, KNOBS, MIS_KEYS, dest_of
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.config.slime_attributes import SLIME_LEVEL

LEVELS = IS_LEVELS  # slime's example knows the three k1 levels for IS and RS alike
MODES = IS_MODES

# slime's mis keys (the knobs of slime_rc.config.knobs that slime's example mis.py reads), by how slime reads them,
# and the older ``mis_*`` spellings of the first ones (slime's earlier mis.yaml).
BOOL_KEYS = tuple(k for k in MIS_KEYS if KNOB[k].boolean)
# rs_level: slime's example takes the IS levels only; the other RS options go to slime-rc's engine (beyond_slime)
CHOICE_KEYS = {k: (KNOB[k].choices or LEVELS) for k in MIS_KEYS if KNOB[k].choices or k == "rs_level"}
NUMBER_KEYS = tuple(k for k in MIS_KEYS if k not in BOOL_KEYS and k not in CHOICE_KEYS)
ALIASES = {k.mis_alias: k.key for k in KNOBS if k.mis_alias}

DEFECTS = {
    "rs_without_tis": (
        "use_rs=true without use_tis: slime's example mis.py returns before rejection sampling, so it silently "
        "rejects nothing. slime-rc applies the rejection you configured (IS weights stay 1)."),
    "veto_without_rs": (
        "rs_veto_threshold={veto} without use_rs: slime's example mis.py ignores the veto unless use_rs is true. "
        "slime-rc applies the veto (a sequence with a token ratio below the threshold is rejected)."),
    "geometric_batch_normalize": (
        "tis_batch_normalize with tis_level=geometric: slime's example mis.py raises 'Unsupported tis_level: "
        "geometric'. slime-rc normalizes the geometric weights as it does sequence weights (the mean over the "
        "micro-batch's sequences of each sequence's weight)."),
}
_warned: set = set()


def warn_once(key: str, **fmt: Any) -> None:
    """Warn about slime-rc differing from slime on purpose, once per process and difference."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn("slime-rc: " + DEFECTS[key].format(**fmt), UserWarning, stacklevel=3)


@dataclass(frozen=True)
class SlimeMisSettings:
    """slime's mis settings with every default resolved.  Bounds are on ``r = pi_train / pi_rollout``."""

    use_tis: bool = False
    use_rs: bool = False
    tis_level: str = "token"
    tis_mode: str = "truncate"
    tis_lower: float = 0.5
    tis_upper: float = 2.0
    rs_level: str = "token"
    rs_lower: float = 0.5
    rs_upper: float = 2.0
    veto: Optional[float] = None
    batch_normalize: bool = False

    @property
    def corrects(self) -> bool:
        """Anything beyond metrics: IS weights, rejection or veto (slime-rc also runs RS/veto without IS)."""
        return self.use_tis or self.use_rs or self.veto is not None


def get(args: Any, name: str) -> Any:
    """``args.name`` (``args[name]`` for a mapping); None when missing."""
    return args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)


def raw_mis_keys(args: Any) -> Tuple[Tuple[str, Any], ...]:
    """The mis keys ``args`` sets (not None), ``mis_*`` aliases folded into slime's names; a conflict between an
    alias and its key is an error."""
    out: Dict[str, Any] = {}
    for key in MIS_KEYS:
        value = get(args, key)
        if value is not None:
            out[key] = _scalar(key, value)
    for alias, key in ALIASES.items():
        value = get(args, alias)
        if value is None:
            continue
        value = _scalar(alias, value)
        if key in out and out[key] != value:
            raise ValueError(f"both {key}={out[key]!r} and its older spelling {alias}={value!r} are set; keep "
                             f"{key}.")
        out[key] = value
    return tuple(sorted(out.items()))


def _scalar(key: str, value: Any) -> Any:
    if not isinstance(value, (bool, int, float, str)):
        raise ValueError(f"{key}={value!r} must be a single value (a number, true/false or a name), not a "
                         f"{type(value).__name__}.")
    return value


def _number(key: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, str):
        raise ValueError(
            f"{key}={value!r} is a string, not a number. slime reads its YAML with yaml.safe_load, which keeps "
            f"quoted values and exponents without a dot (1e-4) as strings: write {key}: 2.0 or 1.0e-4.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key}={value!r} must be a number (e.g. {key}: 2.0).")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{key}={value!r} must be a finite number > 0.")
    return value


def hook_config(args: Any) -> RolloutCorrectionConfig:
    """The config slime's ``args`` describe for the TIS hook: ``args.rollout_correction_config`` when slime-rc resolved
    one at launch, else THE resolution (:func:`slime_rc.config.resolution.resolve`, the one every entry point uses)
    of ``--rollout-correction-preset`` (lowest) and slime's keys on ``args`` -- slime's args hold its flags and the
    ``--custom-config-path`` YAML's keys alike, as attributes: one layer.  Cached: slime calls once per micro-batch."""
    launch = get(args, "rollout_correction_config")
    if launch is not None:
        return launch
    items = raw_mis_keys(args) + tuple(sorted(engine_keys(args).items()))
    try:
        return _resolve(get(args, "rollout_correction_preset"), items)
    except TypeError:  # an unhashable value: resolve without the cache (it reports the bad value)
        return _resolve.__wrapped__(get(args, "rollout_correction_preset"), items)


def _check_values(d: Dict[str, Any]) -> None:
    """slime's example reads its keys as they are: a quoted number or a quoted boolean (which the resolution would
    read as a number or a truthy value) is an error here, named as slime's YAML loader produces it."""
    for key in BOOL_KEYS:
        if key in d and not isinstance(d[key], bool):
            raise ValueError(f"{key}={d[key]!r} must be true or false (a YAML boolean, unquoted).")
    for key, choices in CHOICE_KEYS.items():
        if key in d and key != "rs_level" and d[key] not in choices:
            raise ValueError(f"{key}={d[key]!r} is not one of {', '.join(choices)} (slime's mis.py levels/modes)."
                             + did_you_mean(d[key], choices))
    for key in NUMBER_KEYS:
        if key in d and not (key in ("rs_upper_bound", "rs_lower_bound") and isinstance(d[key], str)
                             and ("_" in d[key] or "," in d[key])):
            _number(key, d[key])


@functools.lru_cache(maxsize=64)
def _resolve(preset: Optional[str], items: Tuple[Tuple[str, Any], ...]) -> RolloutCorrectionConfig:
    from slime_rc.config.resolution import SLIME_KINDS, Layer, preset_layer, resolve

    _check_values(dict(items))
    layers = [preset_layer(preset)] if preset else []
    layers.append(Layer.from_mapping(dict(items), kind="yaml", where="slime's args"))
    return resolve(layers, SLIME_KINDS).config


# slime's level names for the options slime's example knows (its levels and the k1 options that stand for them)
_SLIME_LEVEL = {**SLIME_LEVEL, **{level: level for level in LEVELS}}


def slime_settings(config: RolloutCorrectionConfig) -> Optional[SlimeMisSettings]:
    """``config`` as slime's example reads it (its keys with every default resolved), or None when slime's example
    cannot express it (several rejection criteria, a k2/k3 one): the projection of THE resolved config, so the TIS
    hook, the custom loss and ``slime-rc config`` give one meaning to each key."""
    rs = config.rs
    if len(rs) > 1 or (rs and rs[0].option not in _SLIME_LEVEL):
        return None
    is_level = config.is_level or "token"
    criterion = rs[0] if rs else None
    return SlimeMisSettings(
        use_tis=config.is_enabled, use_rs=bool(rs), tis_level=is_level, tis_mode=config.is_mode,
        tis_lower=config.is_lower, tis_upper=config.is_upper_bound,
        rs_level=_SLIME_LEVEL[criterion.option] if criterion else is_level,
        rs_lower=criterion.lower if criterion else config.is_lower,
        rs_upper=criterion.upper if criterion else config.is_upper_bound,
        veto=config.veto_threshold, batch_normalize=config.is_batch_normalize)


def settings_of(args: Any) -> SlimeMisSettings:
    """The settings slime's example applies for ``args`` (:func:`slime_settings` of :func:`hook_config`)."""
    settings = slime_settings(hook_config(args))
    if settings is None:
        raise ValueError(f"{beyond_slime(args) or 'these rejection settings'} go beyond slime's example mis.py; "
                         f"custom_tis.mis runs slime-rc's engine for them")
    return settings


def mis_settings(args: Any) -> SlimeMisSettings:
    """The settings slime's example would apply for ``args``, validated; warns once about the differences slime-rc
    makes on purpose (:data:`DEFECTS`)."""
    s = settings_of(args)
    for key in defects(s):
        warn_once(key, veto=s.veto)
    return s


def defects(s: SlimeMisSettings) -> Tuple[str, ...]:
    """The keys of :data:`DEFECTS` where ``s`` makes slime-rc differ from slime's example on purpose."""
    out = []
    if s.use_rs and not s.use_tis:
        out.append("rs_without_tis")
    if s.veto is not None and not s.use_rs:
        out.append("veto_without_rs")
    if s.use_tis and s.batch_normalize and s.tis_level == "geometric":
        out.append("geometric_batch_normalize")
    return tuple(out)


# How an unset key is filled (for ``slime-rc config --slime``).
DEFAULT_RULES = {k.key: k.mis for k in KNOBS if k.mis is not None}
# slime's key -> the attribute of SlimeMisSettings that holds its resolved value
FIELD_OF_KEY = {"use_tis": "use_tis", "use_rs": "use_rs", "tis_level": "tis_level", "tis_mode": "tis_mode",
                "tis_upper_bound": "tis_upper", "tis_lower_bound": "tis_lower", "rs_level": "rs_level",
                "rs_lower_bound": "rs_lower", "rs_upper_bound": "rs_upper", "rs_veto_threshold": "veto",
                "tis_batch_normalize": "batch_normalize"}


def explain(args: Any) -> Tuple[SlimeMisSettings, Tuple[Tuple[str, Any, str], ...], Tuple[str, ...]]:
    """``(settings, rows (key, value, 'set' or the default rule), defect messages)`` for ``args``, without
    warning."""
    raw = dict(raw_mis_keys(args))
    s = settings_of(args)
    rows = tuple((key, getattr(s, FIELD_OF_KEY[key]), "set" if key in raw else f"default: {DEFAULT_RULES[key]}")
                 for key in MIS_KEYS)
    return s, rows, tuple("slime-rc: " + DEFECTS[k].format(veto=s.veto) for k in defects(s))


def engine_keys(args) -> dict:
    """slime-rc's own engine settings ``args`` carries (its flags' attributes or YAML keys, see docs/usage.md):
    setting -> value.  slime's example has no such settings."""
    names = {**{key: key for key in ENGINE_KEYS},  # the YAML key, and the attribute of its flag
             **{dest_of(KNOB[key].flag): key for key in ENGINE_KEYS if KNOB[key].flag}}
    return {key: get(args, name) for name, key in names.items() if get(args, name) is not None}


def beyond_slime(args) -> Optional[str]:
    """Why slime's example cannot express ``args``'s settings (None when it can): then ``custom_tis.mis`` runs
    slime-rc's engine instead."""
    if get(args, "rollout_correction_preset"):
        return f"--rollout-correction-preset {get(args, 'rollout_correction_preset')}"
    rs_level = get(args, "rs_level")
    if rs_level is not None and rs_level not in LEVELS:
        return f"rs_level={rs_level!r}"
    for key in ("rs_upper_bound", "rs_lower_bound"):
        value = get(args, key)
        if isinstance(value, str) and ("_" in value or "," in value):
            return f"{key}={value!r}"
    engine = engine_keys(args)
    if engine:
        return ", ".join(f"{k}={v!r}" for k, v in engine.items())
    return None
