"""Policy losses (`slime_rc.compute_policy_loss`): values against a per-token loop, gradients, rejection, modes."""

from __future__ import annotations

import math

import pytest
import torch

from slime_rc import (RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction,
                      cu_seqlens_from_lengths, parse_rejection_criteria)


def _batch(seed=0, lengths=(5, 1, 7, 3, 6), sigma=0.3):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    rollout = -torch.rand(n, generator=g) * 2 - 0.05
    old = rollout + sigma * torch.randn(n, generator=g)
    theta = (old + 0.15 * torch.randn(n, generator=g)).clamp(max=-1e-3)  # a log-prob
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()
    return dict(theta=theta, old=old, rollout=rollout, adv=adv, mask=mask, cu=cu_seqlens_from_lengths(list(lengths)))


def _loss(b, cfg, theta=None, **kw):
    lp = (b["theta"] if theta is None else theta).clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp, b["old"], b["rollout"], b["adv"], b["mask"], b["cu"], cfg, **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _reference(b, cfg):
    """The loss written token by token in plain Python, from the engine's weights and keep mask."""
    bypass = cfg.mode == "bypass"
    corr = None
    if cfg.corrects:
        train = b["theta"] if bypass else b["old"]
        corr = compute_rollout_correction(train, b["rollout"], b["mask"], b["cu"], cfg)
    keep = b["mask"].bool() if corr is None else corr.keep_mask.bool()
    counted = b["mask"].bool() if cfg.rejected_in_denominator else keep
    old = b["rollout"] if bypass else b["old"]
    hi = 1 + (cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip)
    per_seq, dens = [], []
    cu = b["cu"].tolist()
    for i in range(len(cu) - 1):
        s, den = 0.0, 0
        for t in range(cu[i], cu[i + 1]):
            den += int(counted[t])
            if not keep[t]:
                continue
            a = float(b["adv"][t])
            w = float(corr.is_weights[t]) if (corr is not None and cfg.is_weights_applied) else 1.0
            if cfg.loss_type == "reinforce":
                s += -w * float(b["theta"][t]) * a
                continue
            rho = math.exp(float(b["theta"][t]) - float(old[t]))
            lt = max(-a * rho, -a * min(max(rho, 1 - cfg.eps_clip), hi))
            if cfg.eps_clip_c is not None and a < 0:
                lt = min(lt, -a * cfg.eps_clip_c)
            s += w * lt
        per_seq.append(s)
        dens.append(den)
    if cfg.loss_agg == "token_mean":
        return sum(per_seq) / max(sum(dens), 1)
    live = [s / d for s, d in zip(per_seq, dens) if d > 0]
    return sum(live) / max(len(live), 1)


CONFIGS = {
    "standard": RolloutCorrectionConfig(),
    "standard_token_mean_dual": RolloutCorrectionConfig(loss_agg="token_mean", eps_clip_c=3.0, eps_clip_high=0.28),
    "decoupled_token_tis": RolloutCorrectionConfig(is_level="token", is_upper_bound=1.5),
    "decoupled_seq_tis_rs": RolloutCorrectionConfig(is_level="sequence", rs=parse_rejection_criteria("token", 1.6)),
    "decoupled_geo_mask_dilute": RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.1,
                                                         rejected_in_denominator=True, loss_agg="token_mean"),
    "decoupled_veto_norm": RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, veto_threshold=0.6),
    "bypass_ppo": RolloutCorrectionConfig(mode="bypass"),
    "bypass_ppo_rs_diag_is": RolloutCorrectionConfig(mode="bypass", is_level="token",
                                                     rs=parse_rejection_criteria("seq_mean_k3", 0.05)),
    "bypass_reinforce_seq_is": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence"),
    "bypass_reinforce_geo_rs_token": RolloutCorrectionConfig.bypass_pg_geo_rs_token_tis(rs_threshold="0.8_1.25"),
    "bypass_reinforce_plain": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce"),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_equals_the_token_loop(name, seed):
    cfg = CONFIGS[name]
    b = _batch(seed)
    loss, grad, _ = _loss(b, cfg)
    assert torch.isfinite(grad).all()
    assert float(loss) == pytest.approx(_reference(b, cfg), rel=1e-5, abs=1e-7)


