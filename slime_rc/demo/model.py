"""A tiny real ``megatron.core.models.gpt.GPTModel`` under any parallel layout (TP, SP, PP, VPP, CP, DP), and one
training step through megatron's own schedules, DDP wrapper and optimizer -- what a trainer and the tests need.

Works on CPU/gloo (``apply_cpu_patches`` is applied by :func:`initialize_parallel`) and on GPU.  Two architectures
(:class:`TinyGPTConfig`): the demo's GPT (the defaults: LayerNorm, GELU, biases) and Qwen2's (:data:`QWEN2_TINY`,
:func:`qwen2_tiny`: RMSNorm, SwiGLU, q/k/v bias only, RoPE base 1e6, GQA), whose HF checkpoints
``slime_rc.demo.hf_checkpoint`` converts, writes and loads (:func:`load_full_parameters` under any layout).

Typical use (in every rank, after ``torch.distributed.init_process_group``)::

    layout = initialize_parallel(tp=2, pp=2, cp=1, vpp=None, sequence_parallel=True)
    model = build_model(TinyGPTConfig(), calculate_per_token_loss=True)      # list of DDP-wrapped chunks
    optimizer = build_optimizer(model, lr=1e-3)
    mbs = data_parallel_slice(global_micro_batches)                         # this DP rank's micro-batches
    result = train_step(model, optimizer, mbs, loss_fn)                      # StepResult(loss, grad_norm, outputs)
    destroy_parallel()

Packed micro-batch format (input of :func:`train_step` / :func:`shard_micro_batch`)
------------------------------------------------------------------------------------
A dict with ``tokens`` ``[T]`` int64 (all sequences concatenated, each one prompt + response), ``cu_seqlens``
``[B+1]`` (int32/int64, boundaries in ``tokens``) and any number of extra per-token tensors ``[T, ...]`` (e.g.
``loss_mask``, ``advantages``, ``old_log_probs``, ``rollout_log_probs``) aligned with the *target* positions:
``field[i]`` belongs to predicting ``tokens[i + 1]`` within the same sequence, so the last position of each sequence
has no target (give it ``loss_mask`` 0).  Non-tensor entries are passed through unchanged.

``loss_fn`` convention (what megatron's schedule expects from a ``loss_func``)
----------------------------------------------------------------------------
``loss_fn(logits, local_mb)`` is called on the last pipeline stage, once per micro-batch, with this rank's logits
``[T_local, V / tp]`` (vocab-parallel; batch dim squeezed; compute log-probs with
``slime_rc.megatron.logprobs.vocab_parallel_log_probs(logits, local_mb["targets"], temperature)``) and the sharded
micro-batch of :func:`shard_micro_batch`.  With ``M`` the micro-batches of this DP rank and ``dp`` / ``cp`` the
sizes:

* ``build_model(..., calculate_per_token_loss=True)`` (recommended for token-level normalisation): return
  ``(local_sum, local_num_tokens, logs)`` -- ``local_sum`` a 0-dim tensor with the graph (e.g.
  ``-(logp * adv * mask).sum()``), ``local_num_tokens`` a 0-dim int tensor (``mask.sum()``).  Megatron sums the
  counts over micro-batches, PP (broadcast from the last stage) and DP x CP (``finalize_model_grads``), DDP *sums*
  the gradients over DP x CP and divides them by the total count: the step optimises
  ``sum_all local_sum / sum_all local_num_tokens`` -- the global-batch token mean.
* ``calculate_per_token_loss=False`` (megatron's legacy convention): return ``(loss, logs)``.  The schedule
  multiplies ``loss`` by ``cp`` and divides it by ``M``; DDP *averages* gradients over DP x CP.  So the step
  optimises ``sum_{dp, cp, micro-batches} loss / (M * dp)``.  A per-micro-batch token mean is
  ``loss = local_sum / (loss tokens of the micro-batch summed over the CP group)``; the global-batch token mean
  (micro-batches of different sizes) is ``loss = local_sum * M * dp / (loss tokens of the global batch)``
  (``local_mb["num_micro_batches"]`` and ``local_mb["dp_size"]`` are provided for that).

``logs`` is anything (detached) the caller wants back per micro-batch: :attr:`StepResult.outputs`.

:attr:`StepResult.loss` is the value the step optimised, reduced exactly as megatron reduces the gradients
(per-token: ``all_reduce(sum local_sum) / all_reduce(sum local_num_tokens)`` over DP x CP; legacy:
``all_reduce(sum loss * cp / M) / (dp * cp)``), computed on the last stage and broadcast over the pipeline group,
so every rank returns it.  The global batch is ``dp * M`` micro-batches.

Weights: every parameter's *full* (unsharded) value is drawn from a generator seeded by ``(seed, global parameter
name)`` and sharded by its megatron TP attributes (:func:`shard_full_parameter`; a gated MLP's ``linear_fc1``,
``cat(gate, up)``, is split with megatron's partition stride 2, each rank holding ``cat(gate_r, up_r)``), so the
initial model is identical in every layout for the same seed.  megatron's own ``use_cpu_initialization`` is
TP-invariant (it draws the full matrix, then splits it) but not PP-invariant (measured: with PP2 the weight
matrices of the second stage's layers differ from the 1-process model, each stage draws its layers from the start of
its own CPU stream); its biases / norm weights start at 0 / 1, which would leave their sharding untested, so they are
drawn at random here too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import re
import sys
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime_rc.demo.cpu_patches import apply_cpu_patches

# megatron-core warns once per module, on import, that Transformer Engine / Apex are missing (6 warnings, 12 stderr
# lines with megatron-core 0.16-0.19): "Apex is not installed. Falling back to Torch Norm", "Transformer Engine and
# Apex are not installed. Falling back to Torch optimizers." / "... to local implementations of multi_tensor_...".
# The demo silences exactly those and says it once instead (:func:`megatron_fallbacks_line`, printed by rank 0 in
# :func:`initialize_parallel`).
def quiet_megatron_fallback_warnings() -> None:
    """Ignore megatron-core's missing-TE/Apex warnings (by message and megatron module, nothing else) in this
    process.  They are raised when megatron is first imported: call this before that (importing this module does)."""
    warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed\. Falling "
                            r"back to ", category=UserWarning, module=r"(megatron\.core|megatron_fsdp)(\.|$)")


quiet_megatron_fallback_warnings()
_FALLBACKS_SAID = False


def megatron_fallbacks_line() -> Optional[str]:
    """The one line that replaces megatron-core's missing-TE/Apex warnings, or None when both are installed."""
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"slime-rc demo: {' and '.join(missing)} not installed; megatron-core uses its local fallbacks (torch "
            f"norms and optimizers, local multi-tensor ops)")


