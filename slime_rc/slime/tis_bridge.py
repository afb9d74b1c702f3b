"""The TIS-function bridge: a function written to slime's TIS contract (``--custom-tis-function-path``) as the
correction of slime-rc's Megatron loss (:class:`slime_rc.megatron.loss.ExternalCorrection`), as slime calls it --
so ``slime-rc train`` (or any Megatron loop) runs slime's hook with slime's numbers.  The loss takes it through an
argument (``make_loss_func(config, external=tis_function_correction_for(fn, args))``); it does not import it.

* :func:`with_sample_fields`: what the contract needs (per-sample lengths and full-length masks) added to an
  unsharded micro-batch;
* :func:`tis_function_correction`: the function called on this rank's tokens (CP-local log-probs, full-length masks),
  its weights and masks read back into packed tokens, its metrics reduced as slime reduces them;
* beside its own metrics (``rollout_corr/tis_function/<its name>``), the mismatch metrics under the engine's names
  (:func:`mismatch_metrics`) and what its weights and masks did (:func:`applied_correction_metrics`): one set of
  names whichever path corrects;
* :func:`reduce_tis_function_metrics`: slime's once-per-step reduction of the function's metrics.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Dict, Optional, Sequence

import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.correction.packed import segment_sum, token_sequence_ids, upload
from slime_rc.correction.reducer import LocalReducer, sum_named_values
from slime_rc.megatron.cp_layout import ResponseLayout, response_positions, zigzag_response_indices
from slime_rc.megatron.loss import ExternalCorrection
from slime_rc.megatron.reducers import megatron_step_group
from slime_rc.config.slime_attributes import with_slime_attributes

_ZIGZAG_FIX = ("each sequence padded to 2 * cp * ceil(length / (2 * cp)) positions, CP rank r holding its chunks r and "
               "2 * cp - 1 - r (slime_rc.megatron.cp_layout.packed_zigzag_positions gives the positions)")

# A slime-contract function's metrics, as logged: ``rollout_corr/tis_function/<its key>`` (its keys verbatim).
TIS_FUNCTION_PREFIX = "tis_function/"
TIS_FUNCTION_METRICS = "rollout_corr/" + TIS_FUNCTION_PREFIX


class TisContractError(ValueError):
    """A TIS function returned something slime's contract does not allow (docs/tis-function.md): the message names
    the function, what it returned and what the contract expects; ``slime-rc train`` prints it as one line."""

    def __str__(self) -> str:
        return super().__str__() + " (the contract: docs/tis-function.md)"


def with_sample_fields(micro_batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Add what slime's TIS-function contract needs to an *unsharded* packed micro-batch (lists, so CP sharding
    passes them through):

    * ``sample_lengths``: each sequence's length ``T_i`` (slime's ``total_lengths``);
    * ``sample_response_lengths``: slime's ``response_lengths`` -- from ``micro_batch["response_lengths"]`` (a
      list, one per sequence) when the caller knows where each prompt ends, else ``T_i - 1`` (every target is a
      response token; the loss mask says which count).  Response log-prob ``j`` sits at position
      ``T_i - R_i - 1 + j``;
    * ``sample_loss_masks``: each sequence's full-length response loss mask (``torch.int``, ``R_i`` entries), as
      slime passes ``loss_masks``.

    Loss positions outside the response span (a prompt position with ``loss_mask`` 1) would be invisible to the
    function: refused, naming the sample.  Two host reads whatever the number of sequences (the lengths, and one
    flag for the masks); more only to name a bad sample."""
    cu = micro_batch["cu_seqlens"].tolist()  # host metadata the contract needs as lists: one read
    mask = micro_batch["loss_mask"]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    given = micro_batch.get("response_lengths")
    if given is None:
        responses = [max(n - 1, 0) for n in lengths]
    else:
        responses = [int(r) for r in given]
        if len(responses) != len(lengths):
            raise ValueError(f"micro_batch['response_lengths'] has {len(responses)} entries for {len(lengths)} "
                             f"sequences (cu_seqlens {cu}); give one response length per packed sequence")
    unfit = next((i for i, (n, r) in enumerate(zip(lengths, responses)) if n and not 0 <= r <= n - 1), None)
    checked = len(lengths) if unfit is None else unfit  # sequences before the first that does not fit
    starts = [a + n - r - 1 if n else a for a, n, r in zip(cu[:-1], lengths, responses)]
    if checked and cu[checked] > cu[0]:
        # one flag per token: loss_mask non-zero outside its sequence's response span; read once for the batch
        device = mask.device
        n_tok = cu[checked] - cu[0]
        seq = torch.repeat_interleave(torch.arange(checked, device=device),
                                      upload(lengths[:checked], torch.int64, device), output_size=n_tok)
        lo = upload(starts[:checked], torch.int64, device)[seq]
        hi = lo + upload(responses[:checked], torch.int64, device)[seq]
        row = torch.arange(cu[0], cu[checked], device=device)
        outside = (mask.reshape(-1)[cu[0]:cu[checked]] != 0) & ((row < lo) | (row >= hi))
        bad = torch.zeros(checked, dtype=torch.int64, device=device).index_add_(0, seq, outside.long())
        if bool(outside.any()):  # slow path: name the first such sequence
            i = int(torch.nonzero(bad)[0, 0])
            a, n, r, start = cu[i], lengths[i], responses[i], starts[i]
            raise ValueError(f"sequence {i}: loss_mask is non-zero outside its response (positions "
                             f"{start - a}..{start - a + r - 1} of {n}); a TIS function only sees response tokens: "
                             f"set micro_batch['response_lengths'][{i}] to cover them or zero the mask there")
    if unfit is not None:
        i, n, r = unfit, lengths[unfit], responses[unfit]
        raise ValueError(f"sequence {i}: response length {r} does not fit its {n} tokens: a response of R "
                         f"tokens needs a prompt of at least one token (R <= {n - 1}); fix "
                         f"micro_batch['response_lengths'][{i}]")
    masks = [mask[start:start + r].to(torch.int) for start, r in zip(starts, responses)]
    out = dict(micro_batch)
    out["sample_lengths"] = lengths
    out["sample_response_lengths"] = responses
    out["sample_loss_masks"] = masks
    return out


