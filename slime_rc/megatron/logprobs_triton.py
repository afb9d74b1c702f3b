"""Fused Triton kernels for :func:`slime_rc.megatron.logprobs.vocab_parallel_log_probs`: the same log-probs, entropy
and gradients as the eager ``_LogProbsEntropy``, with one read of the logits forward and one read plus one write
backward.

Notation as in ``logprobs.py``: this rank holds ``rows [R, V_local]`` (its vocabulary shard ``[vocab_start,
vocab_start + V_local)``), ``z = rows * inv_t`` (``inv_t = 1 / temperature``), ``m = max_v z_v`` over the whole
vocabulary, ``s = z - m``, ``S = sum_v exp(s_v)``:

    log p(t) = s_t - log S          H = log S - W / S,   W = sum_v exp(s_v) s_v

**Forward** (``_stats_kernel``, online softmax).  One program per row loops over the row in tiles and keeps, per
group of ``GROUP`` adjacent columns (one thread's 16-byte load), a running max ``m_g``, ``S_g = sum exp(z - m_g)``
and ``W_g = sum exp(z - m_g) (z - m_g)``.  When a tile raises the max by ``d = m_new - m_g >= 0`` every old term is
scaled by ``exp(-d)`` and its ``(z - m_g)`` becomes ``(z - m_g) - d``:

    S_new = exp(-d) S_g + sum_tile exp(z - m_new)
    W_new = exp(-d) (W_g - d S_g) + sum_tile exp(z - m_new) (z - m_new)

The same rescaling merges statistics computed against different maxima — the groups at the end of the row, and the
TP shards (:func:`merge_partials`, :func:`combine_shards`): with ``m = max_k m_k`` and ``a_k = exp(m_k - m)``,

    S = sum_k a_k S_k            W = sum_k a_k (W_k + (m_k - m) S_k)

Under TP that is one MAX all-reduce of ``m`` and one SUM all-reduce of the stacked ``[S; W; s_t]`` (``s_t = z_t -
m`` on the shard holding the target, 0 elsewhere): the same two collectives as the eager path; TP=1 has none.  The
kernel also writes ``z_t`` and whether the target is in this shard, so the target logit costs one scalar load per
row, not a pass.  Logits of ``-inf`` (masked entries) add nothing to ``S`` or ``W`` (``0 log 0 = 0``), where the
eager path gives a NaN entropy.

**Backward** (``_grad_kernel``).  Saved per row: ``lse = m + log S`` and ``H``; per element, recomputed:

    log p = z - lse,   p = exp(log p)
    d/dlogits = g onehot(t) + p (c + gh log p),   g = dL/dlogp / T,  gh = -dL/dH / T,  c = gh H - g
    d/dlogits = g onehot(t) - g p                  (no gradient through the entropy)

written once in the logits' dtype (float32, bfloat16, float16; the arithmetic is float32).  No collective (the
forward's all-reduces have identity backwards, as in the eager path).

**Traffic** over ``[R, V_local]``, in passes of the logits' size: forward 1 read, backward 1 read + 1 write — 3 in
all, with or without the entropy's gradient, against the eager path's 14 (8 forward, 6 backward) or 17 (9 backward
with the entropy's gradient), and no float32 scratch of the vocabulary's size.  Autograd keeps the logits themselves
and ``[R]`` vectors.

**Design for H100/H200** (memory-bound: 3.35 / 4.8 TB/s, against ~33 G float32 instructions per ms): one program per
row, a loop over contiguous tiles (16-byte vectorized loads), float32 accumulation, no atomics.  The forward loop
reduces only within threads (per-group statistics, merged once per row): per-tile cross-thread reductions (three
shuffles-and-barriers per tile) held a bfloat16 forward to 2.5 TB/s on an H200, the group form reaches the copy's
4.1 TB/s.  The backward also splits a row across programs when there are few rows (:func:`_splits`); the forward
does not (merging the splits costs a launch, more than it saves at these widths: 73 against 32 us at R = 64,
V = 151936).  Measured on one H200 (triton 3.6, torch 2.11, two runs), entropy and its gradient: ``R = 8192, V =
151936`` bfloat16, forward 0.61-0.64 ms against the eager 22 ms, forward + backward 1.86-1.90 ms against 40-41 ms,
the kernels at 4.0-4.1 TB/s (forward) and 3.9 TB/s (backward, read + write) where a device copy moves 4.2 TB/s;
``R = 4096, V = 151936`` float32, forward + backward 1.88 ms against 16 ms.

Triton is imported lazily: this module imports without it (CI has no GPU and may have no Triton), and the kernels
are built on first use.  Under ``TRITON_INTERPRET=1`` — set before Triton is first imported — they run on CPU
tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch

from slime_rc.megatron.tensor_parallel import tensor_parallel

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tile widths (columns per loop step of one program): 2048 forward (4 warps: 16 columns a thread, two groups of 8 in
# bfloat16), 4096 backward (8 warps); the best of a sweep on an H200 at V_local = 151936 and 37984, within a few
# percent of 1024-8192 columns and 4-16 warps once the forward reduces within threads.
FWD_BLOCK_V = 2048
BWD_BLOCK_V = 4096
# Backward only: below this many rows a row is also split across programs (an H100/H200 has 132 SMs; a few waves of
# programs hide the tail), each split at least _MIN_TILES_PER_SPLIT tiles long.
_TARGET_PROGRAMS = 1024
_MIN_TILES_PER_SPLIT = 4
# exp(x) as one ex2.approx.ftz.f32 of x log2(e) (inline PTX) in the compiled kernels, flushing results below 2^-126
# to 0 (terms that small vanish beside S >= 1): tl.exp's ex2.approx.f32 adds a compare and two multiplies per element
# to handle subnormals, a fifth of the forward loop's instructions (12.5 a column with it; forward 4.1 against 3.6
# TB/s in bfloat16 on an H200).  The interpreter uses tl.exp.
FAST_EXP = True


@functools.lru_cache(maxsize=None)
def _triton():
    """``(triton, triton.language)``, or ``None`` when Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any failure to import (absent, broken install) means "not available"
        return None
    return triton, tl


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(rows: torch.Tensor) -> bool:
    """Whether the fused kernels can run on ``rows``: Triton imports, ``rows`` is a contiguous 2-D CUDA tensor of
    float32 / bfloat16 / float16 with at least one column."""
    return (isinstance(rows, torch.Tensor) and rows.device.type == "cuda" and rows.dim() == 2 and rows.dtype in _DTYPES
            and rows.is_contiguous() and rows.shape[-1] >= 1 and _triton() is not None)


