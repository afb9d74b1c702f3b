"""Command-line flags: ``add_rollout_correction_arguments`` / ``config_from_args`` / ``resolve_args``.

Expectations are written from the documented semantics (slime_rc/config/arguments.py, slime_rc/config/resolution.py,
docs/configuration.md): precedence flag > YAML > preset > default, slime's flag spellings and aliases, the operating
modes (standard / decoupled / bypass, ppo_clip / reinforce), dead-setting checks and parse-time validation.
"""

import argparse
import os
import warnings

import pytest
import torch

import slime_rc.slime.tis_contract as contract
from slime_rc import PRESETS, RejectionCriterion, RolloutCorrectionConfig
from slime_rc.config.arguments import FLAGS, OTHER_FLAGS, add_rollout_correction_arguments, config_from_args, resolve_args

from tests.checks import raises_mentioning as _raises

DEFAULT = RolloutCorrectionConfig()


def _parser(**kwargs) -> argparse.ArgumentParser:
    return add_rollout_correction_arguments(argparse.ArgumentParser(prog="train.py", **kwargs))


def _parse(argv):
    return _parser().parse_args(argv)


def _config(argv):
    """The config of ``argv``; fails the test on any warning (use _config_warns where one is expected)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return config_from_args(_parse(argv))


def _resolve(argv):
    return resolve_args(_parse(argv))


def _parse_fails(capsys, argv, *substrings, parser=None):
    """argparse refuses ``argv`` while parsing: exit status 2 and ``substrings`` in stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        (parser or _parser()).parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    for s in substrings:
        assert s in err, f"{s!r} not in stderr {err!r}"
    return err


def _write(path, text):
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# every flag lands on its config field
# ---------------------------------------------------------------------------------------------------------------

# flag -> (argv that uses it, config field, expected value).  Written from the flag semantics: a flag that only
# means something with IS/RS enabled is given together with its switch.
FLAG_TABLE = {
    "--use-rollout-logprobs": (["--use-rollout-logprobs"], "mode", "bypass"),
    "--use-rollout-correction": (["--use-rollout-correction", "--rs-veto-threshold", "1e-4"], "mode", "decoupled"),
    "--get-mismatch-metrics": (["--get-mismatch-metrics"], "get_mismatch_metrics", True),
    "--use-tis": (["--use-tis"], "is_level", "token"),
    "--tis-mode": (["--use-tis", "--tis-mode", "clip"], "is_mode", "clip"),
    "--tis-lower-bound": (["--use-tis", "--tis-lower-bound", "0.25"], "is_lower_bound", 0.25),
    "--tis-upper-bound": (["--use-tis", "--tis-upper-bound", "3.5"], "is_upper_bound", 3.5),
    "--tis-level": (["--use-tis", "--tis-level", "geometric"], "is_level", "geometric"),
    "--tis-batch-normalize": (["--use-tis", "--tis-batch-normalize"], "is_batch_normalize", True),
    "--tis-clip": (["--use-tis", "--tis-clip", "1.5"], "is_upper_bound", 1.5),
    "--tis-clip-low": (["--use-tis", "--tis-clip-low", "0.2"], "is_lower_bound", 0.2),
    # slime's rule: rs_level defaults to tis_level (token); an unset RS lower bound is the IS lower bound (1/2.0)
    "--use-rs": (["--use-rs", "--rs-upper-bound", "4"], "rs", (RejectionCriterion("token", 4.0, 0.5),)),
    "--rs-lower-bound": (["--use-rs", "--rs-upper-bound", "4", "--rs-lower-bound", "0.2"], "rs",
                         (RejectionCriterion("token", 4.0, 0.2),)),
    "--rs-upper-bound": (["--use-rs", "--rs-level", "geometric", "--rs-upper-bound", "0.99_1.02"], "rs",
                         (RejectionCriterion("geometric", 1.02, 0.99),)),
    "--rs-level": (["--use-rs", "--rs-level", "seq_max_k2", "--rs-upper-bound", "0.05"], "rs",
                   (RejectionCriterion("seq_max_k2", 0.05),)),
    "--rs-veto-threshold": (["--rs-veto-threshold", "1e-5"], "veto_threshold", 1e-5),
    "--rollout-correction-loss-type": (["--use-rollout-logprobs", "--rollout-correction-loss-type", "reinforce"],
                                       "loss_type", "reinforce"),
    "--rollout-correction-rejected-in-denominator": (
        ["--use-tis", "--tis-mode", "mask", "--rollout-correction-rejected-in-denominator"],  # mask mode can reject
        "rejected_in_denominator", True),
    "--eps-clip": (["--eps-clip", "0.1"], "eps_clip", 0.1),
    "--eps-clip-high": (["--eps-clip-high", "0.28"], "eps_clip_high", 0.28),
    "--eps-clip-c": (["--eps-clip-c", "3"], "eps_clip_c", 3.0),
    "--calculate-per-token-loss": (["--calculate-per-token-loss"], "loss_agg", "token_mean"),
    "--rollout-correction-safety-bound": (["--rollout-correction-safety-bound", "30"], "safety_bound", 30.0),
    "--rollout-correction-on-nonfinite": (["--rollout-correction-on-nonfinite", "reject"], "on_nonfinite", "reject"),
    "--rollout-correction-quantile-bins": (["--use-tis", "--rollout-correction-quantile-bins", "256"],  # IS on
                                           "quantile_bins_per_octave", 256),
}


