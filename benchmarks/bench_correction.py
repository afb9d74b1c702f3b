"""Speed and memory of the rollout-correction engine, measured in one run on one thread.

Config everywhere: token-level TIS (truncate at 2) + token RS [0.5, 2] + veto 1e-4 + batch normalization; the same
synthetic batch (fp32 log-probs in [-4, 0], a N(0, 0.1) train/rollout mismatch, one catastrophic token per 5000, a
masked tool-output span in every sample) is given to every contender of a case.

Contenders, timed interleaved (one call of each per round, median over rounds, so that a noisy neighbour slows
them alike; ratios are taken within one run):

* ``ours``: :func:`slime_rc.compute_rollout_correction` on the packed batch (native API), eager;
* ``compiled``: the same with ``compiled=True`` (``slime_rc.correction.compiled``: the engine's stages through
  ``torch.compile``, one graph; compiled in the warm-up call, once per config: dynamic shapes serve every batch);
* ``plugin``: ``custom_tis.mis.compute_mis_weights_with_cp``, the function slime's loss calls through
  ``--custom-tis-function-path`` (slime's contract: per-sample log-prob lists, full-length ``torch.int`` loss masks,
  ``pg_loss`` in; the weighted ``pg_loss``, full-length masks and per-token metrics out; slime's ``mis.yaml`` keys on
  ``args``; no context parallelism);
* ``loop ref``: a per-sequence Python loop over samples, the way slime's example
  ``examples/train_infer_mismatch_helper/mis.py`` computes correction, giving the outputs of
  :func:`slime_rc.testing.reference.reference_correction` (weights, keep masks and every metric; checked against it
  in the first run, weights/keep to 1e-6, metrics to 1e-5).  It is :func:`loop_reference` below, not
  ``reference_correction`` itself: that one is written for clarity (a host read per statistic, five full sorts for the
  quantiles) and took 0.9-8x the time of slime's example (the most on long sequences); this one does one host read per sample and one selection for
  the quantiles, and took 0.45-0.9x the time of slime's example on every case here and in the sweep to 1M tokens
  (measured beside it, same data, one thread; slime's example is neither shipped nor imported here), so the speed-ups
  are over a loop at least as fast as slime's own;
* ``floor``: the cheapest single pass over the inputs, ``(train - rollout).sum()``, timed as the mean of 10
  back-to-back calls per round: its steady state, without the first-touch page faults that its temporary pays when
  one call follows a large engine call (those doubled it and made it swing 10x with the machine's load).

Columns: times (ms), ``ref/ours``, ``ref/comp``, ``ref/plugin``, ``ours/floor`` and ``comp/floor`` (time in one-pass
floors), host synchronisations per call of ours, compiled and the plugin
(:class:`slime_rc.testing.host_reads.HostReads`: device->host reads,
data-dependent shapes, blocking copies; counted on one extra call outside the timed rounds; on a GPU each one drains
the stream; under the counter's dispatch mode the compiled engine runs eagerly, so the compiled column counts the
eager stand-in: the compiled engine is one graph without a break, ``tests/correction/test_compiled.py``; on a GPU the
column adds, in brackets, what CUDA's own sync detector reports for one call of each, the compiled graph as it runs),
and metric memory / input bytes (the bytes of the metric tensors over the three inputs').

Scaling sweep (62k .. 8M tokens, samples of 2k-4k tokens): ``ns/token`` of ours (and of the floor), which should stay
flat, and peak memory per token.  Peak memory is measured as the process's resident set (RSS) high-water mark, in a
fresh subprocess per size (the times are taken in the main process): after building the inputs and one warm-up call, ``/proc/self/clear_refs`` (``5``) resets the
kernel's high-water mark ``VmHWM`` to the current RSS, then one call runs and ``VmHWM - VmRSS_before`` is its peak
extra memory, torch's allocations and kernel temporaries included (``tracemalloc`` sees none of them).  The subprocess
runs with ``MALLOC_MMAP_THRESHOLD_`` set, so glibc serves every block of >= 64 KiB with its own mmap and returns it on
free: a freed tensor cannot hide inside the heap and be reused unseen.  The floor's own peak (its one temporary of
4 bytes/token) is printed next to ours as a check of the method.  The kernel's RSS counters are per-CPU batched, so the
reading is good to a few hundred KiB: the floor's 250 KB at 62k tokens may read 0, ours (megabytes) is unaffected.
Linux only (elsewhere the column reads n/a).

Page faults (CPU): glibc returns freed heap memory to the system once the free memory at the top of the heap
exceeds its trim threshold, and the next touch of it faults (~1-2 us a 4 KiB page here).  In the interleaved
rounds a contender that frees tens of MB (the plugin's outputs, ours' buffers) makes the NEXT contender fault, so a
call's time depends on which call came before it: measured at 560k tokens (2026-11-26), ours 16 ms (1.4k faults) right
after the others and 25 ms (6.5k faults) on its own second call; the plugin 32 ms (8.6k faults) after the others and
19 ms (none) on its second call.  Each run therefore prints the table twice: with glibc's defaults, then in a
subprocess whose glibc keeps freed memory (``MALLOC_TRIM_THRESHOLD_`` 64 GiB, ``MALLOC_MMAP_THRESHOLD_`` 32 MiB, its
largest value: no block of the table's batches is mmapped), as a GPU's caching allocator does -- the arithmetic and
memory traffic alone, the same for every contender (the loop's per-sample tensors rarely fault either way).  Goals
are printed for both.

Goals are printed with met / not met: ours >= 10x the loop reference on the 16-sample micro-batch and >= 5x on the
560k-token batch; the plugin >= 3x the loop reference on every case; ours <= 50 one-pass floors on the 560k-token batch;
metric memory <= 1x input bytes on every case.  Ours' goals are printed for the eager path and for the compiled one.

Run: ``python benchmarks/bench_correction.py`` (``--quick``: fewer rounds, sweep to 1M tokens; ``--runs 3``: the
whole table three times; ``--json PATH``: machine-readable results; ``--device cuda``: the same table on a GPU).

On a GPU (``--device cuda``) every contender gets the same batch on the device and each timed call ends with
``torch.cuda.synchronize()`` (a call's time is its wall time until its kernels are done: the loop reference's
per-sample host reads wait there too, ours queues its kernels and waits once at the end).  Peak memory is
``torch.cuda.max_memory_allocated`` above the memory in use before the call, in the same process.  The goals are
defined for one CPU thread; on a GPU they are printed for reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import slime_rc as rc  # noqa: E402
from slime_rc.config.schema import RS_OPTIONS  # noqa: E402

CONFIG = rc.RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0,
                                    is_batch_normalize=True, rs=rc.parse_rejection_criteria("token", 2.0),
                                    veto_threshold=1e-4)
# the same settings as slime's keys (slime's examples/train_infer_mismatch_helper/mis.yaml)
SLIME_ARGS = SimpleNamespace(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0,
                             tis_lower_bound=0.5, use_rs=True, rs_level="token", rs_upper_bound=2.0,
                             rs_lower_bound=None, rs_veto_threshold=1e-4, tis_batch_normalize=True)

MICRO, SMALL, LARGE, LONG = "16 samples, ~10k tokens", "4 samples, ~10k tokens", "128 samples, ~560k tokens", \
    "4 x 128k tokens (long ctx)"
FLOOR_INNER = {"floor": 10}  # the floor is timed over 10 back-to-back calls per round (its steady state)
SWEEP = (62_000, 250_000, 1_000_000, 4_000_000, 8_000_000)
SWEEP_QUICK = (62_000, 250_000, 1_000_000)


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------
def sample_lengths(n_samples: int, n_tokens: int, seed: int = 0, low: float = 0.5, high: float = 1.5) -> List[int]:
    """``n_samples`` lengths drawn uniformly in ``[low, high] x n_tokens / n_samples``."""
    g = torch.Generator().manual_seed(seed)
    mean = n_tokens / n_samples
    return torch.randint(int(mean * low), int(mean * high) + 1, (n_samples,), generator=g).tolist()


def cases() -> List[tuple]:
    return [(MICRO, sample_lengths(16, 10_000)), (SMALL, sample_lengths(4, 10_000)),
            (LARGE, sample_lengths(128, 560_000)), (LONG, [131_072] * 4)]


def sweep_lengths(n_tokens: int) -> List[int]:
    """Samples of 2k-4k tokens (3k on average) summing to about ``n_tokens``."""
    return sample_lengths(max(1, round(n_tokens / 3000)), n_tokens, low=2 / 3, high=4 / 3)


DEVICE = torch.device("cpu")  # --device


def sync() -> None:
    """Wait for the device's queued kernels (timing on a GPU); nothing on the CPU."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    """``fn`` followed by :func:`sync`: its time is until its kernels are done."""
    def call():
        out = fn()
        sync()
        return out
    return call


