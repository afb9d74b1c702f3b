"""Tests of the rollout-correction engine (slime_rc.compute_rollout_correction).

(a) hand-computed cases for every IS level x mode, every rejection option, veto, batch normalization,
    pure RS, mask mode, non-finite handling and the mismatch metrics;
(b) random batches x diverse configs against the per-sequence loop reference in slime_rc/testing/reference.py;
(c)-(f) batch extremes, ESS, no token-sized tensors in the result, the per-sequence statistics.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from slime_rc import (RS_OPTIONS, RolloutCorrectionConfig, compute_rollout_correction,
                      cu_seqlens_from_lengths, parse_rejection_criteria)
from slime_rc.testing.reference import reference_correction, reference_sequences

QUANTILE_KEYS = ("rollout_is_p25", "rollout_is_p50", "rollout_is_p75", "rollout_is_p95", "rollout_is_p99")


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def pack(train_list, rollout_list, mask_list):
    lengths = [t.numel() for t in train_list]
    return (torch.cat(train_list).float(), torch.cat(rollout_list).float(), torch.cat(mask_list).float(),
            cu_seqlens_from_lengths(lengths))


def run_engine(train_list, rollout_list, mask_list, config):
    return compute_rollout_correction(*pack(train_list, rollout_list, mask_list), config)


def from_ratios(ratio_lists, masks=None):
    """Lists of per-token ratios -> (train, rollout, mask) lists with log pi_train - log pi_rollout = log r."""
    train, rollout, mask = [], [], []
    for i, ratios in enumerate(ratio_lists):
        ro = [-1.0 - 0.25 * i - 0.1 * j for j in range(len(ratios))]
        rollout.append(torch.tensor(ro, dtype=torch.float32))
        train.append(torch.tensor([a + math.log(r) for a, r in zip(ro, ratios)], dtype=torch.float32))
        mask.append(torch.ones(len(ratios)) if masks is None else torch.tensor(masks[i], dtype=torch.float32))
    return train, rollout, mask


def metrics_of(result):
    return {k: float(v) for k, v in result.metrics.items()}


def flat(lists):
    return torch.tensor([x for xs in lists for x in xs], dtype=torch.float32)


def assert_close_list(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual.float(), flat(expected), rtol=tol, atol=tol)


# The hand batch used throughout: four sequences of per-token ratios.
A, B, C, D = [1.5, 3.0, 0.25], [0.8, 1.2], [5.0, 1.0], [0.3]
HAND = [A, B, C, D]
N_HAND = 8


def k2(r):
    return 0.5 * math.log(r) ** 2


def k3(r):
    return r - 1 - math.log(r)


def prod(xs):
    out = 1.0
    for x in xs:
        out *= x
    return out


def geo(xs):
    return prod(xs) ** (1.0 / len(xs))


# ---------------------------------------------------------------------------------------------------------------
# (a) hand-computed: IS level x mode (upper 2, lower defaults to 1/2)
# ---------------------------------------------------------------------------------------------------------------
gA, gB, gC, gD = geo(A), geo(B), geo(C), geo(D)  # 1.040, 0.980, 2.236, 0.3
sA, sB, sC, sD = prod(A), prod(B), prod(C), prod(D)  # 1.125, 0.96, 5.0, 0.3

IS_CASES = {
    ("token", "truncate"): ([[1.5, 2.0, 0.25], [0.8, 1.2], [2.0, 1.0], [0.3]], None),
    ("token", "clip"): ([[1.5, 2.0, 0.5], [0.8, 1.2], [2.0, 1.0], [0.5]], None),
    ("token", "mask"): ([[1.5, 0, 0], [0.8, 1.2], [0, 1.0], [0]], [[1, 0, 0], [1, 1], [0, 1], [0]]),
    ("sequence", "truncate"): ([[sA] * 3, [sB] * 2, [2.0] * 2, [sD]], None),
    ("sequence", "clip"): ([[sA] * 3, [sB] * 2, [2.0] * 2, [0.5]], None),
    ("sequence", "mask"): ([[sA] * 3, [sB] * 2, [0, 0], [0]], [[1, 1, 1], [1, 1], [0, 0], [0]]),
    ("geometric", "truncate"): ([[gA] * 3, [gB] * 2, [2.0] * 2, [gD]], None),
    ("geometric", "clip"): ([[gA] * 3, [gB] * 2, [2.0] * 2, [0.5]], None),
    ("geometric", "mask"): ([[gA] * 3, [gB] * 2, [0, 0], [0]], [[1, 1, 1], [1, 1], [0, 0], [0]]),
}


@pytest.mark.parametrize("level,mode", list(IS_CASES))
def test_is_level_mode_hand(level, mode):
    weights, keep = IS_CASES[(level, mode)]
    keep = keep or [[1] * len(s) for s in HAND]
    cfg = RolloutCorrectionConfig(is_level=level, is_mode=mode, is_upper_bound=2.0)
    res = run_engine(*from_ratios(HAND), cfg)
    assert_close_list(res.is_weights, weights)
    assert_close_list(res.keep_mask, keep, tol=0)
    m = metrics_of(res)
    kept_w = [w for ws, ks in zip(weights, keep) for w, k in zip(ws, ks) if k]
    assert m["rollout_is_mean"] == pytest.approx(sum(kept_w) / len(kept_w), rel=1e-5)
    n_rejected = N_HAND - sum(map(sum, keep))
    assert m["rejected_token_fraction"] == pytest.approx(n_rejected / N_HAND)
    assert m["rejected_seq_fraction"] == pytest.approx(sum(1 for ks in keep if not any(ks)) / 4)
    if mode == "mask":
        assert m["rollout_is_masked_fraction"] == pytest.approx(n_rejected / N_HAND)
        assert m["rollout_is_seq_masked_fraction"] == pytest.approx(sum(1 for ks in keep if not all(ks)) / 4)
    else:
        assert "rollout_is_masked_fraction" not in m


def test_is_clip_explicit_lower_bound():
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="clip", is_upper_bound=4.0, is_lower_bound=0.4)
    res = run_engine(*from_ratios(HAND), cfg)
    assert_close_list(res.is_weights, [[1.5, 3.0, 0.4], [0.8, 1.2], [4.0, 1.0], [0.4]])
    m = metrics_of(res)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 8)  # 5.0
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(2 / 8)  # 0.25, 0.3


def test_truncate_caps_above_only():
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0)
    res = run_engine(*from_ratios([[0.01, 100.0]]), cfg)
    assert_close_list(res.is_weights, [[0.01, 2.0]])


# ---------------------------------------------------------------------------------------------------------------
# (a) hand-computed: every rejection option (pure RS on the hand batch)
# ---------------------------------------------------------------------------------------------------------------
def _seq_keep(flags):
    return [[f] * len(s) for f, s in zip(flags, HAND)]


RS_CASES = {
    # token ratio bound [0.5, 2]: rejects 3.0, 0.25, 5.0, 0.3
    "token": (2.0, [[1, 0, 0], [1, 1], [0, 1], [0]]),
    # [0.28, 4]: rejects 0.25 and 5.0
    "token_k1": ("0.28_4.0", [[1, 1, 0], [1, 1], [0, 1], [1]]),
    # k2 = (log r)^2/2: 0.25 -> 0.961, 5 -> 1.295, 0.3 -> 0.725 exceed 0.7; 3 -> 0.603 does not
    "token_k2": (0.7, [[1, 1, 0], [1, 1], [0, 1], [0]]),
    # k3 = r-1-log r: 3 -> 0.901, 0.25 -> 0.636, 5 -> 2.39 exceed 0.6; 0.3 -> 0.504 does not
    "token_k3": (0.6, [[1, 0, 0], [1, 1], [0, 1], [1]]),
    # sequence ratios 1.125, 0.96, 5, 0.3 vs [0.5, 2]
    "sequence": (2.0, _seq_keep([1, 1, 0, 0])),
    # vs [0.25, 1.1]
    "seq_sum_k1": ("0.25_1.1", _seq_keep([0, 1, 0, 1])),
    # geometric ratios 1.040, 0.980, 2.236, 0.3 vs [1/1.5, 1.5]
    "geometric": (1.5, _seq_keep([1, 1, 0, 0])),
    # vs [1/1.03, 1.03]
    "seq_mean_k1": (1.03, _seq_keep([0, 1, 0, 0])),
    # sum k2: 1.647, 0.041, 1.295, 0.725 vs 1.0
    "seq_sum_k2": (1.0, _seq_keep([0, 1, 0, 1])),
    # sum k3: 1.632, 0.041, 2.391, 0.504 vs 2.0
    "seq_sum_k3": (2.0, _seq_keep([1, 1, 0, 1])),
    # mean k2: 0.549, 0.021, 0.648, 0.725 vs 0.6
    "seq_mean_k2": (0.6, _seq_keep([1, 1, 0, 0])),
    # mean k3: 0.544, 0.020, 1.195, 0.504 vs 0.52
    "seq_mean_k3": (0.52, _seq_keep([0, 1, 0, 1])),
    # max k2: 0.961, 0.025, 1.295, 0.725 vs 0.8
    "seq_max_k2": (0.8, _seq_keep([0, 1, 0, 1])),
    # max k3: 0.901, 0.023, 2.391, 0.504 vs 0.95
    "seq_max_k3": (0.95, _seq_keep([1, 1, 0, 1])),
}

# the hand statistics quoted in the comments above (guards the expected tables against typos)
_HAND_STATS = {
    "seq_sum_k2": [sum(map(k2, s)) for s in HAND], "seq_sum_k3": [sum(map(k3, s)) for s in HAND],
    "seq_mean_k2": [sum(map(k2, s)) / len(s) for s in HAND], "seq_mean_k3": [sum(map(k3, s)) / len(s) for s in HAND],
    "seq_max_k2": [max(map(k2, s)) for s in HAND], "seq_max_k3": [max(map(k3, s)) for s in HAND],
}


def test_rs_cases_cover_every_option():
    assert set(RS_CASES) == set(RS_OPTIONS)
    for option, stats in _HAND_STATS.items():
        thr, keep = RS_CASES[option]
        assert [int(v <= thr) for v in stats] == [ks[0] for ks in keep], option


@pytest.mark.parametrize("option", list(RS_CASES))
def test_rs_option_hand(option):
    threshold, keep = RS_CASES[option]
    cfg = RolloutCorrectionConfig(rs=parse_rejection_criteria(option, threshold))
    res = run_engine(*from_ratios(HAND), cfg)
    assert res.is_weights is None
    assert_close_list(res.keep_mask, keep, tol=0)
    m = metrics_of(res)
    rejected_tokens = N_HAND - sum(map(sum, keep))
    lost_seqs = sum(1 for ks in keep if not all(ks))
    assert m[f"rollout_rs_{option}_masked_fraction"] == pytest.approx(rejected_tokens / N_HAND)
    assert m[f"rollout_rs_{option}_seq_masked_fraction"] == pytest.approx(lost_seqs / 4)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(rejected_tokens / N_HAND)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(lost_seqs / 4)
    assert m["rejected_token_fraction"] == pytest.approx(rejected_tokens / N_HAND)


def test_rs_criteria_are_anded():
    rs = parse_rejection_criteria("token,seq_max_k2", "2.0,0.8")
    res = run_engine(*from_ratios(HAND), RolloutCorrectionConfig(rs=rs))
    assert_close_list(res.keep_mask, [[0, 0, 0], [1, 1], [0, 0], [0]], tol=0)
    m = metrics_of(res)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(6 / 8)  # A (3, whole seq), C (2), D (1)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(3 / 4)
    assert m["rollout_rs_token_masked_fraction"] == pytest.approx(4 / 8)
    assert m["rollout_rs_token_seq_masked_fraction"] == pytest.approx(3 / 4)
    assert m["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(5 / 8)
    assert m["rollout_rs_seq_max_k2_seq_masked_fraction"] == pytest.approx(2 / 4)
    assert m["rejected_seq_fraction"] == pytest.approx(3 / 4)


def test_pure_rs_without_is():
    cfg = RolloutCorrectionConfig(is_level=None, rs=parse_rejection_criteria("geometric", 1.5))
    res = run_engine(*from_ratios(HAND), cfg)
    assert res.is_weights is None
    assert_close_list(res.keep_mask, _seq_keep([1, 1, 0, 0]), tol=0)
    m = metrics_of(res)
    assert not any(k.startswith("rollout_is_") for k in m)
    assert m["rollout_rs_geometric_masked_fraction"] == pytest.approx(3 / 8)
    assert "is_weight" not in res.sequences


def test_mask_mode_and_rs_both_shape_keep_mask():
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=2.0,
                                  rs=parse_rejection_criteria("sequence", 2.0))
    res = run_engine(*from_ratios(HAND), cfg)
    keep = [[1, 0, 0], [1, 1], [0, 0], [0]]
    assert_close_list(res.keep_mask, keep, tol=0)
    assert_close_list(res.is_weights, [[1.5, 0, 0], [0.8, 1.2], [0, 0], [0]])
    m = metrics_of(res)
    assert m["rollout_is_masked_fraction"] == pytest.approx(4 / 8)  # 3.0, 0.25, 5.0, 0.3
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 8)  # C and D
    assert m["rejected_token_fraction"] == pytest.approx(5 / 8)
    assert m["rollout_is_mean"] == pytest.approx((1.5 + 0.8 + 1.2) / 3, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# (a) verl's per-option RS statistics (rollout_rs_<option>_mean ... _seq_fraction_low), by hand on the hand batch
# ---------------------------------------------------------------------------------------------------------------
def _verl_rs_statistics(option, criterion, ratio_lists):
    """verl's compute_rs_metrics on plain Python lists, with this project's statistic (k1 = log r): a token list
    (a sequence criterion's value repeated over its tokens) and a sequence list (a token criterion's per-sequence
    mean)."""
    granularity, aggregate, kind = RS_OPTIONS[option]
    stat = {"k1": math.log, "k2": k2, "k3": k3}[kind]
    per_seq_tokens = [[stat(r) for r in rs] for rs in ratio_lists]
    if granularity == "token":
        values = [sum(xs) / len(xs) for xs in per_seq_tokens]
        tokens = [x for xs in per_seq_tokens for x in xs]
    else:
        agg = {"sum": sum, "mean": lambda xs: sum(xs) / len(xs), "max": max}[aggregate]
        values = [agg(xs) for xs in per_seq_tokens]
        tokens = [v for v, xs in zip(values, per_seq_tokens) for _ in xs]
    hi = math.log(criterion.upper) if kind == "k1" else criterion.upper
    lo = math.log(criterion.lower) if kind == "k1" else 0.0
    stats = values if granularity == "sequence" else tokens  # what _max/_min/_fraction_* are taken over
    band = [min(max(x, lo), hi) for x in tokens]
    name = f"rollout_rs_{option}"
    out = {name + "_mean": statistics.fmean(tokens), name + "_max": max(stats), name + "_min": min(stats),
           name + "_std": statistics.pstdev(band),
           name + "_fraction_high": sum(x > hi for x in stats) / len(stats),
           name + "_seq_mean": statistics.fmean(values), name + "_seq_std": statistics.stdev(values),
           name + "_seq_max": max(values), name + "_seq_min": min(values),
           name + "_seq_max_deviation": max(abs(v) for v in values),
           name + "_seq_fraction_high": sum(v > hi for v in values) / len(values)}
    if kind == "k1":
        out[name + "_fraction_low"] = sum(x < lo for x in stats) / len(stats)
        out[name + "_seq_fraction_low"] = sum(v < lo for v in values) / len(values)
    return out


@pytest.mark.parametrize("option", list(RS_CASES))
def test_rs_statistics_hand(option):
    threshold, _ = RS_CASES[option]
    rs = parse_rejection_criteria(option, threshold)
    m = metrics_of(run_engine(*from_ratios(HAND), RolloutCorrectionConfig(rs=rs)))
    want = _verl_rs_statistics(option, rs[0], HAND)
    got = {k: v for k, v in m.items() if k.startswith(f"rollout_rs_{option}_") and "masked" not in k}
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert m[f"rollout_rs_{option}_seq_std"] > 0 and m[f"rollout_rs_{option}_std"] > 0  # the hand data spreads


@pytest.mark.parametrize("seed", [0, 1])
def test_rs_statistics_add_up_to_the_rejections(seed):
    """Every RS option at once on random data: the high/low fractions split the criterion's own rejections, and the
    k1 statistic has our sign (log r: its token mean is -kl, where verl's -log r would give +kl)."""
    options = list(RS_CASES)
    thresholds = ["0.8_1.2" if RS_OPTIONS[o][2] == "k1" else "0.05" for o in options]
    cfg = RolloutCorrectionConfig(rs=parse_rejection_criteria(options, thresholds))
    train, rollout, mask = random_batch(seed)  # no non-finite loss token: valid sequences are the loss sequences
    m = metrics_of(run_engine(train, rollout, mask, cfg))
    for option in options:
        name = f"rollout_rs_{option}"
        low = m.get(name + "_fraction_low", 0.0)
        if RS_OPTIONS[option][0] == "token":
            assert m[name + "_fraction_high"] + low == pytest.approx(m[name + "_masked_fraction"], abs=1e-12)
        else:
            assert m[name + "_fraction_high"] + low == pytest.approx(m[name + "_seq_masked_fraction"], abs=1e-12)
            assert m[name + "_max"] == m[name + "_seq_max"] and m[name + "_min"] == m[name + "_seq_min"]
        assert m[name + "_min"] <= m[name + "_mean"] <= m[name + "_max"]
        assert m[name + "_seq_min"] <= m[name + "_seq_mean"] <= m[name + "_seq_max"]
        assert m[name + "_seq_max_deviation"] == max(abs(m[name + "_seq_max"]), abs(m[name + "_seq_min"]))
    assert m["rollout_rs_token_k1_mean"] == pytest.approx(-m["kl"], rel=1e-9)
    assert m["rollout_rs_token_k1_fraction_high"] > 0 and m["rollout_rs_token_k1_fraction_low"] > 0


def test_rs_statistics_of_equal_values_have_no_spread():
    """Equal values have std 0 exactly (not the rounding of E[x^2] - E[x]^2), and fewer than two values too."""
    rs = parse_rejection_criteria("token_k3,seq_sum_k1", "0.001,0.5_2.0")
    m = metrics_of(run_engine(*from_ratios([[1.5, 1.5], [1.5, 1.5]]), RolloutCorrectionConfig(rs=rs)))
    for key in ("rollout_rs_token_k3_std", "rollout_rs_token_k3_seq_std", "rollout_rs_seq_sum_k1_seq_std"):
        assert m[key] == 0.0, key
    assert m["rollout_rs_token_k3_mean"] == pytest.approx(k3(1.5), rel=1e-5)  # all above the bound: band-clamped
    one = metrics_of(run_engine(*from_ratios([[1.5]]), RolloutCorrectionConfig(rs=rs)))
    assert one["rollout_rs_token_k3_std"] == 0.0 and one["rollout_rs_seq_sum_k1_seq_std"] == 0.0
    assert one["rollout_rs_seq_sum_k1_max"] == pytest.approx(math.log(1.5), rel=1e-5)
    # every sequence's max k2 (0.0011) lies above the bound: the band-clamped values are all 0.001, weighted by 5, 1
    # and 2 tokens; E[c^2] - E[c]^2 rounds to 0 in some orders of the sequences and to ~2e-22 in others
    lr = [[0, 0.046875, 0, 0, 0, 0, 0], [0.046875], [0, 0.046875]]
    masks = [[1, 1, 1, 1, 1, 0, 0], [1], [1, 1]]
    cfg = RolloutCorrectionConfig(rs=parse_rejection_criteria("seq_max_k2", 0.001))
    for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0], [1, 2, 0]):
        batch = [[torch.tensor(lr[i]) for i in order], [torch.zeros(len(lr[i])) for i in order],
                 [torch.tensor(masks[i], dtype=torch.float32) for i in order]]
        assert metrics_of(run_engine(*batch, cfg))["rollout_rs_seq_max_k2_std"] == 0.0, order


