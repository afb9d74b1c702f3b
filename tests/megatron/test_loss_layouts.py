"""A tiny real megatron-core GPT trained under every parallel layout matches the 1-process run.

Three spawns for the whole file (module-scoped fixtures): the 1-process reference, one 2-process spawn (TP2,
TP2+SP, PP2, PP2+VPP2, CP2, DP2, PP2 with tied embeddings) and one 4-process spawn (TP2xPP2, CP4, DP2xCP2,
TP2xCP2, TP2xCP2+SP, PP2+VPP2xDP2); each spawn re-initialises megatron's parallel state per layout
(``tests/megatron_harness.py``).  Layouts of 2 ranks run in the 2-process spawn so that they are exactly that
layout (in a 4-process world megatron would add DP2 to each).

The data layout is slime's (``slime_rc.megatron.cp_layout``): per-sequence zigzag padding only, each rank's packed stream
padded at its end to a multiple of ``tp * pad_multiplier`` (some CP layouts set ``pad_multiplier`` so that the
stream-padding segment goes through the CP attention and RoPE).  The positions every rank holds are checked against
slime's ``slice_with_cp`` / ``slice_log_prob_with_cp`` (written out in ``tests/slime_like_tis.py``) for sequence
lengths 1..40: in every layout under megatron's real parallel state, and for the grid cp in {2, 4} x tp in
{1, 2, 4} x sequence parallel or not in one process.

Per layout: ``N_STEPS`` optimizer steps (Adam, megatron's ``get_megatron_optimizer``, DDP, schedules) on a global
batch of 8 packed micro-batches of variable-length sequences (a different total length per micro-batch), then one
forward-only pass, with the token-level REINFORCE loss ``-sum(logp * adv * mask) / loss tokens of the global
batch`` (``vocab_parallel_log_probs``, temperature 0.7).  Checked against the reference, to 1e-5 relative: the
loss and the grad norm of every step, the per-token log-probs of every micro-batch and step (gathered from the CP
shards back to the packed order, DP ranks' micro-batches merged), the forward-only log-probs, every updated
parameter and the parameter norm; the initial weights must be bitwise identical.  Some layouts also run
megatron's legacy ``(loss, logs)`` convention, which must give the same numbers.
"""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.megatron_harness import ATTENTION_CHECKS, LAYOUTS, N_MICRO_BATCHES, N_STEPS, REFERENCE, TIS_FUNCTIONS, \
    global_loss_tokens, make_global_batch, reference_key, worker

RTOL = 1e-5
SPAWN_TIMEOUT_S = 600  # a deadlock guard, not a budget: the 4-process spawn takes minutes on 2 shared cores
CASES = [(name, conv) for name, spec in LAYOUTS.items() for conv in spec[2]]
EXPECTED_SIZES = {  # name -> (tp, pp, vpp, cp, dp, sp)
    "tp2": (2, 1, 1, 1, 1, False), "tp2_sp": (2, 1, 1, 1, 1, True), "pp2": (1, 2, 1, 1, 1, False),
    "pp2_vpp2": (1, 2, 2, 1, 1, False), "cp2": (1, 1, 1, 2, 1, False), "dp2": (1, 1, 1, 1, 2, False),
    "tp2_pp2": (2, 2, 1, 1, 1, False), "cp4": (1, 1, 1, 4, 1, False), "dp2_cp2": (1, 1, 1, 2, 2, False),
    "tp2_cp2": (2, 1, 1, 2, 1, False), "pp2_vpp2_dp2": (1, 2, 2, 1, 2, False), "pp2_tied": (1, 2, 1, 1, 1, False),
    "tp2_cp2_sp": (2, 1, 1, 2, 1, True),
}


