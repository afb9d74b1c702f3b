"""The demo's Qwen2-architecture model (``slime_rc.demo.model.QWEN2_TINY``: RMSNorm, SwiGLU, q/k/v bias, RoPE base
1e6, GQA), its HF checkpoint converter (``slime_rc.demo.hf_checkpoint``) and its pure-torch forward
(``slime_rc.demo.rollout.torch_qwen2``).

Two spawns of real megatron-core on gloo (``tests.dist_utils.run_distributed``, module fixtures):

* one process: the untied preset, a tied variant and a 4-layer one -- weights, megatron's logits of fixed packed
  sequences; for the first two also HF checkpoint directories (safetensors and ``pytorch_model.bin``) written from a
  differently seeded model and loaded back, one Adam step, and a load refused for other sizes;
* four processes, three layouts one after the other (TP2 x CP2 with sequence parallelism, TP2 x PP2, and PP2 x
  VPP2 x DP2 for a 4-layer variant): the same weights and logits as one process, and (first two) the same
  checkpoint load and Adam step.

Everything else (round trips, the converter's row order, the torch forward's conventions, the config refusals,
the safetensors format) runs in the pytest process.  The comparison with ``transformers``' ``Qwen2ForCausalLM``
runs where ``transformers`` is installed (not in this project's CI environments: skipped there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import pytest
import torch

from slime_rc.demo.hf_checkpoint import (BIN_NAME, SAFETENSORS_NAME, config_from_hf, hf_config, hf_to_megatron,
                                         load_safetensors, megatron_to_hf, read_hf_checkpoint, save_safetensors,
                                         write_hf_checkpoint)
from slime_rc.demo.model import QWEN2_TINY, TinyGPTConfig, parameter_shapes, qwen2_tiny
from slime_rc.demo.rollout.in_process import TorchGPT
from slime_rc.demo.rollout.torch_qwen2 import TorchQwen2, is_default_architecture
from tests.dist_utils import run_distributed

VARIANTS = {"untied": QWEN2_TINY, "tied": qwen2_tiny(tie_embeddings=True, init_std=0.1),
            "deep": qwen2_tiny(num_layers=4)}  # 4 layers: a virtual pipeline of 2 x 2 stages
# layout -> (its kwargs, the variant it builds); the 4-process spawn runs them one after the other
LAYOUTS = {"tp2_cp2_sp": (dict(tp=2, cp=2, sequence_parallel=True), "untied"), "tp2_pp2": (dict(tp=2, pp=2), "untied"),
           "pp2_vpp2_dp2": (dict(pp=2, vpp=2), "deep")}
FULL = ("untied", "tied")  # the variants checked beyond weights and logits (checkpoints, a training step)
CKPT_SEED_OFFSET = 17  # the checkpoints come from a model seeded differently from the one they are loaded into
TOL = 1e-5  # fp32 logits: megatron vs the pure-torch forward vs transformers (summation order only)
STEP_TOL = 2e-6  # fp32 parameters after one Adam step, one process vs a layout


def fixed_sequences(vocab: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(n),), generator=g) for n in (3, 11, 7, 19, 2)]


def random_params(cfg: TinyGPTConfig, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in parameter_shapes(cfg).items()}


# ---------------------------------------------------------------------------------------------------------------
# the spawned workers
# ---------------------------------------------------------------------------------------------------------------
def _score(M, model, seqs, n_micro: int = 1):
    """Megatron's full logits ``[n, V]`` per sequence (forward only; the sequences packed into ``n_micro``
    micro-batches -- the interleaved pipeline needs at least pp of them) on the ranks of the last pipeline stage
    (gathered over TP, then CP); None elsewhere."""
    from megatron.core import parallel_state as ps

    groups = [list(range(len(seqs)))[i::n_micro] for i in range(n_micro)]
    mbs = []
    for idx in groups:
        cu = torch.tensor([0] + [seqs[i].numel() for i in idx]).cumsum(0)
        mbs.append(dict(tokens=torch.cat([seqs[i] for i in idx]), cu_seqlens=cu))

    def loss_fn(logits, lmb):
        return logits.sum() * 0, torch.tensor(1), {"logits": logits.detach().float()}

    r = M.train_step(model, None, mbs, loss_fn, forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    tp = ps.get_tensor_model_parallel_world_size()
    out = [None] * len(seqs)
    for idx, mb, o, lmb in zip(groups, mbs, r.outputs, r.local_micro_batches):
        local = o["logits"]
        if tp > 1:
            parts = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            local = torch.cat(parts, dim=-1)
        full = M.gather_to_global(local, lmb)
        cu = mb["cu_seqlens"]
        for j, i in enumerate(idx):
            out[i] = full[int(cu[j]):int(cu[j + 1])]
    return out


def _adam_step(M, model, seqs):
    """One Adam step (lr 1, eps 1: the update is g / (|g| + 1), close to the gradient itself) of a REINFORCE-like
    token loss; returns the full parameters after it."""
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0] + [s.numel() for s in seqs]).cumsum(0)
    mask = torch.ones(int(cu[-1]))
    mask[cu[1:] - 1] = 0
    mb = dict(tokens=torch.cat(seqs), cu_seqlens=cu, loss_mask=mask, advantages=torch.randn(int(cu[-1]), generator=g))

    def loss_fn(logits, lmb):
        from slime_rc.megatron.logprobs import vocab_parallel_log_probs
        logp = vocab_parallel_log_probs(logits, lmb["targets"], 1.0)
        return -(logp * lmb["advantages"] * lmb["loss_mask"]).sum(), lmb["loss_mask"].sum(), {}

    optimizer = M.build_optimizer(model, lr=1.0, adam_eps=1.0)
    M.train_step(model, optimizer, [mb], loss_fn)
    return M.full_parameters(model)


def single_worker(rank: int, world_size: int, root: str, seqs) -> dict:
    from slime_rc.demo import model as M
    from slime_rc.demo.hf_checkpoint import load_hf_checkpoint

    M.initialize_parallel()
    out = {}
    try:
        for name, cfg in VARIANTS.items():
            model = M.build_model(cfg)
            res = dict(params=M.full_parameters(model), logits=_score(M, model, seqs))
            out[name] = res
            if name not in FULL:
                continue
            other = M.build_model(dataclasses.replace(cfg, seed=cfg.seed + CKPT_SEED_OFFSET))
            res["ckpt_params"] = M.full_parameters(other)
            for fmt in ("safetensors", "bin"):
                directory = os.path.join(root, name, fmt)
                write_hf_checkpoint(directory, res["ckpt_params"], cfg, weights_format=fmt)
                target = M.build_model(cfg)
                load_hf_checkpoint(target, directory)
                res[f"loaded_params_{fmt}"] = M.full_parameters(target)
                res[f"loaded_logits_{fmt}"] = _score(M, target, seqs)
            res["stepped"] = _adam_step(M, M.build_model(cfg), seqs)
        try:
            load_hf_checkpoint(M.build_model(qwen2_tiny(num_layers=4)), os.path.join(root, "untied", "bin"))
            out["refused"] = None
        except ValueError as e:
            out["refused"] = str(e)
    finally:
        M.destroy_parallel()
    return out


def layout_worker(rank: int, world_size: int, root: str, seqs) -> dict:
    from megatron.core import parallel_state as ps

    from slime_rc.demo import model as M
    from slime_rc.demo.hf_checkpoint import load_hf_checkpoint

    out = {}
    for name, (layout, variant) in LAYOUTS.items():
        cfg = VARIANTS[variant]
        M.initialize_parallel(**layout)
        try:
            model = M.build_model(cfg)
            res = dict(params=M.full_parameters(model), logits=_score(M, model, seqs, 2 * layout.get("pp", 1)),
                       last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
                       sizes=(ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                              ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                              ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size()))
            out[name] = res
            if variant not in FULL:  # the interleaved schedule on gloo trains only with more micro-batches than pp
                continue
            load_hf_checkpoint(model, os.path.join(root, variant, "safetensors"))
            res["loaded_params"] = M.full_parameters(model)
            res["loaded_logits"] = _score(M, model, seqs)
            res["stepped"] = _adam_step(M, M.build_model(cfg), seqs)
        finally:
            M.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qwen2_ckpt"))


@pytest.fixture(scope="module")
def single(ckpt_root):
    return run_distributed(single_worker, 1, args=(ckpt_root, fixed_sequences()), timeout=240)[0]


@pytest.fixture(scope="module")
def layouts(single, ckpt_root):
    return run_distributed(layout_worker, 4, args=(ckpt_root, fixed_sequences()), timeout=300)


def _max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def _torch_logits(params, cfg, seqs, dtype=torch.float32):
    model = TorchQwen2(params, cfg, dtype=dtype)
    return [model.logits(s[None])[0] for s in seqs]


# ---------------------------------------------------------------------------------------------------------------
# megatron vs the pure-torch forward, checkpoints, layouts
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_logits_equal_the_torch_forward(single, variant):
    cfg, res = VARIANTS[variant], single[variant]
    seqs = fixed_sequences()
    ours = _torch_logits(res["params"], cfg, seqs)
    assert _max_diff(res["logits"], ours) < TOL
    # not a vacuous match: the logits vary across the vocabulary and positions
    assert min(float(lg.std()) for lg in ours if lg.shape[0] > 1) > 1e-2


def test_preset_is_the_qwen2_architecture(single):
    params = single["untied"]["params"]
    names = set(params)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names  # q/k/v bias
    assert not any(n.endswith(("linear_proj.bias", "linear_fc1.bias", "linear_fc2.bias", "layernorm.bias"))
                   for n in names)  # no o_proj / MLP bias, RMSNorm has no bias
    assert tuple(params["decoder.layers.0.mlp.linear_fc1.weight"].shape) == (2 * QWEN2_TINY.ffn_hidden_size, 64)
    assert tuple(params["decoder.layers.0.self_attention.linear_qkv.weight"].shape) == ((4 + 2 * 2) * 16, 64)
    assert "output_layer.weight" in names and "output_layer.weight" not in single["tied"]["params"]
    assert {n: tuple(t.shape) for n, t in params.items()} == parameter_shapes(QWEN2_TINY)


@pytest.mark.parametrize("variant", FULL)
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_loading_a_written_checkpoint(single, variant, fmt):
    cfg, res = VARIANTS[variant], single[variant]
    ckpt = res["ckpt_params"]
    assert any(not torch.equal(ckpt[n], res["params"][n]) for n in ckpt)  # the load has something to change
    loaded = res[f"loaded_params_{fmt}"]
    assert loaded.keys() == ckpt.keys()
    assert all(torch.equal(loaded[n], ckpt[n]) for n in ckpt)
    seqs = fixed_sequences()
    assert _max_diff(res[f"loaded_logits_{fmt}"], _torch_logits(ckpt, cfg, seqs)) < TOL
    assert _max_diff(res[f"loaded_logits_{fmt}"], res["logits"]) > 1e-3


def test_load_refuses_a_checkpoint_of_other_sizes(single):
    msg = single["refused"]
    assert msg is not None and "num_layers=2" in msg and "is 4" in msg and "config_from_hf" in msg


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_build_load_and_step_like_one_process(single, layouts, layout):
    kwargs, variant = LAYOUTS[layout]
    cfg, ref = VARIANTS[variant], single[variant]
    seqs = fixed_sequences()
    ranks = [r[layout] for r in layouts]
    want = (kwargs.get("tp", 1), kwargs.get("pp", 1), kwargs.get("vpp", 1), kwargs.get("cp", 1))
    assert {res["sizes"] for res in ranks} == {want + (4 // (want[0] * want[1] * want[3]),)}
    for res in ranks:  # layout-invariant weights: the full parameters are the one-process ones, bit for bit
        assert res["params"].keys() == ref["params"].keys()
        assert all(torch.equal(res["params"][n], ref["params"][n]) for n in ref["params"])
        if variant in FULL:
            assert all(torch.equal(res["loaded_params"][n], ref["ckpt_params"][n]) for n in ref["params"])
            for n, t in ref["stepped"].items():
                assert float((res["stepped"][n] - t).abs().max()) < STEP_TOL, (layout, n)
                assert not torch.equal(t, ref["params"][n])  # the step moved every parameter
    last = [res for res in ranks if res["last_stage"]]
    assert last and all(res["logits"] is not None for res in last)
    for res in last:
        assert _max_diff(res["logits"], _torch_logits(ref["params"], cfg, seqs)) < TOL
        if variant in FULL:
            assert _max_diff(res["loaded_logits"], _torch_logits(ref["ckpt_params"], cfg, seqs)) < TOL


# ---------------------------------------------------------------------------------------------------------------
# the converter (pytest process)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [QWEN2_TINY, qwen2_tiny(tie_embeddings=True), qwen2_tiny(num_attention_heads=8,
                                                                                        num_query_groups=8)],
                         ids=["gqa", "tied", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(cfg, dtype):
    params = random_params(cfg, dtype=dtype)
    hf = megatron_to_hf(params, cfg)
    back = hf_to_megatron(hf, cfg)
    assert list(back) == list(params)  # megatron's order
    assert all(torch.equal(back[n], params[n]) and back[n].dtype == dtype for n in params)
    again = megatron_to_hf(back, cfg)
    assert again.keys() == hf.keys() and all(torch.equal(again[n], hf[n]) for n in hf)
    assert ("lm_head.weight" in hf) == (not cfg.tie_embeddings)


def test_converter_row_order():
    """The interleave written out by index: HF query head j is megatron's group j // r, slot j % r; fc1 = [gate; up]."""
    cfg = QWEN2_TINY
    nh, ng, hn, h = 4, 2, 16, 64
    r = nh // ng
    params = random_params(cfg)
    hf = megatron_to_hf(params, cfg)
    qkv = params["decoder.layers.1.self_attention.linear_qkv.weight"]
    bias = params["decoder.layers.1.self_attention.linear_qkv.bias"]
    for j in range(nh):
        g, i = divmod(j, r)
        rows = slice(g * (r + 2) * hn + i * hn, g * (r + 2) * hn + (i + 1) * hn)
        assert torch.equal(hf["model.layers.1.self_attn.q_proj.weight"][j * hn:(j + 1) * hn], qkv[rows])
        assert torch.equal(hf["model.layers.1.self_attn.q_proj.bias"][j * hn:(j + 1) * hn], bias[rows])
    for g in range(ng):
        k_rows = slice(g * (r + 2) * hn + r * hn, g * (r + 2) * hn + (r + 1) * hn)
        v_rows = slice(g * (r + 2) * hn + (r + 1) * hn, (g + 1) * (r + 2) * hn)
        assert torch.equal(hf["model.layers.1.self_attn.k_proj.weight"][g * hn:(g + 1) * hn], qkv[k_rows])
        assert torch.equal(hf["model.layers.1.self_attn.v_proj.weight"][g * hn:(g + 1) * hn], qkv[v_rows])
    fc1 = params["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], fc1[:cfg.ffn_hidden_size])
    assert torch.equal(hf["model.layers.0.mlp.up_proj.weight"], fc1[cfg.ffn_hidden_size:])
    assert tuple(hf["model.layers.0.self_attn.k_proj.weight"].shape) == (ng * hn, h)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_round_trip_through_a_directory(tmp_path, fmt):
    cfg = qwen2_tiny(tie_embeddings=True, rotary_base=5e5, norm_epsilon=1e-5, max_seq_len=64)
    params = random_params(cfg, seed=3)
    path = write_hf_checkpoint(str(tmp_path), params, cfg, weights_format=fmt)
    assert os.path.basename(path) == (SAFETENSORS_NAME if fmt == "safetensors" else BIN_NAME)
    config, state = read_hf_checkpoint(str(tmp_path))
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    assert "lm_head.weight" not in state  # tied: as transformers saves it
    back_cfg = config_from_hf(str(tmp_path), seed=cfg.seed)
    assert back_cfg == cfg
    back = hf_to_megatron(state, back_cfg)
    assert all(torch.equal(back[n], params[n]) for n in params) and back.keys() == params.keys()


def test_config_json_fields():
    c = hf_config(qwen2_tiny(num_layers=3, rotary_base=2e6))
    expect = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=2e6, vocab_size=16,
                  max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32", hidden_act="silu")
    assert {k: c[k] for k in expect} == expect
    assert json.loads(json.dumps(c)) == c


def test_sharded_index_is_read(tmp_path):
    cfg = QWEN2_TINY
    params = random_params(cfg, seed=4)
    write_hf_checkpoint(str(tmp_path), params, cfg)
    state = load_safetensors(str(tmp_path / SAFETENSORS_NAME))
    os.remove(tmp_path / SAFETENSORS_NAME)
    names = list(state)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for file, part in shards.items():
        save_safetensors({n: state[n] for n in part}, str(tmp_path / file))
    with open(tmp_path / (SAFETENSORS_NAME + ".index.json"), "w") as f:
        json.dump({"weight_map": {n: file for file, part in shards.items() for n in part}}, f)
    _, read = read_hf_checkpoint(str(tmp_path))
    back = hf_to_megatron(read, cfg)
    assert all(torch.equal(back[n], params[n]) for n in params)


# ---------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------
GOOD = hf_config(QWEN2_TINY)


@pytest.mark.parametrize("key,value,fix", [
    ("model_type", "llama", "Qwen2 checkpoint"),
    ("hidden_act", "gelu", '"hidden_act": "silu"'),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, '"rope_scaling": null'),
    ("use_sliding_window", True, '"use_sliding_window": false'),
    ("num_key_value_heads", 3, "give a divisor of 4"),
    ("hidden_size", 66, "give a multiple of 4"),
    ("head_dim", 32, "set it to 16"),
    ("attention_dropout", 0.1, '"attention_dropout": 0.0'),
    ("rms_norm_eps", -1.0, "give e.g. 1e-6"),
    ("rope_theta", 0.5, "give e.g. 1000000.0"),
    ("intermediate_size", None, "give intermediate_size as an integer"),
    ("quantization_config", {"quant_method": "gptq"}, "float32 / bfloat16 / float16"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, '"rope_type": "default"'),
])
def test_config_refusals_name_key_value_and_fix(key, value, fix):
    bad = dict(GOOD, **{key: value})
    with pytest.raises(ValueError) as e:
        config_from_hf(bad)
    msg = str(e.value)
    assert f"config.json {key if key != 'rope_parameters' else 'rope_parameters.rope_type'}=" in msg
    assert repr(value if key != "rope_parameters" else value["rope_type"]) in msg and fix in msg
    assert config_from_hf(GOOD, seed=QWEN2_TINY.seed) == QWEN2_TINY  # the unmodified config is accepted


