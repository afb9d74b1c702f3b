"""The ``slime-rc`` command.

``slime-rc train [flags...]`` runs the main job (:mod:`slime_rc.demo.train.launch`); ``slime-rc plot RUN_DIR... -o
FILE.png`` draws its curves, ``slime-rc plot STUDY_DIR -o FILE.png`` a study's mean over seeds per configuration
(:mod:`slime_rc.demo.train.plot`); ``slime-rc analyze DUMP`` reports the mismatch of a log-prob dump
(:mod:`slime_rc.tools.analyze`); ``slime-rc study estimators`` measures the estimators' bias and variance
(:mod:`slime_rc.tools.estimators`), ``slime-rc study summary DIR`` summarises a mismatch study
(:mod:`slime_rc.demo.train.study`).  Each command's module is imported only when it runs, so ``slime-rc --help``
imports none of them; what the --help texts say is plain text here (:data:`COMMANDS`, ``*_DESCRIPTION``), never a
docstring.  A mistyped command or flag is refused with the closest real one (``Did you mean ...?``).

``slime-rc config [launch flags...] [--json]`` prints the resolved rollout-correction configuration: the operating
mode and every IS/RS setting with where it came from (flag / YAML / preset / default), with the precedence of
slime-rc's own launches (slime-rc train, Megatron's extra_args_provider): flag > YAML > preset > default.  Paste a
whole launch line: flags that are not rollout-correction flags are listed as ignored (a near miss of one is refused).

``slime-rc config --slime [slime launch flags...]`` shows what slime makes of the same line: which loss slime runs
(:func:`slime_runs`), slime's own flags (--use-tis, --tis-clip, --eps-clip, ...) with slime's definitions and
defaults, then the --custom-config-path YAML copied onto args over the flags (YAML > flag > preset > default), as
the attributes the adapters read, each with its source, and the configuration slime-rc's engine resolves from them.
It refuses what slime's start-up checks refuse (:func:`slime_startup_refusal`), a function path slime's
``load_function`` cannot load (:func:`slime_load_refusal`), and a bypass correction outside slime-rc's custom loss.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from slime_rc.config._text import did_you_mean_any, near_miss, unknown_flags_message
from slime_rc.config.arguments import (SLIME_OWNED_FLAGS, add_rollout_correction_arguments, add_slime_owned_arguments,
                                      resolve_args)
from slime_rc.config.knobs import ALL_FLAGS, SPELLINGS
from slime_rc.config.resolution import Resolution
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.config.yaml_config import SLIME_LOSS_TYPES, load_yaml_layer

# What each command does, in the words `slime-rc --help` and `slime-rc COMMAND --help` use (plain text: argparse
# prints it as it is, so no reStructuredText markup).
COMMANDS = {
    "train": "run GRPO training with rollout correction on a small model (the demo job)",
    "plot": "draw the reward and mismatch curves of training runs, or of a study directory",
    "analyze": "report the train/rollout mismatch of a log-prob dump and recommend a preset",
    "study": "'study estimators': bias and variance of the estimators; 'study summary DIR': table of a study",
    "config": "print the rollout-correction configuration a launch line resolves to (--slime: as slime runs it)",
}
STUDY_COMMANDS = {
    "estimators": "measure the bias and variance of the rollout-correction estimators on a toy policy",
    "summary": "print the table of a study directory (<config>/seed<k>/metrics.jsonl): rewards, collapses, mismatch",
}
CONFIG_DESCRIPTION = (
    "Print the rollout-correction configuration a launch line resolves to: the operating mode and every "
    "importance-sampling / rejection setting with where it came from (flag, YAML, preset or default), with the "
    "precedence of slime-rc's own launches (slime-rc train, Megatron's extra_args_provider): flag > YAML > preset > "
    "default. Paste a whole launch line: flags of other tools are listed as ignored; a near miss of a "
    "rollout-correction flag is refused. Add --slime to see what slime makes of the same line.")
SLIME_DESCRIPTION = (
    "Show what slime makes of a slime launch line: which loss slime runs (its built-in policy loss with or without "
    "its TIS, slime's TIS hook with a function, or slime-rc's custom loss), slime's own flags with slime's "
    "defaults, the --custom-config-path YAML copied onto args over the flags (YAML > flag > preset > default), and "
    "the configuration slime-rc resolves from them. What slime refuses at start-up, a function path slime cannot "
    "load and a mode the chosen loss cannot run are refused here, with the fix.")

MODE_TEXT = {
    ("standard", "ppo_clip"): "standard PPO: ratio pi_theta/pi_old, pi_old recomputed, no correction",
    ("decoupled", "ppo_clip"): "decoupled PPO: pi_old recomputed; IS/RS correct pi_rollout -> pi_old, "
                               "PPO clips pi_theta/pi_old",
    ("bypass", "ppo_clip"): "bypass PPO: pi_old := pi_rollout (no recompute pass); PPO clips pi_theta/pi_rollout",
    ("bypass", "reinforce"): "bypass REINFORCE: -w * log pi_theta * A with w = pi_theta/pi_rollout (no PPO clip)",
}


def _value(config: RolloutCorrectionConfig, name: str) -> str:
    value = getattr(config, name)
    if name == "is_lower_bound" and value is None:
        return f"None (1/upper = {config.is_lower:g})"
    if name == "rs":
        if not value:
            return "none"
        return "; ".join(f"{c.option} in [{c.lower:g}, {c.upper:g}]" if c.statistic == "k1"
                         else f"{c.option} <= {c.upper:g}" for c in value)
    if name == "is_level" and value is not None and not config.is_weights_applied:
        return f"{value} (diagnostics only)"
    return str(value)


PRECEDENCE = "flag > YAML (--custom-config-path) > preset (--rollout-correction-preset) > default"
SLIME_PRECEDENCE = ("YAML (--custom-config-path, copied onto args after parsing) > flag > preset "
                    "(--rollout-correction-preset) > default (slime's, for the flags slime owns)")


def _table(header: Tuple[str, str, str], rows: List[Tuple[str, str, str]]) -> List[str]:
    width = max(len(r[0]) for r in rows + [header]) + 2
    vwidth = max(len(r[1]) for r in rows + [header]) + 2
    return [f"  {n.ljust(width)}{v.ljust(vwidth)}{s}" for n, v, s in [header] + rows]


def _no_tis_function(slime: bool) -> str:
    """What runs without --custom-tis-function-path: slime-rc's engine in slime-rc's launches; in slime, see
    'slime runs' (slime's built-in TIS, or no TIS call)."""
    return "none (see 'slime runs' above)" if slime else "built-in engine (slime_rc.compute_rollout_correction)"


def report(config: RolloutCorrectionConfig, sources: dict, notes: List[str], tis_function: Optional[str],
           ignored: List[str], *, slime_args: Optional[List[Tuple[str, str, str]]] = None,
           ignored_yaml: List[str] = (), runs: Optional[Tuple[str, str, List[str]]] = None) -> str:
    """The text ``slime-rc config`` prints; ``slime_args``: the (attribute, value, source) rows of
    ``slime-rc config --slime``, ``runs``: which loss slime runs (:func:`slime_runs`)."""
    first = ("mode", "loss_type", "get_mismatch_metrics")
    order = list(first) + [n for n in sources if n not in first]
    rows = [(name, _value(config, name), sources[name]) for name in order]
    if slime_args is None:
        lines = ["slime-rc: resolved rollout-correction configuration", f"  precedence: {PRECEDENCE}", ""]
    else:
        lines = ["slime-rc: the rollout-correction settings inside slime", f"  precedence: {SLIME_PRECEDENCE}", ""]
        lines += _runs_lines(runs) if runs else []
        lines += ["  slime's args after parsing and copying the YAML (the attributes the adapters read):"]
        lines += _table(("attribute", "value", "source"), [(k, repr(v), s) for k, v, s in slime_args]) + [
            "", "  resolved by slime-rc's engine (custom_tis adapters with a preset or engine-only settings):"]
    lines += [f"  {MODE_TEXT[(config.mode, config.loss_type)]}",
              f"  TIS function: {tis_function or _no_tis_function(slime_args is not None)}", ""]
    lines += _table(("setting", "value", "source"), rows)
    lines += [""] + [f"note: {n}" for n in notes]
    if ignored:
        lines.append(f"ignored (not rollout-correction flags): {' '.join(ignored)}")
    if ignored_yaml:
        lines.append(f"ignored YAML keys (not slime-rc's: slime's or other plugins'): {', '.join(ignored_yaml)}")
    return "\n".join(lines).rstrip() + "\n"


def _config_command(args: argparse.Namespace, ignored: List[str]) -> int:
    resolution = resolve_args(args)
    config = resolution.config
    if args.json:
        print(json.dumps({"config": config.to_dict(), "sources": resolution.sources, "notes": resolution.notes,
                          "is_weights_applied": config.is_weights_applied,
                          "tis_function": args.custom_tis_function_path, "ignored": ignored}, indent=2))
    else:
        sys.stdout.write(report(config, resolution.sources, resolution.notes, args.custom_tis_function_path,
                                ignored))
    return 0


def _flag_of_attribute() -> Dict[str, str]:
    return {f.dest: f.flag for f in ALL_FLAGS}


def _slime_yaml(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``--custom-config-path`` YAML as slime reads it (``yaml.safe_load``); {} without one."""
    import yaml

    path = getattr(args, "custom_config_path", None)
    if not path:
        return {}
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return data if isinstance(data, dict) else {}


def slime_args_rows(args: argparse.Namespace, data: Dict[str, Any]) -> Tuple[List[Tuple[str, str, str]], List[str]]:
    """What slime's ``args`` hold after parsing ``args`` (a namespace of :func:`build_slime_parser`) and copying the
    YAML ``data`` onto it as slime does (``setattr`` of every key): ``(rows, notes)``, one row ``(attribute, value,
    source)`` per rollout-correction attribute that is not None."""
    shared = getattr(args, "slime_rc_shared_flags", {}) or {}
    attributes = _flag_of_attribute()
    rows: Dict[str, Tuple[Any, str]] = {}
    for attr, flag in attributes.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if flag in SLIME_OWNED_FLAGS and value == shared.get(attr, (attr, None))[1]:
            rows[attr] = (value, "slime's default")
        else:
            rows[attr] = (value, "--no-" + flag[2:] if value is False else flag)
    notes = []
    path = getattr(args, "custom_config_path", None)
    for key, value in data.items():
        key = str(key)
        if (key not in SPELLINGS and key not in rows and key not in attributes) or \
                (key == "loss_type" and value in SLIME_LOSS_TYPES):  # not ours, or slime's own --loss-type
            continue
        source = f"{key} in {path}"
        if key in rows and rows[key][1] != "slime's default" and rows[key][0] != value:
            source += f" (over {rows[key][1]} {rows[key][0]!r})"
            notes.append(f"{key}: {value!r} in {path} replaces {rows[key][1]} {rows[key][0]!r}: slime copies the "
                         f"YAML onto args after parsing, so the YAML wins over the command line.")
        rows[key] = (value, source)
    return [(k, v, s) for k, (v, s) in rows.items()], notes


def _dropped_no_flags(ignored: List[str]) -> List[str]:
    """slime parses with parse_known_args: ``--no-use-tis`` (slime's --use-tis is store_true) is dropped silently."""
    notes = []
    for arg in ignored:
        flag = "--" + arg[5:] if arg.startswith("--no-") else None
        if flag in SLIME_OWNED_FLAGS and SLIME_OWNED_FLAGS[flag].get("action") == "store_true":
            notes.append(f"{arg}: slime's {flag} is a store_true flag with no --no- form, and slime parses with "
                         f"parse_known_args, so slime drops {arg} without a word. Leave out {flag} (off is slime's "
                         f"default), or write {flag[2:].replace('-', '_')}: false in the --custom-config-path YAML.")
    return notes


def build_slime_parser() -> argparse.ArgumentParser:
    """A stand-in for slime's parser: our hook run as slime runs it (``slime=True``), then slime's own definitions
    of the flags it shares with us (:data:`slime_rc.config.arguments.SLIME_OWNED_FLAGS`)."""
    parser = argparse.ArgumentParser(prog="slime-rc config --slime", allow_abbrev=False,
                                     usage="%(prog)s [slime launch flags...] [--json]", description=SLIME_DESCRIPTION)
    add_rollout_correction_arguments(parser, slime=True)
    add_slime_owned_arguments(parser)
    group = parser.add_argument_group("slime's flags that decide the loss and its start-up checks")
    for flag, kwargs in SLIME_RUN_FLAGS.items():
        if flag not in parser._option_string_actions:
            group.add_argument(flag, **kwargs)
    parser.add_argument("--slime", action="store_true", help="show the settings as slime resolves them")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def copy_yaml_as_slime(args: argparse.Namespace, data: Dict[str, Any]) -> argparse.Namespace:
    """A copy of ``args`` with every key of the YAML ``data`` set as an attribute, as slime's
    ``slime_validate_args`` does (``setattr`` for each key)."""
    out = argparse.Namespace(**vars(args))
    for key, value in data.items():
        setattr(out, key, value)
    return out


# ---- slime-rc config --slime: what slime refuses at start-up, what it cannot load, which loss it runs ------------
# slime's flags (besides SLIME_OWNED_FLAGS) that decide which loss slime runs or what its start-up checks refuse, as
# slime defines them (slime/utils/arguments.py at 624b824a8: --rollout-temperature ~343, --kl-coef ~909, --loss-type
# ~915, --custom-loss-function-path ~925, --kl-loss-coef ~984; the facts of tests/slime_args.py).
SLIME_RUN_FLAGS: Dict[str, Dict[str, Any]] = {
    "--rollout-temperature": dict(type=float, default=1.0),
    "--kl-coef": dict(type=float, default=0.0),
    "--loss-type": dict(type=str, choices=list(SLIME_LOSS_TYPES), default="policy_loss"),
    "--custom-loss-function-path": dict(type=str, default=None),
    "--kl-loss-coef": dict(type=float, default=0.0),
}
SLIME_RC_LOSS = "slime_rc.slime.policy_loss_function"  # slime-rc's custom loss, as slime's dotted path names it
SLIME_RC_LOSSES = (SLIME_RC_LOSS, "slime_rc.slime.policy_loss.policy_loss_function")
CUSTOM_LOSS_FLAGS = f"--loss-type custom_loss --custom-loss-function-path {SLIME_RC_LOSS}"
METRICS_ONLY_TIS = "custom_tis.metrics_only.compute_metrics_only_with_cp"
MIS_TIS = "custom_tis.mis.compute_mis_weights_with_cp"
# the attributes of slime's own flags: what slime's built-in loss and TIS read (every other rollout-correction
# setting is read only by a TIS function or slime-rc's custom loss)
SLIME_OWNED_ATTRIBUTES = frozenset(flag[2:].replace("-", "_") for flag in SLIME_OWNED_FLAGS)


def slime_startup_refusal(args: argparse.Namespace) -> Optional[str]:
    """What slime's ``slime_validate_args`` refuses in ``args`` (the flags, before the YAML is copied), in slime's
    order, quoting slime's own message, with the fix; None when slime starts."""
    if args.rollout_temperature <= 0:
        return (f"--rollout-temperature {args.rollout_temperature:g}: slime refuses it at start-up (\"--rollout-"
                f"temperature must be > 0\"); give a temperature > 0, e.g. --rollout-temperature 1.0")
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        return (f"--kl-coef {args.kl_coef:g} with --kl-loss-coef {args.kl_loss_coef:g}: slime refuses both at "
                f"start-up (\"Only one of kl_coef and kl_loss_coef can be set\"); set one of them to 0")
    if args.use_rollout_logprobs and args.use_tis:
        return ("--use-rollout-logprobs with --use-tis: slime refuses them at start-up (\"use_rollout_logprobs and "
                "use_tis cannot be set at the same time.\"). Bypass mode with importance sampling runs only in "
                "slime-rc's custom loss: drop --use-tis, write use_tis: true in the --custom-config-path YAML (slime "
                f"copies it after this check) and add {CUSTOM_LOSS_FLAGS}; or drop --use-rollout-logprobs for "
                "decoupled PPO with slime's TIS")
    if args.get_mismatch_metrics and args.custom_tis_function_path is None:
        return ("--get-mismatch-metrics without --custom-tis-function-path: slime refuses it at start-up "
                "(\"custom_tis_function_path must be set when get_mismatch_metrics is set\"). To log the mismatch "
                f"metrics and leave the loss unchanged add --custom-tis-function-path {METRICS_ONLY_TIS}; to correct "
                f"as well, --custom-tis-function-path {MIS_TIS}")
    return None


def slime_load_function(path: str) -> Any:
    """What slime's ``slime.utils.misc.load_function(path)`` returns: the module before the LAST dot, imported,
    and the attribute after it (no ``pkg.mod:fn``, no ``file.py:fn``, no short names).  Raises what slime would."""
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def dotted_form(path: str) -> Tuple[str, str]:
    """``(the dotted pkg.mod.fn spelling of path, where its module must be importable from)`` for the other
    spellings slime-rc's own loader accepts (``pkg.mod:fn``, ``dir/file.py:fn``, the short names ``mis`` / ``tis``
    / ``icepop``), so that a refusal shows the line slime can load."""
    from slime_rc.plugins import SHORT_NAMES

    if path in SHORT_NAMES:
        return SHORT_NAMES[path].replace(":", "."), ""
    target, _, attr = path.rpartition(":")
    if not target:
        return f"pkg.mod.{path}" if "." not in path else path, " (a module slime can import, then the function)"
    if not target.endswith(".py"):
        return f"{target}.{attr}", ""
    folder, name = os.path.split(os.path.abspath(target))
    parts = [name[:-3]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):  # a module of a package: the package's dotted name
        folder, package = os.path.split(folder)
        parts.insert(0, package)
    if importlib.util.find_spec(parts[0]) is not None:  # importable already (an installed package: custom_tis)
        return ".".join(parts + [attr]), ""
    return ".".join(parts + [attr]), f" (with {folder} on PYTHONPATH, so that slime can import {parts[0]})"


def slime_load_refusal(what: str, path: str, contract: Tuple[str, ...] = ()) -> Optional[str]:
    """Why slime cannot load ``path`` (given as ``what``: a flag or a YAML key) with its ``load_function``, or
    cannot call it with the keywords ``contract``, with the dotted form it can load; None when it can."""
    from slime_rc.plugins import PluginError, check_contract

    module_name, _, attr = path.rpartition(".")
    try:
        fn = slime_load_function(path)
    except Exception as e:  # anything slime's import would raise
        return (f"{what} {path}: slime cannot load it. slime's load_function splits the path at its last dot and "
                f"imports the module before it (here module {module_name!r}, attribute {attr!r}): "
                f"{type(e).__name__}: {e}. {_load_fix(what, path)}")
    try:
        if contract:
            check_contract(fn, contract, path)
    except PluginError as e:
        return f"{what} {path}: slime loads it but cannot call it as it calls a TIS function: {e}"
    return None


def _load_fix(what: str, path: str) -> str:
    """The fix for a function path slime cannot load: the dotted form, or, when it is one already, the module to
    make importable."""
    module_name, _, attr = path.rpartition(".")
    if module_name and all(part.isidentifier() for part in path.split(".")):
        return (f"The path is in slime's dotted form pkg.mod.fn, but slime cannot import module {module_name!r} "
                f"or find {attr!r} in it: fix the name, or make the module importable (install it, or put its "
                f"folder on PYTHONPATH)")
    dotted, where = dotted_form(path)
    return f"slime takes only the dotted form pkg.mod.fn: write {what} {dotted}{where}"


def _where(name: str, data: Dict[str, Any], path: Optional[str]) -> str:
    """How the user gave attribute ``name``: its flag, or its key in the YAML (which slime copies over the flag)."""
    return f"{name} in {path}:" if name in data else "--" + name.replace("_", "-")


def slime_function_refusal(view: argparse.Namespace, data: Dict[str, Any], path: Optional[str]) -> Optional[str]:
    """The first function path on slime's ``args`` (``view``: after the YAML) that slime cannot load: the TIS
    function (checked against slime's keyword call), and the custom loss when ``--loss-type custom_loss``."""
    from slime_rc.plugins import TIS_CONTRACT

    tis = getattr(view, "custom_tis_function_path", None)
    if tis:
        refusal = slime_load_refusal(_where("custom_tis_function_path", data, path), str(tis), TIS_CONTRACT)
        if refusal:
            return refusal
    if getattr(view, "loss_type", None) == "custom_loss":
        loss = getattr(view, "custom_loss_function_path", None)
        if not loss:
            return (f"--loss-type custom_loss without --custom-loss-function-path: slime has no loss to call; "
                    f"slime-rc's is {CUSTOM_LOSS_FLAGS}")
        return slime_load_refusal(_where("custom_loss_function_path", data, path), str(loss))
    return None


def _bypass_beyond_slime(config: Optional[RolloutCorrectionConfig]) -> bool:
    """Whether ``config`` is a bypass mode that corrects or weighs something (bypass REINFORCE, IS weights, RS or a
    veto on pi_rollout): only slime-rc's custom loss runs it (slime's plain bypass PPO corrects nothing)."""
    return config is not None and config.mode == "bypass" and (
        config.loss_type == "reinforce" or config.is_level is not None or bool(config.rs)
        or config.veto_threshold is not None)


def _unread(rows: List[Tuple[str, Any, str]]) -> List[str]:
    """The rollout-correction settings given (not slime's defaults) that slime's own loss and TIS never read."""
    return [name for name, value, source in rows if name not in SLIME_OWNED_ATTRIBUTES
            and source != "slime's default" and value not in (None, False)]


def slime_runs(view: argparse.Namespace, resolution: Optional[Resolution],
               rows: List[Tuple[str, Any, str]]) -> Tuple[str, str, List[str]]:
    """``(kind, what slime runs in words, warnings)`` for slime's ``args`` ``view`` (after the YAML), what slime-rc
    resolves from them (None when it refuses them) and the rows of :func:`slime_args_rows`.

    ``kind``: ``custom_loss`` (slime-rc's), ``other_custom_loss``, ``sft_loss``, ``policy_loss`` (slime's, no TIS
    call), ``builtin_tis`` (slime's vanilla TIS) or ``tis_function`` (slime's TIS hook).  Raises ``ValueError`` when
    the settings ask for a mode that loss cannot run (a bypass correction outside slime-rc's custom loss)."""
    config = resolution.config if resolution else None
    loss_type = getattr(view, "loss_type", "policy_loss")
    tis = getattr(view, "custom_tis_function_path", None)
    if loss_type == "custom_loss":
        loss = getattr(view, "custom_loss_function_path", None)
        warnings = [f"slime does not call --custom-tis-function-path {tis} with a custom loss; slime-rc's custom loss "
                    f"applies the settings itself"] if tis else []
        if loss in SLIME_RC_LOSSES:
            mode = MODE_TEXT.get((config.mode, config.loss_type), config.mode) if config else "refused (below)"
            return "custom_loss", f"slime-rc's custom loss ({loss}), which runs every mode; here: {mode}", warnings
        return "other_custom_loss", (f"your custom loss {loss}: slime-rc cannot tell which of the settings below "
                                     f"it reads"), warnings
    if loss_type == "sft_loss":
        return "sft_loss", "slime's SFT loss: no policy-gradient loss, nothing below is used", []
    if _bypass_beyond_slime(config):
        raise ValueError(
            f"mode={config.mode!r}, loss_type={config.loss_type!r} (from {resolution.sources['mode']}): a bypass "
            f"correction that only slime-rc's custom loss runs ({MODE_TEXT.get((config.mode, config.loss_type))}). "
            f"slime's policy loss is PPO-clip and a TIS function (--custom-tis-function-path) only reweights or "
            f"masks each token's PPO term with pi_old recomputed (slime refuses --use-tis with "
            f"--use-rollout-logprobs), so neither slime's built-in TIS nor a TIS function runs it. Add "
            f"{CUSTOM_LOSS_FLAGS}")
    ppo = ("slime's policy loss (PPO clip; bypass: pi_old := pi_rollout, no recompute)"
           if getattr(view, "use_rollout_logprobs", False) else "slime's policy loss (PPO clip, pi_old recomputed)")
    unread = _unread(rows)
    if not (getattr(view, "use_tis", False) or getattr(view, "get_mismatch_metrics", False)):
        warnings = [f"slime calls no TIS function (neither use_tis nor get_mismatch_metrics is set), so these "
                    f"settings have no effect: {', '.join(unread + (['custom_tis_function_path'] if tis else []))}. "
                    f"Set use_tis: true (or --use-tis), or run slime-rc's custom loss: {CUSTOM_LOSS_FLAGS}"] \
            if unread or tis else []
        return "policy_loss", f"{ppo}, no rollout correction", warnings
    if not tis:
        clip, low = getattr(view, "tis_clip", 2.0), getattr(view, "tis_clip_low", 0)
        warnings = [f"slime's built-in TIS reads only tis_clip and tis_clip_low, so these settings have no effect: "
                    f"{', '.join(unread)}. Add --custom-tis-function-path {MIS_TIS} to apply them, or run "
                    f"slime-rc's custom loss: {CUSTOM_LOSS_FLAGS}"] if unread else []
        return "builtin_tis", (f"{ppo} with slime's built-in TIS (vanilla_tis_function): each token's PPO term "
                               f"times clamp(pi_old/pi_rollout, {low!r}, {clip!r})"), warnings
    return "tis_function", (f"{ppo} with slime's TIS hook: slime passes each token's PPO term through {tis}, "
                            f"which may reweight or mask it; bypass corrections (--use-rollout-logprobs with IS or "
                            f"RS, the bypass_* presets) run only in slime-rc's custom loss ({CUSTOM_LOSS_FLAGS})"), []


def _resolved_or_none(view: argparse.Namespace) -> Optional[Resolution]:
    """What slime-rc resolves from slime's ``args`` (slime's precedence), or None when it refuses them."""
    try:
        return resolve_args(view, slime=True)
    except ValueError:
        return None


def _runs_lines(runs: Tuple[str, str, List[str]]) -> List[str]:
    """The lines that say which loss slime runs, and why some settings have no effect there."""
    return [f"  slime runs: {runs[1]}", ""] + [f"warning: {w}" for w in runs[2]] + ([""] if runs[2] else [])


def _slime_config_command(args: argparse.Namespace, ignored: List[str]) -> int:
    # what slime would misread in the YAML (1e-4, quoted numbers, our loss_type under slime's key, near-misses of
    # our keys) is an error before anything is printed
    from slime_rc.slime.settings import beyond_slime  # imports torch: only here, not for --help

    refusal = slime_startup_refusal(args)  # slime checks the flags before it reads the YAML
    if refusal:
        raise ValueError(refusal)
    ignored_yaml = load_yaml_layer(args.custom_config_path, slime=True).ignored if args.custom_config_path else []
    ignored_yaml = [k for k in ignored_yaml if k not in _flag_of_attribute()]  # rollout_correction_preset: ours
    data = _slime_yaml(args)
    rows, notes = slime_args_rows(args, data)
    notes += _dropped_no_flags(ignored)
    view = copy_yaml_as_slime(args, data)  # what the adapters get: slime's args after the YAML is copied on
    refusal = slime_function_refusal(view, data, args.custom_config_path)
    if refusal:
        raise ValueError(refusal)
    runs = slime_runs(view, _resolved_or_none(view), rows)
    beyond = beyond_slime(view)
    if beyond is None:  # custom_tis.mis applies slime's example semantics: show those, not the engine's
        return _slime_semantics_report(args, rows, notes, ignored, ignored_yaml, view, runs)
    notes.append(f"custom_tis.mis runs slime-rc's engine for these settings ({beyond} goes beyond slime's example "
                 f"mis.py; docs/slime.md).")
    try:
        resolution, refused = resolve_args(view, slime=True), None
    except ValueError as e:
        resolution, refused = None, str(e)
    slime_args = {k: {"value": v, "source": s} for k, v, s in rows}
    if args.json:
        config = resolution.config if resolution else None
        print(json.dumps({"precedence": SLIME_PRECEDENCE, "slime_runs": _runs_json(runs), "slime_args": slime_args,
                          "config": config.to_dict() if config else None,
                          "sources": resolution.sources if resolution else None,
                          "notes": notes + (resolution.notes if resolution else []), "engine_error": refused,
                          "is_weights_applied": config.is_weights_applied if config else None,
                          "tis_function": args.custom_tis_function_path, "ignored": ignored,
                          "ignored_yaml_keys": ignored_yaml}, indent=2, default=str))
    elif resolution is not None:
        sys.stdout.write(report(resolution.config, resolution.sources, notes + resolution.notes,
                                args.custom_tis_function_path, ignored, slime_args=rows, ignored_yaml=ignored_yaml,
                                runs=runs))
    else:
        lines = ["slime-rc: the rollout-correction settings inside slime", f"  precedence: {SLIME_PRECEDENCE}", ""]
        lines += _runs_lines(runs) + ["  slime's args after parsing and copying the YAML (the attributes the "
                                      "adapters read):"]
        lines += _table(("attribute", "value", "source"), [(k, repr(v), s) for k, v, s in rows]) + [""]
        lines += [f"note: {n}" for n in notes]
        sys.stdout.write("\n".join(lines).rstrip() + "\n")
    if refused is not None:
        print(f"slime-rc config --slime: error: slime-rc's engine refuses these settings: {refused}",
              file=sys.stderr)
        return 2
    return 0


def _runs_json(runs: Tuple[str, str, List[str]]) -> Dict[str, Any]:
    return {"kind": runs[0], "text": runs[1], "warnings": runs[2]}


def _slime_semantics_report(args, rows, notes, ignored, ignored_yaml, view, runs) -> int:
    """``slime-rc config --slime`` when ``custom_tis.mis`` applies slime's example semantics (docs/slime.md)."""
    from slime_rc.slime.settings import explain

    settings, mis_rows, defect_notes = explain(view)
    notes = notes + list(defect_notes)
    if args.json:
        print(json.dumps({"precedence": SLIME_PRECEDENCE, "slime_runs": _runs_json(runs),
                          "semantics": "slime's example mis.py",
                          "slime_args": {k: {"value": v, "source": s} for k, v, s in rows},
                          "mis_settings": {k: {"value": v, "source": s} for k, v, s in mis_rows},
                          "notes": notes, "tis_function": args.custom_tis_function_path, "ignored": ignored,
                          "ignored_yaml_keys": ignored_yaml}, indent=2, default=str))
        return 0
    lines = ["slime-rc: the rollout-correction settings inside slime", f"  precedence: {SLIME_PRECEDENCE}", ""]
    lines += _runs_lines(runs) + ["  slime's args after parsing and copying the YAML (the attributes the adapters "
                                  "read):"]
    lines += _table(("attribute", "value", "source"), [(k, repr(v), s) for k, v, s in rows]) + [""]
    lines += ["  custom_tis.mis applies slime's example mis.py semantics (docs/slime.md) with:"]
    lines += _table(("key", "value", "source"), [(k, repr(v), s) for k, v, s in mis_rows])
    clip, low = getattr(view, "tis_clip", 2.0), getattr(view, "tis_clip_low", 0)
    lines += [f"  custom_tis.tis / custom_tis.icepop (and slime's built-in TIS / IcePop) use tis_clip={clip!r}, "
              f"tis_clip_low={low!r}",
              f"  TIS function: {args.custom_tis_function_path or 'none (slime runs its built-in vanilla TIS)'}", ""]
    lines += [f"note: {n}" for n in notes]
    if ignored:
        lines.append(f"ignored (not rollout-correction flags): {' '.join(ignored)}")
    if ignored_yaml:
        lines.append(f"ignored YAML keys (not slime-rc's: slime's or other plugins'): {', '.join(ignored_yaml)}")
    sys.stdout.write("\n".join(lines).rstrip() + "\n")
    return 0


def _command_parser(prog: str, usage: str, description: str, commands: Dict[str, str]) -> argparse.ArgumentParser:
    """A parser whose --help lists ``commands`` (name -> what it does); each command parses its own flags."""
    parser = argparse.ArgumentParser(prog=prog, usage=usage, description=description,
                                     epilog=f"Run {prog} COMMAND --help for a command's flags.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in commands.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The top-level ``slime-rc`` parser: its --help lists the commands with what each does.  Each command parses
    its own flags (:func:`main` hands them over), so ``slime-rc --help`` imports no command's module."""
    return _command_parser("slime-rc", "slime-rc COMMAND [flags...]",
                           "Rollout correction for RL on Megatron + SGLang: train, inspect a configuration, analyze a "
                           "log-prob dump, plot runs.", COMMANDS)


def build_config_parser() -> argparse.ArgumentParser:
    """The ``slime-rc config`` parser: the rollout-correction flags as slime-rc's own launches define them."""
    parser = argparse.ArgumentParser(prog="slime-rc config", allow_abbrev=False, description=CONFIG_DESCRIPTION,
                                     usage="%(prog)s [launch flags...] [--json] [--slime]")
    add_rollout_correction_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--slime", action="store_true",
                        help="resolve as slime does: slime's own flags and defaults, the YAML over the flags "
                             "(see slime-rc config --slime --help)")
    return parser


def build_study_parser() -> argparse.ArgumentParser:
    """The ``slime-rc study`` parser, for its --help: the two study commands with what each does."""
    return _command_parser("slime-rc study", "slime-rc study {estimators,summary} [flags...]",
                           "Studies of rollout correction: the estimators' bias and variance on a toy policy, or the "
                           "summary table of a directory of runs.", STUDY_COMMANDS)


def build_summary_parser() -> argparse.ArgumentParser:
    """The ``slime-rc study summary`` parser: one optional directory."""
    parser = argparse.ArgumentParser(prog="slime-rc study summary", allow_abbrev=False,
                                     description="Print the table of a study directory: per configuration the seeds, "
                                                 "final reward, collapses, gradient norm, mismatch (k3), rejected "
                                                 "fraction, effective sample size and step time.")
    parser.add_argument("dir", nargs="?", default="runs/study", metavar="DIR",
                        help="the study directory, <config>/seed<k>/metrics.jsonl (default runs/study)")
    return parser


def parse_with_hints(parser: argparse.ArgumentParser, argv: List[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown flag is refused naming the closest real flag."""
    args, leftover = parser.parse_known_args(argv)
    if leftover:
        parser.error(unknown_flags_message(leftover, parser._option_string_actions))  # no public option index
    return args


@contextlib.contextmanager
def unknown_flags_hinted() -> Iterator[None]:
    """While a command runs, argparse's ``parse_args`` refuses an unknown flag naming the closest real flag
    (:func:`slime_rc.config._text.unknown_flags_message`) instead of only listing it.

    Why here: ``plot``, ``analyze`` and ``study estimators`` build their parsers inside their own ``main``; this
    gives them the same hint as ``train`` and ``config`` without reaching into them.  The replacement does exactly
    what argparse's ``parse_args`` does (``parse_known_args``, then ``error`` on leftovers), with a longer message
    that still starts with argparse's ``unrecognized arguments: ...``; the original is restored on the way out."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        parsed, leftover = self.parse_known_args(args, namespace)
        if leftover:
            self.error(unknown_flags_message(leftover, self._option_string_actions))
        return parsed

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _usage_error(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _unknown_command(prog: str, given: str, commands: Dict[str, str]) -> int:
    """An unknown command, named with the closest real one (``slime-rc trian`` -> ``train``)."""
    hint = did_you_mean_any(given, commands)
    return _usage_error(prog, f"unknown command {given!r}.{hint} Commands: {', '.join(commands)} "
                              f"({prog} --help says what each does)")


def near_miss_flags(ignored: List[str], known: List[str], prog: str, why: str) -> Optional[str]:
    """The refusal for the first flag of ``ignored`` (the flags a config parser left) that is a typo of one of
    ``known`` (:func:`slime_rc.config._text.near_miss`: the tight cutoff that leaves Megatron's and slime's own
    flags alone), or None.  ``why``: what would happen to the flag."""
    for token in ignored:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--") or flag.startswith("--no-"):  # --no-X of slime's store_true: _dropped_no_flags
            continue
        match = near_miss(flag, known)
        if match:
            return (f"unknown flag {flag!r} ({why}). Did you mean {match!r}? Flags of other tools are ignored, but "
                    f"a near miss of a rollout-correction flag is refused ({prog} --help lists them)")
    return None


def _config(argv: List[str]) -> int:
    """``slime-rc config [--slime] ...``."""
    if "--slime" in argv:
        parser = build_slime_parser()
        args, ignored = parser.parse_known_args(argv)
        why = "slime's parse_known_args would drop it without a word"
        prog = "slime-rc config --slime"
        command = _slime_config_command
    else:
        parser = build_config_parser()
        args, ignored = parser.parse_known_args(argv)
        why, prog, command = "it would be ignored", "slime-rc config", _config_command
    refusal = near_miss_flags(ignored, list(parser._option_string_actions), prog, why)
    if refusal:
        return _usage_error(prog, refusal)
    try:
        return command(args, ignored)
    except (ValueError, OSError) as e:
        return _usage_error(prog, str(e))


def _study(argv: List[str]) -> int:
    """``slime-rc study estimators ...`` / ``slime-rc study summary [DIR]``."""
    if not argv:
        return _usage_error("slime-rc study", "choose 'estimators' (bias/variance of the estimators) or 'summary DIR' "
                                              "(table of examples/mismatch_study.sh)")
    if argv[0] in ("-h", "--help"):
        build_study_parser().print_help()
        return 0
    if argv[0] == "estimators":
        from slime_rc.tools.estimators import main as estimators_main
        with unknown_flags_hinted():
            return estimators_main(argv[1:])
    if argv[0] == "summary":
        from slime_rc.demo.train.study import main as summary_main
        return summary_main([parse_with_hints(build_summary_parser(), argv[1:]).dir])
    return _unknown_command("slime-rc study", argv[0], STUDY_COMMANDS)


def _train(argv: List[str]) -> int:
    from slime_rc.demo.train.launch import main as train_main
    return train_main(argv)


def _plot(argv: List[str]) -> int:
    from slime_rc.demo.train.plot import main as plot_main
    with unknown_flags_hinted():
        return plot_main(argv)


def _analyze(argv: List[str]) -> int:
    from slime_rc.tools.analyze import main as analyze_main
    with unknown_flags_hinted():
        return analyze_main(argv)


DISPATCH: Dict[str, Callable[[List[str]], int]] = {"train": _train, "plot": _plot, "analyze": _analyze,
                                                   "study": _study, "config": _config}


def main(argv: Optional[List[str]] = None) -> int:
    """``slime-rc COMMAND [flags...]``: the command's exit status (2 for a usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        build_parser().print_help(sys.stderr)
        return _usage_error("slime-rc", f"choose a command: {', '.join(COMMANDS)}")
    if argv[0] in ("-h", "--help"):
        build_parser().print_help()
        return 0
    if argv[0] not in DISPATCH:
        return _unknown_command("slime-rc", argv[0], COMMANDS)
    return DISPATCH[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
