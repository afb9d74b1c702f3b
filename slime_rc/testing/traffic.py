"""Counting the memory traffic on vocabulary-sized tensors: what a log-prob / entropy pass costs on a GPU.

On a GPU the vocabulary pass of a policy loss (``[T, V]`` logits, V ~ 150k) is bound by memory bandwidth: its time
is the bytes it moves over ``[T, V]``-sized tensors.  :class:`VocabTraffic` counts them on any device, the CPU
included: a ``TorchDispatchMode`` adds, for every aten op, the bytes of its tensor arguments (read) and outputs
(written) that have the vocabulary width among their dimensions.  Views move nothing; indexing ops (``gather``,
``scatter_add_``, advanced indexing) move only the elements they touch.  A model, not a profiler: a fused
kernel that reads its input twice counts once.

    with VocabTraffic(width=v_local) as traffic:
        loss.backward()
    traffic.passes(rows * v_local * 4)   # bytes in units of one float32 [rows, V] tensor
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that touch only the elements an index names: counted as index-sized reads and writes
_SPARSE = ("gather", "scatter", "scatter_add", "scatter_add_", "scatter_", "index", "index_put", "index_put_",
           "_index_put_impl_", "index_select", "index_add", "index_add_", "index_copy", "index_copy_")
# ops that allocate without reading or writing
_NO_WRITE = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


class VocabTraffic(TorchDispatchMode):
    """Bytes read (``read``) and written (``written``) by aten ops on tensors with ``width`` among their
    dimensions, and per op name (``by_op``)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = int(width)
        self.read = 0
        self.written = 0
        self.by_op: Counter = Counter()

    def _wide(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self.width in t.shape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_WRITE:
            return result
        inputs = [t for t in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
                  if self._wide(t)]
        outputs = [t for t in tree_flatten(result)[0] if self._wide(t)]
        if not inputs and not outputs:
            return result
        if name in _SPARSE:
            index = [t for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor) and not t.is_floating_point() and not self._wide(t)]
            moved = sum(t.numel() for t in index) * max(t.element_size() for t in inputs + outputs)
            read = written = moved
        else:
            read = sum(t.numel() * t.element_size() for t in inputs)
            written = sum(t.numel() * t.element_size() for t in outputs)
        self.read += read
        self.written += written
        self.by_op[name] += read + written
        return result

    @property
    def total(self) -> int:
        return self.read + self.written

    def passes(self, unit_bytes: int) -> float:
        """Bytes moved in units of ``unit_bytes`` (e.g. one float32 ``[T, V]`` tensor)."""
        return self.total / unit_bytes
