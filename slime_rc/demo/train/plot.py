"""``slime-rc plot RUN_DIR [RUN_DIR ...] -o curves.png``: reward, mismatch KL / k3, IS effective sample size and
rejected fractions against step, one line per run (from each run's ``metrics.jsonl``).  Needs matplotlib
(``pip install slime-rc[plot]``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

PANELS = (("reward_mean", "mean reward"), ("rollout_corr/k3_kl", "mismatch k3 KL"), ("rollout_corr/kl", "mismatch KL"),
          ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size"),
          ("rollout_corr/rollout_rs_masked_fraction", "rejected token fraction"),
          ("grad_norm", "grad norm"))


def read_run(run_dir: str) -> List[dict]:
    """The per-step metrics of a run directory (``metrics.jsonl``); a clear error names a missing or bad file."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it a slime-rc train --output-dir?)")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return rows


def plot_runs(run_dirs: List[str], output: str) -> Dict[str, List[dict]]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {d.rstrip("/"): read_run(d) for d in run_dirs}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    color = {name: f"C{i % 10}" for i, name in enumerate(runs)}  # one colour per run in every panel
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, rows in runs.items():
            xs = [r["step"] for r in rows if r.get(key) is not None]
            ys = [r[key] for r in rows if r.get(key) is not None]
            if xs:
                ax.plot(xs, ys, label=os.path.relpath(name), linewidth=1.2, color=color[name])
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "rollout_corr/k3_kl":
            ax.set_yscale("symlog", linthresh=1e-6)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return runs


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="slime-rc plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("-o", "--output", default="curves.png")
    args = parser.parse_args(argv)
    try:
        plot_runs(args.runs, args.output)
    except ValueError as e:
        print(f"slime-rc plot: error: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print("slime-rc plot: error: matplotlib is not installed; pip install 'slime-rc[plot]'", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