def _spawn(world: int, names: List[str]) -> List[dict]:
    return run_distributed(worker, world, args=(names,), timeout=SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _spawn(1, [REFERENCE])[0]


@pytest.fixture(scope="module")
def layout_runs() -> Dict[str, List[dict]]:
    """``{(layout, convention): [per-rank result]}`` from the 2- and 4-process spawns."""
    out = {}
    for world in (2, 4):
        names = [n for n, spec in LAYOUTS.items() if spec[0] == world]
        per_rank = _spawn(world, names)
        for name in names:
            for conv in LAYOUTS[name][2]:
                out[(name, conv)] = [r[(name, conv)] for r in per_rank]
            if name in ATTENTION_CHECKS:
                out[("attention", name)] = [r[("attention", name)] for r in per_rank]
            out[("positions", name)] = [r[("positions", name)] for r in per_rank]
        out[("process_groups_left", world)] = [r["process_groups_left"] for r in per_rank]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_each_layout_destroys_the_process_groups_it_made(layout_runs, world):
    """After the spawn's layouts, each initialised and destroyed in turn (``demo.model.destroy_parallel``), every
    rank holds the default group only."""
    assert layout_runs[("process_groups_left", world)] == [1] * world


def rel(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def _merged_logp(runs: List[dict], key: str, step=None) -> Dict[int, torch.Tensor]:
    """Micro-batch id -> log-probs, merged over the DP ranks' reporters; every micro-batch exactly once."""
    merged = {}
    for r in runs:
        part = r[key] if step is None else r[key][step]
        for i, t in part.items():
            assert i not in merged, f"micro-batch {i} reported twice"
            merged[i] = t
    return merged


def _logp_rel_err(got: Dict[int, torch.Tensor], want: Dict[int, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want) == list(range(N_MICRO_BATCHES)), (sorted(got), sorted(want))
    worst = 0.0
    for i in want:
        assert got[i].shape == want[i].shape, (i, got[i].shape, want[i].shape)
        assert bool(torch.isfinite(got[i]).all()), f"micro-batch {i}: non-finite log-probs (a position not gathered?)"
        worst = max(worst, float(((got[i].double() - want[i].double()).abs() / want[i].double().abs()).max()))
    return worst


def _params_rel_err(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Dict[str, float]:
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    out = {}
    for k in want:
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        out[k] = float((got[k].double() - want[k].double()).norm() / want[k].double().norm())
    return out


# ---------------------------------------------------------------------------------------------------------------
# the test's own plumbing: data and reference are non-trivial
# ---------------------------------------------------------------------------------------------------------------
def test_global_batch_is_packed_variable_length():
    batch = make_global_batch()
    totals = [int(mb["tokens"].numel()) for mb in batch]
    assert len(set(totals)) == len(totals), totals
    assert any(mb["cu_seqlens"].numel() > 2 for mb in batch), "some micro-batch must pack several sequences"
    for mb in batch:
        ends = mb["cu_seqlens"][1:].long() - 1
        assert bool((mb["loss_mask"][ends] == 0).all()), "the last position of a sequence has no target"
    assert global_loss_tokens(batch) > 50


def test_reference_is_nontrivial(reference):
    ref = reference[(REFERENCE, "per_token", "base")]
    assert all(abs(x) > 0.05 for x in ref["loss"]), ref["loss"]  # relative errors are meaningful
    assert len(set(ref["loss"])) == N_STEPS, "the loss must change between steps"
    assert all(g > 0.05 for g in ref["grad_norm"]), ref["grad_norm"]
    moved = _params_rel_err(ref["final_params"], ref["init_params"])
    assert min(moved.values()) > 1e-3, f"every parameter must move by far more than the tolerance: {moved}"
    assert ref["num_tokens"] == [global_loss_tokens(make_global_batch())] * N_STEPS
    # the two loss conventions are the same objective
    leg = reference[(REFERENCE, "legacy", "base")]
    for a, b in zip(leg["loss"] + leg["grad_norm"], ref["loss"] + ref["grad_norm"]):
        assert rel(a, b) <= RTOL, (leg["loss"], ref["loss"], leg["grad_norm"], ref["grad_norm"])


@pytest.mark.parametrize("where", list(ATTENTION_CHECKS))
def test_core_attention_matches_torch_sdpa(reference, layout_runs, where):
    """The CP core attention on each rank's zigzag shard vs torch's causal SDPA on the full sequences (packed
    ``thd`` per sequence, GQA, ``sbhd``): outputs and q/k/v gradients (the K/V all-gather's backward)."""
    per_rank = [reference[("attention", REFERENCE)]] if where == REFERENCE else layout_runs[("attention", where)]
    assert len(per_rank) == ATTENTION_CHECKS[where] or where == REFERENCE
    for rank, errs in enumerate(per_rank):
        assert len(errs) == 12, sorted(errs)
        bad = {k: v for k, v in errs.items() if not v <= RTOL}
        assert not bad, f"{where} rank {rank}: {bad}"


# ---------------------------------------------------------------------------------------------------------------
# the data layout is slime's
# ---------------------------------------------------------------------------------------------------------------
def test_positions_equal_slimes_for_every_length_rank_cp_and_tp(reference):
    """``shard_micro_batch`` for cp in {2, 4} x tp in {1, 2, 4} x SP or not x pad_multiplier 1 / 3: for every
    sequence length 1..40 (alone and packed) and every rank, the positions held, the response log-prob indices held,
    the tokens / fields / targets carried equal slime's (and ``slime_rc.megatron.cp_layout``'s); the global cu_seqlens are the
    local ones times cp with the stream padding last, and the stream is a multiple of tp."""
    grid = reference["position_grid"]
    want = {(cp, tp, sp, pm) for cp in (2, 4) for tp in (1, 2, 4) for sp in ((False, True) if tp > 1 else (False,))
            for pm in (1, 3)}
    assert set(grid) == want, sorted(set(grid) ^ want)
    for key, counts in grid.items():
        assert counts["pairs"] == key[0] * (40 + 2 * 40), (key, counts)  # 40 alone + 2 packed batches of 40, per rank
        assert counts["mismatches"] == 0, (key, counts)


@pytest.mark.parametrize("name", [REFERENCE] + list(LAYOUTS))
def test_positions_under_megatron_parallel_state(reference, layout_runs, name):
    """What train_step shards (``shard_for_layout``, megatron's CP rank and TP size, the layout's pad_multiplier)
    equals slime's layout on every rank."""
    per_rank = [reference[("positions", REFERENCE)]] if name == REFERENCE else layout_runs[("positions", name)]
    for rank, counts in enumerate(per_rank):
        assert counts["pairs"] == 120 and counts["mismatches"] == 0, (name, rank, counts)


# ---------------------------------------------------------------------------------------------------------------
# every layout vs the 1-process run
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,conv", CASES)
def test_layout_is_what_megatron_built(layout_runs, name, conv):
    runs = layout_runs[(name, conv)]
    tp, pp, vpp, cp, dp, sp = EXPECTED_SIZES[name]
    for rank, r in enumerate(runs):
        s = r["sizes"]
        assert (s["tp"], s["pp"], s["vpp"], s["cp"], s["dp"], s["sp"], s["chunks"]) == (tp, pp, vpp, cp, dp, sp, vpp), \
            (name, rank, s)


@pytest.mark.parametrize("name,conv", CASES)
def test_initial_weights_identical(reference, layout_runs, name, conv):
    got = layout_runs[(name, conv)][0]["init_params"]
    want = reference[reference_key(name, conv)]["init_params"]
    assert sorted(got) == sorted(want)
    diff = {k: float((got[k] - want[k]).abs().max()) for k in want}
    assert all(v == 0.0 for v in diff.values()), {k: v for k, v in diff.items() if v}


@pytest.mark.parametrize("name,conv", CASES)
def test_loss_and_grad_norm_match(reference, layout_runs, name, conv):
    ref = reference[reference_key(name, conv)]
    for rank, r in enumerate(layout_runs[(name, conv)]):
        for step in range(N_STEPS):
            assert rel(r["loss"][step], ref["loss"][step]) <= RTOL, (name, conv, rank, step, r["loss"], ref["loss"])
            assert rel(r["grad_norm"][step], ref["grad_norm"][step]) <= RTOL, \
                (name, conv, rank, step, r["grad_norm"], ref["grad_norm"])
        assert rel(r["fwd_loss"], ref["fwd_loss"]) <= RTOL, (name, conv, rank, r["fwd_loss"], ref["fwd_loss"])
        if conv == "per_token":
            assert r["num_tokens"] == ref["num_tokens"], (name, rank, r["num_tokens"], ref["num_tokens"])


@pytest.mark.parametrize("name,conv", CASES)
def test_log_probs_match_in_global_order(reference, layout_runs, name, conv):
    runs, ref = layout_runs[(name, conv)], reference[reference_key(name, conv)]
    for step in range(N_STEPS):
        err = _logp_rel_err(_merged_logp(runs, "logp", step), ref["logp"][step])
        assert err <= RTOL, f"{name}/{conv} step {step}: log-probs max relative error {err:.3g}"
    err = _logp_rel_err(_merged_logp(runs, "fwd_logp"), ref["fwd_logp"])
    assert err <= RTOL, f"{name}/{conv} forward-only: log-probs max relative error {err:.3g}"


@pytest.mark.parametrize("name,conv", CASES)
def test_updated_parameters_match(reference, layout_runs, name, conv):
    """All parameters, as one vector, and the parameter norm of every rank.  (Not each tensor to 1e-5 on its own:
    Adam divides each coordinate by sqrt(v) + eps, so a coordinate whose gradient is near zero -- here a few
    query/key-bias entries with |g| ~ 1e-8..1e-7 -- turns fp32 summation-order noise (~1e-11) into update noise;
    the q/k biases end up ~2e-5 apart in TP layouts while everything else agrees to ~1e-7.)"""
    runs, ref = layout_runs[(name, conv)], reference[reference_key(name, conv)]
    got, want = runs[0]["final_params"], ref["final_params"]
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    diff = math.sqrt(sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want))
    assert diff / ref["param_norm"] <= RTOL, \
        f"{name}/{conv}: parameters differ: {diff / ref['param_norm']:.3g}; per tensor {_params_rel_err(got, want)}"
    for rank, r in enumerate(runs):  # every replica / shard holder ends with the same model
        assert rel(r["param_norm"], ref["param_norm"]) <= RTOL, (name, conv, rank, r["param_norm"], ref["param_norm"])


@pytest.mark.parametrize("name", [n for n, spec in LAYOUTS.items() if spec[1].get("vpp")])
def test_interleaved_pipeline_on_gloo_refuses_as_many_micro_batches_as_stages(layout_runs, name):
    for rank, r in enumerate(layout_runs[(name, "per_token")]):
        assert r["vpp_guard"] is not None and "needs more micro-batches than pp=2" in r["vpp_guard"], (rank, r["vpp_guard"])


POLICY_CASES = [(n, c) for n, c in CASES if c.startswith("policy_") and c != "policy_tis_function"]
FUNCTION_CASES = [(n, c) for n, c in CASES if c in TIS_FUNCTIONS]


def test_policy_references_correct_and_reject(reference):
    """The policy-loss references are non-trivial: the correction rejects some tokens and moves the weights."""
    tis = reference[(REFERENCE, "policy_tis_function", "base")]
    # the function's own metrics under its names; beside them the mismatch metrics and what it applied, under the
    # engine's names (one set of names whichever path corrects)
    from slime_rc.correction.metrics import METRICS
    names = tis["metrics"][0][0]
    own = {k for k in names if k.startswith("rollout_corr/tis_function/")}
    assert own and {k[len("rollout_corr/"):] for k in set(names) - own} <= set(METRICS), sorted(names)
    assert {"rollout_corr/k3_kl", "rollout_corr/rejected_token_fraction"} <= set(names), sorted(names)
    for conv in ("policy_prestep", "policy_bypass"):
        ref = reference[(REFERENCE, conv, "base")]
        m = ref["metrics"][0][0]
        assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1, (conv, m)
        assert abs(m["rollout_corr/rollout_is_mean"] - 1.0) > 1e-3, (conv, m)
        assert all(abs(x) > 1e-3 for x in ref["loss"]) and len(set(ref["loss"])) == N_STEPS, (conv, ref["loss"])


@pytest.mark.parametrize("name,conv", POLICY_CASES)
def test_policy_correction_metrics_match(reference, layout_runs, name, conv):
    """Correction metrics of every micro-batch equal the 1-process run's: global over the batch in the pre-step
    path, per micro-batch over the CP group in the in-loss path.  Step 0 (identical weights in every layout) to
    1e-5; later steps to 1e-4, because they start from weights that already differ by Adam's ~1e-6 noise.  Some
    metrics are exponentials of sequence sums (chi2_seq = mean exp(2 sum log r) - 1, ~35 at step 0 and ~3e3 later
    in bypass mode, where log r comes from the model): they turn the layouts' ~2e-7 log-prob differences, summed
    over ~40 tokens, into ~2e-6 at step 0 and ~1e-5 later."""
    ref = reference[reference_key(name, conv)]
    for step in range(N_STEPS):
        tol = 1e-5 if step == 0 else 1e-4
        merged = {}
        for r in layout_runs[(name, conv)]:
            merged.update(r["metrics"][step])
        assert sorted(merged) == list(range(N_MICRO_BATCHES)), sorted(merged)
        for i, want in ref["metrics"][step].items():
            got = merged[i]
            assert sorted(got) == sorted(want)
            for k, v in want.items():
                if k.startswith("rollout_corr/tis_function/"):
                    continue  # a custom function's metrics are this rank's token means (documented), not global
                assert abs(got[k] - v) <= tol * max(1.0, abs(v)), (name, conv, step, i, k, got[k], v)


def test_tis_function_references_report_their_metrics(reference):
    """The slime-contract functions' own metrics come back reduced as slime reduces them: for the function written
    like slime's example, ``lower_bound`` is ``1 / args.tis_upper_bound`` of the config (1.5) on every token -- so
    each sample's masked mean is that constant, except for samples without loss tokens (0), and slime divides by
    all the samples of the global batch -- and it truncated something."""
    masks = [mb["loss_mask"][a:b] for mb in make_global_batch()
             for a, b in zip(mb["cu_seqlens"][:-1].tolist(), mb["cu_seqlens"][1:].tolist())]
    with_tokens = sum(float(m.sum()) > 0 for m in masks)
    assert 0 < with_tokens < len(masks)  # some samples have no loss token: they count in the denominator
    slime_fn = reference[(REFERENCE, "policy_slime_function", "base")]["function_metrics"]
    for step in range(N_STEPS):
        m = slime_fn[step]
        assert sorted(m) == [f"rollout_corr/tis_function/{k}" for k in ("kl", "lower_bound", "seq_log_ratio",
                                                                          "truncate_fraction", "weight_mean")], m
        want = (1 / 1.5) * with_tokens / len(masks)
        assert abs(m["rollout_corr/tis_function/lower_bound"] - want) < 1e-7, (m, want)
        assert 0 < m["rollout_corr/tis_function/truncate_fraction"] < 0.5, m
    ours = reference[(REFERENCE, "policy_tis_function", "base")]["function_metrics"][0]
    assert "rollout_corr/tis_function/kl" in ours and len(ours) > 10, sorted(ours)


@pytest.mark.parametrize("name,conv", FUNCTION_CASES)
def test_tis_function_metrics_match(reference, layout_runs, name, conv):
    """A TIS function's own metrics (slime's reduction: per-sample means over the original loss mask, summed over
    micro-batches, all-reduced over DP x CP, per global sample) equal the 1-process run's under CP (its per-token
    values are CP-local), on every reporting rank.  (Here they depend on the data only: pi_old is given.)"""
    ref = reference[reference_key(name, conv)]["function_metrics"]
    for step in range(N_STEPS):
        reported = [r["function_metrics"][step] for r in layout_runs[(name, conv)] if r["function_metrics"][step]]
        assert reported, (name, conv, step)
        for got in reported:
            assert sorted(got) == sorted(ref[step])
            for k, v in ref[step].items():
                assert abs(got[k] - v) <= 1e-6 * max(1.0, abs(v)), (name, conv, step, k, got[k], v)
