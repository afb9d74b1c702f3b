"""``slime_rc.slime.policy_loss_function`` (slime's custom loss) against slime's own ``policy_loss_function``,
written here from slime's source (THUDM/slime 624b824a8, ``backends/megatron_utils/loss.py``,
``utils/ppo_utils.py``, ``cp_utils.get_sum_of_sample_mean``) one sample at a time in float64:

* correction off (GRPO with the KL loss of every KL type, ``use_unbiased_kl``, the entropy term, dual clip, bypass
  PPO): loss, gradient of the logits and slime's log keys equal to 1e-6, per-sample and per-token loss;
* token TIS in decoupled mode: equal to slime's built-in ``vanilla_tis_function`` path;
* every mode and option of ``tests/test_losses.py``'s configs: equal to the same reference with the IS weights and
  keep masks of the per-sequence reference (``slime_rc.testing.reference``) put where slime puts a TIS function's
  (weights on the PPO term, masks on every numerator).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest
import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.testing.reference import reference_correction
from tests.checks import raises_mentioning
from tests.test_losses import CONFIGS

# (prompt, response): sample 3's mask is all zero, samples 0 and 1 share a rollout (one denominator)
SAMPLES = [(4, 9), (6, 3), (3, 12), (5, 7), (2, 1), (3, 6)]
ROLLOUT_IDS = [0, 0, 1, 2, 3, 4]
ADVANTAGES = [1.0, -0.7, 0.6, 0.3, -1.1, 0.9]
V = 11
PAD = 3  # slime pads the packed stream: rows past the samples get no gradient


def slime_args(**kw) -> argparse.Namespace:
    """slime's args as its parser leaves them (defaults of slime 624b824a8) for a GRPO run with the custom loss."""
    a = dict(loss_type="custom_loss", custom_loss_function_path="slime_rc.slime.policy_loss_function",
             advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, entropy_coef=0.0,
             use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", use_unbiased_kl=False,
             calculate_per_token_loss=False, rollout_temperature=1.0, rollout_top_p=1.0, allgather_cp=False,
             use_rollout_logprobs=False, get_mismatch_metrics=False, use_tis=False, tis_clip=2.0, tis_clip_low=0.0,
             custom_tis_function_path=None, custom_config_path=None, use_opsm=False,
             custom_pg_loss_reducer_function_path=None)
    a.update(kw)
    return argparse.Namespace(**a)


def make_batch(seed: int = 0, temperature: float = 1.0, recompute: bool = True):
    g = torch.Generator().manual_seed(seed)
    totals = [p + r for p, r in SAMPLES]
    tokens = [torch.randint(0, V, (t,), generator=g) for t in totals]
    logits = torch.randn(1, sum(totals) + PAD, V, generator=g) * 1.5
    lsm = (logits[0] / temperature).log_softmax(-1)
    cur, off = [], 0
    for (p, r), tok in zip(SAMPLES, tokens):
        cur.append(lsm[torch.arange(off + p - 1, off + p - 1 + r), tok[p:]])
        off += p + r
    old = [c + 0.15 * torch.randn(c.shape, generator=g) for c in cur]
    rollout = [o + 0.3 * torch.randn(o.shape, generator=g) for o in old]
    masks = [torch.ones(r, dtype=torch.int) for _, r in SAMPLES]
    masks[2][4:7] = 0
    masks[3][:] = 0
    masks[5][0] = 0
    sums = {}
    for rid, m in zip(ROLLOUT_IDS, masks):
        sums[rid] = sums.get(rid, 0) + int(m.sum())
    batch = dict(unconcat_tokens=tokens, total_lengths=totals, response_lengths=[r for _, r in SAMPLES],
                 loss_masks=masks, advantages=[torch.full((r,), a) for (_, r), a in zip(SAMPLES, ADVANTAGES)],
                 rollout_log_probs=rollout, ref_log_probs=[c + 0.2 * torch.randn(c.shape, generator=g) for c in cur],
                 rollout_mask_sums=torch.tensor([float(sums[rid]) for rid in ROLLOUT_IDS]))
    if recompute:
        batch["log_probs"] = old
    return batch, logits