def test_flag_table_covers_every_flag():
    assert set(FLAG_TABLE) == set(FLAGS)


@pytest.mark.parametrize("flag", list(FLAG_TABLE))
def test_flag_lands_on_its_field(flag):
    argv, fieldname, expected = FLAG_TABLE[flag]
    assert getattr(DEFAULT, fieldname) != expected, "the table entry would not show the flag has an effect"
    res = _resolve(argv)
    assert getattr(res.config, fieldname) == expected
    # the source is a flag of the command line; a field built from several flags (is_level from --use-tis and
    # --tis-level, rs from --use-rs and --rs-*) names one of them
    given = [a for a in argv if a.startswith("--")]
    assert res.sources[fieldname] in given
    if len(given) == 1 or fieldname not in ("is_level", "rs", "mode"):
        assert res.sources[fieldname] == flag


@pytest.mark.parametrize("flag", list(FLAG_TABLE))
def test_flag_config_from_args_agrees_with_resolve_args(flag):
    argv = FLAG_TABLE[flag][0]
    assert _config(argv) == _resolve(argv).config


def test_every_flag_defaults_to_none():
    # None = "not given": what lets a YAML file or a preset below the flags show through
    args = _parse([])
    for flag in list(FLAGS) + list(OTHER_FLAGS):
        dest = flag[2:].replace("-", "_")
        assert getattr(args, dest) is None, flag


BOOL_FLAGS = [f for f, (_, kw, _) in FLAGS.items() if kw.get("action") is argparse.BooleanOptionalAction]


def test_boolean_flags_are_the_switches():
    assert set(BOOL_FLAGS) == {"--use-rollout-logprobs", "--use-rollout-correction", "--get-mismatch-metrics",
                               "--use-tis", "--tis-batch-normalize", "--use-rs",
                               "--rollout-correction-rejected-in-denominator", "--calculate-per-token-loss"}


@pytest.mark.parametrize("flag", BOOL_FLAGS)
def test_boolean_flag_no_form_parses_false(flag):
    dest = flag[2:].replace("-", "_")
    assert getattr(_parse([flag]), dest) is True
    assert getattr(_parse(["--no-" + flag[2:]]), dest) is False
    # the last one given wins, as with any argparse flag
    assert getattr(_parse([flag, "--no-" + flag[2:]]), dest) is False


# each --no- form switches off what a lower layer (a preset) switched on
@pytest.mark.parametrize("preset,flag,fieldname,expected", [
    ("disabled", "--no-get-mismatch-metrics", "get_mismatch_metrics", False),
    ("decoupled_seq_is", "--no-use-tis", "is_level", None),
    ("decoupled_geo_rs", "--no-use-rs", "rs", ()),
    ("decoupled_token_icepop", "--no-rollout-correction-rejected-in-denominator", "rejected_in_denominator", False),
    ("ppo_is_bypass", "--no-use-rollout-logprobs", "mode", "decoupled"),
])
def test_no_form_overrides_preset(preset, flag, fieldname, expected):
    before = RolloutCorrectionConfig.preset(preset)
    assert getattr(before, fieldname) != expected
    res = _resolve(["--rollout-correction-preset", preset, flag])
    assert getattr(res.config, fieldname) == expected
    assert flag in res.sources[fieldname]  # the source names what the user typed


def test_no_tis_batch_normalize_overrides_yaml(tmp_path):
    path = _write(tmp_path / "c.yaml", "use_tis: true\ntis_batch_normalize: true\n")
    assert _config(["--custom-config-path", path]).is_batch_normalize is True
    cfg = _config(["--custom-config-path", path, "--no-tis-batch-normalize"])
    assert cfg.is_batch_normalize is False and cfg.is_level == "token"


def test_no_use_rollout_correction_alone_is_standard():
    cfg = _config(["--no-use-rollout-correction"])
    assert cfg.mode == "standard" and not cfg.corrects


def test_no_use_rollout_correction_with_is_is_an_error():
    _raises(lambda: _config(["--no-use-rollout-correction", "--use-tis"]), "--no-use-rollout-correction", "is_level")


# ---------------------------------------------------------------------------------------------------------------
# slime's older spellings --tis-clip / --tis-clip-low
# ---------------------------------------------------------------------------------------------------------------

def test_tis_clip_is_tis_upper_bound():
    assert _config(["--use-tis", "--tis-clip", "3"]) == _config(["--use-tis", "--tis-upper-bound", "3"])
    assert _config(["--use-tis", "--tis-clip", "3"]).is_upper_bound == 3.0


def test_tis_clip_low_is_tis_lower_bound():
    a = _config(["--use-tis", "--tis-mode", "clip", "--tis-clip-low", "0.25"])
    b = _config(["--use-tis", "--tis-mode", "clip", "--tis-lower-bound", "0.25"])
    assert a == b and a.is_lower_bound == 0.25 and a.is_lower == 0.25


def test_tis_clip_low_zero_means_no_lower_bound_in_truncate_mode():
    for argv in (["--use-tis", "--tis-clip-low", "0"], ["--use-tis", "--tis-mode", "truncate", "--tis-clip-low", "0"],
                 ["--use-tis", "--tis-clip", "2", "--tis-clip-low", "0"]):
        cfg = _config(argv)
        assert cfg.is_mode == "truncate"
        assert cfg.is_lower_bound is None  # truncate caps from above only
        assert cfg == RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0)


