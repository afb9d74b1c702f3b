"""Tests of the rollout side (``slime_rc.demo.rollout``): the pure-torch engine against the real megatron model, the
mismatch knobs, sampling, stopping, and the SGLang client/parser.

One 1-process gloo spawn (module fixture, ``tests.dist_utils.run_distributed``) builds ``build_model`` for four
``TinyGPTConfig`` variants (default, tied embeddings, GQA with 2 query groups, ``init_std=0.2`` = "peaked": a random
model whose next-token distributions are far from uniform) and scores fixed sequences with megatron's forward +
``vocab_parallel_log_probs``.  In the same process, rollout engines (fp32 / fp16 / bf16 / logit noise) generate from
the default model and megatron scores those generations too (the production pipeline: the engine samples, the
trainer re-scores); one Adam step then gives a second weight version for the staleness test.  Everything else runs
in the pytest process.
"""

from __future__ import annotations

import http.server
import json
import math
import time

import pytest
import torch

from slime_rc.demo.model import TinyGPTConfig
from slime_rc.demo.rollout import (RolloutEngine, SGLangEngine, TorchGPT, response_tokens_from_meta_info,
                              rollout_log_probs_from_meta_info, sampling_mask)
from tests.dist_utils import run_distributed
from tests.local_http import LocalServer, answer

FIXED_T = 0.7  # temperature for the fixed sequences (both sides divide by it)
GEN_T = 0.9  # rollout temperature of the generations scored by megatron
VARIANTS = {"base": {}, "tied": dict(tie_embeddings=True), "gqa": dict(num_query_groups=2),
            "peaked": dict(init_std=0.2)}
GEN_KNOBS = {"fp32": {}, "fp16": dict(dtype="fp16"), "bf16": dict(dtype="bf16"),
             "noise0.1": dict(logit_noise=0.1), "noise0.5": dict(logit_noise=0.5)}
N_PROMPTS, MAX_NEW = 64, 12
TOL = 1e-5


# ---------------------------------------------------------------------------------------------------------------
# data and the spawned worker
# ---------------------------------------------------------------------------------------------------------------
def fixed_sequences(seed: int = 0, n: int = 8, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(m),), generator=g) for m in torch.randint(2, 40, (n,), generator=g)]


def make_prompts(seed: int = 1, n: int = N_PROMPTS, vocab: int = 128, lo: int = 3, hi: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(m),), generator=g) for m in torch.randint(lo, hi, (n,), generator=g)]


def _megatron_score(M, model, seqs, temperature):
    """Megatron forward-only over one packed micro-batch -> per sequence (log-probs ``[n - 1]`` of tokens 1..n-1,
    logits ``[n, V]``)."""
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs

    cu = torch.tensor([0] + [s.numel() for s in seqs], dtype=torch.int64).cumsum(0)
    mb = dict(tokens=torch.cat(seqs), cu_seqlens=cu)

    def loss_fn(logits, lmb):
        logp = vocab_parallel_log_probs(logits, lmb["targets"], temperature)
        return logits.sum() * 0, torch.tensor(1), {"logp": logp.detach(), "logits": logits.detach().float()}

    r = M.train_step(model, None, [mb], loss_fn, forward_only=True)
    lmb = r.local_micro_batches[0]
    logp = M.gather_to_global(r.outputs[0]["logp"], lmb)
    logits = M.gather_to_global(r.outputs[0]["logits"], lmb)
    return [(logp[int(cu[i]):int(cu[i + 1]) - 1], logits[int(cu[i]):int(cu[i + 1])]) for i in range(len(seqs))]


def _reinforce_step(M, model, optimizer, seqs):
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0] + [s.numel() for s in seqs], dtype=torch.int64).cumsum(0)
    mask = torch.ones(int(cu[-1]))
    mask[cu[1:] - 1] = 0
    mb = dict(tokens=torch.cat(seqs), cu_seqlens=cu, loss_mask=mask, advantages=torch.randn(int(cu[-1]), generator=g))

    def loss_fn(logits, lmb):
        from slime_rc.megatron.logprobs import vocab_parallel_log_probs
        logp = vocab_parallel_log_probs(logits, lmb["targets"], FIXED_T)
        return -(logp * lmb["advantages"] * lmb["loss_mask"]).sum(), lmb["loss_mask"].sum(), {}

    M.train_step(model, optimizer, [mb], loss_fn)