def make_batch(lengths: Sequence[int], seed: int = 0):
    """Packed ``(train, rollout, mask, cu_seqlens)``: fp32 log-probs with a bf16-like mismatch and a few catastrophic
    tokens; a masked tool-output span (a tenth of the sample, from its first third) in every sample."""
    g = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    rollout = torch.rand(n, generator=g).mul_(-4.0)  # log-probs in [-4, 0]
    train = torch.randn(n, generator=g).mul_(0.1).add_(rollout)
    train[torch.randint(0, n, (max(1, n // 5000),), generator=g)] -= 12.0  # catastrophic tokens
    mask = torch.ones(n)
    cu = rc.cu_seqlens_from_lengths(lengths)
    starts = cu[:-1].tolist()
    for s, length in zip(starts, lengths):
        mask[s + length // 3: s + length // 3 + length // 10] = 0
    return tuple(t.to(DEVICE) for t in (train, rollout, mask, cu))


# ---------------------------------------------------------------------------------------------------------------
# the per-sequence loop reference
# ---------------------------------------------------------------------------------------------------------------
def _criterion_bounds(c):
    if RS_OPTIONS[c.option][2] == "k1":
        lower = c.lower if c.lower is not None else 1.0 / c.upper
        return math.log(lower), math.log(c.upper)
    return -math.inf, c.upper


def loop_reference(train_list, rollout_list, mask_list, config: rc.RolloutCorrectionConfig):
    """``reference_correction``'s outputs ``(weights list, keep list, metrics)`` from a Python loop over samples,
    for token-level IS with token-level rejection criteria.  Per sample: the token statistics as whole-tensor ops,
    their sums read back in ONE host read; the clamped log-ratios of the valid tokens (a sentinel above every
    log-ratio elsewhere) go to one buffer whose order statistics (min, max, quantiles) come from one multi-rank
    selection at the end.  A sample is first computed assuming finite log-probs on its loss tokens with float 0/1
    masks; if its sums come back non-finite it is computed again with explicit validity masks."""
    if config.is_level != "token" or any(RS_OPTIONS[c.option][0] != "token" for c in config.rs):
        raise NotImplementedError("loop_reference covers token-level IS with token-level rejection criteria")
    ctx = SimpleNamespace(config=config, bound=config.safety_bound, log_hi=math.log(config.is_upper_bound),
                          log_lo=math.log(config.is_lower),
                          criteria=[(c.option, RS_OPTIONS[c.option][2], *_criterion_bounds(c)) for c in config.rs],
                          log_veto=math.log(config.veto_threshold) if config.veto_threshold is not None else None)
    # the fast form relies on a zero log-ratio (what a masked token carries) never being flagged
    bounds = [(ctx.log_lo, ctx.log_hi)] + [(low, high) for _, _, low, high in ctx.criteria]
    fast = all(low < 0 < high for low, high in bounds) and (ctx.log_veto is None or ctx.log_veto < 0)
    order = torch.empty(sum(t.numel() for t in train_list), device=train_list[0].device)
    seqs, offset = [], 0
    for i, (train, rollout, mask) in enumerate(zip(train_list, rollout_list, mask_list)):
        train, rollout = train.detach().float(), rollout.detach().float()
        out = order[offset:offset + train.numel()]
        offset += train.numel()
        s = _sample_finite(train, rollout, mask, ctx, out) if fast else None
        if s is None:
            s = _sample_general(train, rollout, mask, ctx, out)
        if s["n_loss"] > s["n"] and config.on_nonfinite == "error":
            raise ValueError(f"non-finite log-probs in sample {i}")
        seqs.append(s)
    return _batch_metrics(seqs, order, config, ctx.bound, ctx.log_hi, ctx.log_lo, ctx.criteria)


def _bounded(ratio, config):
    if config.is_mode == "truncate":
        return ratio.clamp(max=config.is_upper_bound)
    if config.is_mode == "clip":
        return ratio.clamp(min=config.is_lower, max=config.is_upper_bound)
    return ratio


def _sample_finite(train, rollout, mask, ctx, order):
    """One sample, assuming finite log-probs on its loss tokens (None when its sums say otherwise)."""
    config, cache = ctx.config, {}

    def below(x, key, value):  # comparisons shared between criteria with the same bound
        if (key, "<", value) not in cache:
            cache[key, "<", value] = x < value
        return cache[key, "<", value]

    def above(x, key, value):
        if (key, ">", value) not in cache:
            cache[key, ">", value] = x > value
        return cache[key, ">", value]

    loss_f = (mask != 0).float()
    lr = (train - rollout) * loss_f  # unclamped; 0 on masked tokens
    lr_c = lr.clamp(-ctx.bound, ctx.bound)
    ratio = lr_c.exp()
    weight = _bounded(ratio, config)
    torch.add(lr_c, 1.0 - loss_f, alpha=1e30, out=order)
    n = loss_f.sum()
    counts = [n, n]
    drop = None
    if ctx.log_veto is not None:
        catastrophic = below(lr, "lr", ctx.log_veto)
        counts.append(catastrophic.sum())
        drop = catastrophic.any()
    rejected = None
    for _, kind, low, high in ctx.criteria:
        stat = lr if kind == "k1" else (0.5 * lr_c * lr_c if kind == "k2" else ratio - 1.0 - lr_c)
        flags = above(stat, kind, high) if low == -math.inf else below(stat, kind, low) | above(stat, kind, high)
        counts.append(flags.sum())
        rejected = flags if rejected is None else rejected | flags
    if ctx.criteria:
        counts.append(rejected.sum())
    if config.is_mode == "mask":
        flags = below(lr, "k1", ctx.log_lo) | above(lr, "k1", ctx.log_hi)
        counts.append(flags.sum())
        rejected = flags if rejected is None else rejected | flags
    counts += [above(lr, "k1", ctx.log_hi).sum(), below(lr, "k1", ctx.log_lo).sum()]
    keep = loss_f if rejected is None else loss_f - rejected.float()
    if drop is not None:
        keep = keep * (~drop).float()
    weighted = weight * keep
    counts.append(keep.sum())
    sums32 = torch.stack([lr.sum(), (train * loss_f).sum(), (rollout * loss_f).sum(), (weight * loss_f).sum()])
    f64 = torch.float64
    sums64 = torch.stack([lr.sum(dtype=f64), lr.abs().sum(dtype=f64), (ratio - 1.0 - lr_c).sum(dtype=f64),
                          (ratio * ratio * loss_f).sum(dtype=f64), weighted.sum(dtype=f64)])
    w64 = weighted.double()
    # one host read: torch.cat promotes the int64 counts and the float32 sums and means to float64
    out = torch.cat([torch.stack(counts), sums32, sums32 / n.clamp_min(1.0), sums64, torch.dot(w64, w64)[None]])
    out = out.tolist()
    if not all(math.isfinite(v) for v in out):
        return None
    return _unpack(out, ctx, weighted, keep)


def _sample_general(train, rollout, mask, ctx, order):
    """One sample, with explicit validity (loss token with finite log-probs) masks."""
    config = ctx.config
    loss = mask != 0
    raw = train - rollout
    valid = loss & torch.isfinite(raw)
    valid_f = valid.float()
    lr = torch.where(valid, raw, 0.0)  # unclamped
    lr_c = lr.clamp(-ctx.bound, ctx.bound)
    ratio = lr_c.exp()
    weight = _bounded(ratio, config)
    torch.where(valid, lr_c, math.inf, out=order)
    counts = [loss.sum(), valid_f.sum()]
    rejected = torch.zeros_like(valid)
    drop = torch.zeros((), dtype=torch.bool, device=valid.device)
    if config.on_nonfinite == "reject":
        drop = drop | (loss & ~valid).any()
    if ctx.log_veto is not None:
        catastrophic = valid & (lr < ctx.log_veto)
        counts.append(catastrophic.sum())
        drop = drop | catastrophic.any()
    rs_union = torch.zeros_like(valid)
    for _, kind, low, high in ctx.criteria:
        stat = lr if kind == "k1" else (0.5 * lr_c * lr_c if kind == "k2" else ratio - 1.0 - lr_c)
        flags = valid & ((stat < low) | (stat > high))
        counts.append(flags.sum())
        rs_union |= flags
    if ctx.criteria:
        counts.append(rs_union.sum())
    rejected |= rs_union
    if config.is_mode == "mask":
        flags = valid & ((lr < ctx.log_lo) | (lr > ctx.log_hi))
        counts.append(flags.sum())
        rejected |= flags
    counts += [(valid & (lr > ctx.log_hi)).sum(), (valid & (lr < ctx.log_lo)).sum()]
    keep = (valid & ~rejected & ~drop).float()
    weighted = weight * keep
    counts.append(keep.sum())
    sums32 = torch.stack([lr.sum(), torch.where(valid, train, 0.0).sum(), torch.where(valid, rollout, 0.0).sum(),
                          (weight * valid_f).sum()])
    rows = torch.stack([lr, lr.abs(), ratio - 1.0 - lr_c, ratio * ratio * valid_f, weighted]).double()
    sums64 = torch.cat([rows.sum(1), (rows[4] * rows[4]).sum().unsqueeze(0)])
    out = torch.cat([torch.stack(counts).double(), sums32.double(), (sums32 / counts[1].clamp_min(1.0)).double(),
                     sums64]).tolist()
    return _unpack(out, ctx, weighted, keep)


def _unpack(out, ctx, weighted, keep):
    s = dict(zip(["n_loss", "n"], out[:2]))
    k = 2
    s["veto_tokens"] = out[k] if ctx.log_veto is not None else 0.0
    k += ctx.log_veto is not None
    s["rs"] = {}
    for option, *_ in ctx.criteria:
        s["rs"][option] = out[k]
        k += 1
    s["rs_tokens"] = 0.0
    if ctx.criteria:
        s["rs_tokens"] = out[k]
        k += 1
    s["is_mask_tokens"] = 0.0
    if ctx.config.is_mode == "mask":
        s["is_mask_tokens"] = out[k]
        k += 1
    s["above"], s["below"], s["kept_tokens"] = out[k:k + 3]
    k += 3
    s["log_ratio_sum"], _, _, _, s["log_ratio_mean"], s["train_mean"], s["rollout_mean"], s["seq_weight"] = \
        out[k:k + 8]
    k += 8
    s["neg_kl"], s["abs"], s["k3"], s["r2"], s["w"], s["w2"] = out[k:k + 6]
    if s["n"] == 0:
        s["log_ratio_mean"] = s["train_mean"] = s["rollout_mean"] = s["seq_weight"] = 0.0
    s["nonfinite"] = s["n_loss"] > s["n"]
    s["kept"] = s["kept_tokens"] > 0
    s["weights"], s["keep"] = weighted, keep
    return s


def _batch_metrics(seqs, order, config, bound, log_hi, log_lo, criteria):
    def mean(values):
        return sum(values) / len(values) if values else 0.0

    def frac(num, den):
        return num / den if den > 0 else 0.0

    exp_c = lambda x: math.exp(min(max(x, -bound), bound))  # noqa: E731
    valid_seqs = [s for s in seqs if s["n"] > 0]
    loss_seqs = [s for s in seqs if s["n_loss"] > 0]
    n_tokens = sum(s["n"] for s in seqs)
    n_loss_tokens = sum(s["n_loss"] for s in seqs)
    n_kept = sum(s["kept_tokens"] for s in seqs)
    d = [s["rollout_mean"] - s["train_mean"] for s in valid_seqs]
    token_mean = lambda key: sum(s[key] for s in seqs) / n_tokens if n_tokens else 0.0  # noqa: E731
    m: Dict[str, float] = {
        "training_log_ppl": mean([-s["train_mean"] for s in valid_seqs]),
        "training_ppl": mean([math.exp(-s["train_mean"]) for s in valid_seqs]),
        "rollout_log_ppl": mean([-s["rollout_mean"] for s in valid_seqs]),
        "rollout_ppl": mean([math.exp(-s["rollout_mean"]) for s in valid_seqs]),
        "log_ppl_diff": mean(d),
        "log_ppl_abs_diff": mean([abs(x) for x in d]),
        "log_ppl_diff_max": max(d) if d else 0.0,
        "log_ppl_diff_min": min(d) if d else 0.0,
        "ppl_ratio": mean([exp_c(x) for x in d]),
        "kl": -token_mean("neg_kl"),
        "k3_kl": token_mean("k3"),
        "chi2_token": token_mean("r2") - 1.0 if n_tokens else 0.0,
        "chi2_seq": mean([exp_c(s["log_ratio_sum"]) ** 2 for s in valid_seqs]) - 1.0 if valid_seqs else 0.0,
        "train_rollout_logprob_abs_diff": token_mean("abs"),
        "rejected_token_fraction": frac(n_loss_tokens - n_kept, n_loss_tokens),
        "rejected_seq_fraction": frac(sum(1 for s in loss_seqs if not s["kept"]), len(loss_seqs)),
    }
    if config.on_nonfinite == "reject":
        m["nonfinite_token_fraction"] = frac(n_loss_tokens - n_tokens, n_loss_tokens)
        m["nonfinite_seq_fraction"] = frac(sum(1 for s in seqs if s["nonfinite"]), len(loss_seqs))

    if n_kept:
        mean_w, mean_w2 = sum(s["w"] for s in seqs) / n_kept, sum(s["w2"] for s in seqs) / n_kept
        m["rollout_is_mean"] = mean_w
        m["rollout_is_std"] = math.sqrt(max(mean_w2 - mean_w * mean_w, 0.0))
        m["rollout_is_eff_sample_size"] = mean_w * mean_w / mean_w2 if mean_w2 > 0 else 0.0
    else:
        m["rollout_is_mean"] = m["rollout_is_std"] = m["rollout_is_eff_sample_size"] = 0.0
    n = int(n_tokens)
    quantiles = (0.25, 0.50, 0.75, 0.95, 0.99)
    if n:  # order statistics of the valid tokens' clamped log-ratios (+inf elsewhere sorts last): one selection
        ranks = sorted({0, n - 1, *(max(1, math.ceil(q * n)) - 1 for q in quantiles)})
        part = order.cpu().numpy().copy()
        part.partition(ranks)
        at = {r: float(part[r]) for r in ranks}
        m["rollout_is_min"], m["rollout_is_max"] = math.exp(at[0]), math.exp(at[n - 1])
        for q in quantiles:
            m[f"rollout_is_p{round(q * 100)}"] = math.exp(at[max(1, math.ceil(q * n)) - 1])
    else:
        m["rollout_is_min"] = m["rollout_is_max"] = 0.0
        for q in quantiles:
            m[f"rollout_is_p{round(q * 100)}"] = 0.0
    m["rollout_is_ratio_fraction_high"] = frac(sum(s["above"] for s in seqs), n_tokens)
    m["rollout_is_ratio_fraction_low"] = frac(sum(s["below"] for s in seqs), n_tokens)
    seq_w = [s["seq_weight"] for s in valid_seqs]
    m["rollout_is_seq_mean"] = mean(seq_w)
    m["rollout_is_seq_std"] = math.sqrt(mean([(w - mean(seq_w)) ** 2 for w in seq_w])) if seq_w else 0.0
    m["rollout_is_seq_min"] = min(seq_w) if seq_w else 0.0
    m["rollout_is_seq_max"] = max(seq_w) if seq_w else 0.0
    m["rollout_is_seq_max_deviation"] = max(abs(w - 1) for w in seq_w) if seq_w else 0.0
    m["rollout_is_seq_fraction_high"] = frac(sum(1 for s in valid_seqs if s["log_ratio_mean"] > log_hi),
                                             len(valid_seqs))
    m["rollout_is_seq_fraction_low"] = frac(sum(1 for s in valid_seqs if s["log_ratio_mean"] < log_lo),
                                            len(valid_seqs))
    if config.is_mode == "mask":
        m["rollout_is_masked_fraction"] = frac(sum(s["is_mask_tokens"] for s in seqs), n_tokens)
        m["rollout_is_seq_masked_fraction"] = frac(sum(1 for s in seqs if s["is_mask_tokens"] > 0), len(loss_seqs))

    weights = [s["weights"] for s in seqs]
    if config.is_batch_normalize:
        norm = m["rollout_is_mean"] if n_kept else 0.0
        if not norm > 0:
            norm = 1.0
        weights = [w / norm for w in weights]
        m["rollout_is_batch_norm_factor"] = norm
    if config.rs:
        m["rollout_rs_masked_fraction"] = frac(sum(s["rs_tokens"] for s in seqs), n_tokens)
        m["rollout_rs_seq_masked_fraction"] = frac(sum(1 for s in seqs if s["rs_tokens"] > 0), len(loss_seqs))
        for option, *_ in criteria:
            name = f"rollout_rs_{option}"
            m[name + "_masked_fraction"] = frac(sum(s["rs"][option] for s in seqs), n_tokens)
            m[name + "_seq_masked_fraction"] = frac(sum(1 for s in seqs if s["rs"][option] > 0), len(loss_seqs))
    if config.veto_threshold is not None:
        m["rollout_is_veto_fraction"] = frac(sum(1 for s in seqs if s["veto_tokens"] > 0), len(loss_seqs))
        m["rollout_is_catastrophic_token_fraction"] = frac(sum(s["veto_tokens"] for s in seqs), n_tokens)
    return weights, [s["keep"] for s in seqs], m


def check_loop_reference(lists, config) -> Dict[str, float]:
    """``loop_reference`` == ``slime_rc.testing.reference.reference_correction`` on this batch: the largest weight and
    keep-mask differences (must be <= 1e-6) and the largest relative metric difference; raises when they differ."""
    from slime_rc.testing.reference import reference_correction

    w_ref, k_ref, m_ref = reference_correction(*lists, config)
    w, k, m = loop_reference(*lists, config)
    dw = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(w, w_ref))
    dk = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(k, k_ref))
    # verl's per-option RS statistics (rollout_rs_<option>_mean, ...) are the engine's and reference_correction's
    # only: slime's loop, which this baseline times, has none (the engine's timings include them)
    m_ref = {key: v for key, v in m_ref.items()
             if not (key.startswith("rollout_rs_") and not key.endswith("masked_fraction"))}
    if set(m) != set(m_ref):
        raise AssertionError(f"loop reference metrics differ in names: {sorted(set(m) ^ set(m_ref))}")
    dm = max(abs(m[key] - m_ref[key]) / max(abs(m_ref[key]), 1e-3) for key in m)
    if dw > 1e-6 or dk > 1e-6 or dm > 1e-5:
        raise AssertionError(f"loop reference != reference_correction: weights {dw:.1e}, keep {dk:.1e}, "
                             f"metrics {dm:.1e}")
    return {"weights_max_abs_diff": dw, "keep_max_abs_diff": dk, "metrics_max_rel_diff": dm}


# ---------------------------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------------------------
def interleaved(fns: Dict[str, callable], rounds: int, inner: Optional[Dict[str, int]] = None,
                shuffle: bool = False) -> Dict[str, float]:
    """Median seconds per call of each function, timed one call of each per round (after one warm-up call each);
    ``inner[name]`` back-to-back calls (their mean) stand for one call of a function too quick to time alone;
    ``shuffle``: each round in another order (seeded), so that no function always follows the same one."""
    inner = inner or {}
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    order, rng = list(fns.items()), random.Random(0)
    for _ in range(rounds):
        if shuffle:
            rng.shuffle(order)
        for name, fn in order:
            k = inner.get(name, 1)
            t = time.perf_counter()
            for _ in range(k):
                fn()
            times[name].append((time.perf_counter() - t) / k)
    return {name: statistics.median(ts) for name, ts in times.items()}


def host_syncs(fn) -> int:
    from slime_rc.testing.host_reads import HostReads

    with HostReads() as reads:
        fn()
    return reads.count


def stream_syncs(fn) -> int:
    """On CUDA: the synchronising calls CUDA's own detector reports in one ``fn()``
    (``torch.cuda.set_sync_debug_mode("warn")``: a warning each).  Unlike :func:`host_syncs` (a dispatch mode, under
    which the compiled engine runs eagerly) it sees the compiled graph as it runs, host->device copies included."""
    sync()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    sync()
    return sum("synchroniz" in str(w.message) for w in caught)


def _proc_status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_extra_bytes(fn) -> Optional[int]:
    """Peak resident memory ``fn()`` adds above the memory in use before it (Linux: VmHWM reset by clear_refs)."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _proc_status("VmRSS")
    result = fn()
    peak = _proc_status("VmHWM")
    del result
    return None if before is None or peak is None else max(peak - before, 0)  # counters are batched: >= 0


def sweep_memory(n_tokens: int) -> dict:
    """Peak memory of one sweep size, meant to run in a fresh process (see the module docstring)."""
    torch.set_num_threads(1)
    train, rollout, mask, cu = make_batch(sweep_lengths(n_tokens))

    def ours():
        return rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG)

    def floor():
        return (train - rollout).sum()

    ours(), floor()  # warm-up: lazy imports, first-call allocations
    mem_ours, mem_floor = peak_extra_bytes(ours), peak_extra_bytes(floor)
    n = train.numel()
    return {"ours_peak_bytes_per_token": None if mem_ours is None else mem_ours / n,
            "floor_peak_bytes_per_token": None if mem_floor is None else mem_floor / n}


def cuda_peak_extra_bytes(fn) -> int:
    """Peak GPU memory ``fn()`` allocates above the memory in use before it (torch's caching allocator)."""
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    sync()
    peak = torch.cuda.max_memory_allocated()
    del result
    return max(peak - before, 0)


def sweep_point(n_tokens: int, rounds: int) -> dict:
    """Time per token here (the allocator as in the table), peak memory per token in a fresh subprocess whose
    glibc returns every large block on free (which would slow the timing: each temporary would fault its pages in)."""
    lengths = sweep_lengths(n_tokens)
    train, rollout, mask, cu = make_batch(lengths)
    times = interleaved({"ours": timed(lambda: rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG)),
                         "floor": timed(lambda: (train - rollout).sum())}, rounds, inner=FLOOR_INNER)
    n = train.numel()
    if DEVICE.type == "cuda":  # the caching allocator's own peak, in this process
        memory = {"ours_peak_bytes_per_token": cuda_peak_extra_bytes(
                      lambda: rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG)) / n,
                  "floor_peak_bytes_per_token": cuda_peak_extra_bytes(lambda: (train - rollout).sum()) / n}
    else:
        train = rollout = mask = cu = None  # freed before the subprocess measures
        gc.collect()
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072", OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--sweep-memory", str(n_tokens)], env=env,
                             capture_output=True, text=True, check=True)
        memory = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tokens": n, "samples": len(lengths), "ours_s": times["ours"], "floor_s": times["floor"],
            "ours_ns_per_token": times["ours"] / n * 1e9, "floor_ns_per_token": times["floor"] / n * 1e9, **memory}


