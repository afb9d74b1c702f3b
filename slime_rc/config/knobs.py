"""The knob table: every rollout-correction setting and every flag, declared once (:data:`KNOBS`, :data:`LAUNCH_FLAGS`).

Where are flags defined?  Here.  One :class:`Knob` row per setting holds its settings key (slime's name: the YAML
key and the ``args`` attribute), the :class:`~slime_rc.RolloutCorrectionConfig` field it builds, its flag, help,
default, how a value is read and checked (``boolean`` / ``choices`` / ``parse``), the switch it needs, its
spellings in each dialect (slime's older names, this project's field names, verl's keys) and what slime itself
makes of it (slime's own definition of a flag it shares with us; slime's example ``mis.py`` default).  The flags
that are not settings (preset, YAML path, TIS function) are :data:`LAUNCH_FLAGS`.

Everything else is derived from these two tables, below and where it is used:

* :data:`SETTINGS`, :data:`FIELD_SETTINGS`, :data:`FIELD_DEFAULTS`: the flat settings every source is translated
  to, the config field each one builds and the config's defaults (:mod:`slime_rc.config.stack`,
  :mod:`slime_rc.config.schema`);
* :data:`SPELLINGS`: every key a mapping may use, in three dialects that must not be mixed for one setting
  (:meth:`slime_rc.config.stack.Layer.from_mapping`, :mod:`slime_rc.config.yaml_config`):

  - slime: the settings keys; slime's older ``mis_*`` (its earlier ``mis.yaml``) and ``tis_clip`` /
    ``tis_clip_low`` / ``calculate_per_token_loss`` (its flags); the attribute of each ``--rollout-correction-*``
    flag (``rollout_correction_loss_type``, ...), so that a YAML slime copies onto ``args`` sets what the flag sets;
  - own: this project's config field names (``is_level``, ``is_mode``, ``rs``, ``veto_threshold``, ``mode``, ...);
  - verl: ``rollout_is``, ``rollout_is_threshold``, ``rollout_rs``, ``bypass_mode``, ``loss_type``, ... and the
    older framework's ``rollout_is_level``, ``rollout_is_mode``, ... (``rollout_is: true|false``);
* :data:`KNOB_FLAGS` + :data:`LAUNCH_FLAGS`: the argparse flags (:mod:`slime_rc.config.arguments`: ``FLAGS``,
  ``OTHER_FLAGS``, ``SLIME_OWNED_FLAGS``), ``slime-rc config``'s rows (:mod:`slime_rc.cli`) and the flag table of
  docs/usage.md (tests/test_docs.py);
* slime's keys and defaults (:mod:`slime_rc.slime.settings`: ``MIS_KEYS``, ``ALIASES``, ``DEFAULT_RULES``, ...) and
  the attributes slime's ``args`` carries (:mod:`slime_rc.config.slime_attributes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from slime_rc.config._text import did_you_mean, not_a_threshold, parse_number, split_threshold
from slime_rc.config.presets import PRESETS
from slime_rc.config.rejection import RejectionCriterion, rs_options
from slime_rc.plugins import TIS_CONTRACT, load_function

# ---- the values a setting takes --------------------------------------------------------------------------------
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "clip", "mask")
NONFINITE_POLICIES = ("error", "reject")
# How the loss uses the correction (rollout_corr_math.md §3): who plays pi_old, and which policy loss.
MODES = ("standard", "decoupled", "bypass")
LOSS_TYPES = ("ppo_clip", "reinforce")
# How per-token losses become one number: mean over each sample's tokens then over samples (slime's default), or
# one mean over all tokens of the batch (slime's --calculate-per-token-loss).
LOSS_AGGREGATIONS = ("sample_mean", "token_mean")

SLIME, OWN, VERL = "slime", "own", "verl"  # the dialects of a mapping's keys


# ---- reading a flag's text: (setting name, text) -> value; ValueError with the one message for the mistake ------
number = parse_number


def integer(what: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{what}={text!r} is not an integer") from None


def thresholds(what: str, text: str) -> str:
    """A threshold, or a comma list of them (one per rs_level option); kept as text."""
    try:
        for part in text.split(","):
            split_threshold(what, part)
    except ValueError:
        raise ValueError(not_a_threshold(what, text)) from None
    return text


def options(what: str, text: str) -> str:
    """An RS option or a comma list of them (:func:`slime_rc.config.rejection.rs_options`); kept as text."""
    rs_options(text)
    return text


# ---- reading a launch flag's text: text -> value (checked while parsing: a bad path fails the launch) -----------
def existing_file(text: str) -> str:
    path = os.path.abspath(text)
    if not os.path.isfile(path):
        raise ValueError(f"no such file: {path}")
    return text


def tis_function(text: str) -> str:
    load_function(text, contract=TIS_CONTRACT)
    return text


# ---- spellings whose value becomes more than one setting ------------------------------------------------------
def _is_level(value):
    """This project's ``is_level``: a level switches IS on, None off."""
    return {"use_tis": value is not None, **({"tis_level": value} if value is not None else {})}


