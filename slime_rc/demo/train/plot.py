"""``slime-rc plot RUN_DIR [RUN_DIR ...] -o curves.png``: reward, mismatch KL / k3, IS effective sample size and
rejected fractions against step, one line per run (from each run's ``metrics.jsonl``).

``slime-rc plot STUDY_DIR -o curves.png`` (a directory of ``<config>/seed<k>/metrics.jsonl``, as
``examples/collapse_study.sh`` writes): one curve per configuration -- the mean over its seeds at each GRPO step, with
a band from the lowest to the highest seed on the linear panels -- of the reward, grad norm, mismatch k3 KL, IS effective sample size,
rejected token fraction and exact-answer fraction (:func:`plot_study`).

Warm-start steps (``"warm_start": true``) are left out: the x axis counts GRPO steps from 0.  A run (or a study's
configuration) without a panel's metric -- no correction and no ``--get-mismatch-metrics``, or a
``--custom-tis-function-path`` run whose metrics went under another prefix -- is named, with the missing metric, in
a ``note:`` line and in a corner of that panel (:func:`left_out`), never silently absent.  Needs matplotlib
(``pip install slime-rc[plot]``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Tuple

from slime_rc.demo.train.study import is_study_dir, read_run, study_runs

DESCRIPTION = ("Plot runs' curves against the GRPO step: reward, mismatch KL and k3, IS effective sample size, "
               "rejected fraction and grad norm, one line per run (from each run's metrics.jsonl); given a study "
               "directory (<config>/seed<k>/metrics.jsonl), one curve per configuration, the mean over its seeds.")

PANELS = (("reward_mean", "mean reward"), ("rollout_corr/k3_kl", "mismatch k3 KL"), ("rollout_corr/kl", "mismatch KL"),
          ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size"),
          ("rollout_corr/rejected_token_fraction", "rejected token fraction"),
          ("grad_norm", "grad norm"))


STUDY_PANELS = (("reward_mean", "mean reward"), ("grad_norm", "grad norm"), ("rollout_corr/k3_kl", "mismatch k3 KL"),
                ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size"),
                ("rollout_corr/rejected_token_fraction", "rejected token fraction"),
                ("exact_fraction", "exact answers (fraction)"))


LOG_PANELS = ("grad_norm", "rollout_corr/k3_kl")  # drawn on a log axis, mean only
# a panel's metric -> the older name a run may have logged it under (runs from before rejected_token_fraction)
OLDER_NAMES = {"rollout_corr/rejected_token_fraction": "rollout_corr/rollout_rs_masked_fraction"}
TIS_FUNCTION_PREFIX = "rollout_corr/tis_function/"  # where a --custom-tis-function-path function's metrics go


def panel_key(rows: List[dict], key: str) -> Optional[str]:
    """The name under which ``rows`` hold a panel's metric ``key`` (``key`` itself, else its :data:`OLDER_NAMES`
    entry), or None when no row has a value for either."""
    for name in (key, OLDER_NAMES.get(key)):
        if name and any(r.get(name) is not None for r in rows):
            return name
    return None


def left_out(runs: Dict[str, List[dict]], panels) -> Dict[str, List[Tuple[str, str]]]:
    """``{run: [(metric, panel title), ...]}``: the panels each run is missing from because none of its rows has
    the panel's metric (runs missing from no panel are not listed)."""
    out = {}
    for name, rows in runs.items():
        missing = [(key, title) for key, title in panels if panel_key(rows, key) is None]
        if missing:
            out[name] = missing
    return out


def _why(rows: List[dict]) -> str:
    """A likely reason for missing mismatch metrics, read off the run's own keys."""
    if any(k.startswith(TIS_FUNCTION_PREFIX) for r in rows for k in r):
        return (f" (its correction metrics are under {TIS_FUNCTION_PREFIX}...: a --custom-tis-function-path run "
                f"logs its function's own names)")
    if not any(k.startswith("rollout_corr/") for r in rows for k in r):
        return " (it logged no rollout_corr/ metric: no correction and no --get-mismatch-metrics?)"
    return ""


def left_out_lines(runs: Dict[str, List[dict]], panels, what: str = "run") -> List[str]:
    """One ``note:`` line per run (``what``: "run" or "configuration") left out of a panel: which metric is
    missing, from which panel."""
    return [f"note: {what} {os.path.relpath(name) if what == 'run' else name} has no "
            + ", ".join(key for key, _ in missing) + " in its metrics.jsonl: left out of the panel(s) "
            + ", ".join(f"'{title}'" for _, title in missing) + _why(runs[name])
            for name, missing in left_out(runs, panels).items()]


def _mark_left_out(ax, names: List[str]) -> None:
    """Name the runs a panel leaves out in its lower-left corner, so the figure says it too."""
    if names:
        ax.text(0.01, 0.01, "not in this panel (metric not logged): " + ", ".join(names), transform=ax.transAxes,
                fontsize=6, color="0.35", va="bottom")


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
        missing = []
        for name, rows in runs.items():
            keyed = panel_key(rows, key)
            if keyed is None:
                missing.append(os.path.relpath(name))
                continue
            xs = [r["step"] for r in rows if r.get(keyed) is not None]
            ys = [r[keyed] for r in rows if r.get(keyed) is not None]
            ax.plot(xs, ys, label=os.path.relpath(name), linewidth=1.2, **style[name])
        _mark_left_out(ax, missing)
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
        missing = []
        for i, (config, runs) in enumerate(study.items()):
            keyed = panel_key([r for rows in runs.values() for r in rows], key)
            steps, mean, low, high = seed_band(list(runs.values()), keyed) if keyed else ([], [], [], [])
            if not steps:
                missing.append(config)
                continue
            ax.plot(steps, mean, linewidth=1.3, label=f"{config} ({len(runs)} seeds)", **_style(i))
            if key not in LOG_PANELS:  # on a log axis a band down to a 0 (a step without signal) hides the curves
                ax.fill_between(steps, low, high, color=_style(i)["color"], alpha=0.08, linewidth=0)
        _mark_left_out(ax, missing)
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
    parser = argparse.ArgumentParser(prog="slime-rc plot", description=DESCRIPTION)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR",
                        help="run directories (each with metrics.jsonl), or one study directory "
                             "(<config>/seed<k>/metrics.jsonl)")
    parser.add_argument("-o", "--output", default="curves.png")
    args = parser.parse_args(argv)
    try:
        if len(args.runs) == 1 and is_study_dir(args.runs[0]):
            study = plot_study(args.runs[0], args.output)
            notes = left_out_lines({c: [r for rows in runs.values() for r in rows] for c, runs in study.items()},
                                   STUDY_PANELS, what="configuration")
        else:
            notes = left_out_lines(plot_runs(args.runs, args.output), PANELS)
    except ValueError as e:
        print(f"slime-rc plot: error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("slime-rc plot: error: matplotlib is not installed; pip install 'slime-rc[plot]'", file=sys.stderr)
        return 2
    for line in notes:
        print(line)
    print(f"wrote {args.output}")
    return 0