def contenders(lengths: List[int]):
    """``({name: call}, inputs, lists)`` for one batch of ``lengths``: ours, the plugin, the loop reference and the
    floor (module docstring) on the same data; ``inputs``: the packed ``(train, rollout, mask)``; ``lists``: the
    per-sample lists the plugin and the loop take."""
    from custom_tis.mis import compute_mis_weights_with_cp

    train, rollout, mask, cu = make_batch(lengths)
    lists = [list(t.split(lengths)) for t in (train, rollout, mask)]
    int_masks = [m.int() for m in lists[2]]  # slime's loss masks are torch.int
    pg_loss = torch.zeros_like(train)  # the per-token loss the plugin weights

    def plugin():
        return compute_mis_weights_with_cp(SLIME_ARGS, pg_loss=pg_loss, train_log_probs=lists[0],
                                           rollout_log_probs=lists[1], loss_masks=int_masks, total_lengths=lengths,
                                           response_lengths=lengths)
    return {"ours": lambda: rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG, compiled=False),
            "compiled": lambda: rc.compute_rollout_correction(train, rollout, mask, cu, CONFIG,
                                                              compiled=True),
            "plugin": plugin,
            "ref": lambda: loop_reference(*lists, CONFIG),
            "floor": lambda: (train - rollout).sum()}, (train, rollout, mask), lists


