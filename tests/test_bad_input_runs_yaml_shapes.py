"""Bad input: a run never replaces a previous run's files (item 3), YAML underscore bands (item 7), and
per-token shapes that are checked, never broadcast (item 2).  Each test gives the failing input and the clear error
or outcome a user now sees; everything runs the real code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from slime_rc import (RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction,
                      cu_seqlens_from_lengths, loss_normalizer, parse_rejection_criteria)
from slime_rc.config.yaml_config import load_yaml_layer
from slime_rc.config.resolution import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--num-steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--micro-batches", "2"]


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "slime_rc", "train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def _one_line_error(proc) -> str:
    """The launch's refusal: exit 2, one ``slime-rc train: error:`` line on stderr, no traceback, nothing run."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("slime-rc train: error:")]
    assert len(lines) == 1, proc.stderr
    assert "step " not in proc.stdout and "slime-rc train:" not in proc.stdout, proc.stdout  # nothing started
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# item 3: nothing is lost
# ---------------------------------------------------------------------------------------------------------------

def test_a_second_run_into_the_same_output_dir_is_refused_and_the_first_runs_files_survive(tmp_path):
    run = tmp_path / "run"
    first = _train(*TINY, "--output-dir", str(run))
    assert first.returncode == 0, first.stderr[-3000:]
    metrics, config = (run / "metrics.jsonl").read_bytes(), (run / "config.json").read_bytes()
    assert len(metrics.splitlines()) == 1

    for extra in ([], ["--num-steps", "2", "--use-tis"]):  # whatever the second launch asks for
        line = _one_line_error(_train(*TINY, *extra, "--output-dir", str(run)))
        assert line == (f"slime-rc train: error: --output-dir {run} already holds a previous run's metrics.jsonl "
                        f"and config.json; give a fresh --output-dir, or add --overwrite to replace them"), line
        assert (run / "metrics.jsonl").read_bytes() == metrics and (run / "config.json").read_bytes() == config

    # --overwrite: the user asked for it; the new run's files replace the old ones
    again = _train(*TINY[2:], "--num-steps", "2", "--use-tis", "--output-dir", str(run), "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert json.loads((run / "config.json").read_text())["sources"]["is_level"] == "--use-tis"


@pytest.mark.parametrize("present", [("metrics.jsonl",), ("config.json",)])
def test_either_run_file_alone_makes_the_directory_a_previous_runs(tmp_path, present):
    for name in present:
        (tmp_path / name).write_text("kept\n")
    line = _one_line_error(_train(*TINY, "--output-dir", str(tmp_path)))
    assert f"--output-dir {tmp_path} already holds a previous run's {present[0]};" in line
    assert "--overwrite" in line and "fresh --output-dir" in line
    # --num-steps -1 ran nothing, exited 0 and truncated metrics.jsonl: now refused, the files untouched
    assert "--num-steps -1" in _one_line_error(_train("--num-steps", "-1", "--output-dir", str(tmp_path)))
    assert all((tmp_path / name).read_text() == "kept\n" for name in present)


def test_a_directory_without_run_files_is_fine_and_a_file_is_refused(tmp_path):
    from slime_rc.demo.train.launch import check_output_dir
    (tmp_path / "notes.txt").write_text("mine\n")  # other files are not a run's
    check_output_dir(str(tmp_path), overwrite=False)
    check_output_dir(str(tmp_path / "new"), overwrite=False)
    check_output_dir(None, overwrite=False)
    (tmp_path / "metrics.jsonl").write_text("")
    check_output_dir(str(tmp_path), overwrite=True)
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_output_dir(str(tmp_path / "notes.txt"), overwrite=False)


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_num_steps_below_one_is_refused_and_nothing_is_written(tmp_path, steps):
    out = tmp_path / "run"
    line = _one_line_error(_train("--num-steps", steps, "--output-dir", str(out)))
    assert line == (f"slime-rc train: error: --num-steps {steps}: a run needs at least one step (nothing would be "
                    f"trained or logged); give --num-steps 1 or more (default 150)"), line
    assert not out.exists()


def test_metrics_lines_are_on_disk_after_each_step(tmp_path):
    """metrics.jsonl is flushed per step: another reader sees every logged step before the run ends."""
    from slime_rc.demo.train.loggers import JsonlLogger
    path = tmp_path / "metrics.jsonl"
    logger = JsonlLogger(str(path))
    try:
        for step in range(3):
            logger.log({"step": step, "loss": 0.5})
            assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == list(range(step + 1))
    finally:
        logger.close()


# ---------------------------------------------------------------------------------------------------------------
# item 7: YAML underscore bands
# ---------------------------------------------------------------------------------------------------------------

def _yaml(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _config(path):
    return resolve([load_yaml_layer(path)]).config


# every key that takes one number, with what switches it on: 0.5_5 in it is refused (it was read as 0.55)
SINGLE_NUMBER_KEYS = {
    "tis_upper_bound": "use_tis: true\n", "tis_clip": "use_tis: true\n", "mis_upper_bound": "use_tis: true\n",
    "tis_lower_bound": "use_tis: true\ntis_mode: clip\ntis_upper_bound: 10.0\n",
    "tis_clip_low": "use_tis: true\ntis_upper_bound: 10.0\n",
    "mis_lower_bound": "use_tis: true\ntis_mode: clip\ntis_upper_bound: 10.0\n",
    "rs_lower_bound": "use_rs: true\nrs_upper_bound: 10.0\n",
    "rs_veto_threshold": "", "mis_veto_threshold": "",
    "rollout_correction_safety_bound": "", "safety_bound": "",
    "eps_clip": "", "eps_clip_high": "", "eps_clip_c": "",
}


@pytest.mark.parametrize("quoted", [False, True])
@pytest.mark.parametrize("key", list(SINGLE_NUMBER_KEYS))
def test_an_underscore_band_in_a_single_number_key_is_refused(tmp_path, key, quoted):
    value = "'0.5_5'" if quoted else "0.5_5"
    path = _yaml(tmp_path, f"{SINGLE_NUMBER_KEYS[key]}{key}: {value}\n")
    with pytest.raises(ValueError) as info:
        _config(path)
    msg = str(info.value)
    assert "'0.5_5' is a 'lower_upper' band" in msg and "takes one number" in msg, msg
    assert "write a single number without an underscore" in msg, msg
    assert f"set by {key} in {path}" in msg, msg  # names the key as written and the file


VERL_SINGLE = {"rollout_is_threshold_lower": "rollout_is: token\n    rollout_is_mode: clip\n"
                                             "    rollout_is_threshold: 10.0\n",
               "rollout_token_veto_threshold": "rollout_is: token\n"}


@pytest.mark.parametrize("key", list(VERL_SINGLE))
def test_an_underscore_band_in_a_verl_single_number_key_is_refused(tmp_path, key):
    path = _yaml(tmp_path, f"algorithm:\n  rollout_correction:\n    {VERL_SINGLE[key]}    {key}: 0.5_5\n")
    with pytest.raises(ValueError, match=rf"'0\.5_5' is a 'lower_upper' band .* takes one number.*\(set by {key} in"):
        _config(path)


def test_the_reported_case_tis_upper_bound_0_5_5_is_no_longer_0_55(tmp_path):
    path = _yaml(tmp_path, "use_tis: true\ntis_upper_bound: 0.5_5\n")
    with pytest.raises(ValueError) as info:
        _config(path)
    assert str(info.value) == (
        "is_upper_bound='0.5_5' is a 'lower_upper' band (lower 0.5, upper 5), but is_upper_bound takes one number "
        "(underscores never group digits here): write a single number without an underscore; a typical value is 2.0 "
        f"(a band's lower end goes in is_lower_bound) (set by tis_upper_bound in {path})")


def test_rs_lower_bound_band_points_to_the_threshold(tmp_path):
    path = _yaml(tmp_path, "use_rs: true\nrs_upper_bound: 10.0\nrs_lower_bound: 0.5_5\n")
    with pytest.raises(ValueError, match=r"rs_lower_bound='0\.5_5' .* a band goes into the threshold instead "
                                         r"\(rs_upper_bound: '0\.5_5'\)"):
        _config(path)


@pytest.mark.parametrize("text, bands", [
    ("use_rs: true\nrs_upper_bound: 0.5_5\n", [("token", 0.5, 5.0)]),
    ("use_rs: true\nrs_upper_bound: '0.5_5'\n", [("token", 0.5, 5.0)]),
    ("use_rs: true\nrs_level: geometric\nrs_upper_bound: 0.7_1.4\n", [("geometric", 0.7, 1.4)]),
    ("use_rs: true\nrs_level: token,seq_mean_k1\nrs_upper_bound: 2.0,0.5_5\n",
     [("token", 0.5, 2.0), ("seq_mean_k1", 0.5, 5.0)]),
    ("algorithm:\n  rollout_correction:\n    rollout_rs: token\n    rollout_rs_threshold: 0.5_5\n",
     [("token", 0.5, 5.0)]),
])
def test_keys_that_take_a_band_read_it_as_the_band(tmp_path, text, bands):
    cfg = _config(_yaml(tmp_path, text))
    assert [(c.option, c.lower, c.upper) for c in cfg.rs] == bands


def test_verl_is_threshold_band_is_icepop(tmp_path):
    cfg = _config(_yaml(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
                                  "    rollout_is_threshold: 0.5_5\n"))
    assert (cfg.is_mode, cfg.is_lower_bound, cfg.is_upper_bound) == ("mask", 0.5, 5.0)


def test_a_band_for_a_k3_option_is_refused(tmp_path):
    path = _yaml(tmp_path, "use_rs: true\nrs_level: token_k3\nrs_upper_bound: 0.5_5\n")
    with pytest.raises(ValueError, match="bounds a divergence .* from above only"):
        _config(path)


def test_inside_slime_a_single_number_key_with_an_underscore_says_it_takes_one_number(tmp_path):
    """Inside slime (``slime-rc config --slime``) slime reads 0.5_5 as 0.55: quoting cannot help a key that takes
    one number, so the message says so (a band key is told to quote it)."""
    path = _yaml(tmp_path, "use_tis: true\ntis_upper_bound: 0.5_5\n")
    with pytest.raises(ValueError) as info:
        load_yaml_layer(path, slime=True)
    assert str(info.value) == (
        f"{path}: tis_upper_bound: 0.5_5 is read by slime's yaml.safe_load (YAML 1.1, where '_' separates digits) "
        f"as the number 0.55, and by slime-rc as the band '0.5_5', but tis_upper_bound takes one number: write it "
        f"without an underscore (a band is for rs_upper_bound; an IS band is tis_lower_bound and tis_upper_bound).")
    band = _yaml(tmp_path, "use_rs: true\nrs_upper_bound: 0.5_5\n", "band.yaml")
    with pytest.raises(ValueError, match=r"Quote it: rs_upper_bound: '0\.5_5'"):
        load_yaml_layer(band, slime=True)


def test_a_dict_or_config_with_a_band_for_a_single_number_is_refused():
    with pytest.raises(ValueError, match=r"is_upper_bound='0\.5_5' is a 'lower_upper' band"):
        RolloutCorrectionConfig.from_dict({"use_tis": True, "tis_upper_bound": "0.5_5"})
    with pytest.raises(ValueError, match=r"veto_threshold='1_0' is a 'lower_upper' band"):
        RolloutCorrectionConfig(veto_threshold="1_0")
    assert RolloutCorrectionConfig(is_level="token", is_upper_bound="3.0").is_upper_bound == 3.0  # text numbers: as before


def test_the_slime_rc_config_command_prints_the_one_line_error(tmp_path):
    path = _yaml(tmp_path, "use_tis: true\ntis_upper_bound: 0.5_5\n")
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "config", "--custom-config-path", path],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("slime-rc config: error: is_upper_bound='0.5_5' is a 'lower_upper' band"), \
        proc.stderr
    assert "0.55" not in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# item 2: shapes are checked, never broadcast
# ---------------------------------------------------------------------------------------------------------------

LOSS_CONFIGS = {
    "standard": RolloutCorrectionConfig(),
    "decoupled_token_is": RolloutCorrectionConfig(is_level="token"),
    "decoupled_rs": RolloutCorrectionConfig(rs=parse_rejection_criteria("token", 3.0)),
    "bypass_ppo": RolloutCorrectionConfig(mode="bypass"),
    "bypass_reinforce": RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="token"),
    "metrics_only": RolloutCorrectionConfig(get_mismatch_metrics=True),
}


