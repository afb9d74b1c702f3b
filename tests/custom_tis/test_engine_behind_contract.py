"""Single-process tests of the slime-compatible adapters in ``custom_tis`` (mis / tis / icepop).

slime's semantics on slime's keys are checked against a reference over the whole settings grid in
tests/custom_tis/test_slime_contract.py; here: slime-rc's engine through the same contract (a config resolved at launch,
``args.rollout_correction_config``), the list format, hand formulas and slime's built-ins' simple cases."""

import math
from types import SimpleNamespace as NS

import pytest
import torch

import custom_tis
from custom_tis.icepop import compute_icepop_weights, compute_icepop_weights_with_cp
from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp
from custom_tis.tis import compute_tis_weights, compute_tis_weights_with_cp
from slime_rc import LocalReducer, RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths

REQUIRED_METRICS = ("training_log_ppl", "training_ppl", "rollout_log_ppl", "rollout_ppl", "kl", "k3_kl",
                    "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio", "chi2_token", "chi2_seq")


def make_batch(seed=0, lengths=(7, 4, 9, 5), noise=0.3):
    g = torch.Generator().manual_seed(seed)
    train = [-torch.rand(n, generator=g) * 2 - 0.05 for n in lengths]
    rollout = [t + noise * torch.randn(t.shape, generator=g) for t in train]
    masks = []
    for n in lengths:
        m = (torch.rand(n, generator=g) > 0.25).float()
        m[0] = 1.0  # every sample has a loss token
        masks.append(m)
    return train, rollout, masks


def engine(config, train, rollout, masks):
    cu = cu_seqlens_from_lengths([t.numel() for t in train])
    return compute_rollout_correction(torch.cat(train), torch.cat(rollout), torch.cat(masks), cu, config)


def masked_mean(x, m):
    m = m.double()
    return float((x.double() * m).sum() / m.sum().clamp(min=1))


def launched(settings: dict) -> NS:
    """args as slime-rc's own launch leaves them: the config resolved once (engine semantics)."""
    return NS(rollout_correction_config=RolloutCorrectionConfig.from_dict(settings))


def call(fn, args, batch):
    train, rollout, masks = batch
    return fn(args, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)


MIS_CASES = [
    dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=1.5),
    dict(use_tis=True, tis_level="token", tis_mode="clip", tis_lower_bound=0.7, tis_upper_bound=1.4),
    dict(use_tis=True, tis_level="token", tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=1.6),
    dict(use_tis=True, tis_level="sequence", tis_mode="truncate", tis_upper_bound=3.0),
    dict(use_tis=True, tis_level="geometric", tis_mode="mask", tis_lower_bound=0.9, tis_upper_bound=1.1),
    dict(use_tis=True, tis_level="geometric", tis_mode="clip", tis_upper_bound=1.2, tis_batch_normalize=True),
    dict(use_tis=True, tis_level="token", use_rs=True, rs_level="token,seq_mean_k3", rs_upper_bound="0.5_2.0,0.05",
         rs_veto_threshold=0.3),
    dict(use_tis=False, use_rs=True, rs_level="geometric", rs_upper_bound=1.1),
]