def slime_reference(args, batch, logits, weights=None, keep=None, reject_from_denominator=False):
    """slime's ``policy_loss_function`` (per-token PPO, TIS with ``use_tis``, entropy, KL loss, slime's reducer)
    for one process, float64.  ``weights`` / ``keep``: per-sample IS weights and keep masks applied as slime applies
    a TIS function's (``weights`` replace the PPO term's ratio-based weight; ``keep`` zeroes numerators); with
    ``reject_from_denominator`` a sample's rejected tokens also leave its denominator (slime-rc's default)."""
    z = logits[0].double() / args.rollout_temperature
    logp = z.log_softmax(-1)
    ent_all = -(logp.exp() * logp).sum(-1)
    totals = {k: torch.zeros((), dtype=torch.float64) for k in
              ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss", "ois", "train_rollout_logprob_abs_diff")}
    off = 0
    per_token = args.calculate_per_token_loss
    for i, (total, resp) in enumerate(zip(batch["total_lengths"], batch["response_lengths"])):
        p = total - resp
        lp = logp[torch.arange(off + p - 1, off + total - 1), batch["unconcat_tokens"][i][p:total]]
        ent = ent_all[off + p - 1:off + total - 1]
        off += total
        rollout = batch["rollout_log_probs"][i].double()
        old = rollout if args.use_rollout_logprobs else batch.get("log_probs", [lp.detach()] * 99)[i].double()
        adv = batch["advantages"][i].double()
        ppo_kl = old - lp
        ratio = (-ppo_kl).exp()
        pg1, pg2 = -ratio * adv, -ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high) * adv
        pg = torch.maximum(pg1, pg2)
        clipfrac = (pg2 > pg1).double()
        if args.eps_clip_c is not None:
            pg = torch.where(adv < 0, torch.minimum(-args.eps_clip_c * adv, pg), pg)
        if args.use_tis:
            train = batch.get("log_probs", [lp.detach()] * 99)[i].double()
            pg = pg * (train - rollout).exp().clamp(min=args.tis_clip_low, max=args.tis_clip)
        if weights is not None:
            pg = pg * weights[i].double()
        mask0 = batch["loss_masks"][i].double()
        mask = mask0 if keep is None else mask0 * keep[i].double()
        denom = float(batch["rollout_mask_sums"][i])
        if reject_from_denominator:
            denom -= float((mask0 - mask).sum())

        def red(x, m=mask, d=denom):
            return (x * m).sum() if per_token else (x * m).sum() / max(d, 1.0)
        totals["pg_loss"] = totals["pg_loss"] + red(pg)
        totals["pg_clipfrac"] += red(clipfrac)
        totals["ppo_kl"] += red(ppo_kl.detach())
        totals["entropy_loss"] = totals["entropy_loss"] + red(ent)
        compared = lp.detach() if args.use_rollout_logprobs else old
        totals["train_rollout_logprob_abs_diff"] += red((compared - rollout).abs())
        totals["ois"] += red(ratio.detach(), mask0, float(batch["rollout_mask_sums"][i]))
        if args.use_kl_loss:
            d = lp - batch["ref_log_probs"][i].double()
            kl = {"k1": d, "k2": d ** 2 / 2}.get(args.kl_loss_type, (-d).exp() - 1 + d)
            if args.use_unbiased_kl:
                kl = (lp - old).exp() * kl
            if args.kl_loss_type == "low_var_kl":
                kl = kl.clamp(-10, 10)
            totals["kl_loss"] = totals["kl_loss"] + red(kl)
    loss = totals["pg_loss"] - args.entropy_coef * totals["entropy_loss"]
    if args.use_kl_loss:
        loss = loss + args.kl_loss_coef * totals["kl_loss"]
    return loss, totals


