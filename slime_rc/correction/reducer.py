"""The one place that talks to other ranks.

A correction call first makes every rank agree on what it is about to reduce, then hands the reducer two kinds of
O(B)-sized statistics, never per-token tensors:

0. ``agree(what, settings, n_sequences)``: one fixed-size header per rank (a fingerprint of the settings, the
   number of sequences, which sequence group it belongs to; :mod:`slime_rc.correction.agreement`), gathered over
   the batch group on the **host** (a gloo group: CPU memory only, so nothing waits on a GPU stream).  Ranks with
   different settings, or CP peers with different numbers of sequences, all raise the same ``ValueError`` naming
   the ranks and what differs -- instead of meeting in a collective of mismatched sizes (gloo aborts, NCCL hangs)
   or, with equal sizes, silently adding statistics of two configurations.
1. ``combine_sequences(sums [B, k], maxes [B, m])``: per-sequence statistics of the ranks that hold pieces of
   the *same* sequences (the context-parallel group).  One ``all_gather``; every rank then reduces the gathered
   pieces in the same order, so all ranks of the group hold bit-identical per-sequence statistics.
2. ``reduce_totals(sums, maxes)``: batch totals (counts, sums, histogram bins) and batch extremes over every rank
   holding part of the batch (data-parallel x context-parallel).  One ``all_reduce(SUM)``: the extremes travel as
   one row per rank (``[world, m]``, zeros elsewhere, so the sum is exact) and each rank takes the rows' maximum.

So a call of the engine costs at most 3 collectives however many sequences it holds (2 without CP), the header
included.  Sequence-level totals must be counted once per sequence, not once per CP rank: ``counts_sequences`` is
True on exactly one rank of each context-parallel group.

Outside the engine, the once-per-step reduction of a TIS function's metrics sums named values here too
(:func:`sum_named_values`).  Which groups a Megatron job uses is the Megatron integration's business
(:mod:`slime_rc.megatron.reducers` builds reducers from megatron-core's ``parallel_state``): this module knows
process groups, not Megatron.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from slime_rc.correction import agreement


class LocalReducer:
    """Single process: statistics are already global.  Also the base class (no collectives)."""

    counts_sequences = True

    def __init__(self):
        self.num_collectives = 0

    def agree(self, what: str, settings: Any, n_sequences: int) -> None:
        """One process agrees with itself."""

    def combine_sequences(self, sums: torch.Tensor, maxes: torch.Tensor):
        return sums, maxes

    def reduce_totals(self, sums: torch.Tensor, maxes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return sums, maxes

    def sum_totals(self, totals: torch.Tensor) -> torch.Tensor:
        return totals


class DistributedReducer(LocalReducer):
    """Reduction over process groups.

    ``sequence_group``: ranks that hold pieces of the same sequences (megatron-core's context-parallel group);
    None or a group of size 1 when sequences are not split.  ``batch_group``: ranks over which the batch is spread
    and over which metrics and batch normalization are global (the data-parallel x context-parallel group);
    None when only the sequence group matters (then totals are reduced over the sequence group).
    ``check_ranks``: exchange the agreement header at each :meth:`agree` (one small host-side collective; see the
    module docstring).  False skips it: ranks that disagree then fail as the collectives do.
    """

    def __init__(self, sequence_group=None, batch_group=None, *, check_ranks: bool = True):
        super().__init__()
        self.check_ranks = check_ranks
        self.sequence_group = sequence_group
        self.sequence_world = dist.get_world_size(sequence_group) if sequence_group is not None else 1
        self.batch_group = batch_group if batch_group is not None else sequence_group
        self.batch_world = dist.get_world_size(self.batch_group) if self.batch_group is not None else 1
        self.counts_sequences = sequence_group is None or dist.get_rank(sequence_group) == 0
        # which CP group this rank belongs to, as every rank can name it: its lowest global rank
        self.sequence_key = (min(dist.get_process_group_ranks(sequence_group)) if sequence_group is not None
                             else dist.get_rank())
        _collectives_untraced()

    def agree(self, what, settings, n_sequences):
        """Raise the same ``ValueError`` on every rank of the batch group when their settings or (within a CP
        group) their numbers of sequences differ.  One host-side all_gather of 5 int64 per rank; a second one,
        of the settings themselves, only when the fingerprints differ (to name the keys)."""
        if not self.check_ranks or self.batch_world == 1:
            return
        group = host_group(self.batch_group)
        if group is None:
            return
        headers = _gather_header(agreement.header(settings, n_sequences, self.sequence_key, dist.get_rank()),
                                 group, self.batch_world)
        self.num_collectives += 1
        fingerprints = {h[agreement.FINGERPRINT] for h in headers}
        settings_of = None
        if len(fingerprints) > 1 and len({h[agreement.PROTOCOL] for h in headers}) == 1:
            settings_of = [None] * self.batch_world
            dist.all_gather_object(settings_of, agreement.settings_dict(settings), group=group)
        message = agreement.disagreement(what, headers, settings_of)
        if message is not None:
            raise ValueError(message)

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

    def reduce_totals(self, sums, maxes):
        if self.batch_world == 1:
            return sums, maxes
        n, m = sums.numel(), maxes.numel()
        rows = torch.zeros(self.batch_world, m, dtype=sums.dtype, device=sums.device)
        rows[dist.get_rank(self.batch_group)] = maxes  # x + 0 + ... + 0 == x exactly (-inf and NaN included)
        packed = torch.cat([sums, rows.reshape(-1)])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.batch_group)
        self.num_collectives += 1
        return packed[:n], packed[n:].view(self.batch_world, m).amax(0) if m else maxes

    def sum_totals(self, totals):
        if self.batch_world == 1:
            return totals
        totals = totals.clone()
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.batch_group)
        self.num_collectives += 1
        return totals


_COLLECTIVES = ("combine_sequences", "reduce_totals", "sum_totals")


@functools.lru_cache(maxsize=None)  # once per process
def _collectives_untraced() -> None:
    """``torch.compiler.disable`` on :class:`DistributedReducer`'s collectives, once, at its first instance: the
    compiled engine (``compiled.py``) breaks its graph there and the collectives run eagerly between its graphs.
    Not at import: ``torch.compiler.disable`` imports ``torch._dynamo`` (~1.1 s of the ~2.2 s that ``import
    slime_rc`` took), which a process that never reduces across ranks (the CLI, a launch refused, the tools) need
    not pay; a compiled call that reduces across ranks is handed an instance, so it comes after this."""
    for name in _COLLECTIVES:
        setattr(DistributedReducer, name, torch.compiler.disable(getattr(DistributedReducer, name)))


_HOST_GROUPS: Dict[Tuple[int, ...], Any] = {}
_warned_no_host_group = False


def host_group(group):
    """A process group over the ranks of ``group`` that takes CPU tensors: ``group`` itself when its backend is
    gloo (or a mixed ``cpu:gloo,cuda:nccl`` one), else a gloo mirror made once per set of ranks by those ranks only
    (``use_local_synchronization``: every CP group can make its own, in any order).  None, with one warning, when
    no such group can be made (then :meth:`DistributedReducer.agree` checks nothing)."""
    global _warned_no_host_group
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _HOST_GROUPS:
        try:
            _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        except Exception as e:  # noqa: BLE001 - a build without gloo: say so once and go on unchecked
            _HOST_GROUPS[ranks] = None
            if not _warned_no_host_group:
                _warned_no_host_group = True
                warnings.warn(f"slime-rc: no gloo group over ranks {list(ranks)} ({e}); ranks are not checked for "
                              f"matching settings before the correction's collectives", UserWarning, stacklevel=3)
    return _HOST_GROUPS[ranks]


def _gather_header(words: List[int], group, world: int) -> List[List[int]]:
    """Every rank's header, in group order.  Host memory only (CPU tensors over a gloo group): it reads nothing
    from a device, so :class:`slime_rc.testing.host_reads.HostReads` does not count it."""
    mine = torch.tensor(words, dtype=torch.int64)  # host: metadata for a gloo group, never on a device
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def as_reducer(reducer: Optional[LocalReducer]) -> LocalReducer:
    return LocalReducer() if reducer is None else reducer


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group) -> int:
    """The number of ranks of ``group`` (1 for None or when torch.distributed is not initialized)."""
    return dist.get_world_size(group) if group is not None and distributed() else 1


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
