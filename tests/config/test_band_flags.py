"""A ``'lower_upper'`` band given to a command-line flag.

Every flag of the knob table that takes one number (``--tis-upper-bound``, ``--tis-clip``, ``--eps-clip``,
``--rollout-correction-safety-bound``, ...) refuses text with an underscore as a band, in the words the YAML path
uses (``slime_rc.config._text.band_refusal``), naming the flag as typed, the value, the band's ends and the fix;
before, it said ``tis_upper_bound='0.5_5' is not a number`` (the setting's name, not the flag; no band, no fix).
Every band flag (``--rs-upper-bound``) still reads the band.  Both lists are derived from the knob table, so a flag
added there is covered here.
"""

from __future__ import annotations

import argparse

import pytest

from slime_rc.config._text import refuse_band
from slime_rc.config.arguments import add_rollout_correction_arguments, config_from_args, takes_one_number
from slime_rc.config.knobs import BAND_SPELLINGS, KNOB, KNOB_FLAGS, integer, number

ONE_NUMBER = [f for f in KNOB_FLAGS if f.knob and KNOB[f.knob].parse in (number, integer)
              and f.sets not in BAND_SPELLINGS]
BAND = [f for f in KNOB_FLAGS if f.sets in BAND_SPELLINGS]
# the switches that make each setting live (a dead setting is refused for another reason)
SWITCHES = ["--use-tis", "--use-rs"]


def _parse(argv, capsys):
    parser = add_rollout_correction_arguments(argparse.ArgumentParser(prog="train"), slime=False)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_lists_cover_the_table():
    """Every knob flag with a value that is read as a number is one of the two kinds (none silently left out)."""
    numeric = {f.flag for f in KNOB_FLAGS if f.knob and KNOB[f.knob].parse in (number, integer)}
    assert numeric == {f.flag for f in ONE_NUMBER}
    assert {"--tis-upper-bound", "--tis-clip", "--tis-lower-bound", "--tis-clip-low", "--rs-lower-bound",
            "--rs-veto-threshold", "--rollout-correction-safety-bound", "--rollout-correction-quantile-bins",
            "--eps-clip", "--eps-clip-high", "--eps-clip-c"} <= numeric
    assert [f.flag for f in BAND] == ["--rs-upper-bound"]
    assert all(takes_one_number(f) for f in ONE_NUMBER) and not any(takes_one_number(f) for f in BAND)


@pytest.mark.parametrize("text", ["0.5_5", "0.5_2.0", "1_000"])
@pytest.mark.parametrize("flag", ONE_NUMBER, ids=lambda f: f.flag)
def test_a_band_given_to_a_one_number_flag_is_refused_naming_the_flag(flag, text, capsys):
    err = _parse(SWITCHES + [flag.flag, text], capsys)
    lower, _, upper = text.partition("_")
    assert err.startswith(f"train: error: argument {flag.flag}: {flag.flag} {text} is a 'lower_upper' band "
                          f"(lower {lower}, upper {upper}), but {flag.flag} takes one number"), err
    assert "write a single number without an underscore; " in err
    assert "is not a number" not in err  # the message before


@pytest.mark.parametrize("flag", ONE_NUMBER, ids=lambda f: f.flag)
def test_the_flag_message_is_the_yaml_message_with_the_flag(flag, capsys):
    """Same words as a mapping's refusal (refuse_band): only how the value was written and the fix differ."""
    err = _parse(SWITCHES + [flag.flag, "0.5_5"], capsys)
    with pytest.raises(ValueError) as info:
        refuse_band(flag.flag, "0.5_5", "HINT")
    yaml_words = str(info.value).replace(f"{flag.flag}='0.5_5'", f"{flag.flag} 0.5_5").replace("; HINT", "")
    assert yaml_words in err, (yaml_words, err)


@pytest.mark.parametrize("flag,fix", [
    ("--tis-upper-bound", "--tis-lower-bound 0.5 --tis-upper-bound 5 (with --tis-mode mask"),
    ("--tis-clip", "--tis-lower-bound 0.5 --tis-upper-bound 5"),
    ("--tis-clip-low", "--tis-lower-bound 0.5 --tis-upper-bound 5"),
    ("--rs-lower-bound", "a rejection band goes into the threshold: --rs-upper-bound 0.5_5"),
    ("--eps-clip", "--eps-clip 0.2 --eps-clip-high 0.28"),
    ("--rollout-correction-safety-bound", "e.g. --rollout-correction-safety-bound 20.0"),
])
def test_the_fix_fits_the_flag(flag, fix, capsys):
    assert fix in _parse(SWITCHES + [flag, "0.5_5"], capsys)


@pytest.mark.parametrize("flag", ONE_NUMBER, ids=lambda f: f.flag)
def test_one_number_flags_still_read_a_number(flag):
    parser = add_rollout_correction_arguments(argparse.ArgumentParser(prog="train"), slime=False)
    text = "3" if KNOB[flag.knob].parse is integer else "0.5"
    args = parser.parse_args(SWITCHES + [flag.flag, text])
    assert getattr(args, flag.dest) == (3 if text == "3" else 0.5)


@pytest.mark.parametrize("flag", BAND, ids=lambda f: f.flag)
def test_band_flags_still_read_a_band(flag):
    parser = add_rollout_correction_arguments(argparse.ArgumentParser(prog="train"), slime=False)
    args = parser.parse_args(SWITCHES + ["--rs-level", "token", flag.flag, "0.5_5"])
    (criterion,) = config_from_args(args).rs
    assert (criterion.lower, criterion.upper) == (0.5, 5.0)
    args = parser.parse_args(SWITCHES + ["--rs-level", "token,seq_max_k3", flag.flag, "0.5_5,2.0"])
    assert [(c.lower, c.upper) for c in config_from_args(args).rs] == [(0.5, 5.0), (None, 2.0)]
