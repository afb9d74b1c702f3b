"""Property-based tests of compute_rollout_correction (hypothesis).

Log-probs are drawn on a 1/64 grid with |value| <= ~25: every float32 value and every float64 sum of them is
exact, so decisions (rejections) cannot flip with summation order and exact comparisons are meaningful.
The finiteness property uses unrestricted finite float32 log-probs instead.
"""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slime_rc import (IS_MODES, RS_OPTIONS, RejectionCriterion, RolloutCorrectionConfig,
                      compute_rollout_correction, cu_seqlens_from_lengths)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GRID = 64

# --------------------------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------------------------

_grid_lp = st.integers(-20 * GRID, 0).map(lambda k: k / GRID)
_grid_delta = st.one_of(
    st.integers(-GRID // 4, GRID // 4),  # small mismatch, the common case
    st.integers(-5 * GRID, 3 * GRID),  # large mismatch
).map(lambda k: k / GRID)


@st.composite
def sequences(draw, max_seqs=5, max_len=7, extreme=False):
    """A batch as a list of sequences, each a list of (train, rollout, mask) token triples."""
    n_seqs = draw(st.integers(0, max_seqs))
    out = []
    for _ in range(n_seqs):
        length = draw(st.integers(0, max_len))
        seq = []
        for _ in range(length):
            if extreme:
                lp = st.one_of(st.floats(max_value=0.0, width=32, allow_nan=False, allow_infinity=False),
                               st.sampled_from([-1e4, -1e30, -3.4e38, 0.0, -1e-30]))
                train, rollout = draw(lp), draw(lp)
            else:
                rollout = draw(_grid_lp)
                train = rollout + draw(_grid_delta)
            mask = draw(st.sampled_from([1.0, 1.0, 1.0, 0.0]))
            seq.append((train, rollout, mask))
        out.append(seq)
    return out


def tensors(seqs):
    flat = [tok for seq in seqs for tok in seq]
    train = torch.tensor([t[0] for t in flat], dtype=torch.float32)
    rollout = torch.tensor([t[1] for t in flat], dtype=torch.float32)
    mask = torch.tensor([t[2] for t in flat], dtype=torch.float32)
    return train, rollout, mask, cu_seqlens_from_lengths([len(s) for s in seqs])


_K1_THRESHOLDS = [(2.0, None), (1.5, 0.9), (3.0, 0.2), (1.05, 0.95), (1.2, None)]
_KDIV_THRESHOLDS = [0.001, 0.02, 0.3, 2.0]


@st.composite
def criteria(draw):
    options = draw(st.lists(st.sampled_from(sorted(RS_OPTIONS)), max_size=3, unique=True))
    out = []
    for opt in options:
        if RS_OPTIONS[opt][2] == "k1":
            upper, lower = draw(st.sampled_from(_K1_THRESHOLDS))
            out.append(RejectionCriterion(opt, upper, lower))
        else:
            out.append(RejectionCriterion(opt, draw(st.sampled_from(_KDIV_THRESHOLDS))))
    return tuple(out)


@st.composite
def configs(draw, levels=(None, "token", "sequence", "geometric"), norm=None):
    level = draw(st.sampled_from(levels))
    upper, lower = draw(st.sampled_from([(2.0, None), (1.5, 0.5), (5.0, None), (1.01, None), (3.0, 0.8)]))
    return RolloutCorrectionConfig(
        is_level=level,
        is_mode=draw(st.sampled_from(IS_MODES)),
        is_upper_bound=upper,
        is_lower_bound=lower,
        is_batch_normalize=draw(st.booleans()) if norm is None else norm,
        rs=draw(criteria()),
        veto_threshold=draw(st.sampled_from([None, None, 1e-4, 0.3])),
        safety_bound=draw(st.sampled_from([20.0, 20.0, 5.0])),
        on_nonfinite=draw(st.sampled_from(["error", "reject"])),
    )


def run(seqs, cfg):
    return compute_rollout_correction(*tensors(seqs), cfg)


def metrics_close(a, b, rel=1e-9, abs_=1e-12):
    assert set(a.metrics) == set(b.metrics)
    for k in a.metrics:
        x, y = float(a.metrics[k]), float(b.metrics[k])
        assert math.isclose(x, y, rel_tol=rel, abs_tol=abs_), f"{k}: {x!r} != {y!r}"


def seq_slices(seqs):
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    return [slice(cu[i], cu[i + 1]) for i in range(len(seqs))]


def invariants(res, seqs, cfg):
    _, _, mask, _ = tensors(seqs)
    keep = res.keep_mask
    assert keep.dtype == torch.float32 and keep.shape == mask.shape
    assert bool(((keep == 0) | (keep == 1)).all())
    assert bool((keep <= mask).all()), "keep_mask <= loss_mask"
    if cfg.is_enabled:
        w = res.is_weights
        assert w.dtype == torch.float32 and w.shape == mask.shape
        assert bool((w[keep == 0] == 0).all()), "is_weights must be 0 where keep_mask is 0"
        assert bool((w >= 0).all())
    else:
        assert res.is_weights is None


# --------------------------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------------------------

@SETTINGS
@given(seqs=sequences(), cfg=configs())
def test_basic_invariants(seqs, cfg):
    invariants(run(seqs, cfg), seqs, cfg)


@SETTINGS
@given(seqs=sequences(), cfg=configs(levels=("sequence", "geometric")))
def test_sequence_level_weights_constant_within_sequence(seqs, cfg):
    res = run(seqs, cfg)
    invariants(res, seqs, cfg)
    for i, sl in enumerate(seq_slices(seqs)):
        kept = res.keep_mask[sl] == 1
        w = res.is_weights[sl][kept]
        if w.numel():
            assert bool((w == w[0]).all()), f"sequence {i}: weights {w.tolist()}"
            assert float(w[0]) > 0
            assert math.isclose(float(w[0]), float(res.sequences["is_weight"][i]), rel_tol=1e-6)


def _has_kept(res):
    return float(res.keep_mask.sum()) > 0


@SETTINGS
@given(seqs=sequences(), cfg=configs(levels=("token",), norm=True))
def test_batch_normalized_token_weights_mean_one(seqs, cfg):
    res = run(seqs, cfg)
    invariants(res, seqs, cfg)
    kept = res.keep_mask == 1
    if _has_kept(res):
        mean = float(res.is_weights[kept].double().mean())
        assert math.isclose(mean, 1.0, rel_tol=1e-5), mean
        factor = float(res.metrics["rollout_is_batch_norm_factor"])
        assert math.isclose(factor, float(res.metrics["rollout_is_mean"]), rel_tol=1e-9)


@SETTINGS
@given(seqs=sequences(), cfg=configs(levels=("sequence", "geometric"), norm=True))
def test_batch_normalized_sequence_weights_mean_one(seqs, cfg):
    res = run(seqs, cfg)
    invariants(res, seqs, cfg)
    per_seq = []
    for sl in seq_slices(seqs):
        kept = res.keep_mask[sl] == 1
        if bool(kept.any()):
            per_seq.append(float(res.is_weights[sl][kept][0]))
    if per_seq:
        mean = sum(per_seq) / len(per_seq)
        assert math.isclose(mean, 1.0, rel_tol=1e-5), per_seq
        kept_seqs = res.sequences["kept"] == 1
        assert int(kept_seqs.sum()) == len(per_seq)
        assert math.isclose(float(res.sequences["is_weight"][kept_seqs].mean()), 1.0, rel_tol=1e-9)


def _widen(c: RejectionCriterion, f_lo: float, f_hi: float) -> RejectionCriterion:
    if c.statistic == "k1":
        return RejectionCriterion(c.option, c.upper * f_hi, c.lower / f_lo)
    return RejectionCriterion(c.option, c.upper * f_hi)


@SETTINGS
@given(seqs=sequences(), cfg=configs(), f_lo=st.sampled_from([1.0, 1.1, 3.0]),
       f_hi=st.sampled_from([1.0, 1.1, 3.0]))
def test_widening_rs_bounds_never_rejects_more(seqs, cfg, f_lo, f_hi):
    wide_cfg = RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "rs": [_widen(c, f_lo, f_hi) for c in cfg.rs]})
    narrow, wide = run(seqs, cfg), run(seqs, wide_cfg)
    assert bool((wide.keep_mask >= narrow.keep_mask).all())
    assert float(wide.metrics["rejected_token_fraction"]) <= float(narrow.metrics["rejected_token_fraction"])
    if cfg.rs:
        assert float(wide.metrics["rollout_rs_masked_fraction"]) <= float(
            narrow.metrics["rollout_rs_masked_fraction"]) + 1e-12


