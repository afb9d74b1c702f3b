"""A core-attention module for megatron-core's *local* GPT layer spec that supports context parallelism and packed
(``thd``) sequences without transformer-engine -- i.e. on CPU / gloo.

megatron-core's local ``DotProductAttention`` refuses both (``"Context parallelism is only supported by
TEDotProductAttention!"``, ``"Packed sequence is not supported by DotProductAttention"``), and transformer-engine
cannot be installed without CUDA.  :class:`ContextParallelDotProductAttention` is a drop-in replacement for the
``core_attention`` submodule of ``SelfAttention`` (same constructor and ``forward`` signature):

* every CP rank holds the zigzag chunks ``r`` and ``2 * cp - 1 - r`` of each (padded) sequence, exactly as
  megatron lays out the data (``get_batch_on_this_cp_rank`` for ``sbhd``, TE's ``thd`` partitioning for packed
  input -- see ``slime_rc.demo.model.shard_micro_batch``);
* K and V are all-gathered over the CP group (backward: all-reduce of the gradient, then this rank's slice -- gloo
  has no reduce-scatter), the queries stay local;
* the mask is causal over the *global* positions of the zigzag chunks, and, for packed ``thd`` input, block-diagonal
  over sequences, using the padded ``cu_seqlens`` of the ``PackedSeqParams`` (``cu_seqlens_q_padded`` when set,
  else ``cu_seqlens_q``; they are the *global* padded boundaries, each sequence a multiple of ``2 * cp``).  A
  trailing stream-padding segment (slime's ``get_batch`` and ``shard_micro_batch`` pad each rank's packed stream to
  a multiple of ``tp * pad_multiplier``, which sequence parallelism needs) is one more segment: its tokens attend
  only among themselves, never to or from a real sequence;
* with ``cp == 1`` it is plain (packed or unpacked) causal softmax attention.

It computes the full ``[heads, local queries, global keys]`` score matrix: fine for tests and small models, not a
ring-attention kernel.  It exercises the data layout and the loss side faithfully, not TE's kernels.

On a GPU with transformer-engine installed use TE's attention instead (``TEDotProductAttention``, which runs ring
attention for CP and handles ``thd`` natively): :func:`default_core_attention` returns it when
``HAVE_TE and torch.cuda.is_available()``.  transformer-engine is detected, never required.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from slime_rc.megatron.cp_layout import packed_zigzag_positions

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def default_core_attention():
    """The core-attention class to put in a GPT layer spec: TE's ``TEDotProductAttention`` on a GPU with
    transformer-engine, else :class:`ContextParallelDotProductAttention`."""
    if HAVE_TE and torch.cuda.is_available():
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    return ContextParallelDotProductAttention


class _AllGatherCP(torch.autograd.Function):
    """``x [n, ...]`` -> ``[cp * n, ...]`` (rank order); backward: all-reduce, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.n = x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def zigzag_positions(padded_lengths, cp_size: int, cp_rank: int) -> Tuple[Tensor, Tensor]:
    """For the segments of a packed stream -- the *global* padded lengths of ``cu_seqlens`` (each a multiple of
    ``2 * cp_size`` when ``cp_size > 1``; a trailing stream-padding segment included) -- the segment id and the
    position inside its segment of every token this CP rank holds, in its local (packed) order.  The layout is
    :mod:`slime_rc.megatron.cp_layout`'s (the one copy); this only checks the lengths are already padded."""
    lengths = [int(x) for x in padded_lengths]
    if cp_size > 1:
        for i, length in enumerate(lengths):
            if length % (2 * cp_size):
                raise ValueError(f"segment {i}: padded length {length} in cu_seqlens is not a multiple of "
                                 f"2*cp={2 * cp_size}; pad each sequence with slime_rc.megatron.cp_layout."
                                 f"zigzag_padded_length (shard_micro_batch does)")
    return packed_zigzag_positions(lengths, cp_size, cp_rank)


class ContextParallelDotProductAttention(MegatronModule):
    """Core attention with context parallelism (K/V all-gather, zigzag causal mask) and packed ``thd`` input.

    Same constructor/``forward`` signature as megatron-core's ``DotProductAttention``.  Inputs:
    ``sbhd``: query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]`` -> ``[s, b, np * hn]``;
    ``thd`` (``packed_seq_params.qkv_format == "thd"``): query ``[t, np, hn]``, key/value ``[t, ng, hn]`` ->
    ``[t, np * hn]``.  Supports ``AttnMaskType.causal`` and ``no_mask`` (then only the per-sequence mask); an
    explicit ``attention_mask`` (True = masked) is honoured for unpacked input without CP.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise NotImplementedError(f"attn_mask_type {attn_mask_type} (only causal / no_mask)")
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None and config.context_parallel_size > 1:
            self.cp_group = parallel_state.get_context_parallel_group()
        tp_size = tp_group.size() if tp_group is not None else 1
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)

    def _cp(self) -> Tuple[int, int]:
        if self.cp_group is None or self.cp_group.size() == 1:
            return 1, 0
        return self.cp_group.size(), self.cp_group.rank()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cp_size, cp_rank = self._cp()

        if thd:  # [t, h, d] -> [1, t, h, d]
            q, k, v = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            lengths = (cu[1:] - cu[:-1]).tolist()
            if sum(lengths) != cp_size * q.shape[1]:
                raise ValueError(f"packed cu_seqlens cover {sum(lengths)} tokens, expected cp*local = "
                                 f"{cp_size}*{q.shape[1]}")
        else:  # [s, b, h, d] -> [b, s, h, d]
            if packed_seq_params is not None:
                raise NotImplementedError(f"qkv_format {packed_seq_params.qkv_format!r}")
            q, k, v = (x.transpose(0, 1) for x in (query, key, value))
            lengths = [cp_size * q.shape[1]]

        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)

        q_seq, q_pos = zigzag_positions(lengths, cp_size, cp_rank)
        if cp_size > 1:
            # gather along the sequence dim: [b, s, h, d] -> [s, b, h, d] -> all-gather dim 0 -> back
            k = _AllGatherCP.apply(k.transpose(0, 1), self.cp_group).transpose(0, 1)
            v = _AllGatherCP.apply(v.transpose(0, 1), self.cp_group).transpose(0, 1)
            kv = [zigzag_positions(lengths, cp_size, r) for r in range(cp_size)]
            k_seq = torch.cat([s for s, _ in kv])
            k_pos = torch.cat([p for _, p in kv])
        else:
            k_seq, k_pos = q_seq, q_pos

        allowed = q_seq[:, None] == k_seq[None, :]
        if mask_type == AttnMaskType.causal:
            allowed &= k_pos[None, :] <= q_pos[:, None]
        allowed = allowed.to(q.device)

        # [b, h, sq, sk]
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * self.softmax_scale
        masked = ~allowed[None, None]
        if attention_mask is not None:
            if thd or cp_size > 1:
                raise NotImplementedError("an explicit attention_mask with packed input or CP")
            masked = masked | attention_mask.bool()
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        if self.attention_dropout.p > 0 and self.training:
            if not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            else:
                probs = self.attention_dropout(probs)
        ctx = torch.einsum("bhqk,bkhd->bqhd", probs, v)  # [b, sq, h, d]
        if thd:
            return ctx.squeeze(0).reshape(ctx.shape[1], self.hidden_size_per_partition)
        return ctx.transpose(0, 1).reshape(ctx.shape[1], ctx.shape[0], self.hidden_size_per_partition)