def _rollout_is(value):
    """verl: a level or null; the older framework: true (apply weights) / false (metrics only)."""
    if isinstance(value, bool):
        return {"use_tis": True} if value else {"use_tis": False, "get_mismatch_metrics": True}
    return _is_level(value)


def _is_threshold(value):
    """verl's ``rollout_is_threshold``: a number caps the weight; ``"lo_hi"`` is IcePop (mask mode)."""
    if value is None:
        return {}
    upper, lower = split_threshold("rollout_is_threshold", value)
    return {"tis_upper_bound": upper} if lower is None else {"tis_mode": "mask", "tis_lower_bound": lower,
                                                             "tis_upper_bound": upper}


def _rollout_rs(value):
    return {"use_rs": value is not None, **({"rs_level": value} if value is not None else {})}


def _rs_criteria(value):
    """This project's ``rs`` field: :class:`RejectionCriterion` objects (or their ``to_dict`` mappings), kept as
    objects."""
    if isinstance(value, str):
        raise ValueError(f"rs={value!r}: give rejection options as strings through the slime keys use_rs / "
                         f"rs_level / rs_upper_bound, or build criteria with parse_rejection_criteria.")
    crits = tuple(RejectionCriterion(**c) if isinstance(c, Mapping) else c for c in (value or ()))
    for c in crits:
        if not isinstance(c, RejectionCriterion):
            raise ValueError(f"rs entries must be RejectionCriterion or {{option, upper, lower}} mappings, got {c!r}")
    return {"use_rs": True, "rs": crits} if crits else {"use_rs": False}


def _mode(value):
    if value == "bypass":
        return {"use_rollout_logprobs": True}
    if value in ("standard", "decoupled"):
        return {"use_rollout_logprobs": False, "use_rollout_correction": value == "decoupled"}
    if value is None:
        return {}
    raise ValueError(f"mode={value!r} is not an operating mode; use one of standard, decoupled, bypass."
                     + did_you_mean(value, MODES))


def _policy_gradient(value):
    return {"loss_type": "reinforce" if value else "ppo_clip"}


def _per_token_loss(value):
    return {"loss_agg": "token_mean" if value else "sample_mean"}


# ---- the records ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spelling:
    """Another key that sets a knob, in a mapping (a YAML file, a dict, slime's ``args``) and, with ``flag``, on the
    command line (the flag's attribute is ``name``)."""

    name: str
    dialect: str = SLIME
    to: Optional[Callable[[Any], Dict[str, Any]]] = None  # value -> settings; None: the knob's setting, as it is
    boolean: bool = False  # takes true/false only (a plain rename of a boolean knob does anyway)
    flag: Optional[str] = None
    help: str = ""
    slime_defines: Optional[Dict[str, Any]] = None  # slime's own definition of ``flag``: slime owns that flag


