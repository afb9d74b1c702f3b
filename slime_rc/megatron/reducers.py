"""Reducers over megatron-core's ``parallel_state`` groups: the Megatron job's side of
:mod:`slime_rc.correction.reducer` (which knows process groups, not Megatron).

* :func:`megatron_reducer`: sequences combined over the context-parallel (CP) group; batch totals over data-parallel
  x CP (or CP only);
* :func:`megatron_context_parallel`: ``(cp_size, cp_rank, reducer)`` for the slime adapters, which get CP-local
  tokens and no group from slime;
* :func:`megatron_step_group`: the DP x CP group a once-per-step reduction sums over.
"""

from __future__ import annotations

from typing import Optional, Tuple

from slime_rc.correction.reducer import DistributedReducer, LocalReducer, distributed, group_size


def megatron_reducer(*, context_parallel: bool = True, data_parallel: bool = True,
                     check_ranks: bool = True) -> LocalReducer:
    """A reducer over megatron-core's initialized ``parallel_state`` groups.

    ``context_parallel``: combine sequence statistics over the CP group (needed whenever CP > 1 and the inputs
    are each rank's CP shard).  ``data_parallel``: make metrics and batch normalization global over DP x CP.
    ``check_ranks``: see :class:`~slime_rc.correction.reducer.DistributedReducer`.
    """
    from megatron.core import parallel_state as ps

    seq_group = ps.get_context_parallel_group() if context_parallel else None
    batch_group = ps.get_data_parallel_group(with_context_parallel=True) if data_parallel else seq_group
    if group_size(seq_group) == 1 and group_size(batch_group) == 1:
        return LocalReducer()
    return DistributedReducer(seq_group, batch_group, check_ranks=check_ranks)


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
