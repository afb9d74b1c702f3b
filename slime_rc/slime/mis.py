"""slime's example ``mis.py`` semantics over packed CP-local tokens, with O(B) reductions.

Inputs are this rank's tokens of ``B`` sequences, packed: ``train``, ``rollout`` ``[N]`` log-probs, ``mask``
``[N]`` 0/1 (the ORIGINAL loss mask), ``cu_seqlens`` ``[B+1]``.  Under context parallelism every rank holds a
piece of every sequence; the per-sequence sums and extremes below are combined over the CP group with ONE
``reducer.combine_sequences`` call (``B x k`` float64 values), so no sequence is gathered.

Per token ``lr = log pi_train - log pi_rollout``; ``exp`` always acts on ``clamp(., -20, 20)`` (slime's
SAFETY_BOUND).  With ``n_i = sum mask``, ``S_i = sum lr * mask`` (masked sums over the whole sequence):

* IS (``use_tis``): the level's log-ratio ``lr`` / ``S_i`` / ``S_i / max(n_i, 1)``; ``w0 = exp(clamp(.))``;
  truncate ``min(w0, U) * mask``, clip ``clamp(w0, L, U) * mask``, mask ``w0 * mask`` with tokens outside
  ``[L, U]`` removed from the mask.  Without ``use_tis`` the weights are 1.
* RS (``use_rs``): the RS level's ratio must lie in ``[rs_lower, rs_upper]``, else the token (token level) or
  sequence is removed from the mask.  Veto: a sequence holding a loss token with ``lr < log(veto)`` (unclamped)
  is removed.
* Batch normalization: token level ``mean = sum_i sum_t w * mask / max(sum_i n_i, 1)``; sequence and geometric
  level ``mean = mean_i masked_mean(w_i)`` over the call's sequences.  Both use the ORIGINAL mask and the
  bounded weights of rejected tokens too (slime's choice; per micro-batch, since slime calls once per
  micro-batch).  Weights are divided by ``mean`` when ``mean > 1e-8``.

The IS weight returned for a rejected token is its bounded weight (as slime returns it); the returned keep mask
is what removes it from the loss.  Metrics are slime's, per token, for slime's original-mask per-sample mean.

No host read: every tensor is made on the inputs' device, no branch depends on a device value, and the check for
non-finite log-probs on loss tokens is a flag in a :class:`~slime_rc.correction.checks.DeferredChecks` (the
caller's, read once per call with the caller's other checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.packed import segment_max, segment_sums, token_sequence_ids
from slime_rc.correction.reducer import LocalReducer, as_reducer
from slime_rc.slime.settings import SlimeMisSettings

# slime's metric names (the CP form returns them with slime's ``mis_`` prefix), in slime's order; which appear
# depends on the settings (docs/slime.md).
MISMATCH_METRICS = ("training_log_ppl", "training_ppl", "rollout_log_ppl", "rollout_ppl", "kl", "k3_kl",
                    "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio", "chi2_token", "chi2_seq")
CORRECTION_METRICS = ("tis_weight_before_bound", "tis_truncate_fraction", "tis_clip_fraction_low",
                      "tis_clip_fraction_high", "tis_mask_fraction_low", "tis_mask_fraction_high",
                      "tis_weight_after_bound", "rs_mask_fraction_low", "rs_mask_fraction_high",
                      "rs_catastrophic_token_fraction", "rs_catastrophic_seq_fraction", "is_ratio_mean_after_tis_rs",
                      "batch_norm_factor", "is_ratio_mean_final", "is_ratio_min_final", "is_ratio_max_final")
SLIME_METRICS = MISMATCH_METRICS + CORRECTION_METRICS

SAFETY_BOUND = 20.0
_NORM_FLOOR = 1e-8  # slime divides by the batch mean only above this
_PPL_EXP_MAX = 80.0  # exp of a float32 perplexity overflows past ~88: keep the metric finite


@dataclass
class SlimeMisResult:
    """``weights``: ``[N]`` float32 final IS weights (None without IS); ``keep``: ``[N]`` float32 0/1, the modified
    loss mask of this rank's tokens; ``seq_keep``: ``[B]`` bool, False for sequences rejected as a whole (veto,
    sequence-level RS or mask mode), known on every rank; ``metrics``: slime's names (no ``mis_`` prefix) ->
    ``[N]`` float32 per-token values (0 where the mask is 0)."""

    weights: Optional[torch.Tensor]
    keep: torch.Tensor
    seq_keep: torch.Tensor
    metrics: Dict[str, torch.Tensor]


class NonFiniteLogProbs(ValueError):
    """A non-finite log-prob on a loss token (slime's example would put NaN into the loss)."""


def _level_log_ratio(level: str, lr: torch.Tensor, s: torch.Tensor, n_safe: torch.Tensor):
    """``(per-token, per-sequence or None)`` log-ratio of ``level``."""
    if level == "token":
        return lr, None
    return None, s if level == "sequence" else s / n_safe


def add_nonfinite_check(checks: DeferredChecks, bad: torch.Tensor, describe_token: Optional[Callable[[int], str]],
                        fix: str, *, bad_per_sequence: Optional[torch.Tensor] = None) -> None:
    """Defer the check for non-finite log-probs on loss tokens: ``bad`` ``[N]`` bool marks this rank's; with
    ``bad_per_sequence`` ``[B]`` (counts combined over the CP group) every rank of the group raises together.  On
    the slow path (raising anyway) it raises :class:`NonFiniteLogProbs` naming the sample and position when this
    rank holds the token (``describe_token(j)``), the sample otherwise."""
    count = bad.sum() if bad_per_sequence is None else bad_per_sequence.sum()

    def describe() -> str:
        local = torch.nonzero(bad)
        if local.numel() and describe_token is not None:
            where = describe_token(int(local[0, 0]))
        else:
            first = int(torch.nonzero(bad_per_sequence if bad_per_sequence is not None else bad)[0, 0])
            where = f"sample {first} (its non-finite token is held by another context-parallel rank)"
        raise NonFiniteLogProbs(f"non-finite log-prob on a loss token: {where}. {fix}")
    checks.add(count, f"non-finite log-prob on a loss token. {fix}", describe)


_NONFINITE_FIX = ("slime's example would put NaN into pg_loss; fix the log-prob source (SGLang reports NaN/inf as "
                  "null) or mask such tokens out of loss_masks.")


def slime_mis(settings: SlimeMisSettings, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
              cu_seqlens: torch.Tensor, *, reducer: Optional[LocalReducer] = None,
              describe_token=None, checks: Optional[DeferredChecks] = None) -> SlimeMisResult:
    """slime's mis computation for packed tokens (see the module docstring).

    ``mask``: the loss mask, 0/1 (any dtype; a non-zero integer or bool counts as 1); a float32 mask is used as it
    is, so it must hold only 0 and 1 (``custom_tis``'s ``Batch`` makes it so and checks the caller's values).
    ``checks``: where the check for a non-finite log-prob on a loss token goes (the caller reads it); without it
    this call reads it once at the end and raises.  ``describe_token(j) -> str``: names packed index ``j`` (sample
    and response position) for that error; every rank of the CP group raises (the count is combined over the
    group), none waits in a collective.
    """
    own = checks is None
    checks = DeferredChecks() if own else checks
    result = _slime_mis(settings, train, rollout, mask, cu_seqlens, reducer, describe_token, checks)
    if own:
        checks.raise_if_any()
    return result


def _slime_mis(settings: SlimeMisSettings, train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
               cu_seqlens: torch.Tensor, reducer, describe_token, checks: DeferredChecks) -> SlimeMisResult:
    s = settings
    reducer = as_reducer(reducer)
    reducer.agree("custom_tis.mis (slime semantics)", settings, cu_seqlens.numel() - 1)
    dev = train.device
    n_tokens, n_seqs = train.numel(), cu_seqlens.numel() - 1
    token_is = s.use_tis and s.tis_level == "token"
    # token -> its sequence, once; each broadcast below is then a gather (int64 where the token-level weight
    # extremes scatter by it: built so, not converted after)
    seq_of_token = token_sequence_ids(cu_seqlens, n_tokens, torch.int64 if token_is else torch.int32)
    per_tok = (lambda v: v.index_select(0, seq_of_token))
    # per-sequence metrics ([B] values that slime reports on every token) are broadcast together at the end
    metrics: Dict[str, Any] = {}

    # Fresh [N] buffers are few and ops in place where they can be: on a CPU each fresh buffer costs page faults
    # (more than its arithmetic), and on any device each is one more pass over memory.
    train, rollout = train.detach().float(), rollout.detach().float()
    # [N] float32 0/1: a float32 mask is taken as it is (0/1, as the custom_tis Batch makes and checks it)
    m = mask if mask.dtype == torch.float32 else torch.ne(mask, 0, out=torch.empty(n_tokens, dtype=torch.float32,
                                                                                  device=dev))
    lr = train - rollout
    # loss tokens whose log r is not finite (|x| < inf is False for NaN and +-inf), as float32 0/1
    bad = torch.abs(lr).lt_(math.inf).mul_(m).neg_().add_(m)  # m - m * finite
    # log r, 0 off the loss mask and where it is not finite: every use below is masked anyway (so it changes no
    # output), and a masked sum or metric needs no product of its own
    lr = torch.nan_to_num_(lr, 0.0, 0.0, 0.0).mul_(m)
    rho = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp_()  # 1 off the mask

    # ---- per-sequence pieces, combined over the CP group in one collective --------------------------------------
    sums = {
        "n": m,
        "lr": lr,
        # sum log pi_train follows as "lr" + "rollout" (log r = log pi_train - log pi_rollout): one column less
        "rollout": torch.nan_to_num(rollout, 0.0, 0.0, 0.0).mul_(m),  # = where(m & isfinite(rollout), rollout, 0)
        "rho2": (rho * rho).mul_(m),
        "bad": bad,
    }
    counts = [m, bad]  # 0/1 columns: summed exactly in float32 blocks (segment_sums)
    if s.veto is not None:
        catastrophic = torch.lt(lr, math.log(s.veto), out=torch.empty_like(lr)).mul_(m)  # unclamped log r
        sums["veto"] = catastrophic
        counts.append(catastrophic)
    maxes = {}
    if token_is:
        if s.tis_mode == "mask":
            w_tok = rho * m
        else:
            w_tok = rho.clamp(0 if s.tis_mode == "truncate" else s.tis_lower, s.tis_upper).mul_(m)
        sums["w"] = w_tok
        # a bounded weight is > 0 on every loss token (exp of a log r clamped to +-20 is), and 0 off the mask: the
        # maximum over all of a sequence's tokens is the one over its loss tokens (a sequence without any reports 0)
        maxes["w_max"] = w_tok
        maxes["w_neg_min"] = torch.where(m > 0, w_tok, math.inf).neg_()  # = where(m, -w, -inf): negation is exact
    zeros = torch.zeros(n_seqs, 0, dtype=torch.float64, device=dev)
    local_sums = segment_sums(list(sums.values()), cu_seqlens, counts).T  # [B, k]
    if maxes:
        local_maxes = torch.stack([segment_max(v, seq_of_token, n_seqs) for v in maxes.values()], 1)
    else:
        local_maxes = zeros
    g_sums, g_maxes = reducer.combine_sequences(local_sums, local_maxes)
    col = dict(zip(sums, g_sums.unbind(1)))
    col.update(zip(maxes, g_maxes.unbind(1)))

    # the check of this call, deferred: every CP rank sees the combined count
    add_nonfinite_check(checks, bad, describe_token, _NONFINITE_FIX, bad_per_sequence=col["bad"])

    n = col["n"]
    has = n > 0
    n_safe = n.clamp(min=1)
    S = col["lr"]

    # ---- slime's add_ppl_metrics: per-sequence values broadcast, per-token values as they are -------------------
    mean_train = (S + col["rollout"]) / n_safe
    mean_rollout = col["rollout"] / n_safe
    diff = mean_rollout - mean_train
    metrics["training_log_ppl"] = _PerSequence((-mean_train).float())
    metrics["training_ppl"] = _PerSequence(torch.exp((-mean_train).clamp(max=_PPL_EXP_MAX)).float())
    metrics["rollout_log_ppl"] = _PerSequence((-mean_rollout).float())
    metrics["rollout_ppl"] = _PerSequence(torch.exp((-mean_rollout).clamp(max=_PPL_EXP_MAX)).float())
    metrics["kl"] = _Masked(torch.neg(lr))  # lr is 0 off the mask
    metrics["k3_kl"] = _Masked((rho - lr).sub_(1))  # off the mask: 1 - 0 - 1 = 0 exactly
    metrics["log_ppl_diff"] = _PerSequence(diff.float())
    metrics["log_ppl_abs_diff"] = _PerSequence(diff.abs().float())
    metrics["ppl_ratio"] = _PerSequence(torch.exp(diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)).float())
    metrics["chi2_token"] = _PerSequence((col["rho2"] / n_safe - 1).float())
    metrics["chi2_seq"] = _PerSequence((torch.exp(2 * S.clamp(-SAFETY_BOUND, SAFETY_BOUND)) - 1).float())

    if not s.corrects:  # metrics only: slime returns the loss masks unchanged and no weights
        return SlimeMisResult(None, m, torch.ones(n_seqs, dtype=torch.bool, device=dev), _masked(metrics, m, seq_of_token))

    # ---- IS weights ---------------------------------------------------------------------------------------------
    keep = m
    seq_keep = torch.ones(n_seqs, dtype=torch.bool, device=dev)
    if s.use_tis:
        tok_lr, seq_lr = _level_log_ratio(s.tis_level, lr, S, n_safe)
        if token_is:
            w0, w = rho, w_tok
        else:
            w0_seq = torch.exp(seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
            w_seq = {"truncate": lambda: w0_seq.clamp(0, s.tis_upper),
                     "clip": lambda: w0_seq.clamp(s.tis_lower, s.tis_upper), "mask": lambda: w0_seq}[s.tis_mode]()
            w0 = per_tok(w0_seq.float())
            w = per_tok(w_seq.float()) * m
        # masked in place at the end (rho, or this call's gather): every other reader of it comes before
        metrics["tis_weight_before_bound"] = _MaskInPlace(w0)
        if s.tis_mode == "truncate":
            metrics["tis_truncate_fraction"] = _flag(torch.gt, w0, s.tis_upper, m)
        else:
            kind = "clip" if s.tis_mode == "clip" else "mask"
            low = metrics[f"tis_{kind}_fraction_low"] = _flag(torch.lt, w0, s.tis_lower, m)
            high = metrics[f"tis_{kind}_fraction_high"] = _flag(torch.gt, w0, s.tis_upper, m)
            if s.tis_mode == "mask":
                keep = _outside_removed(keep, low, high)
                if not token_is:
                    seq_keep &= (w0_seq >= s.tis_lower) & (w0_seq <= s.tis_upper)
        metrics["tis_weight_after_bound"] = w_after = _Masked(w)  # w is 0 off the mask already (w = ... * m)
    else:
        w = torch.ones_like(lr)

    # ---- rejection: ratio band at the RS level, then the veto -----------------------------------------------------
    if s.use_rs:
        tok_lr, seq_lr = _level_log_ratio(s.rs_level, lr, S, n_safe)
        if tok_lr is not None:
            rs_w = rho  # exp(clamp(log r)): the token IS ratio, computed once
        else:
            rs_w_seq = torch.exp(seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
            seq_keep &= (rs_w_seq >= s.rs_lower) & (rs_w_seq <= s.rs_upper)
            rs_w = per_tok(rs_w_seq.float())
        low = metrics["rs_mask_fraction_low"] = _flag(torch.lt, rs_w, s.rs_lower, m)
        high = metrics["rs_mask_fraction_high"] = _flag(torch.gt, rs_w, s.rs_upper, m)
        keep = _outside_removed(keep, low, high)
    if s.veto is not None:
        vetoed = col["veto"] > 0
        seq_keep &= ~vetoed
        metrics["rs_catastrophic_token_fraction"] = _Masked(sums["veto"])  # catastrophic.float(): 0 off the mask
        metrics["rs_catastrophic_seq_fraction"] = _PerSequence(vetoed.float())
        kept_seq = per_tok((~vetoed).float())
        keep = keep * kept_seq if keep is m else keep.mul_(kept_seq)  # m is also the "n" column: not in place
    metrics["is_ratio_mean_after_tis_rs"] = w_after if s.use_tis else w  # the same values: one masked copy

    # ---- batch normalization over the call's sequences (original mask, rejected tokens included) ---------------
    if token_is:
        seq_w_sum = col["w"]
    elif s.use_tis:
        seq_w_sum = w_seq * n
    else:
        seq_w_sum = n  # weights of 1
    norm = None
    if s.batch_normalize:
        if not s.use_tis or s.tis_level == "token":
            mean = seq_w_sum.sum() / n.sum().clamp(min=1)
        else:
            mean = (seq_w_sum / n_safe).sum() / max(n_seqs, 1)
        norm = torch.where(mean > _NORM_FLOOR, mean, torch.ones_like(mean))
        w = w / norm.float()
        metrics["batch_norm_factor"] = norm.float().expand(n_tokens)
    scale = 1.0 if norm is None else norm
    if token_is:
        w_min, w_max = -col["w_neg_min"], col["w_max"]
    elif s.use_tis:
        w_min = w_max = w_seq
    else:
        w_min = w_max = torch.ones_like(n)
    zero = torch.zeros_like(n)
    metrics["is_ratio_mean_final"] = _PerSequence((seq_w_sum / n_safe / scale).float())
    metrics["is_ratio_min_final"] = _PerSequence(torch.where(has, w_min / scale, zero).float())
    metrics["is_ratio_max_final"] = _PerSequence(torch.where(has, w_max / scale, zero).float())
    weights = None
    if s.use_tis:  # not the metric's tensor itself (w without batch normalization): the caller owns its weights
        weights = w.float() if norm is not None else w.clone()
    return SlimeMisResult(weights, keep, seq_keep, _masked(metrics, m, seq_of_token))


class _PerSequence:
    """A ``[B]`` metric that slime reports on every token of its sequence (broadcast by :func:`_masked`)."""

    def __init__(self, value: torch.Tensor):
        self.value = value


class _MaskInPlace:
    """A ``[N]`` metric of this call's own that nothing reads after :func:`_masked`, which masks it in place."""

    def __init__(self, value: torch.Tensor):
        self.value = value


class _Masked:
    """A ``[N]`` metric already 0 off the loss mask (its product with the 0/1 mask is itself, bit for bit): returned
    as it is by :func:`_masked`, without a fresh copy."""

    def __init__(self, value: torch.Tensor):
        self.value = value


def _outside_removed(keep: torch.Tensor, low: _Masked, high: _Masked) -> torch.Tensor:
    """``keep * [lower <= x <= upper]`` from the two flags of ``x`` outside the band (``[N]`` float32 0/1, masked):
    the band is not empty (the settings check it), so the flags are disjoint and their difference is the product,
    without a fresh buffer per comparison; the clamp keeps a token flagged twice (an empty band) at 0, not -1."""
    return (keep - low.value).sub_(high.value).clamp_(min=0.0)


def _flag(compare, values: torch.Tensor, bound: float, m: torch.Tensor) -> _Masked:
    """``compare(values, bound).float() * m`` (``[N]`` float32 0/1) in one fresh buffer: the comparison written
    straight into float32 and masked in place (a bool result, its float copy and the product would be three)."""
    return _Masked(compare(values, bound, out=torch.empty_like(values)).mul_(m))


def _masked(metrics: Dict[str, Any], m: torch.Tensor, seq_of_token: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-token metrics, zero off the loss mask: slime multiplies by the mask, and a value there must not be inf
    (inf * 0 = NaN).  The per-sequence ones (a ``[B]`` value may be inf: a perplexity past float32) are broadcast
    to their tokens in one gather of a ``[k, B + 1]`` matrix whose last column is 0, masked tokens pointing at it;
    the per-token ones are finite by construction (built from the zeroed and clamped log-ratio), so a product with
    the 0/1 mask zeroes them (``torch.where`` over ``[k, N]`` costs several times more on a CPU); a :class:`_Masked`
    one is 0 off the mask already and is returned as it is (no fresh copy; two names given the same one share it),
    a :class:`_MaskInPlace` one is masked in its own buffer.
    ``seq_of_token`` is overwritten (the gather's index, made in place): the caller's last use of it."""
    names = [k for k, v in metrics.items() if isinstance(v, _PerSequence)]
    out = {}
    if names:
        n_seqs = metrics[names[0]].value.numel()
        table = torch.stack([metrics[k].value for k in names])
        table = torch.cat([table, table.new_zeros(len(names), 1)], 1)  # [k, B + 1]: column B holds the zeros
        # masked tokens read column B; in place: the token -> sequence index has no later use
        at = seq_of_token.masked_fill_(m == 0, n_seqs)
        out = dict(zip(names, table.index_select(1, at).detach().unbind()))
    for k, v in metrics.items():
        if k not in out:
            out[k] = (v.value if isinstance(v, _Masked) else v.value.mul_(m) if isinstance(v, _MaskInPlace)
                      else v * m).detach()
    return {k: out[k] for k in metrics}
