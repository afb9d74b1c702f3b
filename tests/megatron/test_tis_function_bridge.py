"""A function written to slime's TIS contract inside ``slime_rc.megatron.loss``: the ``args`` it gets
(``slime_rc.config.slime_attributes``), its full-length masks cut to each CP rank's zigzag positions, its errors, and
slime's reduction of its metrics -- one process, CP ranks laid out by hand with ``slime_rc.megatron.cp_layout`` (the
multi-process runs are in ``tests/megatron/test_loss_layouts.py`` and ``tests/demo/test_train_loop.py``)."""

from __future__ import annotations

import argparse
import math
import types

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria
from slime_rc.config.schema import RS_OPTIONS
from slime_rc.megatron.cp_layout import packed_zigzag_positions, zigzag_response_indices, zigzag_slice
from slime_rc.slime.tis_bridge import (TIS_FUNCTION_METRICS, reduce_tis_function_metrics, tis_function_correction,
                                       tis_function_correction_for, with_sample_fields)
from slime_rc.config.slime_attributes import SLIME_ATTRIBUTES, slime_attributes, with_slime_attributes

CONFIGS = {
    "default_token": RolloutCorrectionConfig(is_level="token"),
    "seq_mask": RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_upper_bound=3.0, is_lower_bound=0.4),
    "geo_clip_bn_rs": RolloutCorrectionConfig(is_level="geometric", is_mode="clip", is_upper_bound=1.5,
                                              is_batch_normalize=True, rs=parse_rejection_criteria("token_k1", 2.5)),
    "rs_band_veto": RolloutCorrectionConfig(rs=parse_rejection_criteria("geometric", "0.9_1.1"), veto_threshold=1e-4),
    "rs_k3": RolloutCorrectionConfig(is_level="token", rs=parse_rejection_criteria("seq_max_k3", 0.02)),
    "rs_many": RolloutCorrectionConfig(is_level="token", rs=parse_rejection_criteria("token,seq_mean_k2,sequence",
                                                                                       "0.5_2.0,0.01,3.0")),
    "bypass_reinforce": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence",
                                                loss_agg="token_mean", eps_clip=0.1, eps_clip_high=0.3,
                                                eps_clip_c=3.0),
    "metrics_only": RolloutCorrectionConfig(get_mismatch_metrics=True),
}


def _semantics(c: RolloutCorrectionConfig) -> dict:
    """What a config computes (aliases and resolved defaults made equal)."""
    return dict(is_level=c.is_level, is_mode=c.is_mode, upper=c.is_upper_bound, lower=c.is_lower,
                bn=c.is_batch_normalize, rs=[(RS_OPTIONS[r.option], r.upper, r.lower) for r in c.rs],
                veto=c.veto_threshold, mode=c.mode, metrics=c.get_mismatch_metrics, agg=c.loss_agg,
                eps=(c.eps_clip, c.eps_clip_high if c.eps_clip_high is not None else c.eps_clip, c.eps_clip_c))


# ---- slime's attributes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_slime_attributes_invert_the_settings(name):
    """slime's keys for a config, read back by our settings (slime's spelling), give the same correction."""
    config = CONFIGS[name]
    attrs = slime_attributes(config)
    assert tuple(sorted(attrs)) == tuple(sorted(SLIME_ATTRIBUTES))
    back = RolloutCorrectionConfig.from_dict({k: v for k, v in attrs.items()
                                              if v is not None and k not in ("tis_clip", "tis_clip_low")})
    assert _semantics(back) == _semantics(config)


