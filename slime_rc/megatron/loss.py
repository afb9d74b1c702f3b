"""The policy loss inside Megatron's pipeline schedule (``get_forward_backward_func()``), last stage only.

Per micro-batch, on each rank: the model's vocab-sharded logits of this rank's tokens (its zigzag CP chunks of
every packed sequence) -> log pi_theta of the targets (:func:`vocab_parallel_log_probs`, divided by the rollout
engine's temperature) -> :func:`slime_rc.compute_policy_loss` -> the value Megatron's schedule expects.

Megatron's conventions (``calculate_per_token_loss=False``): the schedule multiplies a loss_func's value by the CP
size and divides it by the number of micro-batches; DDP averages gradients over data-parallel x context-parallel
ranks.  So:

* **in-loss path** (default): the correction and the loss denominators are computed per micro-batch over the CP
  group only (``megatron_reducer(data_parallel=False)``: collectives among CP peers, which always run the same
  micro-batches).  The returned value is this rank's share of the micro-batch loss; the step's gradient is that of
  the mean over micro-batches of the micro-batch losses (as in slime).
* **pre-step path** (:func:`prepare_global_batch`, decoupled mode): IS weights, RS masks, batch normalization,
  metrics and loss denominators are computed once for the **whole global batch** before the first micro-batch (one
  collective round over DP x CP); the loss makes no collective call, so ranks with different micro-batch counts
  cannot deadlock.  The value is scaled by ``num_microbatches * dp_size`` so that the step's gradient is that of the
  single loss of the global batch.  With one micro-batch and DP = 1 both paths give the same loss.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import RolloutCorrectionConfig
from ..correction import CorrectionResult, compute_rollout_correction
from ..losses import LossNormalizer, compute_policy_loss, loss_normalizer
from ..reducer import LocalReducer
from .logprobs import vocab_parallel_log_probs

# What a micro-batch (this rank's tokens) must hold, all [N] aligned with the target tokens.
REQUIRED = ("targets", "loss_mask", "advantages", "cu_seqlens")


@dataclass(frozen=True)
class PreparedMicroBatch:
    """The global-batch correction restricted to one micro-batch's tokens and sequences."""

    correction: CorrectionResult
    normalizer: LossNormalizer


def _cp_reducer() -> LocalReducer:
    from ..reducer import megatron_reducer
    return megatron_reducer(data_parallel=False)


def prepare_global_batch(micro_batches: Sequence[Dict[str, torch.Tensor]], config: RolloutCorrectionConfig,
                         reducer: Optional[LocalReducer] = None) -> List[PreparedMicroBatch]:
    """Decoupled mode: the correction and loss denominators of the global batch, from this rank's micro-batches
    (their ``old_log_probs``, ``rollout_log_probs``, ``loss_mask``, ``cu_seqlens``), split back per micro-batch.
    ``reducer`` defaults to ``megatron_reducer()`` (CP for sequences, DP x CP for the batch)."""
    if config.mode != "decoupled":
        raise ValueError(f"prepare_global_batch is for mode='decoupled' (pi_old is fixed before the step); got "
                         f"mode={config.mode!r}: in bypass mode the weights depend on pi_theta and are computed in the "
                         f"loss.")
    if reducer is None:
        from ..reducer import megatron_reducer
        reducer = megatron_reducer()
    sizes = [int(mb["cu_seqlens"][-1]) for mb in micro_batches]
    seqs = [mb["cu_seqlens"].numel() - 1 for mb in micro_batches]
    cat = (lambda key: torch.cat([mb[key].reshape(-1) for mb in micro_batches]))
    offsets, cu = [0], [torch.zeros(1, dtype=torch.int64)]
    for mb in micro_batches:
        cu.append(mb["cu_seqlens"][1:].to(torch.int64) + offsets[-1])
        offsets.append(offsets[-1] + int(mb["cu_seqlens"][-1]))
    cu_all = torch.cat(cu)
    mask = cat("loss_mask")
    corr = compute_rollout_correction(cat("old_log_probs"), cat("rollout_log_probs"), mask, cu_all, config,
                                      reducer=reducer)
    counted = mask.bool() if config.rejected_in_denominator else corr.keep_mask.bool()
    norm = loss_normalizer(counted, cu_all, reducer)
    out, t0, s0 = [], 0, 0
    for n, b in zip(sizes, seqs):
        part = replace(corr, is_weights=None if corr.is_weights is None else corr.is_weights[t0:t0 + n],
                       keep_mask=corr.keep_mask[t0:t0 + n],
                       sequences={k: v[s0:s0 + b] for k, v in corr.sequences.items()})
        out.append(PreparedMicroBatch(part, replace(norm, per_sequence=norm.per_sequence[s0:s0 + b])))
        t0, s0 = t0 + n, s0 + b
    return out


