"""Megatron's zigzag context-parallel layout, as slime lays out sequences and response log-probs -- the one copy.

Everything in slime-rc that needs to know which positions a CP rank holds asks this module: the slime adapters
(``custom_tis``), the Megatron loss and the TIS-function bridge (``slime_rc.megatron.loss``), the CP core attention
(``slime_rc.demo.cp_attention.zigzag_positions``), the micro-batch sharding
(``slime_rc.demo.model.shard_micro_batch``) and the trainer (``slime_rc.demo.train``).

The layout (slime's ``get_batch`` / ``cp_utils.slice_with_cp`` / ``get_logits_and_tokens_offset_with_cp``):

* a sequence of ``total_length`` positions is padded at its end to ``2 * cp_size * chunk`` positions, with
  ``chunk = ceil(total_length / (2 * cp_size))``; CP rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r``
  (this balances causal attention work), in that order.  Without CP (``cp_size == 1``) the sequence is not padded;
* a packed micro-batch concatenates each sequence's two chunks on every rank; the local stream may then be padded
  at its end (:func:`stream_padding`: slime pads to a multiple of ``tp * pad_multiplier``, which sequence
  parallelism needs) -- an extra padding segment appended to ``cu_seqlens``.  The *global* ``cu_seqlens`` of the
  packed stream are the local ones times ``cp_size`` (:func:`packed_cu_seqlens`);
* response log-prob ``j`` (0-based) is predicted by the logits at position ``prompt_length - 1 + j``, where
  ``prompt_length = total_length - response_length``; a rank holds the response log-probs whose position lies in
  its chunks, in increasing order of ``j`` (:func:`zigzag_response_indices`).
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import List, Sequence, Tuple

import torch

from slime_rc.correction.packed import token_sequence_ids, upload


def _check_rank(cp_size: int, cp_rank: int) -> None:
    if not (isinstance(cp_size, int) and cp_size >= 1):
        raise ValueError(f"cp_size={cp_size!r} must be an int >= 1 (the context-parallel world size)")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")


def zigzag_chunk_size(total_length: int, cp_size: int) -> int:
    """``ceil(total_length / (2 * cp_size))``: the positions of one of a sequence's ``2 * cp_size`` chunks."""
    if total_length < 0:
        raise ValueError(f"total_length={total_length} must be >= 0")
    return -(-int(total_length) // (2 * cp_size))


def zigzag_padded_length(total_length: int, cp_size: int) -> int:
    """The sequence's length after slime's per-sequence CP padding (``total_length`` itself without CP)."""
    if cp_size == 1:
        return int(total_length)
    return 2 * cp_size * zigzag_chunk_size(total_length, cp_size)


def zigzag_token_positions(total_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions (int64, increasing, in the rank's local order) of the padded sequence that ``cp_rank`` holds:
    chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``.  Positions ``>= total_length`` are padding.
    ``2 * chunk`` entries under CP, ``total_length`` without."""
    _check_rank(cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(int(total_length), dtype=torch.int64, device=device)
    c = zigzag_chunk_size(total_length, cp_size)
    second = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.int64, device=device),
                      torch.arange(second * c, (second + 1) * c, dtype=torch.int64, device=device)])


def packed_zigzag_positions(lengths: Sequence[int], cp_size: int, cp_rank: int,
                            device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """For a packed micro-batch of sequences of ``lengths`` (unpadded): the sequence id and the position inside its
    (padded) sequence of every token ``cp_rank`` holds, in the local packed order.  Both int64 ``[T_local]``."""
    _check_rank(cp_size, cp_rank)
    seq_ids, positions = [], []
    for i, n in enumerate(int(x) for x in lengths):
        pos = zigzag_token_positions(n, cp_size, cp_rank, device)
        positions.append(pos)
        seq_ids.append(torch.full((pos.numel(),), i, dtype=torch.int64, device=device))
    if not positions:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty.clone()
    return torch.cat(seq_ids), torch.cat(positions)


def stream_padding(local_length: int, multiple: int, cp_size: int = 1) -> int:
    """Tokens to append to a rank's packed stream of ``local_length`` tokens so that it is a multiple of
    ``multiple`` (slime: ``tp * pad_multiplier``; sequence parallelism needs a multiple of ``tp``).

    Under CP the padding segment is itself laid out in zigzag (its global length is ``padding * cp_size``, which
    megatron's RoPE and TE split into ``2 * cp_size`` chunks), so the padding is kept even: the multiple used is
    ``lcm(multiple, 2)``.  (slime's ``pad_multiplier`` of 128 is even, so this is slime's padding.)"""
    if not (isinstance(multiple, int) and multiple >= 1):
        raise ValueError(f"multiple={multiple!r} must be an int >= 1 (e.g. the tensor-parallel size under "
                         f"sequence parallelism, 1 for no stream padding)")
    if cp_size > 1:
        multiple = multiple * 2 // math.gcd(multiple, 2)
    return (-int(local_length)) % multiple


def packed_cu_seqlens(lengths: Sequence[int], cp_size: int, padding: int = 0, device=None) -> torch.Tensor:
    """The *global* ``cu_seqlens`` (int32) of a packed CP micro-batch: each sequence's padded length
    (:func:`zigzag_padded_length`), plus a last segment of ``padding * cp_size`` for the stream padding of every
    rank (slime: local ``cu_seqlens`` times ``cp_size``).  Summed on the host, uploaded once to ``device``."""
    from slime_rc.correction.packed import upload
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + zigzag_padded_length(int(n), cp_size))
    if padding:
        cu.append(cu[-1] + int(padding) * cp_size)
    return upload(cu, torch.int32, "cpu" if device is None else device)


def response_positions(positions: torch.Tensor, total_length: int, response_length: int):
    """``(holds, j)`` for token ``positions`` of one sequence: response log-prob ``j`` sits at position
    ``prompt_length - 1 + j`` (it scores token ``prompt_length + j``), so ``j = position - (total - response - 1)``;
    ``holds`` marks the positions with ``0 <= j < response_length``."""
    j = positions - (total_length - response_length - 1)
    return (j >= 0) & (j < response_length), j


def zigzag_response_indices(total_length: int, response_length: int, cp_size: int, cp_rank: int,
                            device=None) -> torch.Tensor:
    """Indices ``j`` (int64, increasing) of the response log-probs held by ``cp_rank``."""
    if not 0 <= response_length <= total_length:
        raise ValueError(f"response_length={response_length} must lie in [0, total_length={total_length}]")
    _check_rank(cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(response_length, dtype=torch.int64, device=device)
    _, runs = response_runs(total_length, response_length, cp_size, cp_rank)
    # at most two ranges of j (one per chunk): host arithmetic, no mask indexing
    parts = [torch.arange(j, j + n, dtype=torch.int64, device=device) for _, j, n in runs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


def response_runs(total: int, response: int, cp_size: int, cp_rank: int) -> Tuple[int, List[Tuple[int, int, int]]]:
    """Where ``cp_rank`` holds a sample's response log-probs, in Python ints (no tensor, no host read):
    ``(local positions, [(local position, response index j, length), ...])``, at most two runs (one per zigzag
    chunk), in the rank's local order.  The same layout as :func:`zigzag_token_positions` and
    :func:`response_positions` (log-prob ``j`` sits at position
    ``total - response - 1 + j``), as runs of consecutive tokens instead of per-token index tensors."""
    if not (isinstance(cp_size, int) and cp_size >= 1) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_size={cp_size!r}, cp_rank={cp_rank!r}: need an int cp_size >= 1 and 0 <= cp_rank < "
                         f"cp_size")
    if cp_size == 1:
        local, chunks = total, ((0, total, 0),)
    else:
        c = zigzag_chunk_size(total, cp_size)
        second = 2 * cp_size - 1 - cp_rank
        local, chunks = 2 * c, ((cp_rank * c, (cp_rank + 1) * c, 0), (second * c, (second + 1) * c, c))
    first = total - response - 1  # the position of log-prob 0
    runs = []
    for lo, hi, at in chunks:
        start, end = max(lo, first), min(hi, first + response)
        if end > start:
            runs.append((at + start - lo, start - first, end - start))
    return local, runs


def expand_runs(starts: Sequence[Sequence[int]], lengths: Sequence[int], n: int, device, *, width: int,
                constant: int = 0) -> torch.Tensor:
    """``[n, width]`` int64 index tensors for runs of consecutive tokens: the ``i``-th token of run ``r`` holds
    ``starts[r][c] + i`` in column ``c``, or ``starts[r][c]`` in the last ``constant`` columns (such as the run's
    sample).  Built on ``device`` from O(runs) Python ints with one upload and no host read: each token's run by
    ``packed.token_sequence_ids`` over the runs' boundaries (the last table column), then one row gather."""
    k = width
    stepping = k - constant
    rows, total = [], 0
    for row, length in zip(starts, lengths):
        rows.append([s - total for s in row[:stepping]] + list(row[stepping:]) + [total])
        total += length
    if total != n:
        raise ValueError(f"runs of {total} tokens for {n} tokens")
    table = upload(rows + [[0] * k + [n]], torch.int64, device).reshape(-1, k + 1)  # last row: the end boundary
    base = table[:-1, :k].index_select(0, token_sequence_ids(table[:, k], n))
    step = base[:, :stepping] + torch.arange(n, dtype=torch.int64, device=base.device)[:, None]
    return torch.cat([step, base[:, stepping:]], 1) if constant else step


class ResponseLayout:
    """slime's samples as one CP rank holds them: THE representation of slime's batch that the custom loss
    (``slime_rc.slime.policy_loss``), the TIS functions (``slime_rc.slime.tis_contract``) and the TIS-function bridge
    (``slime_rc.megatron.loss``) share -- per-sample Python ints in, packed-token index tensors out.

    Sample ``i`` has ``totals[i]`` positions; its last ``responses[i]`` tokens are the response, scored by the
    log-probs at positions ``total - response - 1 + j``.  This rank's packed stream holds ``local_lengths[i]``
    positions of it (:func:`response_runs`) and ``counts[i]`` of its response log-probs, as ``runs``: ``(sample,
    stream row, response position j, count)`` in stream order, at most two per sample.  ``n_tokens`` = the packed
    response tokens (``sum(counts)``).  Host arithmetic only: no tensor until :meth:`index`."""

    def __init__(self, totals: Sequence[int], responses: Sequence[int], cp_size: int = 1, cp_rank: int = 0):
        self.totals, self.responses = [int(t) for t in totals], [int(r) for r in responses]
        self.cp_size, self.cp_rank = cp_size, cp_rank
        self.local_lengths: List[int] = []
        self.counts: List[int] = []
        self.runs: List[Tuple[int, int, int, int]] = []
        row0 = 0
        for i, (total, response) in enumerate(zip(self.totals, self.responses)):
            local, held = response_runs(total, response, cp_size, cp_rank)
            self.runs += [(i, row0 + at, j, n) for at, j, n in held]
            self.counts.append(sum(n for _, _, n in held))
            self.local_lengths.append(local)
            row0 += local
        self.n_tokens = sum(self.counts)

    def index(self, device, *bases: Sequence[int], rows: bool = True) -> torch.Tensor:
        """``[n_tokens, k]`` int64 on ``device``, one row per held response token in packed order: its stream row
        (when ``rows``), ``base[sample] + j`` for each of ``bases`` (per-sample offsets, e.g. where the sample's
        response starts in a concatenation of per-sample tensors; ``[0] * B`` gives ``j`` itself), and its sample.
        One upload (:func:`expand_runs`), no host read."""
        starts = [((row,) if rows else ()) + tuple(b[i] + j for b in bases) + (i,) for i, row, j, _ in self.runs]
        return expand_runs(starts, [n for *_, n in self.runs], self.n_tokens, device,
                           width=int(rows) + len(bases) + 1, constant=1)

    def cu_seqlens(self, device) -> torch.Tensor:
        """``[B + 1]`` int64: the packed response tokens' sequence boundaries."""
        return upload(list(accumulate(self.counts, initial=0)), torch.int64, device)

    def describe(self, flat_index: int) -> str:
        """``sample i, response token j`` of packed index ``flat_index`` (Python ints only)."""
        for sample, _, j, n in self.runs:
            if flat_index < n:
                return f"sample {sample}, response token {j + flat_index}"
            flat_index -= n
        raise IndexError("packed index past this rank's tokens")


def zigzag_slice(values: torch.Tensor, total_length: int, response_length: int, cp_size: int,
                 cp_rank: int) -> torch.Tensor:
    """This rank's part of a full per-response-token tensor ``[response_length]``."""
    if values.shape[0] != response_length:
        raise ValueError(f"expected {response_length} response values, got {values.shape[0]}")
    return values[zigzag_response_indices(total_length, response_length, cp_size, cp_rank, values.device)]