def test_slime_attributes_values():
    a = slime_attributes(CONFIGS["default_token"])
    assert a == dict(use_tis=True, tis_level="token", tis_mode="truncate", tis_upper_bound=2.0, tis_lower_bound=0.5,
                     tis_clip=2.0, tis_clip_low=0.0, tis_batch_normalize=False, use_rs=False, rs_level=None,
                     rs_upper_bound=None, rs_lower_bound=None, rs_veto_threshold=None, get_mismatch_metrics=False,
                     use_rollout_logprobs=False, calculate_per_token_loss=False, eps_clip=0.2, eps_clip_high=0.2,
                     eps_clip_c=None)
    g = slime_attributes(CONFIGS["geo_clip_bn_rs"])  # a k1 alias becomes slime's level name; clip keeps the lower
    assert (g["rs_level"], g["rs_upper_bound"], g["rs_lower_bound"]) == ("token", 2.5, 0.4)
    assert (g["tis_clip_low"], g["tis_lower_bound"]) == (pytest.approx(1 / 1.5), pytest.approx(1 / 1.5))
    m = slime_attributes(CONFIGS["rs_many"])  # what slime's keys can't express: our parser's comma strings
    assert m["rs_level"] == "token,seq_mean_k2,sequence" and m["rs_lower_bound"] is None
    assert m["rs_upper_bound"] == "0.5_2.0,0.01,0.3333333333333333_3.0"
    k3 = slime_attributes(CONFIGS["rs_k3"])
    assert (k3["rs_level"], k3["rs_upper_bound"], k3["rs_lower_bound"]) == ("seq_max_k3", 0.02, None)
    b = slime_attributes(CONFIGS["bypass_reinforce"])
    assert b["use_rollout_logprobs"] and b["calculate_per_token_loss"] and b["eps_clip_high"] == 0.3
    off = slime_attributes(CONFIGS["rs_band_veto"])  # IS off: no level, but a number to divide by (slime's 1/upper)
    assert off["use_tis"] is False and off["tis_level"] is None and off["tis_upper_bound"] == 2.0
    assert off["use_rs"] and off["rs_veto_threshold"] == 1e-4
    with pytest.raises(TypeError, match="RolloutCorrectionConfig"):
        slime_attributes({"use_tis": True})


def test_with_slime_attributes_copies_the_callers_args():
    config = CONFIGS["seq_mask"]
    args = argparse.Namespace(tis_upper_bound=None, use_tis=None, lr=0.1, hidden=[1, 2])
    got = with_slime_attributes(args, config)
    assert vars(args) == dict(tis_upper_bound=None, use_tis=None, lr=0.1, hidden=[1, 2])  # untouched
    assert got is not args and got.tis_upper_bound == 3.0 and got.tis_lower_bound == 0.4 and got.use_tis is True
    assert got.lr == 0.1 and got.hidden == [1, 2] and got.hidden is not args.hidden
    assert got.rollout_correction_config is config
    assert with_slime_attributes(None, config).tis_mode == "mask"
    assert with_slime_attributes({"x": 1}, config).x == 1
    assert with_slime_attributes(types.SimpleNamespace(y=2), config).y == 2
    with pytest.raises(TypeError, match="argparse.Namespace"):
        with_slime_attributes(3, config)


