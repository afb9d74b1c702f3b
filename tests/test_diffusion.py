"""Diffusion (FlowGRPO) rollout correction: (B, W) SDE-window log-probs on the packed engine (slime_rc.diffusion).

Cases from the spec's diffusion document (rollout_corr_diffusion.md): the short-window behaviour of seq_mean_k1,
per-step equivalence of RS options in bypass mode, sequence IS as the product of the window's ratios, bypass +
ppo_clip (IS diagnostics only, RS in the gradient), detached weights and exact zeros for rejected samples, hand
computations of weights, metrics and losses, and data-parallel exactness under a real gloo spawn.
"""

import math
import os

import pytest
import torch

from slime_rc import METRICS, RolloutCorrectionConfig, parse_rejection_criteria
from slime_rc.diffusion import (
    DECOUPLED_PREFIX,
    STEP_PREFIX,
    compute_diffusion_rollout_correction,
    compute_diffusion_step_correction,
    compute_diffusion_step_loss,
)
from slime_rc.config.resolution import resolve
from slime_rc.config.yaml_config import load_yaml_layer

from tests.checks import raises_mentioning
from tests.dist_utils import run_distributed

C = RolloutCorrectionConfig
RS = parse_rejection_criteria
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "diffusion_rollout_correction.yaml")