def test_missing_size_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match=r"config.json num_hidden_layers=None: .*add \"num_hidden_layers\""):
        config_from_hf({k: v for k, v in GOOD.items() if k != "num_hidden_layers"})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        config_from_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(GOOD))
    with pytest.raises(FileNotFoundError, match="has no weights: expected model.safetensors"):
        read_hf_checkpoint(str(tmp_path))


def test_non_qwen2_architecture_and_wrong_weights_are_refused():
    with pytest.raises(ValueError, match=r"normalization='LayerNorm'.*qwen2_tiny"):
        hf_config(TinyGPTConfig())
    with pytest.raises(ValueError, match=r"normalization='LayerNorm'"):
        megatron_to_hf(random_params(TinyGPTConfig()), TinyGPTConfig())
    params = random_params(QWEN2_TINY)
    hf = megatron_to_hf(params, QWEN2_TINY)
    with pytest.raises(KeyError, match=r"missing \['model.layers.0.mlp.up_proj.weight'\]"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.0.mlp.up_proj.weight"}, QWEN2_TINY)
    with pytest.raises(KeyError, match=r"unexpected \['model.layers.2.input_layernorm.weight'\]"):
        hf_to_megatron(dict(hf, **{"model.layers.2.input_layernorm.weight": torch.ones(64)}), QWEN2_TINY)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(16, 32\)"):
        hf_to_megatron(dict(hf, **{"lm_head.weight": torch.ones(16, 32)}), QWEN2_TINY)
    tied = qwen2_tiny(tie_embeddings=True)
    tied_hf = megatron_to_hf(random_params(tied), tied)
    ok = hf_to_megatron(dict(tied_hf, **{"lm_head.weight": tied_hf["model.embed_tokens.weight"].clone()}), tied)
    assert "output_layer.weight" not in ok  # an lm_head equal to the embedding is accepted and dropped
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_megatron(dict(tied_hf, **{"lm_head.weight": torch.zeros(16, 64)}), tied)


def test_tiny_gpt_config_refuses_unknown_architecture_values():
    with pytest.raises(ValueError, match=r"normalization='BatchNorm'.*'LayerNorm', 'RMSNorm'"):
        TinyGPTConfig(normalization="BatchNorm")
    with pytest.raises(ValueError, match=r"activation='relu'.*'gelu', 'silu'"):
        TinyGPTConfig(activation="relu")


# ---------------------------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------------------------
def test_safetensors_layout_and_dtypes(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6).view(2, 3),
               "d": torch.tensor([True, False, True]), "e": torch.zeros(0, 4, dtype=torch.float16)}
    path = str(tmp_path / "x.safetensors")
    save_safetensors(tensors, path)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0  # the data start aligned
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"] == {"format": "pt"} and header["b"]["dtype"] == "BF16"
    assert header["a"]["data_offsets"] == [0, 60] and len(raw) == 8 + n + header["e"]["data_offsets"][1]
    back = load_safetensors(path)
    assert list(back) == list(tensors)
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
    open(path, "wb").write(raw[:-4])  # truncated
    with pytest.raises(ValueError, match="does not fit the data"):
        load_safetensors(path)


