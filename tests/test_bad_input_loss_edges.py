"""Bad input, in ``compute_policy_loss``: the edges the ratio floor does not cover.

* REINFORCE with a current log-prob at SGLang's fp32 floor (``finfo.min`` = -3.4e38): ``-w * log pi_theta * A``
  overflowed to ``loss = inf`` for |A| > 1.  Now the value of ``log pi_theta`` in that term is floored at
  ``LOG_PROB_FLOOR`` (-1e4), with the gradient unchanged (it never depended on the value), counted in ``pg_clipfrac``.
* Absurd but finite advantages (1e30, 3e38) whose loss term or gradient would leave float32: an error naming
  ``advantages``, the sample and the position (``on_nonfinite='error'``), or the sequence rejected and the token
  counted in ``pg_nonfinite_tokens`` (``'reject'``).
* ``on_nonfinite='reject'`` in the loss drops the whole sequence of a non-finite (or overflowing) value, as the
  engine does, not the token alone; the other sequences' loss and gradient are unchanged.

Everything runs the real code (no mocks).
"""

from __future__ import annotations

import math

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, cu_seqlens_from_lengths, parse_rejection_criteria
from slime_rc.losses import ADVANTAGE_OVERFLOW_LIMIT, LOG_PROB_FLOOR
from tests.loss_inputs import all_finite as _all_finite, call_loss as _call, loss_host_reads, loss_inputs, \
    with_ as _with

FP32_FLOOR = torch.finfo(torch.float32).min  # -3.4028e38: SGLang clamps log-probs here

CONFIGS = {
    "standard": RolloutCorrectionConfig(mode="standard"),
    "standard_dual_clip": RolloutCorrectionConfig(mode="standard", eps_clip_c=3.0),
    "decoupled_token_is": RolloutCorrectionConfig(is_level="token"),
    "decoupled_seq_is": RolloutCorrectionConfig(is_level="sequence", is_upper_bound=5.0),
    "decoupled_rs": RolloutCorrectionConfig(is_level="token", rs=parse_rejection_criteria("token", 1e6)),
    "bypass_ppo": RolloutCorrectionConfig(mode="bypass"),
    "bypass_ppo_is": RolloutCorrectionConfig(mode="bypass", is_level="token"),
    "bypass_reinforce": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="token"),
    "bypass_reinforce_seq": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence",
                                                    is_upper_bound=5.0),
    "bypass_reinforce_no_is": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce",
                                                      get_mismatch_metrics=True),
}
REINFORCE = [n for n, c in CONFIGS.items() if c.loss_type == "reinforce"]
MODES = ["error", "reject"]

# three samples: 0 = tokens 0..2, 1 = tokens 3..7, 2 = tokens 8..11; the bad value at sample 1, position 2
LENGTHS = [3, 5, 4]
SAMPLE, POSITION, TOKEN = 1, 2, 5
SAMPLE_TOKENS = slice(3, 8)


def _inputs(seed=0, adv_sign=None):
    return loss_inputs(LENGTHS, seed=seed, adv_sign=adv_sign)


def _error(cfg, inputs) -> str:
    with pytest.raises(ValueError) as info:
        _call(cfg, inputs)
    return str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# REINFORCE with log pi_theta at the fp32 floor
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("adv", [3.0, -3.0, 1e3], ids=["A=3", "A=-3", "A=1e3"])
@pytest.mark.parametrize("name", REINFORCE)
def test_reinforce_current_log_prob_at_the_fp32_floor_gives_a_finite_loss_and_gradient(name, adv, mode):
    """``-w * log pi_theta * A`` with log pi_theta = -3.4e38 and |A| > 1 gave ``loss = inf``."""
    inputs = _inputs()
    inputs["log_probs"][TOKEN] = FP32_FLOOR
    inputs["advantages"][TOKEN] = adv
    cfg = _with(CONFIGS[name], on_nonfinite=mode, loss_agg="token_mean")
    loss, grad, metrics = _call(cfg, inputs)
    _all_finite(loss, grad, metrics)
    # the floor counts the token it touches (pg_clipfrac is 0 otherwise in REINFORCE)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(1 / 12)
    # the gradient is the REINFORCE gradient, -w * A / D, whatever the floor did to the value
    w = 1.0
    if CONFIGS[name].is_weights_applied:  # the engine's IS weight of the token (e^-20 here: the ratio is clamped)
        from slime_rc import compute_rollout_correction
        corr = compute_rollout_correction(inputs["log_probs"], inputs["rollout_log_probs"], inputs["loss_mask"],
                                          inputs["cu_seqlens"], cfg)
        w = float(corr.is_weights[TOKEN])
    assert float(grad[TOKEN]) == pytest.approx(-w * adv / 12, rel=1e-6)
    if mode == "reject":
        assert float(metrics["pg_nonfinite_tokens"]) == 0.0  # finite input: floored, not rejected