def measure_case(label: str, lengths: List[int], quick: bool, check: bool) -> dict:
    fns, inputs, lists = contenders(lengths)
    ours, plugin = fns["ours"], fns["plugin"]
    n_tokens = inputs[0].numel()
    big = n_tokens > 100_000
    rounds = (3 if big else 15) if quick else (7 if big else 60)

    row = {"case": label, "samples": len(lengths), "tokens": n_tokens}
    if check:  # the loop's numbers are device-independent: checked on the host
        row["reference_check"] = check_loop_reference([[t.cpu() for t in ts] for ts in lists], CONFIG)
    t = interleaved({name: timed(fn) for name, fn in fns.items()}, rounds, inner=FLOOR_INNER)
    row.update({f"{k}_s": v for k, v in t.items()})
    row.update(ref_over_ours=t["ref"] / t["ours"], ref_over_plugin=t["ref"] / t["plugin"],
               ours_over_floor=t["ours"] / t["floor"], ours_host_syncs=host_syncs(ours),
               plugin_host_syncs=host_syncs(plugin), ref_over_compiled=t["ref"] / t["compiled"],
               compiled_over_floor=t["compiled"] / t["floor"], compiled_host_syncs=host_syncs(fns["compiled"]))
    if DEVICE.type == "cuda":
        row.update({f"{name}_stream_syncs": stream_syncs(fns[name]) for name in ("ours", "compiled", "plugin")})
    metrics = ours().metrics
    metric_bytes = sum(v.numel() * v.element_size() for v in metrics.values() if isinstance(v, torch.Tensor))
    row["metric_mem_over_input"] = metric_bytes / sum(x.numel() * x.element_size() for x in inputs)
    return row


