"""Settings that cannot act in the configuration they are given in: refused or printed as a note.

The rule is the one of the existing dead-setting check (``--tis-level`` without ``--use-tis``,
slime_rc/config/stack.py): a setting given above the highest layer of the settings that make it dead, or on the same
command line, is refused with a ``ValueError`` that names the flag/key, its value, why it does nothing and the fix;
one left in a file or preset beside them, or made dead by a higher layer, is a note (``slime-rc config`` and the
launch print it).  A setting given equal to its default counts as given, as in the existing check.

Cases: the PPO clip knobs with the REINFORCE loss; the quantile resolution with IS off; ``rejected_in_denominator``
where no token can be rejected.
"""

import json
import re
import warnings

import pytest

from slime_rc import RolloutCorrectionConfig
from slime_rc.config.arguments import config_from_args
from slime_rc.config.stack import Layer, Stack

from tests.checks import raises_mentioning as _raises
from tests.config.test_arguments import _config, _parse, _resolve  # one copy of the argv helpers

BYPASS_PG = ["--use-rollout-logprobs", "--rollout-correction-loss-type", "reinforce"]




def _yaml(tmp_path, text, name="rc.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# PPO clip knobs with the REINFORCE loss
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value", [("--eps-clip", "0.3"), ("--eps-clip-high", "0.28"), ("--eps-clip-c", "3")])
def test_ppo_clip_flag_with_reinforce_is_refused(flag, value):
    msg = _raises(lambda: _config(BYPASS_PG + [flag, value]),
                  f"{flag}={float(value)!r} has no effect", "the REINFORCE loss",
                  "(--rollout-correction-loss-type='reinforce')", "no PPO ratio to clip", "Drop it",
                  "--rollout-correction-loss-type ppo_clip")
    assert msg == (f"{flag}={float(value)!r} has no effect: the REINFORCE loss "
                   f"(--rollout-correction-loss-type='reinforce') has no PPO ratio to clip (it is -stopgrad(w) * "
                   f"log pi_theta * A). Drop it, or use the PPO loss (--rollout-correction-loss-type ppo_clip) for "
                   f"the clip to act.")


def test_ppo_clip_flag_on_a_reinforce_preset_names_the_preset():
    _raises(lambda: _config(["--rollout-correction-preset", "pg_is", "--eps-clip-high", "0.28"]),
            "--eps-clip-high=0.28 has no effect", "loss_type='reinforce' of preset pg_is",
            "--rollout-correction-loss-type ppo_clip")


def test_ppo_clip_flag_equal_to_its_default_counts_as_given():
    # as --tis-level token (the default) without --use-tis is refused: given is given
    _raises(lambda: _config(BYPASS_PG + ["--eps-clip", "0.2"]), "--eps-clip=0.2 has no effect")


def test_ppo_clip_key_beside_reinforce_in_a_mapping_is_a_note():
    # one mapping is one layer: a setting beside what makes it dead is a note, as in a YAML file
    stack = Stack([Layer.from_mapping({"mode": "bypass", "loss_type": "reinforce", "eps_clip_c": 3.0})])
    cfg = stack.build(RolloutCorrectionConfig)
    assert cfg.eps_clip_c == 3.0
    assert any(re.search(r"eps_clip_c=3.0 has no effect: the REINFORCE loss \(loss_type='reinforce'\) has no PPO "
                         r"ratio to clip .* \(loss_type: ppo_clip\)", note) for note in stack.notes), stack.notes


@pytest.mark.parametrize("cfg", [
    RolloutCorrectionConfig(mode="bypass", loss_type="reinforce"),
    RolloutCorrectionConfig(is_level="token"),
    RolloutCorrectionConfig(),
])
def test_from_dict_of_to_dict_is_silent(cfg):
    # to_dict holds every key (eps_clip beside reinforce, quantile bins without IS, ...): reading it back must not
    # warn about settings nobody gave
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RolloutCorrectionConfig.from_dict(cfg.to_dict()) == cfg


def test_ppo_clip_key_beside_reinforce_in_one_yaml_is_a_note(tmp_path):
    path = _yaml(tmp_path, "use_rollout_logprobs: true\nloss_type: reinforce\neps_clip: 0.3\n")
    res = _resolve(["--custom-config-path", path])
    assert res.config.loss_type == "reinforce" and res.config.eps_clip == 0.3
    assert res.notes == [
        f"eps_clip=0.3 in {path} has no effect: the REINFORCE loss (loss_type='reinforce' in {path}) has no PPO "
        f"ratio to clip (it is -stopgrad(w) * log pi_theta * A). Drop it, or use the PPO loss (loss_type: "
        f"ppo_clip) for the clip to act."]
    with pytest.warns(UserWarning, match="eps_clip=0.3 .* has no effect"):
        config_from_args(_parse(["--custom-config-path", path]))


def test_ppo_clip_key_made_dead_by_a_reinforce_flag_is_a_note(tmp_path):
    path = _yaml(tmp_path, "eps_clip_high: 0.28\n")
    res = _resolve(["--custom-config-path", path] + BYPASS_PG)
    assert len(res.notes) == 1
    assert res.notes[0].startswith(f"eps_clip_high=0.28 in {path} has no effect: the REINFORCE loss "
                                   f"(--rollout-correction-loss-type='reinforce')")


def test_ppo_clip_flags_with_the_ppo_loss_are_fine():
    cfg = _config(["--use-rollout-logprobs", "--eps-clip", "0.3", "--eps-clip-high", "0.28", "--eps-clip-c", "3"])
    assert (cfg.loss_type, cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c) == ("ppo_clip", 0.3, 0.28, 3.0)


# ---------------------------------------------------------------------------------------------------------------
# quantile resolution with IS off
# ---------------------------------------------------------------------------------------------------------------

QUANTILE_NOTE = ("it sets the resolution of the IS quantile metrics (rollout_is_p25 ...), which are computed only "
                 "with IS weights on, and IS is off")


def test_quantile_bins_without_is_is_refused():
    msg = _raises(lambda: _config(["--rollout-correction-quantile-bins", "256"]),
                  "--rollout-correction-quantile-bins=256 has no effect", QUANTILE_NOTE, "--use-tis")
    assert msg == (f"--rollout-correction-quantile-bins=256 has no effect: {QUANTILE_NOTE}. Drop it, or add "
                   f"--use-tis to enable IS weights.")


def test_quantile_bins_on_a_preset_without_is_names_the_preset():
    _raises(lambda: _config(["--rollout-correction-preset", "decoupled_geo_rs",
                             "--rollout-correction-quantile-bins", "64"]),
            "--rollout-correction-quantile-bins=64 has no effect", "IS is off (use_tis=False of preset "
            "decoupled_geo_rs)", "add --use-tis")


def test_quantile_bins_with_no_use_tis_on_the_same_line_is_refused():
    _raises(lambda: _config(["--no-use-tis", "--rollout-correction-quantile-bins", "256"]),
            "IS is off (--no-use-tis=False)")


def test_quantile_bins_key_without_is_in_a_yaml_is_refused(tmp_path):
    path = _yaml(tmp_path, "quantile_bins_per_octave: 256\n")
    _raises(lambda: _config(["--custom-config-path", path]), f"quantile_bins_per_octave=256 in {path} has no effect",
            "use_tis: true")


def test_quantile_bins_equal_to_the_default_without_is_counts_as_given():
    _raises(lambda: _config(["--rollout-correction-quantile-bins", "128"]),
            "--rollout-correction-quantile-bins=128 has no effect")


def test_quantile_bins_left_in_a_yaml_that_turns_is_off_is_a_note(tmp_path):
    path = _yaml(tmp_path, "use_tis: false\nquantile_bins_per_octave: 256\n")
    res = _resolve(["--custom-config-path", path])
    assert res.notes == [f"quantile_bins_per_octave=256 in {path} has no effect: {QUANTILE_NOTE} "
                         f"(use_tis=False in {path}). Drop it, or add use_tis: true to enable IS weights."]


def test_quantile_bins_with_is_are_fine():
    assert _config(["--use-tis", "--rollout-correction-quantile-bins", "256"]).quantile_bins_per_octave == 256


# ---------------------------------------------------------------------------------------------------------------
# rejected_in_denominator where nothing can reject
# ---------------------------------------------------------------------------------------------------------------

NOTHING_REJECTS = "no token can be rejected here: no RS criteria, no veto, IS mode is not mask, and "
ADD_A_REJECTION = ("add a rejection for it to act on: RS (--use-rs with --rs-level / --rs-upper-bound), a veto "
                   "(--rs-veto-threshold), IS mask mode (--tis-mode mask) or --rollout-correction-on-nonfinite "
                   "reject with a correction.")


def test_rejected_in_denominator_with_truncated_is_is_refused():
    msg = _raises(lambda: _config(["--use-tis", "--rollout-correction-rejected-in-denominator"]))
    assert msg == ("--rollout-correction-rejected-in-denominator=True has no effect: " + NOTHING_REJECTS
                   + "on_nonfinite is not 'reject'. Drop it, or " + ADD_A_REJECTION)


def test_no_rejected_in_denominator_equal_to_the_default_counts_as_given():
    _raises(lambda: _config(["--use-tis", "--no-rollout-correction-rejected-in-denominator"]),
            "--no-rollout-correction-rejected-in-denominator=False has no effect", NOTHING_REJECTS)


def test_rejected_in_denominator_on_a_preset_that_cannot_reject_is_refused():
    _raises(lambda: _config(["--rollout-correction-preset", "decoupled_seq_is",
                             "--rollout-correction-rejected-in-denominator"]),
            "--rollout-correction-rejected-in-denominator=True has no effect", NOTHING_REJECTS)


def test_rejected_in_denominator_with_reject_but_no_engine_is_refused():
    # on_nonfinite='reject' rejects only where the engine runs: standard PPO without metrics runs none
    _raises(lambda: _config(["--rollout-correction-on-nonfinite", "reject",
                             "--rollout-correction-rejected-in-denominator"]),
            NOTHING_REJECTS + "on_nonfinite='reject' rejects only where the correction engine runs")


def test_rejected_in_denominator_key_beside_truncated_is_in_a_mapping_is_a_note():
    stack = Stack([Layer.from_mapping({"is_level": "token", "rejected_in_denominator": True})])
    stack.build(RolloutCorrectionConfig)
    assert any("rejected_in_denominator=True has no effect: no token can be rejected" in n for n in stack.notes)


def test_rejected_in_denominator_over_a_preset_layer_is_refused():
    # the API's layers follow the launch's rule: given above the preset that cannot reject -> refused
    from slime_rc.config.resolution import Layer, preset_layer, resolve

    _raises(lambda: resolve([preset_layer("decoupled_seq_is"), Layer.from_mapping({"rejected_in_denominator": True})]),
            "rejected_in_denominator=True has no effect", "use_rs: true", "tis_mode: mask")


def test_rejected_in_denominator_left_in_a_yaml_whose_rs_a_flag_turns_off_is_a_note(tmp_path):
    path = _yaml(tmp_path, "use_rs: true\nrs_upper_bound: 2.0\nrejected_in_denominator: true\n")
    assert _resolve(["--custom-config-path", path]).notes == []
    res = _resolve(["--custom-config-path", path, "--no-use-rs", "--use-tis"])
    assert res.notes == [f"rejected_in_denominator=True in {path} has no effect: " + NOTHING_REJECTS
                         + "on_nonfinite is not 'reject'. Drop it, or add a rejection for it to act on: RS (use_rs: "
                         "true with rs_level / rs_upper_bound), a veto (rs_veto_threshold), IS mask mode (tis_mode: "
                         "mask) or on_nonfinite: reject with a correction."]


@pytest.mark.parametrize("argv", [
    ["--use-rs", "--rs-upper-bound", "2"],
    ["--rs-veto-threshold", "1e-4"],
    ["--use-tis", "--tis-mode", "mask"],
    ["--use-tis", "--rollout-correction-on-nonfinite", "reject"],
    ["--get-mismatch-metrics", "--rollout-correction-on-nonfinite", "reject"],
])
def test_rejected_in_denominator_where_something_rejects_is_fine(argv):
    assert _config(argv + ["--rollout-correction-rejected-in-denominator"]).rejected_in_denominator is True


# ---------------------------------------------------------------------------------------------------------------
# what slime-rc config prints
# ---------------------------------------------------------------------------------------------------------------

def test_slime_rc_config_prints_the_note_and_refuses_with_status_2(tmp_path, capsys):
    from slime_rc.cli import main

    path = _yaml(tmp_path, "use_rollout_logprobs: true\nloss_type: reinforce\neps_clip_c: 3.0\n")
    assert main(["config", "--custom-config-path", path, "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(n.startswith(f"eps_clip_c=3.0 in {path} has no effect") for n in notes), notes
    assert main(["config"] + BYPASS_PG + ["--eps-clip-c", "3"]) == 2
    assert "--eps-clip-c=3.0 has no effect" in capsys.readouterr().err