def test_reinforce_floor_sets_the_value_to_the_floor_and_changes_nothing_above_it():
    cfg = _with(CONFIGS["bypass_reinforce_no_is"], loss_agg="token_mean")
    inputs = _inputs()
    base_loss, base_grad, base_metrics = _call(cfg, inputs)
    assert float(base_metrics["pg_clipfrac"]) == 0.0
    inputs["log_probs"][TOKEN] = FP32_FLOOR
    loss, grad, metrics = _call(cfg, inputs)
    adv = inputs["advantages"]
    lp = inputs["log_probs"].clone()
    lp[TOKEN] = LOG_PROB_FLOOR
    assert float(loss) == pytest.approx(float(-(lp * adv).sum() / 12), rel=1e-6)
    torch.testing.assert_close(grad, base_grad, rtol=0, atol=0)  # REINFORCE's gradient does not see the value
    inputs["log_probs"][TOKEN] = LOG_PROB_FLOOR  # exactly at the floor: untouched, not counted
    _, _, metrics = _call(cfg, inputs)
    assert float(metrics["pg_clipfrac"]) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# normal inputs: bit-identical to the formula (the floor and the overflow check change nothing there)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", ["token_mean", "sample_mean"])
@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
def test_normal_inputs_give_exactly_the_formula(loss_type, agg, mode):
    cfg = RolloutCorrectionConfig(mode="bypass", loss_type=loss_type, loss_agg=agg, on_nonfinite=mode)
    inputs = _inputs(seed=3)
    inputs["log_probs"][2] = -80.0  # far below any sampled token, still a real fp32 log-prob: no floor
    inputs["advantages"][7] = 1e6   # large, but nowhere near overflowing
    loss, grad, metrics = _call(cfg, inputs)
    lp = inputs["log_probs"].detach().clone().requires_grad_(True)
    adv, old = inputs["advantages"], inputs["rollout_log_probs"]
    if loss_type == "reinforce":
        per = -(lp * adv) * 1.0
    else:
        rho = torch.exp((lp - old).clamp(-20.0, 20.0))
        per = torch.maximum(-adv * rho, -adv * rho.clamp(0.8, 1.2))
    if agg == "token_mean":
        coef = torch.full((12,), 1 / 12.0)
    else:
        coef = torch.cat([torch.full((n,), 1 / n / 3) for n in LENGTHS]).float()
    ref = (per * coef).sum()
    ref.backward()
    assert float(loss) == float(ref.detach())
    torch.testing.assert_close(grad, lp.grad, rtol=0, atol=0)
    if mode == "reject":
        assert float(metrics["pg_nonfinite_tokens"]) == 0.0


# ---------------------------------------------------------------------------------------------------------------
# advantages whose loss term overflows float32
# ---------------------------------------------------------------------------------------------------------------
ABSURD = [1e30, -1e30, 3e38, -3e38]


def _absurd_inputs(name, value):
    inputs = _inputs()
    inputs["advantages"][TOKEN] = value
    if CONFIGS[name].loss_type == "ppo_clip":  # a ratio of e^20 times 1e30 leaves float32
        inputs["log_probs"][TOKEN] = inputs["old_log_probs"][TOKEN] + 25.0
        inputs["rollout_log_probs"][TOKEN] = inputs["log_probs"][TOKEN] - 25.0
    return inputs


def test_absurd_advantages_overflowed_before():
    """The failing cases, on the formula the loss computed before: every one of them is inf or NaN in float32."""
    a = torch.tensor(ABSURD)
    assert not torch.isfinite(-(torch.tensor(FP32_FLOOR) * torch.tensor(3.0)))  # REINFORCE at the fp32 floor
    assert not torch.isfinite(-a * math.exp(20.0)).any()                        # PPO past the ratio floor
    assert not torch.isfinite(torch.tensor(3e38) * 2.0)                          # a weight of 2 times 3e38


@pytest.mark.parametrize("value", ABSURD, ids=lambda v: f"A={v:g}")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_absurd_advantage_raises_naming_advantages_sample_and_position(name, value):
    inputs = _absurd_inputs(name, value)
    if value in (3e38, -3e38) or CONFIGS[name].loss_type == "ppo_clip":
        msg = _error(CONFIGS[name], inputs)
        assert msg.startswith("advantages holds a value whose loss term overflows float32"), msg
        assert f"sample {SAMPLE}, position {POSITION} (packed token {TOKEN}) = {value:g}" in msg, msg
        assert "on_nonfinite='reject'" in msg
    else:  # REINFORCE with |log pi| < 1e4 and w <= 2: 1e30 is absurd but its loss term stays finite
        loss, grad, metrics = _call(CONFIGS[name], inputs)
        _all_finite(loss, grad, metrics)