# ---------------------------------------------------------------------------------------------------------------
# (a) veto: checks the unclamped per-token ratio
# ---------------------------------------------------------------------------------------------------------------
def _veto_batch():
    # X: log r = [0.1, -25] (-25 is beyond the +-20 safety bound); Y: log r = [0.2, -0.3]
    train = [torch.tensor([-0.9, -27.0]), torch.tensor([-0.8, -1.3])]
    rollout = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])]
    mask = [torch.ones(2), torch.ones(2)]
    return train, rollout, mask


@pytest.mark.parametrize("veto,vetoed", [(1e-10, True), (1e-12, False)])
def test_veto_unclamped(veto, vetoed):
    # log(1e-10) = -23.03 > -25 (vetoed, although the clamped -20 would pass); log(1e-12) = -27.6 < -25
    assert math.log(1e-10) > -25 > math.log(1e-12)
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="truncate", veto_threshold=veto)
    res = run_engine(*_veto_batch(), cfg)
    m = metrics_of(res)
    if vetoed:
        assert_close_list(res.keep_mask, [[0, 0], [1, 1]], tol=0)
        assert_close_list(res.is_weights, [[0, 0], [math.exp(0.2), math.exp(-0.3)]])
        assert m["rollout_is_veto_fraction"] == pytest.approx(0.5)
        assert m["rollout_is_catastrophic_token_fraction"] == pytest.approx(0.25)
        assert m["rejected_token_fraction"] == pytest.approx(0.5)
    else:
        assert_close_list(res.keep_mask, [[1, 1], [1, 1]], tol=0)
        # the weight uses the safety-bounded ratio exp(-20), not exp(-25)
        w = res.is_weights
        assert float(w[1]) == pytest.approx(math.exp(-20), rel=1e-4)
        assert float(w[0]) == pytest.approx(math.exp(0.1), rel=1e-5)
        assert m["rollout_is_veto_fraction"] == 0.0
        assert m["rollout_is_catastrophic_token_fraction"] == 0.0
    # raw extremes use the safety-bounded log-ratio in either case
    assert m["rollout_is_min"] == pytest.approx(math.exp(-20), rel=1e-4)
    assert m["rollout_is_max"] == pytest.approx(math.exp(0.2), rel=1e-5)


