"""The RS criteria travel as objects, and each mistake has one message wherever it is written
(slime_rc/config/rejection.py; the option checks themselves are in tests/config/test_schema.py)."""

import argparse

import pytest

from slime_rc import RejectionCriterion, RolloutCorrectionConfig, parse_rejection_criteria
from slime_rc.config.arguments import add_rollout_correction_arguments, resolve_args
from slime_rc.config.resolution import Layer, resolve

UNKNOWN = ("rs_level='geometrc' is not a rejection option; choose from token, sequence, geometric, token_k1, "
           "token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, "
           "seq_max_k2, seq_max_k3. Did you mean 'geometric'?")


def _message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_an_unknown_option_has_one_message_everywhere(capsys):
    assert _message(lambda: RejectionCriterion("geometrc", 2.0)) == UNKNOWN
    assert _message(lambda: parse_rejection_criteria("token,geometrc", 2.0)) == UNKNOWN
    assert _message(lambda: RolloutCorrectionConfig.from_dict(
        {"use_rs": True, "rs_level": "geometrc", "rs_upper_bound": 2.0})).startswith(UNKNOWN)
    with pytest.raises(SystemExit):
        add_rollout_correction_arguments(argparse.ArgumentParser()).parse_args(["--rs-level", "geometrc"])
    assert f"argument --rs-level: {UNKNOWN}" in capsys.readouterr().err


def test_a_malformed_threshold_has_one_message(capsys):
    with pytest.raises(SystemExit):
        add_rollout_correction_arguments(argparse.ArgumentParser()).parse_args(["--rs-upper-bound", "0.5_x"])
    flag = capsys.readouterr().err
    built = _message(lambda: parse_rejection_criteria("token", "0.5_x"))
    tail = "is not a threshold: give a number (2.0) or 'lower_upper' with one underscore"
    assert f"rs_upper_bound='0.5_x' {tail}" in flag and f"rs threshold for 'token'='0.5_x' {tail}" in built


def test_criteria_given_as_objects_reach_the_config_as_they_are():
    crits = (RejectionCriterion("token", 2.0, 0.25), RejectionCriterion("seq_max_k3", 0.01))
    cfg = RolloutCorrectionConfig.from_dict({"rs": crits})
    assert all(a is b for a, b in zip(cfg.rs, crits)) and len(cfg.rs) == 2
    res = resolve([Layer.from_mapping({"rs": list(crits)}, kind="yaml", where="rc.yaml")])
    assert res.config.rs == crits and res.sources["rs"] == "rs in rc.yaml"


def test_criteria_above_text_settings_replace_them():
    # a preset gives the text settings; a dict above gives criteria: the criteria win, as any setting above does
    from slime_rc.config.resolution import preset_layer
    crits = (RejectionCriterion("seq_mean_k3", 0.05),)
    cfg = resolve([preset_layer("decoupled_geo_rs"), Layer.from_mapping({"rs": crits})]).config
    assert cfg.rs == crits and cfg.veto_threshold == 1e-4


def test_text_settings_above_criteria_are_refused(tmp_path):
    path = tmp_path / "rc.yaml"
    path.write_text("rs:\n  - {option: token, upper: 2.0, lower: 0.5}\n")
    parser = add_rollout_correction_arguments(argparse.ArgumentParser())
    msg = _message(lambda: resolve_args(parser.parse_args(["--custom-config-path", str(path),
                                                           "--rs-upper-bound", "3"])))
    assert "--rs-upper-bound='3'" in msg and "rs in" in msg and "one way" in msg
    # the criteria alone, and the switch above them, are fine
    assert resolve_args(parser.parse_args(["--custom-config-path", str(path)])).config.rs == (
        RejectionCriterion("token", 2.0, 0.5),)
    assert resolve_args(parser.parse_args(["--custom-config-path", str(path), "--no-use-rs"])).config.rs == ()
