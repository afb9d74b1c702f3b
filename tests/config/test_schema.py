"""Validation and construction of RolloutCorrectionConfig, RejectionCriterion and parse_rejection_criteria.

Every invalid value must raise ValueError whose message names the field, shows the value, and says how to fix it.
"""

import math

import pytest
import torch

from slime_rc import (IS_LEVELS, IS_MODES, RS_OPTIONS, RejectionCriterion, RolloutCorrectionConfig,
                      compute_rollout_correction, cu_seqlens_from_lengths, parse_rejection_criteria)

from tests.checks import raises_mentioning as _raises


# ---------------------------------------------------------------------------------------------------------------
# RolloutCorrectionConfig field validation
# ---------------------------------------------------------------------------------------------------------------

def test_defaults_are_valid_and_off():
    c = RolloutCorrectionConfig()
    assert c.is_level is None and not c.is_enabled
    assert c.is_mode == "truncate"
    assert c.rs == ()
    assert c.veto_threshold is None
    assert c.safety_bound == 20.0
    assert c.on_nonfinite == "error"
    assert not c.rejects


@pytest.mark.parametrize("level", IS_LEVELS + (None,))
def test_every_is_level_accepted(level):
    assert RolloutCorrectionConfig(is_level=level).is_level == level


@pytest.mark.parametrize("mode", IS_MODES)
def test_every_is_mode_accepted(mode):
    assert RolloutCorrectionConfig(is_level="token", is_mode=mode).is_mode == mode


def test_unknown_is_level_near_miss_suggests():
    _raises(lambda: RolloutCorrectionConfig(is_level="tokn"), "is_level", "'tokn'", "Did you mean 'token'?",
            "sequence", "geometric")


def test_unknown_is_level_far_miss_lists_choices():
    msg = _raises(lambda: RolloutCorrectionConfig(is_level="zzzzzz"), "is_level", "'zzzzzz'", "token")
    assert "Did you mean" not in msg


def test_unknown_is_mode_near_miss_suggests():
    _raises(lambda: RolloutCorrectionConfig(is_level="token", is_mode="trunc"), "is_mode", "'trunc'",
            "Did you mean 'truncate'?", "clip", "mask")
    _raises(lambda: RolloutCorrectionConfig(is_level="token", is_mode="clipp"), "Did you mean 'clip'?")


@pytest.mark.parametrize("lower,upper", [(2.0, 2.0), (3.0, 2.0), (1.5, 1.2)])
def test_lower_not_below_upper(lower, upper):
    _raises(lambda: RolloutCorrectionConfig(is_level="token", is_lower_bound=lower, is_upper_bound=upper),
            "is_lower_bound", str(float(lower)), "is_upper_bound", str(float(upper)), "leave it unset")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_upper_bound_non_positive_or_non_finite(bad):
    _raises(lambda: RolloutCorrectionConfig(is_level="token", is_upper_bound=bad),
            f"is_upper_bound={bad!r}", "finite number > 0", "2.0")


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_lower_bound_non_positive_or_non_finite(bad):
    _raises(lambda: RolloutCorrectionConfig(is_level="token", is_lower_bound=bad),
            f"is_lower_bound={bad!r}", "finite number > 0", "unset")


def test_upper_bound_not_a_number():
    _raises(lambda: RolloutCorrectionConfig(is_upper_bound="two"), "is_upper_bound='two'", "not a number")


def test_upper_bound_at_most_one_without_lower():
    # clip and mask use the lower bound 1/upper, which must stay below the upper bound
    for mode in ("clip", "mask"):
        _raises(lambda: RolloutCorrectionConfig(is_level="token", is_mode=mode, is_upper_bound=1.0),
                "is_upper_bound=1.0", "> 1", "is_lower_bound")
        _raises(lambda: RolloutCorrectionConfig(is_level="token", is_mode=mode, is_upper_bound=0.5),
                "is_upper_bound=0.5")
    # truncate only caps from above: a cap at (or below) 1 is legal (vanilla TIS with tis_clip=1)
    assert RolloutCorrectionConfig(is_level="token", is_upper_bound=1.0).is_upper_bound == 1.0
    # with an explicit lower bound an upper bound < 1 is legal
    c = RolloutCorrectionConfig(is_level="token", is_upper_bound=0.9, is_lower_bound=0.1)
    assert c.is_lower == 0.1


