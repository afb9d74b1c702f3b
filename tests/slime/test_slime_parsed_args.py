"""slime's ``args`` as slime's parser and validation leave them (``tests/slime_args.py``) resolve to the settings the
same launch gives by hand, and run the custom loss to the same numbers.

slime fills ``eps_clip_high`` with ``eps_clip`` when it is not given, before it copies the YAML: read as a user's
``--eps-clip-high``, that value made every REINFORCE launch fail ("--eps-clip-high=0.2 has no effect") although the
user never gave it.
"""

from __future__ import annotations

import argparse
import math
import warnings

import pytest
import torch

from slime_rc.config.arguments import SLIME_OWNED_FLAGS, resolve_args
from slime_rc.config.knobs import dest_of
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.slime.policy_loss import resolve_config
from tests import slime_args
from tests.checks import raises_mentioning
from tests.slime.test_policy_loss import make_batch

LOSS = ["--loss-type", "custom_loss", "--custom-loss-function-path", "slime_rc.slime.policy_loss_function"]
REINFORCE_SEQ_IS = "use_tis: true\ntis_level: sequence\ntis_upper_bound: 1.5\nrollout_correction_loss_type: reinforce\n"


def _write(tmp_path, text, name="rc.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _resolve(args):
    """``(config or the error, notes)`` as the custom loss resolves ``args`` (on a copy: it caches the config)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = resolve_config(argparse.Namespace(**vars(args)))
        except ValueError as e:
            return f"ValueError: {e}", []
    return config, [str(w.message) for w in caught]


def _slimes_defaults_recorded(args):
    """A copy of hand-made ``args`` with slime's defaults recorded as our hook records them (what the custom loss
    assumes without the hook), so that :func:`resolve_args` tells slime's defaults from flags."""
    view = argparse.Namespace(**vars(args))
    view.slime_rc_shared_flags = {dest_of(f): (dest_of(f), kw.get("default")) for f, kw in SLIME_OWNED_FLAGS.items()}
    return view


def test_the_fixture_leaves_what_slimes_validation_leaves(tmp_path):
    args = slime_args.parse(LOSS)
    assert (args.eps_clip, args.eps_clip_high) == (0.2, 0.2)  # filled in by slime's validation
    assert slime_args.by_hand().eps_clip_high is None  # what tests build by hand
    assert args.use_rs is None and args.slime_rc_shared_flags["eps_clip_high"] == ("eps_clip_high", None)  # the hook
    assert slime_args.parse(["--use-rollout-routing-replay"]).use_routing_replay is True
    # the YAML comes after the fill: eps_clip_high keeps the command line's eps_clip
    args = slime_args.parse(["--custom-config-path", _write(tmp_path, "eps_clip: 0.3\n")])
    assert (args.eps_clip, args.eps_clip_high) == (0.3, 0.2)
    with pytest.raises(AssertionError, match="use_rollout_logprobs and use_tis"):
        slime_args.parse(["--use-rollout-logprobs", "--use-tis"])
    with pytest.raises(AssertionError, match="custom_tis_function_path"):
        slime_args.parse(["--get-mismatch-metrics"])
    assert slime_args.parse(["--no-use-tis"]).use_tis is False  # slime's parse_known_args drops what it lacks


# ---- (a) bypass + REINFORCE + sequence IS through the custom loss ----------------------------------------------
def _reinforce_launches(tmp_path):
    """``{route: (slime's args, the same launch by hand)}``: the settings from the YAML keys, from our parser hook's
    flags (a preset and --tis-level), and from both."""
    yaml_all = _write(tmp_path, REINFORCE_SEQ_IS, "all.yaml")
    yaml_is = _write(tmp_path, "use_tis: true\ntis_level: sequence\ntis_upper_bound: 1.5\n", "is.yaml")
    hand = dict(loss_type="custom_loss", custom_loss_function_path="slime_rc.slime.policy_loss_function")
    return {
        "yaml": (slime_args.parse(LOSS + ["--use-rollout-logprobs", "--custom-config-path", yaml_all]),
                 slime_args.by_hand(yaml_all, use_rollout_logprobs=True, **hand)),
        "hook": (slime_args.parse(LOSS + ["--rollout-correction-preset", "bypass_pg_is", "--tis-level", "sequence",
                                          "--tis-upper-bound", "1.5"]),
                 slime_args.by_hand(rollout_correction_preset="bypass_pg_is", tis_level="sequence",
                                    tis_upper_bound=1.5, **hand)),
        "hook_and_yaml": (slime_args.parse(LOSS + ["--use-rollout-logprobs", "--rollout-correction-loss-type",
                                                   "reinforce", "--custom-config-path", yaml_is]),
                          slime_args.by_hand(yaml_is, use_rollout_logprobs=True,
                                             rollout_correction_loss_type="reinforce", **hand)),
    }