# ---- the function's masks and metrics under CP --------------------------------------------------------------------
def _batch(seed=0):
    """One packed micro-batch of 4 sequences (prompt + response) with train / rollout log-probs per position."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [9, 14, 5, 23], [3, 1, 2, 7]
    cu = torch.tensor([0] + lengths).cumsum(0)
    n = int(cu[-1])
    mask = torch.zeros(n)
    for i, (t, p) in enumerate(zip(lengths, prompts)):
        mask[int(cu[i]) + p - 1:int(cu[i]) + t - 1] = 1.0
    mask[int(cu[3]) + 10] = 0.0  # a masked-out token inside a response (multi-turn tool output)
    train = -1.0 + 0.3 * torch.randn(n, generator=g)
    mb = dict(tokens=torch.zeros(n, dtype=torch.int64), cu_seqlens=cu, loss_mask=mask, old_log_probs=train,
              rollout_log_probs=train + 0.4 * torch.randn(n, generator=g), response_lengths=[t - p for t, p in
                                                                                             zip(lengths, prompts)])
    return with_sample_fields(mb)


def _local(mb, cp, rank):
    """This rank's tokens of ``mb`` in slime's layout (what shard_micro_batch gives, without megatron)."""
    lengths = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
    seq, pos = packed_zigzag_positions(lengths, cp, rank)
    n = torch.tensor(lengths)[seq]
    valid = pos < n
    src = torch.where(valid, mb["cu_seqlens"][:-1][seq] + pos, torch.zeros_like(pos))
    out = {k: v for k, v in mb.items() if not isinstance(v, torch.Tensor)}
    for k in ("loss_mask", "old_log_probs", "rollout_log_probs"):
        out[k] = torch.where(valid, mb[k][src], torch.zeros(()))
    out["position_ids"] = pos
    out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(seq).cumsum(0)])
    out["cp_size"], out["cp_rank"] = cp, rank
    return out


def make_function(cp, rank, return_local_masks=False, bad_mask_sample=None):
    """A slime-contract function that needs no gather: weight exp(train - rollout) capped at args.tis_upper_bound,
    each sample's full-length mask with its first response token dropped, metrics ``log_ratio`` (per token) and
    ``first`` (1 on response token 0, a position only one CP rank holds; a list of per-sample tensors)."""
    def compute(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths):
        assert all(m.dtype == torch.int for m in loss_masks)
        masks, weights, log_ratio, first = [], [], [], []
        for i, (t, r, m, total, resp) in enumerate(zip(train_log_probs, rollout_log_probs, loss_masks,
                                                       total_lengths, response_lengths)):
            assert m.numel() == resp  # full length
            j = zigzag_response_indices(total, resp, cp, rank)
            weights.append(torch.exp(t - r).clamp(max=args.tis_upper_bound))
            full = m.clone()
            full[0] = 0
            if i == bad_mask_sample:
                full = full[:-1]
            masks.append(zigzag_slice(full, total, resp, cp, rank) if return_local_masks else full)
            log_ratio.append(t - r)
            first.append((j == 0).float())
        return pg_loss * torch.cat(weights), masks, {"log_ratio": torch.cat(log_ratio), "first": first}
    return compute


def _run(mb, cp, config, **kw):
    out = []
    for rank in range(cp):
        lmb = _local(mb, cp, rank)
        corr = tis_function_correction(make_function(cp, rank, **kw), argparse.Namespace(tis_upper_bound=None), lmb,
                                       lmb["old_log_probs"], config=config)
        out.append((lmb, corr))
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("local_masks", [False, True])
def test_full_length_masks_are_cut_to_each_ranks_positions(cp, local_masks):
    """The function returns slime's full-length masks (or CP-local ones): every rank keeps exactly its own positions
    of them; weights are the function's ``pg_loss``; gathered over ranks they equal the 1-process result."""
    config = RolloutCorrectionConfig(is_level="token", is_upper_bound=1.3)
    mb = _batch()
    ref = _run(mb, 1, config)[0][1]
    start = mb["cu_seqlens"][:-1] + torch.tensor([3, 1, 2, 7]) - 1  # position of response token 0
    assert float(ref.keep_mask.sum()) == float(mb["loss_mask"].sum()) - 4
    assert bool((ref.keep_mask[start] == 0).all())
    full_keep, full_w = torch.full_like(ref.keep_mask, -1.0), torch.full_like(ref.keep_mask, -1.0)
    for lmb, corr in _run(mb, cp, config, return_local_masks=local_masks):
        lengths = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
        seq, pos = packed_zigzag_positions(lengths, cp, lmb["cp_rank"])
        valid = pos < torch.tensor(lengths)[seq]
        gidx = (mb["cu_seqlens"][:-1][seq] + pos)[valid]
        full_keep[gidx] = corr.keep_mask[valid]
        full_w[gidx] = corr.is_weights[valid]
    torch.testing.assert_close(full_keep, ref.keep_mask, rtol=0, atol=0)
    torch.testing.assert_close(full_w, ref.is_weights, rtol=0, atol=0)
    assert float(ref.is_weights.max()) == pytest.approx(1.3)  # the cap came from args.tis_upper_bound (resolved)


