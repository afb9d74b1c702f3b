"""Bad and degenerate inputs: non-finite log-probs, malformed packing, empty/fully-masked/fully-rejected batches,
low-precision dtypes, wrong config type."""

import math

import pytest
import torch

from slime_rc import (RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths,
                      parse_rejection_criteria)

NAN, INF = float("nan"), float("inf")

CONFIGS = {
    "off": RolloutCorrectionConfig(),
    "token": RolloutCorrectionConfig(is_level="token", is_upper_bound=2.0),
    "token_norm_rs": RolloutCorrectionConfig(is_level="token", is_batch_normalize=True,
                                             rs=parse_rejection_criteria("token_k1,seq_max_k2", "0.5_2.0,0.5"),
                                             veto_threshold=1e-4),
    "sequence_clip": RolloutCorrectionConfig(is_level="sequence", is_mode="clip", is_upper_bound=3.0),
    "geometric_mask_norm": RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.5,
                                                   is_batch_normalize=True,
                                                   rs=parse_rejection_criteria("seq_mean_k3", 0.5)),
    "token_mask": RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=2.0),
}


def _reject(cfg):
    return RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "on_nonfinite": "reject"})


def _batch(lengths=(3, 4, 2), seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    rollout = -torch.rand(n, generator=g) * 3
    train = rollout + 0.2 * torch.randn(n, generator=g)
    mask = torch.ones(n)
    return train, rollout, mask, cu_seqlens_from_lengths(list(lengths))


def _assert_all_finite(res):
    assert torch.isfinite(res.keep_mask).all()
    if res.is_weights is not None:
        assert res.is_weights.dtype == torch.float32
        assert torch.isfinite(res.is_weights).all()
    for k, v in res.metrics.items():
        assert math.isfinite(float(v)), f"metric {k} = {float(v)}"
    for k, v in res.sequences.items():
        assert torch.isfinite(v).all(), f"sequences[{k}] = {v}"


# ---------------------------------------------------------------------------------------------------------------
# non-finite log-probs
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["train", "rollout"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_nonfinite_on_loss_token_raises_naming_sample_and_position(which, bad, cfg_name):
    train, rollout, mask, cu = _batch((3, 4, 2))
    target = train if which == "train" else rollout
    target[3 + 2] = bad  # sample 1, position 2
    with pytest.raises(ValueError) as info:
        compute_rollout_correction(train, rollout, mask, cu, CONFIGS[cfg_name])
    msg = str(info.value)
    assert "sample 1" in msg and "position 2" in msg, msg
    assert f"{which}_log_probs" in msg, msg
    assert "on_nonfinite='reject'" in msg  # the fix


def test_nonfinite_error_reports_first_bad_token():
    train, rollout, mask, cu = _batch((3, 4, 2))
    rollout[7] = NAN  # sample 2, position 0
    train[1] = -INF  # sample 0, position 1 (first)
    with pytest.raises(ValueError, match=r"sample 0, position 1"):
        compute_rollout_correction(train, rollout, mask, cu, CONFIGS["token"])


def test_both_infinite_same_sign_is_nonfinite():
    # -inf - (-inf) = NaN: still non-finite, must not be read as ratio 1
    train, rollout, mask, cu = _batch((3, 4, 2))
    train[4] = -INF
    rollout[4] = -INF
    with pytest.raises(ValueError, match=r"sample 1, position 1"):
        compute_rollout_correction(train, rollout, mask, cu, CONFIGS["token"])


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_nonfinite_on_masked_token_is_ignored(bad, cfg_name):
    cfg = CONFIGS[cfg_name]
    train, rollout, mask, cu = _batch((3, 4, 2))
    clean = compute_rollout_correction(train.clone(), rollout.clone(), mask.clone(), cu, cfg)
    # a fourth sequence-position: mask out token 5 and poison both of its log-probs
    mask[5] = 0
    ref = compute_rollout_correction(train.clone(), rollout.clone(), mask, cu, cfg)
    train[5] = bad
    rollout[5] = bad
    res = compute_rollout_correction(train, rollout, mask, cu, cfg)
    _assert_all_finite(res)
    assert res.keep_mask[5] == 0
    assert torch.equal(res.keep_mask, ref.keep_mask)
    if cfg.is_enabled:
        assert res.is_weights[5] == 0
        torch.testing.assert_close(res.is_weights, ref.is_weights, rtol=1e-6, atol=0)
    for k in ref.metrics:
        assert float(res.metrics[k]) == pytest.approx(float(ref.metrics[k]), rel=1e-9, abs=1e-12), k
    assert set(res.metrics) == set(clean.metrics)


@pytest.mark.parametrize("which", ["train", "rollout"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_reject_policy_drops_the_sequence(which, bad, cfg_name):
    cfg = _reject(CONFIGS[cfg_name])
    train, rollout, mask, cu = _batch((3, 4, 2))
    (train if which == "train" else rollout)[3 + 2] = bad
    res = compute_rollout_correction(train, rollout, mask, cu, cfg)
    _assert_all_finite(res)
    assert res.keep_mask[3:7].sum() == 0, "the whole sequence holding the bad token is rejected"
    if res.is_weights is not None:
        assert (res.is_weights[3:7] == 0).all()
    assert res.sequences["kept"][1] == 0
    m = {k: float(v) for k, v in res.metrics.items()}
    assert m["nonfinite_token_fraction"] == pytest.approx(1 / 9)
    assert m["nonfinite_seq_fraction"] == pytest.approx(1 / 3)
    assert m["rejected_token_fraction"] >= 4 / 9 - 1e-12
    assert m["rejected_seq_fraction"] >= 1 / 3 - 1e-12


def test_reject_policy_other_sequences_unaffected():
    cfg = _reject(CONFIGS["sequence_clip"])
    train, rollout, mask, cu = _batch((3, 4, 2))
    ref = compute_rollout_correction(train.clone(), rollout.clone(), mask, cu, cfg)
    rollout[4] = NAN
    res = compute_rollout_correction(train, rollout, mask, cu, cfg)
    assert torch.equal(res.keep_mask[:3], ref.keep_mask[:3])
    assert torch.equal(res.keep_mask[7:], ref.keep_mask[7:])
    torch.testing.assert_close(res.is_weights[:3], ref.is_weights[:3])
    torch.testing.assert_close(res.is_weights[7:], ref.is_weights[7:])
    assert float(ref.metrics["nonfinite_seq_fraction"]) == 0.0


def test_reject_policy_counts_several_bad_tokens_and_sequences():
    cfg = _reject(CONFIGS["token"])
    train, rollout, mask, cu = _batch((3, 4, 2))
    train[0] = NAN
    rollout[1] = INF
    train[8] = -INF
    res = compute_rollout_correction(train, rollout, mask, cu, cfg)
    _assert_all_finite(res)
    assert res.keep_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert float(res.metrics["nonfinite_token_fraction"]) == pytest.approx(3 / 9)
    assert float(res.metrics["nonfinite_seq_fraction"]) == pytest.approx(2 / 3)


def test_reject_policy_everything_nonfinite():
    for name, base in CONFIGS.items():
        cfg = _reject(base)
        train, rollout, mask, cu = _batch((3, 4, 2))
        train[:] = NAN
        res = compute_rollout_correction(train, rollout, mask, cu, cfg)
        _assert_all_finite(res)
        assert res.keep_mask.sum() == 0, name
        assert float(res.metrics["nonfinite_seq_fraction"]) == 1.0
        assert float(res.metrics["nonfinite_token_fraction"]) == 1.0


# ---------------------------------------------------------------------------------------------------------------
# shapes, lengths, cu_seqlens
# ---------------------------------------------------------------------------------------------------------------

CFG = CONFIGS["token"]


def test_length_mismatch_train_rollout():
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"rollout_log_probs has 8 tokens but train_log_probs has 9"):
        compute_rollout_correction(train, rollout[:-1], mask, cu, CFG)


def test_length_mismatch_mask():
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"loss_mask.*9 tokens"):
        compute_rollout_correction(train, rollout, mask[:-1], cu, CFG)
    with pytest.raises(ValueError, match=r"loss_mask"):
        compute_rollout_correction(train, rollout, torch.ones(10), cu, CFG)


def test_train_shorter_than_cu():
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"cu_seqlens.*end at the token count 8"):
        compute_rollout_correction(train[:-1], rollout[:-1], mask[:-1], cu, CFG)


@pytest.mark.parametrize("which", ["train", "rollout", "mask"])
def test_2d_inputs_rejected(which):
    train, rollout, mask, cu = _batch((3, 3))
    args = {"train": train, "rollout": rollout, "mask": mask}
    args[which] = args[which].reshape(2, 3)
    with pytest.raises(ValueError, match=r"(1-D|\(2, 3\))"):
        compute_rollout_correction(args["train"], args["rollout"], args["mask"], cu, CFG)


def test_2d_error_explains_flattening():
    train, rollout, mask, cu = _batch((3, 3))
    with pytest.raises(ValueError, match=r"train_log_probs.*\(2, 3\).*cu_seqlens"):
        compute_rollout_correction(train.reshape(2, 3), rollout.reshape(2, 3), mask.reshape(2, 3), cu, CFG)


def test_non_tensor_log_probs():
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"train_log_probs must be a torch.Tensor"):
        compute_rollout_correction(train.tolist(), rollout, mask, cu, CFG)


