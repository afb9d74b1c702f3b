"""Log-probs (and entropy) of the target tokens from vocab-sharded logits, in chunks of rows, without gathering the
vocabulary and without keeping anything vocabulary-sized for backward.

Under tensor parallelism each rank holds logits ``[..., V / tp]`` for its slice of the vocabulary
``[rank * V/tp, (rank + 1) * V/tp)``.  With ``z = logits / temperature`` (the rollout engine's temperature, so both
sides score the same distribution), ``s = z - m`` and ``S = sum_v exp(s_v)``:

    log p(t) = s_t - log S,               m = max_v z_v   (max over all shards)
    H        = log S - (sum_v exp(s_v) s_v) / S

Forward makes two passes over the rows in chunks: the row max (one MAX all-reduce across the TP shards), then ``S``,
``sum exp(s) s`` and the target logit (one SUM all-reduce of the three; the target logit is non-zero on exactly one
shard).  It saves only the logits it is given, the targets, ``lse = m + log S`` and ``H`` per row.  Backward
recomputes ``log p = z - lse`` chunk by chunk and writes each chunk of the gradient in place:

    d log p(t) / dz = onehot(t) - p            d H / dz = -p (log p + H)

each shard's own columns, with no collective (the forward's all-reduces have identity backwards, as Megatron's
``reduce_from_tensor_model_parallel_region``).  Peak memory beyond the logits and their gradient is one or two
chunks; the entropy's gradient is computed only when asked for.  Nothing is modified in place in the caller's
logits (``vocab_parallel_cross_entropy`` overwrites fp32 logits).

Traffic over ``[rows, V]`` per forward + backward, in passes of the logits' size: forward 8 with the entropy (max;
``s``; ``exp``; ``sum``; ``sum exp * s`` reads two), 6 without; backward 6 (``log p``; ``exp``; scale), 9 with the
entropy's gradient.  On a GPU with Triton, :mod:`slime_rc.megatron.logprobs_triton` fuses each direction into one
kernel (3 passes in all).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from slime_rc.megatron.tensor_parallel import tensor_parallel

# rows per chunk when the caller gives none: about 64M logits (256 MiB of float32 scratch per buffer)
CHUNK_ELEMENTS = 1 << 26
# "0" keeps the eager path on a GPU (the fused Triton kernels of logprobs_triton are used where they can run)
FUSED_ENV = "SLIME_RC_FUSED_LOGPROBS"


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, *,
                             with_entropy: bool = False, entropy_grad: bool = True,
                             chunk_rows: Optional[int] = None):
    """``logits [..., V_local]`` (this rank's vocab shard), ``target [...]`` global token ids -> ``[...]`` float32
    log-probs.  Uses megatron-core's tensor-parallel group when it is initialized with size > 1.

    ``with_entropy``: also the entropy of each position's distribution over the whole vocabulary: returns
    ``(log_probs, entropy)``; ``entropy_grad=False`` returns it without a gradient (and backward does not compute
    one).  ``chunk_rows``: rows per chunk (slime's ``--log-probs-chunk-size``); ``None`` or ``<= 0`` picks about
    ``CHUNK_ELEMENTS`` logits per chunk.  The gradient of ``logits`` has their dtype; the arithmetic is float32.

    On a GPU with Triton the same function runs as two fused kernels (:mod:`slime_rc.megatron.logprobs_triton`: one
    read of the logits forward, one read and one write backward; chunks do not apply); ``SLIME_RC_FUSED_LOGPROBS=0``
    keeps this module's eager chunks."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be > 0 (use the rollout engine's sampling temperature)")
    v_local = logits.shape[-1]
    rows = logits.reshape(-1, v_local)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    flat_target = target.reshape(-1)
    if flat_target.numel() != rows.shape[0]:
        raise ValueError(f"target has {flat_target.numel()} ids for {rows.shape[0]} rows of logits "
                         f"{tuple(logits.shape)}; one target id per position")
    if chunk_rows is None or chunk_rows <= 0:
        chunk_rows = max(1, CHUNK_ELEMENTS // max(v_local, 1))
    function = _LogProbsEntropy
    if rows.device.type == "cuda" and os.environ.get(FUSED_ENV, "1") != "0":
        from slime_rc.megatron import logprobs_triton  # imports Triton only here, on a GPU
        if logprobs_triton.available(rows):
            function = logprobs_triton.TritonLogProbsEntropy
    log_probs, entropy = function.apply(rows, flat_target, 1.0 / float(temperature), int(chunk_rows),
                                        with_entropy, with_entropy and entropy_grad)
    log_probs = log_probs.reshape(target.shape)
    if with_entropy:
        return log_probs, entropy.reshape(target.shape)
    return log_probs


class _LogProbsEntropy(torch.autograd.Function):
    """``rows [R, V_local]``, ``target [R]`` -> ``(log_probs [R], entropy [R] or empty)``, float32 (module
    docstring for the formulas)."""

    @staticmethod
    def forward(ctx, rows, target, inv_t, chunk, with_entropy, entropy_grad):
        tp_size, tp_rank, group = tensor_parallel()
        n_rows, v_local = rows.shape
        dev = rows.device
        start = tp_rank * v_local
        in_shard = (target >= start) & (target < start + v_local)
        local = torch.where(in_shard, target - start, torch.zeros_like(target)).long().unsqueeze(-1)
        f32 = dict(dtype=torch.float32, device=dev)
        m = torch.empty(n_rows, **f32)
        for a in range(0, n_rows, chunk):
            m[a:a + chunk] = rows[a:a + chunk].amax(dim=-1)  # exact in any dtype
        m.mul_(inv_t)  # max of z = max of logits / temperature (temperature > 0)
        if tp_size > 1:
            torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX, group=group)
        # sums[0] = S, sums[1] = sum exp(s) s, sums[2] = s at the target (this shard's, else 0)
        sums = torch.zeros(3, n_rows, **f32)
        inv = torch.full((), inv_t, **f32)
        for a in range(0, n_rows, chunk):
            b = min(a + chunk, n_rows)
            s = torch.addcmul(-m[a:b, None], rows[a:b].float(), inv)  # s = z - m, one pass
            sums[2, a:b] = s.gather(-1, local[a:b]).squeeze(-1)
            e = s.exp() if with_entropy else s.exp_()
            torch.sum(e, dim=-1, out=sums[0, a:b])
            if with_entropy:
                sums[1, a:b] = torch.einsum("ij,ij->i", e, s)  # no [rows, V] product materialized
            del s, e
        sums[2].mul_(in_shard)
        if tp_size > 1:
            torch.distributed.all_reduce(sums, group=group)
        log_sum = sums[0].log()
        log_probs = sums[2] - log_sum
        entropy = log_sum - sums[1] / sums[0] if with_entropy else torch.empty(0, **f32)
        lse = m + log_sum
        ctx.save_for_backward(rows, local, in_shard, lse, entropy if entropy_grad else torch.empty(0, **f32))
        ctx.inv_t, ctx.chunk, ctx.entropy_grad = inv_t, chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        rows, local, in_shard, lse, entropy = ctx.saved_tensors
        inv_t, chunk = ctx.inv_t, ctx.chunk
        n_rows = rows.shape[0]
        grad = torch.empty_like(rows)
        direct = rows.dtype == torch.float32  # write the chunks straight into the gradient
        inv = torch.full((), inv_t, dtype=torch.float32, device=rows.device)
        g = grad_log_probs.float() * inv_t  # d/dz = (1/T) d/dlogits
        target_grad = (g * in_shard).unsqueeze(-1)
        with_h = ctx.entropy_grad and grad_entropy is not None and grad_entropy.numel() > 0
        if with_h:
            gh = grad_entropy.float() * -inv_t
            # d/dlogits = g onehot - p (g + (gH / T)(log p + H)) = g onehot + p (c + gh log p)
            c = gh * entropy - g
        for a in range(0, n_rows, chunk):
            b = min(a + chunk, n_rows)
            out = grad[a:b] if direct else torch.empty(b - a, rows.shape[1], dtype=torch.float32,
                                                       device=rows.device)
            if with_h:
                log_p = torch.addcmul(-lse[a:b, None], rows[a:b].float(), inv)
                torch.exp(log_p, out=out)
                torch.addcmul(c[a:b, None], log_p, gh[a:b, None], out=log_p)
                out.mul_(log_p)
                del log_p
            else:
                torch.addcmul(-lse[a:b, None], rows[a:b].float(), inv, out=out)
                out.exp_().mul_(-g[a:b, None])
            out.scatter_add_(-1, local[a:b], target_grad[a:b])
            if not direct:
                grad[a:b].copy_(out)
        return grad, None, None, None, None, None