def test_tis_clip_low_without_a_mode_means_clip():
    """slime's --use-tis --tis-clip-low 0.1 clamps to [0.1, tis_clip]; truncate mode would drop the bound."""
    cfg = _config(["--use-tis", "--tis-clip-low", "0.1"])
    assert (cfg.is_mode, cfg.is_lower_bound, cfg.is_lower) == ("clip", 0.1, 0.1)


def test_tis_lower_bound_without_a_mode_keeps_truncate_as_slimes_mis_does():
    """slime's example mis.py reads tis_lower_bound only in clip / mask mode; its default mode is truncate."""
    cfg = _config(["--use-tis", "--tis-lower-bound", "0.1"])
    assert (cfg.is_mode, cfg.is_lower_bound) == ("truncate", 0.1)


@pytest.mark.parametrize("flag", ["--tis-clip-low", "--tis-lower-bound"])
def test_a_given_mode_wins_over_the_lower_bound(flag):
    assert _config(["--use-tis", "--tis-mode", "mask", flag, "0.1"]).is_mode == "mask"
    kept = _config(["--use-tis", "--tis-mode", "truncate", flag, "0.1"])  # slime's mis.yaml: unused in truncate mode
    assert kept.is_mode == "truncate"


@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_tis_clip_low_zero_refused_outside_truncate(mode):
    _raises(lambda: _config(["--use-tis", "--tis-mode", mode, "--tis-clip-low", "0"]),
            "--tis-clip-low", "no lower bound", "truncate", repr(mode))


def test_tis_clip_low_zero_refused_with_mask_mode_preset():
    _raises(lambda: _config(["--rollout-correction-preset", "decoupled_token_icepop", "--tis-clip-low", "0"]),
            "--tis-clip-low", "'mask'")


def test_conflicting_alias_and_flag_is_an_error_naming_both():
    _raises(lambda: _config(["--use-tis", "--tis-clip", "2", "--tis-upper-bound", "3"]),
            "--tis-clip", "--tis-upper-bound", "keep one")
    _raises(lambda: _config(["--use-tis", "--tis-mode", "clip", "--tis-clip-low", "0.1", "--tis-lower-bound", "0.2"]),
            "--tis-clip-low", "--tis-lower-bound")


def test_agreeing_alias_and_flag_are_accepted():
    assert _config(["--use-tis", "--tis-clip", "3", "--tis-upper-bound", "3"]).is_upper_bound == 3.0


# ---------------------------------------------------------------------------------------------------------------
# operating modes
# ---------------------------------------------------------------------------------------------------------------

def test_no_flags_is_standard_ppo():
    res = _resolve([])
    cfg = res.config
    assert cfg == DEFAULT
    assert cfg.mode == "standard" and cfg.loss_type == "ppo_clip"
    assert not cfg.corrects and not cfg.is_enabled and not cfg.is_weights_applied
    assert not cfg.needs_rollout_log_probs
    assert res.notes == []
    assert res.sources["mode"].startswith("derived")
    assert {k for k, v in res.sources.items() if v != "default"} == {"mode"}


def test_use_tis_is_decoupled_ppo_clip():
    cfg = _config(["--use-tis"])
    assert (cfg.mode, cfg.loss_type, cfg.is_level) == ("decoupled", "ppo_clip", "token")
    assert cfg.is_weights_applied


def test_use_rollout_logprobs_is_bypass():
    cfg = _config(["--use-rollout-logprobs"])
    assert (cfg.mode, cfg.loss_type) == ("bypass", "ppo_clip")
    assert not cfg.corrects and cfg.needs_rollout_log_probs


def test_bypass_reinforce_applies_is_weights():
    cfg = _config(["--use-rollout-logprobs", "--use-tis", "--rollout-correction-loss-type", "reinforce"])
    assert (cfg.mode, cfg.loss_type, cfg.is_level) == ("bypass", "reinforce", "token")
    assert cfg.is_weights_applied is True


def test_bypass_ppo_clip_is_weights_are_diagnostics_only():
    argv = ["--use-rollout-logprobs", "--use-tis"]
    with pytest.warns(UserWarning, match="diagnostics only") as record:
        cfg = config_from_args(_parse(argv))
    assert (cfg.mode, cfg.loss_type, cfg.is_level) == ("bypass", "ppo_clip", "token")
    assert cfg.is_enabled and cfg.is_weights_applied is False
    msg = str(record[0].message)
    assert "reinforce" in msg and "--rollout-correction-loss-type" in msg  # says how to get explicit weights
    assert len(_resolve(argv).notes) == 1


def test_bypass_ppo_clip_mask_mode_note_says_rejection_still_applies():
    with pytest.warns(UserWarning, match="mask-mode rejection still applies"):
        config_from_args(_parse(["--use-rollout-logprobs", "--use-tis", "--tis-mode", "mask"]))


def test_no_diagnostics_warning_where_weights_are_applied():
    for argv in ([], ["--use-tis"], ["--use-rollout-logprobs"],
                 ["--use-rollout-logprobs", "--use-tis", "--rollout-correction-loss-type", "reinforce"],
                 ["--use-rollout-logprobs", "--use-rs", "--rs-upper-bound", "2"]):
        _config(argv)  # _config turns any warning into an error
        assert _resolve(argv).notes == []