@pytest.mark.parametrize("upper", [1.5, 2.0, 3.0, 10.0])
def test_default_lower_is_reciprocal_of_upper(upper):
    c = RolloutCorrectionConfig(is_level="token", is_upper_bound=upper)
    assert c.is_lower_bound is None
    assert c.is_lower == pytest.approx(1.0 / upper, rel=1e-15)
    c2 = RolloutCorrectionConfig(is_level="token", is_upper_bound=upper, is_lower_bound=0.25 / upper)
    assert c2.is_lower == pytest.approx(0.25 / upper)


def test_default_lower_bound_used_by_clip_mode():
    # clip mode must clamp to [1/upper, upper] when the lower bound is unset
    cfg = RolloutCorrectionConfig(is_level="token", is_mode="clip", is_upper_bound=4.0)
    train = torch.tensor([math.log(0.01), 0.0, math.log(100.0)])
    rollout = torch.zeros(3)
    res = compute_rollout_correction(train, rollout, torch.ones(3), cu_seqlens_from_lengths([3]), cfg)
    assert res.is_weights.tolist() == pytest.approx([0.25, 1.0, 4.0], rel=1e-6)


@pytest.mark.parametrize("veto", [1.0, 1.5, 100.0])
def test_veto_at_least_one(veto):
    _raises(lambda: RolloutCorrectionConfig(veto_threshold=veto), f"veto_threshold={float(veto)}", "must be < 1",
            "1e-4")


@pytest.mark.parametrize("veto", [0.0, -1e-4, float("nan"), float("inf")])
def test_veto_non_positive_or_non_finite(veto):
    _raises(lambda: RolloutCorrectionConfig(veto_threshold=veto), f"veto_threshold={veto!r}", "1e-4")


def test_veto_valid():
    assert RolloutCorrectionConfig(veto_threshold=1e-4).veto_threshold == 1e-4
    assert RolloutCorrectionConfig(veto_threshold=1e-4).rejects


def test_on_nonfinite_unknown():
    _raises(lambda: RolloutCorrectionConfig(on_nonfinite="raise"), "on_nonfinite='raise'", "'error'", "'reject'")


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf")])
def test_safety_bound_non_positive(bad):
    _raises(lambda: RolloutCorrectionConfig(safety_bound=bad), f"safety_bound={bad!r}", "default is 20")


def test_safety_bound_too_large():
    _raises(lambda: RolloutCorrectionConfig(safety_bound=100.0), "safety_bound=100.0", "at most 80")
    assert RolloutCorrectionConfig(safety_bound=80).safety_bound == 80.0


def test_rs_entries_must_be_criteria():
    _raises(lambda: RolloutCorrectionConfig(rs=("token",)), "rs entries", "'token'", "parse_rejection_criteria")
    # a single criterion is wrapped into a tuple
    c = RolloutCorrectionConfig(rs=RejectionCriterion("token", 2.0))
    assert c.rs == (RejectionCriterion("token", 2.0),)


def test_quantile_bins_invalid():
    _raises(lambda: RolloutCorrectionConfig(quantile_bins_per_octave=100), "quantile_bins_per_octave=100")


def test_config_is_frozen():
    c = RolloutCorrectionConfig()
    with pytest.raises(Exception):
        c.is_level = "token"


# ---------------------------------------------------------------------------------------------------------------
# RejectionCriterion and parse_rejection_criteria
# ---------------------------------------------------------------------------------------------------------------

K1_OPTIONS = [o for o, spec in RS_OPTIONS.items() if spec[2] == "k1"]
KDIV_OPTIONS = [o for o, spec in RS_OPTIONS.items() if spec[2] != "k1"]


