"""Shared glue between slime's custom-TIS function contract and :func:`slime_rc.compute_rollout_correction`.

slime calls a custom TIS function with *lists* of per-sample 1-D tensors (``train_log_probs``,
``rollout_log_probs``, ``loss_masks``) and expects lists (weights, modified masks) and a metrics dict back.
The engine works on *packed* tensors plus ``cu_seqlens``.  Everything here is plumbing: list <-> packed
conversion, ``args`` -> :class:`~slime_rc.RolloutCorrectionConfig`, the CP-local slicing of full-length masks
(megatron's zigzag layout) and the expansion of the engine's per-sequence statistics into slime's per-token
metric format.  No correction math lives here: weights, keep mask and every per-sequence statistic come from
the engine; the adapter adds only elementwise per-token expressions of ``log r`` and broadcasts.

Metric format (slime's ``metrics_append`` convention): ``name -> list`` of per-token tensors, one per sample,
as long as that sample's log-probs.  slime aggregates each with ``sum_of_sample_mean`` over the *original*
loss mask, so

* token metrics hold the per-token value (``kl``, ``k3_kl``, ``chi2_token``, ...): the per-sample masked mean
  is the sample's token mean, and with ``calculate_per_token_loss`` the batch token mean;
* sequence metrics broadcast the sample's value over all its tokens (``training_ppl``, ``log_ppl_diff``,
  ``chi2_seq``, ...): the per-sample masked mean is that value.

Non-finite log-probs (only possible with ``on_nonfinite='reject'``) contribute 0 to token metrics, so that
slime's mask multiplication never sees ``NaN * 0``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from slime_rc import LocalReducer, RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths
from slime_rc.correction import CorrectionResult
from slime_rc.cp_layout import zigzag_response_indices

# Attributes of slime's ``args`` that configure the correction (from_dict accepts them; mis_* are aliases).
SLIME_ARG_KEYS = (
    "use_tis", "use_rs", "tis_level", "rs_level", "tis_mode", "tis_lower_bound", "tis_upper_bound",
    "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize",
    "mis_level", "mis_mode", "mis_lower_bound", "mis_upper_bound", "mis_veto_threshold", "mis_batch_normalize",
)

TensorList = List[torch.Tensor]
Metrics = Dict[str, TensorList]


# ---- args -> config ---------------------------------------------------------------------------------------------
def get_arg(args: Any, name: str, default: Any = None) -> Any:
    """``args.name`` (or ``args[name]`` for a mapping), ``default`` when missing or None."""
    value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
    return default if value is None else value


def launch_config(args: Any) -> Optional[RolloutCorrectionConfig]:
    """The config resolved once at launch (flags + YAML + preset) by :func:`slime_rc.config_from_args`, if any."""
    return get_arg(args, "rollout_correction_config")


def config_from_args(args: Any, keys: Sequence[str] = SLIME_ARG_KEYS, **overrides: Any) -> RolloutCorrectionConfig:
    """Config from the slime keys present on ``args`` and not None (other attributes are ignored).

    ``overrides`` (slime key spelling) replace what ``args`` holds; an override of None removes the key.
    When ``args`` went through :func:`slime_rc.arguments.config_from_args` (flags + YAML + preset, resolved once
    at launch) and there are no overrides, that resolved config is used as it is.
    """
    resolved = launch_config(args)
    if resolved is not None and not overrides:
        return resolved
    d = {k: get_arg(args, k) for k in keys}
    d.update(overrides)
    return RolloutCorrectionConfig.from_dict({k: v for k, v in d.items() if v is not None})


# ---- list <-> packed --------------------------------------------------------------------------------------------
def check_lists(train_log_probs: TensorList, rollout_log_probs: TensorList, loss_masks: TensorList) -> List[int]:
    """Validate per-sample shapes; return the sample lengths."""
    if not len(train_log_probs) == len(rollout_log_probs) == len(loss_masks):
        raise ValueError(
            f"train_log_probs, rollout_log_probs and loss_masks must hold one tensor per sample; got "
            f"{len(train_log_probs)}, {len(rollout_log_probs)} and {len(loss_masks)} samples")
    lengths = []
    for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
        if not (t.dim() == r.dim() == m.dim() == 1 and t.shape == r.shape == m.shape):
            raise ValueError(
                f"sample {i}: train_log_probs {tuple(t.shape)}, rollout_log_probs {tuple(r.shape)} and "
                f"loss_mask {tuple(m.shape)} must be 1-D tensors of the same length")
        lengths.append(t.shape[0])
    return lengths


def pack(tensors: TensorList, device=None, dtype=None) -> torch.Tensor:
    """Concatenate per-sample 1-D tensors (an empty list gives an empty tensor)."""
    if not tensors:
        return torch.zeros(0, dtype=dtype or torch.float32, device=device)
    out = torch.cat([t.reshape(-1) for t in tensors])
    return out if dtype is None else out.to(dtype)


def unpack(packed: torch.Tensor, lengths: Sequence[int]) -> TensorList:
    return list(packed.split(list(lengths))) if lengths else []


# ---- metrics ----------------------------------------------------------------------------------------------------
def token_metrics(result: CorrectionResult, config: RolloutCorrectionConfig, train: torch.Tensor,
                  rollout: torch.Tensor, loss_mask: torch.Tensor, lengths: Sequence[int]) -> Dict[str, torch.Tensor]:
    """slime-style per-token metric tensors (packed ``[N]`` float32) for the engine's ``result``.

    ``train``/``rollout``/``loss_mask``/``lengths``: the packed tokens the engine saw (this rank's tokens under
    CP); per-sequence values come from ``result.sequences``, which are global over the CP group.
    """
    dev = train.device
    n_tokens = train.numel()
    lengths_t = torch.as_tensor(list(lengths), dtype=torch.int64, device=dev)
    seq = result.sequences
    bound = config.safety_bound

    def per_seq(values: torch.Tensor) -> torch.Tensor:  # [B] -> [N], float32
        return torch.repeat_interleave(values.float(), lengths_t, output_size=n_tokens)

    # token level: log r, zero where non-finite
    lr_raw = train.detach().float() - rollout.detach().float()
    finite = torch.isfinite(lr_raw)
    lr = torch.where(finite, lr_raw, 0.0)
    lr_c = lr.clamp(-bound, bound)
    ratio = torch.exp(lr_c)
    mask = loss_mask != 0
    valid = mask & finite

    has = seq["valid_tokens"] > 0
    mean_train = seq["train_log_prob_mean"]
    mean_rollout = seq["rollout_log_prob_mean"]
    d = mean_rollout - mean_train

    def seq_metric(values: torch.Tensor) -> torch.Tensor:
        return per_seq(torch.where(has, values, 0.0))

    out = {
        # per-sequence (broadcast over the sequence's tokens)
        "training_log_ppl": seq_metric(-mean_train),
        "training_ppl": seq_metric(torch.exp((-mean_train).clamp(max=bound))),
        "rollout_log_ppl": seq_metric(-mean_rollout),
        "rollout_ppl": seq_metric(torch.exp((-mean_rollout).clamp(max=bound))),
        "log_ppl_diff": seq_metric(d),
        "log_ppl_abs_diff": seq_metric(d.abs()),
        "ppl_ratio": seq_metric(torch.exp(d.clamp(-bound, bound))),
        "chi2_seq": seq_metric(torch.exp(2 * seq["log_ratio_sum"].clamp(-bound, bound)) - 1),
        # per token
        "kl": -lr,
        "k3_kl": ratio - 1 - lr_c,
        "chi2_token": ratio * ratio - 1,
        "raw_ratio": torch.where(finite, ratio, 0.0),
        # rejection (RS, veto, IS mask mode, non-finite): loss tokens removed from the loss, dropped sequences
        "rejected_token_fraction": (mask & (result.keep_mask == 0)).float(),
        "rejected_seq_fraction": per_seq(1.0 - seq["kept"]),
    }
    if config.veto_threshold is not None:
        out["catastrophic_token_fraction"] = (valid & (lr < math.log(config.veto_threshold))).float()
    if config.is_enabled:
        out["is_weight"] = result.is_weights.float()
        out["is_seq_weight"] = seq_metric(seq["is_weight"])
        # the raw statistic the IS bounds act on: token log r, or the sequence / geometric-mean log-ratio
        if config.is_level == "token":
            raw, raw_ok = lr, valid
        else:
            s = seq["log_ratio_sum"]
            raw = per_seq(s if config.is_level == "sequence" else s / seq["valid_tokens"].clamp(min=1))
            raw_ok = per_seq(has.double()) > 0
        out["is_ratio_fraction_high"] = (raw_ok & (raw > math.log(config.is_upper_bound))).float()
        out["is_ratio_fraction_low"] = (raw_ok & (raw < math.log(config.is_lower))).float()
    return {k: v.detach() for k, v in out.items()}


# ---- the two entry points ---------------------------------------------------------------------------------------
def _run(config: RolloutCorrectionConfig, train: TensorList, rollout: TensorList, masks: TensorList,
         lengths: Sequence[int], reducer: Optional[LocalReducer], device):
    train_p = pack(train, device)
    rollout_p = pack(rollout, device)
    mask_p = pack(masks, device)
    cu = cu_seqlens_from_lengths(list(lengths), device=train_p.device)
    result = compute_rollout_correction(train_p, rollout_p, mask_p, cu, config, reducer=reducer)
    metrics = token_metrics(result, config, train_p, rollout_p, mask_p, lengths)
    return result, metrics


def correct_samples(config: RolloutCorrectionConfig, *, train_log_probs: TensorList, rollout_log_probs: TensorList,
                    loss_masks: TensorList, reducer: Optional[LocalReducer] = None
                    ) -> Tuple[Optional[TensorList], TensorList, Metrics]:
    """slime's non-CP contract: lists in, ``(weights | None, modified_masks, metrics)`` lists out."""
    lengths = check_lists(train_log_probs, rollout_log_probs, loss_masks)
    device = train_log_probs[0].device if train_log_probs else None
    result, metrics = _run(config, train_log_probs, rollout_log_probs, loss_masks, lengths, reducer, device)
    weights = None if result.is_weights is None else unpack(result.is_weights, lengths)
    return weights, unpack(result.keep_mask, lengths), {k: unpack(v, lengths) for k, v in metrics.items()}