def _function_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def _flat(value, what: str, device=None) -> torch.Tensor:
    if isinstance(value, (list, tuple)):
        return (torch.cat([torch.as_tensor(v, device=device).reshape(-1) for v in value]) if len(value)
                else torch.zeros(0, device=device))
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)
    raise ValueError(f"{what} is a {type(value).__name__}; expected a tensor (or a list of per-sample tensors)")


def tis_function_correction(tis_function: Callable, args, micro_batch: Dict[str, torch.Tensor],
                            train_log_probs: torch.Tensor, *,
                            config: Optional[RolloutCorrectionConfig] = None,
                            checks: Optional[DeferredChecks] = None) -> CorrectionResult:
    """Weights and keep mask of this rank's tokens from a function written to slime's TIS contract (slime's
    ``--custom-tis-function-path``; see ``docs/losses.md``), called as slime calls it::

        pg_loss, masks, metrics = fn(args=..., pg_loss=..., train_log_probs=[...], rollout_log_probs=[...],
                                     loss_masks=[...], total_lengths=[...], response_lengths=[...])

    with ``pg_loss = 1`` on this rank's response tokens (so the ``pg_loss * weights`` it returns is the weights),
    the log-probs of this rank's response tokens per sample (CP-local, slime's zigzag positions:
    :func:`slime_rc.megatron.cp_layout.zigzag_response_indices`), the *full-length* ``torch.int`` loss masks, and ``args``
    = :func:`slime_rc.config.slime_attributes.with_slime_attributes` ``(args, config)`` when ``config`` is given (a copy;
    the caller's ``args`` is not modified).

    What it returns: ``pg_loss`` CP-local (as given); ``masks`` one per sample, **full response length** (slime's
    contract: they are cut to this rank's positions here) -- a CP-local mask of this rank's length is accepted too;
    any other length is refused naming the function and the sample.  ``metrics``: name -> per-token values of this
    rank's response tokens (a tensor, or a list of per-sample tensors).  Each comes back as
    ``tis_function/<name>`` (``rollout_corr/tis_function/<name>`` in the loss metrics) holding this rank's share
    of slime's reduction for this micro-batch: the sum over samples of the metric's sum over the sample's original
    loss mask, divided by the sample's full mask sum (at least 1) -- a plain token sum with
    ``calculate_per_token_loss`` (``config.loss_agg == "token_mean"``).  :func:`reduce_tis_function_metrics`
    finishes slime's reduction over micro-batches and DP x CP.

    ``micro_batch``: this rank's tokens with ``position_ids``, ``cp_size`` / ``cp_rank`` and the fields of
    :func:`with_sample_fields`.

    No host read of its own (what the function does is its own): which rows hold which response log-probs is host
    arithmetic on ``sample_lengths`` / ``sample_response_lengths``; that ``position_ids`` and ``cu_seqlens`` agree
    with it is a deferred check in ``checks`` (the caller's, read once per micro-batch; without one this call makes
    its own and reads it at the end)."""
    missing = [k for k in ("position_ids", "sample_lengths", "sample_loss_masks") if k not in micro_batch]
    if missing:
        raise ValueError(f"a custom TIS function needs {', '.join(missing)} in the micro-batch: run "
                         f"slime_rc.slime.tis_bridge.with_sample_fields on it before CP sharding")
    own_checks = checks is None
    if own_checks:
        checks = DeferredChecks(read=config is None or config.on_nonfinite == "error")
    name = _function_name(tis_function)
    if config is not None:
        args = with_slime_attributes(args, config)
    per_token_loss = bool(getattr(args, "calculate_per_token_loss", False))
    cp_size, cp_rank = int(micro_batch.get("cp_size", 1)), int(micro_batch.get("cp_rank", 0))
    cu_dev, pos = micro_batch["cu_seqlens"], micro_batch["position_ids"].reshape(-1)
    lengths = [int(n) for n in micro_batch["sample_lengths"]]
    responses = [int(r) for r in micro_batch.get("sample_response_lengths", [max(n - 1, 0) for n in lengths])]
    full_masks = [m.reshape(-1) for m in micro_batch["sample_loss_masks"]]
    n_seq = cu_dev.numel() - 1
    if not len(lengths) == len(responses) == len(full_masks) == n_seq:
        raise ValueError(f"micro-batch has {n_seq} sequences but {len(lengths)} sample_lengths, "
                         f"{len(responses)} sample_response_lengths and {len(full_masks)} sample_loss_masks: run "
                         f"with_sample_fields on the unsharded micro-batch")
    short = [i for i, (m, r) in enumerate(zip(full_masks, responses)) if m.numel() < r]
    if short:
        i = short[0]
        raise ValueError(f"sample_loss_masks[{i}] has {full_masks[i].numel()} entries for a response of "
                         f"{responses[i]} tokens: run with_sample_fields on the unsharded micro-batch")
    train = train_log_probs.detach().float().reshape(-1)
    device, n = train.device, train.numel()
    layout = ResponseLayout(lengths, responses, cp_size, cp_rank)
    local = layout.local_lengths
    if sum(local) != n or pos.numel() != n:
        raise ValueError(f"this rank's micro-batch holds {n} log-probs and {pos.numel()} position_ids, but its "
                         f"{len(lengths)} samples of lengths {lengths} take {sum(local)} positions on CP rank "
                         f"{cp_rank} of {cp_size} (slime's zigzag layout); lay the micro-batch out "
                         f"as slime does: " + _ZIGZAG_FIX)
    counts, n_local = layout.counts, layout.n_tokens

    # per held token (device, no read): its row in the stream, its response index j and its sample
    idx, jj, sample = layout.index(device, [0] * len(lengths)).unbind(1)

    # the layout the positions say must be the one computed above (checked on the device, read once by the caller)
    first = upload([t - r - 1 for t, r in zip(lengths, responses)], torch.int64, device)
    cu_want = upload([0] + local, torch.int64, device).cumsum(0)
    seq_of_row = token_sequence_ids(cu_want, n)
    j_of_row = pos.to(torch.int64) - first[seq_of_row]  # response_positions, per row of every sample
    holds = (j_of_row >= 0) & (j_of_row < upload(responses, torch.int64, device)[seq_of_row])
    bad_layout = ((holds.sum() != n_local) | (pos[idx] != first[sample] + jj).any()
                  | (cu_dev.to(torch.int64) != cu_want).any())

    def layout_message() -> str:  # slow path: the first sample whose positions differ, as before
        cu = cu_dev.tolist()
        if cu != cu_want.tolist():
            return (f"cu_seqlens {cu} do not match the samples' lengths on this rank {local} (cp {cp_size}, rank "
                    f"{cp_rank}); lay the micro-batch out as slime does: " + _ZIGZAG_FIX)
        for i, (total, resp) in enumerate(zip(lengths, responses)):
            keep, j = response_positions(pos[cu[i]:cu[i + 1]], total, resp)
            want = zigzag_response_indices(total, resp, cp_size, cp_rank)
            if not torch.equal(j[keep].cpu(), want):
                return (f"sample {i} (total {total}, response {resp}): this rank holds response positions "
                        f"{j[keep].tolist()}, slime's zigzag layout (cp {cp_size}, rank {cp_rank}) gives "
                        f"{want.tolist()}; lay the micro-batch out as slime does: " + _ZIGZAG_FIX)
        return "position_ids do not follow slime's zigzag layout; lay the micro-batch out as slime does: " + _ZIGZAG_FIX
    checks.add(bad_layout, f"position_ids / cu_seqlens of this rank do not follow slime's zigzag layout (cp "
                           f"{cp_size}, rank {cp_rank}) of sample_lengths; shard the micro-batch with "
                           f"lay the micro-batch out as slime does: " + _ZIGZAG_FIX, layout_message)

    rollout = micro_batch["rollout_log_probs"].reshape(-1)
    result = tis_function(
        args=args, pg_loss=torch.ones(n_local, device=device), train_log_probs=list(train[idx].split(counts)),
        rollout_log_probs=list(rollout[idx].float().split(counts)), loss_masks=list(micro_batch["sample_loss_masks"]),
        total_lengths=lengths, response_lengths=responses)
    if not (isinstance(result, (tuple, list)) and len(result) == 3):
        raise TisContractError(f"TIS function {name} returned {type(result).__name__}; slime's contract is a tuple "
                         f"(pg_loss, modified_masks, metrics)")
    pg, masks, metrics = result
    pg = _flat(pg, f"TIS function {name}: pg_loss", device).detach().float()
    if pg.numel() != n_local:
        raise TisContractError(f"TIS function {name} returned pg_loss of {pg.numel()} values; it was given {n_local} "
                         f"(this rank's response tokens, CP-local) and must return as many")
    if masks is None or len(masks) != len(lengths):
        raise TisContractError(f"TIS function {name} returned {'no' if masks is None else len(masks)} modified masks "
                         f"for {len(lengths)} samples; return one mask per sample (full response length)")
    flat_masks, full_length = [], []
    for i, (m, resp, c) in enumerate(zip(masks, responses, counts)):
        m = torch.as_tensor(m, device=device).reshape(-1)
        if m.numel() not in (resp, c):
            raise TisContractError(f"TIS function {name}: modified mask of sample {i} has {m.numel()} entries; expected "
                             f"the full response length {resp} (slime's contract) or this rank's {c} "
                             f"response tokens (cp {cp_size}, rank {cp_rank})")
        flat_masks.append(m)
        full_length.append(m.numel() == resp)
    # each held token's entry of its sample's mask: j of a full-length mask, its rank-local index of a local one
    mask_start = list(accumulate([m.numel() for m in flat_masks[:-1]], initial=0))
    local_start = list(accumulate(counts[:-1], initial=0))
    per_sample = upload([[a, f, l] for a, f, l in zip(mask_start, full_length, local_start)] or [[0, 0, 0]],
                        torch.int64, device)
    at = per_sample[sample, 0] + torch.where(per_sample[sample, 1] != 0, jj,
                                             torch.arange(n_local, device=device) - per_sample[sample, 2])
    kept = (torch.cat(flat_masks)[at].float() if flat_masks else torch.zeros(0, device=device))
    weights = torch.zeros(n, device=device).index_copy(0, idx, pg.to(device))
    keep = torch.zeros(n, device=device).index_copy(0, idx, kept) * micro_batch["loss_mask"].reshape(-1).float()

    # slime's reduction of the function's metrics (per micro-batch, this rank's share): per-sample masked sum over
    # the ORIGINAL loss mask / the sample's full mask sum (clamped to 1); a token sum with per-token loss
    if full_masks:
        bounds = upload([0] + [m.numel() for m in full_masks], torch.int64, device).cumsum(0)
        orig_flat = torch.cat(full_masks).to(device).double()
        orig = orig_flat[bounds[:-1][sample] + jj]
        denoms = segment_sum(orig_flat, bounds).clamp(min=1.0)  # each sample's full mask sum, at least 1
    else:
        orig = torch.zeros(0, dtype=torch.float64, device=device)
    scale = orig if (per_token_loss or not full_masks) else orig / denoms[sample]
    out = {}
    if not isinstance(metrics, dict):
        raise TisContractError(f"TIS function {name} returned metrics of type {type(metrics).__name__}; slime's contract "
                         f"is a dict name -> per-token tensor (CP-local)")
    for key, value in metrics.items():
        flat = _flat(value, f"TIS function {name}: metric {key!r}", device).detach().double()
        if flat.numel() != n_local:
            raise TisContractError(f"TIS function {name}: metric {key!r} has {flat.numel()} values; expected one per "
                             f"response token this rank was given ({n_local}, CP-local, like pg_loss)")
        out[TIS_FUNCTION_PREFIX + str(key)] = (flat.to(device) * scale).sum()
    # the loss multiplies these weights on every kept token: a NaN/inf there is a defect of the function (not of
    # the data on_nonfinite is about) and would reach the gradient -- an error in both modes
    bad_weight = (keep != 0) & ~torch.isfinite(weights)

    def weight_message() -> str:  # the slow path: raising anyway
        first = int(torch.nonzero(bad_weight)[0, 0])
        return (f"TIS function {name} returned pg_loss (the IS weights) {float(weights[first])} at a kept loss token "
                f"(this rank's packed token {first}); a weight must be finite where the loss keeps the token: bound "
                f"the function's log-ratios before exp, or zero that token in its modified mask")
    checks.add(bad_weight.sum(), f"TIS function {name} returned a NaN/inf weight (pg_loss) at a kept loss token; a "
                                 f"weight must be finite where the loss keeps the token: bound the function's "
                                 f"log-ratios before exp, or zero that token in its modified mask", weight_message)
    if own_checks:
        checks.raise_if_any()
    # off the kept tokens a weight is not used: zeroed, NaN/inf included (NaN * 0 would still be NaN)
    return CorrectionResult(is_weights=torch.nan_to_num(weights, 0.0, 0.0, 0.0) * keep, keep_mask=keep, metrics=out)