def test_rs_option_table_complete():
    expected = {"token", "sequence", "geometric", "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"}
    assert set(RS_OPTIONS) == expected


@pytest.mark.parametrize("option", list(RS_OPTIONS))
def test_every_option_parses(option):
    (c,) = parse_rejection_criteria(option, 2.0 if option in K1_OPTIONS else 0.01)
    assert c.option == option
    gran, agg, stat = RS_OPTIONS[option]
    assert (c.granularity, c.aggregate, c.statistic) == (gran, agg, stat)
    if stat == "k1":
        assert c.upper == 2.0 and c.lower == pytest.approx(0.5)
        assert c.log_bounds == pytest.approx((math.log(0.5), math.log(2.0)))
    else:
        assert c.upper == 0.01 and c.lower is None
        assert c.log_bounds == (-math.inf, 0.01)


@pytest.mark.parametrize("option", K1_OPTIONS)
def test_lo_hi_string(option):
    (c,) = parse_rejection_criteria(option, "0.5_2.0")
    assert (c.lower, c.upper) == (0.5, 2.0)
    (c,) = parse_rejection_criteria(option, "0.999_1.001")
    assert (c.lower, c.upper) == (0.999, 1.001)


def test_lo_hi_string_malformed():
    _raises(lambda: parse_rejection_criteria("token", "a_b"), "'a_b'", "'token'", "0.5_2.0")
    _raises(lambda: parse_rejection_criteria("token", "2.0_0.5"), "lower=2.0", "upper=0.5", "'token'", "0.5_2.0")


def test_plain_lower_applies_to_k1_options_without_own_lower():
    cs = parse_rejection_criteria("token,seq_mean_k3,geometric", "3.0,0.05,0.9_1.1", lower=0.2)
    assert [c.option for c in cs] == ["token", "seq_mean_k3", "geometric"]
    assert (cs[0].lower, cs[0].upper) == (0.2, 3.0)
    assert (cs[1].lower, cs[1].upper) == (None, 0.05)
    assert (cs[2].lower, cs[2].upper) == (0.9, 1.1)  # the lo_hi string wins over the plain lower


def test_single_shared_threshold():
    cs = parse_rejection_criteria("token,sequence,geometric", 1.5)
    assert [c.upper for c in cs] == [1.5, 1.5, 1.5]
    assert all(c.lower == pytest.approx(1 / 1.5) for c in cs)
    cs = parse_rejection_criteria(["token", "geometric"], "0.8_1.25")
    assert [(c.lower, c.upper) for c in cs] == [(0.8, 1.25), (0.8, 1.25)]


def test_one_threshold_per_option_comma_list_and_list():
    cs = parse_rejection_criteria("token_k1,seq_max_k2,seq_sum_k3", "0.5_2.0, 0.1, 0.3")
    assert [(c.option, c.lower, c.upper) for c in cs] == [
        ("token_k1", 0.5, 2.0), ("seq_max_k2", None, 0.1), ("seq_sum_k3", None, 0.3)]
    cs2 = parse_rejection_criteria(["token_k1", "seq_max_k2", "seq_sum_k3"], ["0.5_2.0", 0.1, 0.3])
    assert cs2 == cs


@pytest.mark.parametrize("upper", ["2.0,3.0", [2.0, 3.0], "1,2,3,4"])
def test_wrong_threshold_count(upper):
    _raises(lambda: parse_rejection_criteria("token,sequence,geometric", upper), "rs thresholds", "3 options",
            "one per option")


@pytest.mark.parametrize("option", KDIV_OPTIONS)
def test_k2_k3_refuse_lower_bound(option):
    _raises(lambda: parse_rejection_criteria(option, "0.001_0.1"), repr(option), "lower=0.001", "divergence",
            "*_k1")
    _raises(lambda: RejectionCriterion(option, 0.1, lower=0.01), repr(option), "lower=0.01")


