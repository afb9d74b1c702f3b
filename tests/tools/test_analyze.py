"""The log-prob dump (slime_rc.tools.dump) and `slime-rc analyze` (slime_rc.tools.analyze): round trip, refusals naming
file:line, the report equal to the engine on the whole dump, chunked == unchunked, the recommendation per scenario,
and the CLI (--json, --plot, --step)."""

import dataclasses
import json
import math
import os
import sys

import pytest
import torch

from slime_rc import METRICS, PRESETS, RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths
from slime_rc.tools.analyze import analysis_config, analyze, merge_rule, report_json
from slime_rc.tools.analyze import guide as R
from slime_rc.cli import main as cli
from slime_rc.tools.dump import DumpWriter, iter_samples, sample_record

from tests.checks import raises_mentioning

torch.set_num_threads(1)


# ---- synthetic dumps -------------------------------------------------------------------------------------------
def make_records(n, lengths, noise, *, seed=0, steps=1, catastrophic=0, mode=None, edge_cases=False):
    """``n`` samples with ``lengths = (lo, hi)`` response tokens.  Train log-probs: 85% confident tokens
    (-log p ~ Exp(mean 0.1)), 15% low-probability ones (~ Exp(mean 5)); rollout = train + noise whose scale grows
    with -log p (mismatch concentrates on low-probability tokens), clamped to <= 0.  ``catastrophic`` tokens get
    ratio e^-13.  ``edge_cases``: a fully masked sample, an empty one and a null on a masked token."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        T = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        low = torch.rand(T, generator=g) < 0.15
        depth = torch.where(low, torch.empty(T).exponential_(1 / 5.0, generator=g),
                            torch.empty(T).exponential_(1 / 0.1, generator=g))
        train = -depth
        rollout = (train + noise * (depth / 3).clamp(max=3) * torch.randn(T, generator=g)).clamp(max=0.0)
        mask = torch.ones(T)
        if T > 8 and i % 3 == 0:
            mask[T // 2:T // 2 + 3] = 0  # a tool response inside the sample
        samples.append([train, rollout, mask])
    for j in range(catastrophic):
        train, rollout, mask = samples[(7 * j + 1) % n]
        k = (5 * j) % train.numel()
        train[k], rollout[k], mask[k] = -14.0, -1.0, 1.0
    if edge_cases:
        samples[2][2] = torch.zeros_like(samples[2][2])  # every token masked
        samples[4] = [torch.zeros(0), torch.zeros(0), torch.zeros(0)]  # no response token
    records = []
    for i, (train, rollout, mask) in enumerate(samples):
        extra = dict(step=i % steps, sample=i, reward=float(i % 2), advantage=0.5 - (i % 2))
        if mode:
            extra["mode"] = mode
        records.append(sample_record(train, rollout, mask, **extra))
    if edge_cases:
        records[0]["rollout_log_probs"][records[0]["loss_mask"].index(0)] = None
    return records


def write_dump(directory, records, steps=1):
    w = DumpWriter(directory)
    for s in range(steps):
        w.write_step(s, [r for r in records if r["step"] == s])
    return str(directory)


SCENARIOS = {  # name -> (n, lengths, noise, extra kwargs)
    "negligible": (40, (20, 60), 0.003, {}),
    "short_moderate": (60, (10, 40), 0.15, dict(edge_cases=True)),
    "short_severe": (60, (10, 40), 1.0, {}),
    "long_moderate": (8, (1500, 2500), 0.15, {}),
    "long_mild": (6, (1100, 1400), 0.02, {}),
    "catastrophic": (60, (10, 40), 0.15, dict(catastrophic=2)),
    "bypass": (60, (10, 40), 0.15, dict(mode="bypass")),
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    out = {}
    for name, (n, lengths, noise, kw) in SCENARIOS.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = write_dump(d, make_records(n, lengths, noise, seed=len(name), steps=2, **kw), steps=2)
    return out


def engine_on_whole_dump(path, config):
    samples = list(iter_samples(path))
    cu = cu_seqlens_from_lengths([len(s) for s in samples])
    train, rollout, mask = (torch.cat([getattr(s, key) for s in samples])
                            for key in ("train_log_probs", "rollout_log_probs", "loss_mask"))
    return compute_rollout_correction(train, rollout, mask, cu, config)


def close(a, b, rel=1e-9, abs_=1e-13):
    return abs(a - b) <= rel * max(abs(a), abs(b)) + abs_


# ---- the dump format ---------------------------------------------------------------------------------------------
def test_round_trip_is_bit_exact_and_atomic(tmp_path):
    g = torch.Generator().manual_seed(1)
    train = -torch.rand(7, generator=g) * 5  # arbitrary float32 values: repr must round-trip them exactly
    rollout = (train - torch.rand(7, generator=g) * 1e-3).bfloat16()
    mask = torch.tensor([True, True, False, True, True, True, False])
    rec = sample_record(train, rollout, mask, step=3, sample=torch.tensor(9), reward=torch.tensor(0.25),
                        turn_ids=torch.tensor([0, 0, 1, 1, 1, 2, 2]), response_length=7, mode="bypass")
    assert rec["sample"] == 9 and rec["reward"] == 0.25 and rec["loss_mask"] == [1, 1, 0, 1, 1, 1, 0]
    path = DumpWriter(tmp_path / "d").write_step(3, [rec, rec])
    assert os.path.basename(path) == "step_000003.jsonl"
    assert sorted(os.listdir(tmp_path / "d")) == ["step_000003.jsonl"]  # no temporary file left behind
    with open(path, "a") as f:
        f.write("\n   \n")  # blank lines are skipped
    got = list(iter_samples(tmp_path / "d"))
    assert len(got) == 2 and [s.line for s in got] == [1, 2] and got[1].where == f"{path}:2"
    s = got[0]
    assert s.train_log_probs.dtype == torch.float32 and s.loss_mask.dtype == torch.bool
    assert torch.equal(s.train_log_probs, train) and torch.equal(s.rollout_log_probs, rollout.float())
    assert torch.equal(s.loss_mask, mask) and s.turn_ids.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert s.step == 3 and s.extra["mode"] == "bypass" and s.extra["response_length"] == 7 and len(s) == 7
    assert list(iter_samples(path))[0].step == 3  # a single file: the record's step key


def test_writer_writes_strict_json_with_null_for_nonfinite(tmp_path):
    rec = sample_record(torch.tensor([-1.0, float("nan")]), [-1.0, -float("inf")], [1, 0], reward=float("nan"))
    path = DumpWriter(tmp_path).write_step(0, [rec, {**rec, "extra": torch.tensor([1.5])}])
    with open(path) as f:
        rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}")) for line in f]
    assert rows[0]["train_log_probs"] == [-1.0, None] and rows[0]["rollout_log_probs"] == [-1.0, None]
    assert rows[0]["reward"] is None and rows[1]["extra"] == [1.5]
    raises_mentioning(lambda: sample_record([-1.0, -2.0], [-1.0], [1, 1]), "differ in length")
    raises_mentioning(lambda: sample_record([-1.0], [-1.0], [2]), "0 and 1")
    raises_mentioning(lambda: DumpWriter(tmp_path).write_step(1, [{"loss_mask": []}]), "lacks", "train_log_probs")
    assert not os.path.exists(os.path.join(tmp_path, "step_000001.jsonl"))
    assert sorted(os.listdir(tmp_path)) == ["step_000000.jsonl"]  # the failed step left no temporary file


GOOD = '{"train_log_probs": [-0.5, -1.0, -2.0], "rollout_log_probs": [-0.4, -1.1, -2.0], "loss_mask": [1, 1, 0]}'
BAD_LINES = {  # name -> (line 2 of the file, substrings the message must hold besides file:2)
    "not_json": ('{"train_log_probs": [-0.5,', ["not JSON"]),
    "not_object": ("[1, 2]", ["JSON object"]),
    "missing_key": ('{"train_log_probs": [-0.5], "loss_mask": [1]}', ["missing key 'rollout_log_probs'"]),
    "null_on_loss_token": (GOOD.replace("-1.1", "null"), ["'rollout_log_probs'[1]", "null", "token 1"]),
    "nan_on_loss_token": (GOOD.replace("-1.0,", "NaN,"), ["'train_log_probs'[1]", "nan", "token 1"]),
    "inf_on_loss_token": (GOOD.replace("-0.4", "-Infinity"), ["'rollout_log_probs'[0]", "inf"]),
    "beyond_float32": (GOOD.replace("-0.4", "-1e300"), ["'rollout_log_probs'[0]", "-1e+300 (beyond float32)"]),
    "length_mismatch": (GOOD.replace("-0.4, ", ""), ["lengths differ", "'rollout_log_probs' has 2", "3"]),
    "mask_not_binary": (GOOD.replace("[1, 1, 0]", "[1, 2, 0]"), ["'loss_mask'[1]", "not 0 or 1"]),
    "positive_log_prob": (GOOD.replace("-2.0]", "0.5]", 1), ["'train_log_probs'[2]", "positive log-prob"]),
    "not_a_number": (GOOD.replace("-1.1", '"x"'), ["'rollout_log_probs'[1]", "not a number"]),
    "response_length": (GOOD[:-1] + ', "response_length": 5}', ["'response_length' = 5", "3 tokens"]),
    "turn_ids_length": (GOOD[:-1] + ', "turn_ids": [0, 1]}', ["'turn_ids' has 2"]),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_input_is_refused_with_file_and_line(tmp_path, capsys, case):
    line, expected = BAD_LINES[case]
    path = tmp_path / "d.jsonl"
    path.write_text(GOOD + "\n" + line + "\n" + GOOD + "\n")
    raises_mentioning(lambda: list(iter_samples(path)), f"{path}:2: ", *expected)
    capsys.readouterr()
    assert cli(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slime-rc analyze: error: {path}:2: ") and all(s in err for s in expected), err


def test_reading_streams_and_masked_nonfinite_values_are_ignored(tmp_path):
    path = tmp_path / "d.jsonl"
    masked_null = GOOD.replace("-2.0]", "null]", 2)  # both log-probs null on the masked third token
    path.write_text(GOOD + "\n" + masked_null + "\n" + "oops\n")
    it = iter_samples(path)
    assert len(next(it)) == 3 and torch.isnan(next(it).rollout_log_probs[2])  # yielded before line 3 is read
    raises_mentioning(lambda: next(it), f"{path}:3: not JSON")


def test_empty_and_missing_dumps_are_refused(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    raises_mentioning(lambda: list(iter_samples(tmp_path / "empty.jsonl")), "empty.jsonl: empty dump file")
    (tmp_path / "d").mkdir()
    raises_mentioning(lambda: list(iter_samples(tmp_path / "d")), "empty dump directory")
    (tmp_path / "d" / "step_000000.jsonl").write_text("")
    raises_mentioning(lambda: list(iter_samples(tmp_path / "d")), "holds no records")
    (tmp_path / "d" / "step_000001.jsonl").write_text(GOOD + "\n")
    assert [s.step for s in iter_samples(tmp_path / "d")] == [1]  # an empty step among others is fine
    raises_mentioning(lambda: iter_samples(tmp_path / "nope"), "no such file or directory")
    assert cli(["analyze", str(tmp_path / "nope")]) == 2
    assert "slime-rc analyze: error:" in capsys.readouterr().err


# ---- the report equals the engine ------------------------------------------------------------------------------
def test_merge_rules_cover_every_metric_the_engine_returns():
    """A new engine metric without a merge rule would silently vanish from the report: fail here instead."""
    from slime_rc import parse_rejection_criteria
    lp = -torch.rand(40, generator=torch.Generator().manual_seed(0))
    everything = RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_batch_normalize=True,
                                         rs=parse_rejection_criteria("token,seq_max_k3,geometric", "2.0,0.5,1.1"),
                                         veto_threshold=1e-4, on_nonfinite="reject")
    unmerged = set()
    for cfg in [analysis_config(), everything] + [RolloutCorrectionConfig.preset(n) for n in PRESETS]:
        names = compute_rollout_correction(lp, lp * 1.1, torch.ones(40), torch.tensor([0, 15, 40]), cfg).metrics
        unmerged |= {n for n in names if merge_rule(n) is None}
    # a per-batch division (no preset normalizes), and verl's rollout_rs_<option>_std: the spread of the statistic
    # clamped into the band, whose clamped mean no metric reports
    rs_std = {n for n in unmerged if n.startswith("rollout_rs_") and n.endswith("_std") and not n.endswith("_seq_std")}
    assert rs_std and unmerged == {"rollout_is_batch_norm_factor"} | rs_std


@pytest.mark.parametrize("scenario", ["short_moderate", "catastrophic", "long_moderate"])
def test_report_equals_the_engine_on_the_whole_dump(dumps, scenario):
    report = analyze(dumps[scenario], chunk_tokens=97)  # several chunks
    assert report["dump"]["chunks"] > 1
    base = engine_on_whole_dump(dumps[scenario], analysis_config())
    for name, value in base.metrics.items():  # every metric of the analysis configuration, quantiles included
        assert close(report[name], float(value)), (name, report[name], float(value))
    assert {n for n, (when, _) in METRICS.items() if when == "always"} <= set(report)
    assert report["quantiles"]["p99"] == float(base.metrics["rollout_is_p99"])
    assert report["ess"] == report["rollout_is_eff_sample_size"]
    for name, row in report["presets"].items():
        out = engine_on_whole_dump(dumps[scenario], RolloutCorrectionConfig.preset(name))
        m = {k: float(v) for k, v in out.metrics.items()}
        assert close(row["rejected_token_fraction"], m["rejected_token_fraction"]), name
        assert close(row["rejected_seq_fraction"], m["rejected_seq_fraction"]), name
        assert (row["ess"] is None) == ("rollout_is_eff_sample_size" not in m), name
        if row["ess"] is not None:
            assert close(row["ess"], m["rollout_is_eff_sample_size"]), name
        for k, v in row["metrics"].items():
            assert close(v, m[k]), (name, k, v, m[k])


def test_chunked_equals_unchunked_for_every_reported_number(dumps):
    path = dumps["short_moderate"]  # with a fully masked sample, an empty one and a masked null
    whole = report_json(analyze(path))
    tiny = report_json(analyze(path, chunk_tokens=1))  # one sample per chunk
    assert whole["dump"]["chunks"] == 1 and whole["dump"]["samples"] == 60
    assert tiny["dump"]["chunks"] == 59  # one sample per chunk; the empty sample rides with the next one

    def compare(a, b, where):
        if isinstance(a, dict):
            assert set(a) == set(b), where
            for k in a:
                if (where, k) != ("dump", "chunks"):
                    compare(a[k], b[k], f"{where}.{k}" if where else k)
        elif isinstance(a, list):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b)):
                compare(x, y, f"{where}[{i}]")
        elif isinstance(a, float):
            assert close(a, b), (where, a, b)
        else:
            assert a == b, (where, a, b)
    compare(whole, tiny, "")


def test_breakdowns_add_up_to_the_engine_metrics(dumps):
    r = analyze(dumps["short_moderate"])
    d = r["dump"]
    rows, lens = r["by_probability"], r["by_length"]
    assert sum(x["tokens"] for x in rows) == sum(x["tokens"] for x in lens) == d["valid_tokens"]
    assert sum(x["samples"] for x in lens) == d["valid_samples"] == 58  # the masked and the empty sample
    for key in ("kl", "k3_kl"):
        assert close(sum(x[key] * x["tokens"] for x in rows) / d["valid_tokens"], r[key]), key
        assert close(sum(x[key] * x["tokens"] for x in lens) / d["valid_tokens"], r[key]), key
    assert close(sum((x["chi2_seq"] + 1) * x["samples"] for x in lens) / d["valid_samples"] - 1, r["chi2_seq"])
    assert close(sum(x["mean_abs_log_ratio"] * x["tokens"] for x in rows) / d["valid_tokens"],
                 r["train_rollout_logprob_abs_diff"])
    assert rows[0]["bucket"] == "p < 0.001" and rows[-1]["bucket"] == "p >= 0.9"
    assert rows[0]["k3_kl"] > 100 * rows[-1]["k3_kl"]  # the synthetic noise sits on low-probability tokens
    assert any("low-probability tokens" in n for n in r["recommendation"]["notes"])


# ---- the recommendation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario,preset,severity,length,cited", [
    ("negligible", "bypass_ppo_clip", "negligible", None, f"per token is below {R.NEGLIGIBLE_K3:g}"),
    ("short_moderate", "decoupled_seq_is", "moderate", "short", f"is below {R.LONG_SEQ_TOKENS} tokens"),
    # Seq-MIS / Geo-RS are the guide's choices there, but they reject more than MAX_REJECTED_FRACTION: their safer twin
    ("short_severe", "decoupled_seq_is", "severe", "short", f"per token is at or above {R.SEVERE_K3:g}"),
    ("long_moderate", "decoupled_token_is", "moderate", "long", f"is at or above {R.LONG_SEQ_TOKENS} tokens"),
    ("long_mild", "decoupled_geo_rs_seq_tis", "moderate", "long", f"is at or above {R.LONG_SEQ_TOKENS} tokens"),
    ("bypass", "bypass_pg_is", "moderate", "short", "recorded in bypass mode"),
])
def test_recommendation_follows_the_decision_guide(dumps, capsys, scenario, preset, severity, length, cited):
    r = analyze(dumps[scenario])
    rec = r["recommendation"]
    assert (r["recommended_preset"], rec["severity"], rec["length_regime"]) == (preset, severity, length), \
        (r["k3_kl"], r["chi2_token"], r["chi2_seq"], r["dump"]["mean_length"], r["reasons"])
    assert any(cited in reason for reason in r["reasons"]), r["reasons"]
    assert any(f"k3_kl = {r['k3_kl']:.3g}" in reason for reason in r["reasons"])  # the number that decided
    assert "--rs-veto-threshold" not in rec["flags"] and any("no veto needed" in x for x in r["reasons"])
    assert cli(["config", *rec["flags"].split()]) == 0  # the suggested flags resolve to a valid configuration
    capsys.readouterr()
    if scenario == "negligible":
        assert r["k3_kl"] < R.NEGLIGIBLE_K3 and r["presets"][preset]["rejected_token_fraction"] == 0.0
    if scenario == "short_severe":
        assert r["k3_kl"] >= R.SEVERE_K3 and any("beyond a numerical precision gap" in w for w in rec["warnings"])
    if scenario == "long_moderate":
        assert r["chi2_seq"] >= R.SEQ_COLLAPSE_CHI2 and r["dump"]["mean_length"] >= R.LONG_SEQ_TOKENS


def test_catastrophic_tokens_bring_the_veto(dumps):
    r = analyze(dumps["catastrophic"])
    rec = r["recommendation"]
    assert r["rollout_is_catastrophic_token_fraction"] > 0 and r["rollout_is_min"] < 1e-4
    n_cat = round(r["rollout_is_catastrophic_token_fraction"] * r["dump"]["valid_tokens"])
    assert r["catastrophic_tokens"] == n_cat == 2
    # two tokens with r = e^-13 alone push k3_kl past SEVERE_K3; the estimator is chosen on the rest
    assert r["k3_kl"] >= R.SEVERE_K3 > r["k3_kl_excluding_catastrophic"] >= R.NEGLIGIBLE_K3
    assert (r["recommended_preset"], rec["severity"]) == ("decoupled_seq_is", "moderate"), r["reasons"]
    assert rec["flags"] == f"--rollout-correction-preset {r['recommended_preset']} --rs-veto-threshold 0.0001"
    veto = [x for x in r["reasons"] if x.startswith("veto:")]
    assert len(veto) == 1 and "2 catastrophic token(s)" in veto[0], r["reasons"]
    # the numbers quoted for the choice are the engine's, with the veto on
    row = r["veto_variants"][r["recommended_preset"]]
    cfg = dataclasses.replace(RolloutCorrectionConfig.preset(r["recommended_preset"]), veto_threshold=1e-4)
    out = engine_on_whole_dump(dumps["catastrophic"], cfg)
    assert close(row["rejected_seq_fraction"], float(out.metrics["rejected_seq_fraction"]))
    assert row["rejected_seq_fraction"] == pytest.approx(2 / 60)
    assert f"{100 * row['rejected_seq_fraction']:.3g}% of samples" in r["reasons"][-1]


def floor_records(n=120, seed=0):
    """The collapse study's mismatch (docs/results.md): an engine that keeps a probability floor, q = 0.968 p + 0.002.
    Short samples of confident tokens (their ratio p/q ~ 1.03: no sequence ratio reaches 2) and, in a fifth of the
    samples, one token the engine drew from the floor although the trainer gives it p = 1e-6 (ratio 5e-4) or
    1e-8 (ratio 5e-6: catastrophic)."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        T = int(torch.randint(6, 9, (1,), generator=g))
        p = 1.0 - 0.05 * torch.rand(T, generator=g, dtype=torch.float64)
        if i % 5 == 0:
            p[T // 2] = 1e-6 if i % 10 == 0 else 1e-8
        q = 0.968 * p + 0.002
        records.append(sample_record(p.log().float(), q.log().float(), torch.ones(T), step=i % 2, sample=i,
                                     reward=0.0, advantage=0.0))
    return records


def test_severe_mismatch_without_a_high_weight_tail_gets_seq_tis_without_veto(tmp_path, dumps):
    """Severe, short, but nothing above the upper bound: Seq-MIS would only reject the low side, samples Seq-TIS
    already weighs ~0 (the collapse study's floor dump: Seq-TIS stable in 5/5 seeds, Seq-MIS collapsed in 3/5);
    the veto, dropping 10% of the samples that sequence IS already suppresses, is left out too.  A dump whose tail
    is high-weight keeps Seq-MIS, and a veto dropping few samples stays."""
    r = analyze(write_dump(tmp_path, floor_records(), steps=2))
    rec = r["recommendation"]
    tis, mis = r["presets"]["decoupled_seq_is"], r["presets"]["decoupled_seq_is_rs"]
    assert rec["severity"] == "severe" and rec["length_regime"] == "short", r["reasons"]
    assert tis["metrics"]["rollout_is_seq_fraction_high"] < R.SEQ_MIS_HIGH_FRACTION
    assert mis["rejected_seq_fraction"] == pytest.approx(0.2)  # Seq-MIS rejects the floor samples ...
    share = R.weight_share_removed(tis, mis)
    assert 0 < share < R.SEQ_MIS_WEIGHT_SHARE  # ... which carry almost none of Seq-TIS's weight
    assert (r["recommended_preset"], rec["flags"]) == ("decoupled_seq_is", "--rollout-correction-preset decoupled_seq_is")
    assert any(r_.startswith("Seq-TIS (decoupled_seq_is), not Seq-MIS") and f"{share:.3g}" in r_ for r_ in r["reasons"])
    veto_frac = r["rollout_is_veto_fraction"]
    assert veto_frac == pytest.approx(0.1) and veto_frac > R.MAX_VETO_SEQ_FRACTION
    vetoed = r["veto_variants"]["decoupled_seq_is"]
    assert R.weight_share_removed(tis, vetoed) < R.VETO_WEIGHT_SHARE
    assert any(r_.startswith("no veto:") for r_ in r["reasons"]) and not any(r_.startswith("veto:") for r_ in r["reasons"])
    assert any("investigate the engine" in w for w in rec["warnings"])
    # the rule's inputs are the engine's: Seq-TIS's weight mass with and without Seq-MIS's rejections
    cfg = RolloutCorrectionConfig.preset("decoupled_seq_is")
    out = engine_on_whole_dump(write_dump(tmp_path / "again", floor_records(), steps=2), cfg)
    assert close(tis["metrics"]["rollout_is_mean"], float(out.metrics["rollout_is_mean"]), rel=1e-6)
    # a high-weight tail makes Seq-MIS the guide's choice (here it then rejects too much: Seq-TIS, said why); a veto
    # that drops few samples stays on a sequence-IS choice
    severe = analyze(dumps["short_severe"])
    assert any(r_.startswith("Seq-MIS (decoupled_seq_is_rs)") for r_ in severe["reasons"]), severe["reasons"]
    assert any(r_.startswith("decoupled_seq_is rather than decoupled_seq_is_rs") for r_ in severe["reasons"])
    assert severe["presets"]["decoupled_seq_is"]["metrics"]["rollout_is_seq_fraction_high"] >= R.SEQ_MIS_HIGH_FRACTION
    few = analyze(dumps["catastrophic"])
    assert few["rollout_is_veto_fraction"] <= R.MAX_VETO_SEQ_FRACTION and "--rs-veto-threshold" in few["recommendation"]["flags"]


def test_tight_geometric_band_is_flagged_with_a_band_the_engine_confirms(dumps):
    """Long samples with moderate mismatch: the default geometric band [0.999, 1.001] of Geo-RS rejects most samples,
    so Geo-RS is not recommended; the reason's suggested band for it, run through the launch-flag resolution and the
    engine, keeps >= 95% of them."""
    import argparse

    from slime_rc import add_rollout_correction_arguments, config_from_args
    r = analyze(dumps["long_moderate"])
    assert r["presets"]["decoupled_geo_rs"]["rejected_seq_fraction"] > R.MAX_REJECTED_FRACTION
    lo, hi = r["geometric_band_95"]
    flag = f"--rs-upper-bound {lo}_{hi}"
    skipped = [x for x in r["reasons"] if "rather than decoupled_geo_rs:" in x]
    assert lo < 1 < hi and len(skipped) == 1 and flag in skipped[0], r["reasons"]
    args = add_rollout_correction_arguments(argparse.ArgumentParser()).parse_args(
        "--rollout-correction-preset decoupled_geo_rs".split() + flag.split())
    out = engine_on_whole_dump(dumps["long_moderate"], config_from_args(args))
    assert float(out.metrics["rejected_seq_fraction"]) <= 0.05


GUIDE_CHOICE = {"short_severe": "decoupled_seq_is_rs", "long_moderate": "decoupled_geo_rs"}  # before the rejection check


@pytest.mark.parametrize("scenario", sorted(GUIDE_CHOICE))
def test_a_preset_rejecting_more_than_the_shared_level_is_never_recommended(dumps, scenario):
    """The guide's first choice rejects more than MAX_REJECTED_FRACTION of the dump: the recommendation is a preset the
    engine says rejects less, a reason says why in numbers, and no warning then warns about its rejection."""
    from slime_rc.tools.analyze.thresholds import MAX_REJECTED_FRACTION
    r = analyze(dumps[scenario])
    rec, first = r["recommendation"], r["presets"][GUIDE_CHOICE[scenario]]
    assert max(first["rejected_token_fraction"], first["rejected_seq_fraction"]) > MAX_REJECTED_FRACTION
    chosen = r["presets"][r["recommended_preset"]]
    assert "--rs-veto-threshold" not in rec["flags"]  # so the row is the recommendation's own numbers
    assert chosen["rejected_token_fraction"] <= MAX_REJECTED_FRACTION
    assert chosen["rejected_seq_fraction"] <= MAX_REJECTED_FRACTION
    why = [x for x in r["reasons"] if f"rather than {GUIDE_CHOICE[scenario]}:" in x]
    assert len(why) == 1, r["reasons"]
    assert f"{100 * first['rejected_seq_fraction']:.3g}% of samples" in why[0]
    assert f"above {100 * MAX_REJECTED_FRACTION:g}%" in why[0]
    assert not any(f"above {100 * MAX_REJECTED_FRACTION:g}%" in w for w in rec["warnings"]), rec["warnings"]


def test_no_report_line_names_a_constant(dumps, tmp_path):
    """Reasons, warnings and notes are sentences with numbers: no UPPER_CASE identifier (the guide's thresholds, the
    shared rejection level) in any line of the text report, whatever the scenario."""
    import re

    from slime_rc.tools.analyze import accumulate, format_report, thresholds
    names = {k for module in (R, thresholds, accumulate) for k in vars(module) if k.isupper() and "_" in k}
    assert "SEVERE_K3" in names and "MAX_REJECTED_FRACTION" in names
    paths = list(dumps.values()) + [write_dump(tmp_path, floor_records(), steps=2)]  # the no-veto reason too
    for path in paths:
        for line in format_report(analyze(path)).splitlines():
            assert not re.search(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", line), line
            assert not any(n in line for n in names), line


# ---- the command -------------------------------------------------------------------------------------------------
def test_cli_json_text_and_step_filter(dumps, capsys):
    path = dumps["short_moderate"]
    assert cli(["analyze", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("recommended_preset", "reasons", "presets", "by_length", "by_probability", "quantiles", "kl",
                "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "rollout_is_eff_sample_size", "ess"):
        assert key in out, key
    assert set(out["presets"]) == set(PRESETS) and set(out["quantiles"]) == {"p25", "p50", "p75", "p95", "p99"}
    assert out["dump"]["samples"] == 60 and out["dump"]["steps"] == [0, 1]

    assert cli(["analyze", path]) == 0
    text = capsys.readouterr().out
    for s in ("Mismatch", "k3_kl", "By sample length", "By rollout token probability", "Presets on this dump",
              f"Recommended: {out['recommended_preset']}", "--rollout-correction-preset"):
        assert s in text, s

    assert cli(["analyze", path, "--json", "--step", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["dump"]["steps"] == [1] and one["dump"]["samples"] == 30 and one["dump"]["files"] == 1
    assert cli(["analyze", path, "--step", "7"]) == 2
    assert "no step file for step(s) [7]; the dump has steps 0-1" in capsys.readouterr().err
    single = os.path.join(path, "step_000001.jsonl")
    raises_mentioning(lambda: analyze(single, steps=[0]), "no sample of step(s) [0]", "1")
    assert cli(["analyze", path, "--chunk-tokens", "0"]) == 2
    assert cli(["analyze"]) == 2  # argparse: DUMP is required
    capsys.readouterr()


def test_plot_writes_a_png(dumps, tmp_path, capsys):
    png = tmp_path / "mismatch.png"
    assert cli(["analyze", dumps["catastrophic"], "--plot", str(png)]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_clear_error(dumps, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli(["analyze", dumps["negligible"], "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.png")


def test_nonfinite_json_is_never_printed(dumps, capsys):
    """A whole-dump report holds no NaN/inf (strict JSON); math.isfinite on every number."""
    assert cli(["analyze", dumps["short_severe"], "--json"]) == 0
    numbers = []
    json.loads(capsys.readouterr().out, parse_float=lambda s: numbers.append(float(s)) or float(s))
    assert numbers and all(math.isfinite(x) for x in numbers)


def test_docs_state_every_threshold_and_option():
    """docs/analyze.md lists each threshold of the guide with its value, and each option of the command."""
    from slime_rc.tools.analyze import build_parser
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "analyze.md")) as f:
        text = f.read()
    constants = {k: v for k, v in vars(R).items() if k.isupper() and isinstance(v, (int, float))}
    assert len(constants) >= 12
    for name, value in constants.items():
        assert f"| `{name}` | {value:g} |" in text, name
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in ("-h", "--help") or f"| `{flag}` |" in text, flag
    assert "| `DUMP` |" in text
