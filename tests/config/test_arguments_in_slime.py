"""slime-rc's flags inside slime's parser, tested the way slime uses them, without a slime checkout.

slime (THUDM/slime at 624b824a8, ``slime/utils/arguments.py``) builds its parser like this (facts of
``shared/notes/slime-contract.md``):

* Megatron-LM's ``parse_args`` (Megatron-LM 1dcf0daf) adds Megatron's flags (``--calculate-per-token-loss`` among
  them), then calls slime's ``add_slime_arguments(parser)``;
* ``add_slime_arguments`` calls the user's ``add_custom_arguments(parser)`` hook FIRST, then adds slime's own flags:
  a hook that defines one of slime's flags fails with ``argparse.ArgumentError: ... conflicting option string``;
* it parses with ``parse_known_args`` (unknown flags are dropped silently);
* ``slime_validate_args`` fills ``eps_clip_high`` in, then copies every key of the ``--custom-config-path`` YAML onto
  ``args`` (``yaml.safe_load``, ``setattr``): the YAML overrides the flags.

slime's side is ``tests/slime_args.py``, slime-rc's own model of slime's parser and validation (no slime code): its
hook is called from a frame whose module name is slime's parser module, the frame our hook looks for.  The names of
slime's parser the tests need (the flags slime shares with us, the arg names nearest to our YAML keys) are stated
there as facts, read off slime's real parser.
"""

import argparse
import os
import sys

import pytest
import yaml

from slime_rc.config.arguments import (FLAGS, OTHER_FLAGS, SLIME_OWNED_FLAGS, SLIME_PARSER_MODULE,
                                       add_rollout_correction_arguments, called_by_slime, resolve_args)
from slime_rc.config.knobs import SPELLINGS
from slime_rc.config.resolution import near_miss, resolve
from slime_rc.config.yaml_config import load_yaml_layer

from tests import slime_args
from tests.checks import raises_mentioning as _raises


def _slime_parse_args(argv, add_custom_arguments=add_rollout_correction_arguments, validated=True):
    """slime's parse_args (the fixture): Megatron's flags, our hook called first from slime's module, slime's flags,
    parse_known_args, then slime's validation with the YAML copied onto args last (``validated=False``: args as the
    parser leaves them).  Returns ``(args, unknown argv)``."""
    return slime_args.parse_known_args(argv, hook=add_custom_arguments, validated=validated)