@pytest.mark.parametrize("option", KDIV_OPTIONS)
def test_k2_k3_plain_lower_is_not_applied(option):
    # the plain lower ratio bound is only for k1 options; it must not leak into divergence options
    (k1, c) = parse_rejection_criteria(f"token,{option}", "2.0,0.1", lower=0.4)
    assert k1.lower == 0.4 and c.lower is None
    # and with no k1 option to apply to it would be a silent no-op: refused
    _raises(lambda: parse_rejection_criteria(option, 0.1, lower=0.5), "rs_lower_bound=0.5", "no effect", option)


def test_unknown_option_with_suggestion():
    _raises(lambda: parse_rejection_criteria("tokn_k1", 2.0), "rs_level='tokn_k1'", "Did you mean 'token_k1'?")
    _raises(lambda: parse_rejection_criteria("token,seq_men_k3", "2.0,0.1"), "'seq_men_k3'",
            "Did you mean 'seq_mean_k3'?")
    _raises(lambda: RejectionCriterion("geometrc", 2.0), "'geometrc'", "Did you mean 'geometric'?")


def test_deduplication_keeps_order():
    cs = parse_rejection_criteria("geometric, token,geometric,,token", 2.0)
    assert [c.option for c in cs] == ["geometric", "token"]
    cs = parse_rejection_criteria(["seq_max_k2", "seq_max_k2"], 0.1)
    assert len(cs) == 1


def test_empty_levels_give_no_criteria():
    assert parse_rejection_criteria(None, 2.0) == ()
    assert parse_rejection_criteria("", 2.0) == ()
    assert parse_rejection_criteria([], None) == ()


def test_missing_threshold_is_clear_error():
    _raises(lambda: parse_rejection_criteria("token", None), "needs a threshold", "rs_upper_bound", "'token'")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "x"])
def test_criterion_bad_upper(bad):
    _raises(lambda: RejectionCriterion("token", bad), "rs upper bound for 'token'", "2.0")


def test_criterion_bad_lower():
    _raises(lambda: RejectionCriterion("token", 2.0, lower=-0.1), "rs lower bound for 'token'", "-0.1")
    _raises(lambda: RejectionCriterion("token", 2.0, lower=3.0), "lower=3.0", "upper=2.0", "0.5_2.0")
    _raises(lambda: RejectionCriterion("token", 1.0), "lower=1.0", "upper=1.0")  # default 1/1 == 1


def _token_batch(ratios):
    """One sequence whose token ratios r = pi_train/pi_rollout are ``ratios``."""
    rollout = torch.full((len(ratios),), -1.0)
    train = rollout + torch.log(torch.tensor(ratios, dtype=torch.float32))
    return train, rollout, torch.ones(len(ratios)), cu_seqlens_from_lengths([len(ratios)])


@pytest.mark.parametrize("option", ["token_k1", "token"])
def test_k1_bounds_are_not_inverted(option):
    # asymmetric band on r = pi_train/pi_rollout: 0.9 <= r <= 1.5.  An inverting implementation would use
    # [1/1.5, 1/0.9] = [0.667, 1.111] and flip the decisions for 1.4 and 0.8.
    cfg = RolloutCorrectionConfig(rs=parse_rejection_criteria(option, "0.9_1.5"))
    res = compute_rollout_correction(*_token_batch([1.4, 0.8, 1.6, 0.95, 1.0]), cfg)
    assert res.keep_mask.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]


def test_k1_sequence_band_not_inverted():
    # geometric-mean ratio of each sequence: 1.4 and 0.8; band [0.9, 1.5] keeps the first, rejects the second
    rollout = torch.full((4,), -2.0)
    train = rollout + torch.log(torch.tensor([1.4, 1.4, 0.8, 0.8]))
    cfg = RolloutCorrectionConfig(rs=parse_rejection_criteria("seq_mean_k1", "0.9_1.5"))
    res = compute_rollout_correction(train, rollout, torch.ones(4), cu_seqlens_from_lengths([2, 2]), cfg)
    assert res.keep_mask.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_k2_token_threshold_bounds_divergence():
    # k2 = (log r)^2 / 2; threshold 0.02 keeps |log r| <= 0.2
    cfg = RolloutCorrectionConfig(rs=parse_rejection_criteria("token_k2", 0.02))
    res = compute_rollout_correction(*_token_batch([math.exp(0.19), math.exp(-0.21), math.exp(0.25), 1.0]), cfg)
    assert res.keep_mask.tolist() == [1.0, 0.0, 0.0, 1.0]


