"""`slime-rc config`: what a user sees when a launch line does not behave as expected."""

import json
import os
import subprocess
import sys

import pytest

from slime_rc.cli import main


def _run(capsys, *argv):
    code = main(["config", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _row(text, name):
    return next(line.split() for line in text.splitlines() if line.strip().startswith(name + " "))


def test_table_shows_each_setting_with_its_source(capsys, tmp_path):
    yaml_path = tmp_path / "rc.yaml"
    yaml_path.write_text("use_tis: true\ntis_level: sequence\ntis_upper_bound: 3.0\n")
    code, out, _ = _run(capsys, "--rollout-correction-preset", "decoupled_seq_is_rs", "--custom-config-path",
                        str(yaml_path), "--tis-upper-bound", "4", "--tensor-model-parallel-size", "2")
    assert code == 0
    assert "decoupled PPO" in out
    assert _row(out, "is_upper_bound")[1:] == ["4.0", "--tis-upper-bound"]         # flag beats YAML
    assert _row(out, "is_level")[1:] == ["sequence", "tis_level", "in", str(yaml_path)]  # YAML beats preset
    assert _row(out, "rs")[1:4] == ["sequence", "in", "[0.5,"]                     # from the preset
    assert _row(out, "rs")[-2:] == ["preset", "decoupled_seq_is_rs"]
    assert _row(out, "safety_bound")[1:] == ["20.0", "default"]
    assert "ignored (not rollout-correction flags): --tensor-model-parallel-size 2" in out


def test_diagnostics_only_is_visible(capsys):
    code, out, _ = _run(capsys, "--use-rollout-logprobs", "--use-tis")
    assert code == 0
    assert "bypass PPO" in out
    assert "token (diagnostics only)" in out
    assert "note: IS weights are diagnostics only" in out


def test_json_output(capsys):
    code, out, _ = _run(capsys, "--rollout-correction-preset", "bypass_pg_geo_rs_token_tis", "--json",
                        "--custom-tis-function-path", "mis")
    assert code == 0
    data = json.loads(out)
    assert data["config"]["mode"] == "bypass" and data["config"]["loss_type"] == "reinforce"
    assert data["config"]["rs"] == [{"option": "seq_mean_k1", "upper": 1.001, "lower": 0.999}]
    assert data["sources"]["rs"] == "preset bypass_pg_geo_rs_token_tis"
    assert data["sources"]["safety_bound"] == "default"
    assert data["is_weights_applied"] is True
    assert data["tis_function"] == "mis"


def test_error_exits_2_with_a_message_naming_the_flag(capsys):
    code, out, err = _run(capsys, "--tis-level", "sequence")
    assert code == 2 and out == ""
    assert "--tis-level='sequence'" in err and "--use-tis" in err


def test_parse_error_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["config", "--custom-tis-function-path", "no_such_module_xyz.fn"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--custom-tis-function-path" in err and "no_such_module_xyz" in err


def test_module_entry_point_runs():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "config", "--use-rs", "--rs-level", "seq_mean_k3",
                           "--rs-upper-bound", "0.01"], capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "seq_mean_k3 <= 0.01" in proc.stdout


def test_study_subcommands_dispatch(capsys, tmp_path):
    run = tmp_path / "cfg" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.5, "grad_norm": 1.0,
                                                   "time/step": 0.1}) + "\n")
    assert main(["study", "summary", str(tmp_path)]) == 0
    assert "| cfg | 1 | 0.500 |" in capsys.readouterr().out
    assert main(["study"]) == 2
    assert "'estimators'" in capsys.readouterr().err


# ---- slime-rc config --slime: the resolution slime applies -------------------------------------------------------

def _slime_row(text, name):
    """The row of attribute ``name`` in the 'slime's args' table (before the engine's table)."""
    part = text.split("resolved by slime-rc's engine")[0].split("custom_tis.mis applies")[0]
    return next(line.split(None, 2) for line in part.splitlines() if line.strip().startswith(name + " "))


def _mis_row(text, name):
    """The row of key ``name`` in the table of slime's example semantics (custom_tis.mis on slime's keys)."""
    part = text.split("custom_tis.mis applies slime's example mis.py semantics")[1]
    return next(line.split(None, 2) for line in part.splitlines() if line.strip().startswith(name + " "))


def test_default_precedence_is_printed(capsys):
    code, out, _ = _run(capsys, "--use-tis")
    assert code == 0
    assert "precedence: flag > YAML (--custom-config-path) > preset (--rollout-correction-preset) > default" in out
    assert "slime's args" not in out


