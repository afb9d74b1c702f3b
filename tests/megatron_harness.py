"""Worker functions for ``tests/megatron/test_loss_layouts.py``: a tiny real megatron-core GPT trained for a few steps
under one parallel layout after another, inside processes spawned by ``tests.dist_utils.run_distributed``.

Everything here runs in the spawned children (they import megatron-core and apply the CPU patches); the pytest
process only imports this module for its constants and data (``make_global_batch``), never megatron.

The loss (defined here, not in the package): token-level REINFORCE,

    L = - sum_{loss tokens of the global batch} logp * advantage / (number of loss tokens of the global batch)

with ``logp`` from ``vocab_parallel_log_probs(logits, targets, TEMPERATURE)``.  It is fed to megatron in both of
``slime_rc.demo.model``'s conventions:

* ``"per_token"`` (``calculate_per_token_loss=True``): ``loss_fn`` returns ``(-sum(logp * adv * mask),
  mask.sum(), logs)``; megatron divides the gradients by the token count summed over micro-batches and DP x CP;
* ``"legacy"`` (``calculate_per_token_loss=False``): ``loss_fn`` returns ``(-sum(logp * adv * mask) * M * dp /
  N_global, logs)``; the schedule multiplies by ``cp`` and divides by ``M``, DDP averages over DP x CP.
"""

from __future__ import annotations

import math
import os
import time
from typing import Dict, List

import torch

N_MICRO_BATCHES = 8  # global batch; DP ranks take contiguous blocks (M = 8 / dp per rank)
N_STEPS = 3
LR = 3e-3
TEMPERATURE = 0.7
DATA_SEED = 7

# The policy loss of the package (slime_rc.megatron.loss, legacy convention) as two more "conventions":
# decoupled PPO with the pre-step global-batch correction, and bypass REINFORCE with the in-loss correction.
# ... and slime's custom loss (slime_rc.slime.policy_loss_function, on slime's batch format, legacy convention)
POLICY = ("policy_prestep", "policy_bypass", "policy_tis_function", "policy_slime_function", "policy_slime_loss")
PRE, BYP, TISFN, SLIMEFN, SLIMELOSS = POLICY
# the TIS-function conventions: the function, loaded by its dotted path as slime loads it
TIS_FUNCTIONS = {TISFN: "mis", SLIMEFN: "tests.slime_like_tis.compute_weights_with_cp"}

# name -> (world size, initialize_parallel kwargs, conventions run[, TinyGPTConfig overrides])
# ``pad_multiplier`` (slime's get_batch: each rank's packed stream padded to a multiple of tp * pad_multiplier) puts
# a stream-padding segment into some CP layouts; TP layouts get one whenever a rank's token count is not a multiple
# of tp (the 1-process reference never pads).
LAYOUTS = {
    # 2-process spawn
    "tp2": (2, dict(tp=2), ("per_token", PRE, SLIMELOSS)),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True), ("per_token", PRE)),
    "pp2": (2, dict(pp=2), ("per_token", PRE, SLIMELOSS)),
    "pp2_vpp2": (2, dict(pp=2, vpp=2), ("per_token", "legacy", PRE)),
    "cp2": (2, dict(cp=2), ("per_token", "legacy", PRE, BYP, TISFN, SLIMEFN, SLIMELOSS)),
    "dp2": (2, dict(), ("per_token", "legacy", PRE, BYP, SLIMELOSS)),
    "pp2_tied": (2, dict(pp=2), ("per_token",), dict(tie_embeddings=True)),
    # 4-process spawn
    "tp2_pp2": (4, dict(tp=2, pp=2), ("per_token", PRE)),
    "cp4": (4, dict(cp=4, pad_multiplier=3), ("per_token", PRE, SLIMEFN, SLIMELOSS)),
    "dp2_cp2": (4, dict(cp=2, pad_multiplier=5), ("per_token", "legacy", PRE, BYP, TISFN, SLIMELOSS)),
    "tp2_cp2": (4, dict(tp=2, cp=2), ("per_token", BYP)),
    "tp2_cp2_sp": (4, dict(tp=2, cp=2, sequence_parallel=True, pad_multiplier=2), ("per_token",)),
    "pp2_vpp2_dp2": (4, dict(pp=2, vpp=2), ("per_token",)),
}
REFERENCE = "single"
# what the 1-process reference runs: (convention, TinyGPTConfig overrides) for every pair the layouts use
VARIANTS = {"base": {}, "tied": dict(tie_embeddings=True)}
ATTENTION_CHECKS = {REFERENCE: 1, "cp2": 2, "cp4": 4}  # where the core-attention unit checks run (cp size)