# ---------------------------------------------------------------------------------------------------------------
# from_dict / to_dict
# ---------------------------------------------------------------------------------------------------------------

def test_from_dict_full_slime_key_set():
    d = dict(use_tis=True, use_rs=True, tis_level="sequence", rs_level="token,seq_mean_k3", tis_mode="clip",
             tis_lower_bound=0.3, tis_upper_bound=3.0, rs_lower_bound=0.4, rs_upper_bound="2.5,0.05",
             rs_veto_threshold=1e-5, tis_batch_normalize=True)
    c = RolloutCorrectionConfig.from_dict(d)
    assert c.is_level == "sequence"
    assert c.is_mode == "clip"
    assert (c.is_lower_bound, c.is_upper_bound) == (0.3, 3.0)
    assert c.is_batch_normalize is True
    assert c.veto_threshold == 1e-5
    assert c.rs == (RejectionCriterion("token", 2.5, 0.4), RejectionCriterion("seq_mean_k3", 0.05))


def test_from_dict_use_tis_defaults_to_token_level():
    c = RolloutCorrectionConfig.from_dict({"use_tis": True, "tis_upper_bound": 2.0})
    assert c.is_level == "token"
    assert c.is_lower == pytest.approx(0.5)


def test_from_dict_use_tis_false_means_no_is():
    c = RolloutCorrectionConfig.from_dict({"use_tis": False, "tis_level": "sequence", "tis_mode": "clip"})
    assert c.is_level is None and not c.is_enabled
    res = compute_rollout_correction(*_token_batch([1.5, 0.5]), c)
    assert res.is_weights is None
    assert not any(k.startswith("rollout_is_") for k in res.metrics)


def test_from_dict_tis_level_without_use_tis():
    _raises(lambda: RolloutCorrectionConfig.from_dict({"tis_level": "token"}), "tis_level='token'", "use_tis")


def test_from_dict_use_rs_without_threshold_is_the_is_band_for_ratios_and_an_error_for_divergences():
    assert RolloutCorrectionConfig.from_dict({"use_rs": True, "rs_level": "geometric"}).rs == (
        RejectionCriterion("geometric", 2.0, 0.5),)
    _raises(lambda: RolloutCorrectionConfig.from_dict({"use_rs": True, "rs_level": "seq_mean_k3"}),
            "needs a threshold", "rs_upper_bound", "seq_mean_k3")


def test_from_dict_use_rs_defaults_to_token_and_pure_rs():
    c = RolloutCorrectionConfig.from_dict({"use_rs": True, "rs_upper_bound": 2.0})
    assert c.rs == (RejectionCriterion("token", 2.0),)
    assert c.is_level is None
    res = compute_rollout_correction(*_token_batch([3.0, 1.0, 0.4]), c)
    assert res.keep_mask.tolist() == [0.0, 1.0, 0.0]  # pure RS without IS rejects


def test_from_dict_use_rs_false_gives_no_rs():
    c = RolloutCorrectionConfig.from_dict({"use_rs": False, "use_tis": True})
    assert c.rs == ()