@pytest.mark.parametrize("route", ["yaml", "hook", "hook_and_yaml"])
def test_bypass_reinforce_sequence_is_runs_on_slimes_args(tmp_path, route):
    from slime_rc.slime import policy_loss_function

    parsed, hand = _reinforce_launches(tmp_path)[route]
    assert parsed.eps_clip_high == 0.2  # slime's fill, which used to be read as --eps-clip-high
    batch, logits = make_batch(6, recompute=False)  # bypass: slime's actor does not recompute
    runs = []
    for args in (parsed, hand):
        x = logits.clone().requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, log = policy_loss_function(args, batch, x, None)
        # not even a note about a clip range nobody gave (megatron-core may warn on its first import)
        assert not [str(w.message) for w in caught if "eps_clip" in str(w.message) or "no effect" in str(w.message)]
        loss.backward()
        runs.append((loss.detach(), x.grad, log))
    (loss, grad, log), (hand_loss, hand_grad, hand_log) = runs
    config = parsed.rollout_correction_config
    assert (config.mode, config.loss_type, config.is_level, config.is_upper_bound) == ("bypass", "reinforce",
                                                                                       "sequence", 1.5)
    assert config == hand.rollout_correction_config and config.eps_clip_high is None
    assert math.isfinite(float(loss)) and torch.isfinite(grad).all()
    assert float(loss) == float(hand_loss) and torch.equal(grad, hand_grad)
    assert list(log) == list(hand_log) and all(torch.equal(log[k], hand_log[k]) for k in log)
    assert "rollout_corr/rollout_is_mean" in log


# ---- (b) the same settings from slime's args and from the same launch by hand ---------------------------------
# (id, launch line, the attributes by hand, YAML text or None); "{yaml}" in the launch line is the YAML's path
CASES = [
    ("defaults", [], {}, None),
    ("eps_clip", ["--eps-clip", "0.25"], dict(eps_clip=0.25), None),
    ("clip_higher", ["--eps-clip-high", "0.28"], dict(eps_clip_high=0.28), None),
    ("eps_clip_high_equal_to_eps_clip", ["--eps-clip", "0.3", "--eps-clip-high", "0.3"], dict(eps_clip=0.3), None),
    ("dual_clip_token_tis", ["--eps-clip-c", "3.0", "--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5"],
     dict(eps_clip_c=3.0, use_tis=True, tis_clip=1.5, tis_clip_low=0.5), None),
    ("per_token_kl_routing_replay", ["--calculate-per-token-loss", "--use-kl-loss", "--kl-loss-coef", "0.1",
                                     "--use-rollout-routing-replay", "--rollout-temperature", "0.7"],
     dict(calculate_per_token_loss=True, use_kl_loss=True, kl_loss_coef=0.1, use_rollout_routing_replay=True,
          rollout_temperature=0.7), None),
    ("bypass_ppo", ["--use-rollout-logprobs"], dict(use_rollout_logprobs=True), None),
    ("bypass_reinforce_yaml", ["--use-rollout-logprobs", "--custom-config-path", "{yaml}"],
     dict(use_rollout_logprobs=True), REINFORCE_SEQ_IS),
    ("bypass_reinforce_preset", ["--rollout-correction-preset", "bypass_pg_geo_rs_seq_tis"],
     dict(rollout_correction_preset="bypass_pg_geo_rs_seq_tis"), None),
    ("bypass_reinforce_flag", ["--use-rollout-logprobs", "--rollout-correction-loss-type", "reinforce",
                               "--custom-config-path", "{yaml}"],
     dict(use_rollout_logprobs=True, rollout_correction_loss_type="reinforce"), "use_tis: true\n"),
    ("decoupled_rs_flags_is_yaml", ["--use-rs", "--rs-level", "geometric", "--rs-upper-bound", "0.999_1.001",
                                    "--rs-veto-threshold", "1e-4", "--custom-config-path", "{yaml}"],
     dict(use_rs=True, rs_level="geometric", rs_upper_bound="0.999_1.001", rs_veto_threshold=1e-4),
     "use_tis: true\ntis_level: sequence\ntis_mode: mask\n"),
    ("eps_clip_in_yaml_only", ["--custom-config-path", "{yaml}"], {}, "eps_clip: 0.3\n"),
    ("clip_range_in_yaml", ["--eps-clip", "0.25", "--custom-config-path", "{yaml}"], dict(eps_clip=0.25),
     "eps_clip: 0.3\neps_clip_high: 0.4\n"),
    ("mismatch_metrics", ["--get-mismatch-metrics", "--custom-tis-function-path", "custom_tis.mis.compute_mis_weights"],
     dict(get_mismatch_metrics=True, custom_tis_function_path="custom_tis.mis.compute_mis_weights"), None),
]