def with_sample_fields(micro_batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Add what slime's TIS-function contract needs to an *unsharded* packed micro-batch: ``sample_lengths`` (each
    sequence's length T_i, slime's total length; its response is positions 1..T_i-1, i.e. the T_i - 1 targets) and
    ``sample_loss_masks`` (each sequence's full-length response mask).  Lists, so CP sharding passes them through."""
    cu = micro_batch["cu_seqlens"].tolist()
    mask = micro_batch["loss_mask"]
    out = dict(micro_batch)
    out["sample_lengths"] = [b - a for a, b in zip(cu[:-1], cu[1:])]
    out["sample_loss_masks"] = [mask[a:max(b - 1, a)].float() for a, b in zip(cu[:-1], cu[1:])]
    return out


def tis_function_correction(tis_function: Callable, args, micro_batch: Dict[str, torch.Tensor],
                            train_log_probs: torch.Tensor) -> CorrectionResult:
    """Weights and keep mask of this rank's tokens from a slime-contract TIS function
    (``fn(args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths)``,
    see :mod:`slime_rc.plugins`).  It is called with ``pg_loss = 1``, so the ``pg_loss * weights`` it returns is the
    weights.  ``micro_batch``: this rank's tokens with ``position_ids`` (position in its sequence) and the fields of
    :func:`with_sample_fields`.  The function's own metrics come back as ``tis_function/<name>``: this rank's token
    means (the function defines what they mean; they are not global like the engine's metrics)."""
    missing = [k for k in ("position_ids", "sample_lengths", "sample_loss_masks") if k not in micro_batch]
    if missing:
        raise ValueError(f"a custom TIS function needs {', '.join(missing)} in the micro-batch: run "
                         f"slime_rc.megatron.loss.with_sample_fields on it before CP sharding")
    cu, pos = micro_batch["cu_seqlens"].tolist(), micro_batch["position_ids"]
    lengths = [int(n) for n in micro_batch["sample_lengths"]]
    rollout = micro_batch["rollout_log_probs"]
    picks = []
    for i, total in enumerate(lengths):  # response log-prob j sits at position j (prompt = the first token)
        local = torch.arange(cu[i], cu[i + 1])
        picks.append(local[pos[cu[i]:cu[i + 1]] < total - 1])
    idx = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.int64)
    train = train_log_probs.detach().float()
    pg, masks, metrics = tis_function(
        args, pg_loss=torch.ones(idx.numel()), train_log_probs=[train[p] for p in picks],
        rollout_log_probs=[rollout[p].float() for p in picks], loss_masks=list(micro_batch["sample_loss_masks"]),
        total_lengths=lengths, response_lengths=[max(n - 1, 0) for n in lengths])
    n = train.numel()
    weights = torch.zeros(n).index_copy(0, idx, pg.detach().reshape(-1).float())
    kept = torch.cat(list(masks)).float() if len(masks) else torch.zeros(0)
    keep = torch.zeros(n).index_copy(0, idx, kept) * micro_batch["loss_mask"].float()
    # The function's metrics are per-token values in slime's format; their meaning is the function's.  They are
    # reported as this rank's token means under their own prefix, never under the engine's global metric names.
    flat = {k: (torch.cat(list(v)) if isinstance(v, (list, tuple)) else v) for k, v in metrics.items()}
    return CorrectionResult(is_weights=weights * keep, keep_mask=keep,
                            metrics={f"tis_function/{k}": v.float().mean() if v.numel() else torch.zeros(())
                                     for k, v in flat.items()})