@dataclass(frozen=True)
class Knob:
    """One setting.  ``help`` may say ``{default}`` (the default as help shows it: ``shown_default`` or ``default``)."""

    key: str  # the settings key: slime's YAML key and args attribute
    field: str  # the RolloutCorrectionConfig field it builds
    group: str  # "is", "rs", "mode", "engine" (slime-rc's own engine settings) or "loss" (the policy loss)
    help: str = ""
    flag: Optional[str] = None
    default: Any = None  # the value when no layer sets it
    shown_default: Optional[str] = None  # how help shows a default that is derived ("1/upper")
    boolean: bool = False  # true/false; a flag with a --no- form
    choices: Tuple[str, ...] = ()
    parse: Optional[Callable[[str, str], Any]] = None  # (setting name, a flag's text) -> value
    needs: Optional[str] = None  # the switch without which the setting is dead (refused)
    spellings: Tuple[Spelling, ...] = ()
    dialect: str = SLIME  # the dialect of ``key`` itself
    to: Optional[Callable[[Any], Dict[str, Any]]] = None  # how ``key`` itself translates (None: as it is)
    slime_defines: Optional[Dict[str, Any]] = None  # slime's own definition of ``flag``: slime owns that flag
    mis: Optional[str] = None  # one of slime's mis keys: what slime's example mis.py makes of it unset
    mis_alias: Optional[str] = None  # its spelling in slime's earlier mis.yaml

    @property
    def all_spellings(self) -> Tuple[Spelling, ...]:
        """Its own key, its flag's attribute, its config field name (when the field is this knob alone), its
        ``mis_*`` alias and the declared spellings."""
        out = [Spelling(self.key, self.dialect, self.to)]
        if self.flag and dest_of(self.flag) != self.key:
            out.append(Spelling(dest_of(self.flag)))
        if self.field != self.key and FIELD_SETTINGS[self.field] == (self.key,):
            out.append(Spelling(self.field, OWN))
        if self.mis_alias:
            out.append(Spelling(self.mis_alias))
        return tuple(out) + self.spellings


@dataclass(frozen=True)
class Flag:
    """One command-line flag: a knob's, a spelling's (``--tis-clip``) or a launch option's (``knob`` None)."""

    flag: str
    help: str
    sets: Optional[str] = None  # the key its value is given under (the knob's key, or a spelling such as tis_clip)
    knob: Optional[str] = None  # the setting it sets
    boolean: bool = False
    choices: Tuple[str, ...] = ()
    parse: Optional[Callable[[str], Any]] = None  # text -> value; ValueError with the message
    metavar: Optional[str] = None
    slime_defines: Optional[Dict[str, Any]] = None

    @property
    def dest(self) -> str:
        return dest_of(self.flag)


def dest_of(flag: str) -> str:
    """The attribute argparse stores ``flag`` under (``--tis-clip`` -> ``tis_clip``)."""
    return flag[2:].replace("-", "_")


_STORE_TRUE = dict(action="store_true", default=False)