@pytest.mark.parametrize("name, argv, attributes, yaml_text", CASES, ids=[c[0] for c in CASES])
def test_slimes_args_resolve_as_the_same_launch_by_hand(tmp_path, name, argv, attributes, yaml_text):
    path = _write(tmp_path, yaml_text) if yaml_text is not None else None
    parsed = slime_args.parse([a.format(yaml=path) for a in argv])
    hand = slime_args.by_hand(path, **attributes)
    ours, by_hand = _resolve(parsed), _resolve(hand)
    assert isinstance(ours[0], RolloutCorrectionConfig), ours[0]
    assert ours == by_hand
    a, b = resolve_args(parsed, slime=True), resolve_args(_slimes_defaults_recorded(hand), slime=True)
    assert a.config == b.config and a.sources == b.sources
    assert a.sources["eps_clip_high"] == ("default" if by_hand[0].eps_clip_high is None else b.sources["eps_clip_high"])


def test_eps_clip_in_the_yaml_leaves_eps_clip_high_unset(tmp_path):
    # slime filled eps_clip_high from the command line's eps_clip (0.2) before the YAML's 0.3 arrived: unset is eps_clip
    args = slime_args.parse(["--custom-config-path", _write(tmp_path, "eps_clip: 0.3\n")])
    config, _ = _resolve(args)
    assert (config.eps_clip, config.eps_clip_high) == (0.3, None)


def test_eps_clip_on_the_command_line_and_in_the_yaml_reads_the_fill_as_a_flag(tmp_path):
    # documented limit: eps_clip_high = the command line's 0.25 looks like --eps-clip-high 0.25 once the YAML replaced
    # eps_clip (slime's own loss clips at 1.25 too)
    args = slime_args.parse(["--eps-clip", "0.25", "--custom-config-path", _write(tmp_path, "eps_clip: 0.3\n")])
    config, _ = _resolve(args)
    assert (config.eps_clip, config.eps_clip_high) == (0.3, 0.25)


# ---- (c) a clip range the user gave is still refused with REINFORCE ---------------------------------------------
@pytest.mark.parametrize("reinforce", [["--rollout-correction-loss-type", "reinforce", "--use-rollout-logprobs"],
                                       ["--rollout-correction-preset", "bypass_pg_is"]], ids=["flag", "preset"])
def test_an_explicit_eps_clip_high_is_refused_with_reinforce(reinforce):
    args = slime_args.parse(LOSS + reinforce + ["--eps-clip-high", "0.28"])
    raises_mentioning(lambda: resolve_config(args), "--eps-clip-high=0.28", "has no effect", "REINFORCE",
                      "Drop it", "--rollout-correction-loss-type ppo_clip")
    # equal to --eps-clip it is what slime fills in: indistinguishable from not giving it, accepted
    config, notes = _resolve(slime_args.parse(LOSS + reinforce + ["--eps-clip-high", "0.2"]))
    assert config.loss_type == "reinforce" and config.eps_clip_high is None and notes == []
    config, notes = _resolve(slime_args.parse(LOSS + reinforce + ["--eps-clip", "0.3", "--eps-clip-high", "0.3"]))
    assert isinstance(config, str) and "--eps-clip=0.3" in config  # --eps-clip itself is the user's


def test_eps_clip_high_in_the_yaml_is_the_users(tmp_path):
    path = _write(tmp_path, "eps_clip_high: 0.2\n")  # even equal to eps_clip: written in the file, not filled in
    args = slime_args.parse(LOSS + ["--rollout-correction-preset", "bypass_pg_is", "--custom-config-path", path])
    raises_mentioning(lambda: resolve_config(args), "eps_clip_high=0.2", path, "REINFORCE", "Drop it")


def test_a_flag_below_the_yamls_reinforce_is_a_note(tmp_path):
    # inside slime the YAML beats the flags: a --eps-clip-high the YAML's REINFORCE made dead is a note, not an error
    args = slime_args.parse(LOSS + ["--use-rollout-logprobs", "--eps-clip-high", "0.28", "--custom-config-path",
                                    _write(tmp_path, REINFORCE_SEQ_IS)])
    config, notes = _resolve(args)
    assert config.loss_type == "reinforce"
    assert len(notes) == 1 and "--eps-clip-high=0.28 has no effect" in notes[0]