def test_safetensors_package_reads_ours_and_we_read_its(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "b": torch.randn(5).to(torch.bfloat16)}
    ours = str(tmp_path / "ours.safetensors")
    save_safetensors(tensors, ours)
    assert all(torch.equal(st.load_file(ours)[k], t) for k, t in tensors.items())
    theirs = str(tmp_path / "theirs.safetensors")
    st.save_file(tensors, theirs, metadata={"format": "pt"})
    assert all(torch.equal(load_safetensors(theirs)[k], t) for k, t in tensors.items())


# ---------------------------------------------------------------------------------------------------------------
# the pure-torch forward
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, dict(num_query_groups=2, tie_embeddings=True)], ids=["mha", "gqa_tied"])
def test_torch_qwen2_is_torch_gpt_on_the_default_architecture(overrides):
    cfg = TinyGPTConfig(num_layers=2, **overrides)
    params = {n: 0.1 * t for n, t in random_params(cfg, seed=1).items()}
    tokens = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([0, 2, 5])
    ours, theirs = TorchQwen2(params, cfg).logits(tokens, pad), TorchGPT(params, cfg).logits(tokens, pad)
    assert torch.equal(ours, theirs)
    assert is_default_architecture(cfg) and not is_default_architecture(QWEN2_TINY)
    assert not is_default_architecture(dataclasses.replace(cfg, rotary_base=5e5))