def test_the_configs_exercise_rejection_clipping_and_weights():
    b = _batch(0)
    kept = {n: float(_loss(b, c)[2].get("rollout_corr/rollout_rs_masked_fraction", 0.0)) for n, c in CONFIGS.items()}
    assert kept["decoupled_seq_tis_rs"] > 0 and kept["bypass_ppo_rs_diag_is"] > 0
    assert float(_loss(b, CONFIGS["standard"])[2]["pg_clipfrac"]) > 0


def test_reinforce_gradient_is_stopgrad_weight_times_advantage():
    # d loss / d log pi_theta_t = -w_t * A_t * c_t: no gradient through w although w depends on pi_theta
    cfg = RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="token", is_upper_bound=5.0,
                                  loss_agg="token_mean")
    b = _batch(3)
    _, grad, _ = _loss(b, cfg)
    corr = compute_rollout_correction(b["theta"], b["rollout"], b["mask"], b["cu"], cfg)
    den = float(corr.keep_mask.sum())
    expected = -corr.is_weights * b["adv"] * corr.keep_mask / den
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)


def test_rejected_tokens_get_exactly_zero_gradient_even_when_nan():
    cfg = RolloutCorrectionConfig(is_level="token", rs=parse_rejection_criteria("token", 1.3),
                                  on_nonfinite="reject")
    b = _batch(4)
    b["old"][2] = float("nan")  # rejected by on_nonfinite='reject' (its whole sequence)
    theta = b["theta"].clone()
    theta[9] = float("nan")  # pi_theta NaN on a token whose sequence is rejected below
    b["old"][9] = b["rollout"][9] + 3.0  # ratio e^3 -> rejected by RS
    loss, grad, _ = _loss(b, cfg, theta=theta)
    corr = compute_rollout_correction(b["old"], b["rollout"], b["mask"], b["cu"], cfg)
    rejected = corr.keep_mask == 0
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert rejected[2] and rejected[9]
    assert (grad[rejected] == 0).all()
    assert (grad[~rejected] != 0).any()


def test_everything_rejected_gives_a_finite_zero_loss_and_zero_gradient():
    for agg in ("sample_mean", "token_mean"):
        cfg = RolloutCorrectionConfig(is_level="token", rs=parse_rejection_criteria("token", 1.0001), loss_agg=agg)
        b = _batch(5, sigma=1.0)
        b["old"] = b["rollout"] + 0.5  # every ratio e^0.5 is outside the band
        loss, grad, metrics = _loss(b, cfg)
        assert float(loss) == 0.0 and (grad == 0).all()
        assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == 1.0


def test_decoupled_with_old_equal_rollout_is_standard_ppo():
    b = _batch(6)
    b["rollout"] = b["old"].clone()
    std = _loss(b, RolloutCorrectionConfig())
    dec = _loss(b, RolloutCorrectionConfig(is_level="sequence", rs=parse_rejection_criteria("token", 1.5),
                                           veto_threshold=1e-4))
    assert float(dec[0]) == pytest.approx(float(std[0]), rel=1e-6)
    torch.testing.assert_close(dec[1], std[1], rtol=1e-6, atol=1e-9)


def test_bypass_ppo_is_ppo_with_old_replaced_by_rollout():
    b = _batch(7)
    bypass = _loss(b, RolloutCorrectionConfig(mode="bypass"))
    b2 = dict(b, old=b["rollout"].clone())
    std = _loss(b2, RolloutCorrectionConfig())
    assert float(bypass[0]) == pytest.approx(float(std[0]), rel=1e-6)
    torch.testing.assert_close(bypass[1], std[1])
    # bypass ignores old_log_probs entirely
    none = compute_policy_loss(b["theta"], None, b["rollout"], b["adv"], b["mask"], b["cu"],
                               RolloutCorrectionConfig(mode="bypass"))[0]
    assert float(none) == pytest.approx(float(bypass[0]), rel=1e-7)


