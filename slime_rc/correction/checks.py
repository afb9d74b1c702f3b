"""Input checks that cost at most one host read per call: flags are collected on the device, read once at the end.

Reading a device value on the host (``bool(t)``, ``int(t)``, ``.item()``) stalls a GPU's stream until every queued
kernel has run.  The hot path (engine, policy losses, Megatron loss, slime adapters) therefore never branches on a
device value; what it must verify about values -- non-finite log-probs on loss tokens, malformed ``cu_seqlens``,
a loss mask that is not 0/1 -- goes into one :class:`DeferredChecks` as 0-d device flags:

* ``raise_if_any()`` with ``read=True`` (``on_nonfinite='error'``) stacks every flag and reads them with **one** host
  read; only when one is set does it spend more reads, on the slow path, to build the message (which tensor, which
  sample, which position) and raise ``ValueError``;
* with ``read=False`` (``on_nonfinite='reject'``, where non-finite values are rejected and counted on the device
  instead) the flags that remain -- malformed inputs, not data -- become ``torch._assert_async``: no host read; on
  the CPU it raises ``RuntimeError`` with the flag's fixed message at once, on a GPU it is a device-side assert.

A caller that runs several checked stages (the engine inside a policy loss) passes one instance down so that the
whole micro-batch still costs one read.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch


class DeferredChecks:
    """0-d device flags (non-zero = a problem) with, for each, a fixed summary and a function that describes it."""

    def __init__(self, read: bool = True):
        self.read = read
        self._flags: List[Tuple[torch.Tensor, str, Callable[[], str]]] = []

    def __len__(self) -> int:
        return len(self._flags)

    def add(self, bad: torch.Tensor, summary: str, describe: Callable[[], str] = None) -> None:
        """``bad``: a 0-d bool or count tensor, non-zero when the problem occurs.  ``summary``: the message when no
        host read is allowed (names the argument and the fix).  ``describe``: builds the full message on the slow
        path (it may read the device freely); defaults to ``summary``."""
        self._flags.append((bad.reshape(()), summary, describe or (lambda: summary)))

    def raise_if_any(self) -> None:
        """One host read (none with ``read=False``, none when nothing was added); ``ValueError`` naming the first
        problem found."""
        flags, self._flags = self._flags, []
        if not flags:
            return
        if not self.read:
            for bad, summary, _ in flags:
                torch._assert_async(bad == 0, summary)
            return
        stacked = torch.stack([bad.to(torch.float64) for bad, _, _ in flags])
        if not bool(stacked.any()):  # the one host read
            return
        first = int(torch.nonzero(stacked)[0, 0])  # slow path: raising anyway
        raise ValueError(flags[first][2]())
