"""``slime-rc train``'s logging: metrics.jsonl unchanged, TensorBoard and wandb with slime's names
(``train/<key>`` against the step axis ``train/step``), wandb offline writing its run files with no network, a clear
error naming the flag and the extra when a package is missing.  The loggers are tested directly; one short
``slime-rc train`` run has both on."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from slime_rc.demo.train.loggers import (JsonlLogger, LoggingPlan, TensorBoardLogger, WandbLogger, WandbSettings,
                                         add_logging_arguments, logging_flags, open_loggers, plan_logging,
                                         slime_names)

from tests.checks import raises_mentioning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = [{"step": 0, "loss": 0.5, "grad_norm": 1.25, "rollout_corr/k3_kl": 1e-3, "rollout_corr/unset": None,
          "time/step": 0.1},
         {"step": 1, "loss": -0.25, "grad_norm": 0.75, "rollout_corr/k3_kl": 2e-3, "rollout_corr/unset": None,
          "time/step": 0.2}]
TRAIN_KEYS = {"train/loss", "train/grad_norm", "train/rollout_corr/k3_kl", "train/time/step"}


def _args(*argv):
    parser = add_logging_arguments(argparse.ArgumentParser())
    parser.add_argument("--output-dir", default=None)
    return parser.parse_args(list(argv))


@pytest.fixture
def no_log_env(monkeypatch):
    for name in ("TENSORBOARD_DIR", "WANDB_DIR", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)


def _wandb_env(monkeypatch, tmp_path):
    """wandb offline and quiet, everything it writes (its own settings and caches too) under ``tmp_path``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def _wandb_run_file(directory) -> bytes:
    """The ``.wandb`` file of the one offline run under ``directory/wandb`` (its records name every key logged)."""
    runs = glob.glob(os.path.join(str(directory), "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    files = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    assert len(files) == 1, os.listdir(runs[0])
    with open(files[0], "rb") as f:
        return f.read()


def _scalars(log_dir) -> dict:
    """tag -> [(step, value)] of the TensorBoard event files in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_are_named_as_slime_names_them():
    named = slime_names(STEPS[1])
    assert named == {"train/step": 1, "train/loss": -0.25, "train/grad_norm": 0.75,
                     "train/rollout_corr/k3_kl": 2e-3, "train/time/step": 0.2}


def test_metrics_jsonl_is_one_json_dump_per_step(tmp_path):
    logger = JsonlLogger(str(tmp_path / "metrics.jsonl"))
    for m in STEPS:
        logger.log(m)
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps(m) + "\n" for m in STEPS)


def test_tensorboard_writes_train_tags_against_the_step(tmp_path):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path / "tb"))
    for m in STEPS:
        logger.log(m)
    logger.close()
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) == TRAIN_KEYS
    assert [s for s, _ in scalars["train/loss"]] == [0, 1]
    assert [v for _, v in scalars["train/loss"]] == [0.5, -0.25]


def test_wandb_offline_run_writes_its_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    _wandb_env(monkeypatch, tmp_path)
    logger = WandbLogger(WandbSettings(mode="offline", project="slime-rc-test", group="loggers", dir=str(tmp_path)),
                         config={"rollout_correction": {"is_level": "token"}})
    for m in STEPS:
        logger.log(m)
    logger.close()
    data = _wandb_run_file(tmp_path)
    for key in TRAIN_KEYS | {"train/step", "train/*", "is_level"}:  # the keys, slime's axis glob, the config
        assert key.encode() in data, key
    assert b"rollout_corr/unset" not in data


def test_the_plan(tmp_path, monkeypatch, no_log_env):
    pytest.importorskip("tensorboard")
    out = str(tmp_path)
    assert plan_logging(_args("--output-dir", out)) == LoggingPlan(tensorboard_dir=out)  # on when it can be
    assert plan_logging(_args()) == LoggingPlan()  # nowhere to write
    assert plan_logging(_args("--output-dir", out, "--no-use-tensorboard")) == LoggingPlan()
    raises_mentioning(lambda: plan_logging(_args("--use-tensorboard")), "--use-tensorboard", "--output-dir",
                      "--tb-project-name", "TENSORBOARD_DIR")
    # slime's layout, and its environment variable winning
    plan = plan_logging(_args("--output-dir", out, "--tb-project-name", "p", "--tb-experiment-name", "e"))
    assert plan.tensorboard_dir == os.path.join("tensorboard_log", "p", "e")
    assert re.fullmatch(r"tensorboard_log/p/\d{8}_\d{6}",
                        plan_logging(_args("--tb-project-name", "p")).tensorboard_dir.replace(os.sep, "/"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env"))
    assert plan_logging(_args("--output-dir", out, "--tb-project-name", "p")).tensorboard_dir == str(tmp_path / "env")


def test_the_wandb_plan(tmp_path, monkeypatch, no_log_env):
    pytest.importorskip("wandb")
    out = str(tmp_path)
    assert plan_logging(_args("--output-dir", out, "--wandb-mode", "offline")).wandb is None  # not asked
    line = ("--use-wandb", "--wandb-mode", "offline", "--wandb-project", "p", "--wandb-group", "g")
    assert plan_logging(_args("--output-dir", out, *line)).wandb == WandbSettings("offline", "p", "g", out)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "env"))
    assert plan_logging(_args("--output-dir", out, *line)).wandb.dir == str(tmp_path / "env")
    assert plan_logging(_args("--output-dir", out, *line, "--wandb-dir", "d")).wandb.dir == "d"


def test_a_missing_package_names_the_flag_and_the_extra(tmp_path, monkeypatch, capsys, no_log_env):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing either now fails, as when not installed
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    raises_mentioning(lambda: plan_logging(_args("--use-wandb")), "--use-wandb", "pip install 'slime-rc[wandb]'")
    raises_mentioning(lambda: plan_logging(_args("--output-dir", str(tmp_path), "--use-tensorboard")),
                      "--use-tensorboard", "pip install 'slime-rc[tensorboard]'")
    assert plan_logging(_args("--output-dir", str(tmp_path))) == LoggingPlan()  # not asked: quietly off
    # the loggers themselves (a package that went missing after the launch), and the launch line
    raises_mentioning(lambda: TensorBoardLogger(str(tmp_path)), "--use-tensorboard", "slime-rc[tensorboard]",
                      exc=ImportError)
    raises_mentioning(lambda: open_loggers(LoggingPlan(wandb=WandbSettings()), str(tmp_path)), "--use-wandb",
                      "slime-rc[wandb]", exc=ImportError)
    from slime_rc.demo.train.launch import main
    assert main(["--use-wandb", "--num-steps", "1"]) == 2
    assert "--use-wandb needs the wandb package" in capsys.readouterr().err


def test_every_logging_flag_is_documented():
    with open(os.path.join(ROOT, "docs", "train.md")) as f:
        text = f.read()
    section = text.split("## Logging: TensorBoard and wandb", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(--[a-z-]+)`", section))
    assert set(logging_flags()) <= documented, set(logging_flags()) - documented


def test_slime_rc_train_logs_to_tensorboard_and_wandb_offline(tmp_path):
    """One short run with both on: the same per-step values in metrics.jsonl, TensorBoard and the wandb run,
    wandb under --output-dir by default, no network."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TENSORBOARD_"))}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb-home"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb-home"), WANDB_DATA_DIR=str(tmp_path / "wandb-home"))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--num-steps", "2", "--prompts-per-step", "4",
                           "--group-size", "4", "--micro-batches", "2", "--use-tis", "--output-dir", str(out),
                           "--use-tensorboard", "--use-wandb", "--wandb-mode", "offline", "--wandb-project",
                           "slime-rc-test", "--wandb-group", "e2e"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    2/2" in proc.stdout and "logging to TensorBoard" in proc.stdout
    text = (out / "metrics.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert text == "".join(json.dumps(m) + "\n" for m in lines) and [m["step"] for m in lines] == [0, 1]
    scalars = _scalars(out)
    numbers = {k for k, v in lines[0].items() if k != "step" and isinstance(v, (int, float))}
    assert set(scalars) == {f"train/{k}" for k in numbers} and "train/rollout_corr/k3_kl" in scalars
    for k in ("loss", "rollout_corr/k3_kl"):
        assert [s for s, _ in scalars[f"train/{k}"]] == [0, 1]
        assert [v for _, v in scalars[f"train/{k}"]] == pytest.approx([m[k] for m in lines], rel=1e-6)
    data = _wandb_run_file(out)
    for key in ("train/step", "train/loss", "train/rollout_corr/k3_kl", "slime-rc-test", "e2e"):
        assert key.encode() in data, key


# ---- heavy rejection: warned once, counted at the end, in summary.json -------------------------------------------
def _rejecting_config():
    from slime_rc.config.schema import RolloutCorrectionConfig
    return RolloutCorrectionConfig.preset("bypass_pg_geo_rs_seq_tis")


def _step(step, rejected, tokens=100, warm=False):
    m = {"step": step, "rejected_tokens": rejected, "loss_tokens": tokens, "kept_fraction": 1.0 - rejected / tokens}
    return {**m, "warm_start": True} if warm else m


def test_rejection_watch_warns_once_at_the_first_step_above_the_shared_level_and_counts_the_rest():
    from slime_rc.demo.train.loggers import RejectionWatch
    from slime_rc.tools.analyze.thresholds import MAX_REJECTED_FRACTION
    above = int(100 * MAX_REJECTED_FRACTION) + 30
    watch = RejectionWatch(_rejecting_config(), {"rs": "preset bypass_pg_geo_rs_seq_tis"}, total_steps=4,
                           warm_start_steps=1)
    said = [watch.observe(m) for m in (_step(0, 90, warm=True), _step(1, 0), _step(2, above), _step(3, 100),
                                       _step(4, int(100 * MAX_REJECTED_FRACTION)))]
    assert said[:2] == [None, None] and said[3:] == [None, None]  # a warm-start step and a step at the level: quiet
    first = said[2]
    assert first.startswith("warning: step 2/4 rejected") and f"{above:.1f}% of tokens" in first
    assert f"above {100 * MAX_REJECTED_FRACTION:g}%" in first
    assert "seq_mean_k1 [0.999, 1.001] (from preset bypass_pg_geo_rs_seq_tis)" in first and "--rs-upper-bound" in first
    assert "slime-rc analyze" in first
    s = watch.summary()
    assert (s["steps_above"], s["grpo_steps"], s["first_step"], s["threshold"]) == (2, 4, 2, MAX_REJECTED_FRACTION)
    assert s["first_token_fraction"] == pytest.approx(above / 100) and s["max_token_fraction"] == 1.0
    assert watch.end_lines() == [s["message"]] and "2 of 4 GRPO steps" in s["message"]


def test_rejection_watch_is_silent_when_no_step_rejects_too_much():
    from slime_rc.demo.train.loggers import RejectionWatch
    watch = RejectionWatch(_rejecting_config(), total_steps=3)
    assert [watch.observe(_step(i, 5)) for i in range(3)] == [None] * 3
    assert watch.summary() is None and watch.end_lines() == []


def _train(out, *flags):
    return subprocess.run([sys.executable, "-m", "slime_rc", "train", "--num-steps", "3", "--prompts-per-step", "4",
                           "--group-size", "4", "--micro-batches", "2", "--hidden-size", "32", "--num-layers", "1",
                           "--rollout-correction-preset", "bypass_pg_geo_rs_seq_tis", "--no-use-tensorboard",
                           "--output-dir", str(out), *flags],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_train_warns_about_heavy_rejection_on_the_console_and_in_the_summary(tmp_path):
    """The geometric band [0.999, 1.001] under --logit-noise 0.5 rejects nearly every token: one warning at the first
    step, a count at the end, and summary.json's rejection_warning, matching metrics.jsonl; the same preset without
    mismatch (fp32 rollouts, no noise) rejects nothing and says nothing."""
    from slime_rc.demo.train.loggers import rejected_fractions
    from slime_rc.tools.analyze.thresholds import MAX_REJECTED_FRACTION
    proc = _train(tmp_path / "noisy", "--logit-noise", "0.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "noisy" / "metrics.jsonl").read_text().splitlines()]
    above = [r for r in rows if max(f or 0.0 for f in rejected_fractions(r)) > MAX_REJECTED_FRACTION]
    assert above, "the test needs a step above the level"
    lines = proc.stdout.splitlines()
    warnings = [x for x in lines if x.startswith("warning:")]
    assert len(warnings) == 2, proc.stdout  # the first step's line and the end-of-run count, not one per step
    first_at = lines.index(warnings[0])
    assert lines[first_at - 1].startswith(f"step {above[0]['step'] + 1:>4}/3")  # right after that step's line
    tokens = 100 * rejected_fractions(above[0])[0]
    for text in (f"step {above[0]['step'] + 1}/3 rejected {tokens:.1f}% of tokens",
                 f"above {100 * MAX_REJECTED_FRACTION:g}%", "seq_mean_k1 [0.999, 1.001]", "--rs-upper-bound",
                 "slime-rc analyze"):
        assert text in warnings[0], (text, warnings[0])
    assert warnings[1].startswith(f"warning: {len(above)} of 3 GRPO steps rejected more than")
    summary = json.loads((tmp_path / "noisy" / "summary.json").read_text())["rejection_warning"]
    assert summary["steps_above"] == len(above) and summary["threshold"] == MAX_REJECTED_FRACTION
    assert summary["first_step"] == above[0]["step"] and summary["message"] == warnings[1]

    quiet = _train(tmp_path / "quiet", "--rollout-dtype", "fp32")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "warning:" not in quiet.stdout
    assert json.loads((tmp_path / "quiet" / "summary.json").read_text())["rejection_warning"] is None
