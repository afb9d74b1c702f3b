"""`slime-rc --help`, every command's --help, and the "did you mean" of a mistyped command or flag."""

import os
import re
import subprocess
import sys

import pytest

from slime_rc.cli import SLIME_RUN_FLAGS, main
from slime_rc.config._text import close_matches, unknown_flags_message

from tests.slime_args import SLIME_ARG_NAMES_NEAR_OURS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RST = re.compile(r"``|:(?:func|mod|class|data|meth|attr):`")


def _run(capsys, *argv):
    """``(exit status, stdout, stderr)`` of ``slime-rc argv``, whether the command returns or argparse exits."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- --help ------------------------------------------------------------------------------------------------------

# the command line and words of its description that must come right after the usage line(s)
HELPS = [
    (["--help"], "Rollout correction for RL on Megatron + SGLang"),
    (["train", "--help"], "Run GRPO training with rollout correction"),
    (["plot", "--help"], "Plot runs' curves against the GRPO step"),
    (["analyze", "--help"], "Mismatch report of a log-prob dump"),
    (["study", "--help"], "Studies of rollout correction"),
    (["study", "estimators", "--help"], "Bias and variance of the rollout-correction estimators"),
    (["study", "summary", "--help"], "Print the table of a study directory"),
    (["config", "--help"], "Print the rollout-correction configuration a launch line resolves to"),
    (["config", "--slime", "--help"], "Show what slime makes of a slime launch line"),
]


@pytest.mark.parametrize("argv, words", HELPS)
def test_every_help_exits_0_and_says_first_in_plain_words_what_the_command_does(capsys, argv, words):
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    head = " ".join(out.split("\n\n")[:2])  # the usage paragraph, then the description
    assert words in " ".join(head.split()), out[:800]
    assert not RST.search(out), RST.search(out).group(0)


def test_top_level_help_lists_every_command_with_what_it_does(capsys):
    _, out, _ = _run(capsys, "--help")
    for command in ("train", "plot", "analyze", "study", "config"):
        assert re.search(rf"^\s+{command}\s+\w+", out, re.M), command


def test_no_command_is_a_usage_error_listing_the_commands(capsys):
    code, _, err = _run(capsys)
    assert code == 2
    assert "slime-rc: error: choose a command: train, plot, analyze, study, config" in err


def test_the_cli_imports_no_torch_for_help_below_the_package():
    """The CLI's own modules (slime_rc.cli and the config modules it reads) import no torch for any --help nor for
    slime-rc config: checked with the package's __init__ bypassed, which imports the engine (see the next test)."""
    code = ("import sys, types\n"
            f"pkg = types.ModuleType('slime_rc'); pkg.__path__ = [{os.path.join(ROOT, 'slime_rc')!r}]\n"
            "sys.modules['slime_rc'] = pkg\n"
            "from slime_rc.cli import main\n"
            "for argv in (['--help'], ['config', '--help'], ['config', '--slime', '--help'], ['study', '--help'],\n"
            "             ['study', 'summary', '--help'], ['config', '--use-tis']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "NO TORCH"


def test_slime_rc_help_imports_no_torch():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "slime_rc", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "torch" not in imported


# ---- did you mean ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, unknown, meant", [
    (["trian"], "'trian'", "'train'"),
    (["confg", "--use-tis"], "'confg'", "'config'"),
    (["study", "estimatrs"], "'estimatrs'", "'estimators'"),
])
def test_a_mistyped_command_is_named_with_the_closest_command(capsys, argv, unknown, meant):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert f"unknown command {unknown}. Did you mean {meant}?" in err


@pytest.mark.parametrize("argv, unknown, meant", [
    (["train", "--rollout-correction-prest", "x"], "--rollout-correction-prest", "--rollout-correction-preset"),
    (["train", "--tis-clp", "2"], "--tis-clp", "--tis-clip"),
    (["plot", "run", "--ouput", "x.png"], "--ouput", "--output"),
    (["analyze", "dump.jsonl", "--jsn"], "--jsn", "--json"),
    (["study", "estimators", "--quik"], "--quik", "--quick"),
    (["config", "--tis-clp", "2"], "--tis-clp", "--tis-clip"),
    (["config", "--rollout-correction-prest", "x"], "--rollout-correction-prest", "--rollout-correction-preset"),
    (["config", "--slime", "--tis-clp", "2"], "--tis-clp", "--tis-clip"),
    (["config", "--slime", "--use-rss"], "--use-rss", "--use-rs"),
])
def test_a_mistyped_flag_is_refused_naming_it_and_the_closest_flag(capsys, argv, unknown, meant):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert f"'{unknown}'" in err and f"Did you mean '{meant}'?" in err


def test_a_flag_study_summary_lacks_is_refused_by_name(capsys):
    code, _, err = _run(capsys, "study", "summary", "runs/study", "--seeds")
    assert code == 2
    assert err.endswith("slime-rc study summary: error: unrecognized arguments: --seeds. Unknown flag '--seeds'.\n")


def test_a_mistyped_flag_says_what_argparse_says_first(capsys):
    """The hint follows argparse's own words, which scripts and older tests look for."""
    code, _, err = _run(capsys, "study", "estimators", "--bogus")
    assert code == 2
    assert "unrecognized arguments: --bogus." in err and "Did you mean" not in err


@pytest.mark.parametrize("slime", [False, True])
def test_config_still_ignores_other_tools_flags_even_near_ours(capsys, slime):
    """A pasted launch line holds Megatron's and slime's flags: those are listed as ignored, not refused, including
    slime's arg names nearest to ours (tests/slime_args.py)."""
    foreign = ["--" + name.replace("_", "-") for name in SLIME_ARG_NAMES_NEAR_OURS]
    foreign = [f for f in foreign if f != "--eps-clip" and not (slime and f in SLIME_RUN_FLAGS)]  # ours there
    code, out, err = _run(capsys, "config", *(["--slime"] if slime else []), "--tensor-model-parallel-size", "2",
                          *foreign)
    assert code == 0, err
    assert "ignored (not rollout-correction flags): --tensor-model-parallel-size 2 " + " ".join(foreign) in out


def test_close_matches_offers_only_likely_typos():
    assert close_matches("--tis-clp", ["--tis-clip", "--tis-clip-low", "--eps-clip"]) == ["--tis-clip"]
    assert close_matches("--use-r", ["--use-rs", "--use-tis"]) == ["--use-rs"]
    assert close_matches("--tis-x", ["--tis-a", "--tis-b", "--lr"]) == ["--tis-a", "--tis-b"]  # ties: both
    assert close_matches("--foo", ["--lr", "--seed", "--output"]) == []


def test_unknown_flags_message_skips_values_and_numbers():
    text = unknown_flags_message(["--tis-clp", "2", "-1", "--x=3"], ["--tis-clip"])
    assert text == ("unrecognized arguments: --tis-clp 2 -1 --x=3. Unknown flag '--tis-clp'. Did you mean "
                    "'--tis-clip'? Unknown flag '--x'.")


def test_a_short_flag_gets_the_flags_its_letters_abbreviate_never_help(capsys):
    code, _, err = _run(capsys, "train", "--cp", "2")
    assert code == 2
    assert "Unknown flag '--cp'. Did you mean '--context-parallel-size'" in err and "'--help'" not in err
