"""The knob table (slime_rc/config/knobs.py): each setting declared once, every other view derived from it."""

import argparse
import ast
import os
from dataclasses import fields

import pytest

from slime_rc import PRESETS, RolloutCorrectionConfig
from slime_rc.config.arguments import FLAGS, OTHER_FLAGS, SLIME_OWNED_FLAGS
from slime_rc.config.knobs import (ALL_FLAGS, BOOLEAN_SPELLINGS, FIELD_DEFAULTS, FIELD_SETTINGS, KNOBS, LAUNCH_FLAGS,
                                   SETTINGS, SPELLINGS)

from tests.checks import raises_mentioning as _raises

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_config_field_is_built_from_knobs_and_takes_the_tables_default():
    assert set(FIELD_SETTINGS) == {f.name for f in fields(RolloutCorrectionConfig)}
    assert {f.name: f.default for f in fields(RolloutCorrectionConfig)} == FIELD_DEFAULTS


def test_settings_keys_are_unique_and_every_key_is_a_spelling():
    assert len(SETTINGS) == len(set(SETTINGS)) == len(KNOBS)
    assert set(SETTINGS) <= set(SPELLINGS)


def test_argparse_views_are_the_tables_flags():
    assert list(FLAGS) + list(OTHER_FLAGS) == [f.flag for f in ALL_FLAGS]
    assert list(OTHER_FLAGS) == [f.flag for f in LAUNCH_FLAGS]
    assert SLIME_OWNED_FLAGS == {f.flag: f.slime_defines for f in ALL_FLAGS if f.slime_defines}
    for f in ALL_FLAGS:
        assert FLAGS.get(f.flag, (f.sets,))[0] == f.sets and f.dest == f.flag[2:].replace("-", "_")


@pytest.mark.parametrize("key", sorted(BOOLEAN_SPELLINGS))
def test_every_boolean_spelling_refuses_a_string(key):
    # "false" as a string is truthy: every spelling of a switch refuses it, the mis_* aliases included
    _raises(lambda: RolloutCorrectionConfig.from_dict({key: "false"}), key, "must be true or false")


def test_presets_are_data_and_the_class_is_not_patched():
    # the deprecated aliases come from the class's own (table-built) base; importing presets changes nothing
    assert not set(PRESETS) & set(vars(RolloutCorrectionConfig))
    for name in PRESETS:
        doc = getattr(RolloutCorrectionConfig, name).__doc__
        assert "Deprecated" in doc and f"RolloutCorrectionConfig.preset({name!r}" in doc
    source = open(os.path.join(ROOT, "slime_rc", "config", "presets.py")).read()
    assert "setattr" not in source and "RolloutCorrectionConfig" not in source.split('"""', 2)[2]


def test_one_did_you_mean_helper():
    # every hint in the configuration (and in slime's key checks) comes from slime_rc.config._text
    users = []
    for folder in ("config", "slime"):
        for name in os.listdir(os.path.join(ROOT, "slime_rc", folder)):
            if name.endswith(".py"):
                tree = ast.parse(open(os.path.join(ROOT, "slime_rc", folder, name)).read())
                names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
                if "difflib" in names:
                    users.append(f"{folder}/{name}")
    assert users == ["config/_text.py"]


def test_a_flags_help_says_the_tables_default():
    parser = argparse.ArgumentParser()
    from slime_rc import add_rollout_correction_arguments
    text = " ".join(add_rollout_correction_arguments(parser).format_help().split())
    assert "upper IS bound (default 2.0)" in text
    assert "resolution of the IS quantile metrics (default 128 per octave)" in text
