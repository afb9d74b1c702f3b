"""Hugging Face Qwen2 checkpoints for the demo model: our own converter, both ways, between megatron's full
parameters (``slime_rc.demo.model.full_parameters`` names) and a ``Qwen2ForCausalLM`` state dict; writing and
reading a local checkpoint directory (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``); the
``config.json`` <-> :class:`~slime_rc.demo.model.TinyGPTConfig` mapping; loading a directory into a (sharded)
megatron model.  No downloads, no ``transformers`` / ``safetensors`` package needed (both formats are written and
read here).

Name and layout mapping (``L`` a layer, ``nh`` heads, ``ng`` key/value groups, ``r = nh / ng``, ``hn`` head dim,
``h`` hidden, ``F`` intermediate size)::

    megatron (full_parameters)                      HF Qwen2 (state dict)
    embedding.word_embeddings.weight     [V, h]     model.embed_tokens.weight
    decoder.layers.L.input_layernorm.weight         model.layers.L.input_layernorm.weight
    decoder.layers.L.self_attention.linear_qkv.weight [(nh + 2 ng) hn, h]
        = rows of ng groups, each [q_{g r} .. q_{g r + r - 1}, k_g, v_g] (hn rows per head)
                                                    model.layers.L.self_attn.{q,k,v}_proj.weight
                                                        q [nh hn, h] (head j = rows j hn .. (j + 1) hn), k, v [ng hn, h]
    decoder.layers.L.self_attention.linear_qkv.bias (same interleave)  self_attn.{q,k,v}_proj.bias
    decoder.layers.L.self_attention.linear_proj.weight                  self_attn.o_proj.weight
    decoder.layers.L.pre_mlp_layernorm.weight                           post_attention_layernorm.weight
    decoder.layers.L.mlp.linear_fc1.weight [2F, h] = cat(gate, up)      mlp.gate_proj.weight, mlp.up_proj.weight [F, h]
    decoder.layers.L.mlp.linear_fc2.weight                              mlp.down_proj.weight
    decoder.final_layernorm.weight                                      model.norm.weight
    output_layer.weight (untied only)                                   lm_head.weight (untied only)

HF's query head ``j`` uses key/value head ``j // r`` (``repeat_kv``), megatron's query head ``g r + i`` belongs to
group ``g``: the same pairing, so the interleave is a pure reordering of rows and the round trip is bit-exact.
Only tensors are moved (no arithmetic), so any dtype round-trips exactly.

Directory format (what ``transformers`` writes and reads): ``config.json`` (:func:`hf_config`), weights in
``model.safetensors`` (8-byte little-endian header length, a JSON header ``{name: {dtype, shape, data_offsets}}``
padded with spaces to a multiple of 8, then the raw little-endian bytes) or ``pytorch_model.bin``
(``torch.save`` of the state dict); sharded checkpoints (``*.index.json`` with a ``weight_map``) are read too.
A tied model's file has no ``lm_head.weight`` (as ``transformers`` saves it).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from slime_rc.demo.model import QWEN2_ARCHITECTURE, TinyGPTConfig, parameter_shapes

__all__ = ["megatron_to_hf", "hf_to_megatron", "hf_config", "config_from_hf", "write_hf_checkpoint",
           "read_hf_checkpoint", "load_hf_checkpoint", "save_safetensors", "load_safetensors",
           "check_qwen2_architecture", "CONFIG_NAME", "SAFETENSORS_NAME", "BIN_NAME"]

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
BIN_NAME = "pytorch_model.bin"
_INDEX_NAMES = (SAFETENSORS_NAME + ".index.json", BIN_NAME + ".index.json")

# safetensors' dtype codes (the ones torch has)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}
_TORCH_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# buffers some Qwen2 checkpoints carry that are recomputed, not learned
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------------------------
# architecture
# ---------------------------------------------------------------------------------------------------------------
def check_qwen2_architecture(cfg: TinyGPTConfig) -> None:
    """``ValueError`` unless ``cfg``'s architecture is Qwen2's (``slime_rc.demo.model.QWEN2_ARCHITECTURE`` except
    the epsilon and the RoPE base, which are Qwen2 config values): the HF format below has no place for anything
    else (e.g. the default demo GPT's LayerNorm biases)."""
    for field in ("normalization", "gated_linear_unit", "activation", "add_bias_linear", "add_qkv_bias"):
        want, got = QWEN2_ARCHITECTURE[field], getattr(cfg, field)
        if got != want:
            raise ValueError(f"TinyGPTConfig({field}={got!r}): the HF Qwen2 format needs {field}={want!r}; build "
                             f"the model from slime_rc.demo.model.qwen2_tiny(...) (the Qwen2 architecture) to "
                             f"convert it")


def _dims(cfg: TinyGPTConfig) -> Tuple[int, int, int, int]:
    nh = cfg.num_attention_heads
    ng = cfg.num_query_groups or nh
    return nh, ng, nh // ng, cfg.hidden_size // nh


# ---------------------------------------------------------------------------------------------------------------
# the converter
# ---------------------------------------------------------------------------------------------------------------
def megatron_to_hf(params: Mapping[str, torch.Tensor], cfg: TinyGPTConfig) -> Dict[str, torch.Tensor]:
    """``full_parameters(model)`` of a Qwen2-architecture ``build_model(cfg)`` -> a ``Qwen2ForCausalLM`` state dict
    (module docstring).  Every name of ``parameter_shapes(cfg)`` must be there with its shape; other names are
    refused (a KeyError names them).  Returns new tensors (``clone``), same dtypes."""
    check_qwen2_architecture(cfg)
    _check_names(params, parameter_shapes(cfg), "megatron parameters", "full_parameters(model) of build_model(cfg)")
    nh, ng, r, hn = _dims(cfg)
    ffn = cfg.ffn_hidden_size
    out = {"model.embed_tokens.weight": params["embedding.word_embeddings.weight"].clone(),
           "model.norm.weight": params["decoder.final_layernorm.weight"].clone()}
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = params[m + "input_layernorm.weight"].clone()
        out[h + "post_attention_layernorm.weight"] = params[m + "pre_mlp_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            qkv = params[m + "self_attention.linear_qkv." + kind]
            grouped = qkv.reshape(ng, (r + 2) * hn, *qkv.shape[1:])  # [ng, (r + 2) hn, (h)]
            tail = tuple(qkv.shape[1:])
            out[h + "self_attn.q_proj." + kind] = grouped[:, :r * hn].reshape(nh * hn, *tail).clone()
            out[h + "self_attn.k_proj." + kind] = grouped[:, r * hn:(r + 1) * hn].reshape(ng * hn, *tail).clone()
            out[h + "self_attn.v_proj." + kind] = grouped[:, (r + 1) * hn:].reshape(ng * hn, *tail).clone()
        out[h + "self_attn.o_proj.weight"] = params[m + "self_attention.linear_proj.weight"].clone()
        fc1 = params[m + "mlp.linear_fc1.weight"]
        out[h + "mlp.gate_proj.weight"] = fc1[:ffn].clone()
        out[h + "mlp.up_proj.weight"] = fc1[ffn:].clone()
        out[h + "mlp.down_proj.weight"] = params[m + "mlp.linear_fc2.weight"].clone()
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["output_layer.weight"].clone()
    return out


def hf_parameter_shapes(cfg: TinyGPTConfig) -> Dict[str, tuple]:
    """``{name: shape}`` of the ``Qwen2ForCausalLM`` state dict of ``cfg`` (no ``lm_head.weight`` when tied)."""
    nh, ng, r, hn = _dims(cfg)
    h, ffn, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (nh * hn, h), p + "self_attn.q_proj.bias": (nh * hn,),
                    p + "self_attn.k_proj.weight": (ng * hn, h), p + "self_attn.k_proj.bias": (ng * hn,),
                    p + "self_attn.v_proj.weight": (ng * hn, h), p + "self_attn.v_proj.bias": (ng * hn,),
                    p + "self_attn.o_proj.weight": (h, nh * hn), p + "mlp.gate_proj.weight": (ffn, h),
                    p + "mlp.up_proj.weight": (ffn, h), p + "mlp.down_proj.weight": (h, ffn)})
    out["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def hf_to_megatron(state: Mapping[str, torch.Tensor], cfg: TinyGPTConfig) -> Dict[str, torch.Tensor]:
    """A ``Qwen2ForCausalLM`` state dict of ``cfg``'s sizes -> megatron full parameters (``full_parameters``
    names; :func:`slime_rc.demo.model.load_full_parameters` loads them into a model of any layout).  The inverse
    of :func:`megatron_to_hf`, bit-exact.  ``rotary_emb.inv_freq`` buffers are skipped; with tied embeddings an
    ``lm_head.weight`` equal to the embedding is accepted (some savers keep it), a different one refused.  Any
    other missing / unknown name or wrong shape raises, naming it.  Returns new tensors, same dtypes."""
    check_qwen2_architecture(cfg)
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_embeddings and "lm_head.weight" in state:
        if not torch.equal(state["lm_head.weight"], state.get("model.embed_tokens.weight", torch.empty(0))):
            raise ValueError("hf_to_megatron: tie_word_embeddings is true but lm_head.weight differs from "
                             "model.embed_tokens.weight; set tie_word_embeddings to false in config.json (an untied "
                             "model) or drop lm_head.weight from the weights")
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    _check_names(state, hf_parameter_shapes(cfg), "HF Qwen2 state dict",
                 "a Qwen2ForCausalLM state dict of the config's sizes")
    nh, ng, r, hn = _dims(cfg)
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"].clone()}
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "input_layernorm.weight"] = state[h + "input_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            q, k, v = (state[h + f"self_attn.{x}_proj." + kind] for x in "qkv")
            tail = tuple(q.shape[1:])
            qkv = torch.cat([q.reshape(ng, r * hn, *tail), k.reshape(ng, hn, *tail), v.reshape(ng, hn, *tail)], dim=1)
            out[m + "self_attention.linear_qkv." + kind] = qkv.reshape((nh + 2 * ng) * hn, *tail)
        out[m + "self_attention.linear_proj.weight"] = state[h + "self_attn.o_proj.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = state[h + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc1.weight"] = torch.cat([state[h + "mlp.gate_proj.weight"],
                                                      state[h + "mlp.up_proj.weight"]])  # megatron's [gate; up]
        out[m + "mlp.linear_fc2.weight"] = state[h + "mlp.down_proj.weight"].clone()
    out["decoder.final_layernorm.weight"] = state["model.norm.weight"].clone()
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"].clone()
    return {name: out[name] for name in parameter_shapes(cfg)}  # megatron's order


def _check_names(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple], what: str, expected: str) -> None:
    missing = [n for n in shapes if n not in tensors]
    extra = [n for n in tensors if n not in shapes]
    if missing or extra:
        parts = ([f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}"] if missing else []) + \
                ([f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}"] if extra else [])
        raise KeyError(f"{what}: {'; '.join(parts)}; expected {expected} (sizes and tie_embeddings of the config)")
    for n, s in shapes.items():
        if tuple(tensors[n].shape) != tuple(s):
            raise ValueError(f"{what}: {n!r} has shape {tuple(tensors[n].shape)}, the config gives {tuple(s)}; the "
                             f"weights are from a model of other sizes (check config.json)")


