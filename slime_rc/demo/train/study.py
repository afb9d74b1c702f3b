"""What a run did, and a table of a study: ``python -m slime_rc.demo.train.study OUT_DIR`` (or ``slime-rc study
summary OUT_DIR``) reads ``OUT_DIR/<config>/seed<k>/metrics.jsonl`` (``examples/collapse_study.sh``,
``examples/mismatch_study.sh``) and prints a markdown table, one row per configuration.

One run (:func:`run_summary`, also what ``slime-rc train`` prints at the end of a run and writes to
``summary.json``), over its GRPO steps only (warm-start steps, the rows with ``"warm_start": true``, are left out):

* ``final_reward``: the mean ``reward_mean`` of the last :data:`WINDOW` (10) steps (all of them when fewer);
* ``peak_reward``: the largest mean of :data:`WINDOW` consecutive steps (the same window, so ``final <= peak``);
* ``collapsed``: ``final_reward < COLLAPSE_FRACTION (0.8) x peak_reward`` -- the run lost a fifth of what it had
  learned;
* ``rejected_tokens`` / ``loss_tokens`` / ``rejected_fraction``: response tokens the correction removed from the loss
  (RS, veto, mask mode: ``rollout_corr/rejected_token_fraction`` times each micro-batch's tokens, logged as the
  step's ``rejected_tokens``), over all steps; ``None`` when the run did not log them;
* ``mean_ess``: the mean over steps of ``rollout_corr/rollout_is_eff_sample_size`` (``None`` without IS weights);
* ``worst_k3`` (``worst_k3_step``): the largest ``rollout_corr/k3_kl`` (``None`` without mismatch metrics);
* ``worst_grad_norm`` (``worst_grad_norm_step``): the largest ``grad_norm`` of the GRPO steps;
* ``mean_step_s``: the mean ``time/step`` of the GRPO steps.

The ``*_step`` values are ``metrics.jsonl``'s ``step`` (warm-start steps count first); the printed lines
(:func:`summary_lines`) count GRPO steps from 1, as the per-step lines do.

A run still in progress counts with the steps it has logged (it has no ``summary.json`` yet).

The study's table (:func:`summarize`): per configuration the number of seeds, final reward (mean ± std over
seeds), how many seeds collapsed, the worst grad norm over steps and seeds, mean and worst k3, the rejected token
fraction (all tokens of all seeds), the mean ESS and the mean step time.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
import sys
from typing import Dict, List, Optional

WINDOW = 10  # final reward: the mean of the last WINDOW steps; peak: the best mean of WINDOW consecutive steps
COLLAPSE_FRACTION = 0.8  # collapsed: final < COLLAPSE_FRACTION x peak
K3, ESS, REJECTED = ("rollout_corr/k3_kl", "rollout_corr/rollout_is_eff_sample_size",
                     "rollout_corr/rejected_token_fraction")


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


def grpo_rows(rows: List[dict]) -> List[dict]:
    """The GRPO steps of a run's metrics (warm-start rows left out)."""
    return [r for r in rows if not r.get("warm_start")]


def _values(rows: List[dict], key: str) -> List[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]


def _worst(rows: List[dict], key: str):
    best = None
    for r in rows:
        v = r.get(key)
        if v is not None and math.isfinite(float(v)) and (best is None or float(v) > best[0]):
            best = (float(v), r["step"])
    return best if best is not None else (None, None)


def run_summary(rows: List[dict]) -> dict:
    """The summary of one run's metrics rows (module docstring).  ``ValueError`` when it has no GRPO step."""
    warm = [r for r in rows if r.get("warm_start")]
    grpo = grpo_rows(rows)
    if not grpo:
        raise ValueError("no GRPO step in the run's metrics")
    rewards = [float(r["reward_mean"]) for r in grpo]
    w = min(WINDOW, len(rewards))
    final = statistics.mean(rewards[-w:])
    peak = max(statistics.mean(rewards[i:i + w]) for i in range(len(rewards) - w + 1))
    out = {"grpo_steps": len(grpo), "warm_start_steps": len(warm), "final_reward": final,
           "final_window": w, "peak_reward": peak, "collapsed": bool(final < COLLAPSE_FRACTION * peak)}
    counted = [r for r in grpo if r.get("rejected_tokens") is not None and r.get("loss_tokens") is not None]
    if counted and len(counted) == len(grpo):
        rejected, tokens = sum(int(r["rejected_tokens"]) for r in grpo), sum(int(r["loss_tokens"]) for r in grpo)
        out.update(rejected_tokens=rejected, loss_tokens=tokens, rejected_fraction=rejected / tokens if tokens else 0.0)
    else:
        out.update(rejected_tokens=None, loss_tokens=None, rejected_fraction=None)
    ess = _values(grpo, ESS)
    out["mean_ess"] = statistics.mean(ess) if ess else None
    out["worst_k3"], out["worst_k3_step"] = _worst(grpo, K3)
    out["worst_grad_norm"], out["worst_grad_norm_step"] = _worst(grpo, "grad_norm")
    times = _values(grpo, "time/step")
    out["mean_step_s"] = statistics.mean(times) if times else None
    return out


