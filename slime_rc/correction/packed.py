"""Packed-sequence helpers: B variable-length sequences laid end to end in 1-D tensors of N tokens.

``cu_seqlens`` (int64, ``[B+1]``, non-decreasing, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == N``) marks where
each sequence starts; sequence ``i`` owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]``.  Every helper here is
vectorized over sequences (no Python loop over B) and free of ``torch.distributed``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the caller (``slime_rc.correction.compiled``): the helpers that shape
    their work for eager kernels (copies in pieces, ``out=`` buffers, a matrix for small batches) then take the one
    form the compiler fuses best."""
    return torch.compiler.is_compiling()


def process_cached(cache: dict, key, limit: int, build: Callable[[], Any]):
    """``cache[key]``, built by ``build()`` on a miss (the cache emptied once it holds ``limit`` entries): the hot
    path's process-wide caches of small constant tensors (metric plans, bounds, quantile grids).  While compiled
    (:func:`tracing`), ``build()`` without the cache: the value is built into the graph, as a lookup in a
    process-wide cache would make dynamo guard on the cache's contents (and give cached tensors' sizes symbols that
    it then tied to the batch's): another entry, or the first one, would have made the graph compile again."""
    if tracing():
        return build()
    value = cache.get(key)
    if value is None:
        if len(cache) >= limit:
            cache.clear()
        value = cache[key] = build()
    return value