# ---------------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------------
def hf_config(cfg: TinyGPTConfig) -> Dict[str, Any]:
    """``config.json`` of a ``Qwen2ForCausalLM`` with ``cfg``'s sizes (``Qwen2Config``'s field names)."""
    check_qwen2_architecture(cfg)
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups or cfg.num_attention_heads, "hidden_act": cfg.activation,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": float(cfg.rotary_base), "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
        "attention_dropout": 0.0, "initializer_range": cfg.init_std, "use_cache": True,
        "torch_dtype": _TORCH_DTYPE_NAMES.get(cfg.dtype, "float32"),
    }


def _refuse(key: str, value: Any, why: str, fix: str) -> ValueError:
    return ValueError(f"config.json {key}={value!r}: {why}; {fix}")


def config_from_hf(config: Union[str, os.PathLike, Mapping[str, Any]], **overrides) -> TinyGPTConfig:
    """A HF ``config.json`` (a checkpoint directory, the file, or its dict) -> the Qwen2-architecture
    :class:`TinyGPTConfig` of the same model; ``overrides``: fields HF does not set (``seed``, ``dtype``,
    ``max_seq_len``, ...).  ``num_key_value_heads``, ``rms_norm_eps``, ``rope_theta``, ``tie_word_embeddings``,
    ``max_position_embeddings`` default as in ``Qwen2Config``; the sizes are required.  Refused, with a
    ``ValueError`` naming the key, its value and the fix: another ``model_type``, an activation other than silu,
    RoPE scaling, sliding-window attention, a ``head_dim`` other than ``hidden_size / num_attention_heads``,
    attention dropout, quantization, sizes that do not divide.  ``torch_dtype`` / ``dtype`` is not used: the demo
    trainer keeps its parameters in ``cfg.dtype`` (fp32 by default) and loading casts the weights to it."""
    if not isinstance(config, Mapping):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config_from_hf: no {CONFIG_NAME} at {path!r}; give a HF checkpoint directory "
                                    f"(config.json + weights), e.g. one written by write_hf_checkpoint")
        with open(path) as f:
            config = json.load(f)
    c = dict(config)
    model_type = c.get("model_type")
    if model_type != "qwen2":
        raise _refuse("model_type", model_type, "the demo builds the Qwen2 architecture only",
                      "give a Qwen2 checkpoint (model_type \"qwen2\", Qwen2ForCausalLM)")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in c:
            raise _refuse(key, None, "a size the model needs is missing", f"add \"{key}\" to config.json")
        value = c[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _refuse(key, value, "must be a positive integer", f"give {key} as an integer >= 1")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads)
    if kv is None:
        kv = heads
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or heads % kv:
        raise _refuse("num_key_value_heads", kv, f"must divide num_attention_heads={heads} (grouped-query "
                      f"attention shares each key/value head among heads / groups query heads)",
                      f"give a divisor of {heads}")
    if hidden % heads:
        raise _refuse("hidden_size", hidden, f"not a multiple of num_attention_heads={heads}",
                      f"give a multiple of {heads}")
    head_dim = hidden // heads
    if c.get("head_dim") is not None and c["head_dim"] != head_dim:
        raise _refuse("head_dim", c["head_dim"], f"the demo's attention uses hidden_size / num_attention_heads = "
                      f"{head_dim} per head", f"drop head_dim or set it to {head_dim}")
    if head_dim % 2:
        raise _refuse("hidden_size", hidden, f"head dim {head_dim} is odd; RoPE rotates pairs of channels",
                      "give hidden_size / num_attention_heads even")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse("hidden_act", act, "Qwen2's MLP is SwiGLU (silu gate)", "set \"hidden_act\": \"silu\"")
    rope_theta = c.get("rope_theta")
    rope_parameters = c.get("rope_parameters")  # transformers >= 5 moved rope_theta here
    if isinstance(rope_parameters, Mapping):
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            raise _refuse("rope_parameters.rope_type", rope_type, "the demo's RoPE has no scaling",
                          "use \"rope_type\": \"default\" (plain RoPE)")
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta")
    elif rope_parameters is not None:
        raise _refuse("rope_parameters", rope_parameters, "expected a dict", "give {\"rope_type\": \"default\", "
                      "\"rope_theta\": ...} or drop it")
    rope_theta = 10000.0 if rope_theta is None else rope_theta
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 1:
        raise _refuse("rope_theta", rope_theta, "the RoPE base must be a number > 1", "give e.g. 1000000.0")
    scaling = c.get("rope_scaling")
    if scaling not in (None, {}) and not (isinstance(scaling, Mapping)
                                          and scaling.get("rope_type", scaling.get("type")) == "default"):
        raise _refuse("rope_scaling", scaling, "the demo's RoPE has no scaling (YaRN, linear, dynamic)",
                      "set \"rope_scaling\": null (plain RoPE)")
    if c.get("use_sliding_window", False):
        raise _refuse("use_sliding_window", c["use_sliding_window"], "the demo's attention is full causal "
                      "attention", "set \"use_sliding_window\": false")
    dropout = c.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0):
        raise _refuse("attention_dropout", dropout, "the demo trains without dropout (its log-probs must be "
                      "deterministic for the correction)", "set \"attention_dropout\": 0.0")
    if c.get("quantization_config") is not None:
        raise _refuse("quantization_config", c["quantization_config"], "the demo loads unquantized weights only",
                      "give a checkpoint in float32 / bfloat16 / float16")
    eps = c.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise _refuse("rms_norm_eps", eps, "must be a number > 0", "give e.g. 1e-6 (Qwen2's default)")
    tie = c.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise _refuse("tie_word_embeddings", tie, "must be true or false", "give true or false")
    max_pos = c.get("max_position_embeddings", 32768)
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos < 1:
        raise _refuse("max_position_embeddings", max_pos, "must be a positive integer", "give e.g. 32768")
    fields = dict(vocab_size=c["vocab_size"], hidden_size=hidden, num_layers=c["num_hidden_layers"],
                  num_attention_heads=heads, num_query_groups=kv, ffn_hidden_size=c["intermediate_size"],
                  max_seq_len=max_pos, tie_embeddings=tie, **QWEN2_ARCHITECTURE)
    fields.update(norm_epsilon=float(eps), rotary_base=float(rope_theta))
    if isinstance(c.get("initializer_range"), (int, float)) and not isinstance(c.get("initializer_range"), bool):
        fields["init_std"] = float(c["initializer_range"])
    fields.update(overrides)
    return TinyGPTConfig(**fields)