def test_veto_without_is_rejects_whole_sequence():
    ratios = [[1.0, 1e-5, 1.0], [0.9, 1.1]]
    cfg = RolloutCorrectionConfig(veto_threshold=1e-4)
    res = run_engine(*from_ratios(ratios), cfg)
    assert res.is_weights is None
    assert_close_list(res.keep_mask, [[0, 0, 0], [1, 1]], tol=0)
    m = metrics_of(res)
    assert m["rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert m["rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)
    assert m["rejected_seq_fraction"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------------------
# (a) batch normalization at every level
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_batch_normalization(level):
    weights, _ = IS_CASES[(level, "truncate")]
    cfg = RolloutCorrectionConfig(is_level=level, is_mode="truncate", is_upper_bound=2.0, is_batch_normalize=True)
    res = run_engine(*from_ratios(HAND), cfg)
    m = metrics_of(res)
    if level == "token":
        factor = sum(map(sum, weights)) / N_HAND  # mean over kept tokens
    else:
        factor = sum(ws[0] for ws in weights) / 4  # mean over kept sequences
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-5)
    assert_close_list(res.is_weights, [[w / factor for w in ws] for ws in weights])
    # the normalized mean is 1 over kept tokens (token level) / kept sequences (sequence levels)
    if level == "token":
        assert float(res.is_weights.double().mean()) == pytest.approx(1.0, rel=1e-5)
    else:
        starts = [0, 3, 5, 7]
        assert float(res.is_weights[starts].double().mean()) == pytest.approx(1.0, rel=1e-5)
        assert float(res.sequences["is_weight"].mean()) == pytest.approx(1.0, rel=1e-5)
    # IS mean/std metrics describe the weights before normalization
    assert m["rollout_is_mean"] == pytest.approx(sum(map(sum, weights)) / N_HAND, rel=1e-5)