@SETTINGS
@given(seqs=sequences(), cfg=configs(), data=st.data())
def test_permuting_sequences_permutes_outputs(seqs, cfg, data):
    perm = data.draw(st.permutations(range(len(seqs))))
    slices = seq_slices(seqs)
    idx = torch.tensor([j for p in perm for j in range(slices[p].start, slices[p].stop)], dtype=torch.int64)
    a = run(seqs, cfg)
    b = run([seqs[p] for p in perm], cfg)
    assert torch.equal(b.keep_mask, a.keep_mask[idx])
    if cfg.is_enabled:
        torch.testing.assert_close(b.is_weights, a.is_weights[idx], rtol=1e-6, atol=0)
    p = torch.tensor(perm, dtype=torch.int64)
    for k in a.sequences:
        torch.testing.assert_close(b.sequences[k], a.sequences[k][p], rtol=1e-9, atol=1e-12)
    metrics_close(a, b)


@SETTINGS
@given(seqs=sequences(), cfg=configs(), data=st.data())
def test_permuting_tokens_within_sequences_permutes_outputs(seqs, cfg, data):
    slices = seq_slices(seqs)
    perms = [data.draw(st.permutations(range(len(s)))) for s in seqs]
    permuted = [[s[j] for j in pm] for s, pm in zip(seqs, perms)]
    idx = torch.tensor([sl.start + j for sl, pm in zip(slices, perms) for j in pm], dtype=torch.int64)
    a = run(seqs, cfg)
    b = run(permuted, cfg)
    assert torch.equal(b.keep_mask, a.keep_mask[idx])
    if cfg.is_enabled:
        torch.testing.assert_close(b.is_weights, a.is_weights[idx], rtol=1e-6, atol=0)
    for k in a.sequences:
        torch.testing.assert_close(b.sequences[k], a.sequences[k], rtol=1e-9, atol=1e-12)
    metrics_close(a, b)


