"""The 24 named presets: classmethods of RolloutCorrectionConfig, ``RolloutCorrectionConfig.preset(name)`` and
``--rollout-correction-preset NAME``.

The expected table below is written by hand from the preset docstrings (slime_rc/config/presets.py) and the estimator
definitions of rollout_corr_math.md: "decoupled" = PPO with recomputed pi_old, "bypass"/"pg" = rollout log-probs as
pi_old (pg = REINFORCE), "*_is" = truncated IS (default upper 2.0), "geo_rs" = geometric-mean ratio band
[0.999, 1.001], "k3_rs" = sequence-mean k3 <= 0.01, "icepop" = token weights masked outside [0.5, 5].
"""

import argparse
import json
import warnings

import pytest

from slime_rc import PRESETS, RS_OPTIONS, RejectionCriterion, RolloutCorrectionConfig
from slime_rc.config.arguments import add_rollout_correction_arguments, config_from_args
from slime_rc.config.knobs import SETTINGS

from tests.checks import raises_mentioning as _raises

C = RolloutCorrectionConfig


GEO = (("geometric", 1.001, 0.999),)       # rollout_corr_math.md spelling of the geometric filter
GEO_K1 = (("seq_mean_k1", 1.001, 0.999),)  # verl's current spelling of the same filter
K3 = (("seq_mean_k3", 0.01, None),)

# name: (mode, loss_type, is_level, is_mode, is_upper, is_lower, rs, veto, rejected_in_denominator,
#        get_mismatch_metrics, is_weights_applied)
EXPECTED = {
    "decoupled_token_is":         ("decoupled", "ppo_clip",  "token",    "truncate", 2.0, None, (), None, False, False, True),
    "decoupled_seq_is":           ("decoupled", "ppo_clip",  "sequence", "truncate", 2.0, None, (), None, False, False, True),
    "decoupled_seq_is_rs":        ("decoupled", "ppo_clip",  "sequence", "truncate", 2.0, None,
                                   (("sequence", 2.0, 0.5),), None, False, False, True),
    "decoupled_geo_rs":           ("decoupled", "ppo_clip",  None,       "truncate", 2.0, None, GEO, 1e-4, False, False, False),
    "geo_rs_seq_tis":             ("decoupled", "ppo_clip",  "sequence", "truncate", 2.0, None, GEO, None, False, False, True),
    "ppo_is_bypass":              ("bypass",    "ppo_clip",  "token",    "truncate", 2.0, None, (), None, False, False, False),
    "pg_is":                      ("bypass",    "reinforce", "sequence", "truncate", 2.0, None, (), None, False, False, True),
    "pg_rs":                      ("bypass",    "reinforce", None,       "truncate", 2.0, None, GEO, 1e-4, False, False, False),
    "pg_geo_rs_seq_tis":          ("bypass",    "reinforce", "sequence", "truncate", 2.0, None, GEO, None, False, False, True),
    "disabled":                   ("standard",  "ppo_clip",  None,       "truncate", 2.0, None, (), None, False, True, False),
    "bypass_ppo_clip":            ("bypass",    "ppo_clip",  None,       "truncate", 2.0, None, (), None, False, False, False),
    "bypass_ppo_clip_geo_rs":     ("bypass",    "ppo_clip",  None,       "truncate", 2.0, None, GEO_K1, None, False, False, False),
    "bypass_ppo_clip_k3_rs":      ("bypass",    "ppo_clip",  None,       "truncate", 2.0, None, K3, None, False, False, False),
    "bypass_pg_is":               ("bypass",    "reinforce", "sequence", "truncate", 2.0, None, (), None, False, False, True),
    "bypass_pg_geo_rs":           ("bypass",    "reinforce", None,       "truncate", 2.0, None, GEO_K1, None, False, False, False),
    "bypass_pg_geo_rs_seq_tis":   ("bypass",    "reinforce", "sequence", "truncate", 2.0, None, GEO_K1, None, False, False, True),
    "bypass_pg_geo_rs_token_tis": ("bypass",    "reinforce", "token",    "truncate", 2.0, None, GEO_K1, None, False, False, True),
    "decoupled_geo_rs_seq_tis":   ("decoupled", "ppo_clip",  "sequence", "truncate", 2.0, None, GEO_K1, None, False, False, True),
    "decoupled_geo_rs_token_tis": ("decoupled", "ppo_clip",  "token",    "truncate", 2.0, None, GEO_K1, None, False, False, True),
    "decoupled_k3_rs":            ("decoupled", "ppo_clip",  None,       "truncate", 2.0, None, K3, None, False, False, False),
    "decoupled_k3_rs_seq_tis":    ("decoupled", "ppo_clip",  "sequence", "truncate", 2.0, None, K3, None, False, False, True),
    "decoupled_k3_rs_token_tis":  ("decoupled", "ppo_clip",  "token",    "truncate", 2.0, None, K3, None, False, False, True),
    "decoupled_token_icepop":     ("decoupled", "ppo_clip",  "token",    "mask",     5.0, 0.5, (), None, True, False, True),
    "bypass_pg_token_icepop":     ("bypass",    "reinforce", "token",    "mask",     5.0, 0.5, (), None, True, False, True),
}