def _kernels():
    """The Triton kernels ``{"stats": ..., "grad": ...}``, built once per interpreter mode (``triton.jit`` picks the
    interpreter when ``TRITON_INTERPRET`` is set at decoration; it must also be set before Triton is first imported,
    which builds ``tl.max`` / ``tl.sum`` for one mode or the other)."""
    return _build_kernels(_interpreting())


@functools.lru_cache(maxsize=None)
def _build_kernels(interpret: bool):
    del interpret  # the cache key
    mods = _triton()
    if mods is None:
        raise RuntimeError("slime_rc.megatron.logprobs_triton needs Triton (pip install triton)")
    triton, tl = mods

    @triton.jit
    def _stats_kernel(x_ptr, tgt_ptr, out_ptr, n_rows, n_cols, vocab_start, inv_t, BLOCK_V: tl.constexpr,
                      GROUP: tl.constexpr, WITH_ENTROPY: tl.constexpr, FAST_EXP: tl.constexpr):
        """Program r: ``out[0|1|2|3|4, r] = m, S, W, z_t, in_shard`` of row r of this shard (module docstring):
        ``z_t`` is 0 and ``in_shard`` 0.0 when the target is not in the shard; ``W`` is 0 without
        ``WITH_ENTROPY``; ``m`` is the lowest finite float32 when the row holds no finite logit.

        Each tile is ``[BLOCK_V / GROUP, GROUP]``: ``GROUP`` adjacent columns (one 16-byte load) are one thread's,
        and each group keeps its own running ``m, S, W`` across the tiles, so the loop reduces only within threads
        (no shuffles, shared memory or barriers per tile); the groups are merged once at the end."""
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * n_cols  # int64: R * V_local passes 2**31 for long micro-batches
        offs = tl.arange(0, BLOCK_V // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        # the running max starts at the lowest finite float, not -inf: m_g - m_new and (m_g - m_new) S_g stay finite
        # (no inf - inf, no inf * 0) while a group has seen only -inf (masked logits, the tail past n_cols)
        lowest = -3.4028234663852886e38
        m_g = tl.full([BLOCK_V // GROUP], lowest, tl.float32)
        s_g = tl.zeros([BLOCK_V // GROUP], tl.float32)
        w_g = tl.zeros([BLOCK_V // GROUP], tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m_g, tl.max(z, axis=1))
            s = z - m_new[:, None]
            if FAST_EXP:  # exp(x) = 2^(x log2 e), see FAST_EXP
                alpha = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r",
                                                  [(m_g - m_new) * 1.4426950408889634], dtype=tl.float32,
                                                  is_pure=True, pack=1)
                e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [s * 1.4426950408889634],
                                              dtype=tl.float32, is_pure=True, pack=1)
            else:
                alpha = tl.exp(m_g - m_new)  # exp(-d), d = the rise of the group's max
                e = tl.exp(s)  # 0 at -inf logits
            if WITH_ENTROPY:
                # W_new = exp(-d) (W_g - d S_g) + sum e s; a -inf logit adds 0 log 0 = 0: s clamped to a finite value
                # so that e * s is 0 * finite, not 0 * -inf (a NaN logit still gives NaN through S)
                w_g = alpha * (w_g + (m_g - m_new) * s_g) + tl.sum(e * tl.maximum(s, lowest), axis=1)
            s_g = alpha * s_g + tl.sum(e, axis=1)
            m_g = m_new
        m = tl.max(m_g, axis=0)
        a = tl.exp(m_g - m)
        tl.store(out_ptr + row, m)
        tl.store(out_ptr + n_rows + row, tl.sum(a * s_g, axis=0))
        w_row = tl.sum(a * w_g, axis=0)  # 0 without WITH_ENTROPY
        if WITH_ENTROPY:
            w_row = tl.sum(a * (w_g + (m_g - m) * s_g), axis=0)
        tl.store(out_ptr + 2 * n_rows + row, w_row)
        local = tl.load(tgt_ptr + row).to(tl.int64) - vocab_start
        in_shard = (local >= 0) & (local < n_cols)
        z_t = tl.load(base + local, mask=in_shard, other=0.0).to(tl.float32) * inv_t
        tl.store(out_ptr + 3 * n_rows + row, tl.where(in_shard, z_t, 0.0))
        tl.store(out_ptr + 4 * n_rows + row, in_shard.to(tl.float32))

    @triton.jit
    def _grad_kernel(x_ptr, grad_ptr, tgt_ptr, lse_ptr, g_ptr, c_ptr, gh_ptr, n_cols, cols_per_split, vocab_start,
                     inv_t, BLOCK_V: tl.constexpr, WITH_H: tl.constexpr, FAST_EXP: tl.constexpr):
        """Program (row r, split k) over columns ``[k * cols_per_split, min((k+1) * cols_per_split, n_cols))``:
        ``grad[r, cols] = g onehot(t) + p (c + gh log p)`` (``WITH_H``) or ``g onehot(t) - g p``, ``log p = x *
        inv_t - lse`` (module docstring), stored in ``grad``'s dtype."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        offset = row.to(tl.int64) * n_cols
        lo = split * cols_per_split
        hi = tl.minimum(lo + cols_per_split, n_cols)
        offs = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        if WITH_H:
            c = tl.load(c_ptr + row)
            gh = tl.load(gh_ptr + row)
        local = tl.load(tgt_ptr + row).to(tl.int64) - vocab_start  # out of [0, n_cols): matches no column
        for start in range(lo, hi, BLOCK_V):
            cols = start + offs
            mask = cols < hi
            x = tl.load(x_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
            log_p = x * inv_t - lse
            if FAST_EXP:
                p = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [log_p * 1.4426950408889634],
                                              dtype=tl.float32, is_pure=True, pack=1)
            else:
                p = tl.exp(log_p)
            if WITH_H:
                # p log p -> 0 at a -inf logit (0 * -inf would be NaN); NaN logits stay NaN
                grad = tl.where(log_p == float("-inf"), 0.0, p * (c + gh * log_p))
            else:
                grad = -g * p
            grad = tl.where(cols == local, grad + g, grad)
            tl.store(grad_ptr + offset + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)

    return dict(stats=_stats_kernel, grad=_grad_kernel)


def _splits(n_rows: int, n_cols: int, block_v: int, n_split: Optional[int]) -> Tuple[int, int]:
    """``(n_split, cols_per_split)``: the backward's programs per row, each over a multiple of ``block_v``
    columns."""
    tiles = -(-n_cols // block_v)
    if n_split is None:
        n_split = 1
        if n_rows < _TARGET_PROGRAMS:
            n_split = min(-(-_TARGET_PROGRAMS // max(n_rows, 1)), max(1, tiles // _MIN_TILES_PER_SPLIT))
    n_split = max(1, min(int(n_split), tiles))
    tiles_per_split = -(-tiles // n_split)
    n_split = -(-tiles // tiles_per_split)  # no empty split
    return n_split, tiles_per_split * block_v


def _fast_exp() -> bool:
    # inline PTX: NVIDIA only (ROCm builds of torch also report is_cuda), and not in the interpreter
    return FAST_EXP and not _interpreting() and torch.version.hip is None


def _launch_opts(block_v: int) -> dict:
    # 512 columns a warp (16 a thread); narrow tiles (the tests' 128 columns) get one warp
    return {} if _interpreting() else {"num_warps": max(1, min(8, block_v // 512))}


def forward_stats(rows: torch.Tensor, target: torch.Tensor, inv_t: float, vocab_start: int = 0, *,
                  with_entropy: bool = True, block_v: int = FWD_BLOCK_V):
    """This shard's statistics in one read of ``rows [R, V_local]`` (contiguous): ``(m_local, S_local, W_local,
    z_target, in_shard)``, each ``[R]`` float32 — ``m_local = max z`` over the shard (the lowest finite float32 where
    the row holds no finite logit), ``S_local = sum exp(z - m_local)``, ``W_local = sum exp(z - m_local) (z -
    m_local)`` (zeros without ``with_entropy``), ``z_target = z`` at ``target - vocab_start`` (0 where the target is
    not in the shard), ``in_shard`` 1.0 / 0.0."""
    n_rows, n_cols = rows.shape
    out = torch.empty(5, n_rows, dtype=torch.float32, device=rows.device)
    if n_rows:
        group = max(1, min(block_v, 16 // rows.element_size()))  # one 16-byte load per thread and group
        _kernels()["stats"][(n_rows,)](rows, target, out, n_rows, n_cols, int(vocab_start), float(inv_t),
                                       BLOCK_V=block_v, GROUP=group, WITH_ENTROPY=bool(with_entropy),
                                       FAST_EXP=_fast_exp(), **_launch_opts(block_v))
    return out[0], out[1], out[2], out[3], out[4]


def merge_partials(m_part: torch.Tensor, s_part: torch.Tensor, w_part: Optional[torch.Tensor], m: torch.Tensor):
    """Partial statistics against their own maxima ``m_part`` rescaled to a common ``m >= m_part`` (broadcasting):
    ``(a S_part, a (W_part + (m_part - m) S_part))`` with ``a = exp(m_part - m)``; their sum over the parts is the
    statistics of the union.  A part with ``S_part = 0`` (only ``-inf``, ``m_part`` -inf or the lowest float)
    contributes 0."""
    a = torch.exp(m_part - m)
    s = a * s_part
    if w_part is None:
        return s, None
    shift = (torch.where(s_part > 0, m_part, m) - m) * s_part  # not -inf * 0 for an all -inf part
    return s, a * (w_part + shift)


def combine_shards(m_local: torch.Tensor, s_local: torch.Tensor, w_local: Optional[torch.Tensor], group=None, *,
                   z_target: Optional[torch.Tensor] = None, in_shard: Optional[torch.Tensor] = None):
    """The whole vocabulary's ``(m, S, W, s_target)`` from each TP shard's ``(m_local, S_local, W_local)`` (``[R]``,
    as :func:`forward_stats` gives them) with two collectives over ``group``: a MAX all-reduce of ``m``, then one SUM
    all-reduce of the stacked ``[S; W; s_target]`` after each shard rescaled its own to the global ``m``
    (:func:`merge_partials`).  ``s_target = (z_target - m) in_shard`` summed over the shards (only the shard holding
    the target contributes; ``None`` without ``z_target``); ``W`` is ``None`` when ``w_local`` is.  ``group=None``:
    one shard, no collective.  Nothing here is differentiable (the eager path's all-reduces have identity backwards,
    and the gradient is the backward kernel's)."""
    flag = in_shard if in_shard is not None else 1.0
    if group is None:
        return m_local, s_local, w_local, None if z_target is None else (z_target - m_local) * flag
    m = m_local.clone()
    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
    s, w = merge_partials(m_local, s_local, w_local, m)
    parts = [s] + ([w] if w is not None else []) + ([(z_target - m) * flag] if z_target is not None else [])
    sums = torch.stack(parts)
    torch.distributed.all_reduce(sums, group=group)
    rest = list(sums.unbind(0))
    s = rest.pop(0)
    w = rest.pop(0) if w is not None else None
    s_t = rest.pop(0) if z_target is not None else None
    return m, s, w, s_t


def backward_grad(rows: torch.Tensor, target: torch.Tensor, inv_t: float, vocab_start: int, lse: torch.Tensor,
                  g: torch.Tensor, c: Optional[torch.Tensor] = None, gh: Optional[torch.Tensor] = None, *,
                  block_v: int = BWD_BLOCK_V, n_split: Optional[int] = None) -> torch.Tensor:
    """``d loss / d rows`` in ``rows``' dtype, one read of ``rows`` and one write: ``g onehot(t) + p (c + gh log p)``
    when ``c``, ``gh`` are given, else ``g onehot(t) - g p``; ``lse, g, c, gh`` are ``[R]`` float32 (module
    docstring).  ``n_split``: programs per row (``None``: enough programs to fill the GPU, :func:`_splits`)."""
    n_rows, n_cols = rows.shape
    grad = torch.empty_like(rows)
    with_h = c is not None
    splits, cols_per_split = _splits(n_rows, n_cols, block_v, n_split)
    if n_rows:
        _kernels()["grad"][(n_rows, splits)](rows, grad, target, lse, g, c if with_h else g, gh if with_h else g,
                                             n_cols, cols_per_split, int(vocab_start), float(inv_t),
                                             BLOCK_V=block_v, WITH_H=with_h, FAST_EXP=_fast_exp(),
                                             **_launch_opts(block_v))
    return grad


class TritonLogProbsEntropy(torch.autograd.Function):
    """Drop-in for ``logprobs._LogProbsEntropy``: ``rows [R, V_local]``, ``target [R]`` global ids ->
    ``(log_probs [R], entropy [R] or empty)``, float32 (check :func:`available` first).  ``chunk`` is ignored:
    nothing vocabulary-sized is allocated but the gradient.  Tests override the tile width (both kernels) and the
    backward's programs per row through the class attributes ``_block_v`` / ``_n_split`` (``None``: the defaults)."""

    _block_v: Optional[int] = None
    _n_split: Optional[int] = None

    @staticmethod
    def forward(ctx, rows, target, inv_t, chunk, with_entropy, entropy_grad):
        tp_size, tp_rank, group = tensor_parallel()
        n_rows, v_local = rows.shape
        vocab_start = tp_rank * v_local
        rows = rows.contiguous()
        target = target.contiguous()
        bv = TritonLogProbsEntropy._block_v
        m_l, s_l, w_l, z_t, in_shard = forward_stats(rows, target, inv_t, vocab_start, with_entropy=with_entropy,
                                                     block_v=bv or FWD_BLOCK_V)
        m, s, w, s_t = combine_shards(m_l, s_l, w_l if with_entropy else None, group if tp_size > 1 else None,
                                      z_target=z_t, in_shard=in_shard)
        log_sum = s.log()
        log_probs = s_t - log_sum
        f32 = dict(dtype=torch.float32, device=rows.device)
        entropy = log_sum - w / s if with_entropy else torch.empty(0, **f32)
        lse = m + log_sum
        ctx.save_for_backward(rows, target, lse, entropy if entropy_grad else torch.empty(0, **f32))
        ctx.inv_t, ctx.vocab_start, ctx.entropy_grad = inv_t, vocab_start, entropy_grad
        ctx.block_v, ctx.n_split = bv or BWD_BLOCK_V, TritonLogProbsEntropy._n_split
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        rows, target, lse, entropy = ctx.saved_tensors
        inv_t = ctx.inv_t
        g = (grad_log_probs.float() * inv_t).contiguous()  # d/dz = (1/T) d/dlogits
        with_h = ctx.entropy_grad and grad_entropy is not None and grad_entropy.numel() > 0
        c = gh = None
        if with_h:
            gh = (grad_entropy.float() * -inv_t).contiguous()
            c = (gh * entropy - g).contiguous()
        grad = backward_grad(rows, target, inv_t, ctx.vocab_start, lse, g, c, gh, block_v=ctx.block_v,
                             n_split=ctx.n_split)
        return grad, None, None, None, None, None