def test_batch_normalization_counts_only_kept():
    cfg = RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_upper_bound=2.0, is_batch_normalize=True)
    res = run_engine(*from_ratios(HAND), cfg)
    factor = (sA + sB) / 2  # C and D are masked out
    assert metrics_of(res)["rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-5)
    assert_close_list(res.is_weights, [[sA / factor] * 3, [sB / factor] * 2, [0, 0], [0]])


def test_batch_normalization_nothing_kept_leaves_weights():
    cfg = RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, rs=parse_rejection_criteria("token", 1.01))
    res = run_engine(*from_ratios([[1.5, 0.5]]), cfg)
    m = metrics_of(res)
    assert m["rollout_is_batch_norm_factor"] == 1.0
    assert torch.all(res.is_weights == 0)
    assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------------------------------------------------------
# (a) mismatch metrics and non-finite inputs
# ---------------------------------------------------------------------------------------------------------------
def test_mismatch_metrics_hand():
    train = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5]), torch.tensor([-3.0])]
    rollout = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.7]), torch.tensor([-1.0])]
    mask = [torch.ones(2), torch.ones(1), torch.zeros(1)]  # the third sample is fully masked
    m = metrics_of(run_engine(train, rollout, mask, RolloutCorrectionConfig()))
    lr = [0.5, -1.0, 0.2]
    e = math.exp
    assert m["kl"] == pytest.approx(-sum(lr) / 3, rel=1e-5)
    assert m["k3_kl"] == pytest.approx(sum(e(x) - 1 - x for x in lr) / 3, rel=1e-5)
    assert m["chi2_token"] == pytest.approx(sum(e(2 * x) for x in lr) / 3 - 1, rel=1e-5)
    assert m["chi2_seq"] == pytest.approx((e(2 * -0.5) + e(2 * 0.2)) / 2 - 1, rel=1e-5)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(1.7 / 3, rel=1e-5)
    assert m["training_log_ppl"] == pytest.approx((1.5 + 0.5) / 2, rel=1e-6)
    assert m["training_ppl"] == pytest.approx((e(1.5) + e(0.5)) / 2, rel=1e-6)
    assert m["rollout_log_ppl"] == pytest.approx((1.25 + 0.7) / 2, rel=1e-6)
    assert m["rollout_ppl"] == pytest.approx((e(1.25) + e(0.7)) / 2, rel=1e-6)
    d = [-1.25 + 1.5, -0.7 + 0.5]
    assert m["log_ppl_diff"] == pytest.approx(sum(d) / 2, abs=1e-6)
    assert m["log_ppl_abs_diff"] == pytest.approx((abs(d[0]) + abs(d[1])) / 2, rel=1e-5)
    assert m["log_ppl_diff_max"] == pytest.approx(0.25, rel=1e-5)
    assert m["log_ppl_diff_min"] == pytest.approx(-0.2, rel=1e-5)
    assert m["ppl_ratio"] == pytest.approx((e(0.25) + e(-0.2)) / 2, rel=1e-5)
    assert m["rejected_token_fraction"] == 0.0 and m["rejected_seq_fraction"] == 0.0