def layout_variant(name: str) -> str:
    overrides = LAYOUTS[name][3] if len(LAYOUTS[name]) > 3 else {}
    return next(k for k, v in VARIANTS.items() if v == overrides)


def reference_key(name: str, convention: str):
    return (REFERENCE, convention, layout_variant(name))


def reference_runs() -> List[tuple]:
    """(convention, variant) pairs the 1-process reference runs: those the layouts need, and both conventions of
    the base model (they must agree with each other)."""
    pairs = {("per_token", "base"), ("legacy", "base")}
    pairs |= {(conv, layout_variant(n)) for n, spec in LAYOUTS.items() for conv in spec[2]}
    return sorted(pairs)


def make_global_batch(seed: int = DATA_SEED, n_micro_batches: int = N_MICRO_BATCHES, vocab: int = 128) -> List[dict]:
    """Packed micro-batches of 1-4 sequences of 2..45 tokens (prompt + response), a different total length per
    micro-batch.  Per-token fields are aligned with the targets: ``loss_mask`` is 0 on each sequence's last
    position (no target) and on a random prompt-like head; ``advantages`` are per-sequence values plus noise."""
    g = torch.Generator().manual_seed(seed)
    out, totals = [], set()
    while len(out) < n_micro_batches:
        n_seq = int(torch.randint(1, 5, (1,), generator=g))
        lengths = [int(x) for x in torch.randint(2, 46, (n_seq,), generator=g)]
        if sum(lengths) in totals:
            continue
        totals.add(sum(lengths))
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        total = int(cu[-1])
        tokens = torch.randint(0, vocab, (total,), generator=g)
        mask = torch.zeros(total)
        adv = torch.zeros(total)
        for i, n in enumerate(lengths):
            s = int(cu[i])
            prompt = int(torch.randint(0, n, (1,), generator=g))  # loss on the response: [prompt, n - 1)
            mask[s + prompt:s + n - 1] = 1.0
            adv[s:s + n] = 1.0 + 0.7 * torch.randn(1, generator=g) + 0.3 * torch.randn(n, generator=g)
        out.append(dict(tokens=tokens, cu_seqlens=cu.to(torch.int32), loss_mask=mask, advantages=adv))
    return out


def global_loss_tokens(batch: List[dict]) -> int:
    return int(sum(float(mb["loss_mask"].sum()) for mb in batch))


def _loss_fns(n_global: int):
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs

    def per_token(logits, mb):
        logp = vocab_parallel_log_probs(logits, mb["targets"], TEMPERATURE)
        local_sum = -(logp * mb["advantages"] * mb["loss_mask"]).sum()
        return local_sum, mb["loss_mask"].sum(), {"logp": logp.detach()}

    def legacy(logits, mb):
        logp = vocab_parallel_log_probs(logits, mb["targets"], TEMPERATURE)
        local_sum = -(logp * mb["advantages"] * mb["loss_mask"]).sum()
        scale = mb["num_micro_batches"] * mb["dp_size"] / n_global
        return local_sum * scale, {"logp": logp.detach()}

    return {"per_token": per_token, "legacy": legacy}


def policy_configs():
    from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria
    return {
        PRE: RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, veto_threshold=0.05,
                                     rs=parse_rejection_criteria("token", 1.8)),
        BYP: RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence", is_upper_bound=3.0,
                                     rs=parse_rejection_criteria("geometric", "0.9_1.1"), loss_agg="token_mean"),
        # the same correction as PRE but in the loss, through slime's TIS-function contract (custom_tis.mis)
        TISFN: RolloutCorrectionConfig(is_level="token", veto_threshold=0.05,
                                       rs=parse_rejection_criteria("token", 1.8)),
        # a function written like slime's example (tests/slime_like_tis.py), settings from slime's args attributes
        SLIMEFN: RolloutCorrectionConfig(is_level="token", is_upper_bound=1.5,
                                         rs=parse_rejection_criteria("token", "0.6_1.7")),
        # slime's custom loss: decoupled token TIS + RS + veto, with slime's entropy and KL terms around it
        SLIMELOSS: RolloutCorrectionConfig(is_level="token", veto_threshold=0.05,
                                           rs=parse_rejection_criteria("token", 1.8)),
    }