@SETTINGS
@given(first=sequences(max_seqs=3), second=sequences(max_seqs=3), cfg=configs())
def test_weights_of_a_sequence_do_not_depend_on_other_sequences(first, second, cfg):
    n1 = sum(len(s) for s in first)
    alone = run(first, cfg)
    joint = run(first + second, cfg)
    other = run(second, cfg)
    # rejection never looks across sequences
    assert torch.equal(joint.keep_mask, torch.cat([alone.keep_mask, other.keep_mask]))
    if not cfg.is_enabled:
        return
    if not cfg.is_batch_normalize:
        assert torch.equal(joint.is_weights[:n1], alone.is_weights)
        assert torch.equal(joint.is_weights[n1:], other.is_weights)
    else:
        # with batch normalization, weights only change by one global factor
        plain = RolloutCorrectionConfig.from_dict({**cfg.to_dict(), "is_batch_normalize": False})
        raw = torch.cat([run(first, plain).is_weights, run(second, plain).is_weights])
        factor = float(joint.metrics["rollout_is_batch_norm_factor"])
        assert factor > 0
        torch.testing.assert_close(joint.is_weights.double() * factor, raw.double(), rtol=1e-5, atol=0)


@SETTINGS
@given(seqs=sequences(extreme=True), cfg=configs())
def test_outputs_finite_for_extreme_finite_log_probs(seqs, cfg):
    res = run(seqs, cfg)
    invariants(res, seqs, cfg)
    if cfg.is_enabled:
        assert bool(torch.isfinite(res.is_weights).all())
    for k, v in res.metrics.items():
        assert math.isfinite(float(v)), f"{k} = {float(v)}"
    for k, v in res.sequences.items():
        assert bool(torch.isfinite(v).all()), f"sequences[{k}] = {v.tolist()}"
    # no finite input may be counted as non-finite
    if cfg.on_nonfinite == "reject":
        assert float(res.metrics["nonfinite_token_fraction"]) == 0.0


