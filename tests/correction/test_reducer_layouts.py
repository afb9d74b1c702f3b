"""Rollout correction under real torch.distributed (gloo) + real megatron-core parallel_state, on CPU.

One 4-process spawn (module-scoped fixture) runs every layout in the same processes (``initialize_model_parallel``
/ ``destroy_model_parallel`` per layout); each rank computes

* the distributed result on its own shard: its DP rank's samples, and of each sample its CP rank's zigzag tokens
  (``slime_rc.megatron.cp_layout``), with ``megatron_reducer()`` (CP + DP) and ``megatron_reducer(data_parallel=False)``;
* the single-process references (no reducer) on the full global batch and on its DP rank's samples, restricted
  to the same tokens.

Everything goes back to this (parent) process, which does the comparisons, so a failure names the layout, the
config and the rank.  Layouts (world size 4): DP2xCP2, TP2xCP2 (TP peers hold identical data), CP4, DP4.
"""

from __future__ import annotations

import math
import types
from typing import Dict, List

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, compute_rollout_correction, parse_rejection_criteria
from slime_rc.megatron.cp_layout import zigzag_response_indices
from slime_rc.correction.packed import cu_seqlens_from_lengths

from tests.dist_utils import run_distributed

WORLD = 4
SPAWN_TIMEOUT_S = 120
N_GLOBAL = 24  # samples in the global batch: 6 per DP rank at DP4, 12 at DP2, 24 at DP1
LAYOUTS = {  # name -> (tensor_model_parallel_size, context_parallel_size); DP = 4 / (TP * CP)
    "dp2_cp2": (1, 2),
    "tp2_cp2": (2, 2),
    "cp4": (1, 4),
    "dp4": (1, 1),
}
CP_LAYOUTS = [name for name, (_, cp) in LAYOUTS.items() if cp > 1]

# special samples of the global batch
EMPTY_RESPONSE = 2  # response length 0
FULLY_MASKED = 9  # every loss-mask entry 0
VETO_SAMPLES = (5, 20)  # one token with log r = -9 (ratio ~1.2e-4)
HIGH_SAMPLE = 14  # one token with log r = +1.5
NAN_SAMPLE = 16  # the NaN batch: train log-prob NaN on one loss token of this sample

CONFIGS = {
    "token_tis_rs_veto_norm": RolloutCorrectionConfig(
        is_level="token", is_mode="truncate", is_upper_bound=1.25, is_batch_normalize=True,
        rs=parse_rejection_criteria("token", 1.4), veto_threshold=1e-3),
    "seq_clip_norm": RolloutCorrectionConfig(is_level="sequence", is_mode="clip", is_upper_bound=2.0,
                                             is_batch_normalize=True),
    "geo_mask": RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.04),
    "rs_geo_max_k3_mean_k2": RolloutCorrectionConfig(
        rs=parse_rejection_criteria("geometric,seq_max_k3,seq_mean_k2", "0.96_1.04,0.5,0.012")),
    "token_k1_asym_band": RolloutCorrectionConfig(is_level="token", is_upper_bound=2.0,
                                                  rs=parse_rejection_criteria("token_k1", "0.85_1.1")),
    # token k2/k3: their per-sequence means go through collective 1 (the RS statistics metrics)
    "token_k2_k3_seq_sum_k1": RolloutCorrectionConfig(
        is_level="sequence", is_upper_bound=2.0,
        rs=parse_rejection_criteria("token_k2,token_k3,seq_sum_k1", "0.02,0.02,0.5_2.0")),
    # run on the batch with a NaN (see _case_batch)
    "reject_nan_token_norm": RolloutCorrectionConfig(
        is_level="token", is_batch_normalize=True, rs=parse_rejection_criteria("token", 1.5),
        veto_threshold=1e-3, on_nonfinite="reject"),
    "reject_nan_seq_trunc": RolloutCorrectionConfig(is_level="sequence", is_upper_bound=2.0, is_batch_normalize=True,
                                                    on_nonfinite="reject"),
}
# policy losses (slime_rc.compute_policy_loss): each rank's share under CP+DP must add up to the global loss
LOSS_CONFIGS = {
    "dec_seq_is_rs_veto": RolloutCorrectionConfig(is_level="sequence", is_batch_normalize=True,
                                                  rs=parse_rejection_criteria("token", 2.0), veto_threshold=1e-3),
    "bypass_pg_token_is": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="token",
                                                  loss_agg="token_mean"),
    "dec_geo_mask_dilute": RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.05,
                                                   rejected_in_denominator=True, loss_agg="token_mean"),
}


