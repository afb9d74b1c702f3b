"""Speed of the rollout-correction engine, measured in one run on one thread.

For each batch shape it prints: our packed engine's time, the per-sequence-loop reference's time
(slime_rc/testing/reference.py: the way slime's mis.py loops over samples) and their ratio, the slime-compatible plugin
(custom_tis.mis.compute_mis_weights, lists in/lists out) vs the same reference, a one-pass memory floor
(``(a - b).sum()`` over the inputs) and our time in units of it, and metric memory / input bytes.

Config: token-level TIS (truncate at 2) + token RS [0.5, 2] + veto 1e-4 + batch normalization.
Run: ``python benchmarks/bench_correction.py`` (add ``--quick`` for fewer repeats).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import slime_rc as rc  # noqa: E402
from slime_rc.testing.reference import reference_correction  # noqa: E402

CASES = [("16 samples, ~9k tokens", 16, 9_000), ("4 samples, ~10k tokens", 4, 10_000),
         ("128 samples, ~600k tokens", 128, 600_000)]
CONFIG = rc.RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0,
                                    is_batch_normalize=True, rs=rc.parse_rejection_criteria("token", 2.0),
                                    veto_threshold=1e-4)
SLIME_ARGS = SimpleNamespace(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0,
                             tis_batch_normalize=True, use_rs=True, rs_level="token", rs_upper_bound=2.0,
                             rs_veto_threshold=1e-4)


def make_batch(n_samples: int, n_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mean = n_tokens // n_samples
    lengths = torch.randint(mean // 2, mean * 3 // 2 + 1, (n_samples,), generator=g)
    n = int(lengths.sum())
    rollout = -torch.rand(n, generator=g) * 4  # log-probs in [-4, 0]
    train = rollout + torch.randn(n, generator=g) * 0.1  # bf16-like mismatch with a tail
    train[torch.randint(0, n, (max(1, n // 5000),), generator=g)] -= 12.0  # a few catastrophic tokens
    mask = torch.ones(n)
    cu = rc.cu_seqlens_from_lengths(lengths)
    for i in range(n_samples):  # mask a short tool-output span in each sample
        s = int(cu[i]) + int(lengths[i]) // 3
        mask[s:s + int(lengths[i]) // 10] = 0
    return train, rollout, mask, cu


def timeit(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from custom_tis.mis import compute_mis_weights

    print(f"torch {torch.__version__}, 1 thread; config: token TIS truncate + token RS + veto + batch norm")
    header = (f"{'batch':28s} {'ours':>9s} {'loop ref':>9s} {'ref/ours':>9s} {'plugin':>9s} {'ref/plugin':>10s} "
              f"{'floor':>9s} {'ours/floor':>10s} {'metric mem/input':>17s}")
    print(header)
    for label, b, n in CASES:
        train, rollout, mask, cu = make_batch(b, n)
        splits = (cu[1:] - cu[:-1]).tolist()
        lists = [list(t.split(splits)) for t in (train, rollout, mask)]
        big = train.numel() > 100_000
        reps = (3 if big else 20) if args.quick else (5 if big else 60)
        ours = timeit(lambda: rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG), reps)
        ref = timeit(lambda: reference_correction(*lists, CONFIG), max(2, reps // 3))
        plugin = timeit(lambda: compute_mis_weights(SLIME_ARGS, train_log_probs=lists[0], rollout_log_probs=lists[1],
                                                    loss_masks=lists[2]), reps)
        floor = timeit(lambda: (train - rollout).sum(), reps)
        result = rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG)
        metric_bytes = sum(v.numel() * v.element_size() for v in result.metrics.values())
        input_bytes = sum(t.numel() * t.element_size() for t in (train, rollout, mask))
        print(f"{label:28s} {ours * 1e3:8.2f}ms {ref * 1e3:8.2f}ms {ref / ours:8.1f}x {plugin * 1e3:8.2f}ms "
              f"{ref / plugin:9.1f}x {floor * 1e3:8.3f}ms {ours / floor:9.1f}x {metric_bytes / input_bytes:16.2e}")


if __name__ == "__main__":
    main()