def run_both(args, batch, logits, **ref_kw):
    from slime_rc.slime import policy_loss_function

    a = logits.clone().requires_grad_(True)
    loss, log = policy_loss_function(args, batch, a, None)
    loss.backward()
    b = logits.clone().requires_grad_(True)
    ref_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "rollout_correction_config"})
    ref_loss, ref_log = slime_reference(ref_args, batch, b, **ref_kw)
    ref_loss.backward()
    return (loss, a.grad, log), (ref_loss, b.grad, ref_log)


def assert_close(x, y, what, tol=1e-6):
    x, y = float(x), float(y)
    assert abs(x - y) <= tol * max(1.0, abs(y)), f"{what}: {x} vs slime's {y} (|diff| {abs(x - y):.3e})"


def check(ours, ref, keys, tol=1e-6):
    """Loss, gradient of the logits (none on the stream padding) and log ``keys`` within ``tol`` (relative above
    1)."""
    (loss, grad, log), (ref_loss, ref_grad, ref_log) = ours, ref
    assert_close(loss, ref_loss, "loss", tol)
    diff = float((grad.double() - ref_grad).abs().max())
    assert diff <= tol, f"gradient differs by {diff:.3e}"
    assert float(grad[0, -PAD:].abs().max()) == 0.0
    for k in keys:
        assert_close(log[k], ref_log[k], k, tol)
    return diff


SLIME_KEYS = ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "train_rollout_logprob_abs_diff")


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("kl", ["low_var_kl", "k1", "k2", "k3", "k3_unbiased", "none"])
def test_correction_off_equals_slime_policy_loss(kl, per_token):
    batch, logits = make_batch(0)
    kw = dict(entropy_coef=0.01, calculate_per_token_loss=per_token)
    if kl != "none":
        kw.update(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type=kl.replace("_unbiased", ""),
                  use_unbiased_kl=kl.endswith("unbiased"))
    args = slime_args(**kw)
    ours, ref = run_both(args, batch, logits)
    check(ours, ref, SLIME_KEYS + (("kl_loss",) if kl != "none" else ()))
    assert args.rollout_correction_config.mode == "standard"
    assert "ois" not in ours[2] and not any(k.startswith("rollout_corr/") for k in ours[2])