def in_step_case(label: str, lengths: List[int], rounds: int, gpu_ms: float = 20.0) -> dict:
    """On a GPU, what a call adds to a training step: each contender is called right after ~``gpu_ms`` of queued GPU
    work (a chain of bf16 8192x8192 matrix products standing for the forward pass the loss follows), then the stream
    is drained; the work alone, timed the same way, is subtracted.  A call without host synchronisation is dispatched
    while the GPU still computes (its kernels queue behind the work); one with host reads waits for the work first.
    The rounds run in a shuffled order, and ``ours again`` (the same call as ``ours``) is an A/A control: the
    difference between the two is the measurement's own (on an H200, in a fixed order, the same eager call added
    0.1-1.5 ms in one column and 0.7-3.2 ms in the next)."""
    fns, _, _ = contenders(lengths)
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    a @ a  # the first product sets up the BLAS handle: not in the calibration
    sync()
    t = time.perf_counter()
    for _ in range(5):
        a @ a
    sync()
    k = max(1, round(gpu_ms / ((time.perf_counter() - t) / 5 * 1e3)))

    def work():
        for _ in range(k):
            a @ a

    fns["ours again"] = fns["ours"]
    names = ("ours", "ours again", "compiled", "plugin", "ref")
    after_work = {"work": timed(work)}
    after_work.update({f"work+{name}": timed(lambda fn=fns[name]: (work(), fn())) for name in names})
    t = interleaved(after_work, rounds, shuffle=True)
    return {"case": label, "work_s": t["work"], **{f"{name}_added_s": t[f"work+{name}"] - t["work"]
                                                    for name in names}}