def loss_inputs(train: torch.Tensor):
    """Deterministic pi_theta and advantages for a packed batch (a function of the global token index)."""
    i = torch.arange(train.numel(), dtype=torch.float32)
    return train + 0.05 * torch.cos(i), torch.sin(0.37 * i)


ERROR_CONFIG = RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, on_nonfinite="error")

# slime-style args for custom_tis.mis (check 5)
MIS_ARGS = {
    "token_rs_veto_norm": dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=1.25,
                               tis_batch_normalize=True, use_rs=True, rs_level="token_k1,seq_max_k2",
                               rs_upper_bound="0.7_1.4,0.3", rs_veto_threshold=1e-3),
    "geo_mask": dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_upper_bound=1.04),
    "seq_clip_norm": dict(use_tis=True, tis_level="sequence", tis_mode="clip", tis_upper_bound=2.0,
                          tis_batch_normalize=True),
}


# ---------------------------------------------------------------------------------------------------------------
# deterministic data (same on every rank)
# ---------------------------------------------------------------------------------------------------------------
def make_samples(n: int, seed: int, *, specials: bool = True, nan: bool = False) -> List[dict]:
    """``n`` samples: prompt length ``P``, response length ``R`` and per-response-token ``train``/``rollout``
    log-probs and ``mask``."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    out = []
    for i in range(n):
        p, r = randint(1, 24), randint(1, 40)
        if specials and i == EMPTY_RESPONSE:
            r = 0
        rollout = -torch.rand(r, generator=g) * 3 - 0.01
        sigma = 0.02 + 0.2 * float(torch.rand(1, generator=g))
        train = rollout + sigma * torch.randn(r, generator=g)
        mask = (torch.rand(r, generator=g) > 0.15).float()
        if r > 4 and i % 3 == 0:
            mask[: randint(1, 3)] = 0  # a tool-call / prompt-like head
        if specials and i == FULLY_MASKED:
            mask.zero_()
        if specials and i in VETO_SAMPLES:
            j = r // 2
            train[j], mask[j] = rollout[j] - 9.0, 1.0
        if specials and i == HIGH_SAMPLE:
            j = r // 3
            train[j], mask[j] = rollout[j] + 1.5, 1.0
        if nan and i == NAN_SAMPLE:
            j = nan_position(r)
            train[j], mask[j] = float("nan"), 1.0
        out.append(dict(P=p, R=r, train=train, rollout=rollout, mask=mask))
    return out


def nan_position(r: int) -> int:
    return (2 * r) // 3


def pack_samples(samples: List[dict]):
    cat = (lambda k: torch.cat([s[k] for s in samples]) if samples else torch.zeros(0))
    return cat("train"), cat("rollout"), cat("mask"), cu_seqlens_from_lengths([s["R"] for s in samples])


def shard(samples: List[dict], dp_size: int, dp_rank: int, cp_size: int, cp_rank: int) -> dict:
    """This rank's inputs and the indices of its tokens in the global and in its DP block's packed batch."""
    per = len(samples) // dp_size
    first = dp_rank * per
    block = samples[first:first + per]
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + s["R"])
    local, gidx, bidx, idxs = [], [], [], []
    b_off = 0
    for k, s in enumerate(block):
        idx = zigzag_response_indices(s["P"] + s["R"], s["R"], cp_size, cp_rank)
        local.append({key: s[key][idx] for key in ("train", "rollout", "mask")} | {"R": idx.numel()})
        gidx.append(starts[first + k] + idx)  # into the global packed batch
        bidx.append(b_off + idx)  # into the DP block's packed batch
        b_off += s["R"]
        idxs.append(idx)  # into the sample's response
    return dict(first=first, block=block, local=local, gidx=torch.cat(gidx), bidx=torch.cat(bidx), idx=idxs)


# ---------------------------------------------------------------------------------------------------------------
# the spawned worker (runs in each of the 4 processes)
# ---------------------------------------------------------------------------------------------------------------
def _plain(res, token_index=None, seq_slice=None) -> dict:
    """A CorrectionResult as tensors/floats, optionally restricted to some tokens and sequences."""
    w, keep = res.is_weights, res.keep_mask
    seqs = dict(res.sequences)
    if token_index is not None:
        w = None if w is None else w[token_index]
        keep = keep[token_index]
    if seq_slice is not None:
        seqs = {k: v[seq_slice] for k, v in seqs.items()}
    return dict(weights=None if w is None else w.clone(), keep=keep.clone(),
                metrics={k: float(v) for k, v in res.metrics.items()},
                sequences={k: v.clone() for k, v in seqs.items()})


def _call(sh: dict, config, reducer):
    train, rollout, mask, cu = pack_samples(sh["local"])
    return compute_rollout_correction(train, rollout, mask, cu, config, reducer=reducer)


def _case_batch(name: str, clean: List[dict], with_nan: List[dict]) -> List[dict]:
    return with_nan if name.startswith("reject_nan") else clean


def _layout_checks(ps, clean, with_nan, full_refs) -> dict:
    from slime_rc.megatron.reducers import megatron_reducer

    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    out = dict(dp_size=dp_size, dp_rank=dp_rank, cp_size=cp_size, cp_rank=cp_rank,
               tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
               cases={}, collectives={}, errors={})
    sh = shard(clean, dp_size, dp_rank, cp_size, cp_rank)
    out["gidx"] = sh["gidx"]
    seq_slice = slice(sh["first"], sh["first"] + len(sh["block"]))

    # 1 + 3: default reducer (CP + DP) vs the global single-process result; CP-only reducer vs own DP samples
    for name, config in CONFIGS.items():
        samples = _case_batch(name, clean, with_nan)
        sh = shard(samples, dp_size, dp_rank, cp_size, cp_rank)
        case = {}
        try:
            reducer = megatron_reducer()
            case["dist"] = _plain(_call(sh, config, reducer))
            case["ncoll"] = reducer.num_collectives
            case["ref"] = _plain(full_refs[name], sh["gidx"], seq_slice)
            cp_reducer = megatron_reducer(data_parallel=False)
            case["cp_only"] = _plain(_call(sh, config, cp_reducer))
            bt, br, bm, bcu = pack_samples(sh["block"])
            case["cp_only_ref"] = _plain(compute_rollout_correction(bt, br, bm, bcu, config), sh["bidx"])
        except Exception as e:  # noqa: BLE001 - reported by the parent
            case["error"] = f"{type(e).__name__}: {e}"
        out["cases"][name] = case

    # 2: collectives (and host reads) per call do not grow with the number of sequences
    from dataclasses import replace

    from slime_rc.testing.host_reads import HostReads
    out["host_reads"] = {}
    for n_local in (3, 40):
        samples = make_samples(n_local * dp_size, seed=100 + n_local, specials=False)
        sh_n = shard(samples, dp_size, dp_rank, cp_size, cp_rank)
        for name, config in CONFIGS.items():
            reducer = megatron_reducer()
            _call(sh_n, config, reducer)
            out["collectives"][(name, n_local)] = reducer.num_collectives
            packed = pack_samples(sh_n["local"])
            for policy in ("reject", "error"):
                policy_config, policy_reducer = replace(config, on_nonfinite=policy), megatron_reducer()
                with HostReads() as reads:
                    compute_rollout_correction(*packed, policy_config, reducer=policy_reducer)
                out["host_reads"][(name, n_local, policy)] = reads.count

    # 4: on_nonfinite='error' with the NaN on one (DP, CP) coordinate: every rank must raise, none may hang
    sh = shard(with_nan, dp_size, dp_rank, cp_size, cp_rank)
    info = dict(raised=None, message="", holder=False, same_dp=False)
    if sh["first"] <= NAN_SAMPLE < sh["first"] + len(sh["block"]):
        k = NAN_SAMPLE - sh["first"]
        info["same_dp"] = True
        info["local_sample"] = k
        hits = torch.nonzero(sh["idx"][k] == nan_position(with_nan[NAN_SAMPLE]["R"]))
        if hits.numel():
            info["holder"] = True
            info["local_position"] = int(hits[0, 0])
    try:
        _call(sh, ERROR_CONFIG, megatron_reducer())
    except Exception as e:  # noqa: BLE001
        info["raised"], info["message"] = type(e).__name__, str(e)
    out["errors"]["nan"] = info

    # 5: policy-loss shares and gradients on this rank's tokens
    out["losses"] = _loss_checks(clean, shard(clean, dp_size, dp_rank, cp_size, cp_rank))
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()

    # 6: custom_tis.mis CP adapter vs its non-CP function (only under CP)
    if cp_size > 1:
        out["mis"] = _mis_checks(clean, dp_size, dp_rank, cp_size, cp_rank)

    # 7: ranks that disagree are named on every rank, and the next agreeing call still works
    out["disagree"] = _disagreement_checks(ps, clean)
    return out


def _disagreement_checks(ps, samples) -> dict:
    """Each case makes one rank of every batch group (its position 1: every TP rank has one) or every CP rank 1
    differ, and records what each rank raised."""
    import torch.distributed as dist

    from slime_rc.correction.reducer import _gather_header, host_group
    from slime_rc.megatron.reducers import megatron_reducer
    from slime_rc.slime.mis import slime_mis
    from slime_rc.slime.settings import SlimeMisSettings

    batch_group = ps.get_data_parallel_group(with_context_parallel=True)
    odd = dist.get_rank(batch_group) == 1
    cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    sh = shard(samples, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), cp_size, cp_rank)
    base = RolloutCorrectionConfig(is_level="token", is_upper_bound=2.0)
    cases = {
        # same sizes everywhere: without the check, two IS caps would be silently summed
        "is_cap": lambda: _call(sh, RolloutCorrectionConfig(is_level="token", is_upper_bound=3.0) if odd else base,
                                megatron_reducer()),
        # a different column set (RS adds statistics): without the check, gloo aborts on the sizes
        "column_set": lambda: _call(sh, RolloutCorrectionConfig(is_level="token", is_upper_bound=2.0,
                                                                rs=parse_rejection_criteria("token", 1.5))
                                    if odd else base, megatron_reducer()),
        "slime_mis": lambda: slime_mis(SlimeMisSettings(use_tis=True, tis_upper=3.0 if odd else 2.0),
                                       *pack_samples(sh["local"]), reducer=megatron_reducer()),
    }
    if cp_size > 1:
        fewer = dict(sh, local=sh["local"][:-1]) if cp_rank == 1 else sh
        cases["cp_sequences"] = lambda: _call(fewer, base, megatron_reducer())
        cases["cp_sequences_cp_only"] = lambda: _call(fewer, base, megatron_reducer(data_parallel=False))
    out = {"rank": dist.get_rank(), "odd": odd, "batch_ranks": dist.get_process_group_ranks(batch_group),
           "cp_ranks": dist.get_process_group_ranks(ps.get_context_parallel_group()),
           "n_local": len(sh["local"])}
    for name, run in cases.items():
        try:
            run()
            out[name] = (None, "")
        except Exception as e:  # noqa: BLE001 - reported by the parent
            out[name] = (type(e).__name__, str(e))
    # afterwards every rank agrees again: the same call goes through (nobody is left inside a collective)
    out["after"] = float(_call(sh, base, megatron_reducer()).metrics["rollout_is_mean"])
    # the gloo mirror a NCCL group gets (made by its members only), exercised on the CP group
    mirror = host_group.__globals__["_HOST_GROUPS"].get(tuple(out["cp_ranks"]))
    if mirror is None:
        mirror = dist.new_group(out["cp_ranks"], backend="gloo", use_local_synchronization=True)
    out["mirror_gathered"] = [h[0] for h in _gather_header([dist.get_rank()], mirror, len(out["cp_ranks"]))]
    return out


def _loss_checks(samples, sh) -> dict:
    """This rank's loss share and gradient (megatron_reducer: CP + DP) next to the single-process loss of the whole
    batch and its gradient at this rank's tokens."""
    from slime_rc import compute_policy_loss
    from slime_rc.megatron.reducers import megatron_reducer

    train, rollout, mask, cu = pack_samples(samples)
    theta, adv = loss_inputs(train)
    _, _, _, local_cu = pack_samples(sh["local"])
    g = sh["gidx"]
    out = {}
    for name, config in LOSS_CONFIGS.items():
        full = theta.clone().requires_grad_(True)
        ref, _ = compute_policy_loss(full, train, rollout, adv, mask, cu, config)
        ref.backward()
        local = theta[g].clone().requires_grad_(True)
        share, _ = compute_policy_loss(local, train[g], rollout[g], adv[g], mask[g], local_cu, config,
                                       reducer=megatron_reducer())
        share.backward()
        out[name] = dict(share=float(share), ref=float(ref), grad=local.grad.clone(), ref_grad=full.grad[g].clone())
    return out