@pytest.mark.parametrize("variant", ["dual_clip", "bypass_ppo", "no_recompute", "temperature"])
def test_correction_off_variants_equal_slime(variant):
    batch, logits = make_batch(1, temperature=0.7 if variant == "temperature" else 1.0,
                               recompute=variant != "no_recompute")
    kw = dict(entropy_coef=0.02, use_kl_loss=True, kl_loss_coef=0.1)
    kw.update({"dual_clip": dict(eps_clip_c=1.5), "bypass_ppo": dict(use_rollout_logprobs=True),
               "no_recompute": {}, "temperature": dict(rollout_temperature=0.7)}[variant])
    args = slime_args(**kw)
    ours, ref = run_both(args, batch, logits)
    # slime's pg_clipfrac does not count dual-clipped tokens; slime-rc's does
    check(ours, ref, [k for k in SLIME_KEYS if not (variant == "dual_clip" and k == "pg_clipfrac")] + ["kl_loss"])


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("clip", [2.0, 1.3])
def test_decoupled_token_tis_equals_slime_builtin_tis(clip, per_token):
    batch, logits = make_batch(2)
    args = slime_args(use_tis=True, tis_clip=clip, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                      calculate_per_token_loss=per_token)
    ours, ref = run_both(args, batch, logits)
    check(ours, ref, SLIME_KEYS + ("kl_loss", "ois"))
    config = args.rollout_correction_config
    assert (config.mode, config.is_level, config.is_upper_bound) == ("decoupled", "token", clip)
    assert any(k.startswith("rollout_corr/") for k in ours[2])


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_slime_tis_clip_low_clamps_from_below_as_slime_does(per_token):
    """slime's built-in TIS clamps to [tis_clip_low, tis_clip]: slime's own flags alone give slime's weights (a lower
    bound without a mode means clip), and a low bound that bites changes the loss (the check could fail)."""
    batch, logits = make_batch(2)
    args = slime_args(use_tis=True, tis_clip=2.0, tis_clip_low=0.95, calculate_per_token_loss=per_token)
    ours, ref = run_both(args, batch, logits)
    check(ours, ref, SLIME_KEYS + ("ois",))
    config = args.rollout_correction_config
    assert (config.is_mode, config.is_lower_bound, config.is_upper_bound) == ("clip", 0.95, 2.0)
    truncated, _ = run_both(slime_args(use_tis=True, tis_clip=2.0, calculate_per_token_loss=per_token), batch, logits)
    assert abs(float(truncated[0]) - float(ours[0])) > 1e-6  # the lower clamp bites on this batch


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("name", sorted(n for n, c in CONFIGS.items() if c.loss_type != "reinforce"))
def test_every_mode_equals_slime_with_the_reference_correction(name, per_token):
    config = replace(CONFIGS[name], loss_agg="token_mean" if per_token else "sample_mean")
    bypass = config.mode == "bypass"
    batch, logits = make_batch(3)
    args = slime_args(rollout_correction_config=config, use_rollout_logprobs=bypass, calculate_per_token_loss=per_token,
                      entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05, eps_clip=config.eps_clip,
                      eps_clip_high=config.eps_clip_high or config.eps_clip, eps_clip_c=config.eps_clip_c)
    cur = []
    lsm = logits[0].log_softmax(-1)
    off = 0
    for (p, r), tok in zip(SAMPLES, batch["unconcat_tokens"]):
        cur.append(lsm[torch.arange(off + p - 1, off + p - 1 + r), tok[p:]])
        off += p + r
    train = cur if bypass else batch["log_probs"]
    weights, keep, ref_metrics = reference_correction(train, batch["rollout_log_probs"], batch["loss_masks"], config)
    if weights is None or not config.is_weights_applied:
        weights = None
    ours, ref = run_both(args, batch, logits, weights=weights, keep=keep,
                         reject_from_denominator=not config.rejected_in_denominator and not per_token)
    # float32 engine weights (sequence IS: exp of a sum) against float64: 1e-5
    check(ours, ref, ("pg_loss", "ppo_kl", "entropy_loss", "kl_loss", "train_rollout_logprob_abs_diff")
          + (("pg_clipfrac",) if config.eps_clip_c is None else ()), tol=1e-5)
    # the engine's metrics in slime's step space: one process, one micro-batch -> value * samples (tokens)
    n = (sum(max(float(m.sum()), 1.0) for m in batch["loss_masks"]) if per_token else len(SAMPLES))
    for key in ("rollout_is_mean", "rollout_rs_masked_fraction", "kl", "rejected_token_fraction"):
        if "rollout_corr/" + key in ours[2] and key in ref_metrics:
            assert float(ours[2]["rollout_corr/" + key]) / n == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("name", sorted(n for n, c in CONFIGS.items() if c.loss_type == "reinforce"))
