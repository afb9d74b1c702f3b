"""slime's ``args`` as slime's parser and validation leave them -- a model for tests, written here from measured facts.

Tests that build slime's ``args`` by hand (:func:`by_hand`) never meet what slime itself does between the command line
and the loss: it fills some attributes in, copies the YAML on top, and refuses some combinations.  :func:`parse` builds
``args`` that way, so a test can check that slime-rc resolves the same settings from both.  No slime code is copied
here; the facts are those of ``../shared/notes/slime-contract.md`` ("What slime's parser and validation leave on
args"), read from THUDM/slime at 624b824a8 (file paths and approximate lines below are slime's) with Megatron-LM at
1dcf0daf (slime's Dockerfile pins it), and checked while this module was written against slime's real ``parse_args``
(slime's and Megatron-LM's real parser and validation; sglang stubbed, its flags are all ``--sglang-*``): every
attribute :func:`parse` sets equals the one slime's real code leaves, for the launch lines of the tests.

What it models, in slime's order:

1. **The parser** (``slime/utils/arguments.py`` ``parse_args`` ~1600, through
   ``slime/backends/megatron_utils/arguments.py`` ``megatron_parse_args`` ~193 and Megatron-LM's ``parse_args``):
   Megatron-LM's parser (``allow_abbrev=False``; its ``--calculate-per-token-loss``, store_true), then slime's
   ``add_slime_arguments``, which calls the ``add_custom_arguments`` hook FIRST (~1551, from a frame of slime's
   module: what :func:`slime_rc.config.arguments.called_by_slime` looks for) and adds slime's own flags after it
   (:data:`SLIME_FLAGS`: those whose attributes slime-rc reads, with slime's types and defaults;
   ``--custom-config-path`` last, ~1572); then ``parse_known_args`` (a flag nobody defines is dropped silently).
2. **The validation** (``slime_validate_args`` ~1767), the steps that touch those attributes: ``--rollout-temperature``
   must be > 0 (~1770); ``kl_coef`` and ``kl_loss_coef`` not both non-zero (~1846); ``--use-rollout-logprobs`` refuses
   ``--use-tis`` (~1855); ``--get-mismatch-metrics`` needs ``--custom-tis-function-path`` (~1859); **``eps_clip_high``
   is set to ``eps_clip`` when not given (~1876)**; ``--use-rollout-routing-replay`` sets ``use_routing_replay``
   (~2010); then the ``--custom-config-path`` YAML (~2013): ``yaml.safe_load`` and ``setattr`` for EVERY key, so the
   YAML beats the flags and comes after everything above.
3. Nothing later (Megatron-LM's and sglang's ``validate_args``) changes an attribute slime-rc reads.

It also states, as facts, the names of slime's parser the tests need (:data:`SLIME_SHARED_FLAGS`: the flags slime
defines that slime-rc defines too; :data:`SLIME_LACKS_FLAGS`: slime-rc's flags slime lacks;
:data:`SLIME_ARG_NAMES_NEAR_OURS`: slime's arg names closest to slime-rc's YAML keys), read off slime's real parser.

Left out: the steps on attributes slime-rc does not read (checkpoint paths, the sglang and Megatron-LM arguments,
batch sizes, offloading, ...); ``--use-kl-loss`` / ``--kl-coef`` make slime check that ``--ref-load`` exists (~1776),
which is not modelled.
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from slime_rc.config.arguments import SLIME_PARSER_MODULE, add_rollout_correction_arguments

_TRUE = dict(action="store_true", default=False)

# slime's flags whose attributes slime-rc reads (the resolution and the custom loss), as slime defines them:
# flag -> (argparse keywords: type and default, the line in slime/utils/arguments.py at 624b824a8).  Their order is
# slime's: --custom-config-path is added at the end of add_slime_arguments.
SLIME_FLAGS: Dict[str, Tuple[Dict[str, Any], int]] = {
    "--allgather-cp": (_TRUE, 297),
    "--rollout-temperature": (dict(type=float, default=1.0), 343),
    "--rollout-top-p": (dict(type=float, default=1.0), 349),
    "--eps-clip": (dict(type=float, default=0.2), 899),
    "--eps-clip-high": (dict(type=float, default=None), 900),
    "--eps-clip-c": (dict(type=float, default=None), 902),
    "--kl-coef": (dict(type=float, default=0.0), 909),
    "--loss-type": (dict(type=str, choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss"), 915),
    "--custom-loss-function-path": (dict(type=str, default=None), 925),
    "--kl-loss-type": (dict(type=str, choices=["k1", "k2", "k3", "low_var_kl"], default="k1"), 934),
    "--advantage-estimator": (dict(type=str, default="grpo", choices=["grpo", "gspo", "cispo", "reinforce_plus_plus",
                                                                      "reinforce_plus_plus_baseline", "ppo"]), 941),
    "--use-kl-loss": (_TRUE, 981),
    "--kl-loss-coef": (dict(type=float, default=0.0), 984),
    "--use-unbiased-kl": (_TRUE, 990),
    "--entropy-coef": (dict(type=float, default=0.0), 1001),
    "--get-mismatch-metrics": (_TRUE, 1027),
    "--use-rollout-logprobs": (_TRUE, 1051),
    "--use-tis": (_TRUE, 1061),
    "--tis-clip": (dict(type=float, default=2.0), 1067),
    "--tis-clip-low": (dict(type=float, default=0), 1073),
    "--custom-tis-function-path": (dict(type=str, default=None), 1079),
    "--custom-pg-loss-reducer-function-path": (dict(type=str, default=None), 1085),
    "--use-routing-replay": (_TRUE, 1092),
    "--use-rollout-routing-replay": (_TRUE, 1098),
    "--use-opsm": (_TRUE, 1104),
    "--opsm-delta": (dict(type=float, default=1e-4), 1110),
    "--custom-config-path": (dict(type=str, default=None), 1572),
}
# Megatron-LM's flags slime-rc reads (megatron/training/arguments.py at 1dcf0daf; slime's reset_arg keeps it, ~879)
MEGATRON_FLAGS: Dict[str, Dict[str, Any]] = {"--calculate-per-token-loss": _TRUE}


# ---- names of slime's parser, as facts ----------------------------------------------------------------------------
# slime's flag and arg names at 624b824a8 (slime's flags, Megatron-LM 1dcf0daf's with slime's Megatron patch
# docker/patch/latest/megatron.patch; sglang's are all --sglang-*): these are slime's flag names, read off slime's real
# parser (893 option strings, 948 arg names) while they were written here -- not a copy of slime's code -- and only
# those the tests need.
#
# The flags slime's parser defines that slime-rc defines too: slime's add_algo_arguments (--eps-clip, --eps-clip-high,
# --eps-clip-c, --get-mismatch-metrics, --use-rollout-logprobs, --use-tis, --tis-clip, --tis-clip-low,
# --custom-tis-function-path), Megatron-LM's --calculate-per-token-loss (reset_arg keeps it) and --custom-config-path
# (reset_arg at the end of add_slime_arguments).  Every other slime-rc flag is absent from slime's parser.
SLIME_SHARED_FLAGS = frozenset({
    "--calculate-per-token-loss", "--custom-config-path", "--custom-tis-function-path", "--eps-clip", "--eps-clip-c",
    "--eps-clip-high", "--get-mismatch-metrics", "--tis-clip", "--tis-clip-low", "--use-rollout-logprobs", "--use-tis",
})
# slime-rc's flags that slime's parser does NOT define (each looked up in slime's option strings): inside slime our
# hook defines them, on the attributes slime's YAML keys use.  A new slime-rc flag belongs in one of the two sets
# after it was looked up in slime's parser.
SLIME_LACKS_FLAGS = frozenset({
    "--rollout-correction-loss-type", "--rollout-correction-on-nonfinite", "--rollout-correction-preset",
    "--rollout-correction-quantile-bins", "--rollout-correction-rejected-in-denominator",
    "--rollout-correction-safety-bound", "--rs-level", "--rs-lower-bound", "--rs-upper-bound", "--rs-veto-threshold",
    "--tis-batch-normalize", "--tis-level", "--tis-lower-bound", "--tis-mode", "--tis-upper-bound",
    "--use-rollout-correction", "--use-rs",
})
# slime's arg names (attributes; a YAML key of that name lands on them) that a slime-rc YAML-key check must leave
# alone: those a shared YAML commonly holds (slime's use_kl_loss, kl_coef, use_opsm, advantage_estimator, ...) and
# every arg name of slime's parser that is closest to a slime-rc YAML spelling: within two edits of near_miss's
# cutoff (slime_rc.config._text.near_miss) for some spelling -- Megatron-LM's test_mode is 2 edits from tis_mode.
# No arg name of slime's parser is within the cutoff itself.
SLIME_ARG_NAMES_NEAR_OURS = (
    "use_kl_loss", "kl_coef", "eps_clip", "use_opsm", "loss_type", "advantage_estimator",
    "test_mode", "kl_loss_type", "lr", "mask_type", "opd_type", "qk_clip", "rope_type", "use_opd", "rollout_seed",
    "rollout_stop",
)


def _attribute(flag: str) -> str:
    return flag[2:].replace("-", "_")


# slime's defaults of those attributes: args as the parser leaves them when no flag is given (before validation)
SLIME_DEFAULTS: Dict[str, Any] = {
    **{_attribute(f): kw.get("default") for f, kw in MEGATRON_FLAGS.items()},
    **{_attribute(f): kw.get("default") for f, (kw, _) in SLIME_FLAGS.items()},
}


def _call_hook(hook, parser):
    return hook(parser)


# _call_hook with slime's parser module as its globals' __name__: the hook runs in a frame of "slime's module", as
# slime's add_slime_arguments calls it (the hook tells it runs inside slime from that frame)
_call_hook_in_slime = types.FunctionType(_call_hook.__code__, {"__name__": SLIME_PARSER_MODULE}, "add_slime_arguments")


def parser(hook=add_rollout_correction_arguments) -> argparse.ArgumentParser:
    """slime's parser, reduced to :data:`MEGATRON_FLAGS` and :data:`SLIME_FLAGS`: Megatron-LM's flags, ``hook``
    (slime's ``add_custom_arguments``; None: none) called from slime's module, then slime's flags.  A hook that
    defines one of slime's flags fails here as in slime (``argparse.ArgumentError: ... conflicting option string``)."""
    out = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for flag, kwargs in MEGATRON_FLAGS.items():
        out.add_argument(flag, **kwargs)
    if hook is not None:
        out = _call_hook_in_slime(hook, out)
    for flag, (kwargs, _) in SLIME_FLAGS.items():
        out.add_argument(flag, **kwargs)
    return out


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The steps of slime's ``slime_validate_args`` that touch what slime-rc reads (module docstring, step 2), in
    slime's order, on ``args`` in place; returns it.  slime's refusals are ``ValueError`` / ``AssertionError`` as in
    slime."""
    if args.rollout_temperature <= 0:
        raise ValueError("--rollout-temperature must be > 0")
    assert not (args.kl_coef != 0 and args.kl_loss_coef != 0), "Only one of kl_coef and kl_loss_coef can be set"
    assert not (args.use_rollout_logprobs and args.use_tis), \
        "use_rollout_logprobs and use_tis cannot be set at the same time."
    assert not args.get_mismatch_metrics or args.custom_tis_function_path is not None, \
        "custom_tis_function_path must be set when get_mismatch_metrics is set"
    if args.eps_clip_high is None:  # filled in: from here on eps_clip_high is always a number
        args.eps_clip_high = args.eps_clip
    if args.use_rollout_routing_replay:
        args.use_routing_replay = True
    if args.custom_config_path:  # last: every key of the YAML lands on args, over the flags and the values above
        with open(args.custom_config_path) as f:
            for key, value in (yaml.safe_load(f) or {}).items():
                setattr(args, key, value)
    return args


def parse(argv: Sequence[str] = (), *, hook=add_rollout_correction_arguments) -> argparse.Namespace:
    """slime's ``args`` for the launch line ``argv``: :func:`parser` (with ``hook``; None: slime without our hook)
    then :func:`validate`.  Flags that nobody defines are dropped, as slime's ``parse_known_args`` drops them."""
    return parse_known_args(argv, hook=hook)[0]


def parse_known_args(argv: Sequence[str] = (), *, hook=add_rollout_correction_arguments,
                     validated: bool = True) -> Tuple[argparse.Namespace, List[str]]:
    """:func:`parse` that also returns what slime's ``parse_known_args`` dropped (the flags nobody defines, in
    ``argv``'s order).  ``validated=False``: ``args`` as the parser leaves them, before :func:`validate` (no
    ``eps_clip_high`` filled in, no YAML copied)."""
    args, unknown = parser(hook).parse_known_args(list(argv))
    return (validate(args) if validated else args), unknown


def by_hand(yaml_path: Optional[str] = None, **attributes: Any) -> argparse.Namespace:
    """``args`` as tests build them by hand: slime's defaults (:data:`SLIME_DEFAULTS`, ``eps_clip_high`` None: no
    validation ran), ``attributes`` (what the user gave, under the attribute names) and, with ``yaml_path``, the
    YAML's keys set on top, as slime sets them (``custom_config_path`` is set to it)."""
    args = argparse.Namespace(**{**SLIME_DEFAULTS, **attributes})
    if yaml_path is not None:
        args.custom_config_path = yaml_path
        with open(yaml_path) as f:
            for key, value in (yaml.safe_load(f) or {}).items():
                setattr(args, key, value)
    return args
