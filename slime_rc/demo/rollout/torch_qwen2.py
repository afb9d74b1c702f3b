"""A pure-torch forward of every architecture :class:`~slime_rc.demo.model.TinyGPTConfig` describes -- Qwen2's
(``slime_rc.demo.model.QWEN2_TINY``: RMSNorm, SwiGLU, q/k/v bias only, RoPE base 1e6, grouped-query attention) is
the point -- for the in-process rollout engine.  Same conventions as
the demo GPT's forward described in ``slime_rc.demo.rollout.in_process`` (whose ``TorchGPT`` is this class):
``full_parameters(model)`` in, no megatron, no ``torch.distributed``.

:class:`TorchQwen2` -- the forward of megatron-core's ``GPTModel`` with the local layer spec as ``build_model(cfg)``
builds it (megatron-core 0.16's ``TransformerLayer`` / ``SelfAttention`` / ``MLP``), and of HF's
``Qwen2ForCausalLM`` for a Qwen2 config (``slime_rc.demo.hf_checkpoint`` maps the weights)
-------------------------------------------------------------------------------------------------------------------
With ``h`` hidden size, ``nh`` heads, ``ng`` query groups (``num_query_groups or nh``), ``hn = h / nh``,
``r = nh / ng``, ``eps = cfg.norm_epsilon``, tokens ``[B, T]``::

    Norm(x; w, b) = (x - mean(x)) / sqrt(var(x) + eps) * w + b       normalization "LayerNorm"
                  = x / sqrt(mean(x^2) + eps) * w                    normalization "RMSNorm" (no bias)
    x      = word_embeddings[tokens]                                   [B, T, h]
    for each layer l:
      a    = Norm(x; input_layernorm)
      qkv  = a @ linear_qkv.W^T (+ linear_qkv.b when cfg.has_qkv_bias)  [B, T, ng * (r + 2) * hn]
             viewed [B, T, ng, (r + 2) * hn], split per group into q [.., ng, r * hn] -> [B, T, nh, hn]
             (query head g * r + j in group g), k, v [B, T, ng, hn]   (megatron: ``q1 .. qr k v | q1 .. qr k v | ..``)
      q, k = RoPE(q), RoPE(k): inv_freq_i = rotary_base ** (-2 i / hn), i < hn / 2 (fp32); theta = pos * inv_freq;
             emb = cat(theta, theta); t' = t * cos(emb) + rotate_half(t) * sin(emb) (not interleaved; cos/sin in
             fp32, cast to the compute dtype); ``pos`` restarts at 0 in every sequence (megatron's packed ``thd``)
      att  = softmax(q k^T / sqrt(hn) + causal mask) v    (k, v repeated r times per group), heads concatenated
      x    = x + att @ linear_proj.W^T (+ linear_proj.b with add_bias_linear)
      m    = Norm(x; pre_mlp_layernorm)
      u    = m @ linear_fc1.W^T (+ b)                                  [B, T, F] or, gated, [B, T, 2F]
      y    = act(u)                 or, gated (linear_fc1.W = cat(W_gate, W_up)): act(u[..., :F]) * u[..., F:]
      x    = x + y @ linear_fc2.W^T (+ b)                             act: exact erf GELU or SiLU
    logits = Norm(x; decoder.final_layernorm) @ W_out^T              [B, T, V]   (no bias)

Qwen2 is the case RMSNorm, gated SiLU (SwiGLU), a q/k/v bias and no other: HF's ``o_proj`` / ``gate_proj`` /
``up_proj`` / ``down_proj`` have no bias.  ``W_out`` is ``output_layer.weight``, or the word embedding when tied.

Precision: in ``bf16``/``fp16`` every weight is cast to that dtype and every matmul / norm / activation runs in it;
the attention softmax is taken in fp32 and rounded back; logits come out in the dtype.  Left padding: ``pad [B]``
leading pad tokens per row; positions are ``t - pad`` and pad keys are masked out, so a padded row computes the
same function as the unpadded sequence (pad rows' outputs are garbage, finite).

:func:`is_default_architecture` tells which forward a config needs: ``TorchGPT`` for the demo's default architecture
(bit-for-bit what the rollout engine always ran; on that architecture :class:`TorchQwen2` gives the same bits),
:class:`TorchQwen2` for any other.  This module imports nothing from ``in_process`` (which picks the forward with
it: an import back would be a circle).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from slime_rc.demo.model import TinyGPTConfig, parameter_shapes

__all__ = ["TorchQwen2", "is_default_architecture"]

_ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}  # F.gelu: exact erf GELU, megatron's default activation_func
_ARCHITECTURE_FIELDS = ("normalization", "norm_epsilon", "gated_linear_unit", "activation", "add_bias_linear",
                        "add_qkv_bias", "rotary_base")


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # in_process.DTYPES


def is_default_architecture(cfg) -> bool:
    """``cfg``'s architecture fields are the demo GPT's defaults (the model ``in_process.TorchGPT`` computes)."""
    return all(getattr(cfg, f, getattr(TinyGPTConfig, f)) == getattr(TinyGPTConfig, f) for f in _ARCHITECTURE_FIELDS)


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """``"fp32"`` / ``"bf16"`` / ``"fp16"`` or the torch dtype -> the torch dtype (``in_process.resolve_dtype``'s
    rule; a copy, see the module docstring)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} not supported; use one of {list(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {list(_DTYPES)}")
    return _DTYPES[dtype]


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


class TorchQwen2:
    """Pure-torch forward of ``build_model(cfg)``'s ``GPTModel`` (module docstring) from ``full_parameters(model)``.

    ``params``: ``{global name: full tensor}`` with exactly the names of ``parameter_shapes(cfg)`` (extra names are
    ignored; a missing one or a wrong shape raises, naming it).  Tensors are copied (cast to ``dtype``), so later
    in-place updates of the trainer's parameters do not leak in.  Same interface as ``TorchGPT``: ``logits(tokens,
    pad)``, ``log_probs(tokens, temperature)``.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], cfg, dtype: Union[str, torch.dtype] = torch.float32,
                 device: Union[str, torch.device, None] = None):
        self.cfg = cfg
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_heads = cfg.num_attention_heads
        self.num_groups = cfg.num_query_groups or cfg.num_attention_heads
        if cfg.hidden_size % self.num_heads or self.num_heads % self.num_groups:
            raise ValueError(f"hidden_size={cfg.hidden_size}, heads={self.num_heads}, groups={self.num_groups}: "
                             "heads must divide hidden_size and groups must divide heads")
        self.head_dim = cfg.hidden_size // self.num_heads
        shapes = parameter_shapes(cfg)
        missing = [n for n in shapes if n not in params]
        if missing:
            raise KeyError(f"parameters missing from the state dict: {missing[:4]}{' ...' if len(missing) > 4 else ''}"
                           f" (expected full_parameters(model) of build_model(cfg) for cfg={cfg})")
        wrong = [(n, tuple(params[n].shape), s) for n, s in shapes.items() if tuple(params[n].shape) != tuple(s)]
        if wrong:
            n, got, want = wrong[0]
            raise ValueError(f"parameter {n!r} has shape {got}, cfg gives {want}: the weights are not of a model "
                             f"built from this config")
        with torch.no_grad():
            self.p = {n: params[n].detach().to(self.device, self.dtype).clone() for n in shapes}
        self.out_weight = self.p["embedding.word_embeddings.weight" if cfg.tie_embeddings else "output_layer.weight"]
        self.act = _ACTIVATIONS[cfg.activation]
        # megatron's RotaryEmbedding: inv_freq in fp32 from the Python-number base
        self.inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                                                device=self.device) / self.head_dim))

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        if self.cfg.normalization == "RMSNorm":
            return F.rms_norm(x, (x.shape[-1],), self.p[prefix + ".weight"], self.cfg.norm_epsilon)
        return F.layer_norm(x, (x.shape[-1],), self.p[prefix + ".weight"], self.p[prefix + ".bias"],
                            self.cfg.norm_epsilon)

    def _bias(self, name: str) -> Optional[torch.Tensor]:
        return self.p.get(name)

    def _rope(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        theta = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, T, hn/2]
        emb = torch.cat((theta, theta), dim=-1)[:, :, None, :]  # [B, T, 1, hn]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tokens [B, T]`` int64 (``pad [B]``: leading pad tokens per row, default 0) -> logits ``[B, T, V]``
        in the rollout engine's dtype.  Rows of padding positions are garbage (finite); read only real positions."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got {tuple(tokens.shape)}")
        tokens = tokens.to(self.device)
        b, t = tokens.shape
        nh, ng, hn = self.num_heads, self.num_groups, self.head_dim
        r = nh // ng
        idx = torch.arange(t, device=self.device)
        pad = torch.zeros(b, dtype=torch.int64, device=self.device) if pad is None else pad.to(self.device)
        positions = (idx[None, :] - pad[:, None]).clamp(min=0)  # [B, T]
        allowed = (idx[None, :] <= idx[:, None])[None] & (idx[None, None, :] >= pad[:, None, None])  # [B, Tq, Tk]
        allowed |= torch.eye(t, dtype=torch.bool, device=self.device)[None]  # pad queries see themselves: no NaN
        bias = torch.zeros(b, 1, t, t, dtype=torch.float32, device=self.device)
        bias.masked_fill_(~allowed[:, None], float("-inf"))
        cos, sin = self._rope(positions)
        scale = 1.0 / math.sqrt(hn)
        ffn = self.cfg.ffn_hidden_size

        x = self.p["embedding.word_embeddings.weight"][tokens]  # [B, T, h]
        for i in range(self.cfg.num_layers):
            pre = f"decoder.layers.{i}."
            a = self._norm(x, pre + "input_layernorm")
            qkv = F.linear(a, self.p[pre + "self_attention.linear_qkv.weight"],
                           self._bias(pre + "self_attention.linear_qkv.bias")).view(b, t, ng, (r + 2) * hn)
            q, k, v = torch.split(qkv, [r * hn, hn, hn], dim=-1)
            q = q.reshape(b, t, nh, hn)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if r > 1:
                k = k.repeat_interleave(r, dim=2)
                v = v.repeat_interleave(r, dim=2)
            q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # [B, nh, T, hn]
            scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
            probs = torch.softmax(scores, dim=-1).to(self.dtype)
            ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, nh * hn)
            x = x + F.linear(ctx, self.p[pre + "self_attention.linear_proj.weight"],
                             self._bias(pre + "self_attention.linear_proj.bias"))
            m = self._norm(x, pre + "pre_mlp_layernorm")
            u = F.linear(m, self.p[pre + "mlp.linear_fc1.weight"], self._bias(pre + "mlp.linear_fc1.bias"))
            y = self.act(u[..., :ffn]) * u[..., ffn:] if self.cfg.gated_linear_unit else self.act(u)
            x = x + F.linear(y, self.p[pre + "mlp.linear_fc2.weight"], self._bias(pre + "mlp.linear_fc2.bias"))
        x = self._norm(x, "decoder.final_layernorm")
        return F.linear(x, self.out_weight)

    def log_probs(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``tokens [B, T]`` -> ``[B, T - 1]`` fp32 ``log_softmax(logits / T)[t, tokens[t + 1]]`` (no padding)."""
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0")
        lp = torch.log_softmax(self.logits(tokens)[:, :-1].float() / temperature, dim=-1)
        return lp.gather(-1, tokens[:, 1:].to(lp.device).unsqueeze(-1)).squeeze(-1)
