"""``--plot FILE.png``: the log-ratio histogram and the length / probability breakdowns (matplotlib, Agg)."""

from __future__ import annotations

import torch

from slime_rc.correction.quantiles import bin_centres


def plot_report(report: dict, path: str) -> None:
    """Write a 2x2 figure to ``path``.  Raises ``ImportError`` when matplotlib is missing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0, 0]
    bins, bound = report["_bins"]
    counts = report["_histogram"]
    centres = bin_centres(bins, float(bound))
    # the quantile grid has ~7k log-magnitude bins: regroup them into ~150 for a readable histogram
    nz = torch.nonzero(counts).flatten()
    if nz.numel():
        lo, hi = float(centres[nz[0]]), float(centres[nz[-1]])
        edges = torch.linspace(min(lo, -1e-6), max(hi, 1e-6), 151, dtype=torch.float64)
        idx = torch.bucketize(centres, edges).clamp(1, 150) - 1
        grouped = torch.zeros(150, dtype=torch.float64).index_add_(0, idx, counts)
        ax.stairs(grouped.tolist(), edges.tolist(), fill=True)
        ax.set_yscale("log")
    ax.set_title("log r = log pi_train - log pi_rollout (loss tokens)")
    ax.set_xlabel("log r")
    ax.set_ylabel("tokens")

    for ax, rows, title in ((axes[0, 1], report["by_length"], "by sample length (loss tokens)"),
                            (axes[1, 0], report["by_probability"], "by rollout token probability")):
        labels = [r["bucket"] for r in rows]
        x = list(range(len(rows)))
        ax.bar([i - 0.2 for i in x], [r["k3_kl"] for r in rows], width=0.4, label="k3_kl (token mean)")
        ax.bar([i + 0.2 for i in x], [r["mean_abs_log_ratio"] for r in rows], width=0.4, label="mean |log r|")
        ax.set_xticks(x, labels, rotation=20, fontsize=8)
        ax.set_yscale("symlog", linthresh=1e-6)
        top = max([r["k3_kl"] for r in rows] + [r["mean_abs_log_ratio"] for r in rows] + [1e-6])
        ax.set_ylim(0, top * 3)
        ax.set_title(title)
        ax.legend(fontsize=8)

    ax = axes[1, 1]
    names = list(report["presets"])
    y = list(range(len(names)))
    ax.barh([i - 0.2 for i in y], [report["presets"][n]["rejected_token_fraction"] for n in names], height=0.4,
            label="rejected tokens")
    ax.barh([i + 0.2 for i in y], [report["presets"][n]["rejected_seq_fraction"] for n in names], height=0.4,
            label="rejected samples")
    ax.set_yticks(y, [n + (" *" if n == report.get("recommended_preset") else "") for n in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_title("what each preset rejects (* recommended)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