def test_integer_log_probs_rejected():
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"rollout_log_probs has dtype torch.int64"):
        compute_rollout_correction(train, rollout.long(), mask, cu, CFG)


def test_non_binary_float_mask_rejected():
    train, rollout, mask, cu = _batch()
    mask[2] = 0.5
    with pytest.raises(ValueError, match=r"loss_mask must hold only 0 and 1"):
        compute_rollout_correction(train, rollout, mask, cu, CFG)


def test_bool_and_int_masks_equivalent():
    train, rollout, mask, cu = _batch()
    mask[[1, 4]] = 0
    a = compute_rollout_correction(train, rollout, mask, cu, CFG)
    b = compute_rollout_correction(train, rollout, mask.bool(), cu, CFG)
    c = compute_rollout_correction(train, rollout, mask.long(), cu, CFG)
    assert torch.equal(a.keep_mask, b.keep_mask) and torch.equal(a.keep_mask, c.keep_mask)
    assert torch.equal(a.is_weights, b.is_weights) and torch.equal(a.is_weights, c.is_weights)


def test_cu_seqlens_non_monotonic():
    train, rollout, mask, _ = _batch()
    with pytest.raises(ValueError, match=r"non-decreasing.*cu_seqlens\[2\]=2 < cu_seqlens\[1\]=5"):
        compute_rollout_correction(train, rollout, mask, torch.tensor([0, 5, 2, 9]), CFG)