# ---- THE TABLE ----------------------------------------------------------------------------------------------------
# Order matters twice: a field built from several settings names the last one given in the top layer as its source
# (tis_level over use_tis), and it is the order of --help.
KNOBS: Tuple[Knob, ...] = (
    # IS weights
    Knob("use_tis", "is_level", "is", "enable importance-sampling weights", "--use-tis", default=False,
         boolean=True, slime_defines=_STORE_TRUE, mis="false",
         spellings=(Spelling("rollout_is", VERL, _rollout_is),)),
    Knob("tis_level", "is_level", "is", "token, sequence or geometric (default {default})", "--tis-level",
         default="token", choices=IS_LEVELS, needs="use_tis", mis="token", mis_alias="mis_level",
         spellings=(Spelling("is_level", OWN, _is_level), Spelling("rollout_is_level", VERL))),
    Knob("tis_mode", "is_mode", "is", "truncate (cap above), clip (clamp both), mask (reject outside)",
         "--tis-mode", default="truncate", choices=IS_MODES, needs="use_tis", mis="truncate", mis_alias="mis_mode",
         spellings=(Spelling("rollout_is_mode", VERL),)),
    Knob("tis_upper_bound", "is_upper_bound", "is", "upper IS bound (default {default})", "--tis-upper-bound",
         default=2.0, parse=number, needs="use_tis", mis="2.0", mis_alias="mis_upper_bound",
         spellings=(Spelling("tis_clip", flag="--tis-clip", help="slime's older spelling of --tis-upper-bound",
                             slime_defines=dict(type=float, default=2.0)),
                    Spelling("rollout_is_threshold", VERL, _is_threshold))),
    Knob("tis_lower_bound", "is_lower_bound", "is", "lower IS bound (default {default})", "--tis-lower-bound",
         shown_default="1/upper", parse=number, needs="use_tis", mis="1 / tis_upper_bound",
         mis_alias="mis_lower_bound",
         spellings=(Spelling("tis_clip_low", flag="--tis-clip-low", slime_defines=dict(type=float, default=0),
                             help="slime's older spelling of --tis-lower-bound (0 = no lower bound, truncate mode; without --tis-mode a positive value means clip mode)"),
                    Spelling("rollout_is_threshold_lower", VERL))),
    Knob("tis_batch_normalize", "is_batch_normalize", "is", "normalize IS weights to mean 1 over the global batch",
         "--tis-batch-normalize", default=False, boolean=True, needs="use_tis", mis="false",
         mis_alias="mis_batch_normalize", spellings=(Spelling("rollout_is_batch_normalize", VERL),)),
    # rejection sampling: the switch, the three parts of the criteria as text, or the criteria themselves
    Knob("use_rs", "rs", "rs", "enable rejection sampling", "--use-rs", default=False, boolean=True, mis="false",
         spellings=(Spelling("rollout_rs", VERL, _rollout_rs),)),
    Knob("rs_level", "rs", "rs", "token, sequence, geometric, or a comma list of token_k1..seq_max_k3 options (ANDed)",
         "--rs-level", default="token", shown_default="the IS level", parse=options, needs="use_rs", mis="tis_level"),
    Knob("rs_upper_bound", "rs", "rs",
         "RS threshold: a number, 'lower_upper', or a comma list, one per --rs-level option", "--rs-upper-bound",
         parse=thresholds, needs="use_rs", mis="tis_upper_bound", spellings=(Spelling("rollout_rs_threshold", VERL),)),
    Knob("rs_lower_bound", "rs", "rs", "lower ratio bound of the k1 RS options (default {default})",
         "--rs-lower-bound", shown_default="the IS lower bound", parse=number, needs="use_rs", mis="tis_lower_bound",
         spellings=(Spelling("rollout_rs_threshold_lower", VERL),)),
    Knob("rs", "rs", "rs", dialect=OWN, to=_rs_criteria),
    Knob("rs_veto_threshold", "veto_threshold", "rs", "reject a sequence holding a token with ratio below this "
         "(e.g. 1e-4)", "--rs-veto-threshold", parse=number, mis="none", mis_alias="mis_veto_threshold",
         spellings=(Spelling("rollout_token_veto_threshold", VERL), Spelling("rollout_is_veto_threshold", VERL))),
    # operating mode
    Knob("use_rollout_logprobs", "mode", "mode",
         "bypass mode: use the rollout log-probs as pi_old (skips the recompute pass)", "--use-rollout-logprobs",
         default=False, boolean=True, slime_defines=_STORE_TRUE,
         spellings=(Spelling("mode", OWN, _mode), Spelling("bypass_mode", VERL))),
    Knob("use_rollout_correction", "mode", "mode",
         "apply the IS/RS settings to the loss (implied by --use-tis / --use-rs)", "--use-rollout-correction",
         boolean=True),
    Knob("loss_type", "loss_type", "mode", "ppo_clip (default) or reinforce (bypass only: REINFORCE with IS weights)",
         "--rollout-correction-loss-type", default="ppo_clip", choices=LOSS_TYPES,
         spellings=(Spelling("loss_type", VERL), Spelling("use_policy_gradient", VERL, _policy_gradient,
                                                          boolean=True))),
    Knob("get_mismatch_metrics", "get_mismatch_metrics", "mode",
         "compute the mismatch metrics even when nothing is corrected", "--get-mismatch-metrics", default=False,
         boolean=True, slime_defines=_STORE_TRUE),
    # slime-rc's own engine settings (slime has none of them)
    Knob("safety_bound", "safety_bound", "engine", "clamp log-ratios to +-this before exp (default {default})",
         "--rollout-correction-safety-bound", default=20.0, parse=number),
    Knob("on_nonfinite", "on_nonfinite", "engine", "NaN/inf log-probs: error (default) or reject the sequence",
         "--rollout-correction-on-nonfinite", default="error", choices=NONFINITE_POLICIES),
    Knob("rejected_in_denominator", "rejected_in_denominator", "engine",
         "keep rejected tokens in the loss denominator (default: no)", "--rollout-correction-rejected-in-denominator",
         default=False, boolean=True),
    Knob("quantile_bins_per_octave", "quantile_bins_per_octave", "engine",
         "resolution of the IS quantile metrics (default {default} per octave)", "--rollout-correction-quantile-bins",
         default=128, parse=integer),
    # the policy loss
    Knob("eps_clip", "eps_clip", "loss", "PPO clip range: the ratio is clipped to [1 - eps, 1 + eps_high] "
         "(default {default})", "--eps-clip", default=0.2, parse=number, slime_defines=dict(type=float, default=0.2)),
    Knob("eps_clip_high", "eps_clip_high", "loss", "upper PPO clip range (default --eps-clip; e.g. 0.28 for "
         "clip-higher)", "--eps-clip-high", parse=number, slime_defines=dict(type=float, default=None)),
    Knob("eps_clip_c", "eps_clip_c", "loss", "dual-clip bound (> 1) for negative advantages (default off)",
         "--eps-clip-c", parse=number, slime_defines=dict(type=float, default=None)),
    Knob("loss_agg", "loss_agg", "loss", default="sample_mean", choices=LOSS_AGGREGATIONS,
         spellings=(Spelling("calculate_per_token_loss", to=_per_token_loss, boolean=True,
                             flag="--calculate-per-token-loss", slime_defines=_STORE_TRUE,
                             help="one token mean over the batch (token_mean) instead of slime's default per-sample "
                                  "mean then mean (sample_mean)"),)),
)