# ---------------------------------------------------------------------------------------------------------------
# config and parallel state
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TinyGPTConfig:
    """The demo model's architecture and sizes.  The defaults are the demo's own GPT (LayerNorm, GELU MLP, a bias on
    every linear layer, RoPE base 10000); :data:`QWEN2_TINY` / :func:`qwen2_tiny` set the architecture fields to
    Qwen2's (RMSNorm, SwiGLU, q/k/v bias only, RoPE base 1e6, grouped-query attention).

    Architecture fields (megatron ``TransformerConfig`` field in brackets):

    * ``normalization`` (``normalization``): ``"LayerNorm"`` -- ``(x - mean) / sqrt(var + eps) * w + b`` -- or
      ``"RMSNorm"`` -- ``x / sqrt(mean(x^2) + eps) * w`` (no bias); ``norm_epsilon`` is ``eps``
      (``layernorm_epsilon``).
    * ``gated_linear_unit`` (``gated_linear_unit``) with ``activation`` (``activation_func``, ``"gelu"`` or
      ``"silu"``): MLP ``fc2(act(fc1(x)))``, or gated ``fc2(act(g) * u)`` with ``[g, u] = fc1(x)`` split in halves
      (``linear_fc1.weight`` ``[2 * ffn_hidden_size, hidden_size]`` is ``cat(gate, up)``; SwiGLU = gated + silu).
    * ``add_bias_linear`` (``add_bias_linear``): a bias on every linear layer; ``add_qkv_bias`` (``add_qkv_bias``):
      a bias on ``linear_qkv`` even without ``add_bias_linear`` (Qwen2: q/k/v bias, none on ``o_proj`` / the MLP).
    * ``rotary_base`` (``GPTModel(rotary_base=...)``; HF's ``rope_theta``): ``inv_freq_i = base ** (-2 i / hn)``.
    """

    vocab_size: int = 128  # must be divisible by tp
    hidden_size: int = 64
    num_layers: int = 4  # must be divisible by pp * vpp
    num_attention_heads: int = 4  # must be divisible by tp
    ffn_hidden_size: int = 128
    max_seq_len: int = 512  # longest padded sequence
    seed: int = 1234
    dtype: torch.dtype = torch.float32
    num_query_groups: Optional[int] = None  # GQA; None = MHA
    tie_embeddings: bool = False
    init_std: float = 0.02
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5  # TransformerConfig.layernorm_epsilon's default
    gated_linear_unit: bool = False
    activation: str = "gelu"  # or "silu"
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    rotary_base: float = 10000  # an int by default, as GPTModel's own default (same inv_freq bits)

    def __post_init__(self):
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"TinyGPTConfig(normalization={self.normalization!r}): not a norm the demo builds; "
                             f"give one of {', '.join(map(repr, NORMALIZATIONS))}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"TinyGPTConfig(activation={self.activation!r}): not an activation the demo builds; "
                             f"give one of {', '.join(map(repr, ACTIVATIONS))}")
        if not (isinstance(self.norm_epsilon, (int, float)) and self.norm_epsilon > 0):
            raise ValueError(f"TinyGPTConfig(norm_epsilon={self.norm_epsilon!r}): must be a number > 0 (LayerNorm's "
                             f"default 1e-5, Qwen2's rms_norm_eps 1e-6)")
        if not (isinstance(self.rotary_base, (int, float)) and self.rotary_base > 1):
            raise ValueError(f"TinyGPTConfig(rotary_base={self.rotary_base!r}): must be a number > 1 (10000 by "
                             f"default, Qwen2's rope_theta 1e6)")

    @property
    def has_qkv_bias(self) -> bool:
        """``linear_qkv`` has a bias (megatron: ``add_bias_linear or add_qkv_bias``)."""
        return bool(self.add_bias_linear or self.add_qkv_bias)


NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "silu")

# Qwen2's architecture at the demo task's size (vocab 16): RMSNorm (eps 1e-6), SwiGLU, q/k/v bias only, RoPE base
# 1e6 (Qwen2's rope_theta), 4 query heads in 2 key/value groups, untied embeddings.
QWEN2_ARCHITECTURE = dict(normalization="RMSNorm", norm_epsilon=1e-6, gated_linear_unit=True, activation="silu",
                          add_bias_linear=False, add_qkv_bias=True, rotary_base=1000000.0)


def qwen2_tiny(**overrides) -> TinyGPTConfig:
    """A Qwen2-architecture :class:`TinyGPTConfig` (:data:`QWEN2_ARCHITECTURE`); the sizes default to vocab 16,
    hidden 64, 2 layers, 4 heads in ``heads // 2`` key/value groups (GQA with 2 query heads per group; MHA when the
    head count is odd), ``ffn_hidden_size = 2 * hidden`` (a SwiGLU's ``fc1`` is twice that wide).  ``overrides``:
    any field, sizes included (the groups follow a new ``num_attention_heads`` unless given)."""
    heads = overrides.get("num_attention_heads", 4)
    hidden = overrides.get("hidden_size", 64)
    fields = dict(vocab_size=16, hidden_size=hidden, num_layers=2, num_attention_heads=heads,
                  num_query_groups=heads // 2 if heads % 2 == 0 else heads, ffn_hidden_size=2 * hidden,
                  **QWEN2_ARCHITECTURE)
    fields.update(overrides)
    return TinyGPTConfig(**fields)


