"""Summarise a mismatch study (``examples/mismatch_study.sh``): ``python -m slime_rc.demo.train.study OUT_DIR`` reads
``OUT_DIR/<config>/seed<k>/metrics.jsonl`` and prints a markdown table, one row per configuration: final reward
(mean of the last 10 steps, mean ± std over seeds), the worst grad norm, the mean mismatch k3 KL and KL, the mean
rejected token fraction and the mean step time."""

from __future__ import annotations

import glob
import os
import statistics
import sys
from typing import List

from slime_rc.demo.train.plot import read_run


def _ms(values: List[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def summarize(out_dir: str) -> str:
    lines = ["| config | seeds | final reward | worst grad norm | mean k3 KL | mean KL | rejected | step s |",
             "|---|---|---|---|---|---|---|---|"]
    for config_dir in sorted(d for d in glob.glob(os.path.join(out_dir, "*")) if os.path.isdir(d)):
        runs = [read_run(d) for d in sorted(glob.glob(os.path.join(config_dir, "seed*")))]
        runs = [r for r in runs if r]
        if not runs:
            continue
        final = [statistics.mean(m["reward_mean"] for m in r[-10:]) for r in runs]
        worst = max(max(m["grad_norm"] for m in r) for r in runs)
        mean = (lambda key: statistics.mean(statistics.mean(m.get(key, 0.0) for m in r) for r in runs))
        lines.append(f"| {os.path.basename(config_dir)} | {len(runs)} | {_ms(final)} | {worst:.2f} | "
                     f"{mean('rollout_corr/k3_kl'):.2e} | {mean('rollout_corr/kl'):.2e} | "
                     f"{mean('rollout_corr/rollout_rs_masked_fraction'):.3f} | {mean('time/step'):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    print(summarize(argv[0] if argv else "runs/study"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