# The flags that are not settings.
LAUNCH_FLAGS: Tuple[Flag, ...] = (
    Flag("--rollout-correction-preset", "start from a preset (see docs/usage.md); flags and YAML override it",
         choices=tuple(PRESETS), metavar="NAME"),
    Flag("--custom-config-path", "YAML with the slime keys or a verl algorithm.rollout_correction block",
         parse=existing_file, metavar="YAML",
         slime_defines=dict(type=str, default=None)),
    Flag("--custom-tis-function-path", "TIS function: pkg.mod.fn, pkg.mod:fn, file.py:fn, or mis / tis / icepop",
         parse=tis_function, metavar="SPEC",
         slime_defines=dict(type=str, default=None)),
)

# ---- derived views ------------------------------------------------------------------------------------------------
KNOB: Dict[str, Knob] = {k.key: k for k in KNOBS}
SETTINGS: Tuple[str, ...] = tuple(KNOB)
ENGINE_KEYS: Tuple[str, ...] = tuple(k.key for k in KNOBS if k.group == "engine")
MIS_KEYS: Tuple[str, ...] = tuple(k.key for k in KNOBS if k.mis is not None)  # the keys slime's example mis.py reads

# config field <- the settings it is built from, in table order
FIELD_SETTINGS: Dict[str, Tuple[str, ...]] = {}
for _k in KNOBS:
    FIELD_SETTINGS[_k.field] = FIELD_SETTINGS.get(_k.field, ()) + (_k.key,)