def print_in_step(rows: List[dict]) -> None:
    print("in a step (GPU): time each call adds after ~20 ms of queued GPU work (median; the work alone subtracted)")
    print(f"{'batch':27s} {'work':>8s} {'ours adds':>10s} {'again (A/A)':>12s} {'compiled adds':>14s} "
          f"{'plugin adds':>12s} {'loop ref adds':>14s}")
    for r in rows:
        print(f"{r['case']:27s} {r['work_s'] * 1e3:6.1f}ms {r['ours_added_s'] * 1e3:8.2f}ms "
              f"{r['ours again_added_s'] * 1e3:10.2f}ms "
              f"{r['compiled_added_s'] * 1e3:12.2f}ms {r['plugin_added_s'] * 1e3:10.2f}ms "
              f"{r['ref_added_s'] * 1e3:12.2f}ms")


def goals(rows: List[dict]) -> List[dict]:
    by = {r["case"]: r for r in rows}
    out = []

    def goal(name, value, target, met, unit="x"):
        out.append({"goal": name, "value": value, "target": target, "met": bool(met), "unit": unit})

    for who, tag in (("ours", ""), ("compiled", " (compiled)")):
        if MICRO in by:
            goal(f"ours{tag} vs loop reference, 16-sample micro-batch", by[MICRO][f"ref_over_{who}"], ">= 10",
                 by[MICRO][f"ref_over_{who}"] >= 10)
        if LARGE in by:
            goal(f"ours{tag} vs loop reference, 560k-token batch", by[LARGE][f"ref_over_{who}"], ">= 5",
                 by[LARGE][f"ref_over_{who}"] >= 5)
    worst = min(rows, key=lambda r: r["ref_over_plugin"])
    goal("plugin vs loop reference, worst case", worst["ref_over_plugin"], ">= 3", worst["ref_over_plugin"] >= 3)
    out[-1]["case"] = worst["case"]
    if LARGE in by:
        for who, tag in (("ours", ""), ("compiled", " (compiled)")):
            goal(f"ours{tag} in one-pass floors, 560k-token batch", by[LARGE][f"{who}_over_floor"], "<= 50",
                 by[LARGE][f"{who}_over_floor"] <= 50, unit=" floors")
    worst = max(rows, key=lambda r: r["metric_mem_over_input"])
    goal("metric memory / input bytes, worst case", worst["metric_mem_over_input"], "<= 1",
         worst["metric_mem_over_input"] <= 1)
    out[-1]["case"] = worst["case"]
    return out