def test_reinforce_without_bypass_is_an_error():
    _raises(lambda: _config(["--rollout-correction-loss-type", "reinforce"]),
            "loss_type='reinforce'", "bypass", "--rollout-correction-loss-type")
    _raises(lambda: _config(["--use-tis", "--rollout-correction-loss-type", "reinforce"]),
            "loss_type='reinforce'", "bypass", "mode='decoupled'")


def test_use_rollout_correction_alone_is_an_error():
    _raises(lambda: _config(["--use-rollout-correction"]), "--use-rollout-correction", "nothing")


def test_use_rollout_correction_with_is_is_decoupled():
    res = _resolve(["--use-rollout-correction", "--use-tis"])
    assert res.config.mode == "decoupled" and res.config.is_level == "token"
    assert res.sources["mode"] == "--use-rollout-correction"
    assert res.config == _config(["--use-tis"])


def test_get_mismatch_metrics_without_correction():
    cfg = _config(["--get-mismatch-metrics"])
    assert cfg.get_mismatch_metrics is True
    assert cfg.mode == "standard" and not cfg.corrects
    assert cfg.needs_rollout_log_probs  # the metrics need the rollout log-probs


def test_pure_rejection_sampling_without_is():
    cfg = _config(["--use-rs", "--rs-level", "geometric", "--rs-upper-bound", "0.99_1.01"])
    assert cfg.mode == "decoupled"
    assert not cfg.is_enabled and not cfg.is_weights_applied
    assert cfg.rs == (RejectionCriterion("geometric", 1.01, 0.99),)
    assert cfg.rejects


def test_several_rejection_options_with_one_threshold_each():
    cfg = _config(["--use-rs", "--rs-level", "token,seq_mean_k3", "--rs-upper-bound", "2,0.01"])
    assert cfg.rs == (RejectionCriterion("token", 2.0, 0.5), RejectionCriterion("seq_mean_k3", 0.01))


def test_veto_alone_is_decoupled():
    # rs_veto_threshold applies whether or not use_rs is set
    cfg = _config(["--rs-veto-threshold", "1e-4"])
    assert cfg.mode == "decoupled" and cfg.veto_threshold == 1e-4 and cfg.rs == ()


def test_use_rs_without_bounds_takes_the_is_band_as_slime_does():
    assert _config(["--use-rs"]).rs == (RejectionCriterion("token", 2.0, 0.5),)
    cfg = _config(["--use-tis", "--tis-level", "geometric", "--tis-upper-bound", "1.01", "--tis-lower-bound", "0.98",
                   "--use-rs"])
    assert cfg.rs == (RejectionCriterion("geometric", 1.01, 0.98),)


def test_use_rs_on_a_divergence_without_threshold_says_what_is_missing():
    _raises(lambda: _config(["--use-rs", "--rs-level", "seq_max_k2"]), "rs_upper_bound", "threshold")


# ---------------------------------------------------------------------------------------------------------------
# precedence: flag > YAML > preset > default
# ---------------------------------------------------------------------------------------------------------------

def test_precedence_chain_for_one_setting(tmp_path):
    yaml_path = _write(tmp_path / "rc.yaml", "tis_upper_bound: 3\n")
    abspath = os.path.abspath(yaml_path)
    preset = ["--rollout-correction-preset", "decoupled_seq_is"]
    yaml_ = ["--custom-config-path", yaml_path]
    flag = ["--tis-upper-bound", "4"]

    res = _resolve(preset + yaml_ + flag)
    assert res.config.is_upper_bound == 4.0
    assert res.sources["is_upper_bound"] == "--tis-upper-bound"

    res = _resolve(preset + yaml_)
    assert res.config.is_upper_bound == 3.0
    assert res.sources["is_upper_bound"] == f"tis_upper_bound in {abspath}"

    res = _resolve(preset)
    assert res.config.is_upper_bound == 2.0
    assert res.sources["is_upper_bound"] == "preset decoupled_seq_is"

    res = _resolve([])
    assert res.config.is_upper_bound == DEFAULT.is_upper_bound
    assert res.sources["is_upper_bound"] == "default"

    # the rest of the preset survives every override of the one setting
    for argv in (preset + yaml_ + flag, preset + yaml_, preset):
        cfg = _config(argv)
        assert (cfg.mode, cfg.loss_type, cfg.is_level, cfg.is_mode) == ("decoupled", "ppo_clip", "sequence",
                                                                          "truncate")


def test_order_on_the_command_line_does_not_matter(tmp_path):
    yaml_path = _write(tmp_path / "rc.yaml", "tis_upper_bound: 3\n")
    a = _config(["--tis-upper-bound", "4", "--custom-config-path", yaml_path,
                 "--rollout-correction-preset", "decoupled_seq_is"])
    b = _config(["--rollout-correction-preset", "decoupled_seq_is", "--custom-config-path", yaml_path,
                 "--tis-upper-bound", "4"])
    assert a == b and a.is_upper_bound == 4.0


