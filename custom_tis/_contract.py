"""slime's custom-TIS contract, as the adapters in ``custom_tis`` take and return it.

slime calls ``fn(args, pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=, total_lengths=,
response_lengths=)`` once per micro-batch on every rank (``slime/backends/megatron_utils/loss.py``):

* ``pg_loss`` ``[N]`` and the log-prob lists are this CP rank's tokens (megatron's zigzag layout,
  :mod:`slime_rc.megatron.cp_layout`); ``loss_masks`` are FULL response length (``torch.int``);
* it expects ``(pg_loss_out [N], masks at full response length, {name: [N] per-token metric})`` and cuts the
  masks into its rank's zigzag chunks itself.  Loss denominators stay the original masks' sums.

Each rank knows the decisions of its own tokens and the sequence-level decisions of every sequence (those are
combined over the CP group).  So the returned full-length mask holds this rank's decisions at its own positions
and, at the positions other ranks hold, the original mask times the sequence-level decision; slime reads only the
rank's own positions (``cp_utils.get_sum_of_sample_mean``).  Nothing per token crosses ranks.

Everything here is plumbing (lists <-> packed tensors, zigzag positions, full-length masks, dtypes); the math is
in :mod:`slime_rc.slime.mis` (slime's semantics) and :func:`slime_rc.compute_rollout_correction` (slime-rc's).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from slime_rc import LocalReducer, RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths
from slime_rc.correction.engine import CorrectionResult
from slime_rc.correction.reducer import megatron_context_parallel
from slime_rc.megatron.cp_layout import zigzag_response_indices

TensorList = List[torch.Tensor]


# ---- where the settings come from --------------------------------------------------------------------------------
def get_arg(args: Any, name: str, default: Any = None) -> Any:
    """``args.name`` (or ``args[name]`` for a mapping), ``default`` when missing or None."""
    value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
    return default if value is None else value


def launch_config(args: Any) -> Optional[RolloutCorrectionConfig]:
    """The config resolved at launch by slime-rc (``slime_rc.config_from_args``: ``slime-rc train``, a Megatron
    launch with our flags), if any.  It selects slime-rc's own semantics (the engine)."""
    return get_arg(args, "rollout_correction_config")


