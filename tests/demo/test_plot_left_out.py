"""``slime-rc plot`` names every run (or study configuration) it leaves out of a panel, and the metric it lacks:
a run without mismatch metrics, or a --custom-tis-function-path run whose metrics went under another prefix, is
never silently missing from the mismatch panels."""

import json

from slime_rc.cli import main
from slime_rc.demo.train.plot import PANELS, STUDY_PANELS, left_out

STANDARD = {"rollout_corr/k3_kl": 1e-3, "rollout_corr/kl": 2e-3, "rollout_corr/rollout_is_eff_sample_size": 0.9,
            "rollout_corr/rejected_token_fraction": 0.1}


def _run(directory, extra, steps=4):
    directory.mkdir(parents=True)
    rows = [{"step": i, "reward_mean": 0.1 * i, "grad_norm": 1.0, "exact_fraction": 0.0, **extra}
            for i in range(steps)]
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(directory)


def test_plot_names_the_run_and_the_metrics_it_leaves_out_of_the_mismatch_panels(tmp_path, capsys):
    full = _run(tmp_path / "full", STANDARD)
    custom = _run(tmp_path / "custom", {"rollout_corr/tis_function/tis_mean": 1.0})
    older = _run(tmp_path / "older", {**{k: v for k, v in STANDARD.items() if "rejected" not in k},
                                      "rollout_corr/rollout_rs_masked_fraction": 0.2})
    assert main(["plot", full, custom, older, "-o", str(tmp_path / "c.png")]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert len(notes) == 1, notes  # the full run and the run with the older rejection name are in every panel
    mismatch = [(k, t) for k, t in PANELS if k.startswith("rollout_corr/")]
    assert mismatch and "custom" in notes[0] and "rollout_corr/tis_function/" in notes[0]
    for key, title in mismatch:
        assert key in notes[0] and f"'{title}'" in notes[0], (key, notes[0])
    assert "reward_mean" not in notes[0] and "'mean reward'" not in notes[0]  # it is in that panel
    missing = left_out({"custom": [{"reward_mean": 0.0, "grad_norm": 1.0}]}, PANELS)["custom"]
    assert [k for k, _ in missing] == [k for k, _ in mismatch]


def test_study_plot_names_the_configuration_left_out_of_a_panel(tmp_path, capsys):
    for seed in (0, 1):
        _run(tmp_path / "study" / "with" / f"seed{seed}", STANDARD, steps=3)
        _run(tmp_path / "study" / "without" / f"seed{seed}", {}, steps=3)
    assert main(["plot", str(tmp_path / "study"), "-o", str(tmp_path / "s.png")]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: configuration without has no "), notes
    for key, title in STUDY_PANELS:
        assert (key in notes[0]) == key.startswith("rollout_corr/"), (key, notes[0])
    assert "no rollout_corr/ metric" in notes[0]