@pytest.mark.parametrize("value", ABSURD, ids=lambda v: f"A={v:g}")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_absurd_advantage_in_reject_mode_rejects_its_sequence_and_counts_it(name, value):
    cfg = _with(CONFIGS[name], on_nonfinite="reject", loss_agg="token_mean")
    inputs = _absurd_inputs(name, value)
    loss, grad, metrics = _call(cfg, inputs)
    _all_finite(loss, grad, metrics)
    overflows = value in (3e38, -3e38) or cfg.loss_type == "ppo_clip"
    assert float(metrics["pg_nonfinite_tokens"]) == (1.0 if overflows else 0.0)
    if overflows:
        assert (grad[SAMPLE_TOKENS] == 0).all()
        assert (grad[:3] != 0).any() and (grad[8:] != 0).any()


def test_float64_advantage_beyond_float32_is_caught():
    """A float64 advantage of 1e39 is finite, but not in float32 (the loss's precision): it overflowed silently."""
    inputs = _inputs()
    inputs["advantages"] = inputs["advantages"].double()
    inputs["advantages"][TOKEN] = 1e39
    msg = _error(CONFIGS["bypass_reinforce"], inputs)
    assert msg.startswith("advantages holds a value whose loss term overflows float32"), msg


def test_the_overflow_limit_is_where_it_is_documented():
    assert ADVANTAGE_OVERFLOW_LIMIT == 1e36 and LOG_PROB_FLOOR == -1e4
    cfg = _with(CONFIGS["bypass_reinforce_no_is"], loss_agg="token_mean")
    inputs = _inputs()
    inputs["log_probs"][TOKEN] = -10.0
    inputs["advantages"][TOKEN] = 0.9e35  # |A| x |log pi| = 9e35: under the limit
    loss, grad, metrics = _call(cfg, inputs)
    _all_finite(loss, grad, metrics)
    inputs["advantages"][TOKEN] = 1.1e35  # 1.1e36: over
    assert _error(cfg, inputs).startswith("advantages holds a value whose loss term overflows float32")


# gradients: finite for every case, both modes, PPO and REINFORCE, bypass and decoupled
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["lp_fp32_floor", "lp_-1e4", "adv_1e30", "adv_3e38", "rollout_fp32_floor"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_edge_gives_a_finite_gradient_or_a_named_error(name, case, mode):
    cfg = _with(CONFIGS[name], on_nonfinite=mode)
    inputs = _inputs(adv_sign=-1.0)
    if case == "lp_fp32_floor":
        inputs["log_probs"][TOKEN] = FP32_FLOOR
    elif case == "lp_-1e4":
        inputs["log_probs"][TOKEN] = -1e4
    elif case == "rollout_fp32_floor":
        inputs["rollout_log_probs"][TOKEN] = FP32_FLOOR
    else:
        inputs = _absurd_inputs(name, -float(case.rsplit("_", 1)[1]))
    try:
        loss, grad, metrics = _call(cfg, inputs)
    except ValueError as e:
        assert mode == "error" and str(e).startswith("advantages holds a value whose loss term overflows"), e
        return
    _all_finite(loss, grad, metrics)


# ---------------------------------------------------------------------------------------------------------------
# reject mode: the whole sequence, as in the engine
# ---------------------------------------------------------------------------------------------------------------
def _without_sample_1(inputs):
    mask = inputs["loss_mask"].clone()
    mask[SAMPLE_TOKENS] = 0.0
    return {**inputs, "loss_mask": mask}


def _reads(name: str, key: str) -> bool:
    """Whether the loss of config ``name`` reads ``key`` at all (bypass ignores pi_old; standard mode without
    correction or metrics never reads the rollout log-probs): only then can a bad value there reject anything."""
    cfg = CONFIGS[name]
    if key == "old_log_probs":
        return cfg.mode != "bypass"
    if key == "rollout_log_probs":
        return cfg.corrects or cfg.get_mismatch_metrics or cfg.mode == "bypass"
    return True


@pytest.mark.parametrize("agg", ["token_mean", "sample_mean"])
@pytest.mark.parametrize("name,key,value", [
    (name, key, value) for name in CONFIGS
    for key, value in (("advantages", math.nan), ("advantages", math.inf), ("log_probs", math.nan),
                       ("old_log_probs", -math.inf), ("rollout_log_probs", math.nan))
    if _reads(name, key)])
def test_reject_mode_drops_the_whole_sequence_and_leaves_the_others_unchanged(name, key, value, agg):
    cfg = _with(CONFIGS[name], on_nonfinite="reject", loss_agg=agg)
    inputs = _inputs()
    bad = {**inputs, key: inputs[key].clone()}
    bad[key][TOKEN] = value
    loss, grad, metrics = _call(cfg, bad)
    _all_finite(loss, grad, metrics)
    ref_loss, ref_grad, _ = _call(cfg, _without_sample_1(inputs))
    assert (grad[SAMPLE_TOKENS] == 0).all()  # every token of the sequence, not only token 5
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)
    counted = float(metrics.get("pg_nonfinite_tokens", 0.0))
    engine = float(metrics.get("rollout_corr/nonfinite_seq_fraction", torch.tensor(0.0)))
    assert counted == 1.0 or engine > 0