# ---------------------------------------------------------------------------------------------------------------
# safetensors, our own (the format is an 8-byte header length, a JSON header, the raw bytes)
# ---------------------------------------------------------------------------------------------------------------
def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str,
                     metadata: Optional[Mapping[str, str]] = None) -> None:
    """Write ``tensors`` in the safetensors format (``metadata`` defaults to ``{"format": "pt"}``, which
    ``transformers`` expects).  Tensors are written contiguous, on the CPU, in their dtype (one of
    ``F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL``)."""
    if sys.byteorder != "little":
        raise RuntimeError("save_safetensors: safetensors stores little-endian bytes; this host is big-endian")
    header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_CODES:
            raise ValueError(f"save_safetensors: {name!r} has dtype {t.dtype}; give one of "
                             f"{sorted(str(d) for d in _ST_CODES)}")
        t = t.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_CODES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data start 8-byte aligned, as the safetensors library writes them
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)
    os.replace(tmp, path)


def load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """Read a safetensors file into ``{name: CPU tensor}`` (in the file's order); the header and every tensor's
    byte range are checked (a ValueError names the file and the tensor)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes); the file is truncated or "
                             f"not safetensors")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, which torch cannot hold here "
                             f"(known: {', '.join(_ST_DTYPES)})")
        shape, (start, end) = list(info["shape"]), info["data_offsets"]
        numel = 1
        for s in shape:
            numel *= int(s)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= start <= end <= len(data) or end - start != numel * itemsize:
            raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {shape}) has byte range [{start}, {end}) "
                             f"that does not fit the data ({len(data)} bytes); the file is corrupt")
        t = (torch.frombuffer(bytearray(data[start:end]), dtype=dtype) if numel
             else torch.empty(0, dtype=dtype))
        out[name] = t.reshape(shape)
    return out


# ---------------------------------------------------------------------------------------------------------------
# checkpoint directories
# ---------------------------------------------------------------------------------------------------------------
def write_hf_checkpoint(directory: str, params: Mapping[str, torch.Tensor], cfg: TinyGPTConfig, *,
                        weights_format: str = "safetensors") -> str:
    """Write megatron full parameters ``params`` (``full_parameters(model)`` of a Qwen2-architecture
    ``build_model(cfg)``) as a HF Qwen2 checkpoint directory: ``config.json`` (:func:`hf_config`) and the weights,
    ``model.safetensors`` (``weights_format="safetensors"``, written here: no package needed) or
    ``pytorch_model.bin`` (``"bin"``).  Creates ``directory``; returns the weights file's path."""
    if weights_format not in ("safetensors", "bin"):
        raise ValueError(f"write_hf_checkpoint(weights_format={weights_format!r}): give \"safetensors\" "
                         f"({SAFETENSORS_NAME}) or \"bin\" ({BIN_NAME})")
    state = megatron_to_hf(params, cfg)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(hf_config(cfg), f, indent=2)
        f.write("\n")
    if weights_format == "safetensors":
        path = os.path.join(directory, SAFETENSORS_NAME)
        save_safetensors(state, path)
    else:
        path = os.path.join(directory, BIN_NAME)
        torch.save(state, path)
    return path