def test_precedence_key_by_key(tmp_path):
    yaml_path = _write(tmp_path / "rc.yaml", "tis_mode: clip\nrs_upper_bound: 3\n")
    abspath = os.path.abspath(yaml_path)
    res = _resolve(["--rollout-correction-preset", "decoupled_seq_is_rs", "--custom-config-path", yaml_path,
                    "--tis-level", "token", "--rollout-correction-safety-bound", "10"])
    cfg, src = res.config, res.sources
    # flag
    assert cfg.is_level == "token" and src["is_level"] == "--tis-level"
    assert cfg.safety_bound == 10.0 and src["safety_bound"] == "--rollout-correction-safety-bound"
    # YAML
    assert cfg.is_mode == "clip" and src["is_mode"] == f"tis_mode in {abspath}"
    # slime's rule: the unset RS lower bound is the IS lower bound (1 / the preset's 2.0), not 1 / 3
    assert cfg.rs == (RejectionCriterion("sequence", 3.0, 0.5),) and src["rs"] == f"rs_upper_bound in {abspath}"
    # preset
    assert cfg.is_upper_bound == 2.0 and src["is_upper_bound"] == "preset decoupled_seq_is_rs"
    assert cfg.loss_type == "ppo_clip" and src["loss_type"] == "preset decoupled_seq_is_rs"
    assert cfg.mode == "decoupled"
    # default
    for name in ("is_lower_bound", "is_batch_normalize", "veto_threshold", "on_nonfinite",
                 "quantile_bins_per_octave", "get_mismatch_metrics", "rejected_in_denominator"):
        assert getattr(cfg, name) == getattr(DEFAULT, name)
        assert src[name] == "default", name


def test_verl_yaml_overrides_preset_and_flag_overrides_verl_yaml(tmp_path):
    path = _write(tmp_path / "verl.yaml", "algorithm:\n  rollout_correction:\n    rollout_is_threshold: 4.0\n")
    abspath = os.path.abspath(path)
    res = _resolve(["--rollout-correction-preset", "decoupled_token_is", "--custom-config-path", path])
    assert res.config.is_upper_bound == 4.0 and res.config.is_level == "token"
    assert res.sources["is_upper_bound"] == f"rollout_is_threshold in {abspath}"
    res = _resolve(["--rollout-correction-preset", "decoupled_token_is", "--custom-config-path", path,
                    "--tis-clip", "5"])
    assert res.config.is_upper_bound == 5.0 and res.sources["is_upper_bound"] == "--tis-clip"


def test_flags_change_the_mode_of_a_preset():
    # pg_is is bypass + reinforce; with ppo_clip the same sequence weights become diagnostics only
    with pytest.warns(UserWarning, match="diagnostics only"):
        cfg = config_from_args(_parse(["--rollout-correction-preset", "pg_is",
                                       "--rollout-correction-loss-type", "ppo_clip"]))
    assert (cfg.mode, cfg.loss_type, cfg.is_level) == ("bypass", "ppo_clip", "sequence")
    assert not cfg.is_weights_applied


def test_yaml_changes_the_mode_of_a_preset(tmp_path):
    path = _write(tmp_path / "rc.yaml", "use_rollout_logprobs: true\nloss_type: reinforce\n")
    res = _resolve(["--rollout-correction-preset", "decoupled_seq_is", "--custom-config-path", path])
    assert (res.config.mode, res.config.loss_type) == ("bypass", "reinforce")
    assert res.config.is_weights_applied
    assert res.sources["mode"].startswith("use_rollout_logprobs in ")


def test_leaving_bypass_of_a_reinforce_preset_names_who_set_what():
    _raises(lambda: _config(["--rollout-correction-preset", "pg_rs", "--no-use-rollout-logprobs"]),
            "loss_type='reinforce'", "bypass", "preset pg_rs")


# ---------------------------------------------------------------------------------------------------------------
# dead settings
# ---------------------------------------------------------------------------------------------------------------

def test_tis_level_without_use_tis_is_an_error():
    _raises(lambda: _config(["--tis-level", "sequence"]), "--tis-level", "--use-tis")


@pytest.mark.parametrize("argv", [["--tis-mode", "clip"], ["--tis-upper-bound", "3"], ["--tis-clip", "3"],
                                  ["--tis-lower-bound", "0.3"], ["--tis-batch-normalize"]])
def test_is_settings_without_use_tis_are_errors(argv):
    _raises(lambda: _config(argv), argv[0], "--use-tis")


@pytest.mark.parametrize("argv", [["--rs-level", "geometric"], ["--rs-upper-bound", "2"],
                                  ["--rs-lower-bound", "0.5"]])
def test_rs_settings_without_use_rs_are_errors(argv):
    _raises(lambda: _config(argv), argv[0], "--use-rs")


def test_is_flag_on_a_preset_without_is_names_the_preset():
    _raises(lambda: _config(["--rollout-correction-preset", "decoupled_geo_rs", "--tis-upper-bound", "3"]),
            "--tis-upper-bound", "decoupled_geo_rs", "--use-tis")


def test_rs_flag_on_a_preset_without_rs_names_the_preset():
    _raises(lambda: _config(["--rollout-correction-preset", "decoupled_seq_is", "--rs-upper-bound", "2"]),
            "--rs-upper-bound", "decoupled_seq_is", "--use-rs")


def test_enabling_is_on_top_of_a_preset_without_is():
    cfg = _config(["--rollout-correction-preset", "decoupled_geo_rs", "--use-tis", "--tis-upper-bound", "3"])
    assert cfg.is_level == "token" and cfg.is_upper_bound == 3.0
    assert cfg.rs == (RejectionCriterion("geometric", 1.001, 0.999),) and cfg.veto_threshold == 1e-4