QWEN2_TINY = qwen2_tiny()


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: Optional[int]
    sequence_parallel: bool
    pad_multiplier: int = 1  # slime's: each rank's packed stream is padded to a multiple of tp * pad_multiplier

    @property
    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("vpp", self.vpp or 1),
                                         ("cp", self.cp), ("dp", self.dp)) if v > 1]
        parts += (["sp"] if self.sequence_parallel else []) + ([f"pad{self.pad_multiplier}"]
                                                                if self.pad_multiplier > 1 else [])
        return "_".join(parts) or "single"


_LAYOUT: Optional[ParallelLayout] = None


def initialize_parallel(tp: int = 1, pp: int = 1, cp: int = 1, vpp: Optional[int] = None,
                        sequence_parallel: bool = False, *, seed: int = 1234,
                        timeout_minutes: int = 1, pad_multiplier: int = 1) -> ParallelLayout:
    """``parallel_state.initialize_model_parallel`` + ``model_parallel_cuda_manual_seed(seed)`` (after
    :func:`apply_cpu_patches` when there is no GPU).  ``torch.distributed`` must be initialised; DP is
    ``world / (tp * pp * cp)``.  Call :func:`destroy_parallel` before initialising another layout.
    ``pad_multiplier``: slime's ``get_batch(pad_multiplier=...)`` -- each rank's packed stream is padded at its end
    to a multiple of ``tp * pad_multiplier`` (:func:`shard_micro_batch`); slime's default is 128, 1 pads least."""
    global _LAYOUT, _FALLBACKS_SAID
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tp > 1 (sequence parallelism splits activations over the "
                         "tensor-parallel group); raise tp or drop sequence_parallel")
    if not (isinstance(pad_multiplier, int) and pad_multiplier >= 1):
        raise ValueError(f"pad_multiplier={pad_multiplier!r} must be an int >= 1 (slime's default is 128; 1 pads "
                         f"each rank's stream only to a multiple of tp)")
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError(f"vpp={vpp} (virtual pipeline) needs pp > 1; raise pp or drop vpp")
    vpp = vpp if vpp and vpp > 1 else None
    apply_cpu_patches()
    if not _FALLBACKS_SAID and dist.get_rank() == 0:
        _FALLBACKS_SAID = True
        line = megatron_fallbacks_line()
        if line:
            print(line, file=sys.stderr, flush=True)
    if ps.model_parallel_is_initialized():
        raise RuntimeError("model parallel already initialised: call destroy_parallel() first")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                                 distributed_timeout_minutes=timeout_minutes)
    model_parallel_cuda_manual_seed(seed)
    _LAYOUT = ParallelLayout(tp=tp, pp=pp, cp=cp, dp=ps.get_data_parallel_world_size(), vpp=vpp,
                             sequence_parallel=sequence_parallel, pad_multiplier=pad_multiplier)
    return _LAYOUT


def destroy_parallel() -> None:
    """Undo :func:`initialize_parallel`: megatron's parallel state and the process groups it made.

    ``parallel_state.destroy_model_parallel`` only drops its references to the groups (its gloo DP groups aside):
    the groups lived on, and with gloo each kept 3 threads (17 groups a layout).  Re-initialised layout after layout
    in one process (the layout tests' spawns: 16 layouts), the later layouts ran 2-3x slower (measured: TP2xCP2
    5.0 s after 12 layouts with the groups destroyed, 11.6 s without)."""
    global _LAYOUT
    from megatron.core import parallel_state as ps

    groups = [g for g in (getattr(ps, "_global_process_group_list", None) or []) if g is not None]
    ps.destroy_model_parallel()
    live = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group in live and group is not dist.GroupMember.WORLD:  # (this rank's groups; not the default one)
            dist.destroy_process_group(group)
    _LAYOUT = None


def current_layout() -> ParallelLayout:
    if _LAYOUT is None:
        raise RuntimeError("initialize_parallel() first")
    return _LAYOUT


def data_parallel_slice(global_micro_batches: Sequence[dict]) -> List[dict]:
    """This DP rank's micro-batches of the global batch: contiguous blocks of ``len / dp``."""
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if len(global_micro_batches) % dp:
        raise ValueError(f"{len(global_micro_batches)} micro-batches do not split over dp={dp}")
    per = len(global_micro_batches) // dp
    return list(global_micro_batches[rank * per:(rank + 1) * per])