def _nonfinite_batch():
    nan, inf = float("nan"), float("inf")
    train = [torch.tensor([-1.0, nan]), torch.tensor([-1.0]), torch.tensor([nan, -0.9])]
    rollout = [torch.tensor([-1.2, -1.0]), torch.tensor([-1.1]), torch.tensor([-inf, -1.0])]
    mask = [torch.ones(2), torch.ones(1), torch.tensor([0.0, 1.0])]  # sample 2's bad token is not a loss token
    return train, rollout, mask


def test_nonfinite_reject():
    cfg = RolloutCorrectionConfig(is_level="token", on_nonfinite="reject")
    res = run_engine(*_nonfinite_batch(), cfg)
    assert_close_list(res.keep_mask, [[0, 0], [1], [0, 1]], tol=0)
    assert_close_list(res.is_weights, [[0, 0], [math.exp(0.1)], [0, math.exp(0.1)]])
    assert torch.isfinite(res.is_weights).all()
    m = metrics_of(res)
    assert all(math.isfinite(v) for v in m.values())
    assert m["nonfinite_token_fraction"] == pytest.approx(1 / 4)
    assert m["nonfinite_seq_fraction"] == pytest.approx(1 / 3)
    assert m["rejected_token_fraction"] == pytest.approx(2 / 4)
    assert m["rejected_seq_fraction"] == pytest.approx(1 / 3)
    assert m["kl"] == pytest.approx(-(0.2 + 0.1 + 0.1) / 3, rel=1e-5)  # valid tokens, rejected or not


def test_nonfinite_error_raises():
    with pytest.raises(ValueError, match="non-finite"):
        run_engine(*_nonfinite_batch(), RolloutCorrectionConfig(is_level="token"))


def test_perplexity_is_not_safety_clamped():
    # METRICS: training_ppl = mean over sequences of exp(-mean_t log pi_train); the +-20 safety bound applies to
    # log-ratios, not to log-probs.  Mean log-prob -25 (only reachable with extreme log-probs) -> ppl e^25.
    train = [torch.tensor([-25.0, -25.0]), torch.tensor([-1.0])]
    rollout = [torch.tensor([-24.0, -24.0]), torch.tensor([-1.0])]
    m = metrics_of(run_engine(train, rollout, [torch.ones(2), torch.ones(1)], RolloutCorrectionConfig()))
    assert m["training_log_ppl"] == pytest.approx(13.0, rel=1e-6)
    assert m["training_ppl"] == pytest.approx((math.exp(25) + math.exp(1)) / 2, rel=1e-5)
    assert m["rollout_ppl"] == pytest.approx((math.exp(24) + math.exp(1)) / 2, rel=1e-5)


def test_nonfinite_outside_loss_mask_is_ignored():
    train, rollout, mask = _nonfinite_batch()
    res = run_engine(train[1:], rollout[1:], mask[1:], RolloutCorrectionConfig(is_level="token"))
    assert_close_list(res.keep_mask, [[1], [0, 1]], tol=0)