def _expected_config(name):
    mode, loss, level, is_mode, upper, lower, rs, veto, rid, gmm, _ = EXPECTED[name]
    return C(mode=mode, loss_type=loss, is_level=level, is_mode=is_mode, is_upper_bound=upper, is_lower_bound=lower,
             rs=tuple(RejectionCriterion(o, u, l) for o, u, l in rs), veto_threshold=veto,
             rejected_in_denominator=rid, get_mismatch_metrics=gmm)


def test_there_are_24_presets_and_the_table_covers_them():
    assert len(PRESETS) == 24
    assert set(EXPECTED) == set(PRESETS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_is_a_classmethod_equal_to_preset(name):
    method = getattr(C, name)
    assert callable(method)
    cfg = method()
    assert isinstance(cfg, C)
    assert cfg == C.preset(name)
    assert PRESETS[name].__doc__ and PRESETS[name].__doc__ in method.__doc__


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_matches_the_hand_written_table(name):
    mode, loss, level, is_mode, upper, lower, rs, veto, rid, gmm, applied = EXPECTED[name]
    cfg = getattr(C, name)()
    assert cfg.mode == mode
    assert cfg.loss_type == loss
    assert cfg.is_level == level
    if level is not None:  # the IS bounds only matter with IS on
        assert cfg.is_mode == is_mode
        assert cfg.is_upper_bound == upper
        assert cfg.is_lower_bound == lower
    assert [(c.option, c.upper, c.lower) for c in cfg.rs] == [
        (o, u, (1 / u if l is None and RS_OPTIONS[o][2] == "k1" else l)) for o, u, l in rs]
    assert cfg.veto_threshold == veto
    assert cfg.rejected_in_denominator is rid
    assert cfg.get_mismatch_metrics is gmm
    assert cfg.is_weights_applied is applied
    # the engine settings stay at their defaults
    default = C()
    for field in ("safety_bound", "on_nonfinite", "quantile_bins_per_octave", "is_batch_normalize"):
        assert getattr(cfg, field) == getattr(default, field), field
    # every preset needs the rollout log-probs (to correct, as pi_old, or for the metrics)
    assert cfg.needs_rollout_log_probs
    assert cfg == _expected_config(name)


def test_geometric_spellings_are_the_same_rejection_rule():
    # the older presets say 'geometric', the verl ones 'seq_mean_k1': one statistic, mean_t log r_t
    assert RS_OPTIONS["geometric"] == RS_OPTIONS["seq_mean_k1"] == ("sequence", "mean", "k1")
    assert RS_OPTIONS["seq_mean_k3"] == ("sequence", "mean", "k3")


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_settings_use_the_documented_keys(name):
    # presets are flat settings in the slime key set, so that a flag or YAML key can override one of them
    settings = PRESETS[name]()
    assert set(settings) <= set(SETTINGS), set(settings) - set(SETTINGS)


# ---------------------------------------------------------------------------------------------------------------
# overrides
# ---------------------------------------------------------------------------------------------------------------

def test_override_decoupled_seq_is_threshold():
    cfg = C.decoupled_seq_is(threshold=3.0)
    assert cfg == C(is_level="sequence", is_upper_bound=3.0, mode="decoupled")
    assert cfg == C.decoupled_seq_is(3.0) == C.preset("decoupled_seq_is", threshold=3.0)
    assert cfg != C.decoupled_seq_is()
    assert C.decoupled_seq_is(threshold="3") == cfg  # a number as text


def test_override_is_threshold_band_is_icepop_mask():
    cfg = C.decoupled_seq_is(threshold="0.5_4.0")
    assert (cfg.is_level, cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("sequence", "mask", 0.5, 4.0)


def test_override_decoupled_geo_rs_band():
    cfg = C.decoupled_geo_rs(rs_threshold="0.99_1.01")
    assert cfg.rs == (RejectionCriterion("geometric", 1.01, 0.99),)
    assert cfg.veto_threshold == 1e-4  # the other threshold keeps its default
    assert cfg.is_level is None and cfg.mode == "decoupled"


def test_override_decoupled_geo_rs_positional():
    cfg = C.decoupled_geo_rs("0.99_1.01", 1e-5)
    assert cfg.rs == (RejectionCriterion("geometric", 1.01, 0.99),) and cfg.veto_threshold == 1e-5
    assert cfg == C.decoupled_geo_rs(rs_threshold="0.99_1.01", veto_threshold=1e-5)


def test_override_geo_rs_single_number_is_symmetric_band():
    cfg = C.decoupled_geo_rs(rs_threshold=1.002)
    (crit,) = cfg.rs
    assert crit.upper == 1.002 and crit.lower == pytest.approx(1 / 1.002, rel=1e-15)


def test_override_decoupled_k3_rs_threshold():
    cfg = C.decoupled_k3_rs(rs_threshold=0.05)
    assert cfg.rs == (RejectionCriterion("seq_mean_k3", 0.05),) and cfg.rs[0].lower is None
    assert cfg == C.decoupled_k3_rs(0.05) == C.preset("decoupled_k3_rs", rs_threshold=0.05)


def test_override_two_thresholds():
    cfg = C.decoupled_seq_is_rs(3.0, "0.5_4.0")
    assert cfg.is_upper_bound == 3.0 and cfg.is_mode == "truncate"
    assert cfg.rs == (RejectionCriterion("sequence", 4.0, 0.5),)
    assert cfg == C.decoupled_seq_is_rs(is_threshold=3.0, rs_threshold="0.5_4.0")
    cfg = C.decoupled_k3_rs_token_tis(is_threshold="0.5_3.0", rs_threshold=0.02)
    assert (cfg.is_level, cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("token", "mask", 0.5, 3.0)
    assert cfg.rs == (RejectionCriterion("seq_mean_k3", 0.02),)


def test_override_icepop_band():
    cfg = C.decoupled_token_icepop(threshold=4.0, threshold_lower=0.25)
    assert (cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("mask", 0.25, 4.0)
    assert cfg.rejected_in_denominator is True
    assert C.bypass_pg_token_icepop(4.0, 0.25).is_upper_bound == 4.0


def test_override_veto():
    assert C.pg_rs(veto_threshold=1e-6).veto_threshold == 1e-6


def test_unknown_override_keyword_names_the_preset():
    _raises(lambda: C.decoupled_seq_is(thresold=3.0), "decoupled_seq_is", "thresold")
    _raises(lambda: C.preset("decoupled_seq_is", thresold=3.0), "decoupled_seq_is", "thresold")
    _raises(lambda: C.disabled(threshold=2.0), "disabled", "threshold")
    _raises(lambda: C.decoupled_geo_rs(threshold=2.0), "decoupled_geo_rs", "threshold")


def test_too_many_positional_thresholds_names_the_preset():
    _raises(lambda: C.decoupled_seq_is(2.0, 3.0), "decoupled_seq_is", "threshold", exc=(TypeError, ValueError))
    _raises(lambda: C.disabled(2.0), "disabled", exc=(TypeError, ValueError))


def test_threshold_given_positionally_and_by_keyword_names_the_preset():
    _raises(lambda: C.decoupled_seq_is(3.0, threshold=4.0), "decoupled_seq_is", "threshold",
            exc=(TypeError, ValueError))


def test_invalid_threshold_value_names_the_preset():
    _raises(lambda: C.decoupled_seq_is(threshold=-1.0), "is_upper_bound=-1.0", "preset decoupled_seq_is")
    _raises(lambda: C.decoupled_k3_rs(rs_threshold=0.0), "seq_mean_k3")


@pytest.mark.parametrize("call,preset,keyword", [
    (lambda: C.decoupled_seq_is(threshold="abc"), "decoupled_seq_is", "threshold"),
    (lambda: C.decoupled_seq_is(threshold="0.5_abc"), "decoupled_seq_is", "threshold"),
    (lambda: C.decoupled_geo_rs(rs_threshold="abc"), "decoupled_geo_rs", "rs_threshold"),
    (lambda: C.decoupled_k3_rs_seq_tis(rs_threshold="abc"), "decoupled_k3_rs_seq_tis", "rs_threshold"),
], ids=["is-abc", "is-band-abc", "rs-abc", "k3-rs-abc"])
def test_non_numeric_threshold_names_the_preset_or_the_keyword(call, preset, keyword):
    # the user typed preset(keyword="abc"): the message must lead back to one of the two
    msg = _raises(call, "abc")
    assert preset in msg or f"{keyword}=" in msg, msg


def test_k3_preset_refuses_a_lower_bound():
    # docs/configuration.md: "k2/k3 options take a single upper bound; giving them "lo_hi" is an error that says so"
    _raises(lambda: C.decoupled_k3_rs(rs_threshold="0.5_0.01"), "seq_mean_k3")
    _raises(lambda: C.bypass_ppo_clip_k3_rs("0.5_0.01"), "seq_mean_k3")


@pytest.mark.parametrize("call", [lambda: C.decoupled_seq_is(threshold="0.5_2_0"),
                                  lambda: C.decoupled_geo_rs(rs_threshold="0.99_1.01_5")],
                         ids=["is", "rs"])
def test_threshold_with_two_underscores_is_refused(call):
    # 'lower_upper' has one underscore; float('2_0') == 20.0, so the typo '0.5_2_0' would become [0.5, 20]
    with pytest.raises(ValueError):
        call()


def test_unknown_preset_name_suggests_the_closest():
    msg = _raises(lambda: C.preset("decoupled_seq_iss"), "'decoupled_seq_iss'", "Did you mean 'decoupled_seq_is'?")
    for name in PRESETS:
        assert name in msg


def test_unknown_preset_name_far_from_any_lists_them():
    msg = _raises(lambda: C.preset("zzzzzz"), "'zzzzzz'", "decoupled_token_is", "bypass_pg_token_icepop")
    assert "Did you mean" not in msg


# ---------------------------------------------------------------------------------------------------------------
# --rollout-correction-preset and round trips
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PRESETS))
def test_flag_gives_the_same_config_as_the_classmethod(name):
    parser = add_rollout_correction_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--rollout-correction-preset", name])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = config_from_args(args)
    assert cfg == getattr(C, name)()
    assert args.rollout_correction_config is cfg
    # IS configured but not applied (bypass + ppo_clip) is announced at launch, and only then
    level, applied = EXPECTED[name][2], EXPECTED[name][10]
    diagnostics_only = level is not None and not applied
    notes = [str(w.message) for w in record]
    assert any("diagnostics only" in n for n in notes) == diagnostics_only, notes


@pytest.mark.parametrize("name", list(PRESETS))
def test_to_dict_from_dict_round_trip(name):
    cfg = getattr(C, name)()
    d = cfg.to_dict()
    assert d["mode"] == EXPECTED[name][0] and d["loss_type"] == EXPECTED[name][1]
    assert C.from_dict(d) == cfg
    assert C.from_dict(json.loads(json.dumps(d))) == cfg  # also through JSON


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_distinct(name):
    same = [other for other in PRESETS if other != name and getattr(C, other)() == getattr(C, name)()]
    # pg_is and bypass_pg_is are the same estimator under its older and current names
    assert set(same) <= {"pg_is", "bypass_pg_is"} - {name}, same
