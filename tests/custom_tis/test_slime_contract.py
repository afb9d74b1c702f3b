"""custom_tis under slime's contract, played the way slime's loss plays it (tests/slime_reference.py):
full-length masks cut by zigzag, original-mask denominators, per-sample mean reduction of metrics — single process
over the whole settings grid, and CP = 2, 4 over real megatron-core parallel_state (gloo)."""

from __future__ import annotations

import itertools
import warnings
from types import SimpleNamespace as NS

import pytest
import torch

import slime_rc.slime.settings as slime_settings
from custom_tis.icepop import compute_icepop_weights, compute_icepop_weights_with_cp
from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp
from slime_rc.slime.tis_hooks import check_shared_yaml
from custom_tis.tis import compute_tis_weights, compute_tis_weights_with_cp
from tests.dist_utils import run_distributed
from tests.slime_reference import (consume, icepop_reference, make_samples, mis_reference, rank_inputs,
                                   tis_reference, zigzag_positions)

from slime_rc.slime.mis import MISMATCH_METRICS, SLIME_METRICS

# every combination of item 2: tis_level x tis_mode x rs_level x veto x batch norm, bounds unset or set
GRID = [dict(use_tis=use_tis, tis_level=level, tis_mode=mode, use_rs=rs is not None, rs_level=rs,
             rs_veto_threshold=veto, tis_batch_normalize=bn, **bounds)
        for use_tis, level, mode, rs, veto, bn, bounds in itertools.product(
            (True, False), ("token", "sequence", "geometric"), ("truncate", "clip", "mask"),
            (None, "token", "sequence", "geometric"), (None, 1e-4), (False, True),
            (dict(tis_lower_bound=0.5, tis_upper_bound=2.0, rs_lower_bound=None, rs_upper_bound=None),  # mis.yaml
             dict(tis_upper_bound=1.6),  # every lower bound and the RS band from tis_upper_bound
             dict(tis_lower_bound=0.7, tis_upper_bound=1.5, rs_lower_bound=0.4, rs_upper_bound=3.0)))]


def _reduce_reference(keys, samples, idx_all, pg_full, per_token=False):
    """slime's reduction of the reference's full-sequence result: (loss, gradient per sample, metrics)."""
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    w, new_masks, metrics = mis_reference(keys, train, rollout, masks)
    pg = [p.detach().double().clone().requires_grad_(True) for p in pg_full]
    out = torch.cat([p * (wi if w is not None else 1.0) for p, wi in zip(pg, w or [None] * len(pg))])
    loss, red = consume(out, new_masks, {"mis_" + k: torch.cat(v) for k, v in metrics.items()}, masks, idx_all,
                        per_token)
    loss.backward()
    return float(loss.detach()), [p.grad for p in pg], {k: float(v) for k, v in red.items()}, new_masks


def _reduce_ours(args, samples, pg_full, cp=1, rank=0, per_token=False):
    idx, inputs = rank_inputs(samples, cp, rank)
    pg = [p.detach().clone().requires_grad_(True) for p in pg_full]
    local_pg = torch.cat([p[i] for p, i in zip(pg, idx)])
    out, masks, metrics = compute_mis_weights_with_cp(args, pg_loss=local_pg, **inputs)
    loss, red = consume(out, masks, metrics, inputs["loss_masks"], idx, per_token)
    loss.backward()
    return loss.detach(), [p.grad for p in pg], {k: v.detach() for k, v in red.items()}, masks, idx


def test_grid_returns_exactly_slimes_metric_names():
    """The union over the grid is slime's 27 names; the 11 mismatch metrics come with every setting."""
    samples = make_samples(0)
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for keys in GRID:
            _, _, metrics = compute_mis_weights(NS(**keys), train_log_probs=train, rollout_log_probs=rollout,
                                                loss_masks=masks)
            assert set(MISMATCH_METRICS) <= set(metrics)
            seen |= set(metrics)
    assert seen == set(SLIME_METRICS), seen ^ set(SLIME_METRICS)


def _close(a, b, what, tol=1e-6):
    a, b = float(a), float(b)
    assert abs(a - b) <= tol * max(1.0, abs(b)), f"{what}: {a} vs {b}"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    slime_settings._warned.clear()
    yield


