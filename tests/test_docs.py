"""The docs say what the code does: every metric and config field documented exists, and vice versa."""

import os
import re
from dataclasses import fields

from slime_rc import METRICS, RS_OPTIONS, RolloutCorrectionConfig

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _read(name):
    with open(os.path.join(DOCS, name)) as f:
        return f.read()


def test_every_metric_is_documented_and_no_stale_names():
    text = _read("metrics.md")
    documented = set(re.findall(r"^\| `([a-z0-9_<>]+)` \|", text, flags=re.M))
    assert documented == set(METRICS), (documented ^ set(METRICS))


def test_every_config_field_and_rs_option_is_documented():
    text = _read("configuration.md")
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M))
    assert {f.name for f in fields(RolloutCorrectionConfig)} <= documented
    for option in RS_OPTIONS:
        assert f"`{option}`" in text, option


def test_engine_returns_only_documented_metric_names():
    import torch
    from slime_rc import compute_rollout_correction, parse_rejection_criteria
    cfg = RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_batch_normalize=True,
                                  rs=parse_rejection_criteria("token,seq_max_k3", "2.0,0.5"), veto_threshold=1e-4,
                                  on_nonfinite="reject")
    lp = -torch.rand(12)
    out = compute_rollout_correction(lp, lp + 0.01, torch.ones(12), torch.tensor([0, 5, 12]), cfg)
    generic = {re.sub(r"^rollout_rs_(token|seq_max_k3)_", "rollout_rs_<option>_", k) for k in out.metrics}
    assert generic <= set(METRICS), generic - set(METRICS)
