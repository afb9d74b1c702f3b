"""The one place that talks to other ranks.

The engine hands a reducer three kinds of O(B)-sized statistics, never per-token tensors:

1. ``combine_sequences(sums [B, k], maxes [B, m])``: per-sequence statistics of the ranks that hold pieces of
   the *same* sequences (the context-parallel group).  One ``all_gather``; every rank then reduces the gathered
   pieces in the same order, so all ranks of the group hold bit-identical per-sequence statistics.
2. ``sum_totals(v)``: batch totals (counts, sums, histogram bins) over every rank holding part of the batch
   (data-parallel x context-parallel).  One ``all_reduce(SUM)``.
3. ``max_totals(v)``: batch extremes over the same ranks.  One ``all_reduce(MAX)``.

So a call of the engine costs at most 3 collectives however many sequences it holds.  Sequence-level totals
must be counted once per sequence, not once per CP rank: ``counts_sequences`` is True on exactly one rank of
each context-parallel group.

Outside the engine, the two other places that need other ranks ask here too: the slime adapters learn their CP
rank and group (:func:`megatron_context_parallel`), and the once-per-step reduction of a TIS function's metrics
sums named values over DP x CP (:func:`sum_named_values`, :func:`megatron_step_group`).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class LocalReducer:
    """Single process: statistics are already global.  Also the base class (no collectives)."""

    counts_sequences = True

    def __init__(self):
        self.num_collectives = 0

    def combine_sequences(self, sums: torch.Tensor, maxes: torch.Tensor):
        return sums, maxes

    def sum_totals(self, totals: torch.Tensor) -> torch.Tensor:
        return totals

    def max_totals(self, totals: torch.Tensor) -> torch.Tensor:
        return totals


class DistributedReducer(LocalReducer):
    """Reduction over process groups.

    ``sequence_group``: ranks that hold pieces of the same sequences (megatron-core's context-parallel group);
    None or a group of size 1 when sequences are not split.  ``batch_group``: ranks over which the batch is spread
    and over which metrics and batch normalization are global (the data-parallel x context-parallel group);
    None when only the sequence group matters (then totals are reduced over the sequence group).
    """

    def __init__(self, sequence_group=None, batch_group=None):
        super().__init__()
        self.sequence_group = sequence_group
        self.sequence_world = dist.get_world_size(sequence_group) if sequence_group is not None else 1
        self.batch_group = batch_group if batch_group is not None else sequence_group
        self.batch_world = dist.get_world_size(self.batch_group) if self.batch_group is not None else 1
        self.counts_sequences = sequence_group is None or dist.get_rank(sequence_group) == 0

    def combine_sequences(self, sums, maxes):
        if self.sequence_world == 1:
            return sums, maxes
        b, k = sums.shape
        packed = torch.cat([sums, maxes], dim=1).contiguous()
        gathered = [torch.empty_like(packed) for _ in range(self.sequence_world)]
        dist.all_gather(gathered, packed, group=self.sequence_group)
        self.num_collectives += 1
        stacked = torch.stack(gathered)  # [world, B, k + m], same order on every rank
        return stacked[:, :, :k].sum(0), stacked[:, :, k:].amax(0) if maxes.shape[1] else maxes

    def sum_totals(self, totals):
        if self.batch_world == 1:
            return totals
        totals = totals.clone()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.batch_group)
        self.num_collectives += 1
        return totals

    def max_totals(self, totals):
        if self.batch_world == 1 or totals.numel() == 0:
            return totals
        totals = totals.clone()
        dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=self.batch_group)
        self.num_collectives += 1
        return totals


def megatron_reducer(*, context_parallel: bool = True, data_parallel: bool = True) -> LocalReducer:
    """A reducer over megatron-core's initialized ``parallel_state`` groups.

    ``context_parallel``: combine sequence statistics over the CP group (needed whenever CP > 1 and the inputs
    are each rank's CP shard).  ``data_parallel``: make metrics and batch normalization global over DP x CP.
    """
    from megatron.core import parallel_state as ps

    seq_group = ps.get_context_parallel_group() if context_parallel else None
    if data_parallel:
        batch_group = ps.get_data_parallel_group(with_context_parallel=True)
    else:
        batch_group = seq_group
    if (seq_group is None or dist.get_world_size(seq_group) == 1) and (
            batch_group is None or dist.get_world_size(batch_group) == 1):
        return LocalReducer()
    return DistributedReducer(seq_group, batch_group)


def as_reducer(reducer: Optional[LocalReducer]) -> LocalReducer:
    return LocalReducer() if reducer is None else reducer


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def megatron_context_parallel() -> Tuple[int, int, LocalReducer]:
    """``(cp_size, cp_rank, reducer over the CP group)`` from megatron-core's parallel_state when torch.distributed
    and the model-parallel groups are initialized; ``(1, 0, LocalReducer())`` otherwise."""
    if distributed():
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                    megatron_reducer(data_parallel=False))
    return 1, 0, LocalReducer()


def megatron_step_group() -> Tuple[Optional[object], int]:
    """``(megatron's DP x CP group, CP size)`` when torch.distributed is initialized; ``(None, 1)`` otherwise."""
    if not distributed():
        return None, 1
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True), ps.get_context_parallel_world_size()


def sum_named_values(names: Sequence[str], values: torch.Tensor, *, group=None, what: str = "values") -> torch.Tensor:
    """``values`` (``[len(names) + extra]``; the first ``len(names)`` belong to ``names``) summed over ``group``.

    Every rank must sum the same names: they are compared first (one ``all_gather_object``), and a difference is a
    ``ValueError`` on every rank naming both lists -- not a gloo size mismatch or, worse, two different metrics
    added together.  Two collectives; none when not distributed or ``group`` has one rank."""
    if not distributed() or dist.get_world_size(group) == 1:
        return values
    everyone: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, list(names), group=group)
    for other in everyone:
        if other != list(names):
            raise ValueError(f"{what}: different names on different ranks ({list(names)} vs {other}); every rank "
                             f"must report the same names")
    values = values.clone()
    dist.all_reduce(values, group=group)
    return values
