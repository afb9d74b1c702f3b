"""``slime-rc plot RUN_DIR [RUN_DIR ...] -o curves.png``: reward, mismatch KL / k3, IS effective sample size and
rejected fractions against step, one line per run (from each run's ``metrics.jsonl``).

``slime-rc plot STUDY_DIR -o curves.png`` (a directory of ``<config>/seed<k>/metrics.jsonl``, as
``examples/collapse_study.sh`` writes): one curve per configuration -- the mean over its seeds at each GRPO step, with
a band from the lowest to the highest seed on the linear panels -- of the reward, grad norm, mismatch k3 KL, IS effective sample size,
rejected token fraction and exact-answer fraction (:func:`plot_study`).

Warm-start steps (``"warm_start": true``) are left out: the x axis counts GRPO steps from 0.  Needs matplotlib
(``pip install slime-rc[plot]``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional

from slime_rc.demo.train.study import is_study_dir, read_run, study_runs

PANELS = (("reward_mean", "mean reward"), ("rollout_corr/k3_kl", "mismatch k3 KL"), ("rollout_corr/kl", "mismatch KL"),
          ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size"),
          ("rollout_corr/rollout_rs_masked_fraction", "rejected token fraction"),
          ("grad_norm", "grad norm"))


STUDY_PANELS = (("reward_mean", "mean reward"), ("grad_norm", "grad norm"), ("rollout_corr/k3_kl", "mismatch k3 KL"),
                ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size"),
                ("rollout_corr/rejected_token_fraction", "rejected token fraction"),
                ("exact_fraction", "exact answers (fraction)"))


LOG_PANELS = ("grad_norm", "rollout_corr/k3_kl")  # drawn on a log axis, mean only


def _grpo(rows: List[dict]) -> List[dict]:
    """The GRPO steps of a run, ``step`` renumbered from 0 (warm-start rows left out)."""
    grpo = [r for r in rows if not r.get("warm_start")]
    return [{**r, "step": i} for i, r in enumerate(grpo)]


def _style(i: int) -> dict:
    """Line style of the ``i``-th run or configuration: matplotlib's ten colours, then the same colours dashed, dotted,
    dash-dotted (a study of more than ten configurations stays readable)."""
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[i // 10 % 4]}


def plot_runs(run_dirs: List[str], output: str) -> Dict[str, List[dict]]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {d.rstrip("/"): _grpo(read_run(d)) for d in run_dirs}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    style = {name: _style(i) for i, name in enumerate(runs)}  # one style per run in every panel
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            xs = [r["step"] for r in rows if r.get(key) is not None]
            ys = [r[key] for r in rows if r.get(key) is not None]
            if xs:
                ax.plot(xs, ys, label=os.path.relpath(name), linewidth=1.2, **style[name])
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "rollout_corr/k3_kl":
            ax.set_yscale("symlog", linthresh=1e-6)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return runs


def seed_band(runs: List[List[dict]], key: str):
    """``(steps, mean, low, high)`` over the seeds' GRPO rows (:func:`_grpo`) at each step where at least one seed
    has ``key``: the mean over the seeds that have it, and their lowest and highest value."""
    by_step: Dict[int, List[float]] = {}
    for rows in runs:
        for r in rows:
            v = r.get(key)
            if v is not None and math.isfinite(float(v)):
                by_step.setdefault(r["step"], []).append(float(v))
    steps = sorted(by_step)
    return (steps, [sum(by_step[x]) / len(by_step[x]) for x in steps], [min(by_step[x]) for x in steps],
            [max(by_step[x]) for x in steps])


def plot_study(study_dir: str, output: str) -> Dict[str, Dict[str, List[dict]]]:
    """One figure of a study directory (module docstring): per configuration, the mean over seeds and the band from
    the lowest to the highest seed.  Returns ``{config: {seed: GRPO rows}}``."""

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    study = {c: {k: _grpo(v) for k, v in runs.items()} for c, runs in study_runs(study_dir).items()}
    if not study:
        raise ValueError(f"{study_dir}: no <config>/seed<k>/metrics.jsonl with a GRPO step")
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    for ax, (key, title) in zip(axes.flat, STUDY_PANELS):
        for i, (config, runs) in enumerate(study.items()):
            keyed = key
            if key == "rollout_corr/rejected_token_fraction" and not any(key in r for rows in runs.values()
                                                                         for r in rows):
                keyed = "rollout_corr/rollout_rs_masked_fraction"  # runs from before rejected_token_fraction
            steps, mean, low, high = seed_band(list(runs.values()), keyed)
            if not steps:
                continue
            ax.plot(steps, mean, linewidth=1.3, label=f"{config} ({len(runs)} seeds)", **_style(i))
            if key not in LOG_PANELS:  # on a log axis a band down to a 0 (a step without signal) hides the curves
                ax.fill_between(steps, low, high, color=_style(i)["color"], alpha=0.08, linewidth=0)
        ax.set_title(title)
        ax.set_xlabel("GRPO step")
        if key in LOG_PANELS:
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{os.path.basename(os.path.abspath(study_dir))}: mean over seeds; band = lowest to highest seed "
                 f"(linear panels)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return study


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="slime-rc plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (each with metrics.jsonl), or one study directory "
                             "(<config>/seed<k>/metrics.jsonl)")
    parser.add_argument("-o", "--output", default="curves.png")
    args = parser.parse_args(argv)
    try:
        if len(args.runs) == 1 and is_study_dir(args.runs[0]):
            plot_study(args.runs[0], args.output)
        else:
            plot_runs(args.runs, args.output)
    except ValueError as e:
        print(f"slime-rc plot: error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("slime-rc plot: error: matplotlib is not installed; pip install 'slime-rc[plot]'", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