def test_cu_seqlens_not_starting_at_zero():
    train, rollout, mask, _ = _batch()
    with pytest.raises(ValueError, match=r"start at 0.*first=1"):
        compute_rollout_correction(train, rollout, mask, torch.tensor([1, 3, 9]), CFG)


@pytest.mark.parametrize("last", [8, 10])
def test_cu_seqlens_not_ending_at_n(last):
    train, rollout, mask, _ = _batch()
    with pytest.raises(ValueError, match=rf"end at the token count 9.*last={last}"):
        compute_rollout_correction(train, rollout, mask, torch.tensor([0, 3, last]), CFG)


def test_cu_seqlens_float_dtype():
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"cu_seqlens must be an integer tensor.*float"):
        compute_rollout_correction(train, rollout, mask, cu.float(), CFG)


@pytest.mark.parametrize("cu", [torch.zeros(0, dtype=torch.int64), torch.tensor([[0, 3], [3, 9]])])
def test_cu_seqlens_wrong_size(cu):
    train, rollout, mask, _ = _batch()
    with pytest.raises(ValueError, match=r"cu_seqlens must be an integer tensor of shape \[B\+1\]"):
        compute_rollout_correction(train, rollout, mask, cu, CFG)


def test_cu_seqlens_int32_and_list_accepted():
    train, rollout, mask, cu = _batch()
    ref = compute_rollout_correction(train, rollout, mask, cu, CFG)
    for alt in (cu.int(), cu.tolist()):
        res = compute_rollout_correction(train, rollout, mask, alt, CFG)
        assert torch.equal(res.is_weights, ref.is_weights)