def rollout_worker(rank: int, world_size: int, seqs, prompts) -> dict:
    from slime_rc.demo import model as M
    M.initialize_parallel()
    out = {}
    try:
        for name, overrides in VARIANTS.items():
            cfg = TinyGPTConfig(**overrides)
            model = M.build_model(cfg)
            optimizer = M.build_optimizer(model, lr=1e-3)
            params0 = M.full_parameters(model)
            res = dict(params0=params0, fixed0=_megatron_score(M, model, seqs, FIXED_T))
            if name == "base":
                gens = {}
                for knob, kwargs in GEN_KNOBS.items():
                    engine = RolloutEngine(cfg, temperature=GEN_T, seed=11, noise_seed=5, **kwargs)
                    engine.load_weights(params0)
                    samples = engine.generate(prompts, MAX_NEW)
                    full = [torch.cat([s["prompt"], s["response"]]) for s in samples]
                    scored = _megatron_score(M, model, full, GEN_T)
                    train = [lp[-s["response"].numel():] for (lp, _), s in zip(scored, samples)]
                    gens[knob] = dict(samples=samples, train=train)
                res["gens"] = gens
                _reinforce_step(M, model, optimizer, seqs)
                res["params1"] = M.full_parameters(model)
                res["fixed1"] = _megatron_score(M, model, seqs, FIXED_T)
            out[name] = res
    finally:
        M.destroy_parallel()
    return out


@pytest.fixture(scope="module")
def mega():
    return run_distributed(rollout_worker, 1, args=(fixed_sequences(), make_prompts()), timeout=180)[0]


def mismatch(train: torch.Tensor, rollout: torch.Tensor) -> dict:
    d = (train - rollout).double()
    return dict(mean=float(d.abs().mean()), p99=float(torch.quantile(d.abs(), 0.99)),
                k3=float((d.exp() - 1 - d).mean()))  # r = pi_train / pi_rollout; k3 estimates KL(rollout || train)


def cat_gen(g):
    return (torch.cat(g["train"]), torch.cat([s["rollout_log_probs"] for s in g["samples"]]))


# ---------------------------------------------------------------------------------------------------------------
# (a) the pure-torch forward equals megatron's
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_gpt_matches_megatron(mega, variant):
    cfg = TinyGPTConfig(**VARIANTS[variant])
    res = mega[variant]
    model = TorchGPT(res["params0"], cfg)
    for seq, (ref_lp, ref_logits) in zip(fixed_sequences(), res["fixed0"]):
        assert (model.log_probs(seq[None], FIXED_T)[0] - ref_lp).abs().max() <= TOL
        assert (model.logits(seq[None])[0] - ref_logits).abs().max() <= TOL
    # the batched, left-padded path of the engine (every sequence scored after its first token)
    engine = RolloutEngine(cfg, temperature=FIXED_T)
    engine.load_weights(res["params0"])
    seqs = fixed_sequences()
    got = engine.score([s[:1] for s in seqs], [s[1:] for s in seqs])
    for g, (ref_lp, _) in zip(got, res["fixed0"]):
        assert (g - ref_lp).abs().max() <= TOL


def test_tied_state_dict_has_no_output_layer(mega):
    assert "output_layer.weight" not in mega["tied"]["params0"]
    assert "output_layer.weight" in mega["base"]["params0"]
    with pytest.raises(KeyError, match="output_layer.weight"):
        TorchGPT(mega["tied"]["params0"], TinyGPTConfig())  # untied config, tied weights: named, not guessed