# ---- equality with the engine's packed result --------------------------------------------------------------------
@pytest.mark.parametrize("case", MIS_CASES, ids=lambda c: f"{c.get('tis_level')}-{c.get('tis_mode')}-{c.get('rs_level')}")
def test_mis_equals_engine_packed_result(case):
    batch = make_batch(1)
    weights, masks, metrics = call(compute_mis_weights, launched(case), batch)
    result = engine(RolloutCorrectionConfig.from_dict(case), *batch)
    lengths = [t.numel() for t in batch[0]]
    if result.is_weights is None:
        assert weights is None
    else:
        assert torch.equal(torch.cat(weights), result.is_weights)
    assert torch.equal(torch.cat(masks), result.keep_mask)
    # per-sample statistics equal the engine's result.sequences-derived values
    seq = result.sequences
    orig = batch[2]
    for i in range(len(lengths)):
        mt, mr = float(seq["train_log_prob_mean"][i]), float(seq["rollout_log_prob_mean"][i])
        expected = {
            "training_log_ppl": -mt, "training_ppl": math.exp(-mt), "rollout_log_ppl": -mr,
            "rollout_ppl": math.exp(-mr), "log_ppl_diff": mr - mt, "log_ppl_abs_diff": abs(mr - mt),
            "ppl_ratio": math.exp(mr - mt), "chi2_seq": math.exp(2 * float(seq["log_ratio_sum"][i])) - 1,
            "rejected_seq_fraction": 1.0 - float(seq["kept"][i]),
        }
        if "is_weight" in seq:
            expected["is_seq_weight"] = float(seq["is_weight"][i])
        for name, value in expected.items():
            assert masked_mean(metrics[name][i], orig[i]) == pytest.approx(value, rel=1e-5, abs=1e-6), (name, i)


def test_metrics_aggregate_to_engine_batch_metrics():
    """slime's aggregation of the per-token metrics reproduces the engine's batch metrics."""
    batch = make_batch(2, lengths=(6, 11, 3, 8, 5))
    args = dict(use_tis=True, tis_level="token", tis_mode="mask", tis_lower_bound=0.7, tis_upper_bound=1.3)
    _, _, metrics = call(compute_mis_weights, launched(args), batch)
    result = engine(RolloutCorrectionConfig.from_dict(args), *batch)
    masks = batch[2]
    mask = torch.cat(masks).double()
    for name in ("kl", "k3_kl", "rejected_token_fraction", "is_ratio_fraction_high", "is_ratio_fraction_low"):
        token_mean = float((torch.cat(metrics[name]).double() * mask).sum() / mask.sum())  # per-token loss mode
        engine_name = {"is_ratio_fraction_high": "rollout_is_ratio_fraction_high",
                       "is_ratio_fraction_low": "rollout_is_ratio_fraction_low"}.get(name, name)
        assert token_mean == pytest.approx(float(result.metrics[engine_name]), rel=1e-5, abs=1e-7), name
    token_chi2 = float((torch.cat(metrics["chi2_token"]).double() * mask).sum() / mask.sum())
    assert token_chi2 == pytest.approx(float(result.metrics["chi2_token"]), rel=1e-5, abs=1e-6)
    for name in ("training_ppl", "rollout_log_ppl", "log_ppl_diff", "ppl_ratio", "chi2_seq", "rejected_seq_fraction"):
        sample_mean = sum(masked_mean(v, m) for v, m in zip(metrics[name], masks)) / len(masks)
        assert sample_mean == pytest.approx(float(result.metrics[name]), rel=1e-5, abs=1e-6), name


# ---- slime format ------------------------------------------------------------------------------------------------
def test_slime_format_lists_in_lists_out():
    batch = make_batch(3, lengths=(2, 5, 1))
    weights, masks, metrics = call(compute_mis_weights, launched(dict(use_tis=True, tis_level="geometric")), batch)
    assert isinstance(weights, list) and isinstance(masks, list) and isinstance(metrics, dict)
    assert [w.shape for w in weights] == [m.shape for m in masks] == [t.shape for t in batch[0]]
    assert set(REQUIRED_METRICS) <= set(metrics)
    for name, values in metrics.items():
        assert isinstance(values, list) and [v.shape for v in values] == [t.shape for t in batch[0]], name
        assert all(v.dtype == torch.float32 and not v.requires_grad and torch.isfinite(v).all() for v in values)
    assert all(not w.requires_grad for w in weights)