def test_no_use_tis_on_an_is_preset_turns_is_off():
    res = _resolve(["--rollout-correction-preset", "decoupled_seq_is", "--no-use-tis"])
    assert res.config.is_level is None and not res.config.is_enabled
    assert res.sources["is_level"] == "--no-use-tis"
    # nothing is left to correct: the preset's decoupled PPO falls back to standard PPO
    assert res.config.mode == "standard" and not res.config.corrects


def test_no_use_tis_on_a_preset_with_is_and_rs_keeps_rs():
    cfg = _config(["--rollout-correction-preset", "geo_rs_seq_tis", "--no-use-tis"])
    assert cfg.is_level is None and cfg.mode == "decoupled"
    assert cfg.rs == (RejectionCriterion("geometric", 1.001, 0.999),)


def test_is_setting_given_together_with_no_use_tis_is_refused():
    # --tis-level has no effect when IS is off; it is refused without --use-tis (above), and must be refused as
    # much when the same command line says --no-use-tis instead of silently dropping it.
    _raises(lambda: _config(["--no-use-tis", "--tis-level", "sequence"]), "--tis-level")


def test_rs_setting_given_together_with_no_use_rs_is_refused():
    _raises(lambda: _config(["--no-use-rs", "--rs-level", "geometric", "--rs-upper-bound", "0.99_1.01"]),
            "--rs-level")


def test_rs_lower_bound_without_a_ratio_option_is_refused():
    # --rs-lower-bound only bounds k1 (ratio) options; with only a k3 (divergence) option it has no effect, and
    # the docs make a lower bound for a k2/k3 option an error.
    _raises(lambda: _config(["--use-rs", "--rs-level", "seq_mean_k3", "--rs-upper-bound", "0.01",
                             "--rs-lower-bound", "0.5"]), "seq_mean_k3")


def test_rs_lower_bound_applies_to_the_ratio_options_of_a_mixed_list():
    cfg = _config(["--use-rs", "--rs-level", "token,seq_mean_k3", "--rs-upper-bound", "2,0.01",
                   "--rs-lower-bound", "0.25"])
    assert cfg.rs == (RejectionCriterion("token", 2.0, 0.25), RejectionCriterion("seq_mean_k3", 0.01))


# ---------------------------------------------------------------------------------------------------------------
# parse-time errors (argparse: exit status 2, message on stderr)
# ---------------------------------------------------------------------------------------------------------------

def test_bad_rs_level_names_option_and_suggests(capsys):
    _parse_fails(capsys, ["--rs-level", "geometrc"], "--rs-level", "'geometrc'", "Did you mean 'geometric'?")
    _parse_fails(capsys, ["--rs-level", "token,seq_mean_k4"], "--rs-level", "'seq_mean_k4'",
                 "Did you mean 'seq_mean_k3'?")
    err = _parse_fails(capsys, ["--rs-level", "zzzzzz"], "--rs-level", "'zzzzzz'", "seq_max_k3")
    assert "Did you mean" not in err


@pytest.mark.parametrize("text", ["two", "0.5_x", "", "2,,3", "abc_1.0"])
def test_bad_rs_upper_bound_text(capsys, text):
    _parse_fails(capsys, ["--rs-upper-bound", text], "--rs-upper-bound", repr(text), "not a threshold")


@pytest.mark.parametrize("text", ["1_2_3", "0.5_2_0", "0.999_1.001_5"])
def test_rs_upper_bound_with_more_than_one_underscore_is_refused(capsys, text):
    # 'lower_upper' has exactly one underscore.  float() reads "2_0" as 20 (digit grouping), so accepting these
    # turns the typo '0.5_2_0' into the band [0.5, 20].
    _parse_fails(capsys, ["--use-rs", "--rs-upper-bound", text], "--rs-upper-bound")


@pytest.mark.parametrize("text", ["2", "2.0", "0.999_1.001", "2,0.01", "0.5_2.0,0.01", "1e-3"])
def test_good_rs_upper_bound_text(text):
    assert _parse(["--rs-upper-bound", text]).rs_upper_bound == text


def test_custom_config_path_missing_names_absolute_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _parse_fails(capsys, ["--custom-config-path", "missing.yaml"], "--custom-config-path",
                 str(tmp_path / "missing.yaml"))


def test_custom_config_path_directory_is_refused(capsys, tmp_path):
    _parse_fails(capsys, ["--custom-config-path", str(tmp_path)], "--custom-config-path", str(tmp_path))


def test_custom_tis_function_missing_module(capsys):
    _parse_fails(capsys, ["--custom-tis-function-path", "no_such_module_xyz.fn"], "--custom-tis-function-path",
                 "no_such_module_xyz")


def test_custom_tis_function_missing_attribute(capsys):
    _parse_fails(capsys, ["--custom-tis-function-path", "custom_tis.mis:compute_mis_weight_with_cp"],
                 "--custom-tis-function-path", "'compute_mis_weight_with_cp'", "compute_mis_weights_with_cp")


def test_custom_tis_function_missing_file(capsys, tmp_path):
    path = tmp_path / "nope.py"
    _parse_fails(capsys, ["--custom-tis-function-path", f"{path}:fn"], "--custom-tis-function-path", str(path))


def test_custom_tis_function_wrong_signature(capsys, tmp_path):
    path = tmp_path / "plugin_sig.py"
    path.write_text("def takes_two(args, weights):\n    return None\n")
    _parse_fails(capsys, ["--custom-tis-function-path", f"{path}:takes_two"], "--custom-tis-function-path",
                 "takes_two", "cannot be called", "pg_loss")