def cu_seqlens_from_lengths(lengths, device=None) -> torch.Tensor:
    """``[3, 1, 2]`` -> ``tensor([0, 3, 4, 6])`` (int64)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64, device=device)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Python numbers (host metadata such as slime's per-sample lengths) -> a tensor on ``device`` without stalling
    a GPU stream: on CUDA through pinned memory with a non-blocking copy (a plain ``torch.tensor(..., device=cuda)``
    is a blocking copy that waits for every queued kernel); compiled, a constant of the graph.  The one sanctioned
    host->device upload of the hot path (``slime_rc.testing.host_reads`` does not count it)."""
    device = torch.device(device)
    if tracing():  # a constant of the compiled graph (dynamo has no pinned memory: pin_memory fails while tracing)
        return torch.tensor(values, dtype=dtype, device=device)
    t = torch.tensor(values, dtype=dtype)  # host: staged here, then copied without blocking
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums, accumulated in float64: ``[N] -> [B]``.

    Uses one prefix sum and two gathers: contiguous segments make a scatter unnecessary, and float64
    accumulation keeps the difference of prefix sums accurate to ~1e-12 of the batch total.
    """
    prefix = torch.zeros(values.numel() + 1, dtype=torch.float64, device=values.device)
    torch.cumsum(values, 0, dtype=torch.float64, out=prefix[1:])
    return prefix[cu_seqlens[1:]] - prefix[cu_seqlens[:-1]]


# Tokens per block of the blocked reductions below.
_BLOCK = 64


def segment_sums(columns: List[torch.Tensor], cu_seqlens: torch.Tensor, counts=(), exact=None) -> torch.Tensor:
    """Per-sequence sums of several ``[N]`` columns at once: ``k x [N] -> [k, B]`` float64.

    Up to ``MATRIX_TOKENS`` tokens (a micro-batch: kernel launches are the cost), the columns are copied into one
    ``[k, N + 1]`` float64 matrix, prefix-summed along the tokens in one op and read at the boundaries: a handful
    of ops whatever k.  Past it (memory traffic is the cost), each column is reduced where it lies, without a
    ``k x N`` copy (fresh memory that size costs page faults on a CPU) and without a sequential scan of every
    token: block sums of 64 tokens (counts -- bool columns and the float 0/1 columns that are (``is``) one of
    ``counts`` -- in float32, exact; the rest in float64), prefix-summed in float64; sequence ``i`` from ``c0`` to
    ``c1`` adds the blocks wholly inside it, the tail of ``c0``'s block and the head of ``c1``'s block (or, when
    both boundaries share a block, the tokens between them), read from a ``[k, B, 64]`` gather.  A tensor given
    twice (one RS rule is also "any RS rule") is summed once.

    Exactness: float64 accumulation of the (at most float32) values either way (a float32 block sum is used for
    counts only), so permuting a sequence's tokens changes its sum by float64 roundings only; as with any prefix
    sum, a sequence's sum carries a rounding of ~1e-16 of the running total before it.  ``exact``: the value
    columns that stay float64 within the blocks while compiled (:func:`tracing`); when it is given, every other
    value column's 64-token blocks are then summed in float32 (a float64 block reduction costs inductor's C++ code
    ~8x a float32 one): for a same-sign column whose sums nothing subtracts from each other, a relative error below
    1e-6.
    """
    n, dev = columns[0].numel(), columns[0].device
    unique, slot = _distinct(columns)
    if not tracing() and n <= MATRIX_TOKENS:  # (compiled: one formula for every N, fused into the token pass)
        m = torch.empty(len(unique), n + 1, dtype=torch.float64, device=dev)
        m[:, :1].zero_()  # the rest is overwritten: zeroing it all would be one more pass over k x N
        for row, column in zip(m[:, 1:], unique):
            row.copy_(_as_values(column))
        torch.cumsum(m, 1, out=m)
        at = m.index_select(1, cu_seqlens)
        per_seq = at[:, 1:] - at[:, :-1]
    else:
        per_seq = _blocked_segment_sums(unique, cu_seqlens, counts, exact)
    if len(unique) == len(columns):
        return per_seq
    rows = per_seq.unbind()
    return torch.stack([rows[i] for i in slot])


def _distinct(columns: List[torch.Tensor]):
    """``(the distinct tensors, in first-seen order; for each column its index there)``, by identity (``is``, not
    ``id()``: torch.compile can follow the first, and would guard on the second's number)."""
    unique: List[torch.Tensor] = []
    slot: List[int] = []
    for c in columns:
        i = next((i for i, u in enumerate(unique) if u is c), len(unique))
        if i == len(unique):
            unique.append(c)
        slot.append(i)
    return unique, slot


# Up to this many tokens segment_sums prefix-sums a matrix copy of its columns (fewest ops); past it, block sums of
# each column where it lies (least memory traffic).
MATRIX_TOKENS = 1 << 16
# tokens per piece of a conversion to float64 (a multiple of the block)
_CHUNK_TOKENS = 1 << 16


def _pieces(x: torch.Tensor):
    """``x`` split for a conversion to float64: in pieces of ``_CHUNK_TOKENS`` on a CPU (a float64 copy of all N at
    once is fresh memory each call, page faults that cost more than the sum; a piece's copy is small and reused),
    whole on a GPU (each piece is a kernel launch; measured on an H100: 128 pieces a column made 8M tokens take
    48 ms, launch-bound, and the caching allocator reuses the whole copy anyway)."""
    if tracing() or x.device.type != "cpu" or x.numel() <= _CHUNK_TOKENS:  # compiled: no copy to make small
        return (x,)
    return x.split(_CHUNK_TOKENS)


def moments64(x: torch.Tensor, transform=None, square: bool = False):
    """``(sum, sum of squares or None)`` of ``transform(x)`` for ``[N]`` float32 values (or 0/1 flags: exact), each
    0-d float64: converted to float64 in pieces (:func:`_pieces`), once for both sums (a float32 square would
    round, a float64 one is exact).  ``transform`` (elementwise, float32 -> float32, such as ``abs`` or a clamp;
    None: none) is applied piece by piece: the sum of ``|log r|`` needs no ``[N]`` buffer of its own.  Compiled
    (:func:`tracing`): two float64 reductions, fused into the code that makes ``x``."""
    if tracing():  # compiled: two reductions fused with the code that makes x (no float64 buffer, no dot)
        d = (x if transform is None else transform(x)).double()  # squared in float64: exact, as eager
        return d.sum(), (d * d).sum() if square else None
    sums, squares = [], []
    for piece in _pieces(x):
        d = (piece if transform is None else transform(piece)).double()
        sums.append(d.sum())
        if square:
            squares.append(torch.dot(d, d))
    if len(sums) == 1:  # one piece: fewest ops
        return sums[0], squares[0] if square else None
    both = torch.stack(sums + squares).view(2 if square else 1, -1).sum(1)  # the pieces' sums added in float64
    return both[0], both[1] if square else None


def _as_values(column: torch.Tensor) -> torch.Tensor:
    # bool -> number through uint8: the same values, and vectorized kernels (bool's are not, on CPU)
    return column.view(torch.uint8) if column.dtype == torch.bool else column


def _blocked_segment_sums(columns: List[torch.Tensor], cu_seqlens: torch.Tensor, counts, exact) -> torch.Tensor:
    """:func:`segment_sums` past ``MATRIX_TOKENS``: ``k x [N] -> [k, B]`` float64 from block sums."""
    n, dev = columns[0].numel(), columns[0].device
    n_blocks = n // _BLOCK + 1  # the last block holds the N % 64 tokens past the whole blocks (maybe none)
    block_of = torch.div(cu_seqlens, _BLOCK, rounding_mode="floor")  # [B+1], each < n_blocks
    offset = cu_seqlens - block_of * _BLOCK
    first, last = block_of[:-1], block_of[1:]
    spans = last > first  # [B]: the sequence reaches past its first block
    position = torch.arange(_BLOCK, device=dev)
    at = (block_of[:, None] * _BLOCK + position).clamp_(max=n - 1).view(-1)  # [(B+1) * 64] token positions

    def in_float32(c):  # counts: exact in float32 (<= 64 per block); compiled, the values not `exact` too
        return c.dtype == torch.bool or any(c is f for f in counts) or \
            (exact is not None and tracing() and not any(c is f for f in exact))

    pieces = [_blocks_of_column(c, in_float32(c), n, at) for c in columns]
    block_sums, ends = (torch.stack(p) for p in zip(*pieces))  # [k, n_blocks], [k, B+1, 64]
    # [B, 64]: the tokens of its first / last block that belong to each sequence (all < N)
    in_first = (position >= offset[:-1, None]) & ((position < offset[1:, None]) | spans[:, None])
    in_last = (position < offset[1:, None]) & spans[:, None]
    inner = torch.maximum(last, first + 1)  # whole blocks first+1 .. last-1 (none unless the sequence spans)
    if tracing():  # torch.compile takes no out= into a slice
        before = torch.nn.functional.pad(torch.cumsum(block_sums, 1, dtype=torch.float64), (1, 0))
    else:
        before = torch.zeros(len(columns), n_blocks + 1, dtype=torch.float64, device=dev)  # [:, j]: blocks < j
        torch.cumsum(block_sums, 1, dtype=torch.float64, out=before[:, 1:])
    partial = (ends[:, :-1] * in_first).sum(2, dtype=torch.float64) + \
        (ends[:, 1:] * in_last).sum(2, dtype=torch.float64)
    return before.index_select(1, inner) - before.index_select(1, first + 1) + partial


def _blocks_of_column(column: torch.Tensor, float32: bool, n: int, at: torch.Tensor):
    """``([n_blocks] block sums, [B+1, 64] the block of each boundary)`` of one column, where it lies: the whole
    blocks as a ``[n // 64, 64]`` view, the last (partial) block on its own, summed in float32 if ``float32`` else
    in float64; ``at``: the token positions of the boundaries' blocks, clamped into ``[0, N)`` (the clamped ones are
    never among the tokens summed)."""
    values = _as_values(column)
    whole = n // _BLOCK * _BLOCK
    dtype = torch.float32 if float32 else torch.float64
    at_boundaries = values.index_select(0, at).view(-1, _BLOCK)
    if tracing():  # compiled: the whole blocks as a view (a padded copy would load through a mask, ~3x slower)
        body = values[:whole].view(-1, _BLOCK).sum(1, dtype=dtype)
        # the tail: the last 64 tokens (zeros before the first when N < 64), those past the whole blocks; one
        # formula for any N % 64 (a slice of N % 64 tokens would be compiled again for 0 and 1)
        last = torch.nn.functional.pad(values, (_BLOCK, 0))[-_BLOCK:]
        past = torch.arange(_BLOCK, device=values.device) >= _BLOCK - (n - whole)
        return torch.cat([body, (last * past).sum(dtype=dtype).reshape(1)]), at_boundaries
    # a reduction into another dtype converts its whole input first: in chunks, that copy stays small and reused
    body = [piece.view(-1, _BLOCK).sum(1, dtype=dtype) for piece in _pieces(values[:whole])]
    tail = values[whole:].sum(dtype=dtype).reshape(1)
    return torch.cat(body + [tail]), at_boundaries


def segment_max(values: torch.Tensor, sequence_of_tokens: torch.Tensor, n_seqs: int,
                empty: float = -torch.inf) -> torch.Tensor:
    """Per-sequence maxima ``[N] -> [B]`` (float64); an empty sequence gives ``empty`` (a value of the values'
    floating dtype, such as -inf).  ``sequence_of_tokens``: ``[N]`` integer, the sequence of each token
    (:func:`token_sequence_ids`).  Reduced in the values' dtype and converted after: a max rounds nothing, so the
    result is the same as over float64 copies, without an ``[N]`` float64 buffer."""
    out = torch.full((n_seqs,), empty, dtype=values.dtype, device=values.device)
    # scatter_reduce_ takes int64 indices only
    return out.scatter_reduce_(0, sequence_of_tokens.long(), values, "amax").double()


def token_sequence_ids(cu_seqlens: torch.Tensor, n_tokens: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``[B+1]`` boundaries -> ``[N]`` int32 sequence index of each token (no host read: the total is given);
    ``dtype=torch.int64`` for a caller that also scatters by it (``scatter_reduce_`` takes int64 only: built so
    directly, rather than converted after, it is one ``[N]`` buffer, not two).

    ``ids[t] = #{i >= 1 : cu_seqlens[i] <= t}``: a 1 added at each sequence end, then one prefix sum (an empty
    sequence repeats a boundary, whose 1s add up).  ``cu_seqlens`` must be well formed (non-decreasing, within
    ``[0, N]``).  Not ``repeat_interleave``: several times slower on a CPU.  int32 (B < 2**31): half the fresh memory
    of int64 (on a CPU, page faults are most of the cost) and a faster prefix sum; ``index_select`` takes it as is.
    """
    ids = torch.zeros(n_tokens + 1, dtype=dtype, device=cu_seqlens.device)
    ends = cu_seqlens[1:]
    ids.index_add_(0, ends, torch.ones((), dtype=dtype, device=ids.device).expand(ends.numel()))
    return torch.cumsum(ids, 0, dtype=dtype, out=ids)[:n_tokens]  # in place: no second [N] buffer


def broadcast_to_tokens(per_sequence: torch.Tensor, cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[B] -> [N]``: each sequence's value repeated over its tokens (one gather by :func:`token_sequence_ids`;
    a caller that broadcasts more than once computes the ids once and gathers with ``index_select`` itself)."""
    return per_sequence.index_select(0, token_sequence_ids(cu_seqlens, n_tokens))


def sequence_of_token(token_index: int, cu_seqlens: torch.Tensor) -> int:
    """The sequence that holds packed position ``token_index``."""
    return int(torch.searchsorted(cu_seqlens, torch.tensor([token_index], device=cu_seqlens.device),
                                  right=True)[0]) - 1


def check_packed_metadata(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens) -> torch.Tensor:
    """What the metadata shows (types, shapes, dtypes, devices) raises ``ValueError`` here, naming the argument, what
    it holds and what it should hold; returns ``cu_seqlens`` as a tensor (a list of ints is uploaded).  No host read:
    the values are :func:`packed_inputs`' to check."""
    for name, t in (("train_log_probs", train_log_probs), ("rollout_log_probs", rollout_log_probs)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape [N], got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D packed tokens [N], got shape {tuple(t.shape)}; "
                             f"flatten padded [B, T] batches and pass cu_seqlens")
        if t.dtype not in _FLOAT_INPUTS:
            raise ValueError(f"{name} has dtype {t.dtype}; pass floating-point log-probs")
    n = train_log_probs.numel()
    if rollout_log_probs.numel() != n:
        raise ValueError(f"rollout_log_probs has {rollout_log_probs.numel()} tokens but train_log_probs has {n}; "
                         f"both must hold the same packed tokens")
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dim() != 1 or loss_mask.numel() != n:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"loss_mask must be a 1-D tensor of {n} tokens (like the log-probs), got {shape}")
    if rollout_log_probs.device != train_log_probs.device:
        raise ValueError(f"rollout_log_probs is on {rollout_log_probs.device}, train_log_probs on "
                         f"{train_log_probs.device}; move them to one device")
    device = train_log_probs.device
    if loss_mask.device != device:
        raise ValueError(f"loss_mask is on {loss_mask.device}, the log-probs on {device}; move it to {device}")
    if not isinstance(cu_seqlens, torch.Tensor):
        try:
            cu_seqlens = upload(list(cu_seqlens), torch.int64, device)
        except (TypeError, ValueError):
            raise ValueError(f"cu_seqlens must be a tensor or a sequence of ints of shape [B+1], got "
                             f"{type(cu_seqlens).__name__}") from None
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be an integer tensor of shape [B+1], got shape {tuple(cu_seqlens.shape)} "
                         f"dtype {cu_seqlens.dtype}")
    if cu_seqlens.numel() == 1 and n:
        raise ValueError(f"cu_seqlens has 1 entry (no sequence) but the log-probs hold {n} tokens; cu_seqlens must "
                         f"be [B+1] boundaries from 0 to {n}")
    return cu_seqlens