def _slime_loss_func(config, mbs: List[dict], n_samples: int):
    """``loss_fn(logits, lmb)`` running slime's custom loss (``slime_rc.slime.policy_loss_function``) on slime's batch
    format built from the unsharded micro-batches (response = every target; per-token keys cut to this CP rank's
    zigzag part as slime's actor cuts them), in the legacy convention: slime's per-sample-mean sum scaled by
    ``M * dp / samples of the global batch``.  Metrics come back as micro-batch values (slime's log holds them times
    ``samples / cp``)."""
    import argparse

    from megatron.core import parallel_state as ps

    from slime_rc.megatron.cp_layout import zigzag_slice
    from slime_rc.slime.tis_bridge import with_sample_fields
    from slime_rc.slime import policy_loss_function

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    args = argparse.Namespace(rollout_correction_config=config, entropy_coef=0.01, use_kl_loss=True,
                              kl_loss_coef=0.05, kl_loss_type="low_var_kl", rollout_temperature=TEMPERATURE,
                              calculate_per_token_loss=False, use_rollout_logprobs=False)
    batches = []
    for mb in mbs:
        s = with_sample_fields(mb)
        ref = mb["old_log_probs"] + 0.1 * torch.sin(torch.arange(mb["old_log_probs"].numel(), dtype=torch.float32))
        b = dict(unconcat_tokens=[], total_lengths=s["sample_lengths"], response_lengths=s["sample_response_lengths"],
                 loss_masks=s["sample_loss_masks"], advantages=[], log_probs=[], rollout_log_probs=[],
                 ref_log_probs=[], rollout_mask_sums=torch.tensor([float(m.sum()) for m in s["sample_loss_masks"]]))
        for a, total, resp in zip(mb["cu_seqlens"].tolist(), s["sample_lengths"], s["sample_response_lengths"]):
            b["unconcat_tokens"].append(mb["tokens"][a:a + total])
            start = a + total - resp - 1
            for key, values in (("advantages", mb["advantages"]), ("log_probs", mb["old_log_probs"]),
                                ("rollout_log_probs", mb["rollout_log_probs"]), ("ref_log_probs", ref)):
                b[key].append(zigzag_slice(values[start:start + resp].float(), total, resp, cp, cp_rank))
        batches.append(b)
    scale = len(mbs) * ps.get_data_parallel_world_size() / n_samples
    calls = {"i": 0}

    def loss_fn(logits, lmb):
        b = batches[lmb.get("micro_batch_index", calls["i"] % len(batches))]
        calls["i"] += 1
        loss, log = policy_loss_function(args, b, logits.reshape(1, -1, logits.shape[-1]), None)
        n = len(b["total_lengths"])
        return loss * scale, {k: v * cp / n for k, v in log.items() if k.startswith("rollout_corr/")}

    return loss_fn