def _mis_checks(samples, dp_size, dp_rank, cp_size, cp_rank) -> dict:
    """``custom_tis.mis.compute_mis_weights_with_cp`` on this rank's zigzag tokens vs ``compute_mis_weights`` on
    the DP rank's full samples, sliced to the same tokens."""
    from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp

    sh = shard(samples, dp_size, dp_rank, cp_size, cp_rank)
    block, local = sh["block"], sh["local"]
    g = torch.Generator().manual_seed(7 + dp_rank)  # any pg_loss works: the reference multiplies the same one
    out = {}
    for name, a in MIS_ARGS.items():
        args = types.SimpleNamespace(**a)
        case = {}
        try:
            n_local = sum(s["R"] for s in local)
            pg_loss = torch.rand(n_local, generator=g) + 0.5
            pg_out, masks_cp, metrics_cp = compute_mis_weights_with_cp(
                args, pg_loss=pg_loss.clone(), train_log_probs=[s["train"] for s in local],
                rollout_log_probs=[s["rollout"] for s in local], loss_masks=[s["mask"] for s in block],
                total_lengths=[s["P"] + s["R"] for s in block], response_lengths=[s["R"] for s in block])
            weights, masks, metrics = compute_mis_weights(
                args, train_log_probs=[s["train"] for s in block], rollout_log_probs=[s["rollout"] for s in block],
                loss_masks=[s["mask"] for s in block])
            cut = (lambda lst: torch.cat([t[i] for t, i in zip(lst, sh["idx"])]) if lst else torch.zeros(0))
            # masks come back at full response length (slime cuts its own positions); metrics of slime's
            # semantics carry slime's mis_ prefix in the CP form only, as in slime's example
            case["cp"] = dict(pg_loss=pg_out.detach().clone(), masks=cut(list(masks_cp)).float(),
                              metrics={k.removeprefix("mis_"): v.clone() for k, v in metrics_cp.items()})
            case["ref"] = dict(pg_loss=pg_loss * (cut(weights) if weights is not None else 1.0),
                               masks=cut(masks).float(),
                               metrics={k: cut(v) for k, v in metrics.items()})
        except Exception as e:  # noqa: BLE001
            case["error"] = f"{type(e).__name__}: {e}"
        out[name] = case
    return out