@pytest.mark.parametrize("mode,loss_type", [("standard", "ppo_clip"), ("bypass", "ppo_clip"), ("bypass", "reinforce")])
@pytest.mark.parametrize("loss_agg", ["sample_mean", "token_mean"])
def test_metrics_only_leaves_loss_and_gradient_bit_identical(mode, loss_type, loss_agg):
    """--get-mismatch-metrics without IS/RS: every mismatch metric is reported, the numbers of the loss are not
    touched (compared bit for bit, not to a tolerance)."""
    b = _batch(21, sigma=0.5)
    base = dict(mode=mode, loss_type=loss_type, loss_agg=loss_agg)
    plain = _loss(b, RolloutCorrectionConfig(**base))
    watched = _loss(b, RolloutCorrectionConfig(**base, get_mismatch_metrics=True))
    assert torch.equal(watched[0], plain[0]) and torch.equal(watched[1], plain[1])
    assert not any(k.startswith("rollout_corr/") for k in plain[2])
    train = b["theta"] if mode == "bypass" else b["old"]
    engine = compute_rollout_correction(train, b["rollout"], b["mask"], b["cu"], RolloutCorrectionConfig())
    assert set(watched[2]) - set(plain[2]) == {f"rollout_corr/{k}" for k in engine.metrics}
    for k, v in engine.metrics.items():  # pi_old vs pi_rollout (standard), pi_theta vs pi_rollout (bypass)
        assert float(watched[2][f"rollout_corr/{k}"]) == float(v), k
    assert float(watched[2]["rollout_corr/kl"]) != 0.0


def test_is_weights_are_diagnostics_only_in_bypass_ppo():
    b = _batch(8)
    plain = _loss(b, RolloutCorrectionConfig(mode="bypass"))
    diag = _loss(b, RolloutCorrectionConfig(mode="bypass", is_level="token", is_upper_bound=1.2))
    assert float(diag[0]) == float(plain[0])
    assert "rollout_corr/rollout_is_mean" in diag[2]


def test_rejected_in_denominator_dilutes_the_token_mean():
    b = _batch(9)
    base = dict(is_level="token", rs=parse_rejection_criteria("token", 1.4), loss_agg="token_mean")
    out = _loss(b, RolloutCorrectionConfig(**base))
    diluted = _loss(b, RolloutCorrectionConfig(**base, rejected_in_denominator=True))
    corr = compute_rollout_correction(b["old"], b["rollout"], b["mask"], b["cu"], RolloutCorrectionConfig(**base))
    kept, total = float(corr.keep_mask.sum()), float(b["mask"].sum())
    assert kept < total
    assert float(diluted[0]) == pytest.approx(float(out[0]) * kept / total, rel=1e-6)


