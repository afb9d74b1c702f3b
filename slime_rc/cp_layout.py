"""Megatron's zigzag context-parallel layout, as slime lays out response log-probs.

A sequence of ``total_length`` positions is cut into ``2 * cp_size`` chunks of ``ceil(total_length / (2 * cp_size))``
positions; CP rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` (this balances causal attention work).
Response log-prob ``j`` (0-based) is predicted by the logits at position ``prompt_length - 1 + j`` where
``prompt_length = total_length - response_length``; a rank holds the response log-probs whose position lies in
its chunks, in increasing order of ``j``.
"""

from __future__ import annotations

import torch


def zigzag_response_indices(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                            device=None) -> torch.Tensor:
    """Indices ``j`` (int64, increasing) of the response log-probs held by ``cp_rank``."""
    if not 0 <= response_length <= total_length:
        raise ValueError(f"response_length={response_length} must lie in [0, total_length={total_length}]")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    j = torch.arange(response_length, dtype=torch.int64, device=device)
    if cp_size == 1:
        return j
    chunk = -(-total_length // (2 * cp_size))
    pos = total_length - response_length - 1 + j
    which = torch.div(pos, chunk, rounding_mode="floor")
    return j[(which == cp_rank) | (which == 2 * cp_size - 1 - cp_rank)]


def zigzag_slice(values: torch.Tensor, total_length: int, response_length: int, cp_size: int,
                 cp_rank: int) -> torch.Tensor:
    """This rank's part of a full per-response-token tensor ``[response_length]``."""
    if values.shape[0] != response_length:
        raise ValueError(f"expected {response_length} response values, got {values.shape[0]}")
    return values[zigzag_response_indices(total_length, response_length, cp_size, cp_rank, values.device)]
