"""The console line shows the mismatch metrics whichever path corrects: slime-rc's engine, or a
``--custom-tis-function-path`` function (slime's example contract, a vanilla TIS function, monitoring only) --
under the same names in metrics.jsonl, and the console's values are those of metrics.jsonl."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--nproc", "1", "--num-steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--logit-noise", "0.5"]
PATHS = {
    "engine": ["--use-tis", "--use-rs", "--rs-upper-bound", "1.2"],
    "custom_tis.mis": ["--use-tis", "--use-rs", "--rs-upper-bound", "1.2", "--custom-tis-function-path",
                       "custom_tis.mis.compute_mis_weights_with_cp"],
    "custom_tis.tis": ["--use-tis", "--custom-tis-function-path", "custom_tis.tis.compute_tis_weights_with_cp"],
    "metrics only": ["--get-mismatch-metrics", "--custom-tis-function-path",
                     "custom_tis.metrics_only.compute_metrics_only_with_cp"],
}
LINE = re.compile(r"step +(\d+)/\d+ .* k3 (\S+)  ess (\S+)  rejected (\S+)")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_console_shows_the_mismatch_metrics_on_every_path(path, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", *BASE, *PATHS[path], "--output-dir",
                           str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = [m.groups() for m in map(LINE.search, proc.stdout.splitlines()) if m]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(shown) == len(rows) == 2, proc.stdout
    for (_, k3, ess, rejected), row in zip(shown, rows):
        assert k3 != "-" and float(k3) == pytest.approx(row["rollout_corr/k3_kl"], rel=1e-2), (path, k3)
        assert float(rejected) == pytest.approx(row["rollout_corr/rejected_token_fraction"], abs=1e-3)
        if path != "metrics only":  # weights applied: their effective sample size
            assert ess != "-" and float(ess) == pytest.approx(row["rollout_corr/rollout_is_eff_sample_size"],
                                                              abs=1e-3)
    if path == "custom_tis.mis":  # the function's own metrics, under its own names
        assert any(k.startswith("rollout_corr/tis_function/") for k in rows[0]), sorted(rows[0])
        assert max(r["rollout_corr/rejected_token_fraction"] for r in rows) > 0  # the band rejects at this noise
