"""Packed-sequence helpers: B variable-length sequences laid end to end in 1-D tensors of N tokens.

``cu_seqlens`` (int64, ``[B+1]``, non-decreasing, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == N``) marks where
each sequence starts; sequence ``i`` owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]``.  Every helper here is
vectorized over sequences (no Python loop over B) and free of ``torch.distributed``.
"""

from __future__ import annotations

from typing import Optional

import torch

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def cu_seqlens_from_lengths(lengths, device=None) -> torch.Tensor:
    """``[3, 1, 2]`` -> ``tensor([0, 3, 4, 6])`` (int64)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums, accumulated in float64: ``[N] -> [B]``.

    Uses one prefix sum and two gathers: contiguous segments make a scatter unnecessary, and float64
    accumulation keeps the difference of prefix sums accurate to ~1e-12 of the batch total.
    """
    prefix = torch.zeros(values.numel() + 1, dtype=torch.float64, device=values.device)
    torch.cumsum(values, 0, dtype=torch.float64, out=prefix[1:])
    return prefix[cu_seqlens[1:]] - prefix[cu_seqlens[:-1]]


def segment_max(values: torch.Tensor, cu_seqlens: torch.Tensor, empty: float = -torch.inf) -> torch.Tensor:
    """Per-sequence maxima ``[N] -> [B]`` (float64); an empty sequence gives ``empty``."""
    return torch.segment_reduce(values.double(), "max", offsets=cu_seqlens, unsafe=True, initial=empty)


def broadcast_to_tokens(per_sequence: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``[B] -> [N]``: repeat each sequence's value over its tokens."""
    return torch.repeat_interleave(per_sequence, lengths, output_size=total)


def sequence_of_token(token_index: int, cu_seqlens: torch.Tensor) -> int:
    """The sequence that holds packed position ``token_index``."""
    return int(torch.searchsorted(cu_seqlens, torch.tensor([token_index], device=cu_seqlens.device),
                                  right=True)[0]) - 1


def check_packed_inputs(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens):
    """Validate shapes/dtypes and return ``(train fp32, rollout fp32, mask bool, cu int64)``.

    Raises ``ValueError`` naming the argument, what it holds and what it should hold.
    """
    for name, t in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape [N], got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D packed tokens [N], got shape {tuple(t.shape)}; "
                             f"flatten padded [B, T] batches and pass cu_seqlens")
        if t.dtype not in _FLOAT_INPUTS:
            raise ValueError(f"{name} has dtype {t.dtype}; pass floating-point log-probs")
    n = train_log_probs.numel()
    if rollout_log_probs.numel() != n:
        raise ValueError(f"rollout_log_probs has {rollout_log_probs.numel()} tokens but train_log_probs has {n}; "
                         f"both must hold the same packed tokens")
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dim() != 1 or loss_mask.numel() != n:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"loss_mask must be a 1-D tensor of {n} tokens (like the log-probs), got {shape}")
    if loss_mask.dtype != torch.bool:
        if loss_mask.is_floating_point() and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
            raise ValueError("loss_mask must hold only 0 and 1 (or be bool); found other values")
        loss_mask = loss_mask != 0
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.int64, device=train_log_probs.device)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor of shape [B+1], got shape {tuple(cu_seqlens.shape)} "
                         f"dtype {cu_seqlens.dtype}")
    cu_seqlens = cu_seqlens.to(torch.int64)
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at the token count {n}; got first={int(cu_seqlens[0])} "
                         f"last={int(cu_seqlens[-1])} (shape [B+1], B = number of sequences)")
    if cu_seqlens.numel() > 1:
        steps = cu_seqlens[1:] - cu_seqlens[:-1]
        if bool((steps < 0).any()):
            i = int(torch.nonzero(steps < 0)[0, 0])
            raise ValueError(f"cu_seqlens must be non-decreasing; cu_seqlens[{i + 1}]={int(cu_seqlens[i + 1])} < "
                             f"cu_seqlens[{i}]={int(cu_seqlens[i])}")
    if rollout_log_probs.device != train_log_probs.device:
        raise ValueError(f"rollout_log_probs is on {rollout_log_probs.device}, train_log_probs on "
                         f"{train_log_probs.device}; move them to one device")
    # bf16/fp16 inputs are computed in fp32: exp() of a bf16 log-ratio is too coarse for weights near 1.
    train = train_log_probs.detach().float()
    rollout = rollout_log_probs.detach().float()
    return train, rollout, loss_mask, cu_seqlens.to(train.device)


def first_nonfinite(train: torch.Tensor, rollout: torch.Tensor, bad: torch.Tensor,
                    cu_seqlens: torch.Tensor) -> Optional[str]:
    """Describe the first non-finite loss token: which tensor, which value, sample and position."""
    idx = torch.nonzero(bad)
    if idx.numel() == 0:
        return None
    j = int(idx[0, 0])
    sample = sequence_of_token(j, cu_seqlens)
    which = "train_log_probs" if not bool(torch.isfinite(train[j])) else "rollout_log_probs"
    value = float((train if which == "train_log_probs" else rollout)[j])
    return (f"{which} is {value} at sample {sample}, position {j - int(cu_seqlens[sample])} "
            f"(packed index {j}); {int(idx.numel())} non-finite loss token(s) on this rank")