def mismatch_metrics(train_log_probs: torch.Tensor, micro_batch: Dict[str, torch.Tensor],
                     config: RolloutCorrectionConfig, reducer: LocalReducer,
                     checks: Optional[DeferredChecks] = None) -> Dict[str, torch.Tensor]:
    """The engine's mismatch metrics (``k3_kl``, ``log_ppl_diff``, ``chi2_token``, ...: the names of
    :data:`slime_rc.correction.metrics.METRICS`, without prefix) of this micro-batch's tokens over the CP group, with
    nothing corrected: the same names whichever path corrects (the engine, or a TIS function, whose own metrics keep
    its names under ``tis_function/``)."""
    metrics_only = RolloutCorrectionConfig(get_mismatch_metrics=True, safety_bound=config.safety_bound,
                                           on_nonfinite=config.on_nonfinite)
    result = compute_rollout_correction(train_log_probs.detach().reshape(-1), micro_batch["rollout_log_probs"].reshape(-1),
                                        micro_batch["loss_mask"].reshape(-1), micro_batch["cu_seqlens"], metrics_only,
                                        reducer=reducer, checks=checks)
    # what was rejected is the corrector's to say (nothing, in this metrics-only call)
    return {k: v for k, v in result.metrics.items() if not k.startswith("rejected_")}


