"""`slime-rc analyze` on bad input: every refusal is one line naming the file, the key / value and the
fix, exit status 2, no traceback; inputs that can be analyzed with a caveat give a counted outcome in the report
(docs/analyze.md, "Bad input").  Real files in tmp_path, the real CLI (``slime_rc.cli.main``; one subprocess run)."""

import gzip
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import slime_rc.tools.dump as dump_module
from slime_rc.cli import main as cli

torch.set_num_threads(1)

PREFIX = "slime-rc analyze: error: "
GOOD = {"train_log_probs": [-0.5, -1.0, -2.0, -0.1], "rollout_log_probs": [-0.4, -1.1, -2.0, -0.12],
        "loss_mask": [1, 1, 0, 1]}


def records(n=6, **extra):
    out = []
    for i in range(n):
        r = json.loads(json.dumps(GOOD))
        r["train_log_probs"][0] -= 0.01 * i
        out.append({**r, "sample": i, **extra})
    return out


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def refused(capsys, argv):
    """``slime-rc analyze argv`` exits 2 with one error line; returns the message after the prefix."""
    capsys.readouterr()
    assert cli(["analyze", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert captured.out == "" and err.startswith(PREFIX) and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err[len(PREFIX):].rstrip("\n")


def report_json(capsys, argv):
    capsys.readouterr()
    assert cli(["analyze", *argv, "--json"]) == 0
    numbers = []
    out = json.loads(capsys.readouterr().out, parse_float=lambda s: numbers.append(float(s)) or float(s))
    assert all(math.isfinite(x) for x in numbers)  # never a NaN / inf in the report
    return out


# 1. a binary file (torch.save, gzip): before, "'utf-8' codec can't decode byte 0x80 ..." without the file's name
@pytest.mark.parametrize("kind", ["torch", "gzip"])
def test_binary_file_is_named_with_what_it_is(tmp_path, capsys, kind):
    if kind == "torch":
        path = tmp_path / "logprobs.pt"
        torch.save({"train_log_probs": torch.zeros(3)}, path)
        expected = ("not a JSONL dump but a zip archive (torch.save writes these): a dump is JSONL text; write one "
                    "with slime_rc.tools.dump.sample_record + DumpWriter, or slime-rc train --dump-logprobs DIR")
    else:
        path = tmp_path / "dump.jsonl.gz"
        with gzip.open(path, "wt") as f:
            f.write(json.dumps(GOOD) + "\n")
        expected = f"not a JSONL dump but a gzip file: decompress it first (gunzip {path})"
    assert refused(capsys, [str(path)]) == f"{path}: {expected}"


# 2. random bytes / a corrupt line: before, the bare UnicodeDecodeError text, no file, no line
def test_non_utf8_bytes_name_file_line_and_byte(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_bytes((json.dumps(GOOD) + "\n").encode() + b'{"train_log_probs": [\xff\xfe]}\n')
    msg = refused(capsys, [str(path)])
    assert msg.startswith(f"{path}:2: not UTF-8 text (byte 0xff at column 22)"), msg
    assert "a dump is JSONL text" in msg


# 2b. a dump cut in the middle of a line (half a file): before, "not JSON (Expecting ',' delimiter at column 1)" when
#     the cut line ended in a newline (the column of the newline), and no word of truncation
def test_truncated_file_says_so_with_the_right_column(tmp_path, capsys):
    whole = "".join(json.dumps(r) + "\n" for r in records(3))
    cut = whole[:len(whole) - 20]  # the last record loses its end
    path = tmp_path / "d.jsonl"
    path.write_text(cut)
    last = cut.split("\n")[-1]
    with pytest.raises(json.JSONDecodeError) as info:
        json.loads(last)
    why = f"{info.value.msg} at column {len(last) + 1}"  # the error sits at the cut
    assert refused(capsys, [str(path)]) == (f"{path}:3: not JSON ({why}); the file ends inside this line: truncated "
                                            f"(a partial copy or a crashed writer?); drop the last line")
    path.write_text(cut + "\n")  # cut, then a newline: the column is still the cut's, not 1
    assert refused(capsys, [str(path)]) == f"{path}:3: not JSON ({why})"


# 3. 2-D token arrays (a padded [B, T] batch in one record): before, the engine's "must be 1-D packed tokens [N] ...
#    pass cu_seqlens" without file or line
def test_nested_token_arrays_are_refused_with_their_shape(tmp_path, capsys):
    rec = {"train_log_probs": [[-0.5, -1.0], [-0.2, -0.3]], "rollout_log_probs": [[-0.4, -1.1], [-0.2, -0.3]],
           "loss_mask": [1, 1]}
    path = write_jsonl(tmp_path / "d.jsonl", records(1) + [rec])
    assert refused(capsys, [path]) == (f"{path}:2: 'train_log_probs' must be a flat list (one number per response "
                                       f"token of this sample), got nested lists of shape [2, 2]; write one record "
                                       f"per sample")


# 4. no loss token at all: before, exit 0 with "negligible mismatch, bypass_ppo_clip" and quantiles of 0
def test_zero_loss_tokens_is_refused_not_reported_as_negligible(tmp_path, capsys):
    recs = [dict(r, loss_mask=[0, 0, 0, 0]) for r in records(3)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    assert refused(capsys, [path]) == (f"{path}: nothing to analyze: none of the 12 response token(s) of 3 "
                                       f"sample(s) is a loss token (loss_mask is 0 on every token); dump the trained "
                                       f"tokens with loss_mask 1")
    floor_only = write_jsonl(tmp_path / "f.jsonl", [{"train_log_probs": [-3.4e38], "rollout_log_probs": [-1.0],
                                                     "loss_mask": [1]}])
    assert refused(capsys, [floor_only]) == (
        f"{floor_only}: nothing to analyze: none of the 1 response token(s) of 1 sample(s) is a loss token with a "
        f"usable log-prob (1 loss token(s) hold a log-prob at the float floor (<= -1e+30, a stand-in for -inf; "
        f"first in "
        f"{floor_only}:1) and were skipped); dump the trained tokens with loss_mask 1")


# 5. the float32 floor SGLang writes for -inf (-3.4e38): before, kl = -1.7e38, k3_kl = 2.4e8 and a "severe"
#    recommendation from one sentinel; now the token is skipped, counted, and named in the report
def test_float_floor_log_probs_are_skipped_and_counted(tmp_path, capsys):
    floor = float(torch.finfo(torch.float32).min)
    recs = records(6)
    recs[2]["rollout_log_probs"][1] = floor
    recs[4]["train_log_probs"][3] = -3.4e38
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    masked = json.loads(json.dumps(recs))  # the same dump with those two tokens off the loss
    masked[2]["loss_mask"][1] = masked[4]["loss_mask"][3] = 0
    clean = report_json(capsys, [write_jsonl(tmp_path / "masked.jsonl", masked)])
    out = report_json(capsys, [path])
    d = out["dump"]
    assert (d["skipped_floor_tokens"], d["skipped_floor_samples"], d["first_floor_sample"]) == (2, 2, f"{path}:3")
    assert "skipped_floor_tokens" not in clean["dump"]  # a clean dump's report keeps its keys
    for key in ("k3_kl", "kl", "chi2_token", "train_rollout_logprob_abs_diff", "log_ppl_diff"):
        assert out[key] == clean[key], key
    assert out["recommended_preset"] == clean["recommended_preset"]
    assert any("2 loss token(s) in 2 sample(s) have a log-prob at the float floor" in w
               for w in out["recommendation"]["warnings"])
    assert cli(["analyze", path]) == 0
    text = capsys.readouterr().out
    assert (f"skipped 2 loss token(s) in 2 sample(s) whose log-prob is at the float floor (<= -1e30, a stand-in "
            f"for -inf; first in {path}:3): not in any number below") in text
    assert "nan" not in text.lower()
    # -1e4 is a real (catastrophic) ratio, not a sentinel: kept and vetoed
    recs[2]["rollout_log_probs"][1], recs[4]["train_log_probs"][3] = -0.5, -1e4
    big = report_json(capsys, [write_jsonl(tmp_path / "big.jsonl", recs)])
    assert "skipped_floor_tokens" not in big["dump"] and big["catastrophic_tokens"] == 1


# 6. a directory of .jsonl files not named step_*: before, "empty dump directory" (it is not empty)
def test_directory_without_step_files_names_the_jsonl_it_has(tmp_path, capsys):
    write_jsonl(tmp_path / "rollouts.jsonl", records(2))
    assert refused(capsys, [str(tmp_path)]) == (
        f"{tmp_path}: no step_*.jsonl file in the dump directory, but 1 other .jsonl file(s): rollouts.jsonl; pass "
        f"one file (slime-rc analyze {tmp_path / 'rollouts.jsonl'}) or name them step_NNNNNN.jsonl")


# 7. two runs' dumps in one directory: before, both step_000001.jsonl and step_000001.run2.jsonl (or step_1.jsonl)
#    were read as one step: every sample counted twice, silently
def test_two_runs_in_one_directory_are_refused(tmp_path, capsys):
    d = tmp_path / "dump"
    d.mkdir()
    write_jsonl(d / "step_000000.jsonl", records(2))
    write_jsonl(d / "step_000001.jsonl", records(2))
    write_jsonl(d / "step_000001.run2.jsonl", records(2))
    assert refused(capsys, [str(d)]) == (
        f"{d}: step 1 is in 2 files (step_000001.jsonl, step_000001.run2.jsonl): dumps of different runs mixed in one "
        f"directory? keep one run per directory, or analyze one file")
    os.remove(d / "step_000001.jsonl")  # tagged shards of one step (no plain step file) are still one dump
    write_jsonl(d / "step_000001.rank1.jsonl", records(2))
    assert report_json(capsys, [str(d)])["dump"]["samples"] == 6


# 8. samples recorded in different modes (two runs / configs mixed): before, the majority mode was taken silently
def test_mixed_modes_are_warned_about(tmp_path, capsys):
    d = tmp_path / "dump"
    d.mkdir()
    write_jsonl(d / "step_000000.jsonl", records(4, mode="bypass"))
    write_jsonl(d / "step_000001.jsonl", records(2, mode="decoupled"))
    out = report_json(capsys, [str(d)])
    assert out["dump"]["modes"] == {"bypass": 4, "decoupled": 2}
    assert ("the dump mixes samples recorded in 2 modes (bypass: 4, decoupled: 2): dumps of different runs or "
            "configurations together? the operating mode above follows the most frequent one (bypass); analyze each "
            "run's dump on its own") in out["recommendation"]["warnings"]


# 9. an unreadable step file in a directory: before, "DIR: Permission denied" named the directory, not the file
def test_unreadable_file_is_named(tmp_path, capsys, monkeypatch):
    d = tmp_path / "dump"
    d.mkdir()
    write_jsonl(d / "step_000000.jsonl", records(2))
    locked = str(write_jsonl(d / "step_000001.jsonl", records(2)))
    os.chmod(locked, 0)
    try:
        with open(locked, "rb"):
            readable = True  # root reads anything: simulate the permission error where the reader opens files
    except PermissionError:
        readable = False
    if readable:
        def fake_open(file, *args, **kwargs):
            if os.fspath(file) == locked:
                raise PermissionError(13, "Permission denied", locked)
            return open(file, *args, **kwargs)
        monkeypatch.setattr(dump_module, "open", fake_open, raising=False)
    try:
        assert refused(capsys, [str(d)]) == (f"{locked}: cannot read the dump file (Permission denied); check its "
                                             f"permissions (chmod +r {locked})")
    finally:
        os.chmod(locked, 0o644)


# 10. --plot into a missing directory / a directory / an unknown format / the dump itself: before, a matplotlib
#     traceback after the whole analysis (or, for a directory, a silent DIR.png and "wrote DIR")
@pytest.mark.parametrize("case", ["missing_dir", "directory", "format", "no_extension"])
def test_plot_path_is_checked_before_the_analysis(tmp_path, capsys, case):
    dump = write_jsonl(tmp_path / "d.jsonl", records(2))
    plot, expected = {
        "missing_dir": (tmp_path / "figs" / "m.png", f"directory {tmp_path / 'figs'} does not exist; create it first "
                                                     f"(mkdir -p {tmp_path / 'figs'})"),
        "directory": (tmp_path, None),
        "format": (tmp_path / "m.txt", "'.txt' is not an image format matplotlib writes; use .png, .pdf or .svg"),
        "no_extension": (tmp_path / "m",
                         f"has no file extension; name the image file, e.g. --plot {tmp_path / 'm'}.png"),
    }[case]
    msg = refused(capsys, [dump, "--plot", str(plot)])
    if case == "directory":
        assert msg == f"--plot {tmp_path} is a directory; give a file name, e.g. --plot {tmp_path / 'mismatch.png'}"
    else:
        assert msg.startswith(f"--plot {plot}") and expected in msg, msg
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]  # nothing written


# 11. an existing figure is replaced: before, "wrote FILE" whether or not a file was overwritten
def test_replacing_an_existing_plot_is_said(tmp_path, capsys):
    dump = write_jsonl(tmp_path / "d.jsonl", records(2))
    png = tmp_path / "m.png"
    png.write_bytes(b"old")
    assert cli(["analyze", dump, "--plot", str(png)]) == 0
    assert f"wrote {png} (replaced the existing file)" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"


# 12. the installed command end to end: one line on stderr, exit 2, no traceback
def test_command_line_prints_one_line_and_exits_2(tmp_path):
    path = tmp_path / "x.pt"
    torch.save([1, 2, 3], path)
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "analyze", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"{PREFIX}{path}: not a JSONL dump but a zip archive") and \
        proc.stderr.count("\n") == 1, proc.stderr
