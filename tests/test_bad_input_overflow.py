"""Bad input, in ``compute_policy_loss``: no NaN or inf reaches the loss, a metric or a gradient.

* finite log-probs that overflow the PPO ratio (a rollout log-prob at SGLang's fp32 floor ``finfo.min`` = -3.4e38,
  or -1e4): the loss clamps the log-ratio to +-``safety_bound`` before ``exp`` (the engine's and verl's floor), so
  the loss and the gradient stay finite, and the tokens the floor touches are counted in ``pg_clipfrac``;
* non-finite values on a kept token (NaN/inf in ``log_probs``, ``old_log_probs``, ``rollout_log_probs`` in bypass
  PPO, ``advantages``): ``on_nonfinite='error'`` raises ``ValueError`` naming the tensor, the sample and the position;
  ``on_nonfinite='reject'`` rejects the token (zero loss, zero gradient) and counts it (``pg_nonfinite_tokens``).

Each test gives the input and the outcome a user now sees; everything runs the real code (no mocks).
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria
from tests.loss_inputs import all_finite as _all_finite, call_loss as _call, loss_host_reads, loss_inputs, \
    with_ as _with

FP32_FLOOR = torch.finfo(torch.float32).min  # -3.4028e38: SGLang clamps log-probs here
BOUND = RolloutCorrectionConfig().safety_bound  # 20.0

CONFIGS = {
    "standard": RolloutCorrectionConfig(mode="standard"),
    "standard_dual_clip": RolloutCorrectionConfig(mode="standard", eps_clip_c=3.0),
    "decoupled_token_is": RolloutCorrectionConfig(is_level="token"),
    "decoupled_rs": RolloutCorrectionConfig(is_level="token", rs=parse_rejection_criteria("token", 1e6)),
    "bypass_ppo": RolloutCorrectionConfig(mode="bypass"),
    "bypass_ppo_is": RolloutCorrectionConfig(mode="bypass", is_level="token"),
    "bypass_ppo_dual_clip": RolloutCorrectionConfig(mode="bypass", eps_clip_c=3.0),
    "bypass_reinforce": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="token"),
}
PPO = [n for n, c in CONFIGS.items() if c.loss_type == "ppo_clip"]
# the tensor that is pi_old in the PPO ratio, per mode
OLD_ARG = {"standard": "old_log_probs", "decoupled": "old_log_probs", "bypass": "rollout_log_probs"}

# sample 1 (tokens 3..7) position 2 = packed token 5
SAMPLE, POSITION, TOKEN = 1, 2, 5


def _inputs(seed=0, adv_sign=None):
    return loss_inputs([3, 5], seed=seed, adv_sign=adv_sign)


# ---------------------------------------------------------------------------------------------------------------
# finite values that overflow exp(): the +-safety_bound floor of the PPO log-ratio
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1e4, FP32_FLOOR], ids=["-1e4", "fp32_floor"])
@pytest.mark.parametrize("adv_sign", [1.0, -1.0], ids=["A>0", "A<0"])
@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n].mode == "bypass"])
def test_bypass_rollout_log_prob_at_the_fp32_floor_gives_a_finite_loss_and_gradient(name, adv_sign, value):
    """bypass PPO with a rollout log-prob of -3.4e38 (what SGLang returns) or -1e4 gave ``loss = inf``."""
    inputs = _inputs(adv_sign=adv_sign)
    inputs["rollout_log_probs"][TOKEN] = value
    loss, grad, metrics = _call(CONFIGS[name], inputs)
    _all_finite(loss, grad, metrics)
    if CONFIGS[name].loss_type == "ppo_clip":
        assert grad[TOKEN] == 0.0  # past the floor the ratio is a constant exp(+-20): no gradient through it
        assert float(metrics["pg_clipfrac"]) > 0  # the token the floor touched is counted
        assert float(metrics["ppo_kl"]) <= BOUND  # the metric is bounded by the same floor


@pytest.mark.parametrize("value", [-1e4, FP32_FLOOR], ids=["-1e4", "fp32_floor"])
@pytest.mark.parametrize("adv_sign", [1.0, -1.0], ids=["A>0", "A<0"])
@pytest.mark.parametrize("name", [n for n in PPO if CONFIGS[n].mode != "bypass"])
def test_recomputed_old_log_prob_that_overflows_gives_a_finite_loss_and_gradient(name, adv_sign, value):
    inputs = _inputs(adv_sign=adv_sign)
    inputs["old_log_probs"][TOKEN] = value
    loss, grad, metrics = _call(CONFIGS[name], inputs)
    _all_finite(loss, grad, metrics)
    assert grad[TOKEN] == 0.0


@pytest.mark.parametrize("value", [-1e4, FP32_FLOOR], ids=["-1e4", "fp32_floor"])
@pytest.mark.parametrize("name", PPO)
def test_current_log_prob_at_the_fp32_floor_gives_a_finite_loss_and_gradient(name, value):
    inputs = _inputs(adv_sign=-1.0)
    inputs["log_probs"][TOKEN] = value
    loss, grad, metrics = _call(CONFIGS[name], inputs)
    _all_finite(loss, grad, metrics)


def test_the_floor_counts_exactly_the_tokens_it_touches():
    """A > 0 and log rho << -20: PPO never clips this side, so before the floor pg_clipfrac did not count it; the
    floor counts it now (token_mean: clipped tokens / kept tokens)."""
    cfg = RolloutCorrectionConfig(mode="bypass", loss_agg="token_mean")
    inputs = _inputs(adv_sign=1.0)
    inputs["log_probs"] = inputs["rollout_log_probs"].clone()  # ratio 1 everywhere: nothing clipped by PPO
    _, _, base = _call(cfg, inputs)
    assert float(base["pg_clipfrac"]) == 0.0
    inputs["rollout_log_probs"][TOKEN] = FP32_FLOOR   # log rho = +3.4e38 > 20 -> clamped (and PPO-clipped: A > 0)
    inputs["rollout_log_probs"][1] = -1e-3            # fine
    inputs["log_probs"][6] = inputs["rollout_log_probs"][6] - 25.0  # log rho = -25 < -20, A > 0: only the floor
    loss, grad, metrics = _call(cfg, inputs)
    _all_finite(loss, grad, metrics)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(2 / 8)
    assert grad[6] == 0.0 and grad[TOKEN] == 0.0


def test_the_floor_changes_nothing_within_the_bound():
    """Exactness for ordinary inputs: log-ratios within +-safety_bound give exactly the unclamped PPO loss."""
    cfg = RolloutCorrectionConfig(mode="standard", loss_agg="token_mean")
    inputs = _inputs()
    inputs["log_probs"][2] = inputs["old_log_probs"][2] + 19.5  # large, but inside the bound
    loss, grad, _ = _call(cfg, inputs)
    lp = inputs["log_probs"].detach().clone().requires_grad_(True)
    rho = torch.exp(lp - inputs["old_log_probs"])
    adv = inputs["advantages"]
    ref = torch.maximum(-adv * rho, -adv * rho.clamp(0.8, 1.2)).sum() / 8
    ref.backward()
    assert float(loss.detach()) == float(ref.detach())
    torch.testing.assert_close(grad, lp.grad, rtol=0, atol=0)


def test_the_floor_follows_the_configured_safety_bound():
    cfg = RolloutCorrectionConfig(mode="bypass", loss_agg="token_mean", safety_bound=5.0, eps_clip=0.99,
                                  eps_clip_high=1e9)  # PPO clip out of the way: only the floor bounds rho
    inputs = _inputs(adv_sign=-1.0)
    inputs["log_probs"] = inputs["rollout_log_probs"].clone()
    inputs["log_probs"][TOKEN] = inputs["rollout_log_probs"][TOKEN] + 7.0  # log rho = 7 > 5
    loss, grad, metrics = _call(cfg, inputs)
    adv = inputs["advantages"]
    expected = (-adv).sum() - (-adv[TOKEN]) + (-adv[TOKEN]) * math.exp(5.0)
    assert float(loss.detach()) == pytest.approx(float(expected) / 8, rel=1e-6)
    assert grad[TOKEN] == 0.0 and float(metrics["pg_clipfrac"]) == pytest.approx(1 / 8)


# ---------------------------------------------------------------------------------------------------------------
# non-finite values, on_nonfinite='error' (default): ValueError naming the tensor, the sample and the position
# ---------------------------------------------------------------------------------------------------------------
def _error(cfg, inputs) -> str:
    with pytest.raises(ValueError) as info:
        _call(cfg, inputs)
    return str(info.value)


def _names_tensor_sample_position(msg, tensor):
    assert msg.startswith(f"{tensor} holds NaN/inf"), msg  # the argument of compute_policy_loss, not an inner name
    assert f"sample {SAMPLE}, position {POSITION}" in msg, msg


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("name", [n for n in PPO if CONFIGS[n].mode != "bypass"])
def test_nonfinite_old_log_probs_raise_naming_tensor_sample_and_position(name, value):
    inputs = _inputs()
    inputs["old_log_probs"][TOKEN] = value
    _names_tensor_sample_position(_error(CONFIGS[name], inputs), "old_log_probs")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n].mode == "bypass"])
def test_nonfinite_rollout_log_probs_in_bypass_raise_naming_tensor_sample_and_position(name, value):
    inputs = _inputs()
    inputs["rollout_log_probs"][TOKEN] = value
    _names_tensor_sample_position(_error(CONFIGS[name], inputs), "rollout_log_probs")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_nonfinite_current_log_probs_raise_naming_tensor_sample_and_position(name, value):
    """+inf (and NaN) current log-probs reached the loss and gradient in standard and decoupled modes."""
    inputs = _inputs()
    inputs["log_probs"][TOKEN] = value
    msg = _error(CONFIGS[name], inputs)
    _names_tensor_sample_position(msg, "log_probs")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_nonfinite_advantage_on_a_kept_token_raises_naming_tensor_sample_and_position(name, value):
    inputs = _inputs()
    inputs["advantages"][TOKEN] = value
    msg = _error(CONFIGS[name], inputs)
    _names_tensor_sample_position(msg, "advantages")
    assert msg.startswith("advantages holds NaN/inf"), msg


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nonfinite_values_on_a_masked_token_are_ignored(name):
    """Only tokens that reach the loss are checked: a NaN under loss_mask = 0 changes nothing and reaches no grad."""
    inputs = _inputs()
    ref_loss, ref_grad, _ = _call(CONFIGS[name], {**inputs, "loss_mask": torch.tensor([1., 1, 1, 1, 1, 0, 1, 1])})
    for key in ("log_probs", "old_log_probs", "rollout_log_probs", "advantages"):
        inputs[key] = inputs[key].clone()
        inputs[key][TOKEN] = math.nan
    inputs["loss_mask"] = torch.tensor([1., 1, 1, 1, 1, 0, 1, 1])
    loss, grad, metrics = _call(CONFIGS[name], inputs)
    _all_finite(loss, grad, metrics)
    assert float(loss) == float(ref_loss) and grad[TOKEN] == 0.0
    torch.testing.assert_close(grad, ref_grad)


# ---------------------------------------------------------------------------------------------------------------
# non-finite values, on_nonfinite='reject': the token is rejected (zero loss and gradient) and counted
# ---------------------------------------------------------------------------------------------------------------
REJECT = {n: _with(c, on_nonfinite="reject") for n, c in CONFIGS.items()}


def _rejected_like_masked(name, key, value):
    """The loss with ``key[TOKEN] = value`` under 'reject': finite, the token without gradient, other tokens with
    (the callers compare with the batch whose sequence holding TOKEN is masked: reject drops the whole sequence)."""
    cfg = _with(REJECT[name], loss_agg="token_mean")
    inputs = _inputs()
    inputs[key] = inputs[key].clone()
    inputs[key][TOKEN] = value
    loss, grad, metrics = _call(cfg, inputs)
    _all_finite(loss, grad, metrics)
    assert grad[TOKEN] == 0.0
    assert (grad != 0).sum() > 0
    return loss, grad, metrics


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "+inf"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reject_mode_rejects_and_counts_a_nonfinite_advantage(name, value):
    loss, grad, metrics = _rejected_like_masked(name, "advantages", value)
    assert float(metrics["pg_nonfinite_tokens"]) == 1.0
    masked = _inputs()
    masked["loss_mask"] = torch.tensor([1., 1, 1, 0, 0, 0, 0, 0])  # its whole sequence (tokens 3-7) leaves the loss
    ref_loss, ref_grad, _ = _call(_with(REJECT[name], loss_agg="token_mean"), masked)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "+inf"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reject_mode_rejects_nonfinite_current_log_probs(name, value):
    """The engine sees pi_theta only in bypass mode; in standard and decoupled modes the loss rejects it itself."""
    _, _, metrics = _rejected_like_masked(name, "log_probs", value)
    engine_counted = float(metrics.get("rollout_corr/nonfinite_token_fraction", torch.tensor(0.0))) > 0
    assert float(metrics["pg_nonfinite_tokens"]) == 1.0 or engine_counted


@pytest.mark.parametrize("value", [math.nan, -math.inf], ids=["nan", "-inf"])
@pytest.mark.parametrize("name", [n for n in PPO if CONFIGS[n].mode != "bypass"])
def test_reject_mode_rejects_nonfinite_old_log_probs(name, value):
    """Standard mode has no engine run: before, a NaN pi_old reached the loss with 'reject'."""
    _, _, metrics = _rejected_like_masked(name, "old_log_probs", value)
    engine_counted = float(metrics.get("rollout_corr/nonfinite_token_fraction", torch.tensor(0.0))) > 0
    assert float(metrics["pg_nonfinite_tokens"]) == 1.0 or engine_counted


def test_reject_mode_counts_nothing_on_clean_input_and_error_mode_has_no_such_metric():
    _, _, metrics = _call(REJECT["standard"], _inputs())
    assert float(metrics["pg_nonfinite_tokens"]) == 0.0
    _, _, metrics = _call(CONFIGS["standard"], _inputs())
    assert "pg_nonfinite_tokens" not in metrics  # with 'error' such a token raises instead


def test_reject_mode_all_nonfinite_gives_a_finite_zero_loss():
    inputs = _inputs()
    inputs["advantages"] = torch.full((8,), math.nan)
    loss, grad, metrics = _call(REJECT["decoupled_token_is"], inputs)
    _all_finite(loss, grad, metrics)
    assert float(loss) == 0.0 and (grad == 0).all() and float(metrics["pg_nonfinite_tokens"]) == 8.0


# ---------------------------------------------------------------------------------------------------------------
# the same through the Megatron loss (one shared DeferredChecks per micro-batch) and on the hot path
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bypass_ppo", "bypass_ppo_is", "bypass_reinforce"])
def test_megatron_loss_with_sglang_fp32_floor_rollout_log_probs_is_finite(name):
    """What was seen through ``slime-rc train``: real SGLang output at ``finfo.min`` gave loss = nan from step 0."""
    from slime_rc.correction.reducer import LocalReducer
    from slime_rc.megatron.loss import policy_loss
    from tests.test_losses import _batch, _micro_batch
    b = _batch(3)
    b["rollout"][[2, 9, 15]] = FP32_FLOOR
    b["mask"][[2, 9, 15]] = 1.0
    mb, logits = _micro_batch(b, 0, 5)
    lp = logits.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, mb, CONFIGS[name], reducer=LocalReducer())
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics


@pytest.mark.parametrize("mode", ["error", "reject"])
def test_the_floor_and_the_reject_path_make_no_host_read_of_their_own(mode):
    cfg = _with(CONFIGS["bypass_ppo_is"], on_nonfinite=mode)
    inputs = _inputs()
    inputs["rollout_log_probs"][TOKEN] = FP32_FLOOR
    loss, events, own = loss_host_reads(cfg, inputs)
    assert not own, own
    assert len(events) == (1 if mode == "error" else 0)
    assert torch.isfinite(loss)
