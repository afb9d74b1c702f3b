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