def context_parallel() -> Tuple[int, int, LocalReducer]:
    """``(cp_size, cp_rank, reducer)`` from megatron-core's parallel_state when torch.distributed and the model
    parallel groups are initialized; ``(1, 0, LocalReducer())`` otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            from slime_rc.reducer import megatron_reducer

            return (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                    megatron_reducer(data_parallel=False))
    return 1, 0, LocalReducer()


def cp_local_masks(loss_masks: TensorList, total_lengths: Sequence[int], response_lengths: Sequence[int],
                   cp_size: int, cp_rank: int) -> TensorList:
    """This rank's part (zigzag layout) of each full-length response loss mask."""
    if not len(loss_masks) == len(total_lengths) == len(response_lengths):
        raise ValueError(f"loss_masks, total_lengths and response_lengths must have one entry per sample; got "
                         f"{len(loss_masks)}, {len(total_lengths)} and {len(response_lengths)}")
    out = []
    for i, (m, total, resp) in enumerate(zip(loss_masks, total_lengths, response_lengths)):
        if m.dim() != 1 or m.shape[0] != int(resp):
            raise ValueError(f"sample {i}: loss_mask must be the full response mask of {int(resp)} tokens, got "
                             f"shape {tuple(m.shape)}")
        out.append(m[zigzag_response_indices(int(total), int(resp), cp_size, cp_rank, m.device)])
    return out