def test_clip_settings_on_hand_computed_tokens():
    # one token per sequence, old = 0; log pi_theta chosen so that rho = 1.5 and 0.5
    lp = torch.log(torch.tensor([1.5, 1.5, 0.5, 10.0]))
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    cu = cu_seqlens_from_lengths([1, 1, 1, 1])
    zeros, ones = torch.zeros(4), torch.ones(4)
    cfg = RolloutCorrectionConfig(loss_agg="token_mean", eps_clip=0.2, eps_clip_high=0.3, eps_clip_c=3.0)
    loss, metrics = compute_policy_loss(lp, zeros, None, adv, ones, cu, cfg)
    # A>0, rho 1.5: min(1.5, 1.3) -> -1.3; A<0, rho 1.5: max(1.5, 1.3) -> 1.5 (unclipped);
    # A<0, rho 0.5: max(0.5, 0.8) -> 0.8 (clipped); A<0, rho 10: max(10, 1.3) = 10, dual clip -> 3
    assert float(loss) == pytest.approx((-1.3 + 1.5 + 0.8 + 3.0) / 4, rel=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(3 / 4)


def test_missing_inputs_are_named():
    b = _batch(10)
    with pytest.raises(ValueError, match="rollout_log_probs is None"):
        compute_policy_loss(b["theta"], b["old"], None, b["adv"], b["mask"], b["cu"],
                            RolloutCorrectionConfig(is_level="token"))
    with pytest.raises(ValueError, match="old_log_probs is None"):
        compute_policy_loss(b["theta"], None, b["rollout"], b["adv"], b["mask"], b["cu"],
                            RolloutCorrectionConfig(is_level="token"))


def test_precomputed_correction_and_normalizer_equal_the_in_loss_path():
    from slime_rc import loss_normalizer
    cfg = RolloutCorrectionConfig(is_level="sequence", is_batch_normalize=True,
                                  rs=parse_rejection_criteria("geometric", "0.9_1.1"))
    b = _batch(11)
    inline = _loss(b, cfg)
    corr = compute_rollout_correction(b["old"], b["rollout"], b["mask"], b["cu"], cfg)
    norm = loss_normalizer(corr.keep_mask.bool(), b["cu"])
    pre = _loss(b, cfg, correction=corr, normalizer=norm)
    assert float(pre[0]) == float(inline[0])
    torch.testing.assert_close(pre[1], inline[1], rtol=0, atol=0)


def test_vocab_parallel_log_probs_single_shard_matches_log_softmax():
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 33, generator=g, requires_grad=True)
    target = torch.randint(0, 33, (7,), generator=g)
    got = vocab_parallel_log_probs(logits, target, temperature=0.7)
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, target[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (g1,) = torch.autograd.grad(got.sum(), logits)
    (g2,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(logits, target, temperature=0.0)


def _micro_batch(b, lo_seq, hi_seq, vocab=11, seed=0):
    """Sequences [lo_seq, hi_seq) of batch ``b`` as a Megatron-loss micro-batch, with logits whose target
    log-prob is exactly ``theta`` at temperature 1 (target logit = theta + log Z)."""
    cu = b["cu"]
    t0, t1 = int(cu[lo_seq]), int(cu[hi_seq])
    n = t1 - t0
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, (n,), generator=g)
    other = torch.randn(n, vocab, generator=g)
    other = other.scatter(1, targets[:, None], -torch.inf)  # Z of the other tokens
    rest = torch.logsumexp(other, 1)
    # p(target) = e^x / (e^x + e^rest) = e^theta  =>  x = theta + rest - log(1 - e^theta)
    x = b["theta"][t0:t1] + rest - torch.log1p(-torch.exp(b["theta"][t0:t1]))
    logits = other.scatter(1, targets[:, None], x[:, None])
    return dict(targets=targets, loss_mask=b["mask"][t0:t1], advantages=b["adv"][t0:t1],
                old_log_probs=b["old"][t0:t1], rollout_log_probs=b["rollout"][t0:t1],
                cu_seqlens=cu[lo_seq:hi_seq + 1] - cu[lo_seq]), logits


def test_megatron_policy_loss_prestep_path_is_the_global_batch_loss():
    from slime_rc.megatron.loss import policy_loss, prepare_global_batch
    from slime_rc.correction.reducer import LocalReducer
    cfg = RolloutCorrectionConfig(is_level="token", is_batch_normalize=True,
                                  rs=parse_rejection_criteria("token", 1.6), loss_agg="sample_mean")
    b = _batch(12)
    mbs = [_micro_batch(b, 0, 2, seed=1), _micro_batch(b, 2, 5, seed=2)]
    # the logits reproduce theta as the target log-probs
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs
    torch.testing.assert_close(vocab_parallel_log_probs(mbs[1][1], mbs[1][0]["targets"]),
                               b["theta"][int(b["cu"][2]):], rtol=1e-5, atol=1e-5)
    prepared = prepare_global_batch([mb for mb, _ in mbs], cfg, reducer=LocalReducer())
    total = sum(policy_loss(logits, mb, cfg, prepared=p, reducer=LocalReducer())[0]
                for (mb, logits), p in zip(mbs, prepared))
    whole = compute_policy_loss(b["theta"], b["old"], b["rollout"], b["adv"], b["mask"], b["cu"], cfg)[0]
    assert float(total) == pytest.approx(float(whole), rel=1e-5)
    # one micro-batch: the pre-step path equals the in-loss path
    mb, logits = _micro_batch(b, 0, 5, seed=3)
    (p,) = prepare_global_batch([mb], cfg, reducer=LocalReducer())
    a = policy_loss(logits, mb, cfg, prepared=p, reducer=LocalReducer())[0]
    c = policy_loss(logits, mb, cfg, reducer=LocalReducer())[0]
    assert float(a) == pytest.approx(float(c), rel=1e-6)
    with pytest.raises(ValueError, match="decoupled"):
        prepare_global_batch([mb], RolloutCorrectionConfig(mode="bypass"), reducer=LocalReducer())


def test_megatron_policy_loss_with_a_slime_tis_function_equals_the_builtin_engine():
    import types
    from custom_tis.mis import compute_mis_weights_with_cp
    from slime_rc.megatron.loss import policy_loss
    from slime_rc.slime.tis_bridge import tis_function_correction_for, with_sample_fields
    from slime_rc.plugins import load_function
    from slime_rc.correction.reducer import LocalReducer
    cfg = RolloutCorrectionConfig(is_level="sequence", rs=parse_rejection_criteria("token", 1.5), veto_threshold=0.5)
    b = _batch(13)
    cu = b["cu"]
    b["mask"][cu[1:] - 1] = 0.0  # the last position of a sequence has no target
    mb, logits = _micro_batch(b, 0, 5, seed=4)
    mb = with_sample_fields(mb)
    mb["position_ids"] = torch.cat([torch.arange(int(n)) for n in cu[1:] - cu[:-1]])
    args = types.SimpleNamespace(rollout_correction_config=cfg)
    assert load_function("mis") is compute_mis_weights_with_cp
    lp = logits.clone().requires_grad_(True)
    external = tis_function_correction_for(compute_mis_weights_with_cp, args)
    custom, m1 = policy_loss(lp, mb, cfg, reducer=LocalReducer(), external=external)
    custom.backward()
    lp2 = logits.clone().requires_grad_(True)
    # a TIS function's masks zero numerators only (slime's contract): the engine with rejected tokens kept in the
    # denominator is the same loss
    from dataclasses import replace
    builtin, m2 = policy_loss(lp2, mb, replace(cfg, rejected_in_denominator=True), reducer=LocalReducer())
    builtin.backward()
    assert float(m2["rollout_corr/rollout_rs_masked_fraction"]) > 0  # the case rejects something
    assert any(k.startswith("rollout_corr/tis_function/") for k in m1)
    # one set of names: the mismatch metrics and what was applied are the engine's, with the engine's values
    shared = sorted(set(m1) & set(m2) - {"pg_loss", "pg_clipfrac", "ppo_kl"})
    assert {"rollout_corr/k3_kl", "rollout_corr/rejected_token_fraction",
            "rollout_corr/rollout_is_eff_sample_size"} <= set(shared), shared
    for k in shared:
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-6, abs=1e-9), k
    assert float(custom) == pytest.approx(float(builtin), rel=1e-6)
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="with_sample_fields"):
        policy_loss(logits, {k: v for k, v in mb.items() if k != "sample_lengths"}, cfg, reducer=LocalReducer(),
                    external=external)