@pytest.mark.parametrize("per_token", [False, True])
def test_metrics_reduced_as_slime_reduces_them(per_token):
    """Per micro-batch and rank: the sum over samples of the metric's sum over the original loss mask / the sample's
    mask sum (a token sum with per-token loss); summed over ranks and micro-batches and divided by the samples (or
    tokens, max(mask sum, 1) each) -- the same at CP 1, 2, 4, and equal to the formula on the full sequences."""
    config = RolloutCorrectionConfig(is_level="token", loss_agg="token_mean" if per_token else "sample_mean")
    mbs = [_batch(0), _batch(1)]
    want_sum, want_count = 0.0, 0.0
    for mb in mbs:
        cu = mb["cu_seqlens"].tolist()
        for i, (t, r, m) in enumerate(zip(mb["sample_lengths"], mb["sample_response_lengths"],
                                          mb["sample_loss_masks"])):
            span = slice(cu[i] + t - r - 1, cu[i] + t - 1)
            x = (mb["old_log_probs"][span] - mb["rollout_log_probs"][span]).double() * m
            want_sum += float(x.sum()) / (1.0 if per_token else max(float(m.sum()), 1.0))
            want_count += max(float(m.sum()), 1.0) if per_token else 1.0
    for cp in (1, 2, 4):
        metrics, locals_ = [], []
        for mb in mbs:
            for lmb, corr in _run(mb, cp, config):
                metrics.append(corr.prefixed())
                locals_.append(lmb)
        got = reduce_tis_function_metrics(metrics, locals_, config, cp_size=cp)
        assert sorted(got) == [TIS_FUNCTION_METRICS + "first", TIS_FUNCTION_METRICS + "log_ratio"]
        assert got[TIS_FUNCTION_METRICS + "log_ratio"] == pytest.approx(want_sum / want_count, rel=1e-12)
        # "first" is 1 on each sample's response token 0, whose original loss mask is 1: per sample 1 / mask sum
        firsts = [1.0 / (1.0 if per_token else max(float(m.sum()), 1.0)) for mb in mbs for m in mb["sample_loss_masks"]]
        assert got[TIS_FUNCTION_METRICS + "first"] == pytest.approx(sum(firsts) / want_count, rel=1e-12)


def test_errors_name_the_function_the_sample_and_the_lengths():
    config = RolloutCorrectionConfig(is_level="token")
    mb = _batch()
    lmb = _local(mb, 2, 1)
    with pytest.raises(ValueError, match=r"make_function.<locals>.compute: modified mask of sample 3 has 15 entries; "
                                         r"expected the full response length 16 .* or this rank's 12 response"):
        tis_function_correction(make_function(2, 1, bad_mask_sample=3), None, lmb, lmb["old_log_probs"], config=config)

    def short_pg(args, *, pg_loss, **kw):
        return pg_loss[:-1], kw["loss_masks"], {}
    with pytest.raises(ValueError, match=r"short_pg returned pg_loss of \d+ values; it was given \d+"):
        tis_function_correction(short_pg, None, lmb, lmb["old_log_probs"], config=config)

    def full_metric(args, *, pg_loss, response_lengths, **kw):
        return pg_loss, kw["loss_masks"], {"full": torch.zeros(sum(response_lengths))}
    with pytest.raises(ValueError, match=r"full_metric: metric 'full' has 38 values; expected one per response token "
                                         r"this rank was given \(\d+, CP-local"):
        tis_function_correction(full_metric, None, lmb, lmb["old_log_probs"], config=config)

    def two(args, **kw):
        return kw["pg_loss"], kw["loss_masks"]
    with pytest.raises(ValueError, match="two returned tuple; slime's contract is a tuple"):
        tis_function_correction(two, None, lmb, lmb["old_log_probs"], config=config)