def worker(rank: int, world_size: int) -> dict:
    """Runs in every spawned process, after ``init_process_group('gloo')`` (see ``dist_utils``)."""
    from megatron.core import parallel_state as ps

    clean = make_samples(N_GLOBAL, seed=0)
    with_nan = make_samples(N_GLOBAL, seed=0, nan=True)
    full_refs = {}
    for name, config in CONFIGS.items():
        t, r, m, cu = pack_samples(_case_batch(name, clean, with_nan))
        full_refs[name] = compute_rollout_correction(t, r, m, cu, config)

    out = {}
    for name, (tp, cp) in LAYOUTS.items():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     distributed_timeout_minutes=1)
        try:
            out[name] = _layout_checks(ps, clean, with_nan, full_refs)
        finally:
            ps.destroy_model_parallel()
    return out


# ---------------------------------------------------------------------------------------------------------------
# the parent side
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs() -> List[dict]:
    """Per-rank results of the single 4-process spawn."""
    return run_distributed(worker, WORLD, timeout=SPAWN_TIMEOUT_S)


def _close_tensor(what: str, got, want, atol: float, rtol: float = 0.0) -> None:
    assert (got is None) == (want is None), f"{what}: one side is None (got {got is None}, want {want is None})"
    if got is None:
        return
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite values {got}"
    err = (got.double() - want.double()).abs()
    tol = atol + rtol * want.double().abs()
    bad = torch.nonzero(err > tol)
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {got.numel()} entries differ; first at {int(bad[0, 0])}: "
                              f"got {float(got[bad[0, 0]])}, want {float(want[bad[0, 0]])}; max err {float(err.max())}")