def test_fp32_generation_matches_trainer(mega):
    g = mega["base"]["gens"]["fp32"]
    train, rollout = cat_gen(g)
    assert train.numel() == N_PROMPTS * MAX_NEW
    assert (train - rollout).abs().max() <= TOL
    for s in g["samples"]:
        assert s["response"].numel() == s["rollout_log_probs"].numel() == MAX_NEW


# ---------------------------------------------------------------------------------------------------------------
# (b) the knobs
# ---------------------------------------------------------------------------------------------------------------
def test_dtype_mismatch_order(mega):
    gens = mega["base"]["gens"]
    m = {k: mismatch(*cat_gen(gens[k])) for k in ("fp32", "fp16", "bf16")}
    assert m["fp32"]["mean"] < 1e-6
    assert m["fp16"]["mean"] > 5 * m["fp32"]["mean"]
    assert m["bf16"]["mean"] > 3 * m["fp16"]["mean"]  # 3 fewer mantissa bits: ~8x in theory
    assert m["bf16"]["p99"] > m["fp16"]["p99"] > m["fp32"]["p99"]
    assert m["bf16"]["mean"] < 0.05  # a mismatch, not a different model


def test_low_precision_is_really_low_precision(mega):
    """bf16 / fp16 run the whole forward in that dtype: their logits are further from the fp32 ones than the fp32
    logits merely rounded to the dtype at the end would be (error accumulated through the layers)."""
    seq = torch.cat(fixed_sequences())[None]
    ref = TorchGPT(mega["base"]["params0"], TinyGPTConfig()).logits(seq)
    for dtype in (torch.bfloat16, torch.float16):
        logits = TorchGPT(mega["base"]["params0"], TinyGPTConfig(), dtype=dtype).logits(seq)
        assert logits.dtype == dtype
        rounding_only = (ref.to(dtype).float() - ref).abs().mean()
        assert (logits.float() - ref).abs().mean() > 2.5 * rounding_only


def test_stale_steps_use_the_previous_weights(mega):
    res = mega["base"]
    cfg = TinyGPTConfig()
    prompts = make_prompts(seed=4, n=16)
    stale = RolloutEngine(cfg, stale_steps=1, temperature=GEN_T, seed=2)
    assert stale.load_weights(res["params0"]) == 0
    assert stale.weight_version == 0  # fewer syncs than stale_steps: the oldest version
    stale.load_weights(res["params1"])
    assert stale.weight_version == 0
    fresh0 = RolloutEngine(cfg, temperature=GEN_T, seed=2)
    fresh0.load_weights(res["params0"])
    a, b = stale.generate(prompts, 8), fresh0.generate(prompts, 8)
    for x, y in zip(a, b):
        assert torch.equal(x["response"], y["response"])
        assert torch.equal(x["rollout_log_probs"], y["rollout_log_probs"])  # exactly
        assert x["weight_version"] == 0
    # and against the trainer: the stale engine reproduces megatron's log-probs *before* the step, not after
    seqs = fixed_sequences()
    st = RolloutEngine(cfg, stale_steps=1, temperature=FIXED_T)
    st.load_weights(res["params0"])
    st.load_weights(res["params1"])
    got = torch.cat(st.score([s[:1] for s in seqs], [s[1:] for s in seqs]))
    before = torch.cat([lp for lp, _ in res["fixed0"]])
    after = torch.cat([lp for lp, _ in res["fixed1"]])
    assert (got - before).abs().max() <= TOL
    assert (after - before).abs().mean() > 100 * TOL  # the step moved the trainer's log-probs
    st.load_weights(res["params1"])  # third sync: now the second version (params1) generates
    assert st.weight_version == 1
    got = torch.cat(st.score([s[:1] for s in seqs], [s[1:] for s in seqs]))
    assert (got - after).abs().max() <= TOL


