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

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.correction.packed import upload
from slime_rc.correction.reducer import LocalReducer
from slime_rc.losses import LossNormalizer, compute_policy_loss, loss_normalizer
from slime_rc.megatron.logprobs import vocab_parallel_log_probs
from slime_rc.megatron.reducers import megatron_reducer

# What a micro-batch (this rank's tokens) must hold, all [N] aligned with the target tokens.
REQUIRED = ("targets", "loss_mask", "advantages", "cu_seqlens")


@dataclass(frozen=True)
class PreparedMicroBatch:
    """The global-batch correction restricted to one micro-batch's tokens and sequences."""

    correction: CorrectionResult
    normalizer: LossNormalizer


def _cp_reducer() -> LocalReducer:
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
        reducer = megatron_reducer()
    # sizes from shapes (host metadata): no host read per micro-batch or per sequence
    sizes = [mb["loss_mask"].numel() for mb in micro_batches]
    seqs = [mb["cu_seqlens"].numel() - 1 for mb in micro_batches]
    cat = (lambda key: torch.cat([mb[key].reshape(-1) for mb in micro_batches]))
    mask = cat("loss_mask")
    device = mask.device
    checks = DeferredChecks(read=config.on_nonfinite == "error")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    cu = [torch.zeros(1, dtype=torch.int64, device=device)]
    ends = []
    for mb, offset in zip(micro_batches, offsets):
        c = mb["cu_seqlens"].to(device=device, dtype=torch.int64)
        cu.append(c[1:] + offset)
        ends.append(torch.stack([c[0], c[-1]]))
    cu_all = torch.cat(cu)
    if ends:  # each micro-batch's cu_seqlens run from 0 to its token count (checked on the device, read once)
        want = upload([[0, n] for n in sizes], torch.int64, device)
        checks.add((torch.stack(ends) != want).any(),
                   "a micro-batch's cu_seqlens do not run from 0 to its number of tokens (loss_mask.numel()); give "
                   "each micro-batch its own cu_seqlens [0, ..., N]",
                   lambda: "micro-batch cu_seqlens (first, last) " + str([e.tolist() for e in ends]) +
                           f" but the micro-batches hold {sizes} tokens (loss_mask.numel()); give each micro-batch "
                           f"its own cu_seqlens [0, ..., N]")
    corr = compute_rollout_correction(cat("old_log_probs"), cat("rollout_log_probs"), mask, cu_all, config,
                                      reducer=reducer, checks=checks)
    checks.raise_if_any()  # at most one host read for the global batch (the engine's flags included)
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


@dataclass(frozen=True)
class ExternalCorrection:
    """A correction computed outside the engine and plugged into the loss (the slime integration's TIS-function
    bridge: :func:`slime_rc.slime.tis_bridge.tis_function_correction_for`).

    ``compute(train_log_probs [N], micro_batch, config, reducer, checks) -> CorrectionResult``: weights, keep mask and
    metrics of this rank's tokens (``train_log_probs``: pi_old, or pi_theta in bypass mode; ``reducer``: the CP
    group's; ``checks``: the micro-batch's deferred checks).  ``rejected_in_denominator``: the loss denominators keep
    the tokens its mask removes (slime's contract: a TIS function's masks zero numerators only)."""

    compute: Callable
    rejected_in_denominator: bool = False


def policy_loss(logits: torch.Tensor, micro_batch: Dict[str, torch.Tensor], config: RolloutCorrectionConfig, *,
                temperature: float = 1.0, prepared: Optional[PreparedMicroBatch] = None, scale: float = 1.0,
                reducer: Optional[LocalReducer] = None,
                external: Optional[ExternalCorrection] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(value for Megatron's schedule, metrics)`` for one micro-batch on this rank.

    ``logits``: ``[N, V / tp]`` (this rank's tokens, its vocab shard).  ``micro_batch``: :data:`REQUIRED` plus
    ``old_log_probs`` / ``rollout_log_probs`` as the mode needs.  ``prepared``: from :func:`prepare_global_batch`
    (then ``scale`` should be ``num_microbatches * dp_size``); otherwise the correction runs here over the CP group.
    ``external``: weights and keep mask come from it (:class:`ExternalCorrection`: e.g. a ``--custom-tis-function-path``
    function through the slime integration's bridge) instead of the built-in engine; the loss around them is the
    same.
    """
    missing = [k for k in REQUIRED if k not in micro_batch]
    if missing:
        raise ValueError(f"micro-batch lacks {', '.join(missing)} (needs {', '.join(REQUIRED)} and the log-probs "
                         f"its mode uses)")
    log_probs = vocab_parallel_log_probs(logits.reshape(-1, logits.shape[-1]), micro_batch["targets"].reshape(-1),
                                         temperature)
    # every check of the micro-batch (the bridge's, the engine's, the loss's) is read once, at the end
    checks = DeferredChecks(read=config.on_nonfinite == "error")
    kwargs = {}
    if prepared is not None:
        kwargs = dict(correction=prepared.correction, normalizer=prepared.normalizer)
    reducer = reducer if reducer is not None else _cp_reducer()
    if prepared is None and external is not None:
        train = log_probs if config.mode == "bypass" else micro_batch["old_log_probs"]
        kwargs = dict(correction=external.compute(train, micro_batch, config, reducer, checks))
        if external.rejected_in_denominator:
            config = replace(config, rejected_in_denominator=True)
    loss, metrics = compute_policy_loss(
        log_probs, micro_batch.get("old_log_probs"), micro_batch.get("rollout_log_probs"),
        micro_batch["advantages"], micro_batch["loss_mask"], micro_batch["cu_seqlens"], config,
        reducer=reducer, checks=checks, **kwargs)
    checks.raise_if_any()  # the micro-batch's one host read with on_nonfinite='error', none with 'reject'
    return loss * scale, {k: v.detach() for k, v in metrics.items()}


def make_loss_func(config: RolloutCorrectionConfig, *, temperature: float = 1.0,
                   prepared: Optional[Sequence[PreparedMicroBatch]] = None, num_microbatches: int = 1,
                   external: Optional[ExternalCorrection] = None) -> Callable[[torch.Tensor, Dict[str, torch.Tensor]],
                                                                              tuple]:
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
                           external=external)

    return loss_fn