def test_metric_per_sample_means_equal_hand_formulas():
    batch = make_batch(4, noise=0.5)
    _, _, metrics = call(compute_mis_weights, NS(use_tis=True), batch)
    for i, (t, r, m) in enumerate(zip(*batch)):
        t, r, keep = t.double(), r.double(), m.bool()
        tk, rk = t[keep], r[keep]
        lr = tk - rk
        ratio = lr.exp()
        d = rk.mean() - tk.mean()
        hand = {
            "training_log_ppl": -tk.mean(), "training_ppl": (-tk.mean()).exp(),
            "rollout_log_ppl": -rk.mean(), "rollout_ppl": (-rk.mean()).exp(),
            "kl": (rk - tk).mean(), "k3_kl": (ratio - 1 - lr).mean(),
            "log_ppl_diff": d, "log_ppl_abs_diff": d.abs(), "ppl_ratio": d.exp(),
            "chi2_token": (ratio ** 2).mean() - 1, "chi2_seq": (2 * lr.sum()).exp() - 1,
        }
        for name, value in hand.items():
            assert masked_mean(metrics[name][i], m) == pytest.approx(float(value), rel=1e-5, abs=1e-6), (name, i)


def test_geometric_truncate_weights_hand_formula():
    batch = make_batch(5, noise=0.2)
    weights, masks, _ = call(compute_mis_weights, NS(use_tis=True, tis_level="geometric", tis_upper_bound=1.05),
                             batch)
    for w, m, t, r, mm in zip(weights, masks, *batch):
        k = mm.bool()
        expected = min(math.exp(float((t.double() - r.double())[k].mean())), 1.05)
        assert torch.allclose(w, torch.full_like(w, expected) * mm, atol=1e-6)
        assert torch.equal(m, mm)


# ---- args handling -----------------------------------------------------------------------------------------------
def test_mis_aliases_equal_tis_spelling():
    batch = make_batch(6, noise=0.8)
    slime = NS(use_tis=True, mis_level="token", mis_mode="mask", mis_lower_bound=0.5, mis_upper_bound=2.5,
               mis_veto_threshold=0.2)
    ours = NS(use_tis=True, tis_level="token", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.5,
              rs_veto_threshold=0.2)
    a, b = call(compute_mis_weights, slime, batch), call(compute_mis_weights, ours, batch)
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert a[2].keys() == b[2].keys() and "rs_catastrophic_token_fraction" in a[2]
    # and the aliases really took effect: mask mode removed some tokens
    assert sum(float(m.sum()) for m in a[1]) < sum(float(m.sum()) for m in batch[2])


def test_missing_none_and_unrelated_attributes():
    batch = make_batch(7, noise=0.6)
    args = NS(use_tis=True, tis_mode=None, tis_upper_bound=None, mis_level=None, tis_clip=9.0, tis_clip_low=0.1,
              eps_clip=0.2, custom_tis_function_path="custom_tis.mis.compute_mis_weights_with_cp")
    weights, masks, _ = call(compute_mis_weights, args, batch)
    default = engine(RolloutCorrectionConfig(is_level="token"), *batch)  # token / truncate / 2.0
    assert torch.equal(torch.cat(weights), default.is_weights)
    assert float(torch.cat(weights).max()) == pytest.approx(2.0)  # tis_clip=9 is not an IS bound for mis
    assert torch.equal(torch.cat(masks), torch.cat(batch[2]))


def test_use_tis_false_gives_none_weights():
    batch = make_batch(8)
    weights, masks, metrics = call(compute_mis_weights, NS(use_tis=False, mis_level="sequence"), batch)
    assert weights is None
    assert all(torch.equal(m, mm) for m, mm in zip(masks, batch[2]))
    assert set(REQUIRED_METRICS) <= set(metrics) and "is_weight" not in metrics


