"""The ``slime-rc`` command.

``slime-rc train [flags...]`` runs the main job (:mod:`slime_rc.train.launch`); ``slime-rc plot RUN_DIR... -o
FILE.png`` draws its curves (:mod:`slime_rc.train.plot`); ``slime-rc analyze DUMP`` reports the mismatch of a log-prob
dump (:mod:`slime_rc.analyze`); ``slime-rc study estimators`` measures the estimators' bias and variance
(:mod:`slime_rc.estimators`), ``slime-rc study summary DIR`` summarises a mismatch study (:mod:`slime_rc.train.study`).

``slime-rc config [launch flags...] [--json]`` prints the resolved rollout-correction configuration: the operating
mode and every IS/RS setting with where it came from (flag / YAML / preset / default).  Paste a whole launch line:
flags that are not rollout-correction flags are listed as ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .arguments import add_rollout_correction_arguments, resolve_args
from .config import RolloutCorrectionConfig

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


def report(config: RolloutCorrectionConfig, sources: dict, notes: List[str], tis_function: Optional[str],
           ignored: List[str]) -> str:
    first = ("mode", "loss_type", "get_mismatch_metrics")
    order = list(first) + [n for n in sources if n not in first]
    rows = [(name, _value(config, name), sources[name]) for name in order]
    width = max(len(r[0]) for r in rows) + 2
    vwidth = max(len(r[1]) for r in rows) + 2
    lines = ["slime-rc: resolved rollout-correction configuration", "",
             f"  {MODE_TEXT[(config.mode, config.loss_type)]}",
             f"  TIS function: {tis_function or 'built-in engine (slime_rc.compute_rollout_correction)'}", "",
             f"  {'setting'.ljust(width)}{'value'.ljust(vwidth)}source"]
    lines += [f"  {n.ljust(width)}{v.ljust(vwidth)}{s}" for n, v, s in rows]
    lines += [""] + [f"note: {n}" for n in notes]
    if ignored:
        lines.append(f"ignored (not rollout-correction flags): {' '.join(ignored)}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime-rc", description="Rollout correction for RL on Megatron + SGLang.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("train", help="run GRPO training with rollout correction (see slime-rc train --help)",
                        add_help=False)
    commands.add_parser("plot", help="plot metrics.jsonl of runs (see slime-rc plot --help)", add_help=False)
    commands.add_parser("analyze", help="mismatch report of a log-prob dump (see slime-rc analyze --help)",
                        add_help=False)
    commands.add_parser("study", help="'study estimators': bias/variance of the estimators; 'study summary DIR': "
                                      "table of a mismatch study", add_help=False)
    config = commands.add_parser("config", help="print the resolved rollout-correction configuration",
                                 description=__doc__.split("\n\n")[1], allow_abbrev=False)
    add_rollout_correction_arguments(config)
    config.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from .train.launch import main as train_main
        return train_main(argv[1:])
    if argv[:1] == ["plot"]:
        from .train.plot import main as plot_main
        return plot_main(argv[1:])
    if argv[:1] == ["analyze"]:
        from .analyze import main as analyze_main
        return analyze_main(argv[1:])
    if argv[:2] == ["study", "estimators"]:
        from .estimators import main as estimators_main
        return estimators_main(argv[2:])
    if argv[:2] == ["study", "summary"]:
        from .train.study import main as summary_main
        return summary_main(argv[2:])
    if argv[:1] == ["study"]:
        print("slime-rc study: error: choose 'estimators' (bias/variance of the estimators) or 'summary DIR' (table "
              "of examples/mismatch_study.sh)", file=sys.stderr)
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