def policy_loss(logits: torch.Tensor, micro_batch: Dict[str, torch.Tensor], config: RolloutCorrectionConfig, *,
                temperature: float = 1.0, prepared: Optional[PreparedMicroBatch] = None, scale: float = 1.0,
                reducer: Optional[LocalReducer] = None, tis_function: Optional[Callable] = None,
                tis_args=None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(value for Megatron's schedule, metrics)`` for one micro-batch on this rank.

    ``logits``: ``[N, V / tp]`` (this rank's tokens, its vocab shard).  ``micro_batch``: :data:`REQUIRED` plus
    ``old_log_probs`` / ``rollout_log_probs`` as the mode needs.  ``prepared``: from :func:`prepare_global_batch`
    (then ``scale`` should be ``num_microbatches * dp_size``); otherwise the correction runs here over the CP group.
    ``tis_function`` (``--custom-tis-function-path``, called with ``tis_args``): weights and keep mask come from it
    (:func:`tis_function_correction`) instead of the built-in engine; the loss around them is the same.
    """
    missing = [k for k in REQUIRED if k not in micro_batch]
    if missing:
        raise ValueError(f"micro-batch lacks {', '.join(missing)} (needs {', '.join(REQUIRED)} and the log-probs "
                         f"its mode uses)")
    log_probs = vocab_parallel_log_probs(logits.reshape(-1, logits.shape[-1]), micro_batch["targets"].reshape(-1),
                                         temperature)
    kwargs = {}
    if prepared is not None:
        kwargs = dict(correction=prepared.correction, normalizer=prepared.normalizer)
    elif tis_function is not None:
        train = log_probs if config.mode == "bypass" else micro_batch["old_log_probs"]
        kwargs = dict(correction=tis_function_correction(tis_function, tis_args, micro_batch, train))
    loss, metrics = compute_policy_loss(
        log_probs, micro_batch.get("old_log_probs"), micro_batch.get("rollout_log_probs"),
        micro_batch["advantages"], micro_batch["loss_mask"], micro_batch["cu_seqlens"], config,
        reducer=reducer if reducer is not None else _cp_reducer(), **kwargs)
    return loss * scale, {k: v.detach() for k, v in metrics.items()}


def make_loss_func(config: RolloutCorrectionConfig, *, temperature: float = 1.0,
                   prepared: Optional[Sequence[PreparedMicroBatch]] = None, num_microbatches: int = 1,
                   tis_function: Optional[Callable] = None,
                   tis_args=None) -> Callable[[torch.Tensor, Dict[str, torch.Tensor]], tuple]:
    """A ``loss_fn(logits, micro_batch)`` for a forward step: the i-th call uses ``prepared[i]`` (pre-step path)."""
    calls = {"i": 0}
    scale = 1.0
    if prepared is not None:
        from megatron.core import parallel_state as ps
        scale = float(num_microbatches * ps.get_data_parallel_world_size())

    def loss_fn(logits, micro_batch):
        p = None
        if prepared is not None:  # the micro-batch's own index when the trainer gives one, else call order
            p = prepared[micro_batch.get("micro_batch_index", calls["i"] % len(prepared))]
            calls["i"] += 1
        return policy_loss(logits, micro_batch, config, temperature=temperature, prepared=p, scale=scale,
                           tis_function=tis_function, tis_args=tis_args)

    return loss_fn
