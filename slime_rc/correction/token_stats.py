"""Stage 1 of the engine: per-token log-ratio, validity and token-level rejections (no communication).

For each token ``t``: ``log r_t = log pi_train - log pi_rollout`` in float32; the token is *valid* if it is a loss
token and ``log r_t`` is finite.  Invalid tokens get ``log r_t = 0`` (so ``r_t = 1``) and are left out of every
count; sums over all N tokens stay finite and exact.  The token-level rules flag valid tokens: veto (unclamped
``r_t < veto_threshold``), each token RS criterion (its statistic outside its bounds) and token-level IS mask mode
(``r_t`` outside ``[is_lower, is_upper_bound]``).  Also here: the non-finite error message, raised after
collective 2 so that every rank raises together.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.packed import first_nonfinite, tracing
from slime_rc.correction.records import PackedBatch, TokenStats
from slime_rc.correction.weights import Comparisons, bounded_weight, outside_flag


def k_statistic(kind: str, clamped_log_ratio: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Per-token divergence ``[N]``: k2 = (log r)^2 / 2, k3 = r - 1 - log r (both >= 0), on the clamped log r."""
    if kind == "k2":
        return 0.5 * clamped_log_ratio * clamped_log_ratio
    return ratio - 1.0 - clamped_log_ratio


def _union(flags: List[torch.Tensor]) -> torch.Tensor:
    out = flags[0]  # one rule: the same tensor (stage 2 sums a tensor given twice only once)
    for f in flags[1:]:
        out = torch.maximum(out, f)
    return out


def token_statistics(batch: PackedBatch, config: RolloutCorrectionConfig) -> TokenStats:
    """Stage 1 on this rank's ``N`` tokens (see :class:`TokenStats` for every field's shape and meaning)."""
    train, rollout, mask = batch.train, batch.rollout, batch.mask
    bound = config.safety_bound

    lr = train - rollout
    # valid = loss token with a finite log r (NaN or inf on either side makes it non-finite); as float32 0/1
    valid = lr.abs().lt_(math.inf).mul_(mask)  # in place: one [N] buffer
    # zeros keep every sum below finite and exact: non-finite values go to 0 first, then masked tokens
    if tracing():  # compiled: a select (inductor's nan_to_num tests NaN one value at a time)
        is_valid = valid > 0
        lr, rollout_v = torch.where(is_valid, lr, 0.0), torch.where(is_valid, rollout, 0.0)
    else:
        lr = torch.nan_to_num_(lr, 0.0, 0.0, 0.0).mul_(valid)
        rollout_v = torch.nan_to_num(rollout, 0.0, 0.0, 0.0).mul_(valid)
    lr_c = lr.clamp(-bound, bound)
    ratio = torch.exp(lr_c)  # safety-bounded per-token ratio; exactly 1 on invalid tokens

    comparisons = Comparisons()  # the metrics ask for some of the same tests (batch_totals)
    veto = None
    if config.veto_threshold is not None:  # unclamped ratio, before the safety bound
        veto = outside_flag(lr, math.log(config.veto_threshold), math.inf, valid, comparisons)

    k_cache: Dict[str, torch.Tensor] = {}

    def k_of(kind: str) -> torch.Tensor:  # each divergence is computed once, for every criterion that needs it
        if kind not in k_cache:  # 0 on invalid tokens already: their lr_c is 0 and ratio 1
            k_cache[kind] = k_statistic(kind, lr_c, ratio)
        return k_cache[kind]

    # token-level rejection: RS token criteria and token-level IS mask mode
    is_token = config.is_level == "token"
    rs_flags = []
    for c in config.rs:
        if c.granularity == "token":
            stat = lr if c.statistic == "k1" else k_of(c.statistic)
            rs_flags.append((c.option, outside_flag(stat, *c.log_bounds, valid, comparisons)))
    mask_flags = []
    if is_token and config.is_mode == "mask":
        mask_flags.append(outside_flag(lr, math.log(config.is_lower), math.log(config.is_upper_bound), valid,
                                       comparisons))

    rs_token = dict(rs_flags)
    is_mask = mask_flags[0] if mask_flags else None
    rs_rejected = _union([f for _, f in rs_flags]) if rs_flags else None
    rejected: Optional[torch.Tensor] = None
    keep = valid
    if rs_flags or mask_flags:
        rejected = _union([f for _, f in rs_flags] + mask_flags)
        keep = valid - rejected  # every flag is of valid tokens

    # per-token divergences that stage 2 aggregates per sequence: those of the sequence RS criteria, and those of
    # the token k2/k3 criteria, whose per-sequence mean is a metric (verl's rollout_rs_<option>_seq_*; for token k1
    # it is S / T, already there).  A divergence shared by several criteria is one tensor, summed once.
    k_sum_terms: Dict[str, torch.Tensor] = {}
    k_max_terms: Dict[str, torch.Tensor] = {}
    for c in config.rs:
        if c.statistic != "k1":
            if c.aggregate == "max":
                k_max_terms[c.option] = torch.where(valid > 0, k_of(c.statistic), -math.inf)
            else:
                k_sum_terms[c.option] = k_of(c.statistic)

    nonfinite = mask - valid
    flags = [valid, nonfinite, veto, is_mask, rs_rejected, rejected, keep, *rs_token.values()]
    is_weight = None
    if is_token:  # invalid tokens hold r = 1: their weight is 0 (mask mode's weight is r itself: not in place)
        bounded = bounded_weight(ratio, config)
        is_weight = bounded * valid if bounded is ratio else bounded.mul_(valid)
    return TokenStats(
        valid=valid, log_ratio=lr, clamped_log_ratio=lr_c, ratio=ratio, rollout_log_probs=rollout_v,
        nonfinite=nonfinite,
        veto=veto, rs_token=rs_token, is_mask=is_mask, rs_rejected=rs_rejected, rejected=rejected, keep=keep,
        # computed here (not in stage 4) because collective 1 sums it per sequence for the sequence-weight metrics
        is_weight=is_weight,
        k_sum_terms=k_sum_terms, k_max_terms=k_max_terms, comparisons=comparisons,
        counts=tuple(f for f in flags if f is not None),
    )


def describe_nonfinite(batch: PackedBatch, nonfinite_seqs: torch.Tensor) -> str:
    """The ``on_nonfinite='error'`` message (slow path: reads the device freely), once the global count after
    collective 2 has shown a non-finite loss token somewhere in the batch group -- every rank sees that count, so
    all of them raise together.  ``nonfinite_seqs``: ``[B]`` bool, sequences with a non-finite token on any rank
    of their sequence group."""
    # the loss tokens with a NaN/inf log-prob (TokenStats.nonfinite), found again: this path runs once, to raise
    nonfinite = (batch.mask != 0) & ~torch.isfinite(batch.train - batch.rollout)
    where = first_nonfinite(batch.train, batch.rollout, nonfinite, batch.cu_seqlens)
    if where is None:
        first = int(torch.nonzero(nonfinite_seqs)[0, 0]) if bool(nonfinite_seqs.any()) else None
        where = (f"sample {first} (its non-finite tokens are on another rank)" if first is not None
                 else "another rank's batch")
    return (f"non-finite log-probs on loss tokens: {where}. Fix the log-prob source (SGLang serializes NaN/inf "
            f"as null), or set on_nonfinite='reject' to drop such sequences and count them in the "
            f"'nonfinite_seq_fraction' metric.")


NONFINITE_SUMMARY = ("non-finite log-probs on loss tokens (train_log_probs or rollout_log_probs); fix the log-prob "
                     "source, or set on_nonfinite='reject' to drop such sequences and count them")