def applied_correction_metrics(correction: CorrectionResult, micro_batch: Dict[str, torch.Tensor],
                               reducer: LocalReducer) -> Dict[str, torch.Tensor]:
    """What a TIS function did to this micro-batch, over the CP group, under the engine's names: the fraction of
    loss tokens its masks removed (``rejected_token_fraction``) and the effective sample size of the weights it
    applied on the kept tokens, ``(sum w)^2 / (n_kept * sum w^2)`` (``rollout_is_eff_sample_size``, as the engine
    computes it).  One ``sum_totals`` of 4 values; no host read."""
    mask = micro_batch["loss_mask"].reshape(-1).double()
    keep = correction.keep_mask.double() * (mask != 0)
    w = correction.is_weights.double() * keep
    totals = reducer.sum_totals(torch.stack([mask.sum(), keep.sum(), w.sum(), (w * w).sum()]))
    n, kept, s1, s2 = totals.unbind()
    return {"rejected_token_fraction": torch.where(n > 0, (n - kept) / n.clamp(min=1), 0.0),
            # the engine's form: mean^2 / mean of squares over the kept tokens (0 when none is kept, or all weights
            # are 0; 1 for weights of 1)
            "rollout_is_eff_sample_size": (s1 / kept.clamp(min=1)) ** 2 / (s2 / kept.clamp(min=1)).clamp(min=1e-300)}


