"""Layers of settings, stacked by precedence, and the config they build.

Every source (flags, a YAML file, a preset, a dictionary) is first translated into the same flat *settings* (the
keys of :data:`slime_rc.config.knobs.SETTINGS`) as one :class:`Layer`.  Layers are stacked lowest precedence
first — default < preset < YAML < flag (:data:`KINDS`; inside slime, which copies the YAML onto ``args`` after
parsing: default < preset < flag < YAML, :data:`SLIME_KINDS`) — and a :class:`Stack` merges them key by key,
remembers which layer set each key, refuses settings that a higher layer made dead (``--tis-level`` while IS is off)
and builds the config with the class it is given (:meth:`Stack.build`): this module sits below the config record
(:mod:`slime_rc.config.schema` builds ``RolloutCorrectionConfig.from_dict`` / ``.preset`` with it) and below
:func:`slime_rc.config.resolution.resolve`, which adds who set each field and the notes a user should see.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from slime_rc.config._text import did_you_mean
from slime_rc.config.knobs import (BOOLEAN_SPELLINGS, FIELD_SETTINGS, KNOB, KNOBS, PLAIN, SHARED_SPELLINGS,
                                   SPELLINGS, VERL, dest_of)
from slime_rc.config.presets import PRESETS
from slime_rc.config.rejection import RS_OPTIONS, parse_rejection_criteria, rs_options

# Precedence of the layer kinds, lowest first: this project's launches (slime-rc train, Megatron's
# extra_args_provider, plain argparse) ...
KINDS = ("default", "preset", "yaml", "flag", "dict")
# ... and slime's, where the --custom-config-path YAML is copied onto args AFTER parsing, so it beats the flags.
SLIME_KINDS = ("default", "preset", "flag", "yaml", "dict")


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
        """Translate one mapping in any accepted spelling (:data:`slime_rc.config.knobs.SPELLINGS`).  ``name``
        turns an input key into what the user wrote (a flag spelling for flags).  Raises ``ValueError`` on unknown
        keys and on two spellings of one setting that disagree or come from different dialects."""
        layer = cls(kind, where)
        dialect_of: Dict[str, Tuple[str, str]] = {}
        for key, value in d.items():
            if key not in SPELLINGS:
                raise ValueError(
                    f"unknown rollout-correction key {name(key)!r}{' in ' + where if where else ''}."
                    + did_you_mean(key, SPELLINGS) + f" Valid keys: {', '.join(sorted(SPELLINGS))}.")
            dialect, translate = SPELLINGS[key]
            if key in BOOLEAN_SPELLINGS and not (isinstance(value, bool) or value is None):
                # "false" (a string) would be truthy and switch the feature on
                raise ValueError(f"{name(key)}={value!r}{' in ' + where if where else ''} must be true or false.")
            for setting, v in translate(value).items():
                if setting in layer.values:
                    other, other_dialect = dialect_of[setting]
                    if layer.values[setting] != v:
                        raise ValueError(f"both {name(other)!r} and {name(key)!r} are set "
                                         f"({d[other]!r} vs {value!r}); keep one.")
                    if dialect != other_dialect and not {key, other} & SHARED_SPELLINGS:
                        raise ValueError(f"{name(other)!r} and {name(key)!r} both set the same thing in two "
                                         f"spellings; use one spelling.")
                layer.values[setting] = v
                layer.names[setting] = name(key)
                layer.raw[setting] = value
                dialect_of[setting] = (key, dialect)
        return layer


def preset_layer(name: str, **overrides: Any) -> Layer:
    """The settings of preset ``name`` (keyword overrides for its thresholds) as a layer."""
    if name not in PRESETS:
        raise ValueError(f"rollout-correction preset {name!r} does not exist." + did_you_mean(name, PRESETS)
                         + f" Presets: {', '.join(PRESETS)}.")
    try:
        values = PRESETS[name](**overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"preset {name!r}: {e}") from None
    return Layer.from_mapping(values, kind="preset", where=name)


# the parts of the rejection criteria written as text (the rs knob holds criteria as objects)
_RS_PARTS = tuple(k.key for k in KNOBS if k.field == "rs" and k.needs == "use_rs")


class Stack:
    """The merged settings and, per setting, the layer that set it; ``order``: the layer kinds, lowest first."""

    def __init__(self, layers: List[Layer], order: Tuple[str, ...] = KINDS):
        self.order = order
        self.values: Dict[str, Any] = {}
        self.owner: Dict[str, Layer] = {}
        self.notes: List[str] = []  # settings that cannot act, turned dead at or above their own layer (build)
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

    # ---- building the config ----------------------------------------------------------------------------------
    def build(self, config_class: type) -> Any:
        """The validated ``config_class`` (:class:`~slime_rc.RolloutCorrectionConfig`) of the merged settings;
        ``ValueError`` naming the setting (and the layer that set it) on a mistake."""
        self._refuse_dead_settings()
        try:  # a mistake of the settings (_config_kwargs) or of the config's values names who set it
            config = config_class(**self._config_kwargs())  # an unset mode is derived: decoupled iff corrects
        except ValueError as e:
            raise ValueError(self.where(str(e))) from None
        wanted = self.get("use_rollout_correction")
        if wanted is not None and bool(wanted) != config.corrects:
            raise ValueError(
                f"{self.given('use_rollout_correction')} but "
                + (f"{config.correction_summary()} is configured" if config.corrects else "nothing is configured "
                   "to correct")
                + ": " + ("add IS (use_tis) and/or RS (use_rs), or a preset, or drop it." if wanted else
                          "turn IS/RS/veto off (use_tis / use_rs false, no veto), or drop it."))
        self._dead_in_config(config)
        return config

    def _refuse_dead_settings(self) -> None:
        """A setting is dead when its switch is off and it was set above the layer that turned the switch off.  On
        one command line a setting beside its own switch turned off is a contradiction too (in a file it is a
        switch toggled off with its settings left in place)."""
        for knob in KNOBS:
            switch = knob.needs
            if switch is None or knob.key not in self.values or self.get(switch):
                continue
            same_line = self.owner[knob.key].kind == "flag" and self.rank(switch) == self.rank(knob.key)
            if self.rank(knob.key) > self.rank(switch) or same_line:
                what, verb = {"use_tis": ("IS weights", "have"), "use_rs": ("rejection sampling", "has")}[switch]
                how = f"it is off ({self.given(switch)})" if switch in self.owner else "nothing enables it"
                raise ValueError(
                    f"{self.given(knob.key)} given without {switch}: {what} {verb} no effect because {how}. "
                    f"Add {_switch_name(self.owner[knob.key], switch)} to enable {what}, or drop it.")

    def _dead_in_config(self, config: Any) -> None:
        """Settings that cannot act in the built ``config`` (``--eps-clip`` with the REINFORCE loss, the quantile
        resolution with IS off, ``rejected_in_denominator`` where nothing can reject), by the rule of
        :meth:`_refuse_dead_settings`: refused (``ValueError``) when given above the highest layer of the settings
        that make it dead, or on the same command line; otherwise (left in a file or preset beside them, or made
        dead by a higher layer) a note in :attr:`notes` (``slime-rc config`` and the launch print it)."""
        self.notes = []
        for key, causes, why, fix in _dead_settings(config):
            if key not in self.values:
                continue
            layer = self.owner[key]
            top = max((self.rank(c) for c in causes if c in self.owner), default=0)
            message = (f"{self.given(key)} has no effect: {why(self)}. Drop it, or {fix(_Spell(layer))}.")
            if self.rank(key) > top or (layer.kind == "flag" and self.rank(key) == top):
                raise ValueError(message)
            self.notes.append(message)

    def cause(self, key: str) -> str:
        """``(--rollout-correction-loss-type='reinforce')``: who set ``key``, for messages; '' when unset."""
        return f" ({self.given(key)})" if key in self.owner else ""

    def _config_kwargs(self) -> Dict[str, Any]:
        kwargs: Dict[str, Any] = {k.field: self.get(k.key) for k in PLAIN if self.get(k.key) is not None}
        if self.get("use_tis"):
            kwargs["is_level"] = self.get("tis_level") or KNOB["tis_level"].default
        lower = kwargs.pop("is_lower_bound", None)
        mode = self.get("tis_mode") or KNOB["tis_mode"].default
        if lower is not None and lower == 0:
            # slime's --tis-clip-low 0 means "no lower clip": exactly truncate mode
            if mode != "truncate":
                raise ValueError(f"{self.given('tis_lower_bound')} means no lower bound, which only "
                                 f"is_mode='truncate' has; give a positive lower bound for mode "
                                 f"{self.get('tis_mode')!r}, or leave it unset (1/upper).")
        elif lower is not None:
            kwargs["is_lower_bound"] = lower
            if mode == "truncate" and "tis_mode" not in self.values and self._spelled_as("tis_lower_bound",
                                                                                          "tis_clip_low"):
                # slime's --tis-clip-low without a mode clamps from below (its vanilla_tis_function clamps to
                # [tis_clip_low, tis_clip]); slime's tis_lower_bound key without a mode is unused, as in slime's
                # example mis.py (truncate is its default mode: "for truncate mode, it will not be used")
                kwargs["is_mode"] = "clip"
        if self.get("use_rs"):
            kwargs["rs"] = self._rejection()
        if self.get("use_rollout_logprobs"):
            kwargs["mode"] = "bypass"
        return kwargs

    def _rejection(self) -> tuple:
        """The RS criteria: as given (the ``rs`` knob, objects), or parsed once from the text settings."""
        parts = [k for k in _RS_PARTS if k in self.values]
        if "rs" in self.values:
            above = [k for k in parts if self.rank(k) > self.rank("rs")]
            if above:
                raise ValueError(
                    f"{self.given(above[0])} would change the rejection criteria given as objects "
                    f"({self.owner['rs'].label('rs')}); give the rejection one way: the criteria (rs) or "
                    f"rs_level / rs_upper_bound / rs_lower_bound.")
            return self.get("rs")
        # slime's rule (its example mis.py): an unset rs_level is tis_level
        levels = self.get("rs_level") or self.get("tis_level") or KNOB["rs_level"].default
        rs_upper, rs_lower = self.get("rs_upper_bound"), self.get("rs_lower_bound")
        if "_" in str(rs_upper) and self.rank("rs_lower_bound") < self.rank("rs_upper_bound"):
            rs_lower = None  # a 'lower_upper' band given above replaces a lower bound from below
        rs_upper, rs_lower = self._rs_band_defaults(levels, rs_upper, rs_lower)
        return parse_rejection_criteria(levels, rs_upper, rs_lower)

    def _rs_band_defaults(self, levels: str, rs_upper: Any, rs_lower: Any) -> Tuple[Any, Any]:
        """slime's rule for its keys (its example ``mis.py``): unset RS bounds of the ratio (k1) options are the IS
        bounds -- ``rs_upper_bound`` is ``tis_upper_bound`` (2.0 unset), ``rs_lower_bound`` is ``tis_lower_bound``,
        else ``1 / tis_upper_bound`` -- whether IS is on or not.  A threshold from a preset or in verl's spelling
        (``rollout_rs_threshold``) keeps the project's ``1 / upper`` for its unset lower bound."""
        if not all(RS_OPTIONS[o][2] == "k1" for o in rs_options(levels)):
            return rs_upper, rs_lower
        is_upper = self.get("tis_upper_bound") or KNOB["tis_upper_bound"].default
        is_lower = self.get("tis_lower_bound") or 1.0 / is_upper  # 0 is slime's "no lower clip": 1/upper then
        if rs_upper is None:
            return is_upper, is_lower if rs_lower is None else rs_lower
        if rs_lower is None and "_" not in str(rs_upper) and self._slime_spelled("rs_upper_bound"):
            return rs_upper, is_lower
        return rs_upper, rs_lower

    def _given_as(self, key: str) -> str:
        """The key ``key`` was given under (a flag read as its attribute); '' when unset."""
        layer = self.owner.get(key)
        name = layer.names.get(key, key) if layer is not None else ""
        return dest_of(name) if name.startswith("--") else name

    def _spelled_as(self, key: str, spelling: str) -> bool:
        """Whether ``key`` was given under ``spelling`` (a key, or its flag)."""
        return self._given_as(key) == spelling

    def _slime_spelled(self, key: str) -> bool:
        """Whether ``key`` was given under slime's spelling (a slime key, its flag or ``mis_*`` alias), not by a
        preset or in verl's spelling."""
        layer = self.owner.get(key)
        return (layer is not None and layer.kind != "preset"
                and SPELLINGS.get(self._given_as(key), ("",))[0] != VERL)

    # ---- telling the user ------------------------------------------------------------------------------------
    def sources(self, config: Any) -> Dict[str, str]:
        """Config field -> the user-facing name of the highest layer's setting it was built from."""
        sources = {}
        for f in fields(config):  # a key given as null (slime's mis.yaml: rs_lower_bound: null) set nothing
            keys = [k for k in FIELD_SETTINGS.get(f.name, ()) if k in self.owner and self.values.get(k) is not None]
            top = max(reversed(keys), key=self.rank) if keys else None  # ties: the detail (tis_level) over its switch
            sources[f.name] = self.owner[top].label(top) if top else "default"
        if config.mode != "bypass" and "use_rollout_correction" not in self.owner:
            # decoupled vs standard follows from whether anything corrects
            sources["mode"] = "derived: decoupled iff IS/RS/veto is set" + (
                f" (not bypass: {sources['mode']})" if sources["mode"] != "default" else "")
        if "tis_mode" not in self.owner and "tis_lower_bound" in self.owner and config.is_mode == "clip":
            sources["is_mode"] = f"derived: clip, from the lower bound {sources['is_lower_bound']}"
        return sources

    def where(self, message: str) -> str:
        """Append which user-facing setting produced each config field a validation message names."""
        hits = []
        for fname, keys in FIELD_SETTINGS.items():
            hits += [self.owner[k].label(k) for k in keys
                     if k in self.owner and (f"{fname}=" in message or f"{k}=" in message)]
        hits = list(dict.fromkeys(hits))
        return message + (f" (set by {', '.join(hits)})" if hits else "")