def test_logit_noise_concentrates_on_improbable_tokens(mega):
    """Full next-token distributions of the peaked model on the fixed sequences: |engine - trainer| per vocabulary
    entry, by the trainer's probability of the entry."""
    res = mega["peaked"]
    cfg = TinyGPTConfig(**VARIANTS["peaked"])
    seqs = fixed_sequences()
    trainer = torch.cat([torch.log_softmax(logits.float() / FIXED_T, -1) for _, logits in res["fixed0"]])
    p = trainer.exp()
    buckets = [(0.0, 1e-2), (1e-2, 0.1), (0.1, 0.3), (0.3, 1.0)]  # by the trainer's probability of the entry
    masks = [(p >= a) & (p < b) for a, b in buckets]
    assert masks[0].sum() > 1000 and masks[-1].sum() > 20  # both ends populated (the model is peaked)
    means = {}
    for sigma in (0.0, 0.1, 0.5):
        engine = RolloutEngine(cfg, temperature=FIXED_T, logit_noise=sigma, noise_seed=9)
        engine.load_weights(res["params0"])
        got = torch.cat([engine.full_log_probs(s[None])[0] for s in seqs])
        d = (got - trainer).abs()
        means[sigma] = [float(d[m].mean()) for m in masks]
    assert max(means[0.0]) < 1e-5
    for sigma in (0.1, 0.5):
        m = means[sigma]
        assert m[0] > 0.8 * sigma * math.sqrt(2 / math.pi)  # E|N(0, s^2)| = 0.8 s; (1 - p)^2 ~ 1 for p < 1e-2
        assert m[0] > m[1] > m[2] > m[3], (sigma, m)  # the mismatch falls as the token gets more probable
        assert m[0] > 2.5 * m[3], (sigma, m)
    assert means[0.5][0] > 3 * means[0.1][0]


def test_logit_noise_mismatch_on_sampled_tokens(mega):
    gens = mega["base"]["gens"]
    m = {k: mismatch(*cat_gen(gens[k])) for k in ("fp32", "noise0.1", "noise0.5")}
    assert m["noise0.5"]["mean"] > 3 * m["noise0.1"]["mean"] > 3 * 10 * m["fp32"]["mean"]
    assert m["noise0.5"]["k3"] > m["noise0.1"]["k3"] > 0