def tis_function_metric_count(local_micro_batches: Sequence[Dict], per_token_loss: bool) -> float:
    """This rank's share of slime's denominator for the TIS function's metrics: its samples, or with per-token loss
    the sum over its samples of ``max(full mask sum, 1)`` (slime's ``num_tokens``).  Every CP rank counts the same
    samples (the full masks), so the sum over DP x CP is ``cp`` times the step's."""
    total = 0.0
    for lmb in local_micro_batches:
        masks = lmb.get("sample_loss_masks")
        if masks is None:
            raise ValueError("the local micro-batches lack sample_loss_masks: run with_sample_fields before sharding")
        total += sum(max(float(m.sum()), 1.0) for m in masks) if per_token_loss else float(len(masks))
    return total


def reduce_tis_function_metrics(micro_batch_metrics: Sequence[Dict[str, torch.Tensor]],
                                local_micro_batches: Sequence[Dict], config: RolloutCorrectionConfig, *,
                                group=None, cp_size: Optional[int] = None) -> Dict[str, float]:
    """slime's reduction of a TIS function's metrics over one step: the per-micro-batch shares of
    :func:`tis_function_correction` (``rollout_corr/tis_function/<name>`` in each micro-batch's loss metrics) summed
    over this rank's micro-batches, all-reduced over ``group`` (default megatron's DP x CP group), divided by the
    step's global number of samples -- or of tokens (``max(mask sum, 1)`` per sample) when ``config.loss_agg ==
    "token_mean"`` (slime's ``calculate_per_token_loss``).  Returns ``{"rollout_corr/tis_function/<name>": value}``.

    Collective over ``group``: call it on every rank of the last pipeline stage (where the loss ran), with the
    micro-batches that stage's loss saw."""
    per_token = config.loss_agg == "token_mean"
    keys = sorted({k for m in micro_batch_metrics for k in m if k.startswith(TIS_FUNCTION_METRICS)})
    if group is None:
        group, megatron_cp = megatron_step_group()
        cp_size = megatron_cp if cp_size is None else cp_size
    cp_size = 1 if cp_size is None else int(cp_size)
    found = [m[k] for m in micro_batch_metrics for k in keys if k in m and isinstance(m[k], torch.Tensor)]
    device = found[0].device if found else torch.device("cpu")
    # once per step, after the last micro-batch: the sums stay on the metrics' device (no read until the end)
    sums = [sum((torch.as_tensor(m[k], dtype=torch.float64, device=device) for m in micro_batch_metrics if k in m),
                torch.zeros((), dtype=torch.float64, device=device)) for k in keys]
    count = torch.as_tensor(tis_function_metric_count(local_micro_batches, per_token), dtype=torch.float64,
                            device=device)
    values = torch.stack(sums + [count])
    values = sum_named_values(keys, values, group=group,
                              what="the TIS function's metrics (slime sums each name over DP x CP: return the same "
                                   "keys on every rank)")
    count = float(values[-1]) / cp_size
    return {k: float(values[i]) / count if count > 0 else 0.0 for i, k in enumerate(keys)}


def tis_function_correction_for(tis_function: Callable, args) -> ExternalCorrection:
    """``tis_function`` as the Megatron loss's correction (``make_loss_func(..., external=...)``): called on every
    micro-batch with a copy of ``args`` carrying slime's attributes for the loss's config
    (:func:`tis_function_correction`); its metrics plus the mismatch metrics and what it applied, under the engine's
    names; slime's denominators (the original loss mask: its masks zero numerators only)."""

    def compute(train_log_probs, micro_batch, config, reducer, checks) -> CorrectionResult:
        correction = tis_function_correction(tis_function, args, micro_batch, train_log_probs, config=config,
                                             checks=checks)
        correction.metrics.update(applied_correction_metrics(correction, micro_batch, reducer))
        correction.metrics.update(mismatch_metrics(train_log_probs, micro_batch, config, reducer, checks))
        return correction
    return ExternalCorrection(compute, rejected_in_denominator=True)
