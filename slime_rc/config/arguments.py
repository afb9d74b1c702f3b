"""Command-line flags: ``add_rollout_correction_arguments(parser)`` and ``config_from_args(args)``.

The flag set is slime's (``--use-tis``, ``--tis-*``, ``--rs-*``, ``--use-rollout-logprobs``, ...) plus the settings
the engine needs.  It adds to any argparse parser, Megatron's included (use it as ``extra_args_provider``: it
returns the parser).  Every flag defaults to None, so ``config_from_args`` can tell what was given on the command
line and apply the precedence **flag > YAML (--custom-config-path) > preset (--rollout-correction-preset) >
default** through :func:`slime_rc.config.layers.resolve`.  ``--custom-tis-function-path`` and
``--custom-config-path`` are checked while parsing (a bad path fails the launch, not the first step).

Inside slime (``slime.utils.arguments.parse_args(add_custom_arguments=add_rollout_correction_arguments)``) the
hook runs BEFORE slime adds its own flags, so it leaves out the flags slime (or Megatron-LM) owns
(:data:`SLIME_OWNED_FLAGS`: slime defines them next, with slime's meaning) and adds only the ones slime lacks, on
the attributes slime's YAML keys use (``args.use_rs``, ``args.tis_level``, ...).  It tells it runs inside slime
from the calling frames (:func:`called_by_slime`); ``slime=True`` / ``slime=False`` forces either way.  slime then
copies the YAML onto ``args`` after parsing, so there the YAML beats the flags: ``resolve_args(args,
slime=True)`` applies that precedence (``slime-rc config --slime`` prints it).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

from slime_rc.config.schema import (IS_LEVELS, IS_MODES, LOSS_TYPES, NONFINITE_POLICIES, RS_OPTIONS, RolloutCorrectionConfig,
                     parse_number, split_threshold)
from slime_rc.plugins import TIS_CONTRACT, load_function
from slime_rc.config.presets import PRESETS
from slime_rc.config.layers import KINDS, SLIME_KINDS, Layer, Resolution, preset_layer, resolve
from slime_rc.config.yaml_config import load_yaml_layer


def _rs_level(value: str) -> str:
    for name in (s.strip() for s in value.split(",")):
        if name not in RS_OPTIONS:
            import difflib
            match = difflib.get_close_matches(name, list(RS_OPTIONS), n=1, cutoff=0.5)
            raise argparse.ArgumentTypeError(
                f"{name!r} is not a rejection option; choose token, sequence, geometric or a comma list of "
                f"{', '.join(o for o in RS_OPTIONS if o not in IS_LEVELS)}"
                + (f". Did you mean {match[0]!r}?" if match else ""))
    return value


def _existing_file(value: str) -> str:
    path = os.path.abspath(value)
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return value


def _tis_function(value: str) -> str:
    try:
        load_function(value, contract=TIS_CONTRACT)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _threshold(value: str) -> str:
    """A number, ``"lower_upper"``, or a comma list of those (one per --rs-level option)."""
    try:
        for part in value.split(","):
            split_threshold("threshold", part)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a threshold: give a number (2.0), 'lower_upper' (0.999_1.001) or a comma "
            f"list with one per --rs-level option") from None
    return value


def _number(value: str) -> float:
    try:
        return parse_number("value", value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None


_BOOL = dict(action=argparse.BooleanOptionalAction, default=None)

# flag -> (settings key it sets, argparse keywords, help).  Settings keys are those of slime_rc.config.layers.
FLAGS: Dict[str, Tuple[str, Dict[str, Any], str]] = {
    "--use-rollout-logprobs": ("use_rollout_logprobs", _BOOL,
                               "bypass mode: use the rollout log-probs as pi_old (skips the recompute pass)"),
    "--use-rollout-correction": ("use_rollout_correction", _BOOL,
                                 "apply the IS/RS settings to the loss (implied by --use-tis / --use-rs)"),
    "--get-mismatch-metrics": ("get_mismatch_metrics", _BOOL,
                               "compute the mismatch metrics even when nothing is corrected"),
    "--use-tis": ("use_tis", _BOOL, "enable importance-sampling weights"),
    "--tis-mode": ("tis_mode", dict(choices=IS_MODES), "truncate (cap above), clip (clamp both), mask (reject outside)"),
    "--tis-lower-bound": ("tis_lower_bound", dict(type=_number), "lower IS bound (default 1/upper)"),
    "--tis-upper-bound": ("tis_upper_bound", dict(type=_number), "upper IS bound (default 2.0)"),
    "--tis-level": ("tis_level", dict(choices=IS_LEVELS), "token, sequence or geometric (default token)"),
    "--tis-batch-normalize": ("tis_batch_normalize", _BOOL, "normalize IS weights to mean 1 over the global batch"),
    "--tis-clip": ("tis_clip", dict(type=_number), "slime's older spelling of --tis-upper-bound"),
    "--tis-clip-low": ("tis_clip_low", dict(type=_number),
                       "slime's older spelling of --tis-lower-bound (0 = no lower bound, truncate mode)"),
    "--use-rs": ("use_rs", _BOOL, "enable rejection sampling"),
    "--rs-lower-bound": ("rs_lower_bound", dict(type=_number),
                         "lower ratio bound of the k1 RS options (default 1/upper)"),
    "--rs-upper-bound": ("rs_upper_bound", dict(type=_threshold),
                         "RS threshold: a number, 'lower_upper', or a comma list, one per --rs-level option"),
    "--rs-level": ("rs_level", dict(type=_rs_level),
                   "token, sequence, geometric, or a comma list of token_k1..seq_max_k3 options (ANDed)"),
    "--rs-veto-threshold": ("rs_veto_threshold", dict(type=_number),
                            "reject a sequence holding a token with ratio below this (e.g. 1e-4)"),
    "--rollout-correction-loss-type": ("loss_type", dict(choices=LOSS_TYPES),
                                       "ppo_clip (default) or reinforce (bypass only: REINFORCE with IS weights)"),
    "--eps-clip": ("eps_clip", dict(type=_number), "PPO clip range: ratio clipped to [1 - eps, 1 + eps_high] (0.2)"),
    "--eps-clip-high": ("eps_clip_high", dict(type=_number), "upper PPO clip range (default --eps-clip)"),
    "--eps-clip-c": ("eps_clip_c", dict(type=_number), "dual-clip bound (> 1) for negative advantages (off)"),
    "--calculate-per-token-loss": ("calculate_per_token_loss", _BOOL,
                                   "token mean over the batch instead of per-sample mean then mean"),
    "--rollout-correction-rejected-in-denominator": (
        "rejected_in_denominator", _BOOL, "keep rejected tokens in the loss denominator (default: no)"),
    "--rollout-correction-safety-bound": ("safety_bound", dict(type=_number),
                                          "clamp log-ratios to +-this before exp (default 20)"),
    "--rollout-correction-on-nonfinite": ("on_nonfinite", dict(choices=NONFINITE_POLICIES),
                                          "NaN/inf log-probs: error (default) or reject the sequence"),
    "--rollout-correction-quantile-bins": ("quantile_bins_per_octave", dict(type=int),
                                           "resolution of the IS quantile metrics (default 128 per octave)"),
}
# Flags that are not settings of the config.
OTHER_FLAGS: Dict[str, Tuple[Dict[str, Any], str]] = {
    "--rollout-correction-preset": (dict(choices=list(PRESETS), metavar="NAME"),
                                    "start from a preset (see docs/usage.md); flags and YAML override it"),
    "--custom-config-path": (dict(type=_existing_file, metavar="YAML"),
                             "YAML with the slime keys or a verl algorithm.rollout_correction block"),
    "--custom-tis-function-path": (dict(type=_tis_function, metavar="SPEC"),
                                   "TIS function: pkg.mod.fn, pkg.mod:fn, file.py:fn, or mis / tis / icepop"),
}


# The flags slime (or Megatron-LM) defines itself that we also define, as slime's parser defines them: argparse
# keywords; the dest is the default one (no dest= in slime).  slime/utils/arguments.py at 624b824a8:
# add_algo_arguments (--eps-clip, --eps-clip-high, --eps-clip-c, --get-mismatch-metrics, --use-rollout-logprobs,
# --use-tis, --tis-clip, --tis-clip-low, --custom-tis-function-path), add_train_arguments (reset_arg of
# Megatron-LM's --calculate-per-token-loss: store_true, default False) and add_slime_arguments (reset_arg
# --custom-config-path).
SLIME_OWNED_FLAGS: Dict[str, Dict[str, Any]] = {
    "--use-rollout-logprobs": dict(action="store_true", default=False),
    "--get-mismatch-metrics": dict(action="store_true", default=False),
    "--use-tis": dict(action="store_true", default=False),
    "--tis-clip": dict(type=float, default=2.0),
    "--tis-clip-low": dict(type=float, default=0),
    "--eps-clip": dict(type=float, default=0.2),
    "--eps-clip-high": dict(type=float, default=None),
    "--eps-clip-c": dict(type=float, default=None),
    "--calculate-per-token-loss": dict(action="store_true", default=False),
    "--custom-config-path": dict(type=str, default=None),
    "--custom-tis-function-path": dict(type=str, default=None),
}
# The module whose add_slime_arguments calls the add_custom_arguments hook.
SLIME_PARSER_MODULE = "slime.utils.arguments"


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


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
            shared[_dest(flag)] = (existing[flag].dest, existing[flag].default)
            continue
        if slime and flag in SLIME_OWNED_FLAGS:
            shared[_dest(flag)] = (_dest(flag), SLIME_OWNED_FLAGS[flag].get("default"))
            continue
        group.add_argument(flag, dest=_dest(flag), help=help_, **{"default": None, **kwargs})
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


def _given(args: argparse.Namespace, flag: str) -> Any:
    """The value of ``flag`` if it was given on the command line, else None."""
    dest, default = (getattr(args, "slime_rc_shared_flags", None) or {}).get(_dest(flag), (_dest(flag), None))
    value = getattr(args, dest, None)
    return None if value == default else value


def resolve_args(args: argparse.Namespace, *, slime: bool = False) -> Resolution:
    """The config ``args`` describe, who set each field, and notes (see :func:`slime_rc.config.layers.resolve`).

    ``slime``: the resolution slime applies — the YAML beats the flags (slime copies it onto ``args`` after
    parsing) and is read as slime reads it (:func:`slime_rc.config.yaml_config.load_yaml_layer`).  ``args`` may already
    hold the YAML's values (slime's own ``args``, after its parse_args): an attribute the YAML names counts as the
    YAML's, not as a flag."""
    layers: List[Layer] = []
    preset = _given(args, "--rollout-correction-preset")
    if preset:
        layers.append(preset_layer(preset))
    path = _given(args, "--custom-config-path")
    from_yaml = set()
    if path:
        layers.append(load_yaml_layer(path, slime=slime))
        if slime:  # slime's args may hold the YAML's values already: those attributes are the YAML's, not flags
            from_yaml = set(layers[-1].names.values()) | set(layers[-1].ignored)
    given = {key: _given(args, flag) for flag, (key, _, _) in FLAGS.items()
             if _given(args, flag) is not None and _dest(flag) not in from_yaml}
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