def test_bypass_reinforce_equals_its_reference(name, per_token):
    """bypass + REINFORCE + IS (what slime's TIS hook cannot reach: slime refuses --use-rollout-logprobs with
    --use-tis): ``-w log pi A`` over kept tokens, slime's denominators, entropy and KL loss as slime has them."""
    config = replace(CONFIGS[name], loss_agg="token_mean" if per_token else "sample_mean")
    batch, logits = make_batch(4)
    args = slime_args(rollout_correction_config=config, use_rollout_logprobs=True, calculate_per_token_loss=per_token,
                      entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05)
    from slime_rc.slime import policy_loss_function

    a = logits.clone().requires_grad_(True)
    loss, log = policy_loss_function(args, batch, a, None)
    loss.backward()
    b = logits.clone().requires_grad_(True)
    logp = b[0].double().log_softmax(-1)
    ent_all = -(logp.exp() * logp).sum(-1)
    lps, off = [], 0
    for (p, r), tok in zip(SAMPLES, batch["unconcat_tokens"]):
        lps.append(logp[torch.arange(off + p - 1, off + p - 1 + r), tok[p:]])
        off += p + r
    weights, keep, _ = reference_correction([x.detach().float() for x in lps], batch["rollout_log_probs"],
                                            batch["loss_masks"], config)
    ref = torch.zeros((), dtype=torch.float64)
    off = 0
    for i, (p, r) in enumerate(SAMPLES):
        m0 = batch["loss_masks"][i].double()
        m = m0 * keep[i].double()
        d = float(batch["rollout_mask_sums"][i]) - (0 if config.rejected_in_denominator else float((m0 - m).sum()))
        w = 1.0 if weights is None else weights[i].double()
        lp = lps[i]
        kl_d = lp - batch["ref_log_probs"][i].double()
        term = -w * lp * batch["advantages"][i].double() - 0.01 * ent_all[off + p - 1:off + p - 1 + r] \
            + 0.05 * ((-kl_d).exp() - 1 + kl_d).clamp(-10, 10)
        off += p + r
        ref = ref + ((term * m).sum() if per_token else (term * m).sum() / max(d, 1.0))
    ref.backward()
    assert_close(loss, ref, "loss", 1e-5)
    assert float((a.grad.double() - b.grad).abs().max()) <= 1e-5


def test_bypass_reinforce_from_slime_yaml(tmp_path):
    """Bypass + REINFORCE + token IS + RS read from slime's YAML (the keys slime copies onto args), with
    --use-rollout-logprobs: slime refuses --use-tis with it on the command line, the YAML gets through."""
    path = tmp_path / "rc.yaml"
    path.write_text("use_tis: true\ntis_level: token\ntis_upper_bound: 1.5\nuse_rs: true\nrs_level: sequence\n"
                    "rs_upper_bound: 3.0\nrollout_correction_loss_type: reinforce\n")
    batch, logits = make_batch(5, recompute=False)
    args = slime_args(use_rollout_logprobs=True, custom_config_path=str(path), use_tis=True, tis_level="token",
                      tis_upper_bound=1.5, use_rs=True, rs_level="sequence", rs_upper_bound=3.0,
                      rollout_correction_loss_type="reinforce")
    from slime_rc.slime import policy_loss_function

    x = logits.clone().requires_grad_(True)
    loss, log = policy_loss_function(args, batch, x, None)
    loss.backward()
    config = args.rollout_correction_config
    assert (config.mode, config.loss_type, config.is_level, config.is_upper_bound) == ("bypass", "reinforce",
                                                                                       "token", 1.5)
    assert torch.isfinite(x.grad).all() and math.isfinite(float(loss))
    assert {"pg_loss", "ois", "rollout_corr/rollout_is_mean"} <= set(log)