def test_with_sample_fields_uses_the_response_lengths():
    mb = _batch()
    assert mb["sample_lengths"] == [9, 14, 5, 23] and mb["sample_response_lengths"] == [6, 13, 3, 16]
    assert [m.numel() for m in mb["sample_loss_masks"]] == [6, 13, 3, 16]
    assert all(m.dtype == torch.int for m in mb["sample_loss_masks"]) and int(mb["sample_loss_masks"][3].sum()) == 15
    plain = with_sample_fields({k: v for k, v in mb.items() if k != "response_lengths"})
    assert plain["sample_response_lengths"] == [8, 13, 4, 22]  # every target a response token
    with pytest.raises(ValueError, match=r"sequence 1: loss_mask is non-zero outside its response .*"
                                         r"\['response_lengths'\]\[1\]"):
        with_sample_fields(dict(mb, response_lengths=[6, 5, 3, 16]))
    with pytest.raises(ValueError, match=r"sequence 2: response length 5 does not fit its 5 tokens"):
        with_sample_fields(dict(mb, response_lengths=[6, 13, 5, 16]))
    with pytest.raises(ValueError, match="has 3 entries for 4 sequences"):
        with_sample_fields(dict(mb, response_lengths=[6, 13, 3]))


def test_function_masks_zero_numerators_only_as_in_slime():
    """slime keeps the original masks' sums as loss denominators: a function that drops response token 0 through
    its mask gives the same loss as one that keeps the mask and returns weight 0 there (the engine's own default,
    rejected tokens out of the denominator, would make them differ)."""
    from slime_rc import LocalReducer
    from slime_rc.megatron.loss import policy_loss

    mb = _batch(3)
    lmb = _local(mb, 1, 0)
    n = lmb["loss_mask"].numel()
    g = torch.Generator().manual_seed(5)
    lmb.update(targets=torch.randint(0, 11, (n,), generator=g), advantages=torch.randn(n, generator=g))
    logits = torch.randn(n, 11, generator=g)
    config = RolloutCorrectionConfig(is_level="token", is_upper_bound=1.3)
    dropping = make_function(1, 0)

    def zero_weight(args, *, pg_loss, train_log_probs, loss_masks, total_lengths, response_lengths, **kw):
        out, masks, metrics = dropping(args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                                       loss_masks=loss_masks, total_lengths=total_lengths,
                                       response_lengths=response_lengths, **kw)
        return out * torch.cat([m.float() for m in masks]), list(loss_masks), metrics

    losses = [float(policy_loss(logits, lmb, config, reducer=LocalReducer(),
                                external=tis_function_correction_for(fn, argparse.Namespace()))[0])
              for fn in (dropping, zero_weight)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7) and losses[0] != 0.0


@pytest.mark.parametrize("on_nonfinite", ["error", "reject"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_weight_on_a_kept_token_is_an_error_in_both_modes(on_nonfinite, bad):
    """A plugin returning NaN/inf weights would put NaN into the gradient: ValueError naming the function (error
    mode), a failed assertion before any use (reject mode: no host read is allowed, the check runs on the device)."""
    config = RolloutCorrectionConfig(is_level="token", on_nonfinite=on_nonfinite)
    lmb = _local(_batch(), 2, 0)

    def nan_weight(args, *, pg_loss, loss_masks, **kw):
        w = pg_loss.clone()
        w[3] = bad
        return w, loss_masks, {}
    error = ValueError if on_nonfinite == "error" else RuntimeError
    with pytest.raises(error, match=r"TIS function .*nan_weight.* returned .*(nan|inf|NaN/inf).* at a kept loss token"):
        tis_function_correction(nan_weight, None, lmb, lmb["old_log_probs"], config=config)


def test_a_nonfinite_weight_on_a_token_the_function_masks_is_fine():
    config = RolloutCorrectionConfig(is_level="token")
    lmb = _local(_batch(), 2, 0)

    def masked_nan(args, *, pg_loss, loss_masks, total_lengths, response_lengths, **kw):
        masks = [m.clone() for m in loss_masks]
        j = zigzag_response_indices(total_lengths[0], response_lengths[0], 2, 0)
        masks[0][j[0]] = 0  # this rank's first held token of sample 0, dropped by the function
        w = pg_loss.clone()
        w[0] = math.nan
        return w, masks, {}
    corr = tis_function_correction(masked_nan, None, lmb, lmb["old_log_probs"], config=config)
    assert bool(torch.isfinite(corr.is_weights).all())