def test_reject_mode_with_a_precomputed_normalizer_drops_the_sequence_too():
    from slime_rc import loss_normalizer
    cfg = _with(CONFIGS["decoupled_token_is"], on_nonfinite="reject", loss_agg="token_mean")
    inputs = _inputs()
    norm = loss_normalizer(inputs["loss_mask"], inputs["cu_seqlens"])
    bad = {**inputs, "advantages": inputs["advantages"].clone()}
    bad["advantages"][TOKEN] = math.nan
    loss, grad, metrics = _call(cfg, bad, normalizer=norm)
    _all_finite(loss, grad, metrics)
    assert (grad[SAMPLE_TOKENS] == 0).all() and (grad[:3] != 0).all() and (grad[8:] != 0).all()
    assert float(metrics["pg_nonfinite_tokens"]) == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_the_new_checks_make_no_host_read_of_their_own(mode):
    cfg = _with(CONFIGS["bypass_reinforce"], on_nonfinite=mode)
    inputs = _inputs()
    inputs["log_probs"][TOKEN] = FP32_FLOOR
    if mode == "reject":
        inputs["advantages"][1] = 3e38
    loss, events, own = loss_host_reads(cfg, inputs)
    assert not own, own
    assert len(events) == (1 if mode == "error" else 0)
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------------------------
# under CP the sequence's tokens are split over ranks: the rank without the bad token drops its part too
# ---------------------------------------------------------------------------------------------------------------
def _cp2_worker(rank, world, name, agg):
    import torch.distributed as dist
    from slime_rc.correction.reducer import DistributedReducer
    cfg = _with(CONFIGS[name], on_nonfinite="reject", loss_agg=agg)
    inputs = _inputs()
    inputs["advantages"][TOKEN] = math.nan  # sample 1's token 5: in rank 0's half of the sample (tokens 3, 4, 5)
    cu = inputs["cu_seqlens"]
    # rank 0 holds the first ceil(n/2) tokens of each sample, rank 1 the rest
    idx, lengths = [], []
    for i in range(len(LENGTHS)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        mid = lo + (hi - lo + 1) // 2
        part = list(range(lo, mid)) if rank == 0 else list(range(mid, hi))
        idx += part
        lengths.append(len(part))
    idx = torch.tensor(idx, dtype=torch.int64)
    local = {k: (v[idx] if k != "cu_seqlens" else cu_seqlens_from_lengths(lengths)) for k, v in inputs.items()}
    reducer = DistributedReducer(sequence_group=dist.group.WORLD)
    loss, grad, metrics = _call(cfg, local, reducer=reducer)
    return {"loss": loss, "grad": grad, "idx": idx, "nonfinite": metrics["pg_nonfinite_tokens"]}


@pytest.mark.parametrize("name,agg", [("decoupled_token_is", "sample_mean"), ("standard", "token_mean")])
def test_reject_mode_under_cp2_drops_the_sequence_on_every_rank(name, agg):
    from tests.dist_utils import run_distributed
    results = run_distributed(_cp2_worker, 2, args=(name, agg))
    cfg = _with(CONFIGS[name], on_nonfinite="reject", loss_agg=agg)
    ref_loss, ref_grad, _ = _call(cfg, _without_sample_1(_inputs()))
    assert sum(float(r["loss"]) for r in results) == pytest.approx(float(ref_loss), rel=1e-6)
    grad = torch.zeros(12)
    for r in results:
        grad[r["idx"]] = r["grad"]
    assert (grad[SAMPLE_TOKENS] == 0).all()  # rank 1's tokens 6, 7 of sample 1 too
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-9)
    assert [float(r["nonfinite"]) for r in results] == [1.0, 0.0]  # counted once, where it is
