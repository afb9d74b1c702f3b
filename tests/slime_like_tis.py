"""A TIS function written to slime's contract, the way slime's example
``examples/train_infer_mismatch_helper/mis.py`` (``compute_mis_weights_with_cp``) is written -- for tests that
cannot use a slime checkout.

Like slime's example it knows nothing of slime-rc: it reads its settings off ``args`` (``args.tis_upper_bound``,
``args.use_rs``, ``args.rs_upper_bound`` ...; ``1.0 / args.tis_upper_bound`` fails on an args that carries None),
all-gathers each sequence's CP-local log-probs over megatron's CP group (``parallel_state``), computes per-sequence
values on the full sequences, and returns

* ``pg_loss * weights`` on this rank's tokens (CP-local),
* the modified masks at **full response length** (slime's contract),
* metrics as CP-local per-token tensors (one flat tensor each), under keys of its own.

The CP offsets are slime's ``cp_utils.get_logits_and_tokens_offset_with_cp``, written out here independently of
``slime_rc.megatron.cp_layout`` (so a layout that drifts from slime's fails these tests).

Computation per sample (full sequence, loss mask ``m``): ``log r = train - rollout``; token-level truncated IS
``w = min(exp(clamp(log r, -20, 20)), tis_upper_bound) * m``; with ``use_rs`` token rejection outside
``[rs_lower_bound, rs_upper_bound]`` of the ratio (modified mask); metrics ``kl`` (``rollout - train`` per token),
``truncate_fraction`` (per token), ``seq_log_ratio`` (the sequence's masked sum of ``log r``, broadcast: a
sequence-level metric), ``weight_mean`` (the sequence's masked mean weight, broadcast) and ``lower_bound``
(``1 / tis_upper_bound`` unless ``tis_lower_bound`` is set, broadcast: shows what ``args`` held).
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed as dist

SAFETY_BOUND = 20.0


def _cp():
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        return 1, 0, None
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(), ps.get_context_parallel_group()


def _logits_offsets(total_length: int, response_length: int, cp_size: int, cp_rank: int):
    """slime's ``get_logits_and_tokens_offset_with_cp`` (its logits offsets)."""
    prompt_length = total_length - response_length
    chunk_size = (total_length + 2 * cp_size - 1) // (2 * cp_size)
    chunk_0 = (cp_rank * chunk_size, (cp_rank + 1) * chunk_size)
    chunk_1 = ((2 * cp_size - cp_rank - 1) * chunk_size, (2 * cp_size - cp_rank) * chunk_size)
    logits_0 = (max(chunk_0[0], prompt_length - 1), min(chunk_0[1], total_length - 1))
    logits_1 = (max(chunk_1[0], prompt_length - 1), min(chunk_1[1], total_length - 1))
    if not logits_0[0] < logits_0[1]:
        logits_0 = (0, 0)
    if not logits_1[0] < logits_1[1]:
        logits_1 = (0, 0)
    return logits_0, logits_1


def _gather(local: torch.Tensor, total_length: int, response_length: int, cp_size: int, cp_rank: int,
            group) -> torch.Tensor:
    """slime's ``all_gather_with_cp``: place this rank's two chunks in a zero tensor of the full response length,
    all-reduce (sum) over the CP group."""
    if cp_size == 1:
        return local
    prompt_length = total_length - response_length
    (a0, b0), (a1, b1) = _logits_offsets(total_length, response_length, cp_size, cp_rank)
    n0 = b0 - a0
    assert local.numel() == n0 + (b1 - a1), (local.numel(), n0, b1 - a1, total_length, response_length)
    full = torch.zeros(response_length, dtype=local.dtype)
    if n0:
        full[a0 - (prompt_length - 1):b0 - (prompt_length - 1)] = local[:n0]
    if b1 - a1:
        full[a1 - (prompt_length - 1):b1 - (prompt_length - 1)] = local[n0:]
    dist.all_reduce(full, group=group)
    return full