def _batch(log_ratios, seed=0):
    """(old, rollout) of shape (B, W) with old - rollout = log_ratios exactly representable in float32."""
    lr = torch.as_tensor(log_ratios, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    rollout = -(torch.rand(lr.shape, generator=g) * 2 + 0.5)
    return rollout + lr, rollout


def _random_window(b, w=2, sigma=0.6, seed=1):
    g = torch.Generator().manual_seed(seed)
    rollout = -(torch.rand(b, w, generator=g) * 2 + 0.5)
    old = rollout + sigma * torch.randn(b, w, generator=g)
    return old, rollout


def _hand_lr(old, rollout):
    return old.double() - rollout.double()


# ---------------------------------------------------------------------------------------------------------------
# decoupled mode: the seq_mean_k1 band on a 2-step window
# ---------------------------------------------------------------------------------------------------------------
# sample 0: one outlier step (log r = 1.6, ratio ~4.95) and one clean step: window mean 0.8 > log 2 = 0.69
OUTLIER = [[1.6, 0.0], [0.05, -0.02], [-0.1, 0.2], [0.0, 0.01]]


def test_seq_mean_k1_one_outlier_step_rejects_the_whole_sample_in_decoupled_mode():
    old, rollout = _batch(OUTLIER)
    out = compute_diffusion_rollout_correction(old, rollout, C(rs=RS("seq_mean_k1", "0.5_2.0")))
    assert out.rollout_is_weights.shape == (4, 2)
    assert torch.equal(out.rollout_is_weights[0], torch.zeros(2))  # both steps, not only the outlier
    assert torch.equal(out.rollout_is_weights[1:], torch.ones(3, 2))  # IS off: the weight is the keep mask
    assert out.is_weights is None
    assert out.metrics["rollout_corr/rejected_seq_fraction"].item() == pytest.approx(0.25)
    assert out.metrics["rollout_corr/rollout_rs_seq_mean_k1_seq_masked_fraction"].item() == pytest.approx(0.25)
    assert out.metrics["rollout_corr/rejected_token_fraction"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("band", ["0.3_3.0", "0.2_5.0"])
def test_widened_band_keeps_the_outlier_sample(band):
    old, rollout = _batch(OUTLIER)
    out = compute_diffusion_rollout_correction(old, rollout, C(rs=RS("seq_mean_k1", band)))
    assert torch.equal(out.rollout_is_weights, torch.ones(4, 2))
    assert out.metrics["rollout_corr/rejected_seq_fraction"].item() == 0.0


def test_token_option_rejects_only_the_outlier_step_in_decoupled_mode():
    # the contrast that makes the window matter: token_k1 tests steps one by one
    old, rollout = _batch(OUTLIER)
    out = compute_diffusion_rollout_correction(old, rollout, C(rs=RS("token_k1", "0.5_2.0")))
    assert out.keep_mask.tolist() == [[0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]


# ---------------------------------------------------------------------------------------------------------------
# rollout_is=sequence: the product of the W per-step ratios, then bounded
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("is_mode", ["truncate", "clip"])
def test_sequence_is_is_the_bounded_product_of_the_step_ratios(is_mode):
    # products: e^0.9 (> 2, bounded), e^-1.0 (< 1/2: kept by truncate, raised to 1/2 by clip), e^0.3, e^0
    lrs = [[0.5, 0.4], [-0.7, -0.3], [0.1, 0.2], [0.25, -0.25]]
    old, rollout = _batch(lrs)
    out = compute_diffusion_rollout_correction(old, rollout, C(is_level="sequence", is_mode=is_mode))
    lr = _hand_lr(old, rollout)
    product = torch.exp(lr[:, 0]) * torch.exp(lr[:, 1])
    bounded = product.clamp(max=2.0) if is_mode == "truncate" else product.clamp(0.5, 2.0)
    expected = bounded[:, None].expand(4, 2)
    torch.testing.assert_close(out.rollout_is_weights.double(), expected, rtol=1e-6, atol=0)
    assert out.rollout_is_weights[0, 0].item() == 2.0
    assert (out.rollout_is_weights[1, 0].item() == 0.5) == (is_mode == "clip")
    # the IS weight itself equals the combined weight when nothing is rejected
    assert torch.equal(out.is_weights, out.rollout_is_weights)


# ---------------------------------------------------------------------------------------------------------------
# decoupled mode: weights and metrics by hand
# ---------------------------------------------------------------------------------------------------------------
def test_decoupled_weights_and_metrics_equal_a_hand_computation():
    old, rollout = _random_window(24, w=2, sigma=0.3, seed=3)
    old[5] = rollout[5] + torch.tensor([1.2, 0.6])  # window mean 0.9: rejected by the band below
    cfg = C(is_level="token", is_upper_bound=1.5, is_batch_normalize=True, rs=RS("seq_mean_k1", "0.5_2.0"))
    out = compute_diffusion_rollout_correction(old, rollout, cfg)

    lr = _hand_lr(old, rollout)
    r = torch.exp(lr)
    keep_row = (lr.mean(1) >= math.log(0.5)) & (lr.mean(1) <= math.log(2.0))
    keep = keep_row[:, None].expand_as(lr)
    assert 0 < int((~keep_row).sum()) < 24 and not bool(keep_row[5])
    w = r.clamp(max=1.5)
    w_kept = w[keep]
    norm = w_kept.mean()
    expected = torch.where(keep, w / norm, 0.0)
    torch.testing.assert_close(out.rollout_is_weights.double(), expected, rtol=2e-6, atol=0)
    assert torch.equal(out.keep_mask, keep.float())

    m = {k: v.item() for k, v in out.metrics.items()}
    rejected = (~keep_row).double().mean().item()
    hand = {
        "kl": (-lr).mean(),
        "k3_kl": (r - 1 - lr).mean(),
        "chi2_token": (r * r).mean() - 1,
        "chi2_seq": torch.exp(2 * lr.sum(1)).mean() - 1,
        "log_ppl_diff": (-lr.mean(1)).mean(),
        "log_ppl_abs_diff": lr.mean(1).abs().mean(),
        "train_rollout_logprob_abs_diff": lr.abs().mean(),
        "rejected_seq_fraction": rejected,
        "rejected_token_fraction": rejected,
        "rollout_rs_seq_masked_fraction": rejected,
        "rollout_rs_seq_mean_k1_seq_masked_fraction": rejected,
        "rollout_is_mean": w_kept.mean(),
        "rollout_is_std": w_kept.std(unbiased=False),
        "rollout_is_eff_sample_size": w_kept.mean() ** 2 / (w_kept * w_kept).mean(),
        "rollout_is_batch_norm_factor": norm,
        "rollout_is_max": r.max(),
        "rollout_is_min": r.min(),
        "rollout_is_ratio_fraction_high": (r > 1.5).double().mean(),
        "rollout_is_ratio_fraction_low": (r < 1 / 1.5).double().mean(),
    }
    for name, value in hand.items():
        assert m["rollout_corr/" + name] == pytest.approx(float(value), rel=2e-6, abs=1e-7), name


# ---------------------------------------------------------------------------------------------------------------
# bypass mode: per SDE step, every RS option is the same test
# ---------------------------------------------------------------------------------------------------------------
def test_bypass_rs_options_give_identical_keep_masks_per_step():
    current, rollout = _random_window(64, w=2, sigma=0.8, seed=5)
    for j in range(2):
        lr = _hand_lr(current[:, j], rollout[:, j])
        hand = ((lr >= math.log(0.5)) & (lr <= math.log(2.0))).float()
        assert 0 < int(hand.sum()) < 64  # the band really rejects some samples and keeps others
        for options, threshold, expected in (
                (("token_k1", "seq_mean_k1", "seq_sum_k1", "token", "geometric", "sequence"), "0.5_2.0", hand),
                (("token_k3", "seq_mean_k3", "seq_sum_k3", "seq_max_k3"), 0.1, None)):
            masks = [compute_diffusion_step_correction(current[:, j], rollout[:, j],
                                                       C(mode="bypass", rs=RS(o, threshold))).keep_mask
                     for o in options]
            if expected is None:  # k3 by hand: r - 1 - log r <= 0.1
                expected = ((torch.exp(lr) - 1 - lr) <= 0.1).float()
            for o, mask in zip(options, masks):
                assert mask.shape == (64,)
                assert torch.equal(mask, expected), (j, o)
    # in decoupled mode, on the same window, the token and window-mean options do differ
    tok = compute_diffusion_rollout_correction(current, rollout, C(rs=RS("token_k1", "0.5_2.0"))).keep_mask
    mean = compute_diffusion_rollout_correction(current, rollout, C(rs=RS("seq_mean_k1", "0.5_2.0"))).keep_mask
    assert not torch.equal(tok, mean)


def test_bypass_sequence_is_per_step_is_the_step_ratio():
    current, rollout = _random_window(16, w=1, sigma=0.5, seed=6)
    out = compute_diffusion_step_correction(current[:, 0], rollout[:, 0],
                                            C(mode="bypass", loss_type="reinforce", is_level="sequence"))
    expected = torch.exp(_hand_lr(current[:, 0], rollout[:, 0])).clamp(max=2.0)
    torch.testing.assert_close(out.rollout_is_weights.double(), expected, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# bypass + ppo_clip: IS weights are diagnostics; RS reaches the gradient
# ---------------------------------------------------------------------------------------------------------------
def _step_loss(cfg, current, rollout, adv, **kw):
    lp = current.clone().requires_grad_(True)
    loss, metrics = compute_diffusion_step_loss(lp, None, rollout, adv, cfg, **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def test_bypass_ppo_clip_is_weights_do_not_change_the_loss_but_rs_does():
    g = torch.Generator().manual_seed(7)
    rollout = -(torch.rand(12, generator=g) + 0.5)
    current = rollout + 0.15 * torch.randn(12, generator=g)
    current[[2, 9]] = rollout[[2, 9]] + torch.tensor([1.5, -1.2])  # far out of the RS band
    adv = torch.randn(12, generator=g)
    adv[2], adv[9] = -1.0, 1.0  # signs for which PPO's unclipped branch is active: a gradient RS can remove

    plain_loss, plain_grad, _ = _step_loss(C(mode="bypass"), current, rollout, adv)
    is_cfg = C(mode="bypass", is_level="sequence")
    assert not is_cfg.is_weights_applied
    is_loss, is_grad, is_metrics = _step_loss(is_cfg, current, rollout, adv)
    assert torch.equal(is_loss, plain_loss) and torch.equal(is_grad, plain_grad)
    # ...although the diagnostic weights are far from 1 and are reported
    step = compute_diffusion_step_correction(current, rollout, is_cfg)
    assert step.is_weights[2].item() == 2.0 and torch.equal(step.rollout_is_weights, torch.ones(12))
    assert is_metrics[STEP_PREFIX + "rollout_is_max"].item() > 2.0

    rs_loss, rs_grad, _ = _step_loss(C(mode="bypass", is_level="sequence", rs=RS("seq_mean_k1", "0.5_2.0")),
                                     current, rollout, adv)
    assert not torch.equal(rs_loss, plain_loss)
    assert rs_grad[2].item() == 0.0 and rs_grad[9].item() == 0.0
    assert plain_grad[2].item() != 0.0 and plain_grad[9].item() != 0.0
    kept = [i for i in range(12) if i not in (2, 9)]
    # the kept samples' gradients only change by the denominator (12 -> 10 samples)
    torch.testing.assert_close(rs_grad[kept], plain_grad[kept] * 12 / 10, rtol=1e-6, atol=1e-9)

    # with REINFORCE the same IS weights do enter the loss (so they are not trivially 1 above)
    pg_plain, _, _ = _step_loss(C(mode="bypass", loss_type="reinforce"), current, rollout, adv)
    pg_is, _, _ = _step_loss(C(mode="bypass", loss_type="reinforce", is_level="sequence"), current, rollout, adv)
    assert not torch.allclose(pg_plain, pg_is)


def test_step_loss_denominator_follows_rejected_in_denominator():
    g = torch.Generator().manual_seed(8)
    rollout = -(torch.rand(8, generator=g) + 0.5)
    current = rollout + 0.1 * torch.randn(8, generator=g)
    current[[1, 6]] = rollout[[1, 6]] + 2.0
    adv = torch.randn(8, generator=g)
    rs = RS("token_k1", 2.0)
    loss, grad, m = _step_loss(C(mode="bypass", rs=rs), current, rollout, adv)
    dilute, dgrad, _ = _step_loss(C(mode="bypass", rs=rs, rejected_in_denominator=True), current, rollout, adv)

    rho = torch.exp(current.double() - rollout.double())
    per = torch.maximum(-adv.double() * rho, -adv.double() * rho.clamp(0.8, 1.2))
    keep = torch.ones(8, dtype=torch.bool)
    keep[[1, 6]] = False
    assert loss.item() == pytest.approx(per[keep].sum().item() / 6, rel=1e-6)  # kept samples only
    assert dilute.item() == pytest.approx(per[keep].sum().item() / 8, rel=1e-6)  # verl's mean(): kept / total
    torch.testing.assert_close(dgrad, grad * 6 / 8, rtol=1e-6, atol=1e-9)
    assert m["pg_loss"].item() == pytest.approx(loss.item())
    assert m[STEP_PREFIX + "rejected_seq_fraction"].item() == pytest.approx(2 / 8)


def test_decoupled_step_loss_equals_hand_computation():
    old, rollout = _random_window(10, w=2, sigma=0.4, seed=9)
    old[3] = rollout[3] + 1.5  # rejected by the window band
    cfg = C(is_level="sequence", rs=RS("seq_mean_k1", "0.5_2.0"), eps_clip=0.2, eps_clip_high=0.28)
    dec = compute_diffusion_rollout_correction(old, rollout, cfg)
    g = torch.Generator().manual_seed(10)
    adv = torch.randn(10, generator=g)
    for j in range(2):
        current = old[:, j] + 0.1 * torch.randn(10, generator=g)
        lp = current.clone().requires_grad_(True)
        loss, m = compute_diffusion_step_loss(lp, old[:, j], rollout[:, j], adv, cfg,
                                              rollout_is_weights=dec.rollout_is_weights[:, j])
        loss.backward()
        w = dec.rollout_is_weights[:, j].double()
        keep = w > 0
        rho = torch.exp(current.double() - old[:, j].double())
        per = w * torch.maximum(-adv.double() * rho, -adv.double() * rho.clamp(0.8, 1.28))
        assert loss.item() == pytest.approx(per[keep].sum().item() / int(keep.sum()), rel=1e-6)
        assert lp.grad[3].item() == 0.0 and not bool(keep[3])
        assert set(m) == {"pg_loss", "pg_clipfrac", "ppo_kl"}  # no per-step correction in decoupled mode


# ---------------------------------------------------------------------------------------------------------------
# detached weights, rejection = exactly zero, even with NaN inputs
# ---------------------------------------------------------------------------------------------------------------
def test_decoupled_weights_are_detached_and_nan_samples_get_zero_weight_and_zero_gradient():
    old, rollout = _random_window(8, w=2, sigma=0.2, seed=11)
    old[2, 1] = float("nan")
    rollout[5, 0] = float("-inf")
    old = old.requires_grad_(True)  # even a graph-carrying input gives detached weights
    cfg = C(is_level="sequence", is_batch_normalize=True, rs=RS("seq_mean_k1", "0.3_3.0"), on_nonfinite="reject")
    out = compute_diffusion_rollout_correction(old, rollout, cfg)
    assert not out.rollout_is_weights.requires_grad and out.rollout_is_weights.grad_fn is None
    assert torch.isfinite(out.rollout_is_weights).all()
    for i in (2, 5):
        assert torch.equal(out.rollout_is_weights[i], torch.zeros(2))
    assert bool((out.rollout_is_weights[[0, 1, 3, 4, 6, 7]] > 0).all())
    assert out.metrics["rollout_corr/nonfinite_seq_fraction"].item() == pytest.approx(2 / 8)

    adv = torch.linspace(-1, 1, 8)
    for j in range(2):
        current = old[:, j].detach() + 0.05
        current[2] = float("nan")  # the rejected sample's current log-prob is garbage too
        lp = current.clone().requires_grad_(True)
        loss, _ = compute_diffusion_step_loss(lp, old[:, j].detach(), rollout[:, j], adv, cfg,
                                              rollout_is_weights=out.rollout_is_weights[:, j])
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert lp.grad[2].item() == 0.0 and lp.grad[5].item() == 0.0
        assert lp.grad[0].item() != 0.0


def test_bypass_nan_step_is_rejected_with_zero_gradient():
    current, rollout = _random_window(6, w=1, sigma=0.1, seed=12)
    current, rollout = current[:, 0], rollout[:, 0]
    current[1] = float("nan")
    rollout[4] = float("nan")
    cfg = C(mode="bypass", loss_type="reinforce", is_level="sequence", on_nonfinite="reject")
    step = compute_diffusion_step_correction(current, rollout, cfg)
    assert step.keep_mask.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert step.rollout_is_weights[1].item() == 0.0 and step.rollout_is_weights[4].item() == 0.0
    loss, grad, m = _step_loss(cfg, current, rollout, torch.ones(6))
    assert torch.isfinite(loss) and grad[1].item() == 0.0 and grad[4].item() == 0.0 and grad[0].item() != 0.0
    assert m[STEP_PREFIX + "nonfinite_seq_fraction"].item() == pytest.approx(2 / 6)


# ---------------------------------------------------------------------------------------------------------------
# metric names: engine names, two namespaces that never overlap
# ---------------------------------------------------------------------------------------------------------------
def _generic(name, prefix):
    assert name.startswith(prefix), name
    base = name[len(prefix):]
    for o in ("seq_mean_k1", "token_k1"):
        base = base.replace(f"rollout_rs_{o}_", "rollout_rs_<option>_")
    return base


def test_metric_prefixes_are_engine_names_and_never_collide():
    old, rollout = _random_window(8, sigma=0.3, seed=13)
    cfg_dec = C(is_level="sequence", rs=RS("seq_mean_k1", "0.5_2.0"))
    cfg_byp = C(mode="bypass", is_level="sequence", rs=RS("token_k1", "0.5_2.0"))
    dec = compute_diffusion_rollout_correction(old, rollout, cfg_dec).metrics
    lp = old[:, 0].clone().requires_grad_(True)
    _, step = compute_diffusion_step_loss(lp, None, rollout[:, 0], torch.ones(8), cfg_byp)
    corr_step = {k for k in step if k not in ("pg_loss", "pg_clipfrac", "ppo_kl")}
    assert {_generic(k, DECOUPLED_PREFIX) for k in dec} <= set(METRICS)
    assert {_generic(k, STEP_PREFIX) for k in corr_step} <= set(METRICS)
    assert "rollout_corr/kl" in dec and STEP_PREFIX + "kl" in step
    assert not set(dec) & set(step)
    assert not any(k.startswith(DECOUPLED_PREFIX) for k in step)  # the policy loss's own names are kept out
    raises_mentioning(lambda: compute_diffusion_step_correction(old[:, 0], rollout[:, 0], cfg_byp,
                                                                prefix="rollout_corr/"), "prefix", "overwrite")


# ---------------------------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_naming_argument_value_and_fix():
    old, rollout = _random_window(4, sigma=0.1, seed=14)
    dec, byp = C(is_level="sequence"), C(mode="bypass", rs=RS("token_k1", 2.0))
    f = compute_diffusion_rollout_correction
    raises_mentioning(lambda: f(old[:, 0], rollout, dec), "old_log_probs", "(B, W)", "(4,)", "torch.stack")
    raises_mentioning(lambda: f(old, rollout[:, :1], dec), "rollout_log_probs", "(4, 1)", "(4, 2)")
    raises_mentioning(lambda: f(old[:, :0], rollout[:, :0], dec), "old_log_probs", "(4, 0)", "W = 0")
    raises_mentioning(lambda: f(old.tolist(), rollout, dec), "old_log_probs", "torch.Tensor", "list")
    raises_mentioning(lambda: f(old, rollout, byp), "bypass", "compute_diffusion_step_loss")
    bad = old.clone()
    bad[1, 1] = float("nan")
    raises_mentioning(lambda: f(bad, rollout, dec), "old_log_probs[1, 1] = nan", "sample 1", "SDE step 1",
                      "on_nonfinite='reject'")
    bad_r = rollout.clone()
    bad_r[3, 0] = float("inf")
    raises_mentioning(lambda: f(old, bad_r, dec), "rollout_log_probs[3, 0] = inf", "sample 3", "SDE step 0")

    s = compute_diffusion_step_correction
    raises_mentioning(lambda: s(old, rollout, byp), "log_probs", "(B,)", "(4, 2)", "log_probs[:, j]")
    raises_mentioning(lambda: s(old[:, 0], rollout[:3, 0], byp), "rollout_log_probs", "(3,)", "(4,)")
    raises_mentioning(lambda: s(old[:, 0], rollout[:, 0], dec), "mode='decoupled'",
                      "compute_diffusion_rollout_correction")
    nan_step = old[:, 0].clone()
    nan_step[2] = float("nan")
    raises_mentioning(lambda: s(nan_step, rollout[:, 0], byp), "log_probs[2] = nan", "sample 2")

    adv = torch.ones(4)
    loss = compute_diffusion_step_loss
    raises_mentioning(lambda: loss(old[:, 0], old[:, 0], rollout[:, 0], adv, dec), "rollout_is_weights",
                      "decoupled", "compute_diffusion_rollout_correction")
    raises_mentioning(lambda: loss(old[:, 0], None, rollout[:, 0], adv, byp, rollout_is_weights=torch.ones(4)),
                      "rollout_is_weights", "bypass")
    raises_mentioning(lambda: loss(old[:, 0], None, None, adv, byp), "rollout_log_probs", "bypass")
    raises_mentioning(lambda: loss(old[:, 0], old[:, 0], rollout[:, 0], torch.ones(4, 2), dec,
                                   rollout_is_weights=torch.ones(4)), "advantages", "(4, 2)")
    raises_mentioning(lambda: loss(old[:, 0], old[:, 0], rollout[:, 0], adv, dec,
                                   rollout_is_weights=torch.ones(4, 2)), "rollout_is_weights", "(4, 2)", "[:, j]")
    raises_mentioning(lambda: loss(old[:, 0], old[:, 0], rollout[:, 0], adv, dec,
                                   rollout_is_weights=-torch.ones(4)), "rollout_is_weights", "negative")


def test_bf16_inputs_and_empty_batch():
    old, rollout = _random_window(6, sigma=0.2, seed=15)
    cfg = C(is_level="sequence")
    ref = compute_diffusion_rollout_correction(old.bfloat16().float(), rollout.bfloat16().float(), cfg)
    out = compute_diffusion_rollout_correction(old.bfloat16(), rollout.bfloat16(), cfg)
    assert out.rollout_is_weights.dtype == torch.float32
    assert torch.equal(out.rollout_is_weights, ref.rollout_is_weights)
    empty = compute_diffusion_rollout_correction(old[:0], rollout[:0], cfg)
    assert empty.rollout_is_weights.shape == (0, 2)
    assert all(math.isfinite(v.item()) for v in empty.metrics.values())


# ---------------------------------------------------------------------------------------------------------------
# the example config
# ---------------------------------------------------------------------------------------------------------------
def test_example_yaml_loads_to_the_expected_config_and_keeps_the_outlier(tmp_path):
    cfg = resolve([load_yaml_layer(EXAMPLE)]).config
    assert cfg == C(mode="decoupled", is_level="sequence", is_mode="truncate", is_upper_bound=2.0,
                    rs=RS("seq_mean_k1", "0.3_3.0"), loss_type="ppo_clip", rejected_in_denominator=False)
    old, rollout = _batch(OUTLIER)
    out = compute_diffusion_rollout_correction(old, rollout, cfg)
    assert bool((out.rollout_is_weights[0] > 0).all())  # the band the doc recommends for W = 2
    # the same file flipped to bypass mode: IS becomes diagnostics only, as its comments say
    with open(EXAMPLE) as f:
        text = f.read()
    assert "bypass_mode: false" in text
    flipped = tmp_path / "bypass.yaml"
    flipped.write_text(text.replace("bypass_mode: false", "bypass_mode: true"))
    bcfg = resolve([load_yaml_layer(str(flipped))]).config
    assert bcfg.mode == "bypass" and bcfg.is_enabled and not bcfg.is_weights_applied


# ---------------------------------------------------------------------------------------------------------------
# data parallelism: a real 2-process gloo spawn equals the single process on the global batch
# ---------------------------------------------------------------------------------------------------------------
DP_SPLIT = (7, 12)  # uneven: rank 0 holds samples 0..6, rank 1 samples 7..11
DP_DEC = {
    "token_norm_rs": C(is_level="token", is_upper_bound=1.5, is_batch_normalize=True,
                       rs=RS("seq_mean_k1", "0.5_2.0")),
    "seq_clip_norm_nan": C(is_level="sequence", is_mode="clip", is_batch_normalize=True, on_nonfinite="reject"),
}
DP_STEP = C(mode="bypass", loss_type="reinforce", is_level="sequence", is_batch_normalize=True,
            rs=RS("token_k1", "0.5_2.0"))


def _dp_data():
    old, rollout = _random_window(DP_SPLIT[1], w=2, sigma=0.5, seed=21)
    old_nan = old.clone()
    old_nan[9, 0] = float("nan")  # on rank 1
    adv = torch.linspace(-1.0, 1.0, DP_SPLIT[1])
    return old, old_nan, rollout, adv


def _dp_run(old, old_nan, rollout, adv, reducer, rows):
    out = {}
    for name, cfg in DP_DEC.items():
        src = old_nan if name.endswith("nan") else old
        d = compute_diffusion_rollout_correction(src[rows], rollout[rows], cfg, reducer=reducer)
        out[name] = (d.rollout_is_weights, {k: v.item() for k, v in d.metrics.items()})
    step = compute_diffusion_step_correction(old[rows, 1], rollout[rows, 1], DP_STEP, reducer=reducer)
    lp = old[rows, 1].clone().requires_grad_(True)
    loss, _ = compute_diffusion_step_loss(lp, None, rollout[rows, 1], adv[rows], DP_STEP, reducer=reducer)
    loss.backward()
    out["step"] = (step.rollout_is_weights, {k: v.item() for k, v in step.metrics.items()})
    out["loss"] = (loss.detach(), lp.grad)
    return out


def _dp_worker(rank, world_size, data):
    import torch.distributed as dist

    from slime_rc.correction.reducer import DistributedReducer
    reducer = DistributedReducer(batch_group=dist.group.WORLD)
    rows = slice(0, DP_SPLIT[0]) if rank == 0 else slice(DP_SPLIT[0], DP_SPLIT[1])
    return _dp_run(*data, reducer, rows)


def test_data_parallel_equals_single_process_on_the_global_batch():
    data = _dp_data()
    ref = _dp_run(*data, None, slice(None))
    ranks = run_distributed(_dp_worker, 2, args=(data,), timeout=90)
    for key in DP_DEC.keys() | {"step"}:
        weights = torch.cat([ranks[0][key][0], ranks[1][key][0]])
        torch.testing.assert_close(weights, ref[key][0], rtol=1e-6, atol=1e-6, msg=key)
        for rank in ranks:
            assert rank[key][1].keys() == ref[key][1].keys()
            for name, value in ref[key][1].items():
                assert rank[key][1][name] == pytest.approx(value, rel=1e-6, abs=1e-6), (key, name)
    # the rejected NaN sample and the global batch normalization really were exercised
    assert torch.equal(ref["seq_clip_norm_nan"][0][9], torch.zeros(2))
    assert ref["token_norm_rs"][1]["rollout_corr/rollout_is_batch_norm_factor"] != pytest.approx(1.0, abs=1e-3)
    assert 0 < ref["step"][1][STEP_PREFIX + "rejected_seq_fraction"] < 1
    # loss shares add up to the single-process loss; each rank's gradient is the single-process one at its samples
    assert (ranks[0]["loss"][0] + ranks[1]["loss"][0]).item() == pytest.approx(ref["loss"][0].item(), rel=1e-6)
    grads = torch.cat([ranks[0]["loss"][1], ranks[1]["loss"][1]])
    torch.testing.assert_close(grads, ref["loss"][1], rtol=1e-6, atol=1e-7)