def packed_inputs(train_log_probs, rollout_log_probs, loss_mask, cu_seqlens: torch.Tensor):
    """``(train fp32, rollout fp32, mask fp32 0/1, cu int64, bad_input)`` from inputs whose metadata
    :func:`check_packed_metadata` has checked; tensor operations only (the engine's compiled form traces it).

    What only the values show -- ``cu_seqlens`` not starting at 0, not ending at N, decreasing; a float loss mask
    with values other than 0 and 1 -- costs no host read: ``bad_input`` (0-d bool, set when malformed) goes to the
    caller (the engine sums it over ranks, so that every rank raises together, and adds it to its deferred checks),
    and the returned ``cu`` is clamped into ``[0, N]`` and made non-decreasing so that nothing downstream indexes out
    of bounds before the check fires.
    """
    n = train_log_probs.numel()
    device = train_log_probs.device
    given = cu_seqlens.to(device=device, dtype=torch.int64, non_blocking=True)
    # cu made safe to index with: clamped into [0, N], non-decreasing, from 0 to N.  It differs from the given
    # cu_seqlens exactly when those are malformed, which is the deferred check (no host read here).
    cu = given.clamp(0, n).cummax(0).values
    cu[:1].fill_(0), cu[-1:].fill_(n)
    bad = (cu != given).any() | (given[0] != 0)  # (the second: a single entry is both first and last)
    if loss_mask.dtype == torch.float32:
        mask = loss_mask.detach()
    elif loss_mask.is_floating_point():
        mask = loss_mask.detach().float()
    else:  # bool or integer: 0/1 by construction (bool) or read as "non-zero is a loss token" (integer)
        mask = (loss_mask != 0).view(torch.uint8).float()  # bool -> float through uint8: a vectorized copy
    if loss_mask.is_floating_point():
        # m^2 - m is 0 exactly for 0 and 1, NaN/inf for NaN/inf, non-zero otherwise: its squared sum finds them
        d = (mask * mask).sub_(mask)
        bad = bad | (torch.dot(d, d) != 0)
    # bf16/fp16 inputs are computed in fp32: exp() of a bf16 log-ratio is too coarse for weights near 1.
    train = train_log_probs.detach().float()
    rollout = rollout_log_probs.detach().float()
    return train, rollout, mask, cu, bad