def _slice(full: torch.Tensor, total_length: int, response_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """slime's ``slice_log_prob_with_cp``."""
    if cp_size == 1:
        return full
    prompt_length = total_length - response_length
    (a0, b0), (a1, b1) = _logits_offsets(total_length, response_length, cp_size, cp_rank)
    return torch.cat([full[a0 - (prompt_length - 1):b0 - (prompt_length - 1)],
                      full[a1 - (prompt_length - 1):b1 - (prompt_length - 1)]])


def slime_slice_with_cp(tokens: torch.Tensor, cp_size: int, cp_rank: int, pad_value=-1) -> torch.Tensor:
    """slime's ``cp_utils.slice_with_cp`` (what ``get_batch`` does to each sequence's tokens)."""
    if cp_size == 1:
        return tokens
    token_len = len(tokens)
    chunk_size = (token_len + 2 * cp_size - 1) // (2 * cp_size)
    pad = 2 * cp_size * chunk_size - token_len
    tokens = torch.cat([tokens, torch.full((pad,), pad_value, dtype=tokens.dtype)])
    start_1, end_1 = chunk_size * cp_rank, chunk_size * (cp_rank + 1)
    start_2, end_2 = chunk_size * (2 * cp_size - cp_rank - 1), chunk_size * (2 * cp_size - cp_rank)
    return torch.cat([tokens[start_1:end_1], tokens[start_2:end_2]])


def slime_response_positions(total_length: int, response_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The response log-prob indices ``j`` slime's ``slice_log_prob_with_cp`` keeps on ``cp_rank``."""
    return _slice(torch.arange(response_length), total_length, response_length, cp_size, cp_rank)


def compute_weights_with_cp(args, *, pg_loss: torch.Tensor, train_log_probs: List[torch.Tensor],
                            rollout_log_probs: List[torch.Tensor], loss_masks: List[torch.Tensor],
                            total_lengths: List[int], response_lengths: List[int], **kwargs: Any):
    cp_size, cp_rank, group = _cp()
    upper = args.tis_upper_bound
    lower = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / args.tis_upper_bound
    rs_upper = args.rs_upper_bound if args.rs_upper_bound is not None else upper
    rs_lower = args.rs_lower_bound if args.rs_lower_bound is not None else lower

    weights_local, masks, metrics = [], [], {}

    def add(key, full, total, resp):
        metrics.setdefault(key, []).append(_slice(full, total, resp, cp_size, cp_rank))

    for train, rollout, mask, total, resp in zip(train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                                                 response_lengths):
        m = mask.float()
        assert m.numel() == resp, f"loss mask of {m.numel()} entries for a response of {resp} (slime: full length)"
        log_r = (_gather(train.float(), total, resp, cp_size, cp_rank, group)
                 - _gather(rollout.float(), total, resp, cp_size, cp_rank, group))
        ratio = torch.exp(log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        w = (ratio.clamp(max=upper) * m) if args.use_tis else torch.ones_like(m)
        modified = m.clone()
        if args.use_rs:
            modified = modified * ((ratio >= rs_lower) & (ratio <= rs_upper)).float()
        weights_local.append(_slice(w, total, resp, cp_size, cp_rank))
        masks.append(modified)
        add("kl", -log_r, total, resp)
        add("truncate_fraction", (ratio > upper).float(), total, resp)
        add("seq_log_ratio", (log_r * m).sum().expand(resp).clone(), total, resp)
        add("weight_mean", ((w * m).sum() / m.sum().clamp(min=1)).expand(resp).clone(), total, resp)
        add("lower_bound", torch.full((resp,), float(lower)), total, resp)
    flat = {k: torch.cat(v) if v else torch.zeros(0) for k, v in metrics.items()}
    w_all = torch.cat(weights_local) if weights_local else torch.zeros(0)
    return pg_loss * w_all, masks, flat