def test_all_masked_batch_reports_zeros():
    train, rollout, _ = from_ratios([[1.5, 0.5], [2.0]])
    mask = [torch.zeros(2), torch.zeros(1)]
    cfg = RolloutCorrectionConfig(is_level="sequence", rs=parse_rejection_criteria("token", 2.0),
                                  veto_threshold=1e-4, is_batch_normalize=True)
    res = run_engine(train, rollout, mask, cfg)
    assert torch.all(res.keep_mask == 0) and torch.all(res.is_weights == 0)
    m = metrics_of(res)
    for k, v in m.items():
        assert v == (1.0 if k == "rollout_is_batch_norm_factor" else 0.0), k


# ---------------------------------------------------------------------------------------------------------------
# (c) rollout_is_min / max are true batch extremes; quantiles
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level,lo,hi", [
    ("token", 0.5, 4.0),
    ("sequence", 0.9 * 1.1, 0.5 * 4.0),
    ("geometric", math.sqrt(0.9 * 1.1), math.sqrt(0.5 * 4.0)),
])
def test_min_max_are_batch_extremes(level, lo, hi):
    ratios = [[0.5, 4.0], [0.9, 1.1], [1.3, 1.2, 1.25]]
    m = metrics_of(run_engine(*from_ratios(ratios), RolloutCorrectionConfig(is_level=level, is_upper_bound=3.0)))
    assert m["rollout_is_max"] == pytest.approx(hi, rel=1e-5)
    assert m["rollout_is_min"] == pytest.approx(lo, rel=1e-5)
    if level == "token":
        # an average of per-sequence extremes would give these instead
        assert m["rollout_is_max"] != pytest.approx((4.0 + 1.1 + 1.3) / 3, rel=1e-3)
        assert m["rollout_is_min"] != pytest.approx((0.5 + 0.9 + 1.2) / 3, rel=1e-3)


def _within_bin(reported, true_log, bins):
    err = abs(math.log(reported) - true_log)
    return err <= abs(true_log) / (2 * bins) * 1.001 + 2.0 ** -24 + 2e-6


@pytest.mark.parametrize("bins", [16, 128])
def test_quantiles_token_level_nearest_rank(bins):
    ratios = [k / 50 for k in range(1, 101)]  # nearest ranks 25, 50, 75, 95, 99 -> 0.5, 1.0, 1.5, 1.9, 1.98
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = [ratios[i] for i in perm]
    seqs = [shuffled[:37], shuffled[37:38], shuffled[38:]]
    cfg = RolloutCorrectionConfig(is_level="token", quantile_bins_per_octave=bins)
    m = metrics_of(run_engine(*from_ratios(seqs), cfg))
    for key, true in zip(QUANTILE_KEYS, [0.5, 1.0, 1.5, 1.9, 1.98]):
        assert _within_bin(m[key], math.log(true), bins), (key, m[key], true)
    assert m["rollout_is_p50"] == pytest.approx(1.0, abs=1e-6)


def test_quantiles_sequence_level_are_token_weighted():
    # sequence ratios 2.0 (3 tokens) and 0.5 (1 token): token-weighted median is 2.0, per-sequence median 0.5
    ratios = [[2.0, 1.0, 1.0], [0.5]]
    m = metrics_of(run_engine(*from_ratios(ratios), RolloutCorrectionConfig(is_level="sequence", is_upper_bound=4.0)))
    assert _within_bin(m["rollout_is_p25"], math.log(0.5), 128)
    assert _within_bin(m["rollout_is_p50"], math.log(2.0), 128)
    assert _within_bin(m["rollout_is_p99"], math.log(2.0), 128)
    assert m["rollout_is_ratio_fraction_low"] == 0.0  # bounds [0.25, 4]: neither ratio is outside
    assert m["rollout_is_ratio_fraction_high"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# (d) ESS and IS weight statistics
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ess_formula(level):
    cfg = RolloutCorrectionConfig(is_level=level, is_mode="truncate", is_upper_bound=2.0)
    m = metrics_of(run_engine(*from_ratios(HAND), cfg))
    w = [x for xs in IS_CASES[(level, "truncate")][0] for x in xs]  # per kept token
    mean = sum(w) / len(w)
    mean_sq = sum(x * x for x in w) / len(w)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(mean * mean / mean_sq, rel=1e-5)
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(mean_sq - mean * mean), rel=1e-5)
    assert m["rollout_is_mean"] == pytest.approx(mean, rel=1e-5)


def test_ess_over_kept_tokens_and_constant_weights():
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=2.0)
    m = metrics_of(run_engine(*from_ratios([[1.5, 1.5, 9.0], [1.5, 0.1]]), cfg))
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.0, rel=1e-6)  # kept weights all 1.5
    assert m["rollout_is_std"] == pytest.approx(0.0, abs=1e-6)
    assert m["rollout_is_mean"] == pytest.approx(1.5, rel=1e-6)


def test_sequence_weight_metrics_hand():
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0)
    m = metrics_of(run_engine(*from_ratios(HAND), cfg))
    seq_w = [(1.5 + 2 + 0.25) / 3, 1.0, 1.5, 0.3]
    mean = sum(seq_w) / 4
    assert m["rollout_is_seq_mean"] == pytest.approx(mean, rel=1e-5)
    assert m["rollout_is_seq_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in seq_w) / 4), rel=1e-5)
    assert m["rollout_is_seq_min"] == pytest.approx(0.3, rel=1e-5)
    assert m["rollout_is_seq_max"] == pytest.approx(1.5, rel=1e-5)
    assert m["rollout_is_seq_max_deviation"] == pytest.approx(0.7, rel=1e-5)
    # raw geometric ratios 1.040, 0.980, 2.236, 0.3 vs [0.5, 2]
    assert m["rollout_is_seq_fraction_high"] == pytest.approx(1 / 4)
    assert m["rollout_is_seq_fraction_low"] == pytest.approx(1 / 4)


def test_is_weight_statistics_are_accurate_on_large_batches():
    # 100k tokens, every ratio 1.7 (weights all 1.7): std must be 0 and ESS exactly 1, whatever the batch size
    n = 100_000
    rollout = torch.full((n,), -1.0)
    train = rollout + math.log(1.7)
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0)
    res = compute_rollout_correction(train, rollout, torch.ones(n), torch.tensor([0, n]), cfg)
    m = metrics_of(res)
    w = res.is_weights.double()
    assert float(w.std(unbiased=False)) == 0.0
    assert m["rollout_is_std"] == pytest.approx(0.0, abs=1e-6)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-9)
    assert m["chi2_token"] == pytest.approx(float((w * w).mean()) - 1, rel=1e-6)