def describe_bad_input(loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, n: int) -> str:
    """The message for malformed ``cu_seqlens`` / ``loss_mask`` values (slow path: reads the device freely)."""
    cu = cu_seqlens.to("cpu", torch.int64)
    if cu.numel() == 0 or int(cu[0]) != 0 or int(cu[-1]) != n:
        return (f"cu_seqlens must start at 0 and end at the token count {n}; got first="
                f"{int(cu[0]) if cu.numel() else None} last={int(cu[-1]) if cu.numel() else None} "
                f"(shape [B+1], B = number of sequences)")
    steps = cu[1:] - cu[:-1]
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0, 0])
        return (f"cu_seqlens must be non-decreasing; cu_seqlens[{i + 1}]={int(cu[i + 1])} < "
                f"cu_seqlens[{i}]={int(cu[i])}")
    if loss_mask.is_floating_point() and bool(((loss_mask != 0) & (loss_mask != 1)).any()):
        return "loss_mask must hold only 0 and 1 (or be bool); found other values"
    return "malformed cu_seqlens or loss_mask on another rank of the batch group (this rank's are well-formed)"


BAD_INPUT_SUMMARY = ("malformed packed input: cu_seqlens must start at 0, be non-decreasing and end at the token "
                     "count N, and a float loss_mask must hold only 0 and 1 (on this or another rank)")


def first_nonfinite(train: torch.Tensor, rollout: torch.Tensor, bad: torch.Tensor,
                    cu_seqlens: torch.Tensor) -> Optional[str]:
    """Describe the first non-finite loss token: which tensor, which value, sample and position."""
    idx = torch.nonzero(bad)
    if idx.numel() == 0:
        return None
    j = int(idx[0, 0])
    sample = sequence_of_token(j, cu_seqlens)
    which = "train_log_probs" if not bool(torch.isfinite(train[j])) else "rollout_log_probs"
    value = float((train if which == "train_log_probs" else rollout)[j])
    return (f"{which} is {value} at sample {sample}, position {j - int(cu_seqlens[sample])} "
            f"(packed index {j}); {int(idx.numel())} non-finite loss token(s) on this rank")