def correct_samples_with_cp(config: RolloutCorrectionConfig, *, pg_loss: torch.Tensor, train_log_probs: TensorList,
                            rollout_log_probs: TensorList, loss_masks: TensorList, total_lengths: Sequence[int],
                            response_lengths: Sequence[int], cp: Optional[Tuple[int, int, LocalReducer]] = None
                            ) -> Tuple[torch.Tensor, TensorList, Dict[str, torch.Tensor]]:
    """slime's CP contract: CP-local log-prob lists, full-length loss masks; returns ``(pg_loss * weights,
    CP-local modified masks, metrics as flat local concatenations)``.  ``pg_loss`` is unchanged when IS is off.

    ``cp``: ``(cp_size, cp_rank, reducer)``; default :func:`context_parallel`.
    """
    cp_size, cp_rank, reducer = context_parallel() if cp is None else cp
    local_masks = cp_local_masks(loss_masks, total_lengths, response_lengths, cp_size, cp_rank)
    lengths = check_lists(train_log_probs, rollout_log_probs, local_masks)
    if pg_loss.numel() != sum(lengths):
        raise ValueError(f"pg_loss holds {pg_loss.numel()} tokens but this CP rank's log-probs hold {sum(lengths)}")
    result, metrics = _run(config, train_log_probs, rollout_log_probs, local_masks, lengths, reducer,
                           pg_loss.device)
    if result.is_weights is not None:
        pg_loss = pg_loss * result.is_weights.to(pg_loss.dtype).reshape(pg_loss.shape)
    return pg_loss, unpack(result.keep_mask, lengths), metrics
