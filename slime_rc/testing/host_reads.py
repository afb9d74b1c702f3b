"""Counting host synchronisations on any device, the CPU included: what would stall a GPU's stream.

On a GPU every device->host read (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``), every op whose output size
depends on the data (``nonzero``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``,
``bincount``, ``unique``, ``masked_select``) and every blocking host<->device copy (``torch.tensor(list)`` on the
device) waits for the stream to drain.  On the CPU the same calls are cheap, which is why they creep in unseen;
:class:`HostReads` sees them anyway: a ``TorchDispatchMode`` classifies every aten op, and ``Tensor.tolist`` /
``Tensor.numpy`` (which bypass the dispatcher on the CPU) are wrapped while it is active.  Two places are host
memory by construction and not counted: ``packed.upload`` (pinned, non-blocking) and the reducer's agreement header
(``reducer._gather_header``: CPU tensors over a gloo group, never a device).

    with HostReads() as reads:
        compute_rollout_correction(...)
    assert reads.count == 0, reads.report()
"""

from __future__ import annotations

import os
import sys
import traceback
from collections import Counter
from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read device memory on the host, or whose output shape depends on the data (a read of a count)
_READS = {
    "aten._local_scalar_dense.default": "scalar read (.item / int / float / bool)",
    "aten.nonzero.default": "nonzero (data-dependent size)",
    "aten.nonzero_static.default": None,  # fixed size: no read
    "aten.masked_select.default": "masked_select (data-dependent size)",
    "aten.bincount.default": "bincount (reads the maximum)",
    "aten._unique2.default": "unique (data-dependent size)",
    "aten.unique_dim.default": "unique (data-dependent size)",
    "aten.unique_consecutive.default": "unique_consecutive (data-dependent size)",
    "aten.equal.default": "torch.equal (host bool)",
    "aten.is_nonzero.default": "is_nonzero (host bool)",
    "aten.segment_reduce.default": "segment_reduce (reads its offsets on CUDA)",
    "aten.lift_fresh.default": "torch.tensor(data) (a blocking host->device copy on a GPU)",
}


def _why(func, args, kwargs) -> str | None:
    name = str(func)
    if name == "aten.lift_fresh.default" and _in_frame("upload", "packed.py"):
        return None  # slime_rc.correction.packed.upload: pinned, non-blocking on a GPU
    if name in _READS:
        return _READS[name]
    if name.startswith("aten.repeat_interleave.") and kwargs.get("output_size") is None \
            and (len(args) < 4 or args[3] is None) and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
        return "repeat_interleave without output_size (reads the total)"
    if name.startswith(("aten.index.Tensor", "aten.index_put")):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "boolean-mask indexing (nonzero)"
    if name in ("aten._to_copy.default", "aten.copy_.default"):
        src = args[1] if name == "aten.copy_.default" else args[0]
        dst = args[0].device if name == "aten.copy_.default" else kwargs.get("device")
        if isinstance(src, torch.Tensor) and dst is not None and torch.device(dst).type != src.device.type:
            to_host = torch.device(dst).type == "cpu"
            if to_host or not (kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True)):
                return f"copy {src.device.type} -> {torch.device(dst).type}" + ("" if to_host else " (blocking)")
    return None


def _in_frame(function: str, filename: str) -> bool:
    """Whether ``slime_rc/correction/<filename>``'s ``function`` is on the stack."""
    frame = sys._getframe(1)
    suffix = os.path.join("slime_rc", "correction", filename)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(suffix):
            return True
        frame = frame.f_back
    return False


class HostReads(TorchDispatchMode):
    """Counts host synchronisations while active: ``count``, ``events`` ``[(what, op, where)]``, ``report()``."""

    def __init__(self, stack_depth: int = 4):
        super().__init__()
        self.events: List[Tuple[str, str, str]] = []
        self.stack_depth = stack_depth
        self._patched = {}

    @property
    def count(self) -> int:
        return len(self.events)

    def by_kind(self) -> Counter:
        return Counter(what for what, _, _ in self.events)

    def report(self) -> str:
        lines = [f"{self.count} host synchronisation(s):"]
        for what, op, where in self.events:
            lines.append(f"  {what} [{op}]\n{where}")
        return "\n".join(lines)

    def _record(self, what: str, op: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-3] if "host_reads.py" not in f.filename
                  and "_python_dispatch" not in f.filename and "torch/" not in f.filename][-self.stack_depth:]
        where = "".join(f"      {f.filename}:{f.lineno} {f.name}: {f.line}\n" for f in frames)
        self.events.append((what, op, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why and not _in_frame("_gather_header", "reducer.py"):
            # (the reducer's agreement header is CPU tensors over a gloo group: host memory, never a device)
            self._record(why, str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def wrapped(t, *a, _original=original, _name=name, **k):
                if not _in_frame("_gather_header", "reducer.py"):
                    self._record(f"Tensor.{_name}() (device->host copy)", f"Tensor.{_name}")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        return super().__exit__(*exc)


def innermost_project_frame() -> str:
    """``file:line`` of the innermost frame of slime-rc's code (``slime_rc``, ``custom_tis``; not the testing
    helpers) on the current stack, or ``"?"``."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if ("/slime_rc/" in name or "/custom_tis/" in name) and "/testing/" not in name:
            return f"{name}:{frame.lineno}"
    return "?"


class KernelsFrom(TorchDispatchMode):
    """Counts the non-view ops launched from the files whose path contains one of ``parts`` (e.g.
    ``("slime_rc/slime/", "custom_tis/")``): ``ops`` holds ``(op, file:line)``.  A fixed count whatever the number
    of samples shows that no per-sample loop launches kernels."""

    def __init__(self, parts):
        super().__init__()
        self.parts = tuple(parts)
        self.ops: List[Tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            where = innermost_project_frame()
            if any(part in where for part in self.parts):
                self.ops.append((str(func), where))
        return func(*args, **(kwargs or {}))