def test_log_keys_are_the_same_every_micro_batch():
    """slime sums the log values positionally with the first micro-batch's keys."""
    from slime_rc.slime import policy_loss_function

    args = slime_args(use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    keys = [list(policy_loss_function(args, *make_batch(s), None)[1]) for s in (0, 1)]
    assert keys[0] == keys[1]
    assert keys[0][:5] == ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"]


# ---- bad input: a clear error naming the arg / key and the fix, never NaN into the gradient ---------------------
@pytest.mark.parametrize("kw, words", [
    (dict(allgather_cp=True), ("allgather_cp", "--allgather-cp")),
    (dict(advantage_estimator="gspo"), ("gspo", "--loss-type policy_loss")),
    (dict(use_opsm=True), ("use_opsm",)),
    (dict(rollout_top_p=0.9), ("rollout_top_p",)),
    (dict(custom_tis_function_path="my.tis"), ("my.tis", "--custom-tis-function-path")),
    (dict(use_kl_loss=True, kl_loss_type="k4"), ("k4", "--kl-loss-type")),
    (dict(rollout_temperature=0.0), ("rollout_temperature",)),
    (dict(rollout_correction_config=RolloutCorrectionConfig(loss_agg="token_mean")),
     ("loss_agg", "calculate_per_token_loss")),
])
def test_unsupported_args_are_refused(kw, words):
    from slime_rc.slime import policy_loss_function

    batch, logits = make_batch(0)
    raises_mentioning(lambda: policy_loss_function(slime_args(**kw), batch, logits, None), *words)


def test_bad_batches_are_refused():
    from slime_rc.slime import policy_loss_function

    batch, logits = make_batch(0)
    call = (lambda b, x=logits, **kw: policy_loss_function(slime_args(**kw), b, x, None))
    raises_mentioning(lambda: call({k: v for k, v in batch.items() if k != "advantages"}), "advantages")
    short = dict(batch, advantages=[a[:-1] for a in batch["advantages"]])
    raises_mentioning(lambda: call(short), "advantages", "zigzag")
    raises_mentioning(lambda: call(dict(batch, rollout_log_probs=None), use_rollout_logprobs=True),
                      "rollout_log_probs")
    raises_mentioning(lambda: call(batch, logits[:, :10]), "logits")
    raises_mentioning(lambda: call(batch, logits[0]), "[1, T, V/tp]")
    nan_adv = [a.clone() for a in batch["advantages"]]
    nan_adv[0][2] = float("nan")
    raises_mentioning(lambda: call(dict(batch, advantages=nan_adv)), "advantages", "sample 0, response token 2")
    nan_ref = [r.clone() for r in batch["ref_log_probs"]]
    nan_ref[2][1] = float("inf")
    raises_mentioning(lambda: call(dict(batch, ref_log_probs=nan_ref), use_kl_loss=True, kl_loss_coef=0.1),
                      "ref_log_probs", "sample 2")


def test_non_finite_values_outside_the_loss_mask_do_not_reach_the_gradient():
    from slime_rc.slime import policy_loss_function

    batch, logits = make_batch(0)
    # sample 2's tokens 4:7 and sample 3 are masked out
    for key, value in (("advantages", float("nan")), ("ref_log_probs", float("-inf")), ("log_probs", float("nan"))):
        for i, j in ((2, 5), (3, 0)):
            batch[key][i][j] = value
    x = logits.clone().requires_grad_(True)
    loss, log = policy_loss_function(slime_args(use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01),
                                     batch, x, None)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(x.grad).all()
    assert all(math.isfinite(float(v)) for v in log.values())


def test_dotted_path_loads_as_slime_loads_it():
    import importlib
    import subprocess
    import sys

    module, _, attr = "slime_rc.slime.policy_loss_function".rpartition(".")  # slime's load_function
    assert callable(getattr(importlib.import_module(module), attr))
    # importing slime_rc.slime (as slime's load_function does) does not pull in megatron-core: slime imports its
    # own Megatron when it is ready to, and slime_rc's megatron helpers import megatron.core only when called
    code = ("import sys, slime_rc.slime; print(any(m == 'megatron' or m.startswith('megatron.') "
            "for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("entropy_coef,bound", [(0.0, 14), (0.01, 17)])
def test_the_loss_moves_over_the_vocabulary_only_what_the_log_prob_pass_does(entropy_coef, bound):
    """Forward + backward of the whole custom loss, in float32 ``[T, V]`` passes: the log-prob function's 8 + 6 (9
    with the entropy's gradient, tests/megatron/test_logprobs.py) and nothing more -- no copy of the response rows,
    no zero-filled ``[1, T, V]`` gradient from indexing the logits, no other vocabulary-sized intermediate."""
    from slime_rc.slime import policy_loss_function
    from slime_rc.testing.traffic import VocabTraffic

    batch, logits = make_batch(3)
    width = 97  # wider than any other dimension here; the token ids stay < V
    x = (torch.randn(1, logits.shape[1], width, generator=torch.Generator().manual_seed(4)) * 1.5).requires_grad_()
    with VocabTraffic(width) as traffic:
        loss, _ = policy_loss_function(slime_args(entropy_coef=entropy_coef), batch, x, None)
        loss.backward()
    assert bound - 1 < traffic.passes(x.numel() * 4) <= bound + 0.1, dict(traffic.by_op)