def test_slime_yaml_beats_flags_and_our_launch_flags_beat_yaml(capsys, tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("use_tis: true\ntis_level: sequence\ntis_upper_bound: 3.0\nuse_kl_loss: true\n"
                    "advantage_estimator: grpo\n")
    argv = ["--use-tis", "--tis-level", "token", "--tis-upper-bound", "4", "--custom-config-path", str(path)]
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert _row(out, "is_level")[1:] == ["token", "--tis-level"]
    assert _row(out, "is_upper_bound")[1:] == ["4.0", "--tis-upper-bound"]
    code, out, _ = _run(capsys, "--slime", *argv)
    assert code == 0
    assert "precedence: YAML (--custom-config-path, copied onto args after parsing) > flag > preset" in out
    assert _mis_row(out, "tis_level") == ["tis_level", "'sequence'", "set"]
    assert _mis_row(out, "tis_upper_bound") == ["tis_upper_bound", "3.0", "set"]
    assert _mis_row(out, "tis_lower_bound") == ["tis_lower_bound", repr(1 / 3.0), "default: 1 / tis_upper_bound"]
    assert _slime_row(out, "tis_level") == ["tis_level", "'sequence'",
                                            f"tis_level in {path} (over --tis-level 'token')"]
    assert f"note: tis_level: 'sequence' in {path} replaces --tis-level 'token'" in out
    assert "ignored YAML keys (not slime-rc's: slime's or other plugins'): use_kl_loss, advantage_estimator" in out


def test_slime_shows_slimes_defaults_and_dropped_no_flags(capsys):
    code, out, _ = _run(capsys, "--slime", "--use-tis", "--no-use-tis", "--tis-clip", "2.5", "--num-rollout", "3")
    assert code == 0
    assert _slime_row(out, "tis_clip") == ["tis_clip", "2.5", "--tis-clip"]
    assert _slime_row(out, "tis_clip_low") == ["tis_clip_low", "0", "slime's default"]
    assert _slime_row(out, "eps_clip") == ["eps_clip", "0.2", "slime's default"]
    assert _slime_row(out, "use_tis") == ["use_tis", "True", "--use-tis"]  # --no-use-tis did not turn it off
    assert "use tis_clip=2.5, tis_clip_low=0" in out  # what slime's vanilla TIS caps at; mis.py reads tis_upper_bound
    assert _mis_row(out, "tis_upper_bound") == ["tis_upper_bound", "2.0", "default: 2.0"]
    assert "note: --no-use-tis: slime's --use-tis is a store_true flag with no --no- form" in out
    assert "use_tis: false in the --custom-config-path YAML" in out
    assert "ignored (not rollout-correction flags): --no-use-tis --num-rollout 3" in out


def test_slime_json(capsys, tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("use_rs: true\nrs_level: geometric\nrs_upper_bound: '0.999_1.001'\nkl_coef: 0.0\n")
    code, out, _ = _run(capsys, "--slime", "--json", "--rs-level", "token", "--custom-config-path", str(path))
    assert code == 0
    data = json.loads(out)
    assert data["precedence"].startswith("YAML")
    assert data["slime_args"]["rs_level"] == {"value": "geometric",
                                              "source": f"rs_level in {path} (over --rs-level 'token')"}
    assert data["slime_args"]["tis_clip"] == {"value": 2.0, "source": "slime's default"}
    assert data["config"]["rs"] == [{"option": "geometric", "upper": 1.001, "lower": 0.999}]
    assert data["sources"]["rs"] == f"rs_upper_bound in {path}"
    assert data["ignored_yaml_keys"] == ["kl_coef"]


def test_slime_refuses_what_slime_would_misread(capsys, tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("rs_veto_threshold: 1e-4\n")
    code, out, err = _run(capsys, "--slime", "--custom-config-path", str(path))
    assert code == 2 and out == ""
    assert "rs_veto_threshold" in err and "'1e-4'" in err and "rs_veto_threshold: 1.0e-4" in err and str(path) in err
    code, out, _ = _run(capsys, "--custom-config-path", str(path))  # slime-rc's own launches read the number
    assert code == 0 and _row(out, "veto_threshold")[1:3] == ["0.0001", "rs_veto_threshold"]


def test_slime_refuses_a_near_miss_in_the_shared_yaml(capsys, tmp_path):
    path = tmp_path / "shared.yaml"
    path.write_text("use_tis: true\ntis_uper_bound: 3.0\nkl_coef: 0.0\n")
    code, _, err = _run(capsys, "--slime", "--custom-config-path", str(path))
    assert code == 2
    assert "'tis_uper_bound'" in err and "Did you mean 'tis_upper_bound'?" in err and str(path) in err


def test_slime_semantics_fill_rs_bounds_where_the_engine_needs_them(capsys, tmp_path):
    """slime's mis.yaml leaves the RS bounds null: slime's example takes the IS bounds, and so does custom_tis.mis
    on slime's keys; settings beyond slime's example go to the engine, which refuses a missing threshold."""
    path = tmp_path / "shared.yaml"
    path.write_text("use_tis: true\nuse_rs: true\nrs_veto_threshold: 1.0e-4\n")
    code, out, _ = _run(capsys, "--slime", "--custom-config-path", str(path))
    assert code == 0
    assert _slime_row(out, "use_rs") == ["use_rs", "True", f"use_rs in {path}"]
    assert _mis_row(out, "rs_upper_bound") == ["rs_upper_bound", "2.0", "default: tis_upper_bound"]
    assert _mis_row(out, "rs_lower_bound") == ["rs_lower_bound", "0.5", "default: tis_lower_bound"]
    path.write_text("use_tis: false\nrs_veto_threshold: 1.0e-4\n")
    code, out, _ = _run(capsys, "--slime", "--custom-config-path", str(path))
    assert code == 0 and "note: slime-rc: rs_veto_threshold=0.0001 without use_rs: slime's example mis.py ignores" in out
    path.write_text("use_rs: true\nrs_level: seq_mean_k3\n")
    code, out, err = _run(capsys, "--slime", "--custom-config-path", str(path))
    assert code == 2
    assert _slime_row(out, "rs_level") == ["rs_level", "'seq_mean_k3'", f"rs_level in {path}"]
    assert "slime-rc's engine refuses these settings" in err and "rs_upper_bound" in err