# ---------------------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------------------
class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with megatron's norm constructor signature whose parameters carry
    ``sequence_parallel`` (so ``finalize_model_grads`` all-reduces their gradients over TP under SP).  megatron's
    ``WrappedTorchNorm`` refuses sequence parallelism; apex/TE norms are GPU-only.  Used for every layer norm,
    the block's final one included."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.normalization != "LayerNorm" or zero_centered_gamma:
            raise NotImplementedError("plain LayerNorm only")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` -- ``y = x / sqrt(mean(x^2, last dim) + eps) * weight`` -- with megatron's norm
    constructor signature, its weight carrying ``sequence_parallel`` like :class:`SequenceParallelLayerNorm`'s (the
    RMSNorm that megatron's ``WrappedTorchNorm`` would build, which refuses sequence parallelism)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or zero_centered_gamma:
            raise NotImplementedError("plain RMSNorm only")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))


def norm_class(cfg: Optional[TinyGPTConfig] = None):
    """The layer-norm class of ``cfg``'s layers and final norm: :class:`SequenceParallelLayerNorm` or
    :class:`SequenceParallelRMSNorm` (``cfg=None``: the default config's)."""
    normalization = cfg.normalization if cfg is not None else TinyGPTConfig.normalization
    return SequenceParallelRMSNorm if normalization == "RMSNorm" else SequenceParallelLayerNorm


_ACTIVATION_FUNCS = {"gelu": F.gelu, "silu": F.silu}  # TransformerConfig's default activation_func is F.gelu


def transformer_config(cfg: TinyGPTConfig, layout: Optional[ParallelLayout] = None, *,
                       calculate_per_token_loss: bool = True):
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = layout or current_layout()
    gloo = dist.get_backend() == "gloo"
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        use_cpu_initialization=True, params_dtype=cfg.dtype, pipeline_dtype=cfg.dtype,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=calculate_per_token_loss,
        normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=cfg.gated_linear_unit, activation_func=_ACTIVATION_FUNCS[cfg.activation],
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
        # gloo: batched isend/irecv can swap two messages to the same neighbour (PP=2 with VPP: silently wrong)
        batch_p2p_comm=not gloo,
        **_no_cuda_graph_scope_warning(TransformerConfig),
    )


def _no_cuda_graph_scope_warning(config_class) -> dict:
    """megatron-core defaults its CUDA-graph scope to ``"full"`` (0.16: ``cuda_graph_scope``, 0.19:
    ``cuda_graph_modules``) and then warns on every config that "full" is deprecated in favour of the empty list it
    converts it to; giving that empty list is the same setting, without the warning."""
    defaults = getattr(config_class, "__dataclass_fields__", {})
    return {name: [] for name in ("cuda_graph_scope", "cuda_graph_modules")
            if name in defaults and defaults[name].default == "full"}


def layer_spec(cfg: Optional[TinyGPTConfig] = None):
    """``get_gpt_layer_local_spec()`` with the CP-capable core attention and SP-compatible layer norms (``cfg``'s
    normalization: :func:`norm_class`; the local spec's linear layers follow the ``TransformerConfig``, so
    SwiGLU and the bias flags need nothing here)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime_rc.demo.cp_attention import default_core_attention

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    norm = norm_class(cfg)
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    spec.submodules.self_attention.submodules.core_attention = default_core_attention()
    return spec


def model_device() -> torch.device:
    """Where the model and its sharded micro-batches live: this rank's GPU when CUDA is present, else the CPU (the
    unsharded micro-batches and the rollouts stay on the host)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _to_model_device(model: torch.nn.Module) -> None:
    """On a GPU: the chunk's parameters and buffers, and the RoPE ``inv_freq`` that megatron keeps as a plain
    attribute (``use_cpu_initialization`` left it on the CPU; ``Module.to`` does not see it)."""
    device = model_device()
    if device.type == "cpu":
        return
    model.to(device)
    for module in model.modules():
        freq = getattr(module, "inv_freq", None)
        if isinstance(freq, torch.Tensor) and freq.device != device:
            module.inv_freq = freq.to(device)


def build_model(cfg: TinyGPTConfig = TinyGPTConfig(), *, calculate_per_token_loss: bool = True,
                layout: Optional[ParallelLayout] = None) -> List[torch.nn.Module]:
    """Model chunks (one per virtual pipeline stage) of a ``GPTModel`` (RoPE, local spec, CP attention), with
    deterministic layout-invariant weights, each wrapped in megatron ``DistributedDataParallel``.  The
    ``TransformerConfig`` (``get_model_config(chunk)``) gets ``finalize_model_grads_func`` / ``no_sync_func`` set as
    megatron's training loop does; :func:`build_optimizer` adds ``grad_scale_func``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layout = layout or current_layout()
    if cfg.num_layers % (layout.pp * (layout.vpp or 1)):
        raise ValueError(f"num_layers={cfg.num_layers} must be divisible by pp*vpp={layout.pp * (layout.vpp or 1)}")
    config = transformer_config(cfg, layout, calculate_per_token_loss=calculate_per_token_loss)
    spec = layer_spec(cfg)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        block = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp),
                                           layer_norm=norm_class(cfg))
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_seq_len,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=True, share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope", rotary_base=cfg.rotary_base, vp_stage=vp)
        _init_weights(model, cfg)
        _to_model_device(model)
        model.tiny_gpt_config = cfg  # read back by config_of() (e.g. to check a checkpoint's architecture)
        chunks.append(model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
               for i, m in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def build_optimizer(model: List[torch.nn.Module], lr: float = 1e-3, *, clip_grad: float = 1.0e6,
                    weight_decay: float = 0.0, **optimizer_config):
    """megatron's ``get_megatron_optimizer`` (Adam, fp32, replicated -- not the distributed optimizer).  The
    default ``clip_grad`` is large: no clipping in practice, but the grad norm is computed and megatron's clipping
    path runs (patched on CPU).  ``optimizer_config``: more ``OptimizerConfig`` fields (``adam_eps``, ...)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.utils import get_model_config

    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                                 bf16=False, fp16=False, params_dtype=torch.float32,
                                 use_distributed_optimizer=False, **optimizer_config)
    optimizer = get_megatron_optimizer(opt_config, model)
    get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
    return optimizer


def _unwrap(chunk):
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def global_parameter_names(chunk) -> Dict[str, torch.nn.Parameter]:
    """``{global name: parameter}`` of one (DDP-wrapped or bare) model chunk: ``decoder.layers.<i>`` uses the
    global layer index; a tied output weight on the last PP stage is named like the word embedding."""
    model = _unwrap(chunk)
    local_to_global = {}
    if getattr(model, "decoder", None) is not None:
        for i, layer in enumerate(model.decoder.layers):
            local_to_global[i] = layer.layer_number - 1
    out = {}
    for name, p in model.named_parameters():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            name = f"decoder.layers.{local_to_global[int(m.group(1))]}.{m.group(2)}"
        if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
            name = "embedding.word_embeddings.weight"
        out[name] = p
    return out


def parameter_shapes(cfg: TinyGPTConfig) -> Dict[str, tuple]:
    """``{global name: full shape}`` of :func:`full_parameters` of ``build_model(cfg)`` (every layout gives the
    same), in megatron's order.  With ``h`` hidden, ``F`` ffn, ``hn = h / nh``, ``ng`` query groups (``nh`` when
    None): ``embedding.word_embeddings.weight [V, h]``; per layer ``l``: ``decoder.layers.<l>.input_layernorm.weight
    [h]`` (+ ``.bias`` with LayerNorm), ``self_attention.linear_qkv.weight [(nh + 2 ng) hn, h]`` (+ ``.bias`` when
    ``cfg.has_qkv_bias``), ``self_attention.linear_proj.weight [h, h]``, ``pre_mlp_layernorm``,
    ``mlp.linear_fc1.weight [F or 2F (gated), h]``, ``mlp.linear_fc2.weight [h, F]`` (+ ``.bias`` of proj / fc1 /
    fc2 with ``add_bias_linear``); ``decoder.final_layernorm``; ``output_layer.weight [V, h]`` unless tied."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    ng = cfg.num_query_groups or nh
    hn = h // nh
    fc1 = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    norm_bias = cfg.normalization == "LayerNorm"
    out = {"embedding.word_embeddings.weight": (cfg.vocab_size, h)}

    def norm(prefix):
        out[prefix + ".weight"] = (h,)
        if norm_bias:
            out[prefix + ".bias"] = (h,)

    for i in range(cfg.num_layers):
        pre = f"decoder.layers.{i}."
        norm(pre + "input_layernorm")
        out[pre + "self_attention.linear_qkv.weight"] = ((nh + 2 * ng) * hn, h)
        if cfg.has_qkv_bias:
            out[pre + "self_attention.linear_qkv.bias"] = ((nh + 2 * ng) * hn,)
        out[pre + "self_attention.linear_proj.weight"] = (h, nh * hn)
        if cfg.add_bias_linear:
            out[pre + "self_attention.linear_proj.bias"] = (h,)
        norm(pre + "pre_mlp_layernorm")
        out[pre + "mlp.linear_fc1.weight"] = (fc1, h)
        if cfg.add_bias_linear:
            out[pre + "mlp.linear_fc1.bias"] = (fc1,)
        out[pre + "mlp.linear_fc2.weight"] = (h, cfg.ffn_hidden_size)
        if cfg.add_bias_linear:
            out[pre + "mlp.linear_fc2.bias"] = (h,)
    norm("decoder.final_layernorm")
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = (cfg.vocab_size, h)
    return out


def config_of(model: List[torch.nn.Module]) -> TinyGPTConfig:
    """The :class:`TinyGPTConfig` that :func:`build_model` built ``model`` (its chunks) from."""
    cfg = getattr(_unwrap(model[0]), "tiny_gpt_config", None)
    if cfg is None:
        raise ValueError("config_of: the model was not built by slime_rc.demo.model.build_model (no "
                         "tiny_gpt_config on its first chunk); pass the TinyGPTConfig explicitly")
    return cfg


def _full_shape(p: torch.Tensor, tp: int):
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= tp
    return shape


def shard_full_parameter(full: torch.Tensor, p: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of a parameter's full value ``full`` (``_full_shape(p, tp)``), by ``p``'s megatron TP
    attributes: unsharded when not ``tensor_model_parallel``; else ``full`` is cut along ``partition_dim`` into
    ``tp * stride`` equal blocks and rank ``r`` holds blocks ``r, r + tp, ..., r + (stride - 1) * tp`` concatenated
    (megatron's ``_initialize_affine_weight_cpu``).  Stride 2 is a gated MLP's ``linear_fc1``: full
    ``cat(gate, up)`` ``[2F, h]``, rank ``r`` holds ``cat(gate_r, up_r)`` ``[2F / tp, h]``, the halves its
    ``chunk(2)`` in the forward splits."""
    if not getattr(p, "tensor_model_parallel", False) or tp == 1:
        return full
    stride = getattr(p, "partition_stride", 1)
    if stride == 1:
        return full.chunk(tp, dim=p.partition_dim)[tp_rank]
    blocks = full.chunk(tp * stride, dim=p.partition_dim)
    return torch.cat(blocks[tp_rank::tp], dim=p.partition_dim)


def _unshard(parts: List[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`shard_full_parameter`: the TP ranks' shards ``parts`` (rank order) -> the full value."""
    stride = getattr(p, "partition_stride", 1)
    if stride == 1:
        return torch.cat(parts, dim=p.partition_dim)
    pieces = [part.chunk(stride, dim=p.partition_dim) for part in parts]
    return torch.cat([pieces[r][s] for s in range(stride) for r in range(len(parts))], dim=p.partition_dim)


def _init_weights(model, cfg: TinyGPTConfig) -> None:
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in global_parameter_names(model).items():
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(name.encode()))
            shape = _full_shape(p, tp)
            noise = torch.randn(shape, generator=g, dtype=torch.float64)
            if p.dim() == 1 and ("norm" in name) and name.endswith("weight"):
                full = 1.0 + 0.1 * noise  # layer-norm gains (not all 1: sharding mistakes must show)
            elif p.dim() == 1:
                full = 0.02 * noise  # biases (not 0, same reason)
            else:
                full = cfg.init_std * noise
            p.copy_(shard_full_parameter(full, p, tp, tp_rank).to(p.dtype))


def load_full_parameters(model: List[torch.nn.Module], params: Dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) values ``{global name: tensor}`` -- :func:`full_parameters`' format -- into this
    rank's parameters of every chunk of ``model``, each sharded by its TP attributes (:func:`shard_full_parameter`)
    and cast to the parameter's dtype.  Every parameter of this rank's chunks must be in ``params`` with its full
    shape (a KeyError / ValueError names it); extra names (other pipeline stages' layers) are ignored.  Local, no
    collective.  Call it before :func:`build_optimizer` (an optimizer keeping fp32 main copies would not see it)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in model:
            for name, p in global_parameter_names(chunk).items():
                if name not in params:
                    raise KeyError(f"load_full_parameters: {name!r} is missing from the given parameters (the model "
                                   f"has it); give every name full_parameters(model) returns")
                full = params[name]
                if list(full.shape) != _full_shape(p, tp):
                    raise ValueError(f"load_full_parameters: {name!r} has shape {tuple(full.shape)}, the model's "
                                     f"full shape is {tuple(_full_shape(p, tp))}; the weights are from a model of "
                                     f"other sizes")
                p.copy_(shard_full_parameter(full.to(p.device), p, tp, tp_rank).to(p.dtype))


def full_parameters(model: List[torch.nn.Module]) -> Dict[str, torch.Tensor]:
    """Every parameter at full (unsharded) size under its global name, on every rank (gathered over TP, then over
    PP).  Collective over the model-parallel group."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group()
    local = {}
    for chunk in model:
        for name, p in global_parameter_names(chunk).items():
            t = p.detach()
            if getattr(p, "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = _unshard(parts, p)
            local.setdefault(name, t.clone())
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return local
    gathered: List[Any] = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(gathered, local, group=ps.get_pipeline_model_parallel_group())
    out = {}
    for d in gathered:
        for k, v in d.items():
            out.setdefault(k, v)
    return out


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------
_RESERVED = ("tokens", "cu_seqlens")


def stream_multiple(tp: int, pad_multiplier: int = 1) -> int:
    """What each rank's packed stream is padded to a multiple of (:func:`slime_rc.megatron.cp_layout.stream_padding`), as
    slime's ``get_batch`` does: ``tp * pad_multiplier`` (sequence parallelism splits the local tokens over TP)."""
    return int(tp) * int(pad_multiplier)


def shard_micro_batch(mb: dict, cp_size: int = 1, cp_rank: int = 0, *, stream_multiple: int = 1) -> dict:
    """This CP rank's part of a packed micro-batch (format in the module docstring), in slime's layout
    (:mod:`slime_rc.megatron.cp_layout`, the one copy of megatron's zigzag).

    Each sequence of ``n`` tokens is padded at its end to ``zigzag_padded_length(n, cp_size)`` (token 0, every
    per-token field 0 -- so ``loss_mask`` 0); rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r`` of every
    padded sequence.  The rank's packed stream is then padded at its end by ``stream_padding`` tokens to a
    multiple of ``stream_multiple`` (:func:`slime_rc.megatron.cp_layout.stream_padding`; :func:`train_step` passes
    ``tp * pad_multiplier``, as slime does -- a multiple of ``tp`` is what sequence parallelism needs): one more
    segment of the ``PackedSeqParams``, a model input only -- the loss never sees it.  Returns a dict with

    * ``tokens``, ``position_ids`` (position inside the padded sequence), ``targets`` (the next token of the same
      padded sequence, 0 at its last position) -- ``[T_local]`` int64, the sequences' tokens only;
    * every extra per-token field of ``mb``, sharded the same way ``[T_local, ...]``;
    * ``cu_seqlens`` ``[B+1]`` int64: boundaries of each sequence's positions on this rank (padded length / cp);
    * ``stream_padding`` (int): tokens :func:`model_inputs` appends to ``tokens`` / ``position_ids`` for the model;
    * ``packed_seq_params``: ``PackedSeqParams(qkv_format="thd")`` with the *global* ``cu_seqlens`` (int32, the
      stream-padding segment last: :func:`slime_rc.megatron.cp_layout.packed_cu_seqlens`) as ``cu_seqlens_q/kv`` and
      ``..._padded``, ``max_seqlen_q/kv`` the longest segment;
    * ``global_index`` ``[T_local]`` int64: index of each position in ``mb``'s packed order, -1 for padding;
    * ``cp_size``, ``cp_rank`` and the non-tensor entries of ``mb``.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime_rc.megatron.cp_layout import packed_cu_seqlens, packed_zigzag_positions, stream_padding

    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} not in [0, cp_size={cp_size})")
    tokens = mb["tokens"]
    cu = mb["cu_seqlens"].to(torch.int64)
    total = tokens.shape[0]
    if tokens.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"bad packed micro-batch: tokens {tuple(tokens.shape)}, cu_seqlens {cu.tolist()}")
    fields = {k: v for k, v in mb.items() if k not in _RESERVED and isinstance(v, torch.Tensor)}
    for k, v in fields.items():
        if v.shape[:1] != (total,):
            raise ValueError(f"per-token field {k!r} has shape {tuple(v.shape)}, expected [{total}, ...]")
    lengths = (cu[1:] - cu[:-1]).tolist()
    seq, pos = packed_zigzag_positions(lengths, cp_size, cp_rank)
    n = torch.tensor(lengths, dtype=torch.int64)[seq] if lengths else torch.zeros(0, dtype=torch.int64)
    start = cu[:-1][seq] if lengths else torch.zeros(0, dtype=torch.int64)
    valid = pos < n
    gidx = torch.where(valid, start + pos, torch.full_like(pos, -1))
    src = gidx.clamp(min=0)
    has_target = pos + 1 < n
    zeros = torch.zeros_like(src)

    out = {k: v for k, v in mb.items() if not isinstance(v, torch.Tensor)}
    out["tokens"] = torch.where(valid, tokens[src], zeros) if total else zeros
    out["position_ids"] = pos
    out["targets"] = torch.where(has_target, tokens[(src + 1).clamp(max=max(total - 1, 0))], zeros) if total else zeros
    for k, v in fields.items():
        out[k] = _take(v, gidx)
    local_lens = torch.bincount(seq, minlength=len(lengths)) if lengths else torch.zeros(0, dtype=torch.int64)
    out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), local_lens.cumsum(0)])
    padding = stream_padding(pos.numel(), stream_multiple, cp_size)
    out["stream_padding"] = padding
    cu_global = packed_cu_seqlens(lengths, cp_size, padding)
    max_len = int((cu_global[1:] - cu_global[:-1]).max()) if cu_global.numel() > 1 else 0
    cp_group = None
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            cp_group = ps.get_context_parallel_group()
    except ImportError:
        pass
    out["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_global, cu_seqlens_kv=cu_global, cu_seqlens_q_padded=cu_global,
        cu_seqlens_kv_padded=cu_global, max_seqlen_q=max_len, max_seqlen_kv=max_len, cp_group=cp_group)
    out["global_index"] = gidx
    out["cp_size"], out["cp_rank"] = cp_size, cp_rank
    return out


def _take(values: torch.Tensor, global_index: torch.Tensor) -> torch.Tensor:
    """``values[global_index]`` (a per-token field ``[T, ...]`` of the unsharded micro-batch), 0 where the index is
    -1 (padding)."""
    valid = global_index >= 0
    values = values.to(global_index.device)  # a host field of the unsharded micro-batch, for a sharded one on a GPU
    picked = (values[global_index.clamp(min=0)] if values.shape[0]
              else values.new_zeros((0,) + tuple(values.shape[1:])))
    mask = valid.view(-1, *([1] * (values.dim() - 1)))
    return torch.where(mask, picked, torch.zeros_like(picked))


def shard_field(local_mb: dict, values: torch.Tensor) -> torch.Tensor:
    """A per-token field of the micro-batch ``local_mb`` was sharded from (``[T, ...]``, its packed order) at
    ``local_mb``'s positions, exactly as :func:`shard_micro_batch` shards the fields it is given (0 on padding).
    For a field known only after sharding: the trainer's advantages wait for the pre-step correction of the local
    micro-batches (``slime_rc.demo.train.loop``)."""
    return _take(values, local_mb["global_index"])


def model_inputs(local_mb: dict):
    """``(input_ids, position_ids)`` ``[T_local + stream_padding]`` for the model: the sharded micro-batch's
    tokens and positions with the stream-padding segment appended (token 0; its own zigzag positions)."""
    from slime_rc.megatron.cp_layout import zigzag_token_positions

    tokens, positions = local_mb["tokens"], local_mb["position_ids"]
    padding = int(local_mb.get("stream_padding", 0))
    if padding:
        cp_size, cp_rank = int(local_mb.get("cp_size", 1)), int(local_mb.get("cp_rank", 0))
        tokens = torch.cat([tokens, tokens.new_zeros(padding)])
        positions = torch.cat([positions, zigzag_token_positions(padding * cp_size, cp_size, cp_rank,
                                                                 positions.device)])
    return tokens, positions


def gather_to_global(values: torch.Tensor, local_mb, group=None) -> torch.Tensor:
    """Per-token ``values [T_local, ...]`` computed on each CP rank -> ``[T, ...]`` in the packed order of the
    original micro-batch (padding dropped).  ``local_mb``: the sharded micro-batch (or its ``global_index``).
    Collective over ``group`` (default: the CP group) -- call it on every CP rank of the last stage."""
    from megatron.core import parallel_state as ps

    gidx = local_mb["global_index"] if isinstance(local_mb, dict) else local_mb
    if group is None:
        group = ps.get_context_parallel_group()
    n = dist.get_world_size(group)
    values = values.detach().contiguous()
    if n > 1:
        vals = [torch.empty_like(values) for _ in range(n)]
        idxs = [torch.empty_like(gidx) for _ in range(n)]
        dist.all_gather(vals, values, group=group)
        dist.all_gather(idxs, gidx.contiguous(), group=group)
        values, gidx = torch.cat(vals), torch.cat(idxs)
    keep = gidx >= 0
    total = int(keep.sum())
    out = values.new_full((total,) + tuple(values.shape[1:]), float("nan"))
    if total and (int(gidx[keep].max()) != total - 1 or torch.unique(gidx[keep]).numel() != total):
        raise ValueError("the gathered positions do not partition the micro-batch")
    out[gidx[keep]] = values[keep]
    return out


# ---------------------------------------------------------------------------------------------------------------
# one step
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    loss: Optional[float]  # the value optimised, reduced like the gradients (see module docstring); every rank
    grad_norm: Optional[float]  # megatron's total grad norm (None when forward_only)
    outputs: List[Any]  # per micro-batch ``logs`` of loss_fn, in order, on the last PP stage; [] elsewhere
    local_micro_batches: List[dict]  # the sharded micro-batches loss_fn saw (this rank)
    num_micro_batches: int  # M: this DP rank's micro-batches (global batch: dp * M)
    num_tokens: Optional[int] = None  # per-token convention: loss tokens summed over the global batch
    update_successful: Optional[bool] = None


def shard_for_step(model: List[torch.nn.Module], micro_batches: Sequence[dict]) -> List[dict]:
    """This rank's micro-batches exactly as :func:`train_step` shards them (CP zigzag, stream padding under SP),
    each with ``num_micro_batches``, ``dp_size`` and ``micro_batch_index`` -- for work before the step that needs
    the local tokens (e.g. ``slime_rc.megatron.loss.prepare_global_batch``); pass them back as
    ``local_micro_batches``."""
    from megatron.core.utils import get_model_config

    get_model_config(model[0])  # a model of the current layout
    return shard_for_layout(micro_batches)


def shard_for_layout(micro_batches: Sequence[dict]) -> List[dict]:
    """:func:`shard_for_step` from megatron's parallel state alone (no model): CP size and rank, TP size and the
    ``pad_multiplier`` of :func:`initialize_parallel`."""
    from megatron.core import parallel_state as ps

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    multiple = stream_multiple(ps.get_tensor_model_parallel_world_size(), current_layout().pad_multiplier)
    out = []
    for i, mb in enumerate(micro_batches):
        lmb = _on(shard_micro_batch(mb, cp, cp_rank, stream_multiple=multiple), model_device())
        lmb["num_micro_batches"], lmb["dp_size"] = len(micro_batches), ps.get_data_parallel_world_size()
        lmb["micro_batch_index"] = i
        out.append(lmb)
    return out


def _on(local_mb: dict, device: torch.device) -> dict:
    """A sharded micro-batch with its tensors (and its ``PackedSeqParams``' cu_seqlens) on ``device``."""
    if device.type == "cpu":
        return local_mb

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        return [move(x) for x in v] if isinstance(v, list) else v  # per-sample lists (with_sample_fields)

    out = {k: move(v) for k, v in local_mb.items()}
    p = out["packed_seq_params"]
    out["packed_seq_params"] = dataclasses.replace(p, **{k: move(getattr(p, k)) for k in (
        "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")})
    return out


def train_step(model: List[torch.nn.Module], optimizer, micro_batches: Sequence[dict],
               loss_fn: Callable[[torch.Tensor, dict], tuple], *, forward_only: bool = False,
               local_micro_batches: Optional[Sequence[dict]] = None) -> StepResult:
    """One optimizer step (or, ``forward_only``, a pass without backward/step; ``optimizer`` may then be None) over
    this DP rank's packed micro-batches (full sequences; sharded here with :func:`shard_micro_batch`: CP zigzag,
    stream padding under SP) with
    megatron's ``get_forward_backward_func()`` (no-pipelining / 1F1B / interleaved, variable sequence lengths,
    ``micro_batch_size=1`` packed ``thd``, ``seq_length`` = the longest padded micro-batch).

    ``M = len(micro_batches)`` micro-batches per DP rank; the global batch is ``dp * M`` micro-batches.  What is
    averaged (module docstring): per-token convention -- the sum of ``loss_fn``'s sums over all ``dp * M``
    micro-batches and CP shards divided by the sum of its token counts; legacy -- ``loss * cp`` averaged over the
    ``M`` micro-batches and the ``dp * cp`` ranks.  Interleaved PP on gloo needs ``M > pp`` (else the schedule
    deadlocks; a ValueError says so)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    current_layout()  # initialize_parallel() first
    config = get_model_config(model[0])
    per_token = bool(config.calculate_per_token_loss)
    cp = ps.get_context_parallel_world_size()
    n_mb = len(micro_batches)
    if n_mb == 0:
        raise ValueError("train_step: micro_batches is empty; give this DP rank at least one packed micro-batch")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    if vpp and vpp > 1 and not forward_only and dist.get_backend() == "gloo" and n_mb <= pp:
        # Measured (pp=2, vpp=2, M=2): rank 0 runs every micro-batch in warm-up and the interleaved schedule
        # deadlocks -- gloo's wait() on a send blocks the host until the peer posts the matching receive.
        raise ValueError(f"interleaved pipeline on gloo needs more micro-batches than pp={pp} per DP rank "
                         f"(got {n_mb}); use a multiple of pp >= 2 * pp")
    local_mbs = list(local_micro_batches) if local_micro_batches is not None else shard_for_step(model, micro_batches)

    records: List[tuple] = []

    def loss_wrapper(lmb, output_tensor):
        logits = output_tensor.squeeze(0)[:lmb["tokens"].numel()]  # the stream padding is no loss position
        result = loss_fn(logits, lmb)
        if per_token:
            if not (isinstance(result, tuple) and len(result) == 3):
                raise TypeError("calculate_per_token_loss=True: loss_fn must return (local_sum, num_tokens, logs)")
            loss, num_tokens, logs = result
            num_tokens = torch.as_tensor(num_tokens).detach().to(torch.int)
            records.append((loss.detach().double().clone(), int(num_tokens)))
            return loss, num_tokens, logs
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError("calculate_per_token_loss=False: loss_fn must return (loss, logs)")
        loss, logs = result
        records.append((loss.detach().double().clone() * cp / n_mb, 0))
        return loss, logs

    def forward_step(data_iterator, model_chunk):
        lmb = next(data_iterator)
        input_ids, position_ids = model_inputs(lmb)
        output = model_chunk(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0),
                             attention_mask=None, packed_seq_params=lmb["packed_seq_params"])
        return output, functools.partial(loss_wrapper, lmb)

    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    data_iterator = [iter(local_mbs) for _ in model] if len(model) > 1 else iter(local_mbs)
    seq_length = max(int(lmb["tokens"].numel()) + int(lmb.get("stream_padding", 0)) for lmb in local_mbs) * cp
    forward_backward = get_forward_backward_func()
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        outputs = forward_backward(forward_step_func=forward_step, data_iterator=data_iterator,
                                   model=model if len(model) > 1 else model[0], num_microbatches=n_mb,
                                   seq_length=seq_length, micro_batch_size=1, forward_only=forward_only)
    grad_norm, success = None, None
    if not forward_only:
        success, grad_norm, _ = optimizer.step()
        grad_norm = None if grad_norm is None else float(grad_norm)

    # the optimised value, reduced like the gradients
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    stat = torch.zeros(2, dtype=torch.float64, device=model_device())  # NCCL reduces device tensors only
    if last:
        for value, count in records:
            stat[0] += value
            stat[1] += count
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(stat, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(stat, group=dp_cp_group)
    if per_token:
        loss = float(stat[0] / stat[1]) if stat[1] > 0 else 0.0
        num_tokens = int(stat[1])
    else:
        loss = float(stat[0]) / dist.get_world_size(dp_cp_group)
        num_tokens = None
    return StepResult(loss=loss, grad_norm=grad_norm, outputs=list(outputs) if last else [],
                      local_micro_batches=local_mbs, num_micro_batches=n_mb, num_tokens=num_tokens,
                      update_successful=success)

