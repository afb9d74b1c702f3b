"""The ``slime-rc`` command.

``slime-rc train [flags...]`` runs the main job (:mod:`slime_rc.demo.train.launch`); ``slime-rc plot RUN_DIR... -o
FILE.png`` draws its curves, ``slime-rc plot STUDY_DIR -o FILE.png`` a study's mean over seeds per configuration
(:mod:`slime_rc.demo.train.plot`); ``slime-rc analyze DUMP`` reports the mismatch of a log-prob
dump (:mod:`slime_rc.tools.analyze`); ``slime-rc study estimators`` measures the estimators' bias and variance
(:mod:`slime_rc.tools.estimators`), ``slime-rc study summary DIR`` summarises a mismatch study (:mod:`slime_rc.demo.train.study`).

``slime-rc config [launch flags...] [--json]`` prints the resolved rollout-correction configuration: the operating
mode and every IS/RS setting with where it came from (flag / YAML / preset / default), with the precedence of
slime-rc's own launches (slime-rc train, Megatron's extra_args_provider): flag > YAML > preset > default.  Paste a
whole launch line: flags that are not rollout-correction flags are listed as ignored.

``slime-rc config --slime [slime launch flags...]`` shows what slime makes of the same line: slime's own flags
(--use-tis, --tis-clip, --eps-clip, ...) with slime's definitions and defaults, then the --custom-config-path YAML
copied onto args over the flags (YAML > flag > preset > default), as the attributes the adapters read, each with
its source, and the configuration slime-rc's engine resolves from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Tuple

from slime_rc.config.arguments import (SLIME_OWNED_FLAGS, add_rollout_correction_arguments, add_slime_owned_arguments,
                                      resolve_args)
from slime_rc.config.knobs import ALL_FLAGS, SPELLINGS
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.config.yaml_config import SLIME_LOSS_TYPES, load_yaml_layer
from slime_rc.slime.settings import beyond_slime, explain

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


def report(config: RolloutCorrectionConfig, sources: dict, notes: List[str], tis_function: Optional[str],
           ignored: List[str], *, slime_args: Optional[List[Tuple[str, str, str]]] = None,
           ignored_yaml: List[str] = ()) -> str:
    """The text ``slime-rc config`` prints; ``slime_args``: the (attribute, value, source) rows of
    ``slime-rc config --slime``."""
    first = ("mode", "loss_type", "get_mismatch_metrics")
    order = list(first) + [n for n in sources if n not in first]
    rows = [(name, _value(config, name), sources[name]) for name in order]
    if slime_args is None:
        lines = ["slime-rc: resolved rollout-correction configuration", f"  precedence: {PRECEDENCE}", ""]
    else:
        lines = ["slime-rc: the rollout-correction settings inside slime", f"  precedence: {SLIME_PRECEDENCE}", "",
                 "  slime's args after parsing and copying the YAML (the attributes the adapters read):"]
        lines += _table(("attribute", "value", "source"), [(k, repr(v), s) for k, v, s in slime_args]) + [
            "", "  resolved by slime-rc's engine (custom_tis adapters with a preset or engine-only settings):"]
    lines += [f"  {MODE_TEXT[(config.mode, config.loss_type)]}",
              f"  TIS function: {tis_function or 'built-in engine (slime_rc.compute_rollout_correction)'}", ""]
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
                                     description=__doc__.split("\n\n")[2])
    add_rollout_correction_arguments(parser, slime=True)
    add_slime_owned_arguments(parser)
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


def _slime_config_command(args: argparse.Namespace, ignored: List[str]) -> int:
    # what slime would misread in the YAML (1e-4, quoted numbers, our loss_type under slime's key, near-misses of
    # our keys) is an error before anything is printed
    ignored_yaml = load_yaml_layer(args.custom_config_path, slime=True).ignored if args.custom_config_path else []
    ignored_yaml = [k for k in ignored_yaml if k not in _flag_of_attribute()]  # rollout_correction_preset: ours
    data = _slime_yaml(args)
    rows, notes = slime_args_rows(args, data)
    notes += _dropped_no_flags(ignored)
    view = copy_yaml_as_slime(args, data)  # what the adapters get: slime's args after the YAML is copied on
    beyond = beyond_slime(view)
    if beyond is None:  # custom_tis.mis applies slime's example semantics: show those, not the engine's
        return _slime_semantics_report(args, rows, notes, ignored, ignored_yaml, view)
    notes.append(f"custom_tis.mis runs slime-rc's engine for these settings ({beyond} goes beyond slime's example "
                 f"mis.py; docs/slime.md).")
    try:
        resolution, refused = resolve_args(view, slime=True), None
    except ValueError as e:
        resolution, refused = None, str(e)
    slime_args = {k: {"value": v, "source": s} for k, v, s in rows}
    if args.json:
        config = resolution.config if resolution else None
        print(json.dumps({"precedence": SLIME_PRECEDENCE, "slime_args": slime_args,
                          "config": config.to_dict() if config else None,
                          "sources": resolution.sources if resolution else None,
                          "notes": notes + (resolution.notes if resolution else []), "engine_error": refused,
                          "is_weights_applied": config.is_weights_applied if config else None,
                          "tis_function": args.custom_tis_function_path, "ignored": ignored,
                          "ignored_yaml_keys": ignored_yaml}, indent=2, default=str))
    elif resolution is not None:
        sys.stdout.write(report(resolution.config, resolution.sources, notes + resolution.notes,
                                args.custom_tis_function_path, ignored, slime_args=rows, ignored_yaml=ignored_yaml))
    else:
        lines = ["slime-rc: the rollout-correction settings inside slime", f"  precedence: {SLIME_PRECEDENCE}", "",
                 "  slime's args after parsing and copying the YAML (the attributes the adapters read):"]
        lines += _table(("attribute", "value", "source"), [(k, repr(v), s) for k, v, s in rows]) + [""]
        lines += [f"note: {n}" for n in notes]
        sys.stdout.write("\n".join(lines).rstrip() + "\n")
    if refused is not None:
        print(f"slime-rc config --slime: error: slime-rc's engine refuses these settings: {refused}",
              file=sys.stderr)
        return 2
    return 0


def _slime_semantics_report(args, rows, notes, ignored, ignored_yaml, view) -> int:
    """``slime-rc config --slime`` when ``custom_tis.mis`` applies slime's example semantics (docs/slime.md)."""
    settings, mis_rows, defect_notes = explain(view)
    notes = notes + list(defect_notes)
    if args.json:
        print(json.dumps({"precedence": SLIME_PRECEDENCE, "semantics": "slime's example mis.py",
                          "slime_args": {k: {"value": v, "source": s} for k, v, s in rows},
                          "mis_settings": {k: {"value": v, "source": s} for k, v, s in mis_rows},
                          "notes": notes, "tis_function": args.custom_tis_function_path, "ignored": ignored,
                          "ignored_yaml_keys": ignored_yaml}, indent=2, default=str))
        return 0
    lines = ["slime-rc: the rollout-correction settings inside slime", f"  precedence: {SLIME_PRECEDENCE}", "",
             "  slime's args after parsing and copying the YAML (the attributes the adapters read):"]
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime-rc", description="Rollout correction for RL on Megatron + SGLang.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("train", help="run GRPO training with rollout correction (see slime-rc train --help)",
                        add_help=False)
    commands.add_parser("plot", help="plot metrics.jsonl of runs, or of a study directory (see slime-rc plot --help)", add_help=False)
    commands.add_parser("analyze", help="mismatch report of a log-prob dump (see slime-rc analyze --help)",
                        add_help=False)
    commands.add_parser("study", help="'study estimators': bias/variance of the estimators; 'study summary DIR': "
                                      "table of a mismatch study", add_help=False)
    config = commands.add_parser("config", help="print the resolved rollout-correction configuration",
                                 description=__doc__.split("\n\n")[1], allow_abbrev=False)
    add_rollout_correction_arguments(config)
    config.add_argument("--json", action="store_true", help="print JSON instead of a table")
    config.add_argument("--slime", action="store_true",
                        help="resolve as slime does: slime's own flags and defaults, the YAML over the flags "
                             "(see slime-rc config --slime --help)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from slime_rc.demo.train.launch import main as train_main
        return train_main(argv[1:])
    if argv[:1] == ["plot"]:
        from slime_rc.demo.train.plot import main as plot_main
        return plot_main(argv[1:])
    if argv[:1] == ["analyze"]:
        from slime_rc.tools.analyze import main as analyze_main
        return analyze_main(argv[1:])
    if argv[:2] == ["study", "estimators"]:
        from slime_rc.tools.estimators import main as estimators_main
        return estimators_main(argv[2:])
    if argv[:2] == ["study", "summary"]:
        from slime_rc.demo.train.study import main as summary_main
        return summary_main(argv[2:])
    if argv[:1] == ["study"]:
        print("slime-rc study: error: choose 'estimators' (bias/variance of the estimators) or 'summary DIR' (table "
              "of examples/mismatch_study.sh)", file=sys.stderr)
        return 2
    if argv[:1] == ["config"] and "--slime" in argv[1:]:
        args, ignored = build_slime_parser().parse_known_args(argv[1:])
        try:
            return _slime_config_command(args, ignored)
        except (ValueError, OSError) as e:
            print(f"slime-rc config --slime: error: {e}", file=sys.stderr)
            return 2
    parser = build_parser()
    args, ignored = parser.parse_known_args(argv)
    try:
        return _config_command(args, ignored)
    except ValueError as e:
        print(f"slime-rc {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