# the knobs that are their field alone (the field is the setting renamed); the others are built in
# slime_rc.config.stack: is_level (use_tis, tis_level), rs (use_rs and the criteria), mode (the two mode switches)
PLAIN: Tuple[Knob, ...] = tuple(k for k in KNOBS if FIELD_SETTINGS[k.field] == (k.key,))
# the config's defaults: a plain field's knob default; the built fields are off (is_level, rs) or derived (mode)
FIELD_DEFAULTS: Dict[str, Any] = {**{k.field: k.default for k in PLAIN}, "is_level": None, "rs": (), "mode": None}


def _rename(key: str) -> Callable[[Any], Dict[str, Any]]:
    return lambda value: {key: value}


def _spellings():
    table: Dict[str, Tuple[str, Callable[[Any], Dict[str, Any]]]] = {}
    boolean, shared = set(), set()
    for knob in KNOBS:
        for s in knob.all_spellings:
            if s.name in table:  # the same word in two dialects (loss_type is slime's and verl's)
                shared.add(s.name)
                continue
            table[s.name] = (s.dialect, s.to or _rename(knob.key))
            if s.boolean or (s.to is None and knob.boolean):
                boolean.add(s.name)
    # slime's keys first, then the other dialects (the order near-misses are looked up in)
    order = {SLIME: 0, OWN: 1, VERL: 2}
    return dict(sorted(table.items(), key=lambda kv: order[kv[1][0]])), frozenset(boolean), frozenset(shared)


# every key a mapping may use -> (dialect, translator to settings); the keys that take only true/false; the keys
# that are the same word in two dialects
SPELLINGS, BOOLEAN_SPELLINGS, SHARED_SPELLINGS = _spellings()
# the keys whose value may be a 'lower_upper' band (text with one underscore, e.g. '0.5_2.0'): the RS threshold
# (rs_upper_bound, verl's rollout_rs_threshold) and verl's rollout_is_threshold; every other number takes no band
# (slime_rc.config._text.refuse_band)
BAND_SPELLINGS = frozenset(s.name for k in KNOBS for s in k.all_spellings
                           if k.parse is thresholds or s.to is _is_threshold)


def _shown(knob: Knob) -> str:
    return knob.shown_default if knob.shown_default is not None else str(knob.default)


def _knob_flags():
    out = []
    for knob in KNOBS:
        reads = dict(boolean=knob.boolean, choices=knob.choices)
        if knob.flag:
            out.append(Flag(knob.flag, knob.help.format(default=_shown(knob)), sets=knob.key, knob=knob.key,
                            parse=knob.parse and (lambda text, p=knob.parse, w=knob.key: p(w, text)),
                            slime_defines=knob.slime_defines, **reads))
        for s in knob.spellings:
            if s.flag:
                flag = Flag(s.flag, s.help, sets=s.name, knob=knob.key, slime_defines=s.slime_defines,
                            parse=knob.parse and (lambda text, p=knob.parse, w=s.name: p(w, text)), **reads)
                out.append(replace(flag, boolean=True, choices=(), parse=None) if s.boolean else flag)
    return tuple(out)


# the flags of the settings, in table order (a spelling's flag after its knob's)
KNOB_FLAGS: Tuple[Flag, ...] = _knob_flags()
ALL_FLAGS: Tuple[Flag, ...] = KNOB_FLAGS + LAUNCH_FLAGS