# ---------------------------------------------------------------------------------------------------------------
# empty, fully masked, fully rejected
# ---------------------------------------------------------------------------------------------------------------

ALL_CONFIGS = list(CONFIGS.items()) + [(n + "_reject", _reject(c)) for n, c in CONFIGS.items()]


@pytest.mark.parametrize("cfg_name,cfg", ALL_CONFIGS)
@pytest.mark.parametrize("n_seqs", [0, 1, 3])
def test_empty_batch(cfg_name, cfg, n_seqs):
    e = torch.zeros(0)
    res = compute_rollout_correction(e, e.clone(), e.clone(), torch.zeros(n_seqs + 1, dtype=torch.int64), cfg)
    _assert_all_finite(res)
    assert res.keep_mask.shape == (0,)
    if cfg.is_enabled:
        assert res.is_weights.shape == (0,)
    assert all(v.numel() == n_seqs for v in res.sequences.values())
    assert float(res.metrics["rejected_token_fraction"]) == 0.0
    assert float(res.metrics["kl"]) == 0.0


@pytest.mark.parametrize("cfg_name,cfg", ALL_CONFIGS)
def test_fully_masked_samples(cfg_name, cfg):
    train, rollout, mask, cu = _batch((3, 4, 2))
    mask[3:7] = 0  # sample 1 fully masked
    res = compute_rollout_correction(train, rollout, mask, cu, cfg)
    _assert_all_finite(res)
    assert res.keep_mask[3:7].sum() == 0
    if cfg.is_enabled:
        assert (res.is_weights[3:7] == 0).all()
    assert res.sequences["valid_tokens"][1] == 0
    assert res.sequences["kept"][1] == 0
    # the empty sample does not count as a sequence in the per-sequence means
    ref = compute_rollout_correction(torch.cat([train[:3], train[7:]]), torch.cat([rollout[:3], rollout[7:]]),
                                     torch.ones(5), cu_seqlens_from_lengths([3, 2]), cfg)
    for k in ("training_log_ppl", "log_ppl_diff", "kl", "chi2_seq", "rejected_seq_fraction"):
        assert float(res.metrics[k]) == pytest.approx(float(ref.metrics[k]), rel=1e-9, abs=1e-12), k


@pytest.mark.parametrize("cfg_name,cfg", ALL_CONFIGS)
def test_everything_masked(cfg_name, cfg):
    train, rollout, mask, cu = _batch((3, 4, 2))
    res = compute_rollout_correction(train, rollout, torch.zeros_like(mask), cu, cfg)
    _assert_all_finite(res)
    assert res.keep_mask.sum() == 0
    if cfg.is_enabled:
        assert (res.is_weights == 0).all()


@pytest.mark.parametrize("cfg", [
    RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, rs=parse_rejection_criteria("token", 1.01)),
    RolloutCorrectionConfig(is_level="sequence", is_batch_normalize=True,
                            rs=parse_rejection_criteria("geometric", "0.999_1.001")),
    RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.001, is_batch_normalize=True),
    RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=1.001, is_batch_normalize=True),
    RolloutCorrectionConfig(is_level="token", veto_threshold=0.9, is_batch_normalize=True),
    RolloutCorrectionConfig(rs=parse_rejection_criteria("seq_max_k2", 1e-6)),
])
def test_everything_rejected_is_finite(cfg):
    train, rollout, mask, cu = _batch((3, 4, 2))
    train = rollout - 0.5  # every token (and every sequence) has log r = -0.5
    res = compute_rollout_correction(train, rollout, mask, cu, cfg)
    _assert_all_finite(res)
    assert res.keep_mask.sum() == 0
    if cfg.is_enabled:
        assert (res.is_weights == 0).all()
    assert float(res.metrics["rejected_token_fraction"]) == 1.0
    assert float(res.metrics["rejected_seq_fraction"]) == 1.0