@pytest.mark.parametrize("level,mode", list(itertools.product(("token", "sequence", "geometric"),
                                                              ("truncate", "clip", "mask"))))
def test_mis_equals_slime_semantics_on_every_combination(level, mode):
    samples = make_samples(0)
    g = torch.Generator().manual_seed(1)
    pg_full = [torch.randn(s["R"], generator=g) for s in samples]
    idx_all = [torch.arange(s["R"]) for s in samples]
    for keys in (k for k in GRID if k["tis_level"] == level and k["tis_mode"] == mode):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss, grads, metrics, masks, _ = _reduce_ours(NS(**keys), samples, pg_full)
        want_loss, want_grads, want_metrics, want_masks = _reduce_reference(keys, samples, idx_all, pg_full)
        _close(loss, want_loss, f"{keys} loss")
        for i, (a, b) in enumerate(zip(grads, want_grads)):
            assert torch.allclose(a.double(), b, atol=1e-6, rtol=1e-6), f"{keys} grad of sample {i}"
        for i, (a, b) in enumerate(zip(masks, want_masks)):
            assert a.dtype == samples[i]["mask"].dtype and torch.equal(a.double(), b), f"{keys} mask {i}"
        assert set(metrics) == set(want_metrics), f"{keys}: {set(metrics) ^ set(want_metrics)}"
        assert set(MISMATCH_METRICS) <= {k[4:] for k in metrics}
        for k in want_metrics:
            _close(metrics[k], want_metrics[k], f"{keys} {k}")