def print_table(rows: List[dict]) -> None:
    print(f"{'batch':27s} {'ours':>8s} {'loop ref':>9s} {'ref/ours':>8s} {'compiled':>8s} {'ref/comp':>8s} "
          f"{'plugin':>8s} {'ref/plug':>8s} {'floor':>8s} {'ours/floor':>10s} {'comp/floor':>10s} "
          f"{'syncs ours/comp/plug':>20s} {'metric mem/input':>16s}")
    for r in rows:
        syncs = f"{r['ours_host_syncs']} / {r['compiled_host_syncs']} / {r['plugin_host_syncs']}"
        if "compiled_stream_syncs" in r:  # CUDA's detector, the compiled graph included (one call each)
            syncs += f" [{r['ours_stream_syncs']}/{r['compiled_stream_syncs']}/{r['plugin_stream_syncs']}]"
        print(f"{r['case']:27s} {r['ours_s'] * 1e3:6.2f}ms {r['ref_s'] * 1e3:7.2f}ms {r['ref_over_ours']:7.1f}x "
              f"{r['compiled_s'] * 1e3:6.2f}ms {r['ref_over_compiled']:7.1f}x "
              f"{r['plugin_s'] * 1e3:6.2f}ms {r['ref_over_plugin']:7.1f}x {r['floor_s'] * 1e3:6.3f}ms "
              f"{r['ours_over_floor']:9.1f}x {r['compiled_over_floor']:9.1f}x {syncs:>20s} "
              f"{r['metric_mem_over_input']:16.2e}")


