"""This rank's place in megatron-core's tensor-parallel group, where the vocabulary is sharded."""

from __future__ import annotations


def tensor_parallel():
    """``(size, rank, group)`` of megatron's tensor-parallel group when it is initialized with size > 1, else
    ``(1, 0, None)`` (megatron absent or not initialized: the whole vocabulary is here)."""
    try:
        from megatron.core import parallel_state as ps
        if ps.model_parallel_is_initialized():
            size = ps.get_tensor_model_parallel_world_size()
            if size > 1:
                return size, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    except ImportError:
        pass
    return 1, 0, None