def test_rs_only_rejects_without_weights():
    batch = make_batch(9, noise=0.6)
    weights, masks, metrics = call(compute_mis_weights,
                                   launched(dict(use_tis=False, use_rs=True, rs_level="token", rs_upper_bound=1.5)),
                                   batch)
    assert weights is None
    for m, t, r, mm in zip(masks, *batch):
        ratio = (t - r).exp()
        # slime's rule: the unset RS lower bound is the IS lower bound, 1 / tis_upper_bound (2.0 unset)
        assert torch.equal(m, (mm.bool() & (ratio >= 0.5) & (ratio <= 1.5)).float())
    assert any(float(v.sum()) > 0 for v in metrics["rejected_token_fraction"])


def test_veto_zeroes_a_samples_mask():
    train, rollout, masks = make_batch(10, noise=0.05)
    rollout[1] = rollout[1].clone()
    rollout[1][0] = train[1][0] + 8.0  # ratio e^-8 on a loss token: catastrophic
    weights, new_masks, metrics = compute_mis_weights(
        launched(dict(use_tis=True, tis_level="token", rs_veto_threshold=1e-3)),
        train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert float(new_masks[1].sum()) == 0 and float(weights[1].abs().sum()) == 0
    for i in (0, 2, 3):
        assert torch.equal(new_masks[i], masks[i])
    assert masked_mean(metrics["rejected_seq_fraction"][1], masks[1]) == 1.0
    assert masked_mean(metrics["rejected_seq_fraction"][0], masks[0]) == 0.0
    assert metrics["catastrophic_token_fraction"][1].tolist()[0] == 1.0
    assert float(metrics["catastrophic_token_fraction"][1].sum()) == 1.0


def test_sequence_level_ratio_indicators_broadcast():
    batch = make_batch(11, noise=0.4)
    _, _, metrics = call(compute_mis_weights, launched(dict(use_tis=True, tis_level="sequence", tis_upper_bound=1.5)),
                         batch)
    for i, (t, r, m) in enumerate(zip(*batch)):
        s = float((t.double() - r.double())[m.bool()].sum())
        assert metrics["is_ratio_fraction_high"][i].tolist() == [float(s > math.log(1.5))] * t.numel()
        assert metrics["is_ratio_fraction_low"][i].tolist() == [float(s < -math.log(1.5))] * t.numel()


def test_shape_mismatch_raises():
    train, rollout, masks = make_batch(12)
    with pytest.raises(ValueError, match="sample 1"):
        compute_mis_weights(NS(use_tis=True), train_log_probs=train, rollout_log_probs=rollout,
                            loss_masks=[masks[0], masks[1][:-1]] + masks[2:])
    with pytest.raises(ValueError, match="one entry per sample in every list"):
        compute_mis_weights(NS(use_tis=True), train_log_probs=train, rollout_log_probs=rollout[:-1],
                            loss_masks=masks)


# ---- vanilla TIS ---------------------------------------------------------------------------------------------------
def test_tis_truncate_has_no_lower_bound():
    batch = make_batch(13, noise=1.0)
    weights, masks, _ = call(compute_tis_weights, NS(tis_clip=1.5, tis_clip_low=0), batch)
    for w, m, t, r, mm in zip(weights, masks, *batch):
        assert torch.allclose(w * mm, (t - r).exp().clamp(max=1.5) * mm, rtol=1e-6)
        assert torch.equal(m, mm)  # no rejection
    assert min(float(w[mm.bool()].min()) for w, mm in zip(weights, batch[2])) < 1 / 1.5


def test_tis_clip_mode_with_lower_bound():
    batch = make_batch(14, noise=1.0)
    weights, masks, _ = call(compute_tis_weights, NS(tis_clip=1.2, tis_clip_low=0.8), batch)
    flat = torch.cat(weights)[torch.cat(batch[2]).bool()]
    assert float(flat.min()) == pytest.approx(0.8) and float(flat.max()) == pytest.approx(1.2)
    for w, m, t, r, mm in zip(weights, masks, *batch):
        assert torch.allclose(w * mm, (t - r).exp().clamp(0.8, 1.2) * mm, rtol=1e-6)
        assert torch.equal(m, mm)


def test_tis_defaults_and_extreme_ratios_not_rejected():
    train, rollout, masks = make_batch(15, noise=0.1)
    rollout[0] = rollout[0].clone()
    rollout[0][0] = train[0][0] - 30.0  # huge ratio: truncated, never rejected
    weights, new_masks, _ = compute_tis_weights(NS(), train_log_probs=train, rollout_log_probs=rollout,
                                                loss_masks=masks)
    assert float(weights[0][0]) == pytest.approx(2.0)
    assert all(torch.equal(a, b) for a, b in zip(new_masks, masks))


# ---- IcePop --------------------------------------------------------------------------------------------------------
def test_icepop_zeroes_out_of_band_tokens_and_keeps_masks():
    """slime's icepop_function: weight 0 outside [tis_clip_low, tis_clip]; the masks come back unchanged, so the
    token stays in slime's denominators with a zero numerator."""
    batch = make_batch(16, noise=0.6)
    weights, masks, metrics = call(compute_icepop_weights, NS(tis_clip_low=0.8, tis_clip=1.25), batch)
    n_out = 0
    for w, m, t, r, mm in zip(weights, masks, *batch):
        ratio = (t - r).exp()
        inside = (ratio >= 0.8) & (ratio <= 1.25)
        assert torch.equal(m, mm)
        assert torch.allclose(w, torch.where(inside, ratio, 0.0), rtol=1e-6)
        n_out += int((mm.bool() & ~inside).sum())
    assert n_out > 0
    assert sum(float((v * mm).sum()) for v, mm in zip(metrics["tis_clipfrac"], batch[2])) == n_out


def test_icepop_after_config_from_args_still_zeroes_outside_the_band():
    """One meaning: a config resolved at launch (slime_rc.config_from_args, as docs prescribe) gives IcePop's band,
    not TIS's clamp -- the same weights as slime's icepop_function on the plain flags."""
    import argparse

    import slime_rc

    parser = slime_rc.add_rollout_correction_arguments(argparse.ArgumentParser(), slime=False)
    args = parser.parse_args(["--use-tis", "--tis-clip", "2.0", "--tis-clip-low", "0.5"])
    slime_rc.config_from_args(args)
    ratios = torch.tensor([0.3, 0.45, 0.8, 1.0, 1.5, 2.5, 4.0])
    lists = dict(train_log_probs=[ratios.log()], rollout_log_probs=[torch.zeros(7)],
                 loss_masks=[torch.ones(7, dtype=torch.int)])
    launched_w = compute_icepop_weights(args, **lists)[0][0]
    plain_w = compute_icepop_weights(NS(tis_clip=2.0, tis_clip_low=0.5), **lists)[0][0]
    expected = torch.where((ratios >= 0.5) & (ratios <= 2.0), ratios, torch.zeros(()))
    torch.testing.assert_close(launched_w, expected)
    torch.testing.assert_close(plain_w, expected)


def test_icepop_default_band_is_slimes_flag_defaults():
    """--tis-clip 2.0 and --tis-clip-low 0: only ratios above 2 are zeroed."""
    train, rollout, masks = make_batch(17, noise=0.01)
    rollout[0] = rollout[0].clone()
    rollout[0][:3] = train[0][:3] - torch.tensor([math.log(1.9), math.log(2.1), math.log(0.01)])
    weights, new_masks, _ = compute_icepop_weights(NS(tis_clip=None), train_log_probs=train,
                                                   rollout_log_probs=rollout, loss_masks=masks)
    assert float(weights[0][0]) == pytest.approx(1.9, rel=1e-5) and float(weights[0][1]) == 0.0
    assert float(weights[0][2]) == pytest.approx(0.01, rel=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(new_masks, masks))


# ---- *_with_cp ---------------------------------------------------------------------------------------------------
WITH_CP = [
    (compute_mis_weights, compute_mis_weights_with_cp, NS(use_tis=True, tis_level="geometric", tis_mode="mask",
                                                         tis_lower_bound=0.9, tis_upper_bound=1.1)),
    (compute_tis_weights, compute_tis_weights_with_cp, NS(tis_clip=1.3, tis_clip_low=0.7)),
    (compute_icepop_weights, compute_icepop_weights_with_cp, NS(tis_clip_low=0.7, tis_clip=1.4)),
]


@pytest.mark.parametrize("plain,with_cp,args", WITH_CP, ids=["mis", "tis", "icepop"])
def test_with_cp_size_one_equals_non_cp(plain, with_cp, args):
    train, rollout, masks = make_batch(18, noise=0.4)
    lengths = [t.numel() for t in train]
    pg_loss = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(0))
    weights, new_masks, metrics = plain(args, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    out, cp_masks, cp_metrics = with_cp(args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                                        loss_masks=masks, total_lengths=[n + 5 for n in lengths],
                                        response_lengths=lengths, unrelated_kwarg=1)
    assert torch.equal(out, pg_loss * torch.cat(weights))
    assert all(torch.equal(a, b) for a, b in zip(cp_masks, new_masks))
    cp_metrics = {k.removeprefix("mis_"): v for k, v in cp_metrics.items()}  # slime's example prefixes in CP only
    assert cp_metrics.keys() == metrics.keys()
    for name in metrics:
        assert cp_metrics[name].dim() == 1 and torch.equal(cp_metrics[name], torch.cat(metrics[name])), name


def test_with_cp_is_off_returns_pg_loss_unchanged():
    train, rollout, masks = make_batch(19)
    lengths = [t.numel() for t in train]
    pg_loss = torch.randn(sum(lengths))
    out, cp_masks, metrics = compute_mis_weights_with_cp(
        NS(use_tis=False), pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
        total_lengths=[n + 3 for n in lengths], response_lengths=lengths)
    assert torch.equal(out, pg_loss)
    assert all(torch.equal(a, b) for a, b in zip(cp_masks, masks))
    assert metrics["mis_kl"].shape == pg_loss.shape


def test_with_cp_weights_are_detached_and_gradient_flows():
    train, rollout, masks = make_batch(20, noise=0.3)
    lengths = [t.numel() for t in train]
    pg_loss = torch.randn(sum(lengths), requires_grad=True)
    out, _, _ = compute_tis_weights_with_cp(NS(), pg_loss=pg_loss, train_log_probs=train,
                                            rollout_log_probs=rollout, loss_masks=masks,
                                            total_lengths=lengths, response_lengths=lengths)
    out.sum().backward()
    weights, _, _ = compute_tis_weights(NS(), train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert torch.equal(pg_loss.grad, torch.cat(weights))


def test_with_cp_rejects_wrong_lengths():
    train, rollout, masks = make_batch(23)
    lengths = [t.numel() for t in train]
    with pytest.raises(ValueError, match="pg_loss"):
        compute_mis_weights_with_cp(NS(use_tis=True), pg_loss=torch.ones(sum(lengths) + 1), train_log_probs=train,
                                    rollout_log_probs=rollout, loss_masks=masks, total_lengths=lengths,
                                    response_lengths=lengths)
    with pytest.raises(ValueError, match="full response mask"):
        compute_mis_weights_with_cp(NS(use_tis=True), pg_loss=torch.ones(sum(lengths)), train_log_probs=train,
                                    rollout_log_probs=rollout, loss_masks=[m[:-1] for m in masks],
                                    total_lengths=lengths, response_lengths=lengths)


def test_package_exports():
    assert set(custom_tis.__all__) == {
        "compute_mis_weights", "compute_mis_weights_with_cp", "compute_tis_weights", "compute_tis_weights_with_cp",
        "compute_icepop_weights", "compute_icepop_weights_with_cp", "compute_metrics_only",
        "compute_metrics_only_with_cp"}
    assert custom_tis.compute_icepop_weights is compute_icepop_weights
