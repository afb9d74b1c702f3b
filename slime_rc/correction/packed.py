"""Packed-sequence helpers: B variable-length sequences laid end to end in 1-D tensors of N tokens.

``cu_seqlens`` (int64, ``[B+1]``, non-decreasing, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == N``) marks where
each sequence starts; sequence ``i`` owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]``.  Every helper here is
vectorized over sequences (no Python loop over B) and free of ``torch.distributed``.
"""

from __future__ import annotations

from typing import List, Optional

import torch

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def cu_seqlens_from_lengths(lengths, device=None) -> torch.Tensor:
    """``[3, 1, 2]`` -> ``tensor([0, 3, 4, 6])`` (int64)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Python numbers (host metadata such as slime's per-sample lengths) -> a tensor on ``device`` without stalling
    a GPU stream: on CUDA through pinned memory with a non-blocking copy (a plain ``torch.tensor(..., device=cuda)``
    is a blocking copy that waits for every queued kernel).  The one sanctioned host->device upload of the hot
    path (``slime_rc.testing.host_reads`` does not count it)."""
    t = torch.tensor(values, dtype=dtype)  # host: staged here, then copied without blocking
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums, accumulated in float64: ``[N] -> [B]``.

    Uses one prefix sum and two gathers: contiguous segments make a scatter unnecessary, and float64
    accumulation keeps the difference of prefix sums accurate to ~1e-12 of the batch total.
    """
    prefix = torch.zeros(values.numel() + 1, dtype=torch.float64, device=values.device)
    torch.cumsum(values, 0, dtype=torch.float64, out=prefix[1:])
    return prefix[cu_seqlens[1:]] - prefix[cu_seqlens[:-1]]


def segment_sums(columns: List[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums of several ``[N]`` columns at once: ``k x [N] -> [k, B]`` float64.

    Bool columns (counts) are prefix-summed in one ``[kb, N + 1]`` int32 matrix (exact up to 2^31 tokens), the
    others in one float64 matrix; each matrix is prefix-summed along the tokens in one op and read at the
    boundaries.  A tensor given twice (one RS rule is also "any RS rule") is summed once.  A handful of ops whatever
    ``k`` (one :func:`segment_sum` per column would be eight each).
    """
    n, dev = columns[0].numel(), columns[0].device
    unique = list({id(c): c for c in columns}.values())
    sums = {}
    for is_count in (True, False):
        group = [c for c in unique if (c.dtype == torch.bool) == is_count]
        if not group:
            continue
        m = torch.empty(len(group), n + 1, dtype=torch.int32 if is_count else torch.float64, device=dev)
        m[:, :1].zero_()  # the rest is overwritten: zeroing it all would be one more pass over k x N
        for row, column in zip(m[:, 1:], group):
            row.copy_(column)
        torch.cumsum(m, 1, out=m)
        at = m.index_select(1, cu_seqlens)
        sums.update(zip(map(id, group), (at[:, 1:] - at[:, :-1]).to(torch.float64)))
    return torch.stack([sums[id(c)] for c in columns])


def segment_max(values: torch.Tensor, sequence_of_tokens: torch.Tensor, n_seqs: int,
                empty: float = -torch.inf) -> torch.Tensor:
    """Per-sequence maxima ``[N] -> [B]`` (float64); an empty sequence gives ``empty``.  ``sequence_of_tokens``:
    ``[N]`` int64, the sequence of each token (:func:`token_sequence_ids`)."""
    out = torch.full((n_seqs,), empty, dtype=torch.float64, device=values.device)
    return out.scatter_reduce_(0, sequence_of_tokens, values.double(), "amax")


