"""`slime-rc config --slime`: what slime refuses at start-up, function paths slime cannot load, and which loss slime
actually runs.  The facts are slime's (../shared/notes/slime-contract.md); tests/slime_args.py models slime's parser
and validation, and the refusals here are checked against it."""

import json

import pytest

from slime_rc.cli import (CUSTOM_LOSS_FLAGS, METRICS_ONLY_TIS, MIS_TIS, SLIME_RC_LOSS, main, slime_load_function)

from tests import slime_args


def _run(capsys, *argv):
    code = main(["config", "--slime", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _runs(out):
    """The 'slime runs:' line."""
    return next(line.strip() for line in out.splitlines() if line.strip().startswith("slime runs:"))


# ---- what slime refuses at start-up ------------------------------------------------------------------------------

# launch line -> the words slime's validation refuses it with (None: slime starts)
STARTUP = [
    ([], None),
    (["--use-tis"], None),
    (["--get-mismatch-metrics"], "custom_tis_function_path must be set when get_mismatch_metrics is set"),
    (["--get-mismatch-metrics", "--custom-tis-function-path", METRICS_ONLY_TIS], None),
    (["--use-rollout-logprobs", "--use-tis"], "use_rollout_logprobs and use_tis cannot be set at the same time."),
    (["--kl-coef", "0.1", "--kl-loss-coef", "0.1"], "Only one of kl_coef and kl_loss_coef can be set"),
    (["--rollout-temperature", "0"], "--rollout-temperature must be > 0"),
]


@pytest.mark.parametrize("argv, slime_says", STARTUP)
def test_refuses_what_slimes_validation_refuses_quoting_slime(capsys, argv, slime_says):
    try:  # the model of slime's parser and validation (tests/slime_args.py) agrees on what slime refuses
        slime_args.parse(argv)
        model_says = None
    except (AssertionError, ValueError) as e:
        model_says = str(e)
    assert model_says == slime_says
    code, out, err = _run(capsys, *argv)
    if slime_says is None:
        assert code == 0, err
    else:
        assert code == 2 and out == ""
        assert 'slime refuses' in err and f'("{slime_says}")' in err


def test_mismatch_metrics_without_a_function_is_refused_with_the_function_that_fixes_it(capsys):
    code, _, err = _run(capsys, "--get-mismatch-metrics")
    assert code == 2
    assert err.startswith("slime-rc config --slime: error: --get-mismatch-metrics without --custom-tis-function-path")
    assert f"--custom-tis-function-path {METRICS_ONLY_TIS}" in err and f"--custom-tis-function-path {MIS_TIS}" in err
    import custom_tis.metrics_only
    assert slime_load_function(METRICS_ONLY_TIS) is custom_tis.metrics_only.compute_metrics_only_with_cp
    code, out, err = _run(capsys, "--get-mismatch-metrics", "--custom-tis-function-path", METRICS_ONLY_TIS)
    assert code == 0, err
    assert f"with slime's TIS hook: slime passes each token's PPO term through {METRICS_ONLY_TIS}" in _runs(out)


def test_rollout_logprobs_with_use_tis_points_to_the_yaml_and_the_custom_loss(capsys):
    code, _, err = _run(capsys, "--use-rollout-logprobs", "--use-tis")
    assert code == 2
    assert "use_tis: true in the --custom-config-path YAML" in err and CUSTOM_LOSS_FLAGS in err


# ---- function paths slime's load_function cannot load ------------------------------------------------------------

@pytest.mark.parametrize("given, dotted", [
    ("my_tis.py:my_tis", "my_tis.my_tis"),
    ("mis", MIS_TIS),
    ("custom_tis.mis:compute_mis_weights_with_cp", MIS_TIS),
    ("custom_tis/mis.py:compute_mis_weights_with_cp", MIS_TIS),
])
def test_a_path_slime_cannot_load_is_refused_with_the_dotted_form(capsys, given, dotted):
    code, out, err = _run(capsys, "--use-tis", "--custom-tis-function-path", given)
    assert code == 2 and out == ""
    assert f"--custom-tis-function-path {given}: slime cannot load it." in err
    assert f"slime takes only the dotted form pkg.mod.fn: write --custom-tis-function-path {dotted}" in err


def test_the_dotted_form_of_a_file_path_is_what_slime_then_loads(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_tis.py").write_text("def my_tis(args, **kwargs):\n    return kwargs['pg_loss'], "
                                        "kwargs['loss_masks'], {}\n")
    code, _, err = _run(capsys, "--use-tis", "--custom-tis-function-path", f"{tmp_path}/my_tis.py:my_tis")
    assert code == 2
    assert (f"write --custom-tis-function-path my_tis.my_tis (with {tmp_path} on PYTHONPATH, so that slime can "
            f"import my_tis)") in err
    monkeypatch.syspath_prepend(str(tmp_path))  # what the message asks for
    code, out, err = _run(capsys, "--use-tis", "--custom-tis-function-path", "my_tis.my_tis")
    assert code == 0, err
    assert "through my_tis.my_tis" in _runs(out)


def test_a_function_slime_cannot_call_is_refused(capsys, tmp_path, monkeypatch):
    (tmp_path / "bad_tis.py").write_text("def tis(args, pg_loss):\n    return pg_loss\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _run(capsys, "--use-tis", "--custom-tis-function-path", "bad_tis.tis")
    assert code == 2
    assert "--custom-tis-function-path bad_tis.tis: slime loads it but cannot call it" in err
    assert "train_log_probs" in err


def test_a_dotted_path_whose_module_is_missing_asks_for_the_module(capsys):
    code, _, err = _run(capsys, "--use-tis", "--custom-tis-function-path", "no_such_pkg_xyz.fn")
    assert code == 2
    assert "No module named 'no_such_pkg_xyz'" in err
    assert "The path is in slime's dotted form pkg.mod.fn, but slime cannot import module 'no_such_pkg_xyz'" in err


def test_a_path_in_the_yaml_is_named_as_the_yaml_key(capsys, tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("use_tis: true\ncustom_tis_function_path: mis\n")
    code, _, err = _run(capsys, "--custom-config-path", str(path))
    assert code == 2
    assert f"custom_tis_function_path in {path}: mis: slime cannot load it." in err
    assert f"custom_tis_function_path in {path}: {MIS_TIS}" in err


def test_the_custom_loss_path_is_checked_too(capsys):
    code, _, err = _run(capsys, "--loss-type", "custom_loss", "--custom-loss-function-path", "slime_rc.slime:"
                                                                                           "policy_loss_function")
    assert code == 2
    assert f"write --custom-loss-function-path {SLIME_RC_LOSS}" in err
    code, _, err = _run(capsys, "--loss-type", "custom_loss")
    assert code == 2 and "--loss-type custom_loss without --custom-loss-function-path" in err
    from slime_rc.slime import policy_loss_function
    assert slime_load_function(SLIME_RC_LOSS) is policy_loss_function


# ---- which loss slime runs ---------------------------------------------------------------------------------------

def test_without_use_tis_slime_runs_its_loss_and_says_the_settings_have_no_effect(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    assert _runs(out) == "slime runs: slime's policy loss (PPO clip, pi_old recomputed), no rollout correction"
    assert "warning:" not in out
    code, out, _ = _run(capsys, "--use-rs", "--custom-tis-function-path", MIS_TIS)
    assert code == 0
    assert ("warning: slime calls no TIS function (neither use_tis nor get_mismatch_metrics is set), so these "
            "settings have no effect: use_rs, custom_tis_function_path.") in out


def test_use_tis_without_a_function_is_slimes_builtin_tis_which_ignores_slime_rc_settings(capsys):
    code, out, _ = _run(capsys, "--use-tis", "--tis-clip", "3", "--tis-level", "sequence")
    assert code == 0
    assert _runs(out) == ("slime runs: slime's policy loss (PPO clip, pi_old recomputed) with slime's built-in TIS "
                          "(vanilla_tis_function): each token's PPO term times clamp(pi_old/pi_rollout, 0, 3.0)")
    assert ("warning: slime's built-in TIS reads only tis_clip and tis_clip_low, so these settings have no effect: "
            f"tis_level. Add --custom-tis-function-path {MIS_TIS} to apply them") in out


def test_a_tis_function_runs_in_slimes_tis_hook(capsys, tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("use_tis: true\ntis_level: sequence\n")
    code, out, _ = _run(capsys, "--custom-config-path", str(path), "--custom-tis-function-path", MIS_TIS)
    assert code == 0
    assert _runs(out).startswith(f"slime runs: slime's policy loss (PPO clip, pi_old recomputed) with slime's TIS "
                                 f"hook: slime passes each token's PPO term through {MIS_TIS}")
    assert "warning:" not in out


@pytest.mark.parametrize("argv, yaml_text", [
    (["--rollout-correction-preset", "bypass_pg_is"], None),
    (["--rollout-correction-preset", "bypass_pg_is", "--use-tis", "--custom-tis-function-path", MIS_TIS], None),
    (["--use-rollout-logprobs", "--custom-tis-function-path", MIS_TIS], "use_tis: true\n"),
    (["--use-rollout-logprobs"], "use_rs: true\nrs_level: sequence\nrs_upper_bound: 2.0\n"),
])
def test_a_bypass_correction_outside_slime_rcs_custom_loss_is_refused(capsys, tmp_path, argv, yaml_text):
    if yaml_text is not None:
        path = tmp_path / "shared.yaml"
        path.write_text(yaml_text)
        argv = [*argv, "--custom-config-path", str(path)]
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert "mode='bypass'" in err and "a bypass correction that only slime-rc's custom loss runs" in err
    assert f"Add {CUSTOM_LOSS_FLAGS}" in err
    code, out, err = _run(capsys, *argv, *CUSTOM_LOSS_FLAGS.split())  # the fix
    assert code == 0, err
    assert _runs(out).startswith(f"slime runs: slime-rc's custom loss ({SLIME_RC_LOSS}), which runs every mode; "
                                 f"here: bypass")


def test_plain_bypass_ppo_is_slimes_own(capsys):
    code, out, _ = _run(capsys, "--use-rollout-logprobs")
    assert code == 0
    assert _runs(out) == ("slime runs: slime's policy loss (PPO clip; bypass: pi_old := pi_rollout, no recompute), "
                          "no rollout correction")


def test_the_custom_loss_says_it_does_not_call_the_tis_function(capsys):
    code, out, _ = _run(capsys, "--use-tis", "--custom-tis-function-path", MIS_TIS, *CUSTOM_LOSS_FLAGS.split())
    assert code == 0
    assert "here: decoupled PPO" in _runs(out)
    assert f"warning: slime does not call --custom-tis-function-path {MIS_TIS} with a custom loss" in out


def test_json_says_which_loss_runs(capsys):
    code, out, _ = _run(capsys, "--json", "--use-tis")
    assert code == 0
    assert json.loads(out)["slime_runs"]["kind"] == "builtin_tis"
    code, out, _ = _run(capsys, "--json", "--rollout-correction-preset", "decoupled_seq_is_rs", "--use-tis",
                        "--custom-tis-function-path", MIS_TIS)
    assert code == 0
    data = json.loads(out)
    assert data["slime_runs"]["kind"] == "tis_function" and data["slime_runs"]["warnings"] == []