def _small_mismatch_batch():
    # weights 1 +- 0.001 over 100k tokens, none capped: std ~1e-3 and chi2 ~1e-6 need float64 accumulation
    g = torch.Generator().manual_seed(0)
    n = 100_000
    rollout = -torch.rand(n, generator=g)
    train = rollout + 0.001 * torch.randn(n, generator=g)
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0)
    res = compute_rollout_correction(train, rollout, torch.ones(n), torch.tensor([0, n]), cfg)
    return train, rollout, res


def test_is_std_accurate_for_small_mismatch():
    _, _, res = _small_mismatch_batch()
    w = res.is_weights.double()  # every token is kept and no weight is capped
    assert metrics_of(res)["rollout_is_std"] == pytest.approx(float(w.std(unbiased=False)), rel=1e-3)


def test_chi2_token_accurate_for_small_mismatch():
    train, rollout, res = _small_mismatch_batch()
    r = torch.exp((train - rollout).float()).double()
    assert metrics_of(res)["chi2_token"] == pytest.approx(float((r * r).mean()) - 1, rel=1e-2, abs=1e-9)


def test_ess_never_exceeds_one():
    for seed in range(4):
        train, rollout, mask = random_batch(seed)
        for cfg in CONFIGS:
            if cfg.is_enabled:
                assert metrics_of(run_engine(train, rollout, mask, cfg))["rollout_is_eff_sample_size"] <= 1 + 1e-12


# ---------------------------------------------------------------------------------------------------------------
# (e) memory: the result holds no token-sized tensor besides is_weights and keep_mask; no gradient
# ---------------------------------------------------------------------------------------------------------------
def _tensors(obj, path="result"):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from _tensors(v, f"{path}.{k}")


def test_result_holds_no_token_sized_tensors():
    train, rollout, mask = random_batch(3, n_seqs=9)
    cfg = RolloutCorrectionConfig(is_level="geometric", is_batch_normalize=True, veto_threshold=1e-4,
                                  rs=parse_rejection_criteria("token_k3,seq_max_k2", "2.0,3.0"))
    res = run_engine(train, rollout, mask, cfg)
    n = sum(t.numel() for t in train)
    assert n > 9
    found = list(_tensors(res))
    assert {p for p, _ in found} >= {"result.is_weights", "result.keep_mask"}
    for path, t in found:
        if path in ("result.is_weights", "result.keep_mask"):
            assert t.shape == (n,)
        else:
            assert t.numel() < n, path
            if path.startswith("result.sequences"):
                assert t.shape == (9,), path
            else:
                assert t.numel() == 1, path


def test_weights_carry_no_gradient():
    train, rollout, mask = from_ratios(HAND)
    t, r, msk, cu = pack(train, rollout, mask)
    t.requires_grad_(True)
    for mode in ("truncate", "clip", "mask"):
        res = compute_rollout_correction(t, r, msk, cu, RolloutCorrectionConfig(is_level="token", is_mode=mode))
        assert not res.is_weights.requires_grad
        assert res.is_weights.dtype == torch.float32 and res.keep_mask.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# (f) per-sequence statistics
