"""Counting the memory traffic on vocabulary-sized tensors: what a log-prob / entropy pass costs on a GPU.

On a GPU the vocabulary pass of a policy loss (``[T, V]`` logits, V ~ 150k) is bound by memory bandwidth: its time
is the bytes it moves over ``[T, V]``-sized tensors.  :class:`VocabTraffic` counts them on any device, the CPU
included: a ``TorchDispatchMode`` adds, for every aten op, the bytes of its tensor arguments (read) and outputs
(written) that have the vocabulary width among their dimensions (a broadcast dimension counted once).  Views and
allocations move nothing, ``copy_`` / ``fill_`` do not read their destination, and indexing ops (``gather``,
``scatter_add_``, advanced indexing) move only the elements they touch.  A model, not a profiler: a fused
kernel that reads its input twice counts once.

    with VocabTraffic(v_local) as traffic:
        loss.backward()
    traffic.passes(rows * v_local * 4)   # bytes in units of one float32 [rows, V] tensor
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class VocabTraffic(TorchDispatchMode):
    """Bytes read (``read``) and written (``written``) by aten ops on tensors that have a dimension equal to ``V``,
    and per op name (``by_op``)."""

    # ops that allocate without writing (nothing moves)
    ALLOCATE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
    # ops that read only their input's metadata (shape, dtype, device) and write their output
    WRITE_ONLY = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "rand_like",
                  "randn_like", "randint_like", "zeros", "ones", "full"}
    NO_READ_DEST = {"copy_", "fill_", "zero_"}  # write their first argument without reading it
    GATHER = {"index", "index_select", "gather", "take"}  # read from self only the elements they return
    SCATTER = {"index_put_", "index_put", "_index_put_impl_", "index_add_", "index_add", "index_copy_",
               "index_copy", "scatter_", "scatter", "scatter_add_", "scatter_add", "index_fill_", "masked_scatter_"}

    def __init__(self, V: int):
        super().__init__()
        self.V, self.read, self.written, self.by_op = V, 0, 0, Counter()

    def _bytes(self, t, numel: Optional[int] = None) -> int:
        """Addressed bytes of ``t`` if it has a dimension V (broadcast dimensions once); ``numel``: only that many
        of its elements (an indexing op's)."""
        if not isinstance(t, torch.Tensor) or self.V not in t.shape:
            return 0
        if numel is None:
            numel = 1
            for size, stride in zip(t.shape, t.stride()):
                if stride != 0:
                    numel *= size
        return numel * t.element_size()

    @staticmethod
    def _tensors(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in VocabTraffic._tensors(v)]
        return []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func._schema.name.split("::")[-1]
        if getattr(func, "is_view", False) or op in self.ALLOCATE:
            return out
        outs = self._tensors(out)
        if op in self.WRITE_ONLY:
            w = sum(self._bytes(t) for t in outs)
            self.written += w
            if w:
                self.by_op[op] += w
            return out
        first, rest = (args[0] if args else None), list(args[1:]) + [v for k, v in kwargs.items() if k != "out"]
        other = sum(self._bytes(t) for t in self._tensors(rest))  # indices, values, the other operand...
        if op in self.GATHER and isinstance(first, torch.Tensor):
            r = self._bytes(first, sum(t.numel() for t in outs)) + other
            w = sum(self._bytes(t) for t in outs)
        elif op in self.SCATTER and isinstance(first, torch.Tensor):
            touched = max([t.numel() for t in self._tensors(rest) if t.is_floating_point()] or [0])
            r = other + (self._bytes(first, touched) if "add" in op else 0)
            w = self._bytes(first, touched) if op.endswith("_") else sum(self._bytes(t) for t in outs)
            if not op.endswith("_"):  # out of place: a full copy of self, then the scatter
                r += self._bytes(first)
        else:
            r = other + (0 if op in self.NO_READ_DEST else sum(self._bytes(t) for t in self._tensors(first)))
            w = sum(self._bytes(t) for t in outs)
        if r or w:
            self.read += r
            self.written += w
            self.by_op[op] += r + w
        return out

    @property
    def total(self) -> int:
        return self.read + self.written

    def passes(self, unit_bytes: int) -> float:
        """Bytes moved in units of ``unit_bytes`` (e.g. one float32 ``[T, V]`` tensor)."""
        return self.total / unit_bytes


@contextlib.contextmanager
def saved_for_backward(width: int) -> Iterator[List[torch.Tensor]]:
    """The tensors autograd saves for backward inside the block that have ``width`` among their dimensions (what a
    vocabulary pass keeps alive between forward and backward), in a list filled as they are saved."""
    wide: List[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if width in t.shape:
            wide.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield wide