@SETTINGS
@given(seqs=sequences(), cfg=configs(levels=("token",)))
def test_token_level_weight_is_bounded_ratio(seqs, cfg):
    train, rollout, mask, _ = tensors(seqs)
    res = run(seqs, cfg)
    kept = res.keep_mask == 1
    lr = (train - rollout).double().clamp(-cfg.safety_bound, cfg.safety_bound)
    r = torch.exp(lr)
    if cfg.is_mode == "truncate":
        expect = r.clamp(max=cfg.is_upper_bound)
    elif cfg.is_mode == "clip":
        expect = r.clamp(cfg.is_lower, cfg.is_upper_bound)
    else:
        expect = r
        assert bool((r[kept] <= cfg.is_upper_bound * (1 + 1e-6)).all())
        assert bool((r[kept] >= cfg.is_lower * (1 - 1e-6)).all())
    if cfg.is_batch_normalize and bool(kept.any()):
        expect = expect / float(res.metrics["rollout_is_batch_norm_factor"])
    torch.testing.assert_close(res.is_weights[kept].double(), expect[kept], rtol=1e-5, atol=0)


@SETTINGS
@given(seqs=sequences(), cfg=configs(), data=st.data())
def test_masked_out_tokens_have_no_influence(seqs, cfg, data):
    """Changing the log-probs of masked-out tokens, or inserting more of them, changes nothing else."""
    junk = st.tuples(st.sampled_from([0.0, -7.0, -1e4, 3.0]), st.sampled_from([0.0, -0.5, -1e4, -30.0]))
    padded, idx, j = [], [], 0
    for s in seqs:
        new = []
        for tok in s:
            if data.draw(st.booleans()):
                t, r = data.draw(junk)
                new.append((t, r, 0.0))
            if tok[2] == 0.0:  # scramble existing masked-out tokens too
                t, r = data.draw(junk)
                tok = (t, r, 0.0)
            idx.append(len(new) + j)
            new.append(tok)
        if data.draw(st.booleans()):
            new.append((-2.0, -40.0, 0.0))
        j += len(new)
        padded.append(new)
    idx = torch.tensor(idx, dtype=torch.int64)
    a, b = run(seqs, cfg), run(padded, cfg)
    invariants(b, padded, cfg)
    assert torch.equal(b.keep_mask[idx], a.keep_mask)
    assert float(b.keep_mask.sum()) == float(a.keep_mask.sum())
    if cfg.is_enabled:
        torch.testing.assert_close(b.is_weights[idx], a.is_weights, rtol=1e-6, atol=0)
        assert math.isclose(float(b.is_weights.sum()), float(b.is_weights[idx].sum()), rel_tol=1e-6)
    for k in a.sequences:
        torch.testing.assert_close(b.sequences[k], a.sequences[k], rtol=1e-9, atol=1e-12)
    metrics_close(a, b)