def _close_metrics(what: str, got: Dict[str, float], want: Dict[str, float], rel: float = 1e-6) -> None:
    assert set(got) == set(want), f"{what}: metric names differ: {sorted(set(got) ^ set(want))}"
    bad = {k: (got[k], want[k]) for k in want
           if not (math.isfinite(got[k]) and abs(got[k] - want[k]) <= rel * abs(want[k]) + 1e-12)}
    assert not bad, f"{what}: metrics differ (got, want): {bad}"


def _compare(what: str, got: dict, want: dict) -> None:
    _close_tensor(f"{what} keep_mask", got["keep"], want["keep"], atol=0.0)
    _close_tensor(f"{what} is_weights", got["weights"], want["weights"], atol=1e-6, rtol=1e-6)
    _close_metrics(f"{what} metrics", got["metrics"], want["metrics"])
    assert set(got["sequences"]) == set(want["sequences"]), f"{what}: sequence stats differ in names"
    for k in want["sequences"]:
        _close_tensor(f"{what} sequences[{k}]", got["sequences"][k], want["sequences"][k], atol=1e-9, rtol=1e-6)


def test_layouts_are_what_megatron_builds_and_shards_cover_the_batch(runs):
    """The test's own plumbing: megatron's DP/CP/TP sizes per layout, and the (DP, CP) shards partition the
    global batch's tokens exactly (TP peers hold the same tokens)."""
    n_tokens = sum(s["R"] for s in make_samples(N_GLOBAL, seed=0))
    for name, (tp, cp) in LAYOUTS.items():
        seen = torch.zeros(n_tokens, dtype=torch.int64)
        for rank, run in enumerate(runs):
            r = run[name]
            assert (r["tp_size"], r["cp_size"], r["dp_size"]) == (tp, cp, WORLD // (tp * cp)), (name, rank, r)
            if r["tp_rank"] == 0:
                seen[r["gidx"]] += 1
        assert bool((seen == 1).all()), f"{name}: shards do not partition the tokens: {seen.tolist()}"


def test_reference_data_exercises_the_configs(runs):
    """Every config keeps some tokens and (where it can reject) rejects some beyond the loss mask: the
    comparisons below are not trivially satisfied by all-kept or all-rejected batches."""
    for name in CONFIGS:
        ref_metrics = runs[0]["dp4"]["cases"][name]["ref"]["metrics"]
        frac = ref_metrics["rejected_token_fraction"]
        assert frac < 0.9, (name, frac)
        if CONFIGS[name].rejects:
            assert frac > 0.0, (name, ref_metrics)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_reducer_matches_single_process_global_batch(runs, layout, config):
    for rank, run in enumerate(runs):
        case = run[layout]["cases"][config]
        assert "error" not in case, f"{layout}/{config} rank {rank}: {case['error']}"
        _compare(f"{layout}/{config} rank {rank}", case["dist"], case["ref"])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp_only_reducer_matches_own_dp_samples(runs, layout, config):
    for rank, run in enumerate(runs):
        case = run[layout]["cases"][config]
        assert "error" not in case, f"{layout}/{config} rank {rank}: {case['error']}"
        _compare(f"{layout}/{config} rank {rank} (CP-only reducer)", case["cp_only"], case["cp_only_ref"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_per_call_bounded_and_independent_of_sequence_count(runs, layout):
    for rank, run in enumerate(runs):
        counts = run[layout]["collectives"]
        for name in CONFIGS:
            few, many = counts[(name, 3)], counts[(name, 40)]
            assert few == many, f"{layout}/{name} rank {rank}: {few} collectives for 3 sequences, {many} for 40"
            assert 1 <= many <= 3, f"{layout}/{name} rank {rank}: {many} collectives per call"
            assert run[layout]["cases"][name].get("ncoll") == many, (layout, name, rank)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_host_read_under_every_layout(runs, layout):
    """With real collectives (gloo) the engine still reads nothing on the host with ``on_nonfinite='reject'`` and
    once with ``'error'``, on every rank, for few and many sequences."""
    for rank, run in enumerate(runs):
        counts = run[layout]["host_reads"]
        assert len(counts) == 2 * 2 * len(CONFIGS)
        bad = {k: v for k, v in counts.items() if v != (0 if k[2] == "reject" else 1)}
        assert not bad, f"{layout} rank {rank}: {bad}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nonfinite_error_raises_on_every_rank_and_holder_names_sample_and_position(runs, layout):
    holders = 0
    for rank, run in enumerate(runs):
        info = run[layout]["errors"]["nan"]
        assert info["raised"] == "ValueError", f"{layout} rank {rank}: raised {info['raised']} {info['message']!r}"
        assert "non-finite log-probs" in info["message"], info["message"]
        if info["holder"]:
            holders += run[layout]["tp_rank"] == 0
            want = f"at sample {info['local_sample']}, position {info['local_position']}"
            assert want in info["message"] and "train_log_probs is nan" in info["message"], \
                f"{layout} rank {rank}: expected {want!r} in {info['message']!r}"
        elif info["same_dp"]:  # a CP peer of the holder: the sequence is known, the token is elsewhere
            want = f"sample {info['local_sample']} (its non-finite tokens are on another rank)"
            assert want in info["message"], f"{layout} rank {rank}: expected {want!r} in {info['message']!r}"
        else:
            assert "another rank" in info["message"], f"{layout} rank {rank}: {info['message']!r}"
    assert holders == 1, f"{layout}: the NaN should sit on exactly one (DP, CP) shard, found {holders}"


@pytest.mark.parametrize("layout", CP_LAYOUTS)
def test_custom_tis_mis_with_cp_matches_non_cp(runs, layout):
    for rank, run in enumerate(runs):
        for name, case in run[layout]["mis"].items():
            what = f"{layout}/mis:{name} rank {rank}"
            assert "error" not in case, f"{what}: {case['error']}"
            got, want = case["cp"], case["ref"]
            _close_tensor(f"{what} pg_loss*weights", got["pg_loss"], want["pg_loss"], atol=1e-6, rtol=1e-6)
            _close_tensor(f"{what} masks", got["masks"], want["masks"], atol=0.0)
            assert set(got["metrics"]) == set(want["metrics"]), f"{what}: metric names differ"
            for k in want["metrics"]:
                _close_tensor(f"{what} metrics[{k}]", got["metrics"][k], want["metrics"][k], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_policy_loss_shares_add_up_and_gradients_match_single_process(runs, layout):
    for name in LOSS_CONFIGS:
        shares, ref = 0.0, None
        for rank, run in enumerate(runs):
            case = run[layout]["losses"][name]
            what = f"{layout}/{name} rank {rank}"
            _close_tensor(f"{what} grad", case["grad"], case["ref_grad"], atol=1e-7, rtol=1e-6)
            ref = case["ref"]
            if run[layout]["tp_rank"] == 0:  # TP peers hold the same tokens: count each (DP, CP) shard once
                shares += case["share"]
        assert ref != 0.0
        assert shares == pytest.approx(ref, rel=1e-6, abs=1e-9), f"{layout}/{name}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ranks_that_disagree_are_named_on_every_rank(runs, layout):
    """A different IS cap (equal collective sizes), a different column set (unequal sizes), different slime mis
    settings, and CP peers with different sequence counts: every rank raises a ValueError naming the ranks and
    what differs -- no gloo abort, no silent merge -- and the next agreeing call goes through."""
    results = [run[layout]["disagree"] for run in runs]
    for r in results:
        odd = [o["rank"] for o in results if o["odd"] and o["rank"] in r["batch_ranks"]]
        assert len(odd) == 1, (layout, r["rank"], odd)
        for case, key, values in (("is_cap", "is_upper_bound", ("2.0", "3.0")),
                                  ("column_set", "rs", ("[]", "'option': 'token'")),
                                  ("slime_mis", "tis_upper", ("2.0", "3.0"))):
            raised, message = r[case]
            what = f"{layout}/{case} rank {r['rank']}: {raised} {message!r}"
            assert raised == "ValueError", what
            assert "the ranks disagree before their first collective" in message, what
            assert f"{key}: " in message and all(v in message for v in values), what
            assert f"rank {odd[0]} has " in message, what
        if "cp_sequences" in r:
            n = {o["rank"]: o["n_local"] for o in results}
            cp = r["cp_ranks"]
            for case in ("cp_sequences", "cp_sequences_cp_only"):
                raised, message = r[case]
                what = f"{layout}/{case} rank {r['rank']}: {raised} {message!r}"
                assert raised == "ValueError" and "hold different numbers of sequences" in message, what
                assert f"rank {cp[0]} holds {n[cp[0]]}; rank {cp[1]} holds {n[cp[1]] - 1}" in message, what
        assert r["after"] > 0
        assert sorted(r["mirror_gathered"]) == sorted(r["cp_ranks"]), (layout, r)