def test_custom_tis_function_good_specs_parse(tmp_path):
    path = tmp_path / "plugin_ok.py"
    path.write_text("def fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,\n"
                    "       response_lengths, **kwargs):\n    return pg_loss, loss_masks, {}\n")
    for spec in ("mis", "tis", "icepop", "custom_tis.mis:compute_mis_weights_with_cp",
                 "custom_tis.mis.compute_mis_weights_with_cp", f"{path}:fn"):
        assert _parse(["--custom-tis-function-path", spec]).custom_tis_function_path == spec


def test_unknown_preset_lists_choices(capsys):
    err = _parse_fails(capsys, ["--rollout-correction-preset", "decoupled_seq"], "--rollout-correction-preset",
                       "'decoupled_seq'")
    for name in PRESETS:
        assert repr(name) in err or name in err, name


@pytest.mark.parametrize("argv,flag", [
    (["--tis-mode", "trunc"], "--tis-mode"), (["--tis-level", "tok"], "--tis-level"),
    (["--rollout-correction-loss-type", "pg"], "--rollout-correction-loss-type"),
    (["--rollout-correction-on-nonfinite", "skip"], "--rollout-correction-on-nonfinite"),
    (["--tis-upper-bound", "two"], "--tis-upper-bound"),
    (["--rollout-correction-quantile-bins", "1.5"], "--rollout-correction-quantile-bins"),
])
def test_other_parse_errors_name_the_flag(capsys, argv, flag):
    _parse_fails(capsys, argv, flag, repr(argv[1]))


# ---------------------------------------------------------------------------------------------------------------
# coexistence with Megatron's parser
# ---------------------------------------------------------------------------------------------------------------

def _megatron_parser():
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="training")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--lr", type=float, default=None)
    group.add_argument("--micro-batch-size", type=int, default=None)
    group.add_argument("--global-batch-size", type=int, default=None)
    group.add_argument("--loss-scale", type=float, default=None)
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--calculate-per-token-loss", action="store_true")
    return parser


def _megatron_parse_args(extra_args_provider, argv):
    """What megatron.training.arguments.parse_args does with an extra_args_provider."""
    parser = _megatron_parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args(argv)


MEGATRON_ARGV = ["--tensor-model-parallel-size", "2", "--seed", "7", "--lr", "1e-6", "--micro-batch-size", "1",
                 "--loss-scale", "128", "--bf16", "--use-distributed-optimizer"]


def test_adds_to_a_megatron_parser_and_returns_it():
    parser = _megatron_parser()
    assert add_rollout_correction_arguments(parser) is parser


def test_megatron_extra_args_provider_contract():
    args = _megatron_parse_args(add_rollout_correction_arguments,
                                MEGATRON_ARGV + ["--use-tis", "--tis-level", "sequence", "--tis-upper-bound", "3"])
    assert (args.tensor_model_parallel_size, args.seed, args.lr, args.micro_batch_size, args.loss_scale) == (
        2, 7, 1e-6, 1, 128.0)
    assert args.bf16 and args.use_distributed_optimizer and not args.calculate_per_token_loss
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config_from_args(args)
    assert cfg == RolloutCorrectionConfig(is_level="sequence", is_upper_bound=3.0)


def test_megatron_flags_alone_give_the_default_config():
    args = _megatron_parse_args(add_rollout_correction_arguments, MEGATRON_ARGV)
    assert config_from_args(args) == DEFAULT
    assert args.seed == 7


def test_parse_known_args_leaves_unrelated_flags_alone():
    parser = add_rollout_correction_arguments(_megatron_parser())
    argv = ["--seed", "3", "--some-slime-flag", "x", "--use-rs", "--rs-upper-bound", "2", "--other", "--lr", "0.1"]
    args, rest = parser.parse_known_args(argv)
    assert rest == ["--some-slime-flag", "x", "--other"]
    assert args.seed == 3 and args.lr == 0.1 and args.use_rs is True and args.rs_upper_bound == "2"


def test_allow_abbrev_false_is_respected():
    # Megatron builds its parser with allow_abbrev=False: our flags must not be reachable by a prefix there
    parser = add_rollout_correction_arguments(_megatron_parser())
    args, rest = parser.parse_known_args(["--use-ti"])
    assert rest == ["--use-ti"] and args.use_tis is None


def test_our_flags_are_in_their_own_help_group():
    text = add_rollout_correction_arguments(_megatron_parser()).format_help()
    assert "rollout correction (slime-rc)" in text
    for flag in list(FLAGS) + list(OTHER_FLAGS):
        assert flag in text, flag


def test_namespace_without_our_flags_resolves_to_default():
    # e.g. an args object that never went through add_rollout_correction_arguments
    assert resolve_args(argparse.Namespace(seed=1)).config == DEFAULT


# ---------------------------------------------------------------------------------------------------------------
# config_from_args stores the resolved config for the slime adapters
# ---------------------------------------------------------------------------------------------------------------

def test_config_from_args_stores_the_config_on_args(tmp_path):
    path = _write(tmp_path / "rc.yaml", "tis_upper_bound: 3\n")
    args = _parse(["--rollout-correction-preset", "decoupled_seq_is", "--custom-config-path", path])
    assert not hasattr(args, "rollout_correction_config")
    cfg = config_from_args(args)
    assert args.rollout_correction_config is cfg
    assert cfg.is_level == "sequence" and cfg.is_upper_bound == 3.0