def token_sequence_ids(lengths: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[B]`` lengths -> ``[N]`` int64 sequence index of each token (no host read: the total is given)."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                   output_size=n_tokens)


def broadcast_to_tokens(per_sequence: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``[B] -> [N]``: repeat each sequence's value over its tokens."""
    return torch.repeat_interleave(per_sequence, lengths, output_size=total)


def sequence_of_token(token_index: int, cu_seqlens: torch.Tensor) -> int:
    """The sequence that holds packed position ``token_index``."""
    return int(torch.searchsorted(cu_seqlens, torch.tensor([token_index], device=cu_seqlens.device),
                                  right=True)[0]) - 1


def check_packed_inputs(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens):
    """Validate shapes/dtypes and return ``(train fp32, rollout fp32, mask bool, cu int64, bad_input)``.

    What the metadata shows (types, shapes, dtypes, devices) raises ``ValueError`` here, naming the argument, what
    it holds and what it should hold.  What only the values show -- ``cu_seqlens`` not starting at 0, not ending
    at N, decreasing; a float loss mask with values other than 0 and 1 -- costs no host read: ``bad_input`` (0-d
    float64, non-zero when malformed) goes to the caller (the engine sums it over ranks, so that every rank raises
    together, and adds it to its deferred checks), and the returned ``cu`` is clamped into ``[0, N]`` and made
    non-decreasing so that nothing downstream indexes out of bounds before the check fires.
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
    if rollout_log_probs.device != train_log_probs.device:
        raise ValueError(f"rollout_log_probs is on {rollout_log_probs.device}, train_log_probs on "
                         f"{train_log_probs.device}; move them to one device")
    device = train_log_probs.device
    if loss_mask.device != device:
        raise ValueError(f"loss_mask is on {loss_mask.device}, the log-probs on {device}; move it to {device}")
    if not isinstance(cu_seqlens, torch.Tensor):
        try:
            cu_seqlens = upload(list(cu_seqlens), torch.int64, device)
        except (TypeError, ValueError):
            raise ValueError(f"cu_seqlens must be a tensor or a sequence of ints of shape [B+1], got "
                             f"{type(cu_seqlens).__name__}") from None
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor of shape [B+1], got shape {tuple(cu_seqlens.shape)} "
                         f"dtype {cu_seqlens.dtype}")
    if cu_seqlens.numel() == 1 and n:
        raise ValueError(f"cu_seqlens has 1 entry (no sequence) but the log-probs hold {n} tokens; cu_seqlens must "
                         f"be [B+1] boundaries from 0 to {n}")
    given = cu_seqlens.to(device=device, dtype=torch.int64, non_blocking=True)
    # cu made safe to index with: clamped into [0, N], non-decreasing, from 0 to N.  It differs from the given
    # cu_seqlens exactly when those are malformed, which is the deferred check (no host read here).
    cu = given.clamp(0, n).cummax(0).values
    cu[:1].fill_(0), cu[-1:].fill_(n)
    bad = (cu != given).any() | (given[0] != 0)  # (the second: a single entry is both first and last)
    if loss_mask.dtype != torch.bool:
        if loss_mask.is_floating_point():
            bad = bad | (loss_mask * loss_mask != loss_mask).any()  # m^2 == m only for 0 and 1 (NaN fails too)
        loss_mask = loss_mask != 0
    # bf16/fp16 inputs are computed in fp32: exp() of a bf16 log-ratio is too coarse for weights near 1.
    train = train_log_probs.detach().float()
    rollout = rollout_log_probs.detach().float()
    return train, rollout, loss_mask, cu, bad


def describe_bad_input(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, n: int) -> str:
    """The message for malformed ``cu_seqlens`` / ``loss_mask`` values (slow path: reads the device freely)."""
    cu = cu_seqlens.to("cpu", torch.int64)
    if cu.numel() == 0 or int(cu[0]) != 0 or int(cu[-1]) != n:
        return (f"cu_seqlens must start at 0 and end at the token count {n}; got first="
                f"{int(cu[0]) if cu.numel() else None} last={int(cu[-1]) if cu.numel() else None} "
                f"(shape [B+1], B = number of sequences)")
    steps = cu[1:] - cu[:-1]
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0, 0])
        return (f"cu_seqlens must be non-decreasing; cu_seqlens[{i + 1}]={int(cu[i + 1])} < "
                f"cu_seqlens[{i}]={int(cu[i])}")
    if loss_mask.is_floating_point() and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
        return "loss_mask must hold only 0 and 1 (or be bool); found other values"
    return "malformed cu_seqlens or loss_mask on another rank of the batch group (this rank's are well-formed)"


BAD_INPUT_SUMMARY = ("malformed packed input: cu_seqlens must start at 0, be non-decreasing and end at the token "
                     "count N, and a float loss_mask must hold only 0 and 1 (on this or another rank)")


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