def test_knobs_are_validated():
    cfg = TinyGPTConfig()
    for kwargs in (dict(temperature=0.0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                   dict(stale_steps=-1), dict(logit_noise=-0.1), dict(dtype="fp8")):
        with pytest.raises(ValueError):
            RolloutEngine(cfg, **kwargs)
    with pytest.raises(RuntimeError, match="load_weights"):
        RolloutEngine(cfg).generate([torch.tensor([1, 2])], 2)


# ---------------------------------------------------------------------------------------------------------------
# (c) sampling
# ---------------------------------------------------------------------------------------------------------------
def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple:
    """Pearson chi-square of ``counts`` against ``probs`` (bins with expected < 5 merged); (stat, dof)."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum().double().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


def _chi2_ok(stat: float, dof: int) -> bool:
    return stat < dof + 6 * math.sqrt(2 * dof)  # ~6 sigma of chi2(dof): a fixed seed, never flaky by chance


def _one_step_draws(mega, n, **kwargs):
    cfg = TinyGPTConfig(**VARIANTS["peaked"])
    prompt = torch.tensor([5, 17, 99, 3, 64])
    engine = RolloutEngine(cfg, seed=123, **kwargs)
    engine.load_weights(mega["peaked"]["params0"])
    out = engine.generate([prompt] * n, 1)
    tokens = torch.stack([o["response"][0] for o in out])
    logps = torch.stack([o["rollout_log_probs"][0] for o in out])
    logits = TorchGPT(mega["peaked"]["params0"], cfg).logits(prompt[None])[0, -1]
    return tokens, logps, logits


def test_sampling_frequencies_match_tempered_softmax(mega):
    t = 0.8
    tokens, logps, logits = _one_step_draws(mega, 20000, temperature=t)
    counts = torch.bincount(tokens, minlength=128)
    probs = torch.softmax(logits / t, -1)
    stat, dof = _chi2(counts, probs)
    assert dof >= 10 and _chi2_ok(stat, dof), (stat, dof)
    # the test has power: the untempered softmax is rejected by the same draws
    wrong, wdof = _chi2(counts, torch.softmax(logits, -1))
    assert not _chi2_ok(wrong, wdof), (wrong, wdof)
    assert (logps - torch.log_softmax(logits / t, -1)[tokens]).abs().max() <= TOL


def test_top_p_stays_in_the_nucleus_and_reports_full_log_probs(mega):
    t, top_p = 1.0, 0.6
    tokens, logps, logits = _one_step_draws(mega, 20000, temperature=t, top_p=top_p)
    full = torch.log_softmax(logits / t, -1)
    probs = full.exp()
    nucleus = sampling_mask(probs[None], top_p)[0]
    assert 1 < int(nucleus.sum()) < 128
    mass = float(probs[nucleus].sum())
    assert top_p <= mass < 0.95  # the nucleus: the smallest top set with mass >= top_p
    counts = torch.bincount(tokens, minlength=128)
    assert counts[~nucleus].sum() == 0
    assert (counts[nucleus] > 0).all()
    stat, dof = _chi2(counts, torch.where(nucleus, probs, torch.zeros_like(probs)) / mass)
    assert _chi2_ok(stat, dof), (stat, dof)
    # reported: the full distribution's log-prob, not the renormalised one (those differ by -log(mass) > 0.05)
    assert (logps - full[tokens]).abs().max() <= TOL
    assert (logps - (full[tokens] - math.log(mass))).abs().min() > 0.05


def test_top_p_over_many_positions(mega):
    cfg = TinyGPTConfig(**VARIANTS["peaked"])
    engine = RolloutEngine(cfg, temperature=0.9, top_p=0.5, seed=7)
    engine.load_weights(mega["peaked"]["params0"])
    prompts = make_prompts(seed=8)
    out = engine.generate(prompts, MAX_NEW)
    model = TorchGPT(mega["peaked"]["params0"], cfg)
    outside = 0
    for o in out:
        seq = torch.cat([o["prompt"], o["response"]])
        full = torch.log_softmax(model.logits(seq[None])[0].float() / 0.9, -1)[-MAX_NEW - 1:-1]
        keep = sampling_mask(full.exp(), 0.5)
        outside += int((~keep.gather(-1, o["response"][:, None])).sum())
        assert (o["rollout_log_probs"] - full.gather(-1, o["response"][:, None]).squeeze(-1)).abs().max() <= TOL
    assert outside == 0


# ---------------------------------------------------------------------------------------------------------------
# (d) stopping
# ---------------------------------------------------------------------------------------------------------------
def test_generation_stops_at_the_stop_token(mega):
    cfg = TinyGPTConfig(**VARIANTS["peaked"])
    params = mega["peaked"]["params0"]
    prompts = make_prompts(seed=12)
    model = TorchGPT(params, cfg)
    # a stop token the model actually emits: the most probable first token summed over the prompts
    first = torch.stack([torch.softmax(model.logits(p[None])[0, -1].float(), -1) for p in prompts]).sum(0)
    stop = int(first.argmax())
    engine = RolloutEngine(cfg, seed=3)
    engine.load_weights(params)
    out = engine.generate(prompts, MAX_NEW, stop_token=stop)
    lengths = [o["response"].numel() for o in out]
    stopped = [o for o in out if o["finish_reason"] == "stop"]
    assert 0 < len(stopped) < len(out)
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW
    for o in out:
        resp = o["response"]
        assert o["rollout_log_probs"].numel() == resp.numel() >= 1
        hits = (resp == stop).nonzero().flatten().tolist()
        if o["finish_reason"] == "stop":
            assert hits == [resp.numel() - 1]  # the stop token, once, last; nothing after it
        else:
            assert hits == [] and resp.numel() == MAX_NEW
    # no padding leaked into the log-probs of rows that finished early
    scored = engine.score([o["prompt"] for o in out], [o["response"] for o in out])
    for o, s in zip(out, scored):
        assert (o["rollout_log_probs"] - s).abs().max() <= TOL


def test_generation_speed(mega):
    engine = RolloutEngine(TinyGPTConfig(), temperature=1.0, seed=0)
    engine.load_weights(mega["base"]["params0"])
    prompts = make_prompts(seed=21)
    engine.generate(prompts[:2], 2)  # warm-up
    best = min(_timed(lambda: engine.generate(prompts, MAX_NEW)) for _ in range(3))
    assert best < 1.0, f"64 x {MAX_NEW} tokens took {best:.3f} s"


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# (e) SGLang
# ---------------------------------------------------------------------------------------------------------------
def test_meta_info_parsing():
    meta = {"output_token_logprobs": [[-0.5, 7, "a"], [-2.25, 3, None], [0.0, 9, "c"]]}
    assert torch.equal(rollout_log_probs_from_meta_info(meta), torch.tensor([-0.5, -2.25, 0.0]))
    assert torch.equal(rollout_log_probs_from_meta_info(meta, torch.tensor([7, 3, 9])),
                       torch.tensor([-0.5, -2.25, 0.0]))
    assert response_tokens_from_meta_info(meta).tolist() == [7, 3, 9]
    assert rollout_log_probs_from_meta_info({"output_token_logprobs": []}).numel() == 0


@pytest.mark.parametrize("items,tokens,match", [
    ([[-0.5, 7, "a"], [None, 3, "b"]], None, r"\[1\].*null"),  # JSON null = NaN/Inf on the server
    ([[-0.5, 7, "a"], [float("nan"), 3, "b"]], None, r"\[1\].*not finite"),
    ([[float("-inf"), 7, "a"]], None, r"\[0\].*not finite"),
    ([[-0.5, 7, "a"], [-1.0, 4, "b"]], [7, 3], r"\[1\].*token id 4 != response token 3"),
    ([[-0.5, 7, "a"]], [7, 3], r"1 output_token_logprobs for a response of 2"),
    ([[0.5, 7, "a"]], None, r"\[0\].*> 0"),
    ([[-0.5, 7, "a"], ["x", 3, "b"]], None, r"\[1\].*not a number"),
    ([[-0.5]], None, r"\[0\]"),
])
def test_meta_info_parsing_refuses_bad_items(items, tokens, match):
    with pytest.raises(ValueError, match=match):
        rollout_log_probs_from_meta_info({"output_token_logprobs": items}, tokens)


def test_meta_info_without_logprobs():
    with pytest.raises(ValueError, match="return_logprob"):
        rollout_log_probs_from_meta_info({"finish_reason": {"type": "length"}})


class _Stub(LocalServer):
    """A tiny ``/generate`` server in a thread: answers each batched request from a RolloutEngine, in SGLang's
    response format, or with a canned body; records the requests."""

    def __init__(self, engine=None, canned=None, status=200):
        stub = self
        self.requests, self.engine, self.canned, self.status = [], engine, canned, status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append((self.path, body))
                if stub.canned is not None:
                    payload = stub.canned
                else:
                    sp = body["sampling_params"]
                    stop = sp.get("stop_token_ids", [None])[0]
                    out = stub.engine.generate([torch.tensor(ids) for ids in body["input_ids"]],
                                               sp["max_new_tokens"], stop_token=stop)
                    payload = [{"text": "", "output_ids": o["response"].tolist(),
                                "meta_info": {"output_token_logprobs": [[float(lp), int(t), None] for lp, t in
                                                                        zip(o["rollout_log_probs"], o["response"])],
                                              "finish_reason": {"type": o["finish_reason"]}}} for o in out]
                data = json.dumps(payload).encode()  # NaN would be written as NaN; canned bodies use null
                answer(self, stub.status, data, "application/json")

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def test_sglang_client_round_trip(mega):
    cfg = TinyGPTConfig(**VARIANTS["peaked"])
    server_engine = RolloutEngine(cfg, temperature=0.8, top_p=0.9, seed=31)
    server_engine.load_weights(mega["peaked"]["params0"])
    local = RolloutEngine(cfg, temperature=0.8, top_p=0.9, seed=31)
    local.load_weights(mega["peaked"]["params0"])
    prompts = make_prompts(seed=40, n=6)
    with _Stub(engine=server_engine) as stub:
        got = SGLangEngine(stub.url, temperature=0.8, top_p=0.9, timeout=10).generate(prompts, 5, stop_token=7)
    path, body = stub.requests[0]
    assert len(stub.requests) == 1 and path == "/generate"  # one batched request
    assert body == {"input_ids": [p.tolist() for p in prompts], "return_logprob": True,
                    "sampling_params": {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 5,
                                        "stop_token_ids": [7]}}
    want = local.generate(prompts, 5, stop_token=7)
    for g, w, p in zip(got, want, prompts):
        assert torch.equal(g["prompt"], p)
        assert torch.equal(g["response"], w["response"])
        assert torch.allclose(g["rollout_log_probs"], w["rollout_log_probs"], rtol=0, atol=1e-6)
        assert g["finish_reason"] == w["finish_reason"]


def test_sglang_client_refuses_null_log_probs_and_http_errors():
    canned = [{"meta_info": {"output_token_logprobs": [[-0.1, 4, None]]}},
              {"meta_info": {"output_token_logprobs": [[-0.3, 5, None], [None, 6, None]]}}]
    with _Stub(canned=canned) as stub:
        with pytest.raises(ValueError, match=r"result 1: output_token_logprobs\[1\].*null"):
            SGLangEngine(stub.url).generate([torch.tensor([1]), torch.tensor([2])], 2)
    with _Stub(canned=canned[:1]) as stub:
        with pytest.raises(ValueError, match="1 results for 2 prompts"):
            SGLangEngine(stub.url).generate([torch.tensor([1]), torch.tensor([2])], 2)
    mismatched = [{"output_ids": [4, 8], "meta_info": {"output_token_logprobs": [[-0.1, 4, None], [-0.2, 5, None]]}}]
    with _Stub(canned=mismatched) as stub:
        with pytest.raises(ValueError, match="output_ids"):
            SGLangEngine(stub.url).generate([torch.tensor([1])], 2)
    with _Stub(canned={"error": "boom"}, status=500) as stub:
        with pytest.raises(RuntimeError, match="HTTP 500"):
            SGLangEngine(stub.url).generate([torch.tensor([1])], 2)
    with pytest.raises(ValueError):
        SGLangEngine("http://127.0.0.1:1", temperature=0.0)


# ---------------------------------------------------------------------------------------------------------------
# an engine in rank 0 alone (vLLM, SGLang in a multi-process job): slime_rc.demo.train.loop.RankZeroRollout
# ---------------------------------------------------------------------------------------------------------------
class _Rank0Engine:
    """A stand-in for vLLM in rank 0: samples from a generator of its own (another rank's would differ)."""

    def __init__(self, fail_generate: bool = False):
        self.gen = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
        self.synced, self.closed, self.fail_generate = [], False, fail_generate

    def load_weights(self, params):
        if "w" not in params:
            raise ValueError("converter: no tensor for ['w']")
        self.synced.append(float(params["w"]))
        return len(self.synced) - 1

    def generate(self, prompts, max_new_tokens, stop_token=None):
        if self.fail_generate:
            raise ValueError("prompt 1: token ids outside [0, 16)")
        out = []
        for p in prompts:
            n = int(torch.randint(1, max_new_tokens + 1, (1,), generator=self.gen))
            out.append({"prompt": p, "response": torch.randint(0, 16, (n,), generator=self.gen),
                        "rollout_log_probs": -torch.rand(n, generator=self.gen), "finish_reason": "length",
                        "weight_version": len(self.synced) - 1})
        return out

    def close(self):
        self.closed = True


def rank_zero_worker(rank, world):
    from slime_rc.demo.train.loop import RankZeroRollout
    built = []

    def build(**kwargs):
        if rank != 0:
            raise AssertionError("the engine is built in rank 0 only")
        built.append(_Rank0Engine(**kwargs))
        return built[-1]

    out = {}
    engine = RankZeroRollout(build)
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    out["versions"] = [engine.load_weights({"w": torch.tensor(float(v))}) for v in (0.5, 1.5)]
    out["samples"] = engine.generate(prompts, 4, stop_token=3)
    engine.close()
    out["engine"] = (built[0].synced, built[0].closed) if built else None
    try:  # rank 0's engine cannot be built: every rank ends, with rank 0's message
        RankZeroRollout(lambda: (_ for _ in ()).throw(ImportError("--rollout-engine vllm needs vLLM")))
    except Exception as e:  # noqa: BLE001 - the test reads it
        out["build_error"] = f"{type(e).__name__}: {e}"
    failing = RankZeroRollout(lambda: build(fail_generate=True))
    try:
        failing.generate(prompts, 4)
    except Exception as e:  # noqa: BLE001
        out["generate_error"] = f"{type(e).__name__}: {e}"
    # the SGLang client in a multi-process job: one client, in rank 0 (each rank's own /generate would draw other
    # samples for the same sequences); it has no load_weights (the server's weights are the user's): syncs only count
    from types import SimpleNamespace

    from slime_rc.demo.train.loop import make_rollout_engine
    sglang = make_rollout_engine(SimpleNamespace(rollout_engine="sglang", sglang_url="http://127.0.0.1:1",
                                                 temperature=1.0, top_p=1.0, sglang_timeout=5.0), None)
    out["sglang"] = (type(sglang).__name__, type(sglang.engine).__name__, sglang.load_weights({"w": torch.ones(())}))
    refused = RankZeroRollout(build)  # a sync rank 0's engine refuses: said by the generate that follows it
    refused.load_weights({"v": torch.tensor(0.0)})
    try:
        refused.generate(prompts, 4)
    except Exception as e:  # noqa: BLE001
        out["sync_error"] = f"{type(e).__name__}: {e}"
    return out


def test_an_engine_in_rank_zero_hands_its_samples_to_every_rank():
    """2 gloo ranks: the engine is built, synced and closed in rank 0 only; both ranks get rank 0's samples (tensors
    bit for bit) and the sync versions; a failure in rank 0 -- building, a weight sync, generating -- ends both ranks
    with its message instead of a hang in a collective."""
    r0, r1 = run_distributed(rank_zero_worker, 2, timeout=120)
    assert r0["engine"] == ([0.5, 1.5], True) and r1["engine"] is None
    assert r0["sglang"] == ("RankZeroRollout", "SGLangEngine", 0) and r1["sglang"] == ("RankZeroRollout", "NoneType", 0)
    assert r0["versions"] == r1["versions"] == [0, 1]
    assert len(r0["samples"]) == 2
    for a, b in zip(r0["samples"], r1["samples"]):
        assert sorted(a) == sorted(b) == ["finish_reason", "prompt", "response", "rollout_log_probs", "weight_version"]
        for k in a:
            assert (torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype) if torch.is_tensor(a[k]) else a[k] == b[k]
        assert a["weight_version"] == 1
    assert r0["build_error"] == "ImportError: --rollout-engine vllm needs vLLM"
    assert r1["build_error"] == ("RuntimeError: the rollout engine (in rank 0) failed to start: ImportError: "
                                 "--rollout-engine vllm needs vLLM")
    assert r0["generate_error"] == "ValueError: prompt 1: token ids outside [0, 16)"
    assert r1["generate_error"] == ("RuntimeError: the rollout engine (in rank 0) failed to generate: ValueError: "
                                    "prompt 1: token ids outside [0, 16)")
    assert r0["sync_error"] == "ValueError: converter: no tensor for ['w']"
    assert r1["sync_error"] == ("RuntimeError: the rollout engine (in rank 0) failed to take the weights: ValueError: "
                                "converter: no tensor for ['w']")