# ---- the CP layout -----------------------------------------------------------------------------------------------
class Batch:
    """One call's samples, packed: this rank's tokens of each sample and where they sit in the full responses.

    ``train``, ``rollout``: ``[N]`` float32; ``mask``: ``[N]`` float32 0/1 (the original loss mask at this rank's
    tokens); ``cu_seqlens``: ``[B+1]``; ``lengths``: this rank's token count per sample; ``positions``: ``[N]``
    int64 index of each token in its sample's response; ``full_masks``: the caller's full-length masks.
    """

    def __init__(self, train_log_probs: TensorList, rollout_log_probs: TensorList, loss_masks: TensorList,
                 total_lengths: Optional[Sequence[int]] = None, response_lengths: Optional[Sequence[int]] = None,
                 cp: Tuple[int, int] = (1, 0)):
        for name, v in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs),
                        ("loss_masks", loss_masks)):
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"{name} must be a list with one 1-D tensor per sample, got {type(v).__name__}")
        counts = {"train_log_probs": len(train_log_probs), "rollout_log_probs": len(rollout_log_probs),
                  "loss_masks": len(loss_masks)}
        if total_lengths is not None:
            counts.update(total_lengths=len(total_lengths), response_lengths=len(response_lengths))
        if len(set(counts.values())) > 1:
            raise ValueError("one entry per sample in every list: got " + ", ".join(f"{k} {v}" for k, v in
                                                                                     counts.items()))
        cp_size, cp_rank = cp
        idx, lengths = [], []
        for i, (t, r, m) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks)):
            for name, v in (("train_log_probs", t), ("rollout_log_probs", r), ("loss_masks", m)):
                if not isinstance(v, torch.Tensor) or v.dim() != 1:
                    raise ValueError(f"sample {i}: {name} must be a 1-D tensor, got "
                                     f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
            if t.shape != r.shape:
                raise ValueError(f"sample {i}: train_log_probs holds {t.numel()} tokens, rollout_log_probs "
                                 f"{r.numel()}; both must be this rank's tokens of the response")
            if total_lengths is None:
                if m.numel() != t.numel():
                    raise ValueError(f"sample {i}: loss_masks holds {m.numel()} tokens, the log-probs "
                                     f"{t.numel()}; pass one mask per response, as long as its log-probs")
                idx.append(None)
            else:
                total, resp = int(total_lengths[i]), int(response_lengths[i])
                if m.numel() != resp:
                    raise ValueError(f"sample {i}: loss_masks must be the full response mask of "
                                     f"response_lengths[{i}]={resp} tokens, got {m.numel()} (slime passes full-length "
                                     f"masks and CP-local log-probs)")
                j = zigzag_response_indices(total, resp, cp_size, cp_rank, m.device)
                if j.numel() != t.numel():
                    raise ValueError(
                        f"sample {i}: train_log_probs holds {t.numel()} tokens but context-parallel rank {cp_rank} "
                        f"of {cp_size} holds {j.numel()} of its {resp} response tokens (total_lengths[{i}]={total}, "
                        f"megatron's zigzag layout); pass this rank's log-probs")
                idx.append(j)
            lengths.append(t.numel())
        self.n_samples, self.lengths, self.idx = len(lengths), lengths, idx
        self.full_masks = list(loss_masks)
        device = train_log_probs[0].device if lengths else torch.device("cpu")
        cat = (lambda ts: torch.cat([t.reshape(-1) for t in ts]).to(device) if ts else
               torch.zeros(0, device=device))
        self.train = cat(train_log_probs).float()
        self.rollout = cat(rollout_log_probs).float()
        local_masks = [m if j is None else m[j] for m, j in zip(loss_masks, idx)]
        mask = cat(local_masks)
        if mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("loss_masks must hold only 0 and 1")
        self.mask = (mask != 0).float()
        self.cu_seqlens = cu_seqlens_from_lengths(lengths, device=device)
        self.positions = torch.cat([torch.arange(n, device=device) if j is None else j
                                    for n, j in zip(lengths, idx)]) if lengths else torch.zeros(0, dtype=torch.int64)

    def describe(self, j: int) -> str:
        """Sample and response position of packed token ``j``."""
        sample = int(torch.searchsorted(self.cu_seqlens, torch.tensor([j], device=self.cu_seqlens.device),
                                        right=True)[0]) - 1
        which = "train_log_probs" if not math.isfinite(float(self.train[j])) else "rollout_log_probs"
        value = float((self.train if which == "train_log_probs" else self.rollout)[j])
        return f"{which} is {value} at sample {sample}, response position {int(self.positions[j])}"

    def split(self, packed: torch.Tensor) -> TensorList:
        return list(packed.split(self.lengths)) if self.lengths else []

    def full_length_masks(self, keep: torch.Tensor, seq_keep: torch.Tensor) -> TensorList:
        """Full-length masks in the callers' dtype: ``keep`` at this rank's positions, the original mask times the
        sequence decision ``seq_keep [B]`` elsewhere."""
        return [((m != 0) & s).to(m.dtype).index_copy(0, j, k.to(m.dtype))
                for m, j, k, s in zip(self.full_masks, self.idx, self.split(keep), seq_keep.unbind(0))]


def check_pg_loss(pg_loss: torch.Tensor, batch: Batch) -> None:
    if not isinstance(pg_loss, torch.Tensor) or pg_loss.numel() != sum(batch.lengths):
        got = pg_loss.numel() if isinstance(pg_loss, torch.Tensor) else type(pg_loss).__name__
        raise ValueError(f"pg_loss holds {got} tokens but this CP rank's log-probs hold {sum(batch.lengths)}; "
                         f"pass the per-token loss of the same tokens")


def apply_weights(pg_loss: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``pg_loss * weights`` in ``pg_loss``'s dtype and shape (weights carry no gradient)."""
    if weights is None:
        return pg_loss
    return pg_loss * weights.detach().to(pg_loss.dtype).reshape(pg_loss.shape)


def run_with_cp(compute: Callable[[Batch, LocalReducer], Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor,
                                                                  Dict[str, torch.Tensor]]],
                *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                prefix: str = "", cp: Optional[Tuple[int, int, LocalReducer]] = None):
    """slime's CP contract around ``compute(batch, reducer) -> (weights [N] | None, keep [N], seq_keep [B],
    metrics {name: [N]})``: returns ``(pg_loss * weights, full-length masks, {prefix + name: [N]})``."""
    cp_size, cp_rank, reducer = megatron_context_parallel() if cp is None else cp
    batch = Batch(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, (cp_size, cp_rank))
    check_pg_loss(pg_loss, batch)
    weights, keep, seq_keep, metrics = compute(batch, reducer)
    masks = batch.full_length_masks(keep, seq_keep)
    return apply_weights(pg_loss, weights), masks, {prefix + k: v.float() for k, v in metrics.items()}


def run_lists(compute, *, train_log_probs, rollout_log_probs, loss_masks, weights_when_off: bool = True):
    """slime's non-CP form: ``(weights list | None, masks list, {name: list})``, one process."""
    batch = Batch(train_log_probs, rollout_log_probs, loss_masks)
    weights, keep, _, metrics = compute(batch, LocalReducer())
    masks = [k.to(m.dtype) for k, m in zip(batch.split(keep), batch.full_masks)]
    return (None if weights is None else batch.split(weights), masks,
            {k: batch.split(v.float()) for k, v in metrics.items()})


# ---- slime-rc's own semantics (a config resolved at launch) ------------------------------------------------------
def engine_compute(config: RolloutCorrectionConfig) -> Callable:
    """``compute`` for :func:`run_with_cp` / :func:`run_lists` from slime-rc's engine."""

    def compute(batch: Batch, reducer: LocalReducer):
        result = compute_rollout_correction(batch.train, batch.rollout, batch.mask, batch.cu_seqlens, config,
                                            reducer=reducer)
        return (result.is_weights, result.keep_mask, result.sequences["kept"] > 0,
                token_metrics(result, config, batch))
    return compute


def token_metrics(result: CorrectionResult, config: RolloutCorrectionConfig, batch: Batch) -> Dict[str, torch.Tensor]:
    """The engine's metrics as slime-style per-token values (``[N]`` float32) for slime's per-sample masked mean:
    token metrics hold the token's value, sequence metrics broadcast the sequence's (global) value."""
    train, rollout, loss_mask = batch.train, batch.rollout, batch.mask
    dev = train.device
    n_tokens = train.numel()
    lengths_t = torch.as_tensor(batch.lengths, dtype=torch.int64, device=dev)
    seq = result.sequences
    bound = config.safety_bound

    def per_seq(values: torch.Tensor) -> torch.Tensor:  # [B] -> [N], float32
        return torch.repeat_interleave(values.float(), lengths_t, output_size=n_tokens)

    lr_raw = train - rollout
    finite = torch.isfinite(lr_raw)
    lr = torch.where(finite, lr_raw, 0.0)
    lr_c = lr.clamp(-bound, bound)
    ratio = torch.exp(lr_c)
    mask = loss_mask != 0
    valid = mask & finite
    has = seq["valid_tokens"] > 0
    mean_train, mean_rollout = seq["train_log_prob_mean"], seq["rollout_log_prob_mean"]
    d = mean_rollout - mean_train

    def seq_metric(values: torch.Tensor) -> torch.Tensor:
        return per_seq(torch.where(has, values, 0.0))

    out = {
        "training_log_ppl": seq_metric(-mean_train),
        "training_ppl": seq_metric(torch.exp((-mean_train).clamp(max=bound))),
        "rollout_log_ppl": seq_metric(-mean_rollout),
        "rollout_ppl": seq_metric(torch.exp((-mean_rollout).clamp(max=bound))),
        "log_ppl_diff": seq_metric(d),
        "log_ppl_abs_diff": seq_metric(d.abs()),
        "ppl_ratio": seq_metric(torch.exp(d.clamp(-bound, bound))),
        "chi2_seq": seq_metric(torch.exp(2 * seq["log_ratio_sum"].clamp(-bound, bound)) - 1),
        "kl": -lr,
        "k3_kl": ratio - 1 - lr_c,
        "chi2_token": ratio * ratio - 1,
        "raw_ratio": torch.where(finite, ratio, 0.0),
        "rejected_token_fraction": (mask & (result.keep_mask == 0)).float(),
        "rejected_seq_fraction": per_seq(1.0 - seq["kept"]),
    }
    if config.veto_threshold is not None:
        out["catastrophic_token_fraction"] = (valid & (lr < math.log(config.veto_threshold))).float()
    if config.is_enabled:
        out["is_weight"] = result.is_weights.float()
        out["is_seq_weight"] = seq_metric(seq["is_weight"])
        if config.is_level == "token":
            raw, raw_ok = lr, valid
        else:
            s = seq["log_ratio_sum"]
            raw = per_seq(s if config.is_level == "sequence" else s / seq["valid_tokens"].clamp(min=1))
            raw_ok = per_seq(has.double()) > 0
        out["is_ratio_fraction_high"] = (raw_ok & (raw > math.log(config.is_upper_bound))).float()
        out["is_ratio_fraction_low"] = (raw_ok & (raw < math.log(config.is_lower))).float()
    return {k: v.detach() for k, v in out.items()}