# ---------------------------------------------------------------------------------------------------------------
def test_sequences_dict_hand():
    train, rollout, mask = from_ratios(HAND)
    cfg = RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_upper_bound=2.0)
    s = run_engine(train, rollout, mask, cfg).sequences
    torch.testing.assert_close(s["valid_tokens"].double(), torch.tensor([3.0, 2, 2, 1], dtype=torch.float64))
    torch.testing.assert_close(s["log_ratio_sum"].double(),
                               torch.tensor([math.log(x) for x in (sA, sB, sC, sD)], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s["kept"].double(), torch.tensor([1.0, 1, 0, 0], dtype=torch.float64))
    # mask mode: the sequence weight is the (safety-bounded) ratio itself
    torch.testing.assert_close(s["is_weight"].double(), torch.tensor([sA, sB, sC, sD], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)
    ro_means = [sum(r.tolist()) / r.numel() for r in rollout]
    tr_means = [sum(t.tolist()) / t.numel() for t in train]
    torch.testing.assert_close(s["rollout_log_prob_mean"].double(), torch.tensor(ro_means, dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s["train_log_prob_mean"].double(), torch.tensor(tr_means, dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cfg_index", [0, 5, 9, 12])
@pytest.mark.parametrize("seed", [1, 2])
def test_sequences_dict_vs_reference(cfg_index, seed):
    cfg = CONFIGS[cfg_index]
    train, rollout, mask = random_batch(seed, nonfinite=cfg.on_nonfinite == "reject")
    res = run_engine(train, rollout, mask, cfg)
    ref = reference_sequences(train, rollout, mask, cfg)
    valid = torch.tensor(ref["valid_tokens"]) > 0
    assert set(res.sequences) == set(ref)
    for key, values in ref.items():
        got = res.sequences[key].double()
        want = torch.tensor(values, dtype=torch.float64)
        if key == "is_weight":
            norm = float(res.metrics.get("rollout_is_batch_norm_factor", 1.0))
            want = want / norm
            got, want = got[valid], want[valid]  # an empty sequence has no weight to speak of
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=key)


# ---------------------------------------------------------------------------------------------------------------
# (b) random batches vs the per-sequence loop reference
# ---------------------------------------------------------------------------------------------------------------
def random_batch(seed, n_seqs=None, nonfinite=False):
    """Variable lengths (including an empty and a fully masked sample), a spread of mismatch scales, outliers
    beyond the safety bound, prompt-like masked prefixes and non-finite values outside (and optionally inside)
    the loss mask."""
    g = torch.Generator().manual_seed(seed)
    b = n_seqs or int(torch.randint(8, 16, (1,), generator=g))
    scales = [0.01, 0.1, 0.4, 1.0, 2.0]
    train, rollout, mask = [], [], []
    for i in range(b):
        n = 0 if i == 1 else int(torch.randint(1, 40, (1,), generator=g))
        ro = -3.0 * torch.rand(n, generator=g)
        lr = scales[int(torch.randint(len(scales), (1,), generator=g))] * torch.randn(n, generator=g)
        if n and float(torch.rand(1, generator=g)) < 0.3:  # an outlier token, sometimes beyond +-20
            lr[int(torch.randint(n, (1,), generator=g))] = float(torch.empty(1).uniform_(-26, 24, generator=g))
        m = (torch.rand(n, generator=g) > 0.15).float()
        m[: int(torch.randint(0, max(n // 3, 1), (1,), generator=g))] = 0  # prompt-like prefix
        if i == 2:
            m.zero_()  # fully masked sample
        tr = ro + lr
        if n and m.numel() and float(m.min()) == 0:  # NaN / inf outside the loss mask must be ignored
            j = int(torch.nonzero(m == 0)[0, 0])
            tr[j] = float("nan") if i % 2 else -float("inf")
        if nonfinite and n > 2 and i % 4 == 3 and float(m.sum()) > 0:
            j = int(torch.nonzero(m > 0)[-1, 0])
            tr[j] = float("nan") if i % 8 == 3 else float("inf")
        train.append(tr.float())
        rollout.append(ro.float())
        mask.append(m)
    return train, rollout, mask


def _rs(levels, upper):
    return parse_rejection_criteria(levels, upper)


CONFIGS = [
    RolloutCorrectionConfig(is_level="token", is_mode="truncate"),
    RolloutCorrectionConfig(is_level="token", is_mode="clip", is_upper_bound=3.0, is_lower_bound=0.3),
    RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=1.5),
    RolloutCorrectionConfig(is_level="sequence", is_mode="truncate", is_upper_bound=5.0),
    RolloutCorrectionConfig(is_level="sequence", is_mode="clip", is_upper_bound=4.0),
    RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_upper_bound=20.0, is_batch_normalize=True),
    RolloutCorrectionConfig(is_level="geometric", is_mode="truncate", is_upper_bound=1.2),
    RolloutCorrectionConfig(is_level="geometric", is_mode="clip", is_upper_bound=1.3, quantile_bins_per_octave=16),
    RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.5, is_batch_normalize=True),
    RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_batch_normalize=True, veto_threshold=1e-4,
                            rs=_rs("token", 4.0)),
    RolloutCorrectionConfig(rs=_rs("geometric,seq_max_k3", "0.7_1.4,1.0")),
    RolloutCorrectionConfig(is_level="sequence", is_mode="truncate", is_batch_normalize=True, on_nonfinite="reject",
                            rs=_rs("seq_sum_k2,seq_mean_k3", "2.0,0.1")),
    RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=3.0, is_batch_normalize=True,
                            veto_threshold=1e-6, on_nonfinite="reject",
                            rs=_rs("token_k2,token_k3,seq_mean_k1", "0.5,0.5,0.8_1.3")),
    RolloutCorrectionConfig(is_level="geometric", is_mode="clip", quantile_bins_per_octave=32,
                            rs=_rs("sequence,seq_sum_k3,token_k1", "0.1_10,3.0,0.05_8")),
    RolloutCorrectionConfig(veto_threshold=1e-3, on_nonfinite="reject", rs=_rs("seq_mean_k2,seq_sum_k1", "0.05,50")),
    RolloutCorrectionConfig(is_level="token", is_mode="clip", is_upper_bound=2.5, quantile_bins_per_octave=1024,
                            rs=_rs("seq_max_k2,seq_mean_k3,geometric", "4.0,0.2,1.5")),
]


def _check_against_reference(cfg, train, rollout, mask):
    res = run_engine(train, rollout, mask, cfg)
    ref_w, ref_keep, ref_m = reference_correction(train, rollout, mask, cfg)
    torch.testing.assert_close(res.keep_mask, torch.cat(ref_keep).float(), rtol=0, atol=1e-5)
    if ref_w is None:
        assert res.is_weights is None
    else:
        torch.testing.assert_close(res.is_weights, torch.cat(ref_w).float(), rtol=1e-5, atol=1e-5)
    m = metrics_of(res)
    assert set(m) == set(ref_m)
    bins = cfg.quantile_bins_per_octave
    for key, want in ref_m.items():
        got = m[key]
        if key in QUANTILE_KEYS:
            if want == 0.0:
                assert got == 0.0, key
            else:
                assert _within_bin(got, math.log(want), bins), (key, got, want)
        elif key.startswith("rollout_rs_") and not key.endswith("masked_fraction"):  # verl's RS statistics
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6), (key, got, want)
        else:
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (key, got, want)
    return res, ref_m


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("cfg_index", range(len(CONFIGS)))
def test_engine_matches_reference(cfg_index, seed):
    cfg = CONFIGS[cfg_index]
    train, rollout, mask = random_batch(seed, nonfinite=cfg.on_nonfinite == "reject")
    res, ref_m = _check_against_reference(cfg, train, rollout, mask)
    assert torch.isfinite(res.keep_mask).all()
    if cfg.rejects and seed == 0:
        assert ref_m["rejected_token_fraction"] > 0  # the config really rejects something on this data


def test_random_batches_exercise_the_edge_cases():
    train, rollout, mask = random_batch(0, nonfinite=True)
    assert train[1].numel() == 0 and float(mask[2].sum()) == 0
    assert any(bool(torch.isnan(t).any()) for t in train)
    lr = torch.cat([(t - r)[m > 0] for t, r, m in zip(train, rollout, mask)])
    assert bool((~torch.isfinite(lr)).any())  # non-finite loss tokens are present with nonfinite=True
    assert float(lr[torch.isfinite(lr)].abs().max()) > 3


@pytest.mark.parametrize("seed", [10, 11])
def test_engine_matches_reference_large_batch(seed):
    train, rollout, mask = random_batch(seed, n_seqs=120)
    for cfg in (CONFIGS[0], CONFIGS[4], CONFIGS[9]):
        _check_against_reference(cfg, train, rollout, mask)