@pytest.mark.parametrize("bound,veto,lr", [(20.0, 1e-10, -25.0), (5.0, 1e-4, -10.0)])
def test_veto_checks_unclamped_ratio(bound, veto, lr):
    # log r below log(veto) but above -safety_bound after clamping: the veto must still fire (spec convention 3)
    assert lr < math.log(veto) < -bound
    cfg = RolloutCorrectionConfig(is_level="token", veto_threshold=veto, safety_bound=bound)
    rollout = torch.full((5,), -1.0)
    train = rollout.clone()
    train[1] = rollout[1] + lr
    res = compute_rollout_correction(train, rollout, torch.ones(5), cu_seqlens_from_lengths([3, 2]), cfg)
    assert res.keep_mask.tolist() == [0, 0, 0, 1, 1]
    assert float(res.metrics["rollout_is_veto_fraction"]) == pytest.approx(0.5)
    _assert_all_finite(res)


def test_extreme_log_ratio_is_safety_bounded():
    cfg = RolloutCorrectionConfig(is_level="sequence", is_mode="clip", is_upper_bound=1e9, is_lower_bound=1e-9)
    rollout = torch.tensor([-1e4, 0.0, -1e4, 0.0])
    train = torch.tensor([0.0, 0.0, -1e4, -1e4])  # sequence ratios e^{1e4}, e^{-1e4}
    res = compute_rollout_correction(train, rollout, torch.ones(4), cu_seqlens_from_lengths([2, 2]), cfg)
    _assert_all_finite(res)
    assert res.is_weights.tolist() == pytest.approx([math.exp(20)] * 2 + [math.exp(-20)] * 2, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_low_precision_equals_upcast(dtype, cfg_name):
    cfg = CONFIGS[cfg_name]
    train, rollout, mask, cu = _batch((5, 7, 3, 1), seed=3)
    train_lp, rollout_lp = train.to(dtype), rollout.to(dtype)
    low = compute_rollout_correction(train_lp, rollout_lp, mask, cu, cfg)
    ref = compute_rollout_correction(train_lp.float(), rollout_lp.float(), mask, cu, cfg)
    assert low.keep_mask.dtype == torch.float32
    assert torch.equal(low.keep_mask, ref.keep_mask)
    if cfg.is_enabled:
        assert low.is_weights.dtype == torch.float32
        assert torch.equal(low.is_weights, ref.is_weights)
    assert set(low.metrics) == set(ref.metrics)
    for k in ref.metrics:
        assert float(low.metrics[k]) == float(ref.metrics[k]), k


def test_float64_input_gives_float32_weights():
    train, rollout, mask, cu = _batch()
    res = compute_rollout_correction(train.double(), rollout.double(), mask, cu, CONFIGS["sequence_clip"])
    ref = compute_rollout_correction(train, rollout, mask, cu, CONFIGS["sequence_clip"])
    assert res.is_weights.dtype == torch.float32
    assert torch.equal(res.is_weights, ref.is_weights)


def test_weights_carry_no_gradient():
    train, rollout, mask, cu = _batch()
    train.requires_grad_(True)
    for cfg in CONFIGS.values():
        res = compute_rollout_correction(train, rollout, mask, cu, cfg)
        assert not res.keep_mask.requires_grad
        if res.is_weights is not None:
            assert not res.is_weights.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# config type
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [None, {"use_tis": True}, "token", object()])
def test_config_must_be_config_object(bad):
    train, rollout, mask, cu = _batch()
    with pytest.raises(ValueError, match=r"config must be a RolloutCorrectionConfig.*from_dict"):
        compute_rollout_correction(train, rollout, mask, cu, bad)
