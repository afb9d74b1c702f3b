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


# ---- usage.md: flags and presets ---------------------------------------------------------------------------------
def _preset_row(name):
    """The usage.md row of a preset, derived from the config the preset builds (so a stale row fails)."""
    c = RolloutCorrectionConfig.preset(name)
    if not c.is_enabled:
        is_text = "—"
    elif c.is_mode == "truncate":
        is_text = f"{c.is_level}, truncate ≤ {c.is_upper_bound:g}"
    else:
        is_text = f"{c.is_level}, {c.is_mode} [{c.is_lower:g}, {c.is_upper_bound:g}]"
    if c.is_enabled and not c.is_weights_applied:
        is_text += " (diagnostics only)"
    rs_text = "; ".join(f"{r.option} in [{r.lower:g}, {r.upper:g}]" if r.statistic == "k1" else
                        f"{r.option} ≤ {r.upper:g}" for r in c.rs) or "—"
    veto = "—" if c.veto_threshold is None else f"{c.veto_threshold:g}"
    extra = ", ".join([x for x, on in (("rejected tokens stay in the denominator", c.rejected_in_denominator),
                                       ("metrics only", c.get_mismatch_metrics)) if on]) or "—"
    return f"| `{name}` | {c.mode} | {c.loss_type} | {is_text} | {rs_text} | {veto} | {extra} |"


def test_every_preset_row_matches_the_code():
    from slime_rc import PRESETS
    text = _read("usage.md")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9_]+)` \| (?:standard|decoupled|bypass) .*\|$",
                                                          text, flags=re.M)}
    assert set(rows) == set(PRESETS), set(rows) ^ set(PRESETS)
    for name in PRESETS:
        assert rows[name] == _preset_row(name)


def test_every_flag_is_documented_and_no_stale_flags():
    from slime_rc.config.knobs import ALL_FLAGS
    text = _read("usage.md")
    documented = set(re.findall(r"^\| `(--[a-z-]+)`", text, flags=re.M))
    flags = {f.flag for f in ALL_FLAGS}  # the knob table's flags (argparse's FLAGS / OTHER_FLAGS are views of it)
    assert documented == flags, documented ^ flags


def test_every_flag_row_is_the_knob_tables():
    """usage.md's flag table, row by row: the flag, the setting it sets (— for the launch flags) and its help."""
    from slime_rc.config.knobs import ALL_FLAGS
    row = r"^\| `(--[a-z-]+)` \| (?:`[a-z_]+`|—) \|.*\|$"
    rows = {m.group(1): m.group(0) for m in re.finditer(row, _read("usage.md"), flags=re.M)}
    for f in ALL_FLAGS:
        assert rows[f.flag] == f"| `{f.flag}` | {f'`{f.knob}`' if f.knob else '—'} | {f.help} |", f.flag


def test_every_yaml_key_is_documented():
    from slime_rc.config.knobs import SPELLINGS
    text = _read("usage.md") + _read("configuration.md")
    missing = [k for k in SPELLINGS if f"`{k}`" not in text]
    assert not missing, missing


def test_readme_names_no_missing_doc():
    readme = open(os.path.join(os.path.dirname(DOCS), "README.md")).read()
    for link in re.findall(r"\]\((docs/[a-z_]+\.md)\)", readme):
        assert os.path.exists(os.path.join(os.path.dirname(DOCS), link)), link


def test_every_train_flag_is_documented():
    from slime_rc.demo.train.launch import _FLAGS
    documented = set(re.findall(r"^\| `(--[a-z-]+)`", _read("train.md"), flags=re.M))
    expected = set(_FLAGS) | {"--nproc", "--output-dir", "--overwrite"}
    assert documented == expected, documented ^ expected