@pytest.mark.parametrize("alias,key,value,field,expected", [
    ("mis_level", "tis_level", "geometric", "is_level", "geometric"),
    ("mis_mode", "tis_mode", "mask", "is_mode", "mask"),
    ("mis_lower_bound", "tis_lower_bound", 0.2, "is_lower_bound", 0.2),
    ("mis_upper_bound", "tis_upper_bound", 4.0, "is_upper_bound", 4.0),
    ("mis_veto_threshold", "rs_veto_threshold", 1e-6, "veto_threshold", 1e-6),
    ("mis_batch_normalize", "tis_batch_normalize", True, "is_batch_normalize", True),
])
def test_from_dict_mis_aliases(alias, key, value, field, expected):
    c = RolloutCorrectionConfig.from_dict({"use_tis": True, alias: value})
    assert getattr(c, field) == expected
    # the alias and the key spelled the same way with the same value is fine
    c2 = RolloutCorrectionConfig.from_dict({"use_tis": True, alias: value, key: value})
    assert c2 == c


def test_from_dict_conflicting_alias_and_key():
    _raises(lambda: RolloutCorrectionConfig.from_dict({"use_tis": True, "mis_mode": "clip", "tis_mode": "mask"}),
            "'mis_mode'", "'tis_mode'", "'clip'", "'mask'", "keep one")


def test_from_dict_unknown_key_suggests_closest():
    _raises(lambda: RolloutCorrectionConfig.from_dict({"use_tis": True, "tis_uper_bound": 2.0}),
            "'tis_uper_bound'", "Did you mean 'tis_upper_bound'?")
    _raises(lambda: RolloutCorrectionConfig.from_dict({"rs_veto_treshold": 1e-4}), "'rs_veto_treshold'",
            "Did you mean 'rs_veto_threshold'?")
    msg = _raises(lambda: RolloutCorrectionConfig.from_dict({"qqqqqqqq": 1}), "'qqqqqqqq'", "Valid keys")
    assert "use_tis" in msg and "is_level" in msg


def test_from_dict_slime_and_own_spelling_conflict():
    _raises(lambda: RolloutCorrectionConfig.from_dict({"use_tis": True, "is_level": "token"}), "'use_tis'",
            "'is_level'")


def test_from_dict_invalid_value_still_validated():
    _raises(lambda: RolloutCorrectionConfig.from_dict({"use_tis": True, "tis_level": "tokn"}),
            "is_level='tokn'", "Did you mean 'token'?")
    _raises(lambda: RolloutCorrectionConfig.from_dict({"use_tis": True, "tis_upper_bound": -2}),
            "is_upper_bound=-2")


def test_from_dict_own_field_names():
    c = RolloutCorrectionConfig.from_dict({"is_level": "geometric", "is_upper_bound": 1.01, "safety_bound": 10.0,
                                           "on_nonfinite": "reject"})
    assert (c.is_level, c.is_upper_bound, c.safety_bound, c.on_nonfinite) == ("geometric", 1.01, 10.0, "reject")


@pytest.mark.parametrize("cfg", [
    RolloutCorrectionConfig(),
    RolloutCorrectionConfig(is_level="token", is_mode="clip", is_upper_bound=3.0, is_lower_bound=0.2),
    RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.01, is_batch_normalize=True,
                            rs=parse_rejection_criteria("token_k1,seq_max_k3", "0.5_2.0,0.1"),
                            veto_threshold=1e-4, on_nonfinite="reject", rejected_in_denominator=True),
])
def test_to_dict_round_trip(cfg):
    d = cfg.to_dict()
    assert isinstance(d["rs"], list)
    assert all(isinstance(c, dict) and set(c) == {"option", "upper", "lower"} for c in d["rs"])
    assert d["is_level"] == cfg.is_level
    assert RolloutCorrectionConfig.from_dict(d) == cfg


def test_from_dict_rs_string_rejected():
    _raises(lambda: RolloutCorrectionConfig.from_dict({"rs": "token"}), "rs='token'", "use_rs")


def test_rs_keys_without_use_rs_are_refused():
    with pytest.raises(ValueError, match="rs_level.*without use_rs"):
        RolloutCorrectionConfig.from_dict({"rs_level": "geometric", "rs_upper_bound": 1.001})
    # use_rs: false with thresholds left in the file is an explicit "off"
    assert RolloutCorrectionConfig.from_dict({"use_rs": False, "rs_level": "token", "rs_upper_bound": 2.0}).rs == ()