def print_sweep(points: List[dict]) -> None:
    print(f"{'tokens':>10s} {'samples':>7s} {'ours':>9s} {'ours ns/tok':>11s} {'floor ns/tok':>12s} "
          f"{'ours/floor':>10s} {'ours peak B/tok':>15s} {'floor peak B/tok':>16s}")
    fmt = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    for p in points:
        print(f"{p['tokens']:>10d} {p['samples']:>7d} {p['ours_s'] * 1e3:7.1f}ms {p['ours_ns_per_token']:11.1f} "
              f"{p['floor_ns_per_token']:12.2f} {p['ours_s'] / p['floor_s']:9.1f}x "
              f"{fmt(p['ours_peak_bytes_per_token']):>15s} {fmt(p['floor_peak_bytes_per_token']):>16s}")
    ns = [p["ours_ns_per_token"] for p in points]
    mem = [p["ours_peak_bytes_per_token"] for p in points if p["ours_peak_bytes_per_token"] is not None]
    spread = f"ns/token max/min {max(ns) / min(ns):.2f}"
    if mem:
        spread += f", peak bytes/token max/min {max(mem) / min(mem):.2f}"
    print(f"  flatness over {points[0]['tokens']:,}..{points[-1]['tokens']:,} tokens: {spread}")


KEEP_FREED_ENV = {"MALLOC_TRIM_THRESHOLD_": str(1 << 36), "MALLOC_MMAP_THRESHOLD_": str(1 << 25)}


def cases_keeping_freed_memory(quick: bool) -> List[dict]:
    """The table's rows measured in a subprocess whose glibc keeps freed memory (:data:`KEEP_FREED_ENV`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **KEEP_FREED_ENV)
    cmd = [sys.executable, os.path.abspath(__file__), "--cases-only"] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_goals(gs: List[dict], title: str) -> None:
    print(title)
    for g in gs:
        print(f"  {g['goal']:48s} {g['value']:9.3g}{g['unit']:7s} (goal {g['target']}): "
              f"{'met' if g['met'] else 'NOT MET'}" + (f" [{g['case']}]" if "case" in g else ""))


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds, sweep to 1M tokens (< 2 min)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole table (ratios are within each run)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--device", default="cpu", help="where the batches live: cpu (default) or cuda")
    ap.add_argument("--sweep-memory", type=int, help=argparse.SUPPRESS)  # internal: one size's peak, in a subprocess
    ap.add_argument("--cases-only", action="store_true", help=argparse.SUPPRESS)  # internal: the table's rows as JSON
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.sweep_memory:
        result = sweep_memory(args.sweep_memory)
        print(json.dumps(result))
        return result
    if args.cases_only:
        rows = [measure_case(label, lengths, args.quick, check=False) for label, lengths in cases()]
        print(json.dumps(rows))
        return {"cases": rows}

    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {where}, {torch.get_num_threads()} host thread; config: token TIS truncate 2 "
          f"+ token RS [0.5, 2] + veto 1e-4 + batch norm")
    report = {"torch": torch.__version__, "device": where, "threads": 1, "quick": args.quick, "runs": []}
    for run in range(args.runs):
        print(f"\n== run {run + 1}/{args.runs}")
        rows = [measure_case(label, lengths, args.quick, check=run == 0) for label, lengths in cases()]
        if run == 0:
            worst = {k: max(r["reference_check"][k] for r in rows) for k in rows[0]["reference_check"]}
            print("loop reference == slime_rc.testing.reference.reference_correction on every case: "
                  + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
        print_table(rows)
        kept_rows = None
        if DEVICE.type == "cpu":
            kept_rows = cases_keeping_freed_memory(args.quick)
            print("the same, in a process whose glibc keeps freed memory (no page faults from another contender's "
                  "frees; " + " ".join(f"{k}={v}" for k, v in KEEP_FREED_ENV.items()) + "):")
            print_table(kept_rows)
        if DEVICE.type == "cuda":
            steps = [in_step_case(label, lengths, 5 if args.quick else 15) for label, lengths in cases()]
            print_in_step(steps)
            report.setdefault("in_step", []).append(steps)
        sizes = SWEEP_QUICK if args.quick else SWEEP
        points = [sweep_point(n, 2 if args.quick else (5 if n <= 1_000_000 else 3)) for n in sizes]
        print("scaling (ours; peak = " + ("torch.cuda.max_memory_allocated above the inputs):" if DEVICE.type == "cuda"
                                          else "RSS high-water mark above the inputs, in a fresh process per size):"))
        print_sweep(points)
        gs = goals(rows)
        print_goals(gs, "goals:" if DEVICE.type == "cpu" else "goals (defined for one CPU thread; shown for reference):")
        entry = {"cases": rows, "sweep": points, "goals": gs}
        if kept_rows is not None:
            entry.update(cases_keeping_freed_memory=kept_rows, goals_keeping_freed_memory=goals(kept_rows))
            print_goals(entry["goals_keeping_freed_memory"], "goals, glibc keeping freed memory:")
        report["runs"].append(entry)
    if args.runs > 1:
        for key, title in (("goals", "\nacross runs:"), ("goals_keeping_freed_memory",
                                                         "across runs, glibc keeping freed memory:")):
            if key not in report["runs"][0]:
                continue
            print(title)
            for i, g in enumerate(report["runs"][0][key]):
                values = [r[key][i]["value"] for r in report["runs"]]
                met = sum(r[key][i]["met"] for r in report["runs"])
                print(f"  {g['goal']:48s} " + ", ".join(f"{v:.3g}" for v in values) + f"  (met in {met}/{args.runs})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")
    return report


if __name__ == "__main__":
    main()