def test_adapters_see_the_preset_and_yaml_resolved_config(tmp_path):
    path = _write(tmp_path / "rc.yaml", "tis_upper_bound: 3\n")
    args = _parse(["--rollout-correction-preset", "decoupled_seq_is", "--custom-config-path", path])
    cfg = config_from_args(args)
    # the slime keys on args are all None (the preset and the YAML set them): only the stored config knows them
    assert args.use_tis is None and args.tis_level is None
    assert contract.launch_config(args) is cfg


# one sample, ratios pi_train/pi_rollout = 0.25, 1, 4, 6
_RATIOS = dict(train_log_probs=[torch.log(torch.tensor([0.25, 1.0, 4.0, 6.0]))],
               rollout_log_probs=[torch.zeros(4)], loss_masks=[torch.ones(4)])


def test_tis_adapter_sees_the_resolved_upper_bound():
    # docs/usage.md: "The custom_tis adapters read the config resolved at launch (args.rollout_correction_config),
    # so presets and YAML apply to them too."  --tis-upper-bound is the current spelling of --tis-clip.
    import custom_tis.tis as tis
    for argv in (["--use-tis", "--tis-upper-bound", "3"], ["--use-tis", "--tis-clip", "3"]):
        args = _parse(argv + ["--custom-tis-function-path", "tis"])
        assert config_from_args(args).is_upper_bound == 3.0
        weights, masks, _ = tis.compute_tis_weights(args, **_RATIOS)
        assert weights[0].tolist() == [0.25, 1.0, 3.0, 3.0], argv
        assert masks[0].tolist() == [1.0] * 4
    # without a launch config: slime's own --tis-clip default 2.0
    weights, _, _ = tis.compute_tis_weights(argparse.Namespace(tis_clip=2.0, tis_clip_low=0), **_RATIOS)
    assert weights[0].tolist() == [0.25, 1.0, 2.0, 2.0]


def test_icepop_adapter_sees_the_preset_band():
    import custom_tis.icepop as icepop
    args = _parse(["--rollout-correction-preset", "decoupled_token_icepop", "--custom-tis-function-path", "icepop"])
    cfg = config_from_args(args)
    assert (cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("mask", 0.5, 5.0)
    weights, masks, _ = icepop.compute_icepop_weights(args, **_RATIOS)
    # the preset's band [0.5, 5]: 0.25 and 6 are outside (weight 0), 4 is inside; IcePop leaves the masks as they
    # came (slime's icepop_function: a zero weight, the token stays in slime's denominators)
    assert weights[0].tolist() == [0.0, 1.0, 4.0, 0.0] and masks[0].tolist() == [1.0, 1.0, 1.0, 1.0]
    # slime's band [tis_clip_low, tis_clip] = [0, 2] without a launch config
    weights, _, _ = icepop.compute_icepop_weights(argparse.Namespace(tis_clip=2.0, tis_clip_low=0), **_RATIOS)
    assert weights[0].tolist() == [0.25, 1.0, 0.0, 0.0]


def test_coexists_with_a_parser_that_already_has_slimes_flags():
    # slime's own parser already defines some of these flags (store_true / float defaults): they are reused,
    # and count as given only when they differ from that parser's default
    import argparse as _argparse
    from slime_rc.config.arguments import add_rollout_correction_arguments, config_from_args, resolve_args
    parser = _argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--use-tis", action="store_true")
    parser.add_argument("--tis-clip", type=float, default=2.0)
    parser.add_argument("--use-rollout-logprobs", action="store_true")
    assert add_rollout_correction_arguments(parser) is parser
    cfg = config_from_args(parser.parse_args([]))
    assert cfg.mode == "standard" and not cfg.is_enabled
    args = parser.parse_args(["--use-tis", "--tis-clip", "3", "--tis-level", "sequence"])
    res = resolve_args(args)
    assert (res.config.is_level, res.config.is_upper_bound) == ("sequence", 3.0)
    assert res.sources["is_upper_bound"] == "--tis-clip"
    # the parser's own default (2.0) is not an explicit flag: a YAML value beats it
    cfg = config_from_args(parser.parse_args(["--use-tis", "--rollout-correction-preset", "decoupled_token_is",
                                              "--tis-upper-bound", "5"]))
    assert cfg.is_upper_bound == 5.0


def test_a_band_given_above_replaces_a_lower_bound_from_below():
    cfg = _config(["--rollout-correction-preset", "decoupled_geo_rs", "--rs-upper-bound", "0.99_1.01"])
    assert cfg.rs == (RejectionCriterion("geometric", 1.01, 0.99),)


def test_a_lower_bound_beside_a_band_is_refused_not_ignored():
    # verl spelling: the band carries its own lower bound, so rollout_rs_threshold_lower would do nothing
    _raises(lambda: RolloutCorrectionConfig.from_dict({"rollout_rs": "geometric", "rollout_rs_threshold": "0.999_1.001",
                                                        "rollout_rs_threshold_lower": 0.5}),
            "rs_lower_bound=0.5", "no effect", "rollout_rs_threshold_lower")
    _raises(lambda: _config(["--use-rs", "--rs-level", "geometric", "--rs-upper-bound", "0.999_1.001",
                             "--rs-lower-bound", "0.5"]), "no effect", "--rs-lower-bound")