def _load_weights_file(path: str) -> Dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        return load_safetensors(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: expected a state dict (name -> tensor), got {type(state).__name__}")
    return dict(state)


def read_hf_checkpoint(directory: str) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """``(config dict, HF state dict)`` of a checkpoint directory: ``config.json`` and the weights from the first
    of ``model.safetensors``, ``pytorch_model.bin``, ``model.safetensors.index.json``,
    ``pytorch_model.bin.index.json`` (sharded: every file of its ``weight_map``) that exists."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"HF checkpoint directory {directory!r} does not exist; give a directory with "
                                f"config.json and model.safetensors or pytorch_model.bin")
    config_path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"HF checkpoint {directory!r} has no {CONFIG_NAME}; a checkpoint directory needs it "
                                f"(write_hf_checkpoint writes one)")
    with open(config_path) as f:
        config = json.load(f)
    for name in (SAFETENSORS_NAME, BIN_NAME):
        if os.path.isfile(os.path.join(directory, name)):
            return config, _load_weights_file(os.path.join(directory, name))
    for name in _INDEX_NAMES:
        index_path = os.path.join(directory, name)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map", {})
            state: Dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                for k, v in _load_weights_file(os.path.join(directory, shard)).items():
                    if weight_map.get(k) == shard:
                        state[k] = v
            missing = sorted(set(weight_map) - set(state))
            if missing:
                raise ValueError(f"{index_path}: {missing[:4]} are listed in weight_map but not in their shard files")
            return config, state
    raise FileNotFoundError(f"HF checkpoint {directory!r} has no weights: expected {SAFETENSORS_NAME}, {BIN_NAME} "
                            f"or a sharded index ({', '.join(_INDEX_NAMES)})")


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "tie_embeddings", "normalization", "norm_epsilon", "gated_linear_unit",
                "activation", "add_bias_linear", "add_qkv_bias", "rotary_base")


def load_hf_checkpoint(model, directory: str, cfg: Optional[TinyGPTConfig] = None) -> TinyGPTConfig:
    """Load a HF Qwen2 checkpoint directory into ``model`` (the chunks of ``build_model(cfg)``, any layout): read
    it (:func:`read_hf_checkpoint`), convert (:func:`hf_to_megatron`), and copy this rank's shard of every
    parameter (:func:`slime_rc.demo.model.load_full_parameters`, cast to the parameters' dtype).  ``cfg``: the
    model's config (default: the one ``build_model`` recorded).  The checkpoint's architecture and sizes
    (:func:`config_from_hf`) must be the model's: a ValueError names the first field that differs and how to build
    a matching model.  Local (no collective); every rank reads the directory.  Call it before ``build_optimizer``.
    Returns the checkpoint's config."""
    from slime_rc.demo.model import config_of, load_full_parameters

    cfg = cfg if cfg is not None else config_of(model)
    config, state = read_hf_checkpoint(directory)
    ckpt_cfg = config_from_hf(config)
    for field in _SIZE_FIELDS:
        mine, theirs = getattr(cfg, field), getattr(ckpt_cfg, field)
        if field == "num_query_groups":
            mine, theirs = mine or cfg.num_attention_heads, theirs or ckpt_cfg.num_attention_heads
        if mine != theirs:
            raise ValueError(f"load_hf_checkpoint({directory!r}): the checkpoint's {field}={theirs!r} but the model's "
                             f"is {mine!r}; build the model from the checkpoint's config "
                             f"(slime_rc.demo.hf_checkpoint.config_from_hf(directory))")
    load_full_parameters(model, hf_to_megatron(state, ckpt_cfg))
    return ckpt_cfg
