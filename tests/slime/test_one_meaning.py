"""One meaning per setting: slime's example ``mis.yaml`` (and the same settings as flags) resolves to the same
settings in every entry point -- the Python API, ``slime-rc config`` with and without ``--slime``, ``slime-rc
train``, slime's TIS hook (``custom_tis.mis``), slime-rc's custom loss, and the settings slime's own ``mis.py``
reads when slime-rc hands it a resolved config (``with_slime_attributes``).

The YAML below holds the keys and values of slime's ``examples/train_infer_mismatch_helper/mis.yaml`` (624b824a8:
``rs_*_bound: null``, so the RS band is the IS band; truncate mode keeps ``tis_lower_bound`` unused).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import warnings

import pytest

from slime_rc.cli import main as cli_main
from slime_rc.config.arguments import resolve_args
from slime_rc.config.schema import RejectionCriterion, RolloutCorrectionConfig
from slime_rc.config.slime_attributes import with_slime_attributes
from slime_rc.demo.train.launch import build_parser, parse_launch_line
from slime_rc.slime.policy_loss import resolve_config
from slime_rc.slime.settings import SlimeMisSettings, hook_config, mis_settings, slime_settings
from tests import slime_args

MIS_YAML = """\
use_tis: true
use_rs: true
tis_level: "token"
rs_level: "token"
tis_mode: "truncate"
tis_lower_bound: 0.5
tis_upper_bound: 2.0
rs_lower_bound: null
rs_upper_bound: null
rs_veto_threshold: 1.0e-4
tis_batch_normalize: true
"""
# what slime's example mis.py applies for it (its defaulting rules, read from its source)
SLIME_APPLIES = SlimeMisSettings(use_tis=True, use_rs=True, tis_level="token", tis_mode="truncate", tis_lower=0.5,
                                 tis_upper=2.0, rs_level="token", rs_lower=0.5, rs_upper=2.0, veto=1e-4,
                                 batch_normalize=True)
CORRECTION_FIELDS = ("is_level", "is_mode", "is_upper_bound", "is_lower", "is_batch_normalize", "rs",
                     "veto_threshold")


def _correction(config: RolloutCorrectionConfig) -> dict:
    return {name: getattr(config, name) for name in CORRECTION_FIELDS}


def _cli_json(argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli_main(argv) == 0
    return json.loads(out.getvalue())


def _entry_points(path: str) -> dict:
    """entry point -> the correction settings it resolves for the YAML at ``path``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slime_line = slime_args.parse(["--custom-config-path", path])  # slime's parser + validation + YAML copy
        train_args = parse_launch_line(build_parser(), ["--custom-config-path", path])
        out = {
            "python API (from_yaml)": _correction(RolloutCorrectionConfig.from_yaml(path)),
            "slime-rc config": _correction(RolloutCorrectionConfig.from_dict(
                _cli_json(["config", "--custom-config-path", path, "--json"])["config"])),
            "slime-rc train": _correction(resolve_args(train_args).config),
            "custom loss": _correction(resolve_config(slime_line)),
            "TIS hook (custom_tis.mis)": _correction(hook_config(slime_args.parse(["--custom-config-path", path]))),
        }
    return out


def test_slimes_mis_yaml_resolves_to_the_same_settings_in_every_entry_point(tmp_path):
    path = tmp_path / "mis.yaml"
    path.write_text(MIS_YAML)
    found = _entry_points(str(path))
    expected = dict(is_level="token", is_mode="truncate", is_upper_bound=2.0, is_lower=0.5, is_batch_normalize=True,
                    rs=(RejectionCriterion("token", 2.0, 0.5),), veto_threshold=1e-4)
    for where, settings in found.items():
        assert settings == expected, where


def test_every_entry_point_applies_what_slimes_example_applies(tmp_path):
    path = tmp_path / "mis.yaml"
    path.write_text(MIS_YAML)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = RolloutCorrectionConfig.from_yaml(str(path))
        hook = mis_settings(slime_args.parse(["--custom-config-path", str(path)]))
        # slime-rc handing the resolved config to slime's own mis.py: the attributes it reads
        handed = vars(with_slime_attributes(argparse.Namespace(), config))
        handed.pop("rollout_correction_config")
        reread = mis_settings(argparse.Namespace(**handed))
        shown = _cli_json(["config", "--slime", "--custom-config-path", str(path), "--json"])["mis_settings"]
    assert slime_settings(config) == hook == reread == SLIME_APPLIES
    key_of = {"tis_lower_bound": "tis_lower", "tis_upper_bound": "tis_upper", "rs_lower_bound": "rs_lower",
              "rs_upper_bound": "rs_upper", "rs_veto_threshold": "veto", "tis_batch_normalize": "batch_normalize"}
    for key, row in shown.items():
        assert row["value"] == getattr(SLIME_APPLIES, key_of.get(key, key)), key


@pytest.mark.parametrize("argv,criterion", [
    (["--use-tis", "--use-rs", "--rs-level", "geometric"], RejectionCriterion("geometric", 2.0, 0.5)),
    (["--use-tis", "--tis-level", "sequence", "--tis-upper-bound", "3.0", "--use-rs"],
     RejectionCriterion("sequence", 3.0, 1 / 3)),
    (["--use-rs", "--rs-upper-bound", "4.0"], RejectionCriterion("token", 4.0, 0.5)),
])
def test_unset_rs_settings_take_slimes_defaults_on_a_launch_line_too(argv, criterion):
    """slime's rules: rs_level = tis_level, rs_upper_bound = tis_upper_bound, rs_lower_bound = tis_lower_bound or
    1 / tis_upper_bound -- the same in slime-rc train and in the TIS hook reading the same attributes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = resolve_args(parse_launch_line(build_parser(), argv)).config
        attributes = {a.lstrip("-").replace("-", "_"): (True if b is None else float(b) if b[0].isdigit() else b)
                      for a, b in zip(argv, argv[1:] + [None]) if a.startswith("--")
                      and (b is None or not b.startswith("--"))}
        attributes.update({a.lstrip("-").replace("-", "_"): True for a, b in zip(argv, argv[1:] + ["--"])
                           if a.startswith("--") and b.startswith("--")})
        hook = hook_config(argparse.Namespace(**attributes))
    assert train.rs == hook.rs == (criterion,)


def test_slime_rc_config_names_what_set_the_rs_criteria_not_a_null_key(tmp_path, capsys):
    path = tmp_path / "mis.yaml"
    path.write_text(MIS_YAML)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli_main(["config", "--custom-config-path", str(path)]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  rs "))
    assert "token in [0.5, 2]" in row and "rs_level in" in row, row
    assert "rs_lower_bound" not in row  # given as null: it set nothing