def summary_lines(summary: dict) -> List[str]:
    """The end-of-run lines of ``slime-rc train`` for :func:`run_summary`'s dict."""
    s = summary
    warm = f" after {s['warm_start_steps']} warm-start steps" if s["warm_start_steps"] else ""
    head = (f"summary ({s['grpo_steps']} GRPO steps{warm}): final reward {s['final_reward']:.3f} (mean of the last "
            f"{s['final_window']} steps; best {s['final_window']}-step mean {s['peak_reward']:.3f}"
            f"{', collapsed: final < ' + format(COLLAPSE_FRACTION, 'g') + ' x best' if s['collapsed'] else ''})")
    if s["rejected_tokens"] is None:
        rejected = "rejected tokens -"
    else:
        rejected = (f"rejected {s['rejected_tokens']} of {s['loss_tokens']} tokens "
                    f"({100 * s['rejected_fraction']:.2f}%)")
    ess = "-" if s["mean_ess"] is None else f"{s['mean_ess']:.3f}"
    at = (lambda step: f"step {step - s['warm_start_steps'] + 1}/{s['grpo_steps']}")  # as the per-step lines count
    k3 = "-" if s["worst_k3"] is None else f"{s['worst_k3']:.2e} at {at(s['worst_k3_step'])}"
    grad = "-" if s["worst_grad_norm"] is None else f"{s['worst_grad_norm']:.3f} at {at(s['worst_grad_norm_step'])}"
    return [head, f"summary: {rejected}; mean ESS {ess}; worst k3 {k3}; worst grad norm {grad}"]


def write_summary(output_dir: str, summary: dict) -> str:
    """``OUTPUT_DIR/summary.json``, whole or not at all (written beside it, then renamed)."""
    path = os.path.join(output_dir, "summary.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


# ---- a study: OUT/<config>/seed<k>/metrics.jsonl ------------------------------------------------------------------
def study_runs(out_dir: str) -> Dict[str, Dict[str, List[dict]]]:
    """``{config: {seed dir name: metrics rows}}`` of a study directory (configurations sorted, seeds in order)."""
    found: Dict[str, Dict[str, List[dict]]] = {}
    for config_dir in sorted(d for d in glob.glob(os.path.join(glob.escape(out_dir), "*")) if os.path.isdir(d)):
        seeds = sorted((d for d in glob.glob(os.path.join(glob.escape(config_dir), "seed*"))
                        if os.path.isfile(os.path.join(d, "metrics.jsonl"))),
                       key=lambda d: (len(os.path.basename(d)), os.path.basename(d)))
        runs = {os.path.basename(d): read_run(d) for d in seeds}
        runs = {k: v for k, v in runs.items() if grpo_rows(v)}
        if runs:
            found[os.path.basename(config_dir)] = runs
    return found


def is_study_dir(path: str) -> bool:
    """``path`` holds ``<config>/seed<k>/metrics.jsonl`` (and is not itself a run directory)."""
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, "metrics.jsonl"))
            and bool(glob.glob(os.path.join(glob.escape(path), "*", "seed*", "metrics.jsonl"))))


def _ms(values: List[float], fmt: str = ".3f") -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def study_table(out_dir: str) -> List[dict]:
    """One dict per configuration (the numbers of :func:`summarize`'s table)."""
    table = []
    for config, runs in study_runs(out_dir).items():
        sums = [run_summary(rows) for rows in runs.values()]
        grpo = [grpo_rows(rows) for rows in runs.values()]
        rejected = [s for s in sums if s["rejected_tokens"] is not None]
        k3 = [v for g in grpo for v in _values(g, K3)]
        ess = [s["mean_ess"] for s in sums if s["mean_ess"] is not None]
        times = [s["mean_step_s"] for s in sums if s["mean_step_s"] is not None]
        table.append({
            "config": config, "seeds": len(sums), "final_rewards": [s["final_reward"] for s in sums],
            "collapsed": sum(s["collapsed"] for s in sums),
            "worst_grad_norm": max(s["worst_grad_norm"] for s in sums),
            "mean_k3": statistics.mean(k3) if k3 else None, "worst_k3": max(k3) if k3 else None,
            "rejected_fraction": _rejected_fraction(sums, grpo),
            "mean_ess": statistics.mean(ess) if ess else None,
            "step_s": statistics.mean(times) if times else None})
    return table


def _rejected_fraction(sums: List[dict], grpo: List[List[dict]]) -> Optional[float]:
    """Rejected tokens over all tokens of all seeds; for runs that did not count them (older ``metrics.jsonl``), the
    mean over steps of ``rollout_corr/rejected_token_fraction``, else of ``rollout_corr/rollout_rs_masked_fraction``."""
    if all(s["rejected_tokens"] is not None for s in sums):
        tokens = sum(s["loss_tokens"] for s in sums)
        return sum(s["rejected_tokens"] for s in sums) / tokens if tokens else 0.0
    for key in (REJECTED, "rollout_corr/rollout_rs_masked_fraction"):
        values = [v for g in grpo for v in _values(g, key)]
        if values:
            return statistics.mean(values)
    return None


def summarize(out_dir: str) -> str:
    """The study's markdown table (module docstring)."""
    lines = ["| config | seeds | final reward | collapsed | worst grad norm | mean k3 | worst k3 | rejected | mean ESS "
             "| step s |", "|---|---|---|---|---|---|---|---|---|---|"]
    opt = (lambda v, fmt: "-" if v is None else format(v, fmt))
    for row in study_table(out_dir):
        lines.append(f"| {row['config']} | {row['seeds']} | {_ms(row['final_rewards'])} | "
                     f"{row['collapsed']}/{row['seeds']} | {row['worst_grad_norm']:.2f} | {opt(row['mean_k3'], '.2e')} "
                     f"| {opt(row['worst_k3'], '.2e')} | {opt(row['rejected_fraction'], '.3f')} | "
                     f"{opt(row['mean_ess'], '.3f')} | {opt(row['step_s'], '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    out_dir = argv[0] if argv else "runs/study"
    try:
        if not study_runs(out_dir):
            raise ValueError(f"{out_dir}: no <config>/seed<k>/metrics.jsonl with a GRPO step (is it a study "
                             f"directory, e.g. of examples/collapse_study.sh?)")
        print(summarize(out_dir))
    except ValueError as e:
        print(f"slime-rc study summary: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