class _Spell:
    """A setting's name in the spelling of ``layer``: its flag on the command line, its key elsewhere."""

    def __init__(self, layer: Layer):
        self.layer, self.flags = layer, layer.kind == "flag"

    def switch(self, key: str) -> str:
        return _switch_name(self.layer, key)

    def __call__(self, key: str, value: Optional[str] = None) -> str:
        if self.flags:
            return KNOB[key].flag + (f" {value}" if value is not None else "")
        return key + (f": {value}" if value is not None else "")


# The settings that decide whether a token can be rejected (rs, veto, IS mask mode, on_nonfinite='reject' where the
# engine runs), and those that decide whether the engine runs at all.
_REJECT_CAUSES = ("use_tis", "tis_mode", "use_rs", "rs", "rs_veto_threshold", "on_nonfinite",
                  "use_rollout_correction", "get_mismatch_metrics")


def _can_reject(config: Any) -> bool:
    """Whether any token can leave the loss: RS criteria, a veto, IS in mask mode, or on_nonfinite='reject' where
    the correction engine runs (something corrected, or get_mismatch_metrics; else the loss keeps every loss token:
    slime_rc.losses.compute_policy_loss)."""
    return config.rejects and (config.corrects or config.get_mismatch_metrics)


def _dead_settings(config: Any):
    """``(key, the settings that make it dead, why(stack), fix(spell))`` for every setting that cannot act in
    ``config`` (whether it was given is the stack's business)."""
    out = []
    if config.loss_type == "reinforce":
        for key in ("eps_clip", "eps_clip_high", "eps_clip_c"):
            out.append((key, ("loss_type",),
                        lambda s: f"the REINFORCE loss{s.cause('loss_type')} has no PPO ratio to clip (it is "
                                  f"-stopgrad(w) * log pi_theta * A)",
                        lambda sp: f"use the PPO loss ({sp('loss_type', 'ppo_clip')}) for the clip to act"))
    if not config.is_enabled:
        out.append(("quantile_bins_per_octave", ("use_tis",),
                    lambda s: f"it sets the resolution of the IS quantile metrics (rollout_is_p25 ...), which are "
                              f"computed only with IS weights on, and IS is off{s.cause('use_tis')}",
                    lambda sp: f"add {sp.switch('use_tis')} to enable IS weights"))
    if not _can_reject(config):
        out.append(("rejected_in_denominator", _REJECT_CAUSES,
                    lambda s: "no token can be rejected here: no RS criteria, no veto, IS mode is not mask, and "
                              + ("on_nonfinite='reject' rejects only where the correction engine runs (nothing is "
                                 "corrected and get_mismatch_metrics is off)" if config.on_nonfinite == "reject"
                                 else "on_nonfinite is not 'reject'"),
                    lambda sp: f"add a rejection for it to act on: RS ({sp.switch('use_rs')}"
                               f" with {sp('rs_level')} / {sp('rs_upper_bound')}), a veto "
                               f"({sp('rs_veto_threshold')}), IS mask mode ({sp('tis_mode', 'mask')}) or "
                               f"{sp('on_nonfinite', 'reject')} with a correction"))
    return out


def _switch_name(layer: Layer, switch: str) -> str:
    """How to turn ``switch`` on in the spelling the user wrote ``layer`` in."""
    if layer.kind == "flag":
        return KNOB[switch].flag
    if any(SPELLINGS.get(name, ("",))[0] == VERL for name in layer.names.values()):
        return {"use_tis": "rollout_is: token (or sequence)", "use_rs": "rollout_rs: <option>"}[switch]
    return f"{switch}: true"
