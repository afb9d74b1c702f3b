"""What slime does, written independently for the tests (no slime checkout at CI time).

* :func:`mis_reference`: the semantics of slime's example ``mis.py`` (THUDM/slime 624b824a8,
  ``examples/train_infer_mismatch_helper``) on FULL sequences, one sample at a time in float64, with slime-rc's two
  deliberate differences (RS without IS, veto without RS) as options;
* :func:`tis_reference` / :func:`icepop_reference`: slime's built-in ``vanilla_tis_function`` / ``icepop_function``;
* :func:`zigzag_positions`: the response positions a CP rank holds (``cp_utils.get_logits_and_tokens_offset_with_cp``);
* :func:`consume`: slime's loss side of the TIS-function call (``loss.py`` ``policy_loss_function`` and
  ``cp_utils.get_sum_of_sample_mean``): it cuts the returned full-length masks to its own positions, keeps the
  original masks' sums as denominators, and reduces each metric with the original mask (per-sample mean, or token
  sum with ``calculate_per_token_loss``).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

BOUND = 20.0


def _exp(x):
    return torch.exp(torch.clamp(x, -BOUND, BOUND))


def mis_reference(keys: dict, train: List[torch.Tensor], rollout: List[torch.Tensor], masks: List[torch.Tensor],
                  *, rs_without_tis: bool = True, veto_without_rs: bool = True):
    """``(weights list | None, masks list, {name: list})`` of full sequences; names without ``mis_``."""
    use_tis, use_rs = keys.get("use_tis") or False, keys.get("use_rs") or False
    level, mode = keys.get("tis_level") or "token", keys.get("tis_mode") or "truncate"
    hi = keys.get("tis_upper_bound") or 2.0
    lo = keys.get("tis_lower_bound") or 1.0 / hi
    rs_level = keys.get("rs_level") or level
    rs_lo = keys.get("rs_lower_bound") or lo
    rs_hi = keys.get("rs_upper_bound") or hi
    veto = keys.get("rs_veto_threshold")
    normalize = keys.get("tis_batch_normalize") or False
    # slime runs IS/RS/veto only with use_tis, and the veto only with use_rs; slime-rc applies what is set
    pipeline = use_tis or (rs_without_tis and use_rs) or (veto_without_rs and veto is not None)
    apply_rs = use_rs and pipeline
    apply_veto = veto is not None and pipeline and (use_rs or veto_without_rs)

    metrics: Dict[str, List[torch.Tensor]] = {}

    def put(name, value):
        metrics.setdefault(name, []).append(value.double())

    def mean_over(x, m):
        return (x * m).sum() / max(float(m.sum()), 1.0)

    for t, r, m in zip(train, rollout, masks):
        t, r, m = t.double(), r.double(), m.double()
        ones = torch.ones_like(t)
        mt, mr = mean_over(t, m), mean_over(r, m)
        lr = t - r
        put("training_log_ppl", -mt * ones)
        put("training_ppl", torch.exp(-mt) * ones)
        put("rollout_log_ppl", -mr * ones)
        put("rollout_ppl", torch.exp(-mr) * ones)
        put("kl", r - t)
        put("k3_kl", torch.exp(lr) - lr - 1)
        put("log_ppl_diff", (mr - mt) * ones)
        put("log_ppl_abs_diff", (mr - mt).abs() * ones)
        put("ppl_ratio", torch.exp(mr - mt) * ones)
        put("chi2_token", (mean_over(_exp(lr) ** 2, m) - 1) * ones)
        put("chi2_seq", (torch.exp(2 * torch.clamp((lr * m).sum(), -BOUND, BOUND)) - 1) * ones)
    if not pipeline:
        return None, list(masks), metrics

    def level_ratio(lvl, lr, m):
        if lvl == "token":
            return _exp(lr)
        s = (lr * m).sum()
        return _exp(s if lvl == "sequence" else s / max(float(m.sum()), 1.0)) * torch.ones_like(lr)

    weights, new_masks = [], []
    for t, r, m in zip(train, rollout, masks):
        lr, m = t.double() - r.double(), m.double()
        keep = m.clone()
        if use_tis:
            w0 = level_ratio(level, lr, m)
            put("tis_weight_before_bound", w0)
            if mode == "truncate":
                put("tis_truncate_fraction", (w0 > hi).double())
                w = torch.minimum(w0, torch.tensor(hi, dtype=torch.float64)) * m
            elif mode == "clip":
                put("tis_clip_fraction_low", (w0 < lo).double())
                put("tis_clip_fraction_high", (w0 > hi).double())
                w = torch.clamp(w0, lo, hi) * m
            else:
                put("tis_mask_fraction_low", (w0 < lo).double())
                put("tis_mask_fraction_high", (w0 > hi).double())
                keep = keep * ((w0 >= lo) & (w0 <= hi)).double()
                w = w0 * m
            put("tis_weight_after_bound", w)
        else:
            w = torch.ones_like(lr)
        if apply_rs:
            rw = level_ratio(rs_level, lr, m)
            put("rs_mask_fraction_low", (rw < rs_lo).double())
            put("rs_mask_fraction_high", (rw > rs_hi).double())
            keep = keep * ((rw >= rs_lo) & (rw <= rs_hi)).double()
        if apply_veto:
            bad = (lr < math.log(veto)) & (m > 0)
            put("rs_catastrophic_token_fraction", bad.double())
            put("rs_catastrophic_seq_fraction", float(bad.any()) * torch.ones_like(lr))
            if bad.any():
                keep = keep * 0
        put("is_ratio_mean_after_tis_rs", w)
        weights.append(w)
        new_masks.append(keep)
    if normalize:
        lvl = level if use_tis else "token"
        if lvl == "token":
            total = sum(float((w * m.double()).sum()) for w, m in zip(weights, masks))
            mean = total / max(sum(float(m.sum()) for m in masks), 1.0)
        else:  # sequence; geometric too (slime's example raises there; slime-rc does the same as sequence)
            mean = sum(float(mean_over(w, m.double())) for w, m in zip(weights, masks)) / len(weights)
        factor = mean if mean > 1e-8 else 1.0
        weights = [w / factor for w in weights]
        for w in weights:
            put("batch_norm_factor", factor * torch.ones_like(w))
    for w, m in zip(weights, masks):
        m = m.double()
        on = m > 0
        put("is_ratio_mean_final", mean_over(w, m) * torch.ones_like(w))
        put("is_ratio_min_final", (w[on].min() if on.any() else torch.tensor(0.0)) * torch.ones_like(w))
        put("is_ratio_max_final", (w[on].max() if on.any() else torch.tensor(0.0)) * torch.ones_like(w))
    return (weights if use_tis else None), new_masks, metrics


def _ratio_reference(args: dict, train, rollout, masks, band: bool):
    high, low = args.get("tis_clip", 2.0), args.get("tis_clip_low", 0.0)
    weights, metrics = [], {"tis": [], "tis_clipfrac": [], "tis_abs": []}
    for t, r in zip(train, rollout):
        ratio = torch.exp(t.double() - r.double())
        w = torch.where((ratio >= low) & (ratio <= high), ratio, 0.0) if band else ratio.clamp(low, high)
        weights.append(w)
        metrics["tis"].append(ratio)
        metrics["tis_clipfrac"].append((w != ratio).double())
        metrics["tis_abs"].append((ratio - 1).abs())
    return weights, list(masks), metrics


def tis_reference(args: dict, train, rollout, masks):
    return _ratio_reference(args, train, rollout, masks, band=False)


def icepop_reference(args: dict, train, rollout, masks):
    return _ratio_reference(args, train, rollout, masks, band=True)


def zigzag_positions(total: int, response: int, cp: int, rank: int) -> torch.Tensor:
    """Response positions ``j`` rank ``rank`` holds: logit position ``prompt - 1 + j`` in chunks ``rank`` and
    ``2cp - 1 - rank`` of ``ceil(total / 2cp)`` positions."""
    if cp == 1:
        return torch.arange(response)
    chunk = (total + 2 * cp - 1) // (2 * cp)
    prompt = total - response
    held = []
    for c in (rank, 2 * cp - 1 - rank):
        lo, hi = max(c * chunk, prompt - 1), min((c + 1) * chunk, total - 1)
        held += [p - (prompt - 1) for p in range(lo, hi)]
    return torch.tensor(held, dtype=torch.int64)


def consume(pg_out: torch.Tensor, masks_out: List[torch.Tensor], metrics: Dict[str, torch.Tensor],
            masks_in: List[torch.Tensor], idx: List[torch.Tensor], per_token: bool = False):
    """slime's reduction on one rank: ``(loss, {name: value})`` as sums over this rank's samples; the caller adds
    the ranks.  ``idx``: the positions this rank holds of each sample."""
    lengths = [len(i) for i in idx]
    denoms = [max(float(m.sum()), 1.0) for m in masks_in]

    def reduce(x: torch.Tensor, masks: List[torch.Tensor]):
        total = 0.0
        for xi, m, i, d in zip(x.split(lengths), masks, idx, denoms):
            part = (xi.double() * m[i].double()).sum()
            total = total + (part if per_token else part / d)
        return total

    loss = reduce(pg_out, masks_out)
    return loss, {k: reduce(v, masks_in) for k, v in metrics.items()}


def rank_inputs(samples: List[dict], cp: int, rank: int, per_sample=None):
    """This rank's view of full samples (``P``, ``R``, ``train``, ``rollout``, ``mask`` each)."""
    idx = [zigzag_positions(s["P"] + s["R"], s["R"], cp, rank) for s in samples]
    return idx, dict(train_log_probs=[s["train"][i] for s, i in zip(samples, idx)],
                     rollout_log_probs=[s["rollout"][i] for s, i in zip(samples, idx)],
                     loss_masks=[s["mask"] for s in samples],
                     total_lengths=[s["P"] + s["R"] for s in samples], response_lengths=[s["R"] for s in samples])


def make_samples(seed: int = 0, n: int = 7, *, veto_sample: Optional[int] = 2) -> List[dict]:
    """Full samples with prompt/response lengths from 1 up, multi-turn style masks (zeros inside), one response
    with an all-zero mask, ratios on both sides of [0.5, 2], and one catastrophic token (ratio ~ e^-12)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P = int(torch.randint(1, 12, (1,), generator=g))
        R = [1, 3, 17, 6, 29, 2, 11, 8][i % 8]
        train = -torch.rand(R, generator=g, dtype=torch.float64) * 2 - 0.05
        rollout = train + 0.5 * torch.randn(R, generator=g, dtype=torch.float64)
        mask = (torch.rand(R, generator=g) > 0.2).to(torch.int32)
        mask[0] = 1
        if i == 5:
            mask[:] = 0
        if veto_sample is not None and i == veto_sample:
            rollout[R // 2] = train[R // 2] + 12.0
            mask[R // 2] = 1
        out.append(dict(P=P, R=R, train=train.float(), rollout=rollout.float(), mask=mask))
    return out