def with_policy_fields(batch: List[dict], seed: int = DATA_SEED + 1) -> List[dict]:
    """``old_log_probs`` and ``rollout_log_probs`` for every position: near log(1/vocab) (what the tiny untrained
    model assigns), so that bypass weights pi_theta/pi_rollout are O(1) and the bands reject some tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for mb in batch:
        n = mb["tokens"].numel()
        old = -math.log(128) + 0.2 * torch.randn(n, generator=g)
        out.append(dict(mb, old_log_probs=old, rollout_log_probs=old + 0.25 * torch.randn(n, generator=g)))
    return out


def _policy_step(M, model, optimizer, mbs: List[dict], convention: str, forward_only: bool = False,
                 n_samples: int = 0):
    """One step with the package's policy loss (pre-step or in-loss correction), logging log-probs and metrics."""
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs
    from slime_rc.megatron.loss import make_loss_func, prepare_global_batch

    config = policy_configs()[convention]
    tis = {}
    if convention in TIS_FUNCTIONS:
        import argparse

        from slime_rc.slime.tis_bridge import with_sample_fields
        from slime_rc.plugins import load_function
        mbs = [with_sample_fields(mb) for mb in mbs]
        # the caller's args: slime's keys unset (None), as a launch line without them leaves them; the function
        # must get a copy with the resolved values
        from slime_rc.slime.tis_bridge import tis_function_correction_for
        caller_args = argparse.Namespace(tis_upper_bound=None, tis_lower_bound=None, use_tis=None)
        tis = dict(external=tis_function_correction_for(load_function(TIS_FUNCTIONS[convention]), caller_args))
    local = M.shard_for_step(model, mbs)
    prepared = prepare_global_batch(local, config) if convention == PRE else None
    if convention == SLIMELOSS:
        inner = _slime_loss_func(config, mbs, n_samples)
    else:
        inner = make_loss_func(config, temperature=TEMPERATURE, prepared=prepared, num_microbatches=len(mbs), **tis)

    def loss_fn(logits, lmb):
        loss, metrics = inner(logits, lmb)
        logp = vocab_parallel_log_probs(logits.detach(), lmb["targets"], TEMPERATURE)
        return loss, {"logp": logp, "metrics": {k: float(v) for k, v in metrics.items()
                                                if k.startswith("rollout_corr/")}}

    result = M.train_step(model, optimizer, mbs, loss_fn, forward_only=forward_only, local_micro_batches=local)
    if "external" in tis:
        assert caller_args.tis_upper_bound is None, "the caller's args were modified"
        from megatron.core import parallel_state as ps

        from slime_rc.slime.tis_bridge import reduce_tis_function_metrics
        if ps.is_pipeline_last_stage(ignore_virtual=True):  # slime's reduction over micro-batches and DP x CP
            result.function_metrics = reduce_tis_function_metrics([o["metrics"] for o in result.outputs],
                                                                  result.local_micro_batches, config)
    return result


def _run(name: str, kwargs: dict, convention: str, batch: List[dict], rank: int, overrides: dict) -> dict:
    from megatron.core import parallel_state as ps

    from slime_rc.demo import model as M
    t0 = time.perf_counter()
    layout = M.initialize_parallel(**kwargs, seed=1234)
    try:
        cfg = M.TinyGPTConfig(**overrides)
        model = M.build_model(cfg, calculate_per_token_loss=(convention == "per_token"))
        # The policy losses run with Adam eps 1e-6: their objective is a small difference of O(1) terms, and with
        # eps 1e-8 Adam turns fp32 summation-order noise on near-zero gradient coordinates into ~2e-5 parameter
        # noise (see test_updated_parameters_match), which the next step's loss then shows at ~1e-5.
        optimizer = M.build_optimizer(model, lr=LR, **(dict(adam_eps=1e-6) if convention in POLICY else {}))
        if convention in POLICY:
            batch = with_policy_fields(batch)

            n_samples = sum(mb["cu_seqlens"].numel() - 1 for mb in batch)

            def step(opt, mbs, forward_only=False):
                return _policy_step(M, model, opt, mbs, convention, forward_only, n_samples)
        else:
            loss_fn = _loss_fns(global_loss_tokens(batch))[convention]

            def step(opt, mbs, forward_only=False):
                return M.train_step(model, opt, mbs, loss_fn, forward_only=forward_only)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per = len(batch) // dp
        my_ids = list(range(dp_rank * per, (dp_rank + 1) * per))
        mine = M.data_parallel_slice(batch)
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        reporter = last and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        out = dict(sizes=dict(tp=ps.get_tensor_model_parallel_world_size(),
                              pp=ps.get_pipeline_model_parallel_world_size(),
                              vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                              cp=ps.get_context_parallel_world_size(), dp=dp,
                              sp=layout.sequence_parallel, chunks=len(model)),
                   ranks=dict(tp=ps.get_tensor_model_parallel_rank(), pp=ps.get_pipeline_model_parallel_rank(),
                              cp=ps.get_context_parallel_rank(), dp=dp_rank),
                   loss=[], grad_norm=[], logp=[], num_tokens=[], metrics=[], function_metrics=[])

        def gathered(result) -> Dict[int, torch.Tensor]:
            if not last:
                return {}
            logps = {i: M.gather_to_global(o["logp"], lmb)
                     for i, o, lmb in zip(my_ids, result.outputs, result.local_micro_batches)}
            return logps if reporter else {}

        def metrics(result) -> Dict[int, dict]:
            if not reporter or convention not in POLICY:
                return {}
            return {i: o["metrics"] for i, o in zip(my_ids, result.outputs)}

        init = M.full_parameters(model)
        for _ in range(N_STEPS):
            r = step(optimizer, mine)
            out["loss"].append(r.loss)
            out["grad_norm"].append(r.grad_norm)
            out["num_tokens"].append(r.num_tokens)
            out["logp"].append(gathered(r))
            out["metrics"].append(metrics(r))
            out["function_metrics"].append(getattr(r, "function_metrics", None) if reporter else None)
        if layout.vpp and len(mine) > layout.pp:  # interleaved PP on gloo refuses M == pp (it would deadlock)
            try:
                step(optimizer, mine[:layout.pp])
                out["vpp_guard"] = None
            except ValueError as e:
                out["vpp_guard"] = str(e)
        r = step(None, mine, forward_only=True)
        out["fwd_loss"] = r.loss
        out["fwd_logp"] = gathered(r)
        final = M.full_parameters(model)
        out["param_norm"] = float(torch.sqrt(sum((p.double() ** 2).sum() for p in final.values())))
        if rank == 0:  # full tensors once per layout (rank 0 holds the whole model after the gathers)
            out["init_params"] = init
            out["final_params"] = final
        out["seconds"] = time.perf_counter() - t0
        return out
    finally:
        M.destroy_parallel()