def test_dtype_names_are_the_rollout_engines():
    from slime_rc.demo.rollout import in_process, torch_qwen2
    assert torch_qwen2._DTYPES == in_process.DTYPES  # the copy (torch_qwen2 cannot import in_process) has not drifted
    assert torch_qwen2.resolve_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype 'fp8' not supported; use one of \['fp32', 'bf16', 'fp16'\]"):
        torch_qwen2.resolve_dtype("fp8")


def test_torch_qwen2_conventions():
    cfg = QWEN2_TINY
    params = {n: (t if "norm" not in n else 1 + 0.1 * t) * (0.3 if t.dim() == 2 else 0.1)
              for n, t in random_params(cfg, seed=6).items()}
    model = TorchQwen2(params, cfg)
    seq = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(7))
    ref = model.logits(seq)[0]
    # left padding: the padded row computes the unpadded sequence's logits (positions restart, pad keys masked)
    padded = torch.cat([torch.full((1, 3), 9), seq], dim=1)
    assert float((model.logits(padded, torch.tensor([3]))[0, 3:] - ref).abs().max()) < 1e-5
    assert float((model.logits(padded)[0, 3:] - ref).abs().max()) > 1e-3  # without pad: another function
    # the RoPE base is used: another base, other logits
    other = TorchQwen2(params, dataclasses.replace(cfg, rotary_base=10000))
    assert float((other.logits(seq)[0] - ref).abs().max()) > 1e-4
    # low precision really is low precision, and close
    bf = TorchQwen2(params, cfg, dtype="bf16")
    assert bf.p["decoder.layers.0.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    low = bf.logits(seq)[0]
    assert low.dtype == torch.bfloat16 and 0 < float((low.float() - ref).abs().max()) < 0.1
    # the weights are copied: a later in-place update does not leak in
    params["decoder.final_layernorm.weight"].mul_(2)
    assert torch.equal(model.logits(seq)[0], ref)
    lp = model.log_probs(seq, temperature=0.7)
    expect = torch.log_softmax(ref[:-1] / 0.7, -1).gather(-1, seq[0, 1:, None])[:, 0]
    assert lp.shape == (1, 7) and torch.allclose(lp[0], expect, atol=1e-6)
    with pytest.raises(ValueError, match=r"'decoder.layers.0.mlp.linear_fc1.weight' has shape \(128, 64\)"):
        TorchQwen2(dict(params, **{"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(128, 64)}), cfg)


# ---------------------------------------------------------------------------------------------------------------
# transformers (only where it is installed)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", FULL)
def test_transformers_qwen2_logits_match(single, ckpt_root, variant):
    transformers = pytest.importorskip("transformers")
    cfg, res = VARIANTS[variant], single[variant]
    directory = os.path.join(ckpt_root, variant, "safetensors")
    # the dtype argument was renamed (torch_dtype -> dtype) across transformers versions: cast after loading
    hf = transformers.Qwen2ForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    seqs = fixed_sequences()
    with torch.no_grad():
        theirs = [hf(input_ids=s[None]).logits[0] for s in seqs]
    assert _max_diff(theirs, res["loaded_logits_safetensors"]) < TOL  # megatron, loaded from the same directory
    assert _max_diff(theirs, _torch_logits(res["ckpt_params"], cfg, seqs)) < TOL
    # and back: transformers' own state dict converts to the megatron parameters that were written
    state = {k: v for k, v in hf.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    back = hf_to_megatron(state, cfg)
    assert all(torch.equal(back[n], res["ckpt_params"][n]) for n in back)


# ---------------------------------------------------------------------------------------------------------------
# the trainer's wiring: --model, --hf-checkpoint, the rollout engine's forward
# ---------------------------------------------------------------------------------------------------------------
def test_rollout_engine_runs_the_forward_of_the_config():
    from slime_rc.demo.rollout.in_process import RolloutEngine, forward_class
    assert forward_class(TinyGPTConfig()) is TorchGPT and forward_class(QWEN2_TINY) is TorchQwen2
    params = {n: 0.3 * t for n, t in random_params(QWEN2_TINY, seed=8).items()}
    engine = RolloutEngine(QWEN2_TINY, temperature=1.0, seed=0)
    engine.load_weights(params)
    assert isinstance(engine.model, TorchQwen2)
    prompt = torch.tensor([3, 1, 4, 1, 5])
    sample = engine.generate([prompt], 4)[0]
    full = torch.cat([prompt, sample["response"]])
    logp = torch.log_softmax(TorchQwen2(params, QWEN2_TINY).logits(full[None])[0].float(), -1)
    expect = logp[prompt.numel() - 1:-1].gather(-1, sample["response"][:, None])[:, 0]
    assert sample["response"].numel() == 4 and torch.allclose(sample["rollout_log_probs"], expect, atol=1e-6)


def test_train_settings_model_and_checkpoint(tmp_path):
    from slime_rc.demo.train.loop import TrainSettings
    s = TrainSettings(model="qwen2-tiny")
    s.check_values()
    assert s.model_config() == qwen2_tiny(max_seq_len=4 * (s.digits + 2) + 8, seed=1234)
    assert TrainSettings().model_config().normalization == "LayerNorm"  # the default stays the demo's GPT
    with pytest.raises(ValueError, match=r"--model gpt2: not a demo model; give one of tiny-gpt, qwen2-tiny"):
        TrainSettings(model="gpt2").check_values()
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size 4: the Qwen2 model's 2 key/value groups"):
        TrainSettings(model="qwen2-tiny", tp=4).check_values()
    cfg = qwen2_tiny(num_layers=4, seed=5)
    write_hf_checkpoint(str(tmp_path), random_params(cfg), cfg)
    with pytest.raises(ValueError, match=r"--hf-checkpoint .*: a HF checkpoint holds a Qwen2 model; give --model "
                                         r"qwen2-tiny with it"):
        TrainSettings(hf_checkpoint=str(tmp_path)).check_values()
    s = TrainSettings(model="qwen2-tiny", hf_checkpoint=str(tmp_path), pp=4)  # the checkpoint's 4 layers, not 2
    s.check_values()
    assert s.model_config() == dataclasses.replace(cfg, seed=1234)
    with pytest.raises(ValueError, match=r"--hf-checkpoint .*: its 4 layers do not split over 3 pipeline stages"):
        TrainSettings(model="qwen2-tiny", hf_checkpoint=str(tmp_path), pp=3).check_values()
    bad = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(bad, hidden_act="gelu")))
    with pytest.raises(ValueError, match=r"--hf-checkpoint .*: config.json hidden_act='gelu': .*\"hidden_act\": "
                                         r"\"silu\""):
        TrainSettings(model="qwen2-tiny", hf_checkpoint=str(tmp_path)).check_values()