def _write(tmp_path, text, name="shared.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- the hook inside slime's parser ------------------------------------------------------------------------------

def test_the_hook_runs_in_a_frame_of_slimes_parser_module_before_slimes_flags():
    # what slime's add_slime_arguments does and what called_by_slime looks for
    seen = {}

    def spy(parser):
        seen["caller"] = sys._getframe(1).f_globals["__name__"]
        seen["called_by_slime"] = called_by_slime()
        seen["slimes_flags_yet"] = sorted(set(slime_args.SLIME_FLAGS) & set(parser._option_string_actions))
        seen["megatrons_flags_yet"] = sorted(set(slime_args.MEGATRON_FLAGS) & set(parser._option_string_actions))
        return parser
    _slime_parse_args([], spy)
    assert seen == {"caller": SLIME_PARSER_MODULE, "called_by_slime": True, "slimes_flags_yet": [],
                    "megatrons_flags_yet": ["--calculate-per-token-loss"]}
    assert SLIME_PARSER_MODULE == "slime.utils.arguments"


def test_without_slime_mode_the_hook_conflicts_with_slimes_flags():
    # the bug: forced outside slime mode, our --eps-clip is defined before slime's own
    with pytest.raises(argparse.ArgumentError, match="conflicting option string"):
        _slime_parse_args([], lambda p: add_rollout_correction_arguments(p, slime=False))


def test_hook_detects_slimes_calling_frame_and_leaves_slimes_flags_to_slime():
    args, unknown = _slime_parse_args([], validated=False)
    assert unknown == []
    # slime's definitions, with slime's defaults
    assert (args.use_tis, args.get_mismatch_metrics, args.use_rollout_logprobs, args.calculate_per_token_loss) == (
        False, False, False, False)
    assert (args.tis_clip, args.tis_clip_low, args.eps_clip, args.eps_clip_high, args.eps_clip_c) == (
        2.0, 0, 0.2, None, None)
    assert args.loss_type == "policy_loss" and args.custom_config_path is None
    # the flags slime lacks are ours, None = not given
    for flag in list(FLAGS) + list(OTHER_FLAGS):
        if flag not in SLIME_OWNED_FLAGS:
            assert getattr(args, flag[2:].replace("-", "_")) is None, flag
    # slime's validation fills eps_clip_high in and leaves the rest as the parser did
    validated, unknown = _slime_parse_args([])
    assert unknown == [] and validated.eps_clip_high == 0.2
    assert {k: v for k, v in vars(validated).items() if k != "eps_clip_high"} == {
        k: v for k, v in vars(args).items() if k != "eps_clip_high"}


def test_slimes_flags_keep_slimes_meaning():
    args, _ = _slime_parse_args(["--tis-clip", "3", "--custom-tis-function-path", "pkg_not_importable_xyz.fn",
                                 "--eps-clip", "0.1"])
    assert args.tis_clip == 3.0 and args.eps_clip == 0.1
    # slime's --custom-tis-function-path is a plain string (slime loads it later); ours checks it while parsing
    assert args.custom_tis_function_path == "pkg_not_importable_xyz.fn"
    with pytest.raises(SystemExit):
        add_rollout_correction_arguments(argparse.ArgumentParser(), slime=False).parse_args(
            ["--custom-tis-function-path", "pkg_not_importable_xyz.fn"])


def test_flags_slime_lacks_land_on_slimes_yaml_key_attributes():
    args, unknown = _slime_parse_args([
        "--use-rs", "--rs-level", "geometric", "--rs-upper-bound", "0.999_1.001", "--rs-lower-bound", "0.99",
        "--rs-veto-threshold", "1e-4", "--tis-level", "sequence", "--tis-mode", "mask", "--tis-lower-bound", "0.5",
        "--tis-upper-bound", "5", "--tis-batch-normalize", "--rollout-correction-preset", "decoupled_seq_is",
        "--use-rollout-correction", "--rollout-correction-loss-type", "ppo_clip"])
    assert unknown == []
    assert (args.use_rs, args.rs_level, args.rs_upper_bound, args.rs_lower_bound, args.rs_veto_threshold) == (
        True, "geometric", "0.999_1.001", 0.99, 1e-4)
    assert (args.tis_level, args.tis_mode, args.tis_lower_bound, args.tis_upper_bound, args.tis_batch_normalize) == (
        "sequence", "mask", 0.5, 5.0, True)
    assert args.rollout_correction_preset == "decoupled_seq_is" and args.use_rollout_correction is True
    assert args.rollout_correction_loss_type == "ppo_clip"
    assert args.loss_type == "policy_loss"  # slime's own --loss-type is untouched


def test_no_form_of_a_slime_store_true_flag_is_dropped_by_parse_known_args():
    args, unknown = _slime_parse_args(["--use-tis", "--no-use-tis", "--no-get-mismatch-metrics"])
    assert unknown == ["--no-use-tis", "--no-get-mismatch-metrics"]
    assert args.use_tis is True  # --no-use-tis did nothing
    # our own switches keep their --no- form inside slime
    args, unknown = _slime_parse_args(["--no-use-rs"])
    assert unknown == [] and args.use_rs is False


def test_yaml_overrides_flags_inside_slime(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_level: sequence\ntis_upper_bound: 3.0\n"
                            "use_kl_loss: true\nkl_coef: 0.01\nadvantage_estimator: grpo\n")
    argv = ["--use-tis", "--tis-level", "token", "--tis-upper-bound", "4", "--custom-config-path", path]
    args, _ = _slime_parse_args(argv)
    assert (args.tis_level, args.tis_upper_bound) == ("sequence", 3.0)  # slime's setattr: the YAML won
    assert args.use_kl_loss is True and args.kl_coef == 0.01  # other plugins' keys reach args too
    res = resolve_args(args, slime=True)
    assert (res.config.is_level, res.config.is_upper_bound) == ("sequence", 3.0)
    assert res.sources["is_level"] == f"tis_level in {path}"
    assert res.sources["is_upper_bound"] == f"tis_upper_bound in {path}"
    # the same line in slime-rc's own launches: the flags win
    own = add_rollout_correction_arguments(argparse.ArgumentParser(), slime=False).parse_args(argv)
    res = resolve_args(own)
    assert (res.config.is_level, res.config.is_upper_bound) == ("token", 4.0)
    assert res.sources["is_level"] in ("--tis-level", "--use-tis")


def test_slime_resolution_before_the_yaml_is_copied_equals_after(tmp_path):
    # slime-rc config --slime resolves the parsed flags; slime's adapters see args after the YAML was copied on
    path = _write(tmp_path, "use_tis: true\ntis_upper_bound: 3.0\nrs_veto_threshold: 1.0e-4\n")
    argv = ["--tis-clip", "2.5", "--use-tis", "--tis-level", "sequence", "--custom-config-path", path]
    before, _ = _slime_parse_args(argv, validated=False)
    after, _ = _slime_parse_args(argv)
    a, b = resolve_args(before, slime=True), resolve_args(after, slime=True)
    assert a.config == b.config and a.sources == b.sources
    assert (a.config.is_upper_bound, a.config.is_level, a.config.veto_threshold) == (3.0, "sequence", 1e-4)
    assert a.sources["is_upper_bound"] == f"tis_upper_bound in {path}"  # the YAML over --tis-clip


def test_slime_defaults_count_as_not_given(tmp_path):
    # slime's --tis-clip default 2.0 must not fight a preset's or the YAML's upper bound
    args, _ = _slime_parse_args(["--use-tis", "--rollout-correction-preset", "decoupled_token_icepop"])
    res = resolve_args(args, slime=True)
    assert (res.config.is_mode, res.config.is_lower_bound, res.config.is_upper_bound) == ("mask", 0.5, 5.0)
    assert res.sources["is_upper_bound"] == "preset decoupled_token_icepop"


def test_slimes_defaults_are_slime_rcs_defaults():
    # so "default" in slime-rc config --slime is slime's default as well
    from slime_rc import RolloutCorrectionConfig
    args, _ = _slime_parse_args([])
    assert resolve_args(args, slime=True).config == RolloutCorrectionConfig()


def test_explicit_keyword_forces_slime_mode_on_any_parser():
    parser = add_rollout_correction_arguments(argparse.ArgumentParser(allow_abbrev=False), slime=True)
    for flag in SLIME_OWNED_FLAGS:
        assert flag not in parser._option_string_actions, flag
    assert "--use-rs" in parser._option_string_actions
    # and forced off inside slime's frame: the conflict of today (see the first test)


def test_detection_through_a_wrapper_hook():
    # a user's hook that adds its own flags and calls ours
    def my_hook(parser):
        add_rollout_correction_arguments(parser)
        parser.add_argument("--my-plugin-flag", type=int, default=1)
        return parser
    args, unknown = _slime_parse_args(["--my-plugin-flag", "3", "--use-rs"], my_hook)
    assert unknown == [] and args.my_plugin_flag == 3 and args.use_rs is True


def test_outside_slime_nothing_is_detected():
    assert called_by_slime() is False
    parser = add_rollout_correction_arguments(argparse.ArgumentParser())
    for flag in list(FLAGS) + list(OTHER_FLAGS):
        assert flag in parser._option_string_actions, flag


def test_slime_owned_flags_are_exactly_the_overlap_with_slimes_parser():
    # slime's flag names (tests/slime_args.py, read off slime's real parser at 624b824a8): of our flags, slime's
    # parser defines exactly SLIME_OWNED_FLAGS and none of the others
    ours = set(FLAGS) | set(OTHER_FLAGS)
    assert slime_args.SLIME_SHARED_FLAGS.isdisjoint(slime_args.SLIME_LACKS_FLAGS)
    unclassified = ours - slime_args.SLIME_SHARED_FLAGS - slime_args.SLIME_LACKS_FLAGS
    assert not unclassified, f"look {sorted(unclassified)} up in slime's parser (tests/slime_args.py)"
    assert ours & slime_args.SLIME_SHARED_FLAGS == set(SLIME_OWNED_FLAGS)
    assert ours - slime_args.SLIME_LACKS_FLAGS == set(SLIME_OWNED_FLAGS)
    # the flags the issue names as the ones slime lacks are not slime's
    for flag in ("--use-rs", "--tis-level", "--tis-mode", "--rs-level", "--rs-upper-bound", "--rs-lower-bound",
                 "--rs-veto-threshold", "--tis-batch-normalize", "--rollout-correction-preset"):
        assert flag in slime_args.SLIME_LACKS_FLAGS and flag not in slime_args.SLIME_SHARED_FLAGS, flag
        assert flag not in SLIME_OWNED_FLAGS, flag
    # the model of slime's parser defines every shared flag and none of the ones slime lacks
    slime = slime_args.parser(hook=None)
    assert slime_args.SLIME_SHARED_FLAGS <= set(slime._option_string_actions)
    assert slime_args.SLIME_LACKS_FLAGS.isdisjoint(slime._option_string_actions)


def test_slime_owned_table_matches_slimes_definitions():
    slime = slime_args.parser(hook=None)
    for flag, kwargs in SLIME_OWNED_FLAGS.items():
        action = slime._option_string_actions[flag]
        assert action.dest == flag[2:].replace("-", "_"), flag
        assert action.default == kwargs.get("default"), flag
        if "type" in kwargs:
            assert action.type is kwargs["type"], flag
        else:
            assert isinstance(action, argparse._StoreTrueAction), flag
    assert slime_args.SLIME_SHARED_FLAGS == set(SLIME_OWNED_FLAGS)


# ---- one YAML shared by every plugin -------------------------------------------------------------------------

def test_near_miss_flags_typos_of_our_keys():
    for typo, key in (("tis_uper_bound", "tis_upper_bound"), ("rs_veto_treshold", "rs_veto_threshold"),
                      ("use_tiss", "use_tis"), ("tis_levle", "tis_level"), ("TIS_MODE", "tis_mode"),
                      ("rs-upper-bound", "rs_upper_bound"), ("rollout_is_treshold", "rollout_is_threshold")):
        assert near_miss(typo, SPELLINGS) == key, typo


def test_near_miss_leaves_slimes_and_megatrons_arg_names_alone():
    # slime's arg names nearest to our YAML spellings (tests/slime_args.py: checked at 624b824a8 that no arg name of
    # slime's real parser is flagged; these are the ones within two edits of being flagged, and common YAML keys)
    names = slime_args.SLIME_ARG_NAMES_NEAR_OURS
    for name in ("use_kl_loss", "kl_coef", "eps_clip", "use_opsm", "loss_type", "advantage_estimator", "test_mode"):
        assert name in names, name
    # the attributes of slime's flags in the model of slime's parser are slime's arg names too
    names = sorted(set(names) | set(slime_args.SLIME_DEFAULTS) | {f[2:].replace("-", "_")
                                                                  for f in slime_args.SLIME_SHARED_FLAGS})
    flagged = {name: near_miss(name, SPELLINGS) for name in names}
    assert {k: v for k, v in flagged.items() if v} == {}
    # Megatron-LM's test_mode is 2 edits from tis_mode; other plugins' short keys
    for name in ("test_mode", "lr", "rank", "node", "use_opd", "use_mtp", "rs_x"):
        assert near_miss(name, SPELLINGS) is None, name


def test_near_miss_of_a_known_key_is_none_and_of_nothing_is_none():
    assert near_miss("tis_level", SPELLINGS) is None
    assert near_miss("tis_level", []) is None
    assert near_miss("tis_levle", ["tis_level", "rs_level"]) == "tis_level"


def test_shared_yaml_other_plugins_keys_are_ignored(tmp_path):
    path = _write(tmp_path, "use_tis: true\ntis_level: sequence\nuse_kl_loss: true\nkl_coef: 0.0\n"
                            "advantage_estimator: grpo\nmy_plugin:\n  depth: 3\n")
    layer = load_yaml_layer(path)
    assert layer.values == {"use_tis": True, "tis_level": "sequence"}
    assert layer.ignored == ["use_kl_loss", "kl_coef", "advantage_estimator", "my_plugin"]


@pytest.mark.parametrize("typo,key", [("tis_uper_bound", "tis_upper_bound"), ("rs_veto_treshold",
                                                                               "rs_veto_threshold"),
                                      ("use_tiss", "use_tis")])
def test_shared_yaml_near_miss_is_refused_naming_file_key_and_closest(tmp_path, typo, key):
    path = _write(tmp_path, f"use_tis: true\nkl_coef: 0.0\n{typo}: 1\n")
    for slime in (False, True):
        _raises(lambda: load_yaml_layer(path, slime=slime), path, repr(typo), f"Did you mean {key!r}?")


def test_exponent_without_a_dot_arrives_in_slime_as_a_string(tmp_path):
    path = _write(tmp_path, "rs_veto_threshold: 1e-4\n")
    with open(path) as f:
        assert yaml.safe_load(f) == {"rs_veto_threshold": "1e-4"}  # what slime copies onto args
    assert load_yaml_layer(path).values == {"rs_veto_threshold": 1e-4}  # slime-rc's own launches read the number
    _raises(lambda: load_yaml_layer(path, slime=True), path, "rs_veto_threshold", "'1e-4'", "safe_load",
            "rs_veto_threshold: 1.0e-4")


def test_underscored_number_arrives_in_slime_as_a_number(tmp_path):
    path = _write(tmp_path, "use_rs: true\nrs_level: geometric\nrs_upper_bound: 0.5_5\n")
    assert load_yaml_layer(path).values["rs_upper_bound"] == "0.5_5"
    _raises(lambda: load_yaml_layer(path, slime=True), path, "rs_upper_bound", "0.55", "rs_upper_bound: '0.5_5'")


@pytest.mark.parametrize("value", ["tis_upper_bound: '2.0'", 'tis_upper_bound: "3"', "rs_veto_threshold: '1e-4'",
                                   "rs_upper_bound: '2'"])
def test_quoted_numbers_are_refused(tmp_path, value):
    key, _, text = value.partition(": ")
    path = _write(tmp_path, f"use_tis: true\nuse_rs: true\n{value}\n")
    for slime in (False, True):
        msg = _raises(lambda: load_yaml_layer(path, slime=slime), path, key, repr(text.strip("'\"")),
                      "quoted string", "without quotes")
        assert "1.0e-4" in msg if "e-4" in text else True


def test_quoted_bands_and_lists_stay_strings(tmp_path):
    path = _write(tmp_path, "use_rs: true\nrs_level: token,geometric\nrs_upper_bound: '2,0.999_1.001'\n")
    assert load_yaml_layer(path, slime=True).values["rs_upper_bound"] == "2,0.999_1.001"


def test_loss_type_in_a_slime_yaml_is_slimes_key(tmp_path):
    slimes = _write(tmp_path, "loss_type: custom_loss\nuse_tis: true\n", "slimes.yaml")
    assert load_yaml_layer(slimes, slime=True).ignored == ["loss_type"]
    _raises(lambda: resolve([load_yaml_layer(slimes)]), "loss_type='custom_loss'")  # outside slime: our key
    ours = _write(tmp_path, "loss_type: reinforce\nuse_rollout_logprobs: true\n", "ours.yaml")
    _raises(lambda: load_yaml_layer(ours, slime=True), ours, "loss_type", "'reinforce'", "Unknown loss type",
            "rollout_correction_loss_type: reinforce")
    fixed = _write(tmp_path, "rollout_correction_loss_type: reinforce\nuse_rollout_logprobs: true\n", "fixed.yaml")
    for slime in (False, True):
        assert load_yaml_layer(fixed, slime=slime).values["loss_type"] == "reinforce"


def test_yaml_key_of_the_flag_attribute_overrides_the_flag_in_slime(tmp_path):
    path = _write(tmp_path, "rollout_correction_loss_type: reinforce\nuse_tis: true\n")
    args, _ = _slime_parse_args(["--use-rollout-logprobs", "--rollout-correction-loss-type", "ppo_clip",
                                 "--custom-config-path", path])
    assert args.rollout_correction_loss_type == "reinforce"
    res = resolve_args(args, slime=True)
    assert (res.config.mode, res.config.loss_type) == ("bypass", "reinforce")
    assert res.sources["loss_type"] == f"rollout_correction_loss_type in {os.path.abspath(path)}"


def test_every_attribute_our_flags_set_is_a_yaml_key_so_the_yaml_overrides_it_in_slime(tmp_path):
    # slime's setattr puts a YAML key on the attribute of the same name: for each of our flags that attribute must
    # mean what the flag means, or the YAML would silently not override the flag
    for flag, (setting, _, _) in FLAGS.items():
        attr = flag[2:].replace("-", "_")
        assert attr in SPELLINGS, flag
        assert SPELLINGS[attr][1]("x") == SPELLINGS[setting][1]("x"), flag  # the same setting as the flag
    path = _write(tmp_path, "rollout_correction_safety_bound: 10\nrollout_correction_on_nonfinite: reject\n"
                            "rollout_correction_preset: decoupled_seq_is\n")
    args, _ = _slime_parse_args(["--rollout-correction-safety-bound", "30", "--custom-config-path", path])
    res = resolve_args(args, slime=True)
    assert (res.config.safety_bound, res.config.on_nonfinite) == (10.0, "reject")
    assert res.sources["safety_bound"] == f"rollout_correction_safety_bound in {path}"
    assert res.config.is_level == "sequence" and res.sources["is_level"] == "preset decoupled_seq_is"