def attention_checks(cp_size: int) -> Dict[str, float]:
    """``ContextParallelDotProductAttention`` on this rank's zigzag shard vs ``torch``'s scaled-dot-product
    attention on the full sequences (causal, per packed sequence): outputs and the gradients of q, k, v (max
    |error| / max |reference|).  Needs megatron's parallel state with context parallel size ``cp_size``."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from slime_rc.demo.cp_attention import ContextParallelDotProductAttention, zigzag_positions

    assert ps.get_context_parallel_world_size() == cp_size
    cp_rank = ps.get_context_parallel_rank()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    heads, dim = 4, 16
    out = {}
    for fmt, groups in (("thd", 4), ("thd_gqa", 2), ("sbhd", 4)):
        config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                                   num_query_groups=groups, context_parallel_size=cp_size, attention_dropout=0.0,
                                   hidden_dropout=0.0, use_cpu_initialization=True)
        attn = ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(11)
        lengths = [8, 24, 16] if fmt.startswith("thd") else [24]  # multiples of 2 * cp for cp <= 4
        batch = 1 if fmt.startswith("thd") else 2
        total = sum(lengths)
        q = torch.randn(total, batch, heads, dim, generator=g, dtype=torch.float64).float().requires_grad_()
        k = torch.randn(total, batch, groups, dim, generator=g, dtype=torch.float64).float().requires_grad_()
        v = torch.randn(total, batch, groups, dim, generator=g, dtype=torch.float64).float().requires_grad_()
        go = torch.randn(total, batch, heads * dim, generator=g, dtype=torch.float64).float()
        # reference on the full sequences
        ref_parts, start = [], 0
        for n in lengths:
            sl = slice(start, start + n)
            qs = q[sl].permute(1, 2, 0, 3)  # [b, h, s, d]
            ks = k[sl].repeat_interleave(heads // groups, dim=2).permute(1, 2, 0, 3)
            vs = v[sl].repeat_interleave(heads // groups, dim=2).permute(1, 2, 0, 3)
            ref_parts.append(sdpa(qs, ks, vs, is_causal=True).permute(2, 0, 1, 3).reshape(n, batch, heads * dim))
            start += n
        ref = torch.cat(ref_parts)
        ref_grads = torch.autograd.grad(ref, (q, k, v), go)
        # this rank's zigzag rows
        seq, pos = zigzag_positions(lengths, cp_size, cp_rank)
        starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
        rows = starts[seq] + pos
        ql, kl, vl = (x.detach()[rows].clone().requires_grad_() for x in (q, k, v))
        if fmt.startswith("thd"):
            cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                  cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
            got = attn(ql.squeeze(1), kl.squeeze(1), vl.squeeze(1), None, packed_seq_params=psp).unsqueeze(1)
        else:
            got = attn(ql, kl, vl, None)
        grads = torch.autograd.grad(got, (ql, kl, vl), go[rows])
        got, ref = got.detach(), ref.detach()
        out[f"{fmt}_out"] = float((got - ref[rows]).abs().max() / ref.abs().max())
        for name, a, b in zip("qkv", grads, ref_grads):
            out[f"{fmt}_grad_{name}"] = float((a - b[rows]).abs().max() / b.abs().max())
    return out


POSITION_LENGTHS = tuple(range(1, 41))  # sequence lengths of the layout-position checks


def _position_batch(vocab: int = 128) -> List[dict]:
    """Micro-batches for the position checks: every length of ``POSITION_LENGTHS`` alone, then all of them packed
    (forwards and backwards), tokens = their index (so a token says where it came from)."""
    mbs = []
    for lengths in [[n] for n in POSITION_LENGTHS] + [list(POSITION_LENGTHS), list(reversed(POSITION_LENGTHS))]:
        cu = torch.tensor([0] + lengths).cumsum(0)
        total = int(cu[-1])
        mbs.append(dict(tokens=torch.arange(total) % vocab, cu_seqlens=cu, loss_mask=torch.ones(total),
                        index=torch.arange(total, dtype=torch.float64)))
    return mbs


def check_positions(local: dict, mb: dict, cp: int, cp_rank: int, tp: int, multiple: int) -> Dict[str, int]:
    """One sharded micro-batch against slime's layout, sequence by sequence: the positions this rank holds (slime's
    ``slice_with_cp`` written out in ``tests/slime_like_tis.py``, and ``slime_rc.megatron.cp_layout``), the response log-prob
    indices it holds for a prompt of ``1 + n // 3`` tokens (slime's ``slice_log_prob_with_cp`` and
    ``cp_layout.zigzag_response_indices``), the tokens / fields / targets it carries, the global ``cu_seqlens``
    (local ones times cp, the stream padding last) and the stream length (the least multiple of ``multiple`` --
    ``tp * pad_multiplier``, made even under CP -- so a multiple of tp, as sequence parallelism needs).
    Returns counts: ``pairs`` (sequence, rank) checked and ``mismatches``."""
    from slime_rc.megatron.cp_layout import zigzag_response_indices, zigzag_token_positions

    from tests.slime_like_tis import slime_response_positions, slime_slice_with_cp

    cu = mb["cu_seqlens"].tolist()
    lcu = local["cu_seqlens"].tolist()
    bad = 0
    for i in range(len(cu) - 1):
        n = cu[i + 1] - cu[i]
        pos = local["position_ids"][lcu[i]:lcu[i + 1]]
        slime = slime_slice_with_cp(torch.arange(n), cp, cp_rank, pad_value=-1)
        ours = zigzag_token_positions(n, cp, cp_rank)
        held = torch.where(pos < n, pos, torch.full_like(pos, -1))
        ok = torch.equal(held, slime) and torch.equal(pos, ours)
        gidx = local["global_index"][lcu[i]:lcu[i + 1]]
        ok &= torch.equal(gidx, torch.where(pos < n, cu[i] + pos, torch.full_like(pos, -1)))
        ok &= torch.equal(local["index"][lcu[i]:lcu[i + 1]], torch.where(pos < n, gidx.double(), 0.0))
        want_tgt = torch.where(pos + 1 < n, (cu[i] + pos + 1) % 128, torch.zeros_like(pos))
        ok &= torch.equal(local["targets"][lcu[i]:lcu[i + 1]], want_tgt)
        prompt = 1 + n // 3
        resp = n - prompt
        j = pos - (prompt - 1)
        j = j[(j >= 0) & (j < resp)]
        ok &= torch.equal(j, zigzag_response_indices(n, resp, cp, cp_rank))
        ok &= torch.equal(j, slime_response_positions(n, resp, cp, cp_rank))
        bad += not ok
    pad = int(local["stream_padding"])
    stream = int(local["tokens"].numel()) + pad
    local_lens = [b - a for a, b in zip(lcu[:-1], lcu[1:])] + ([pad] if pad else [])
    want_cu = (torch.tensor([0] + local_lens).cumsum(0) * cp).to(torch.int32)
    psp = local["packed_seq_params"]
    ok = torch.equal(psp.cu_seqlens_q, want_cu) and torch.equal(psp.cu_seqlens_kv_padded, want_cu)
    ok &= psp.max_seqlen_q == int((want_cu[1:] - want_cu[:-1]).max())
    multiple = multiple * (2 if cp > 1 and multiple % 2 else 1)
    ok &= stream % tp == 0 and stream % multiple == 0 and pad < multiple
    return {"pairs": len(cu) - 1, "mismatches": bad + (not ok)}


def position_grid() -> Dict[tuple, Dict[str, int]]:
    """:func:`check_positions` of ``shard_micro_batch`` for cp in {2, 4} x tp in {1, 2, 4} x sequence parallel or not
    x pad_multiplier 1 / 3, every rank (the stream multiple train_step uses: ``stream_multiple(tp,
    pad_multiplier)``).  A pure function of its arguments: runs in one process."""
    from slime_rc.demo.model import shard_micro_batch, stream_multiple

    out = {}
    for cp in (2, 4):
        for tp in (1, 2, 4):
            for sp in ((False, True) if tp > 1 else (False,)):
                for pad_multiplier in (1, 3):
                    counts = {"pairs": 0, "mismatches": 0}
                    for mb in _position_batch():
                        for r in range(cp):
                            multiple = stream_multiple(tp, pad_multiplier)
                            local = shard_micro_batch(mb, cp, r, stream_multiple=multiple)
                            for k, v in check_positions(local, mb, cp, r, tp, multiple).items():
                                counts[k] += v
                    out[(cp, tp, sp, pad_multiplier)] = counts
    return out


def layout_positions() -> Dict[str, int]:
    """:func:`check_positions` of ``shard_for_layout`` (what train_step shards) on this rank, under the current
    megatron parallel state (its CP rank, TP size, pad_multiplier)."""
    from megatron.core import parallel_state as ps

    from slime_rc.demo import model as M
    mbs = _position_batch()
    counts = {"pairs": 0, "mismatches": 0}
    for mb, local in zip(mbs, M.shard_for_layout(mbs)):
        tp = ps.get_tensor_model_parallel_world_size()
        for k, v in check_positions(local, mb, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                                    tp, M.stream_multiple(tp, M.current_layout().pad_multiplier)).items():
            counts[k] += v
    return counts


def worker(rank: int, world_size: int, names: List[str]) -> dict:
    """Runs every named layout (``REFERENCE`` = the 1-process run of every convention and variant) in this
    spawn, plus the core-attention checks (``ATTENTION_CHECKS``)."""
    from slime_rc.demo import model as M
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    batch = make_global_batch()
    results = {}
    for name in names:
        if name == REFERENCE:
            for conv, variant in reference_runs():
                results[(name, conv, variant)] = _run(name, {}, conv, batch, rank, VARIANTS[variant])
        else:
            world, kwargs, conventions = LAYOUTS[name][:3]
            assert world == world_size, (name, world, world_size)
            for conv in conventions:
                results[(name, conv)] = _run(name, kwargs, conv, batch, rank,
                                             VARIANTS[layout_variant(name)])
        kwargs = {} if name == REFERENCE else LAYOUTS[name][1]
        M.initialize_parallel(**kwargs)
        try:
            if name in ATTENTION_CHECKS:
                results[("attention", name)] = attention_checks(ATTENTION_CHECKS[name])
            results[("positions", name)] = layout_positions()
        finally:
            M.destroy_parallel()
        if name == REFERENCE:
            results["position_grid"] = position_grid()
    # what the spawn's layouts left behind: destroy_parallel must destroy megatron's groups (left alive, each kept
    # 3 gloo threads and the later layouts ran 2-3x slower)
    results["process_groups_left"] = len(torch.distributed.distributed_c10d._world.pg_map)
    results["seconds"] = time.perf_counter() - t0
    return results
