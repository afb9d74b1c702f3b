"""Command-line flags: ``add_rollout_correction_arguments(parser)`` and ``config_from_args(args)``.

The flags are declared in the knob table (:mod:`slime_rc.config.knobs`): slime's (``--use-tis``, ``--tis-*``,
``--rs-*``, ``--use-rollout-logprobs``, ...) plus the settings the engine needs; :data:`FLAGS`, :data:`OTHER_FLAGS`
and :data:`SLIME_OWNED_FLAGS` are that table in argparse's shape.  They add to any argparse parser, Megatron's
included (use it as ``extra_args_provider``: it returns the parser).  Every flag defaults to None, so
``config_from_args`` can tell what was given on the command line and apply the precedence **flag > YAML
(--custom-config-path) > preset (--rollout-correction-preset) > default** through
:func:`slime_rc.config.resolution.resolve`.  ``--custom-tis-function-path`` and
``--custom-config-path`` are checked while parsing (a bad path fails the launch, not the first step).

Inside slime (``slime.utils.arguments.parse_args(add_custom_arguments=add_rollout_correction_arguments)``) the
hook runs BEFORE slime adds its own flags, so it leaves out the flags slime (or Megatron-LM) owns
(:data:`SLIME_OWNED_FLAGS`: slime defines them next, with slime's meaning) and adds only the ones slime lacks, on
the attributes slime's YAML keys use (``args.use_rs``, ``args.tis_level``, ...).  It tells it runs inside slime
from the calling frames (:func:`called_by_slime`); ``slime=True`` / ``slime=False`` forces either way.  slime then
copies the YAML onto ``args`` after parsing, so there the YAML beats the flags: ``resolve_args(args,
slime=True)`` applies that precedence (``slime-rc config --slime`` prints it).  Between the two, slime's validation
fills some attributes we read from others (:data:`SLIME_FILLS`: ``eps_clip_high`` from ``eps_clip``); with
``slime=True`` such a filled value counts as slime's default, not as a flag the user gave.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

from slime_rc.config._text import band_refusal
from slime_rc.config.knobs import ALL_FLAGS, BAND_SPELLINGS, KNOB, KNOB_FLAGS, LAUNCH_FLAGS, Flag, dest_of, integer, \
    number
from slime_rc.config.resolution import KINDS, SLIME_KINDS, Layer, Resolution, preset_layer, resolve
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.config.yaml_config import load_yaml_layer
from slime_rc.plugins import TIS_CONTRACT, load_function


def _argparse_kwargs(flag: Flag) -> Dict[str, Any]:
    """A flag of the knob table as argparse keywords (the default, None, is added where it is defined)."""
    if flag.boolean:
        return dict(action=argparse.BooleanOptionalAction)
    kwargs: Dict[str, Any] = dict(metavar=flag.metavar) if flag.metavar else {}
    if flag.choices:
        kwargs["choices"] = flag.choices
    if flag.parse:
        kwargs["type"] = _type(flag.parse, flag.dest, flag if takes_one_number(flag) else None)
    return kwargs


def takes_one_number(flag: Flag) -> bool:
    """Whether ``flag`` takes one number, so that text with an underscore given to it is a ``'lower_upper'`` band
    it refuses (:func:`band_hint`); the band flags (``--rs-upper-bound``: :data:`~slime_rc.config.knobs.BAND_SPELLINGS`)
    read bands."""
    return (flag.knob is not None and KNOB[flag.knob].parse in (number, integer)
            and flag.sets not in BAND_SPELLINGS)


def band_hint(flag: Flag, text: str) -> str:
    """The fix for the band ``text`` given to the one-number ``flag``."""
    lower, _, upper = text.strip().partition("_")
    if flag.knob in ("tis_upper_bound", "tis_lower_bound"):
        return (f"an IS band is two flags: --tis-lower-bound {lower} --tis-upper-bound {upper} (with --tis-mode "
                f"mask to reject weights outside it, or clip to clamp them into it)")
    if flag.knob == "rs_lower_bound":
        return f"a rejection band goes into the threshold: --rs-upper-bound {text.strip()}"
    if flag.knob in ("eps_clip", "eps_clip_high"):
        return ("the PPO clip range [1 - eps_clip, 1 + eps_clip_high] is two flags, e.g. --eps-clip 0.2 "
                "--eps-clip-high 0.28")
    example = {"rs_veto_threshold": "1e-4", "eps_clip_c": "3.0"}.get(flag.knob, KNOB[flag.knob].default)
    return f"e.g. {flag.flag} {example}"


def _type(parse, name: str, one_number: Optional[Flag] = None):
    """``parse`` as an argparse type: its ValueError message becomes argparse's (exit status 2, the flag named).
    ``one_number``: the flag, when it takes one number: text with an underscore is refused as a band, in the words
    the YAML path uses (:func:`slime_rc.config._text.band_refusal`), naming the flag as typed."""
    def read(text: str) -> Any:
        if one_number is not None and "_" in text:
            raise argparse.ArgumentTypeError(band_refusal(f"{one_number.flag} {text}", one_number.flag, text,
                                                          band_hint(one_number, text)))
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    read.__name__ = name
    return read


# Views of the knob table (slime_rc.config.knobs), in the shapes argparse and slime-rc config use:
# flag -> (the key its value is given under, argparse keywords, help) for the settings' flags ...
FLAGS: Dict[str, Tuple[str, Dict[str, Any], str]] = {f.flag: (f.sets, _argparse_kwargs(f), f.help) for f in KNOB_FLAGS}
# ... flag -> (argparse keywords, help) for the flags that are not settings ...
OTHER_FLAGS: Dict[str, Tuple[Dict[str, Any], str]] = {f.flag: (_argparse_kwargs(f), f.help) for f in LAUNCH_FLAGS}
# ... and the flags slime (or Megatron-LM) defines itself that we also define, as slime's parser defines them:
# argparse keywords; the dest is the default one (no dest= in slime).  slime/utils/arguments.py at 624b824a8:
# add_algo_arguments (--eps-clip, --eps-clip-high, --eps-clip-c, --get-mismatch-metrics, --use-rollout-logprobs,
# --use-tis, --tis-clip, --tis-clip-low, --custom-tis-function-path), add_train_arguments (reset_arg of
# Megatron-LM's --calculate-per-token-loss: store_true, default False) and add_slime_arguments (reset_arg
# --custom-config-path).
SLIME_OWNED_FLAGS: Dict[str, Dict[str, Any]] = {f.flag: f.slime_defines for f in ALL_FLAGS if f.slime_defines}
# The module whose add_slime_arguments calls the add_custom_arguments hook.
SLIME_PARSER_MODULE = "slime.utils.arguments"
# What slime's validation fills in on the attributes we read, after parsing and BEFORE it copies the YAML onto args:
# attribute -> the attribute whose value it takes when the flag was not given (slime/utils/arguments.py at
# 624b824a8, slime_validate_args, ~line 1876: ``if args.eps_clip_high is None: args.eps_clip_high = args.eps_clip``).
# Checked against slime's real parse_args: no other attribute we read is changed by slime's, Megatron-LM's or
# sglang's validation (slime's --use-rollout-routing-replay sets use_routing_replay, which we do not read).
SLIME_FILLS: Dict[str, str] = {"eps_clip_high": "eps_clip"}


def called_by_slime(depth: int = 1) -> bool:
    """Whether a frame of slime's parser module (:data:`SLIME_PARSER_MODULE`) is on the call stack above the
    caller's ``depth``-th frame: ``add_rollout_correction_arguments`` then runs as slime's ``add_custom_arguments``
    hook (slime's ``add_slime_arguments`` calls it first, before its own flags), directly or through a wrapper."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        if frame.f_globals.get("__name__") == SLIME_PARSER_MODULE:
            return True
        frame = frame.f_back
    return False


def add_rollout_correction_arguments(parser: argparse.ArgumentParser, *,
                                     slime: Optional[bool] = None) -> argparse.ArgumentParser:
    """Add the rollout-correction flags (in their own group) to ``parser`` and return it.

    A flag the parser already has (slime's own ``--use-tis``, ``--tis-clip``, ...) is left as it is and read
    from there; it counts as given when its value differs from that parser's default.

    ``slime``: the parser is slime's, which will add :data:`SLIME_OWNED_FLAGS` after this hook: those are left
    to slime (with slime's defaults) instead of defined here, so the definitions do not conflict.  ``None``
    (default): detected with :func:`called_by_slime`.
    """
    if slime is None:
        slime = called_by_slime(depth=1)
    group = parser.add_argument_group("rollout correction (slime-rc)")
    shared = {}
    existing = parser._option_string_actions  # argparse keeps no public index of option strings
    for flag, (kwargs, help_) in {**{f: (kw, h) for f, (_, kw, h) in FLAGS.items()}, **OTHER_FLAGS}.items():
        if flag in existing:
            shared[dest_of(flag)] = (existing[flag].dest, existing[flag].default)
            continue
        if slime and flag in SLIME_OWNED_FLAGS:
            shared[dest_of(flag)] = (dest_of(flag), SLIME_OWNED_FLAGS[flag].get("default"))
            continue
        group.add_argument(flag, dest=dest_of(flag), help=help_, **{"default": None, **kwargs})
    parser.set_defaults(slime_rc_shared_flags=shared)
    return parser


def add_slime_owned_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add :data:`SLIME_OWNED_FLAGS` as slime defines them (those the parser lacks), for a parser that stands in
    for slime's (``slime-rc config --slime``)."""
    group = parser.add_argument_group("slime's own flags (as slime defines them)")
    for flag, kwargs in SLIME_OWNED_FLAGS.items():
        if flag not in parser._option_string_actions:
            group.add_argument(flag, **kwargs)
    return parser


def _flag_record(args: argparse.Namespace, flag: str) -> Tuple[str, Any]:
    """``(attribute, the parser's default)`` of ``flag`` (the default is None for our own flags)."""
    return (getattr(args, "slime_rc_shared_flags", None) or {}).get(dest_of(flag), (dest_of(flag), None))


def _given(args: argparse.Namespace, flag: str, *, slime: bool = False, from_yaml: frozenset = frozenset()) -> Any:
    """The value of ``flag`` if it was given on the command line, else None.  ``slime``: ``args`` went through
    slime's validation, and a value it filled in (:func:`filled_by_slime`) is not given either; ``from_yaml``: the
    attributes the ``--custom-config-path`` YAML set (slime copies them after its validation)."""
    dest, default = _flag_record(args, flag)
    value = getattr(args, dest, None)
    if value == default or (slime and filled_by_slime(args, dest, from_yaml)):
        return None
    return value


def filled_by_slime(args: argparse.Namespace, dest: str, from_yaml: frozenset = frozenset()) -> bool:
    """Whether ``args.<dest>`` may be the value slime's validation filled in (:data:`SLIME_FILLS`) rather than a
    flag: it equals the attribute it is filled from, as that attribute was when slime's validation ran -- the value on
    ``args``, or, when the YAML (``from_yaml``) has since overwritten it, its flag's default (``--eps-clip`` 0.2).

    A flag given with that same value (``--eps-clip-high 0.2`` beside the default ``--eps-clip``) cannot be told
    apart and counts as not given: it means what leaving it out means (``eps_clip_high`` unset is ``eps_clip``).  So
    does ``--eps-clip-high`` equal to an ``--eps-clip`` that the YAML then replaces by another value; an
    ``eps_clip_high`` written in the YAML is always the user's."""
    source = SLIME_FILLS.get(dest)
    if source is None or dest in from_yaml:
        return False
    if source in from_yaml:
        return getattr(args, dest, None) == _flag_record(args, "--" + source.replace("_", "-"))[1]
    return getattr(args, dest, None) == getattr(args, source, None)


def resolve_args(args: argparse.Namespace, *, slime: bool = False) -> Resolution:
    """The config ``args`` describe, who set each field, and notes (see :func:`slime_rc.config.resolution.resolve`).

    ``slime``: the resolution slime applies — the YAML beats the flags (slime copies it onto ``args`` after
    parsing) and is read as slime reads it (:func:`slime_rc.config.yaml_config.load_yaml_layer`).  ``args`` may already
    hold the YAML's values (slime's own ``args``, after its parse_args): an attribute the YAML names counts as the
    YAML's, not as a flag, and a value slime's validation filled in (``eps_clip_high`` = ``eps_clip``:
    :func:`filled_by_slime`) as slime's default, so that slime's ``args`` resolve as the same flags given by hand."""
    layers: List[Layer] = []
    preset = _given(args, "--rollout-correction-preset")
    if preset:
        layers.append(preset_layer(preset))
    path = _given(args, "--custom-config-path")
    from_yaml: frozenset = frozenset()
    if path:
        layers.append(load_yaml_layer(path, slime=slime))
        if slime:  # slime's args may hold the YAML's values already: those attributes are the YAML's, not flags
            from_yaml = frozenset(layers[-1].names.values()) | frozenset(layers[-1].ignored)
    given = {key: value for flag, (key, _, _) in FLAGS.items()
             if (value := _given(args, flag, slime=slime, from_yaml=from_yaml)) is not None
             and dest_of(flag) not in from_yaml}
    flag_of = {key: flag for flag, (key, _, _) in FLAGS.items()}
    def spelled(key):  # what the user typed: --no-use-tis for a False boolean
        flag = flag_of.get(key, key)
        return "--no-" + flag[2:] if given.get(key) is False else flag
    layers.append(Layer.from_mapping(given, kind="flag", name=spelled))
    return resolve(layers, SLIME_KINDS if slime else KINDS)


def config_from_args(args: argparse.Namespace, *, slime: bool = False) -> RolloutCorrectionConfig:
    """The validated config (operating mode included: ``config.mode``, ``config.loss_type``) for parsed ``args``;
    ``slime``: with slime's precedence (:func:`resolve_args`).

    Also stores it as ``args.rollout_correction_config`` (the slime adapters in ``custom_tis`` read it from
    there) and emits each note of the resolution (e.g. IS weights that are diagnostics only) as a warning.
    """
    resolution = resolve_args(args, slime=slime)
    for note in resolution.notes:
        warnings.warn(note, stacklevel=2)
    args.rollout_correction_config = resolution.config
    return resolution.config


def tis_function_from_args(args: argparse.Namespace) -> Optional[Any]:
    """The function named by ``--custom-tis-function-path`` (None when unset: the built-in engine is used)."""
    spec = _given(args, "--custom-tis-function-path")
    return load_function(spec, contract=TIS_CONTRACT) if spec else None