def _inputs(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(n, generator=g) - 0.1
    old = rollout + 0.05 * torch.randn(n, generator=g)
    return dict(log_probs=(old + 0.05 * torch.randn(n, generator=g)).requires_grad_(True), old_log_probs=old,
                rollout_log_probs=rollout, advantages=torch.randn(n, generator=g), loss_mask=torch.ones(n),
                cu_seqlens=cu_seqlens_from_lengths([3, 5]))


def _call(cfg, **inputs):
    return compute_policy_loss(inputs["log_probs"], inputs["old_log_probs"], inputs["rollout_log_probs"],
                               inputs["advantages"], inputs["loss_mask"], inputs["cu_seqlens"], cfg)


@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_advantages_of_shape_n_by_1_are_refused_not_broadcast(name):
    inputs = _inputs()
    inputs["advantages"] = inputs["advantages"][:, None]  # [8, 1]: broadcast to [8, 8] it multiplied the loss by 8
    with pytest.raises(ValueError) as info:
        _call(LOSS_CONFIGS[name], **inputs)
    msg = str(info.value)
    assert msg.startswith("compute_policy_loss: advantages has shape [8, 1], expected [8]: every per-token input "
                          "holds exactly one value per packed token (N = 8 like log_probs"), msg
    assert msg.endswith("nothing is broadcast; reshape it to [8] (e.g. advantages.reshape(-1))"), msg


@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_one_log_prob_for_eight_tokens_is_refused(name):
    inputs = _inputs()
    inputs["log_probs"] = inputs["log_probs"][:1]
    with pytest.raises(ValueError, match=r"^compute_policy_loss: log_probs has shape \[1\], expected \[8\]: .* "
                                         r"nothing is broadcast; pass it for the same packed tokens as the others$"):
        _call(LOSS_CONFIGS[name], **inputs)


@pytest.mark.parametrize("arg, shape", [("old_log_probs", (1,)), ("old_log_probs", (8, 1)),
                                        ("rollout_log_probs", (1,)), ("rollout_log_probs", (1, 8)),
                                        ("loss_mask", (8, 1)), ("loss_mask", (1,)), ("advantages", (1,)),
                                        ("advantages", (4,))])
def test_every_per_token_input_must_have_exactly_n_values(arg, shape):
    inputs = _inputs()
    inputs[arg] = torch.full(shape, 1.0 if arg == "loss_mask" else -0.5)
    cfg = LOSS_CONFIGS["decoupled_token_is"]
    with pytest.raises(ValueError, match=rf"compute_policy_loss: {arg} has shape \[{', '.join(map(str, shape))}\], "
                                         r"expected \[8\]"):
        _call(cfg, **inputs)


def test_old_log_probs_are_ignored_in_bypass_mode_whatever_their_shape():
    inputs = _inputs()
    inputs["old_log_probs"] = torch.zeros(1)  # documented as ignored in bypass mode
    loss, _ = _call(LOSS_CONFIGS["bypass_ppo"], **inputs)
    assert torch.isfinite(loss)


def test_a_precomputed_correction_for_other_tokens_is_refused():
    inputs = _inputs()
    cfg = LOSS_CONFIGS["decoupled_token_is"]
    other = compute_rollout_correction(inputs["old_log_probs"][:5], inputs["rollout_log_probs"][:5], torch.ones(5),
                                       cu_seqlens_from_lengths([5]), cfg)
    with pytest.raises(ValueError, match=r"correction\.keep_mask has shape \[5\], expected \[8\]"):
        compute_policy_loss(inputs["log_probs"], inputs["old_log_probs"], inputs["rollout_log_probs"],
                            inputs["advantages"], inputs["loss_mask"], inputs["cu_seqlens"], cfg, correction=other)


def test_loss_normalizer_wants_a_1d_mask():
    with pytest.raises(ValueError, match=r"loss_normalizer: count_mask has shape \[2, 4\], expected \[N\]"):
        loss_normalizer(torch.ones(2, 4), cu_seqlens_from_lengths([3, 5]))


def test_a_non_tensor_per_token_input_is_named():
    inputs = _inputs()
    inputs["advantages"] = [0.1] * 8
    with pytest.raises(ValueError, match="advantages must be a torch.Tensor of shape"):
        _call(LOSS_CONFIGS["standard"], **inputs)


def test_correct_shapes_give_the_same_loss_as_before():
    """The check changes nothing for well-formed input: the loss equals the per-token mean computed by hand."""
    inputs = _inputs()
    loss, _ = _call(LOSS_CONFIGS["standard"], **inputs)
    ratio = torch.exp(inputs["log_probs"].detach() - inputs["old_log_probs"])
    adv = inputs["advantages"]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected = (per_token[:3].mean() + per_token[3:].mean()) / 2
    torch.testing.assert_close(loss.detach(), expected)


def test_the_shape_check_makes_no_host_read():
    """Shapes are metadata: on the meta device (where any host read raises) the bad shape is still refused."""
    inputs = {k: (v.detach().to("meta") if k != "cu_seqlens" else v.to("meta")) for k, v in _inputs().items()}
    inputs["advantages"] = inputs["advantages"][:, None]
    cfg = RolloutCorrectionConfig(on_nonfinite="reject")
    with pytest.raises(ValueError, match=r"advantages has shape \[8, 1\], expected \[8\]"):
        _call(cfg, **inputs)