def test_slime_defaults_rs_bounds_follow_is_bounds():
    """mis.yaml's rs bounds are null: the RS band is the IS band; tis_lower_bound unset is 1/upper."""
    samples = make_samples(3)
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    _, got, _ = compute_mis_weights(NS(use_tis=True, use_rs=True, tis_upper_bound=1.5, rs_upper_bound=None),
                                    train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    _, explicit, _ = compute_mis_weights(NS(use_tis=True, use_rs=True, tis_upper_bound=1.5, rs_lower_bound=1 / 1.5,
                                            rs_upper_bound=1.5), train_log_probs=train, rollout_log_probs=rollout,
                                         loss_masks=masks)
    assert all(torch.equal(a, b) for a, b in zip(got, explicit))
    assert any(not torch.equal(a, m) for a, m in zip(got, masks)), "the data must make the band reject something"


def test_mis_yaml_verbatim_runs(tmp_path):
    """slime's shipped mis.yaml (keys and values as slime ships them) set onto args the way slime does."""
    import yaml

    text = ("use_tis: true\nuse_rs: true\ntis_level: \"token\"\nrs_level: \"token\"\ntis_mode: \"truncate\"\n"
            "tis_lower_bound: 0.5\ntis_upper_bound: 2.0\nrs_lower_bound: null\nrs_upper_bound: null\n"
            "rs_veto_threshold: 1.0e-4\ntis_batch_normalize: true\n")
    path = tmp_path / "mis.yaml"
    path.write_text(text)
    args = NS(custom_config_path=str(path), use_tis=False)  # slime's --use-tis default, overridden by the YAML
    for k, v in yaml.safe_load(text).items():
        setattr(args, k, v)
    samples = make_samples(4)
    pg_full = [torch.ones(s["R"]) for s in samples]
    loss, _, metrics, _, _ = _reduce_ours(args, samples, pg_full)
    want_loss, _, want_metrics, _ = _reduce_reference(vars(args), samples, [torch.arange(s["R"]) for s in samples],
                                                      pg_full)
    _close(loss, want_loss, "loss")
    assert metrics["mis_rs_catastrophic_seq_fraction"] > 0 and "mis_batch_norm_factor" in metrics


@pytest.mark.parametrize("keys,defect", [
    (dict(use_tis=False, use_rs=True, rs_level="sequence", tis_upper_bound=1.5), "rs_without_tis"),
    (dict(use_tis=True, rs_veto_threshold=1e-4), "veto_without_rs"),
    (dict(use_tis=False, rs_veto_threshold=1e-4), "veto_without_rs"),
])
def test_slime_defects_are_not_copied_and_warn_once(keys, defect):
    samples = make_samples(0)
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    with pytest.warns(UserWarning, match="slime's example mis.py") as record:
        _, got, _ = compute_mis_weights(NS(**keys), train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=masks)
        compute_mis_weights(NS(**keys), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    said = slime_settings.DEFECTS[defect].split(": ", 1)[1][:40]  # what slime does, after the formatted setting
    assert sum(said in str(r.message) for r in record) == 1
    _, slime_masks, _ = mis_reference(keys, train, rollout, masks, rs_without_tis=False, veto_without_rs=False)
    _, ours, _ = mis_reference(keys, train, rollout, masks)
    assert all(torch.equal(a.double(), b) for a, b in zip(got, ours))
    assert any(not torch.equal(a, b) for a, b in zip(ours, slime_masks)), "the difference must show in the masks"


def test_geometric_batch_normalize_warns_and_normalizes_like_sequence():
    samples = make_samples(2)
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    keys = dict(use_tis=True, tis_level="geometric", tis_mode="clip", tis_upper_bound=1.3, tis_batch_normalize=True)
    with pytest.warns(UserWarning, match="Unsupported tis_level"):
        w, _, metrics = compute_mis_weights(NS(**keys), train_log_probs=train, rollout_log_probs=rollout,
                                            loss_masks=masks)
    seq_means = [float((wi.double() * m).sum() / max(float(m.sum()), 1)) for wi, m in zip(w, masks)]
    assert abs(sum(seq_means) / len(seq_means) - 1) < 1e-6  # mean over sequences of the final weight is 1


@pytest.mark.parametrize("fn,with_cp,ref", [(compute_tis_weights, compute_tis_weights_with_cp, tis_reference),
                                            (compute_icepop_weights, compute_icepop_weights_with_cp,
                                             icepop_reference)], ids=["tis", "icepop"])
@pytest.mark.parametrize("bounds", [{}, dict(tis_clip=1.4, tis_clip_low=0.6)], ids=["defaults", "band"])
def test_tis_and_icepop_equal_slime_builtins(fn, with_cp, ref, bounds):
    samples = make_samples(5)
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    w, m, metrics = fn(NS(**bounds), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    rw, rm, rmetrics = ref(bounds, train, rollout, masks)
    for a, b in zip(w, rw):
        assert torch.allclose(a.double(), b, rtol=1e-6, atol=1e-7)
    assert all(a is b or torch.equal(a, b) for a, b in zip(m, rm))  # slime returns the loss masks unchanged
    assert set(metrics) == {"tis", "tis_clipfrac", "tis_abs"}
    for k in metrics:
        for a, b, mm in zip(metrics[k], rmetrics[k], masks):
            assert torch.allclose(a.double() * mm, b * mm, rtol=1e-6, atol=1e-7), k
    pg = torch.randn(sum(s["R"] for s in samples), dtype=torch.float64)
    idx, inputs = rank_inputs(samples, 1, 0)
    out, full, flat = with_cp(NS(**bounds), pg_loss=pg, **inputs)
    assert out.dtype == torch.float64 and torch.allclose(out, pg * torch.cat(rw), rtol=1e-6)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(full, masks))


def test_dtypes_kept_and_weights_detached():
    samples = make_samples(6)
    idx, inputs = rank_inputs(samples, 1, 0)
    pg = torch.randn(sum(len(i) for i in idx), dtype=torch.bfloat16, requires_grad=True)
    out, masks, metrics = compute_mis_weights_with_cp(NS(use_tis=True, use_rs=True), pg_loss=pg, **inputs)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    assert [m.dtype for m in masks] == [torch.int32] * len(masks)
    assert all(v.dtype == torch.float32 and not v.requires_grad and v.shape == pg.shape for v in metrics.values())


# ---- bad input through the slime path -----------------------------------------------------------------------
def _call(keys, samples=None, **over):
    samples = samples or make_samples(0)
    idx, inputs = rank_inputs(samples, 1, 0)
    inputs.update(over)
    return compute_mis_weights_with_cp(NS(**keys), pg_loss=torch.ones(sum(len(i) for i in idx)), **inputs)


@pytest.mark.parametrize("keys,needle", [
    (dict(use_tis=True, tis_upper_bound="2.0"), "tis_upper_bound='2.0' is a string"),
    (dict(use_tis=True, use_rs=True, rs_veto_threshold="1e-4"), "write rs_veto_threshold: 2.0 or 1.0e-4"),
    (dict(use_tis="true"), "use_tis='true' must be true or false"),
    (dict(use_tis=True, tis_level="tokn"), "Did you mean 'token'"),
    (dict(use_tis=True, tis_mode="truncated"), "tis_mode='truncated' is not one of"),
    (dict(use_tis=True, tis_upper_bound=-1.0), "tis_upper_bound=-1.0 must be a finite number > 0"),
    (dict(use_tis=True, tis_mode="clip", tis_lower_bound=3.0, tis_upper_bound=2.0),
     "must be < is_upper_bound=2.0; lower it or leave it unset (it defaults to 1/upper = 0.5). (set by "
     "tis_upper_bound in slime's args, tis_lower_bound in slime's args)"),
    (dict(use_tis=True, use_rs=True, rs_lower_bound=2.5, tis_upper_bound=2.0), "lower=2.5 must be < upper=2.0"),
    (dict(use_tis=True, mis_upper_bound=3.0, tis_upper_bound=2.0), "older spelling mis_upper_bound"),
])
def test_bad_slime_keys_name_the_key(keys, needle):
    with pytest.raises(ValueError, match=None) as e:
        _call(keys)
    assert needle in str(e.value), str(e.value)


def test_bad_lists_name_the_argument():
    samples = make_samples(0)
    idx, inputs = rank_inputs(samples, 1, 0)
    pg = torch.ones(sum(len(i) for i in idx))
    with pytest.raises(ValueError, match="loss_masks must be the full response mask of response_lengths"):
        compute_mis_weights_with_cp(NS(use_tis=True), pg_loss=pg, **{**inputs, "loss_masks": [
            m[:-1] if i == 2 else m for i, m in enumerate(inputs["loss_masks"])]})
    with pytest.raises(ValueError, match="one entry per sample in every list"):
        compute_mis_weights_with_cp(NS(use_tis=True), pg_loss=pg,
                                    **{**inputs, "rollout_log_probs": inputs["rollout_log_probs"][:-1]})
    with pytest.raises(ValueError, match="pg_loss holds"):
        compute_mis_weights_with_cp(NS(use_tis=True), pg_loss=pg[:-1], **inputs)
    with pytest.raises(ValueError, match="context-parallel rank 0 of 1 holds"):
        shorter = [t[:-1] if t.numel() > 1 else t for t in inputs["train_log_probs"]]
        compute_mis_weights_with_cp(NS(use_tis=True), pg_loss=pg[:sum(t.numel() for t in shorter)],
                                    **{**inputs, "train_log_probs": shorter, "rollout_log_probs": [
                                        t[:-1] if t.numel() > 1 else t for t in inputs["rollout_log_probs"]]})


@pytest.mark.parametrize("fn", [compute_mis_weights_with_cp, compute_tis_weights_with_cp,
                                compute_icepop_weights_with_cp], ids=["mis", "tis", "icepop"])
def test_nan_log_prob_names_sample_and_position(fn):
    samples = make_samples(0)
    samples[3]["rollout"][4] = float("nan")
    samples[3]["mask"][4] = 1
    idx, inputs = rank_inputs(samples, 1, 0)
    with pytest.raises(ValueError, match=r"rollout_log_probs is nan at sample 3, response position 4"):
        fn(NS(use_tis=True), pg_loss=torch.ones(sum(len(i) for i in idx)), **inputs)
    samples[3]["mask"][4] = 0  # off the loss mask: ignored, and no NaN reaches the outputs
    idx, inputs = rank_inputs(samples, 1, 0)
    out, _, metrics = fn(NS(use_tis=True), pg_loss=torch.ones(sum(len(i) for i in idx)), **inputs)
    assert all(bool(torch.isfinite(v).all()) for v in metrics.values())


def test_shared_yaml_ignores_other_plugins_and_refuses_near_misses(tmp_path):
    ok = tmp_path / "shared.yaml"
    ok.write_text("use_tis: true\nuse_kl_loss: true\nkl_coef: 0.01\nmy_plugin_temperature: 0.7\n")
    check_shared_yaml(str(ok))
    _call(dict(use_tis=True, custom_config_path=str(ok)))
    bad = tmp_path / "typo.yaml"
    bad.write_text("use_tis: true\ntis_uper_bound: 3.0\n")
    with pytest.raises(ValueError, match="key 'tis_uper_bound'. Did you mean 'tis_upper_bound'"):
        _call(dict(use_tis=True, custom_config_path=str(bad)))


def test_settings_beyond_slime_use_the_engine_and_say_so():
    with pytest.warns(UserWarning, match="rs_level='seq_mean_k3' goes beyond slime's example"):
        out, masks, metrics = _call(dict(use_tis=True, use_rs=True, rs_level="seq_mean_k3", rs_upper_bound=0.01))
    assert "is_weight" in metrics and not any(k.startswith("mis_") for k in metrics)


# ---- CP = 2 and 4 over megatron-core parallel_state ----------------------------------------------------------
CP_KEYS = {
    "mis.yaml": dict(use_tis=True, use_rs=True, tis_level="token", rs_level="token", tis_mode="truncate",
                     tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4, tis_batch_normalize=True),
    "seq_mask_geo_rs": dict(use_tis=True, tis_level="sequence", tis_mode="mask", tis_upper_bound=4.0, use_rs=True,
                            rs_level="geometric", rs_lower_bound=0.8, rs_upper_bound=1.25, tis_batch_normalize=True),
    "geo_clip_seq_rs_veto": dict(use_tis=True, tis_level="geometric", tis_mode="clip", tis_upper_bound=1.2,
                                 use_rs=True, rs_level="sequence", rs_veto_threshold=1e-4),
    "token_mask_bn": dict(use_tis=True, tis_level="token", tis_mode="mask", tis_lower_bound=0.6,
                          tis_upper_bound=1.7, tis_batch_normalize=True),
    "metrics_only": dict(use_tis=False),
}
CP_SIZES = (4, 2)
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "broadcast")


def _cp_worker(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    samples = make_samples(0)
    g = torch.Generator().manual_seed(1)
    pg_full = [torch.randn(s["R"], generator=g) for s in samples]
    out = {}
    for cp in CP_SIZES:
        ps.initialize_model_parallel(context_parallel_size=cp, distributed_timeout_minutes=1)
        try:
            cp_rank, group = ps.get_context_parallel_rank(), ps.get_context_parallel_group()
            res = {}
            for name, keys in CP_KEYS.items():
                calls = []
                real = {n: getattr(dist, n) for n in COLLECTIVES}

                def spy(n):
                    def f(tensor, *a, **k):
                        t = tensor[0] if isinstance(tensor, list) else tensor
                        calls.append((n, t.numel() * t.element_size()))
                        return real[n](tensor, *a, **k)
                    return f
                for n in COLLECTIVES:
                    setattr(dist, n, spy(n))
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        loss, grads, metrics, masks, idx = _reduce_ours(NS(**keys), samples, pg_full, cp, cp_rank)
                finally:
                    for n in COLLECTIVES:
                        setattr(dist, n, real[n])
                # slime all-reduces the reported values over DP x CP; the CP group is this micro-batch's
                vec = torch.tensor([float(loss)] + [float(v) for v in metrics.values()], dtype=torch.float64)
                dist.all_reduce(vec, group=group)
                grad = torch.cat(grads).double()
                dist.all_reduce(grad, group=group)
                local_masks = [m[i] for m, i in zip(masks, idx)]
                res[name] = dict(loss=float(vec[0]), metrics=dict(zip(metrics, vec[1:].tolist())),
                                 grad=grad, local_masks=local_masks, idx=idx, calls=calls)
            # a NaN on one rank's token: every rank raises, none hangs; the holder names sample and position
            bad = [dict(s) for s in samples]
            bad[4] = dict(bad[4], rollout=bad[4]["rollout"].clone(), mask=bad[4]["mask"].clone())
            bad[4]["rollout"][20] = float("nan")
            bad[4]["mask"][20] = 1
            try:
                _reduce_ours(NS(use_tis=True), bad, pg_full, cp, cp_rank)
                res["nan"] = None
            except ValueError as e:
                res["nan"] = (str(e), 20 in zigzag_positions(bad[4]["P"] + 29, 29, cp, cp_rank).tolist())
            out[cp] = res
        finally:
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def cp_runs():
    return run_distributed(_cp_worker, 4, timeout=180)


@pytest.mark.parametrize("cp", CP_SIZES)
@pytest.mark.parametrize("name", list(CP_KEYS))
def test_cp_equals_single_process_and_slime_semantics(cp_runs, cp, name):
    samples = make_samples(0)
    g = torch.Generator().manual_seed(1)
    pg_full = [torch.randn(s["R"], generator=g) for s in samples]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss1, grads1, metrics1, masks1, _ = _reduce_ours(NS(**CP_KEYS[name]), samples, pg_full)
    want_loss, want_grads, want_metrics, _ = _reduce_reference(CP_KEYS[name], samples,
                                                               [torch.arange(s["R"]) for s in samples], pg_full)
    _close(loss1, want_loss, f"{name} cp=1 loss")
    for rank, run in enumerate(cp_runs):
        r = run[cp][name]
        _close(r["loss"], loss1, f"{name} cp={cp} rank {rank} loss")
        assert torch.allclose(r["grad"], torch.cat(grads1).double(), atol=1e-6, rtol=1e-6), f"{name} cp={cp} grad"
        assert r["metrics"].keys() == metrics1.keys()
        for k, v in r["metrics"].items():
            _close(v, metrics1[k], f"{name} cp={cp} rank {rank} {k}")
            if k in want_metrics:
                _close(v, want_metrics[k], f"{name} cp={cp} {k} vs reference")
        for i, (m, j) in enumerate(zip(r["local_masks"], r["idx"])):
            assert torch.equal(m, masks1[i][j]), f"{name} cp={cp} rank {rank} sample {i}: mask at own positions"


@pytest.mark.parametrize("cp", CP_SIZES)
def test_cp_costs_one_all_gather_of_per_sequence_values(cp_runs, cp):
    """No sequence is gathered: one all-gather of B x k float64 per call (slime's example all-reduces every
    sequence's log-probs twice), after the ranks' 5-word agreement header (int64, on the host)."""
    from slime_rc.correction.agreement import HEADER_WORDS

    n_samples = len(make_samples(0))
    for run in cp_runs:
        for name, r in run[cp].items():
            if name == "nan":
                continue
            assert [c for c, _ in r["calls"]] == ["all_gather", "all_gather"], (name, r["calls"])
            assert r["calls"][0][1] == HEADER_WORDS * 8, (name, r["calls"])
            per_seq_values = r["calls"][1][1] / 8 / n_samples
            assert per_seq_values == int(per_seq_values) and per_seq_values <= 12, (name, r["calls"])


@pytest.mark.parametrize("cp", CP_SIZES)
def test_cp_nan_raises_on_every_rank(cp_runs, cp):
    holders = 0
    for run in cp_runs:
        message, holds = run[cp]["nan"]
        if holds:
            holders += 1
            assert "rollout_log_probs is nan at sample 4, response position 20" in message
        else:
            assert "sample 4 (its non-finite token is held by another context-parallel rank)" in message
    assert holders == len(cp_runs) // cp


def test_docs_list_exactly_slimes_metric_names():
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "slime.md")
    text = open(path).read()
    rows = [line for line in text.splitlines() if line.startswith("| `mis_")]
    documented = set(re.findall(r"`mis_([a-z0-9_]+)`", "\n".join(rows)))
    assert documented == set(SLIME_METRICS), documented ^ set(SLIME_METRICS)


def test_engine_only_settings_are_not_silently_ignored():
    """slime-rc's engine keys (e.g. --rollout-correction-on-nonfinite through the parser hook) have no meaning in
    slime's example: they select the engine, and say so."""
    samples = make_samples(0)
    samples[3]["rollout"][4] = float("nan")
    samples[3]["mask"][4] = 1
    with pytest.warns(UserWarning, match="on_nonfinite='reject' goes beyond slime's example"):
        out, masks, metrics = _call(dict(use_tis=True, rollout_correction_on_nonfinite="reject"), samples)
    assert float(masks[3].sum()) == 0 and "nonfinite" not in str(metrics.keys())
    with pytest.raises(ValueError, match="must be a single value"):
        _call(dict(use_tis=True, tis_upper_bound=[1.0, 2.0]))
