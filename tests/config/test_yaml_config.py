"""``--custom-config-path``: YAML files in slime's dialect (flat keys, ``mis_*`` aliases) and verl's dialect
(``algorithm.rollout_correction`` and the older ``algorithm.rollout_is*`` framework keys).

Expected configs are built directly with ``RolloutCorrectionConfig(...)`` from the documented meaning of each key.
"""

import argparse
import os
import textwrap

import pytest

from slime_rc import RejectionCriterion, RolloutCorrectionConfig
from slime_rc.config.arguments import add_rollout_correction_arguments, config_from_args
from slime_rc.config.resolution import resolve
from slime_rc.config.yaml_config import load_yaml_layer

from tests.checks import raises_mentioning as _raises

C = RolloutCorrectionConfig


def _write(tmp_path, text, name="rc.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _load(path):
    """The config of a YAML file alone, the way the launch reads it."""
    return resolve([load_yaml_layer(path)]).config


def _load_text(tmp_path, text, name="rc.yaml"):
    return _load(_write(tmp_path, text, name))


def _via_flag(path, *argv):
    parser = add_rollout_correction_arguments(argparse.ArgumentParser())
    return config_from_args(parser.parse_args(["--custom-config-path", path, *argv]))


# ---------------------------------------------------------------------------------------------------------------
# slime dialect
# ---------------------------------------------------------------------------------------------------------------

def test_slime_flat_keys(tmp_path):
    cfg = _load_text(tmp_path, """
        use_tis: true
        tis_level: geometric
        tis_mode: clip
        tis_lower_bound: 0.5
        tis_upper_bound: 3.0
        tis_batch_normalize: true
        use_rs: true
        rs_level: token,seq_max_k3
        rs_upper_bound: 4.0,0.05
        rs_veto_threshold: 1.0e-5
    """)
    assert cfg == C(is_level="geometric", is_mode="clip", is_lower_bound=0.5, is_upper_bound=3.0,
                    is_batch_normalize=True,
                    rs=(RejectionCriterion("token", 4.0, 0.25), RejectionCriterion("seq_max_k3", 0.05)),
                    veto_threshold=1e-5, mode="decoupled")


def test_slime_mis_yaml(tmp_path):
    # the key set of slime's examples/train_infer_mismatch_helper/mis.yaml
    path = _write(tmp_path, """
        # Enable importance sampling, details refer to the comments of compute_mis_weights in mis.py
        use_tis: true
        use_rs: false
        mis_level: "sequence"
        mis_mode: "mask"
        mis_upper_bound: 2.0
        mis_lower_bound: 0.5
        mis_veto_threshold: 1.0e-4
        mis_batch_normalize: true
    """, "mis.yaml")
    expected = C(is_level="sequence", is_mode="mask", is_upper_bound=2.0, is_lower_bound=0.5, veto_threshold=1e-4,
                 is_batch_normalize=True)
    assert _load(path) == expected
    assert _via_flag(path) == expected
    assert expected.mode == "decoupled" and expected.rejects


def test_mis_aliases_equal_tis_keys(tmp_path):
    mis = _load_text(tmp_path, """
        use_tis: true
        mis_level: token
        mis_mode: clip
        mis_lower_bound: 0.3
        mis_upper_bound: 3.0
        mis_batch_normalize: true
        mis_veto_threshold: 1.0e-6
    """, "a.yaml")
    tis = _load_text(tmp_path, """
        use_tis: true
        tis_level: token
        tis_mode: clip
        tis_lower_bound: 0.3
        tis_upper_bound: 3.0
        tis_batch_normalize: true
        rs_veto_threshold: 1.0e-6
    """, "b.yaml")
    assert mis == tis
    assert mis.is_lower_bound == 0.3 and mis.veto_threshold == 1e-6


def test_slime_older_tis_clip_keys(tmp_path):
    cfg = _load_text(tmp_path, "use_tis: true\ntis_clip: 3.0\ntis_clip_low: 0\n")
    assert cfg == C(is_level="token", is_upper_bound=3.0)


def test_slime_mode_keys(tmp_path):
    cfg = _load_text(tmp_path, """
        use_rollout_logprobs: true
        use_tis: true
        tis_level: sequence
        loss_type: reinforce
        get_mismatch_metrics: true
    """)
    assert cfg == C(mode="bypass", loss_type="reinforce", is_level="sequence", get_mismatch_metrics=True)
    assert cfg.is_weights_applied


def test_slime_engine_keys(tmp_path):
    cfg = _load_text(tmp_path, """
        use_tis: true
        safety_bound: 10
        on_nonfinite: reject
        rejected_in_denominator: true
        quantile_bins_per_octave: 32
    """)
    assert cfg == C(is_level="token", safety_bound=10.0, on_nonfinite="reject", rejected_in_denominator=True,
                    quantile_bins_per_octave=32)


def test_yaml_scientific_notation_without_a_dot(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-4 as the *string* '1e-4'; it must still mean 1e-4
    cfg = _load_text(tmp_path, "use_tis: true\ntis_upper_bound: 5e0\nrs_veto_threshold: 1e-4\n")
    assert cfg.veto_threshold == 1e-4 and cfg.is_upper_bound == 5.0


# ---------------------------------------------------------------------------------------------------------------
# verl dialect
# ---------------------------------------------------------------------------------------------------------------

def test_verl_rollout_correction_block(tmp_path):
    path = _write(tmp_path, """
        algorithm:
          adv_estimator: grpo
          gamma: 1.0
          lam: 1.0
          use_kl_in_reward: false
          rollout_correction:
            rollout_is: sequence
            rollout_is_threshold: 2.0
            rollout_is_batch_normalize: true
            rollout_rs: geometric
            rollout_rs_threshold: 0.999_1.001
            bypass_mode: true
            loss_type: reinforce
        actor_rollout_ref:
          actor:
            ppo_mini_batch_size: 16
          rollout:
            name: sglang
            n: 4
        trainer:
          total_epochs: 1
    """)
    expected = C(is_level="sequence", is_upper_bound=2.0, is_batch_normalize=True,
                 rs=(RejectionCriterion("geometric", 1.001, 0.999),), mode="bypass", loss_type="reinforce")
    assert _load(path) == expected
    assert _via_flag(path) == expected


def test_verl_non_rollout_keys_are_ignored(tmp_path):
    block = "  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 3.0\n"
    bare = _load_text(tmp_path, "algorithm:\n" + block, "bare.yaml")
    full = _load_text(tmp_path, "algorithm:\n  gamma: 0.99\n  kl_ctrl:\n    kl_coef: 0.001\n" + block
                      + "actor_rollout_ref:\n  rollout:\n    n: 8\ndata:\n  train_batch_size: 4\n", "full.yaml")
    assert bare == full == C(is_level="token", is_upper_bound=3.0)


def test_verl_icepop_threshold_string_is_mask_mode(tmp_path):
    cfg = _load_text(tmp_path, """
        algorithm:
          rollout_correction:
            rollout_is: token
            rollout_is_threshold: "0.5_5.0"
    """)
    assert cfg == C(is_level="token", is_mode="mask", is_lower_bound=0.5, is_upper_bound=5.0)
    assert cfg.rejects


def test_verl_icepop_threshold_unquoted(tmp_path):
    # two dots: YAML keeps it a string
    cfg = _load_text(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                               "    rollout_is_threshold: 0.5_5.0\n")
    assert (cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("mask", 0.5, 5.0)


def test_verl_icepop_threshold_unquoted_integer_upper_is_not_silently_a_number(tmp_path):
    # YAML 1.1 reads the unquoted 0.5_5 as the float 0.55 (underscores are digit separators).  The user meant the
    # IcePop band [0.5, 5]; silently truncating every IS weight at 0.55 is wrong: read it as the band or refuse it.
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                            "    rollout_is_threshold: 0.5_5\n")
    try:
        cfg = _load(path)
    except ValueError:
        return
    assert (cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("mask", 0.5, 5.0), cfg


def test_verl_threshold_with_two_underscores_is_refused(tmp_path):
    # '0.5_5_0' is a typo of '0.5_5.0'; float('5_0') is 50.0, which must not become the upper bound
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                            "    rollout_is_threshold: '0.5_5_0'\n")
    _raises(lambda: _load(path), "rollout_is_threshold", "0.5_5_0")


def test_verl_older_block_keys(tmp_path):
    cfg = _load_text(tmp_path, """
        algorithm:
          rollout_correction:
            rollout_is: token
            rollout_is_threshold: 2.0
            rollout_rs: token
            rollout_rs_threshold: 3.0
            rollout_rs_threshold_lower: 0.25
            rollout_token_veto_threshold: 1.0e-4
            bypass_mode: true
            use_policy_gradient: true
    """)
    assert cfg == C(is_level="token", is_upper_bound=2.0, rs=(RejectionCriterion("token", 3.0, 0.25),),
                    veto_threshold=1e-4, mode="bypass", loss_type="reinforce")


def test_verl_use_policy_gradient_false_is_ppo_clip(tmp_path):
    cfg = _load_text(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                               "    bypass_mode: true\n    use_policy_gradient: false\n")
    assert (cfg.mode, cfg.loss_type, cfg.is_weights_applied) == ("bypass", "ppo_clip", False)


def test_verl_null_is_and_rs_mean_off(tmp_path):
    cfg = _load_text(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: null\n    rollout_rs: null\n")
    assert cfg == C() and cfg.mode == "standard"


def test_verl_framework_keys_under_algorithm(tmp_path):
    cfg = _load_text(tmp_path, """
        algorithm:
          gamma: 1.0
          rollout_is: true
          rollout_is_level: geometric
          rollout_is_mode: clip
          rollout_is_threshold: 3.0
          rollout_is_threshold_lower: 0.5
          rollout_is_veto_threshold: 1.0e-5
    """)
    assert cfg == C(is_level="geometric", is_mode="clip", is_upper_bound=3.0, is_lower_bound=0.5,
                    veto_threshold=1e-5)


def test_verl_framework_rollout_is_true_defaults_to_token(tmp_path):
    cfg = _load_text(tmp_path, "algorithm:\n  rollout_is: true\n  rollout_is_threshold: 2.0\n")
    assert cfg == C(is_level="token", is_upper_bound=2.0)


def test_verl_framework_rollout_is_false_is_metrics_only(tmp_path):
    # the older framework: rollout_is false = compute the IS metrics, don't apply weights
    cfg = _load_text(tmp_path, "algorithm:\n  rollout_is: false\n")
    assert cfg == C(get_mismatch_metrics=True)
    assert not cfg.is_enabled and cfg.mode == "standard" and cfg.needs_rollout_log_probs


def test_verl_block_and_framework_keys_may_be_split_across_both_places(tmp_path):
    cfg = _load_text(tmp_path, "algorithm:\n  rollout_is_threshold: 4.0\n  rollout_correction:\n"
                               "    rollout_is: token\n")
    assert cfg == C(is_level="token", is_upper_bound=4.0)


SAME_SETTINGS = [
    # (slime text, verl text): the same settings in both dialects
    ("use_tis: true\ntis_level: sequence\ntis_upper_bound: 3.0\n",
     "algorithm:\n  rollout_correction:\n    rollout_is: sequence\n    rollout_is_threshold: 3.0\n"),
    ("use_tis: true\ntis_level: token\ntis_mode: mask\ntis_lower_bound: 0.5\ntis_upper_bound: 5.0\n",
     "algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: '0.5_5.0'\n"),
    ("use_tis: true\ntis_level: sequence\ntis_batch_normalize: true\nuse_rs: true\nrs_level: geometric\n"
     "rs_upper_bound: '0.999_1.001'\nrs_veto_threshold: 1.0e-4\nuse_rollout_logprobs: true\nloss_type: reinforce\n",
     "algorithm:\n  rollout_correction:\n    rollout_is: sequence\n    rollout_is_batch_normalize: true\n"
     "    rollout_rs: geometric\n    rollout_rs_threshold: '0.999_1.001'\n    rollout_token_veto_threshold: 1.0e-4\n"
     "    bypass_mode: true\n    loss_type: reinforce\n"),
    ("use_rs: true\nrs_level: seq_mean_k3\nrs_upper_bound: 0.01\n",
     "algorithm:\n  rollout_correction:\n    rollout_rs: seq_mean_k3\n    rollout_rs_threshold: 0.01\n"),
    ("use_tis: true\ntis_level: geometric\ntis_mode: clip\ntis_lower_bound: 0.5\ntis_upper_bound: 3.0\n"
     "rs_veto_threshold: 1.0e-5\n",
     "algorithm:\n  rollout_is: true\n  rollout_is_level: geometric\n  rollout_is_mode: clip\n"
     "  rollout_is_threshold: 3.0\n  rollout_is_threshold_lower: 0.5\n  rollout_is_veto_threshold: 1.0e-5\n"),
    ("get_mismatch_metrics: true\n", "algorithm:\n  rollout_is: false\n"),
]


@pytest.mark.parametrize("slime_text,verl_text", SAME_SETTINGS)
def test_same_settings_in_both_dialects_give_equal_configs(tmp_path, slime_text, verl_text):
    a = _load_text(tmp_path, slime_text, "slime.yaml")
    b = _load_text(tmp_path, verl_text, "verl.yaml")
    assert a == b
    assert a != C()  # each pair configures something


# ---------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------

def test_unknown_slime_key_names_key_file_and_closest(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_levle: sequence\n")
    _raises(lambda: _load(path), "'tis_levle'", os.path.abspath(path), "Did you mean 'tis_level'?")


def test_unknown_verl_key_names_key_file_and_closest(tmp_path):
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_treshold: 2.0\n")
    _raises(lambda: _load(path), "'rollout_is_treshold'", os.path.abspath(path),
            "Did you mean 'rollout_is_threshold'?")


def test_unknown_slime_key_far_from_ours_is_another_plugins_and_ignored(tmp_path):
    # slime copies ONE YAML onto args for every plugin: a key slime-rc does not know is someone else's
    path = _write(tmp_path, "zzzzqqqq: 1\nuse_tis: true\nuse_kl_loss: true\n")
    layer = load_yaml_layer(path)
    assert layer.ignored == ["zzzzqqqq", "use_kl_loss"]
    assert _load(path) == C(is_level="token")
    assert _via_flag(path) == C(is_level="token")


def test_unknown_key_inside_the_verl_block_is_still_refused_with_the_valid_keys(tmp_path):
    # the verl block is ours as a whole: a key in it that we do not know is an error
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n    zzzzqqqq: 1\n")
    msg = _raises(lambda: _load(path), "'zzzzqqqq'", "Valid keys", "use_tis", "rollout_is_threshold", "mis_level")
    assert "Did you mean" not in msg


def test_unknown_key_through_the_flag(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_uper_bound: 3\n")
    _raises(lambda: _via_flag(path), "'tis_uper_bound'", os.path.abspath(path), "Did you mean 'tis_upper_bound'?")


def test_missing_file_names_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _raises(lambda: load_yaml_layer("nowhere.yaml"), "--custom-config-path", str(tmp_path / "nowhere.yaml"),
            "no such file")


def test_invalid_yaml_names_the_line(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_level: sequence\n bad: : x\n")
    _raises(lambda: _load(path), os.path.abspath(path), "not valid YAML", "line 3", "column")


def test_invalid_yaml_unclosed_bracket_names_the_line(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_level: [token\ntis_mode: clip\n")
    _raises(lambda: _load(path), os.path.abspath(path), "not valid YAML", "line ")


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n"])
def test_empty_file(tmp_path, text):
    path = _write(tmp_path, text)
    _raises(lambda: _load(path), os.path.abspath(path), "empty")


@pytest.mark.parametrize("text,kind", [("- use_tis\n- tis_level\n", "list"), ("use_tis\n", "str"), ("3\n", "int")])
def test_not_a_mapping(tmp_path, text, kind):
    path = _write(tmp_path, text)
    _raises(lambda: _load(path), os.path.abspath(path), "mapping", kind)


@pytest.mark.parametrize("text", ["algorithm:\n  gamma: 1.0\n  lam: 0.95\n",
                                  "algorithm:\n  rollout_correction:\n",
                                  "algorithm:\n  rollout_correction: {}\n"])
def test_verl_without_rollout_correction_block(tmp_path, text):
    path = _write(tmp_path, text)
    _raises(lambda: _load(path), os.path.abspath(path), "algorithm.rollout_correction")


def test_verl_block_not_a_mapping(tmp_path):
    path = _write(tmp_path, "algorithm:\n  rollout_correction: [token]\n")
    _raises(lambda: _load(path), os.path.abspath(path), "rollout_correction", "mapping", "list")


def test_verl_algorithm_not_a_mapping(tmp_path):
    path = _write(tmp_path, "algorithm: grpo\n")
    _raises(lambda: _load(path), os.path.abspath(path), "'algorithm'", "mapping")


def test_slime_keys_mixed_with_algorithm_block(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_upper_bound: 3\nalgorithm:\n  rollout_correction:\n"
                            "    rollout_is: token\n")
    _raises(lambda: _load(path), os.path.abspath(path), "use_tis", "tis_upper_bound", "algorithm",
            "one dialect")


@pytest.mark.parametrize("key,under_algorithm,block", [
    ("rollout_is", "  rollout_is: token\n", "    rollout_is: token\n"),  # even with the same value
    ("rollout_is_threshold", "  rollout_is_threshold: 3.0\n",
     "    rollout_is: token\n    rollout_is_threshold: 2.0\n"),
])
def test_key_both_in_block_and_directly_under_algorithm(tmp_path, key, under_algorithm, block):
    path = _write(tmp_path, "algorithm:\n" + under_algorithm + "  rollout_correction:\n" + block)
    _raises(lambda: _load(path), os.path.abspath(path), key, "both", "keep one")


def test_two_spellings_of_one_setting_with_different_values(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_upper_bound: 3.0\ntis_clip: 2.0\n")
    _raises(lambda: _load(path), "'tis_upper_bound'", "'tis_clip'", "keep one")


def test_two_dialects_for_one_setting_in_one_file(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_upper_bound: 3.0\nrollout_is_threshold: 3.0\n")
    _raises(lambda: _load(path), "'tis_upper_bound'", "'rollout_is_threshold'", "one spelling")


@pytest.mark.parametrize("text", [
    "use_tis: true\ntis_upper_bound: 3.0\ntis_clip: 2.0\n",                                     # two spellings
    "use_tis: true\ntis_upper_bound: 3.0\nrollout_is_threshold: 3.0\n",                         # two dialects
    "algorithm:\n  rollout_correction:\n    rollout_is: token\n    rollout_is_threshold: 'a_b'\n",  # bad band
    "algorithm:\n  rollout_correction:\n    bypass_mode: true\n    loss_type: ppo_clip\n"
    "    use_policy_gradient: true\n",                                                           # loss disagrees
], ids=["two-spellings", "two-dialects", "bad-band", "loss-disagrees"])
def test_every_error_about_a_file_names_the_file(tmp_path, text):
    # with a preset, a YAML file and flags on one command line, an error that does not say which file it is
    # about leaves the user guessing; the unknown-key and dead-setting errors name it, these must too
    path = _write(tmp_path, text)
    _raises(lambda: _load(path), os.path.abspath(path))


def test_value_errors_name_the_key_and_file(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_level: tokn\n")
    _raises(lambda: _load(path), "is_level='tokn'", "Did you mean 'token'?", f"tis_level in {os.path.abspath(path)}")
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                            "    rollout_is_threshold: -1\n", "neg.yaml")
    _raises(lambda: _load(path), "is_upper_bound=-1", f"rollout_is_threshold in {os.path.abspath(path)}")


def test_dead_setting_in_yaml_names_file_and_switch(tmp_path):
    path = _write(tmp_path, "tis_upper_bound: 3\n")
    _raises(lambda: _load(path), "tis_upper_bound=3", os.path.abspath(path), "use_tis")
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_rs_threshold: 2.0\n", "verl.yaml")
    _raises(lambda: _load(path), "rollout_rs_threshold=2.0", os.path.abspath(path), "use_rs")


def test_mode_error_in_yaml_names_the_keys(tmp_path):
    path = _write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n    loss_type: reinforce\n")
    _raises(lambda: _load(path), "loss_type='reinforce'", "bypass", f"loss_type in {os.path.abspath(path)}")


@pytest.mark.parametrize("text", ['use_tis: "false"\n', "use_rs: 1\nrs_upper_bound: 2.0\n",
                                  "algorithm:\n  rollout_correction:\n    bypass_mode: 'no'\n"])
def test_a_switch_must_be_a_boolean_not_a_truthy_string(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="must be true or false") as e:
        load_yaml_layer(str(path))
    assert str(path) in str(e.value)
