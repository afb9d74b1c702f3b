"""The GRPO loop of ``slime-rc train`` (``slime_rc.demo.train.loop``): same seed and global batch give the same per-step
metrics in every parallel layout (1 process, TP2xPP2, CP2xDP2), in decoupled and bypass mode; metrics-only
monitoring, ``decoupled_metrics`` and ``dump_logprobs`` leave the training bit-identical; a TIS function written to
slime's contract (``tests/slime_like_tis.py``, like slime's example ``mis.py``) trains the same at CP=1, 2 and 4
with slime's reduction of its metrics."""

from __future__ import annotations

import pytest

from tests.dist_utils import run_distributed

STEPS = 3
LAYOUTS = {"single": (1, dict()), "tp2_pp2": (4, dict(tp=2, pp=2)), "cp2_dp2": (4, dict(cp=2))}
MODES = ("decoupled", "bypass")
# --custom-tis-function-path runs: a function written like slime's example, at CP=1, 2 (with DP2) and 4
SLIME_FN = "tests.slime_like_tis.compute_weights_with_cp"
TIS_LAYOUTS = {"single": (1, dict()), "cp2_dp2": (4, dict(cp=2)), "cp4": (4, dict(cp=4))}


def _config(mode):
    from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria
    if mode == "decoupled":
        return RolloutCorrectionConfig(is_level="token", is_batch_normalize=True,
                                       rs=parse_rejection_criteria("token", 1.05))
    return RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence",
                                   rs=parse_rejection_criteria("geometric", "0.8_1.25"))


MONITOR_RUNS = {  # name -> (config fields, TrainSettings fields); dump_logprobs is filled in by the worker
    "standard": (dict(), dict()),
    "standard_watched": (dict(get_mismatch_metrics=True), dict()),
    "bypass": (dict(mode="bypass"), dict()),
    "bypass_watched": (dict(mode="bypass", get_mismatch_metrics=True), dict()),
    "bypass_decoupled_dump": (dict(mode="bypass", get_mismatch_metrics=True),
                              dict(decoupled_metrics=True, dump_logprobs=True)),
}


def _tis_config():
    from slime_rc import RolloutCorrectionConfig, parse_rejection_criteria
    return RolloutCorrectionConfig(is_level="token", is_upper_bound=1.5, rs=parse_rejection_criteria("token", "0.7_1.4"))


def _caller_args():
    """The caller's args as a launch line leaves them: slime's keys None (not given), plus an attribute of its own."""
    import argparse
    return argparse.Namespace(tis_upper_bound=None, tis_lower_bound=None, use_tis=None, rs_upper_bound=None,
                              mine="kept")


def worker(rank, world, names, dump_dir=None, tis_names=()):
    import os

    import torch
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    import slime_rc.demo.train.loop as loop
    from slime_rc import RolloutCorrectionConfig
    from slime_rc.demo.train.loop import TrainSettings, run_training
    out = {}
    for name in names:
        for mode in MODES:
            # fp32 rollouts: after a step the layouts' weights differ by ~1e-7 (fp32 reduction order), which bf16
            # rounding in the rollout engine would turn into 1e-3 log-prob differences; the noise knob is seeded
            settings = TrainSettings(num_steps=STEPS, prompts_per_step=16, group_size=4, logit_noise=0.3,
                                     rollout_dtype="fp32", **LAYOUTS[name][1])
            out[(name, mode)] = run_training(settings, _config(mode))
    for name in tis_names:
        from slime_rc.plugins import load_function
        settings = TrainSettings(num_steps=STEPS, prompts_per_step=16, group_size=4, logit_noise=0.3,
                                 rollout_dtype="fp32", **TIS_LAYOUTS[name][1])
        args = _caller_args()
        hist = run_training(settings, _tis_config(), tis_function=load_function(SLIME_FN), tis_args=args)
        out[("tis", name)] = (hist, vars(args))
    if dump_dir is not None:  # metrics-only monitoring: count the forward-only passes the loop makes
        real, calls = loop.self_log_probs, []
        loop.self_log_probs = lambda *a, **k: calls.append(1) or real(*a, **k)
        for name, (cfg, extra) in MONITOR_RUNS.items():
            extra = dict(extra, dump_logprobs=dump_dir) if extra.get("dump_logprobs") else extra
            settings = TrainSettings(num_steps=STEPS, prompts_per_step=16, group_size=4, logit_noise=0.3,
                                     rollout_dtype="fp32", **extra)
            calls.clear()
            out[("monitor", name)] = (run_training(settings, RolloutCorrectionConfig(**cfg)), len(calls))
        loop.self_log_probs = real
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    dump_dir = str(tmp_path_factory.mktemp("dump"))
    out["dump_dir"] = dump_dir
    for world in (1, 4):
        names = [n for n, (w, _) in LAYOUTS.items() if w == world]
        tis_names = [n for n, (w, _) in TIS_LAYOUTS.items() if w == world]
        per_rank = run_distributed(worker, world, args=(names, dump_dir if world == 1 else None, tis_names),
                                   timeout=420)
        for key, hist in per_rank[0].items():
            out[key] = hist
            if key[0] == "tis":
                hist = hist[0]
            for r in per_rank[1:]:
                other = r[key][0] if key[0] == "tis" else r[key]
                assert other == hist or all(abs(a[k] - b[k]) <= 1e-9 * max(1, abs(b[k]))
                                            for a, b in zip(other, hist) for k in b if not k.startswith("time/"))
    return out


def test_the_run_corrects_and_rejects(runs):
    for mode in MODES:
        hist = runs[("single", mode)]
        assert len(hist) == STEPS
        m = hist[0]
        assert m["rollout_corr/kl"] > 1e-4, m  # the noisy rollout engine creates a mismatch
        assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1, m
        assert any(h["grad_norm"] > 0 and abs(h["loss"]) > 0 for h in hist), hist  # a learning signal
        assert 0 < m["kept_fraction"] < 1, m  # rejected samples are out of the group baselines (both modes)


def test_metrics_only_monitoring_changes_nothing_and_bypass_adds_no_forward_pass(runs):
    """--get-mismatch-metrics: the same per-step loss, grad norm and rewards bit for bit (so the same weights and
    samples), with the mismatch metrics logged; bypass mode gets them from the loss's own pi_theta (no forward-only
    pass), standard mode from the pi_old it recomputes anyway."""
    for plain, watched in (("standard", "standard_watched"), ("bypass", "bypass_watched"),
                           ("bypass", "bypass_decoupled_dump")):
        (a, _), (b, _) = runs[("monitor", plain)], runs[("monitor", watched)]
        for step, (x, y) in enumerate(zip(a, b)):
            for k in ("loss", "grad_norm", "reward_mean", "kept_fraction"):
                assert x[k] == y[k], (plain, watched, step, k, x[k], y[k])
        assert not any(k.startswith("rollout_corr") for k in a[0]), sorted(a[0])
        assert b[0]["rollout_corr/k3_kl"] > 1e-5 and "rollout_corr/chi2_seq" in b[0], sorted(b[0])
    passes = {name: runs[("monitor", name)][1] for name in MONITOR_RUNS}
    assert passes == {"standard": STEPS, "standard_watched": STEPS, "bypass": 0, "bypass_watched": 0,
                      "bypass_decoupled_dump": STEPS}, passes


def test_decoupled_metrics_and_the_dump_agree_with_the_engine(runs):
    """Bypass + --decoupled-metrics logs rollout_corr_decoupled/... (global batch, pi_old at the step's start vs
    pi_rollout); --dump-logprobs wrote the same log-probs: the engine on the dump gives the same metrics."""
    import json
    import os

    import torch

    from slime_rc import RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths
    hist, _ = runs[("monitor", "bypass_decoupled_dump")]
    files = sorted(os.listdir(runs["dump_dir"]))
    assert files == [f"step_{i:06d}.jsonl" for i in range(STEPS)], files
    for step, m in enumerate(hist):
        with open(os.path.join(runs["dump_dir"], files[step])) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        assert len(rows) == 16 * 4 and {r["step"] for r in rows} == {step} and rows[0]["mode"] == "bypass"
        cat = (lambda key: torch.tensor([x for r in rows for x in r[key]], dtype=torch.float32))
        cu = cu_seqlens_from_lengths([len(r["loss_mask"]) for r in rows])
        engine = compute_rollout_correction(cat("train_log_probs"), cat("rollout_log_probs"), cat("loss_mask"), cu,
                                            RolloutCorrectionConfig(mode="bypass", get_mismatch_metrics=True))
        for k, v in engine.metrics.items():
            got = m[f"rollout_corr_decoupled/{k}"]
            assert abs(got - float(v)) <= 1e-9 * max(1.0, abs(float(v))), (step, k, got, float(v))
        assert m["rollout_corr_decoupled/kl"] != 0.0


def test_decoupled_metrics_outside_bypass_is_refused():
    from slime_rc import RolloutCorrectionConfig
    from slime_rc.demo.train.loop import TrainSettings
    with pytest.raises(ValueError, match="--decoupled-metrics is for bypass mode"):
        TrainSettings(decoupled_metrics=True).check(RolloutCorrectionConfig(is_level="token"))
    TrainSettings(decoupled_metrics=True).check(RolloutCorrectionConfig(mode="bypass"))


@pytest.mark.parametrize("layout", ["tp2_pp2", "cp2_dp2"])
@pytest.mark.parametrize("mode", MODES)
def test_same_metrics_in_every_layout(runs, layout, mode):
    ref, got = runs[("single", mode)], runs[(layout, mode)]
    for step, (a, b) in enumerate(zip(got, ref)):
        assert sorted(a) == sorted(b)
        assert a["reward_mean"] == b["reward_mean"], (layout, mode, step)  # the same samples
        for k, v in b.items():
            if k.startswith("time/"):
                continue
            tol = 1e-5 if step == 0 else 1e-4  # later steps start from weights with Adam's ~1e-6 noise
            assert abs(a[k] - v) <= tol * max(1.0, abs(v)), (layout, mode, step, k, a[k], v)


def test_slime_contract_function_trains_the_same_at_cp_1_2_4(runs):
    """A function written to slime's TIS contract (it all-gathers each sequence over megatron's CP group, returns
    full-length masks and CP-local weights / metrics) as --custom-tis-function-path: loss, grad norm, rewards and its
    own metrics (slime's reduction: per-sample means over the original mask, summed over micro-batches and DP x CP,
    per global sample) are those of the 1-process run at CP=2 (x DP2) and CP=4.  It read slime's attributes with the
    resolved values from a copy of the caller's args, which is left as it was."""
    ref, caller = runs[("tis", "single")]
    assert caller == vars(_caller_args()), caller  # not modified
    names = {k for k in ref[0] if k.startswith("rollout_corr/tis_function/")}
    assert names == {f"rollout_corr/tis_function/{k}" for k in ("kl", "truncate_fraction", "seq_log_ratio",
                                                                  "weight_mean", "lower_bound")}, sorted(ref[0])
    for m in ref:  # 1 / args.tis_upper_bound read off args (float32), reduced per sample: the constant
        assert abs(m["rollout_corr/tis_function/lower_bound"] - 1 / 1.5) < 1e-7, m
        assert 0 < m["rollout_corr/tis_function/truncate_fraction"] < 1 and m["grad_norm"] > 0, m
    # beside the function's own metrics: the mismatch metrics under the engine's names (the same whichever path
    # corrects) and what the function's weights and masks did (rejected fraction, ESS), nothing else
    from slime_rc.correction.metrics import METRICS
    others = {k[len("rollout_corr/"):] for k in ref[0] if k.startswith("rollout_corr/") and k not in names}
    assert {"k3_kl", "log_ppl_diff", "rejected_token_fraction", "rollout_is_eff_sample_size"} <= others <= set(METRICS)
    assert "rejected_seq_fraction" not in others, sorted(others)  # not known from a function's masks: not made up
    for layout in ("cp2_dp2", "cp4"):
        got, caller = runs[("tis", layout)]
        assert caller == vars(_caller_args())
        for step, (a, b) in enumerate(zip(got, ref)):
            assert sorted(a) == sorted(b), (layout, sorted(set(a) ^ set(b)))
            assert a["reward_mean"] == b["reward_mean"], (layout, step)
            for k, v in b.items():
                if k.startswith("time/"):
                    continue
                tol = 1e-5 if step == 0 else 1e-4  # later steps start from weights with Adam's ~1e-6 noise
                assert abs(a[k] - v) <= tol * max(1.0, abs(v)), (layout, step, k, a[k], v)


def test_slime_rc_train_command_writes_metrics(tmp_path):
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--num-steps", "2", "--prompts-per-step", "8",
                           "--use-tis", "--rollout-dtype", "bf16", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    2/2" in proc.stdout and "done: mean reward" in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    assert {"loss", "grad_norm", "reward_mean", "rollout_corr/kl", "time/step"} <= set(lines[0])
    assert lines[0]["rollout_corr/k3_kl"] > 0  # bf16 rollouts: a real mismatch (k3 >= 0; k1 may be < 0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rollout_correction"]["is_level"] == "token" and config["sources"]["is_level"] == "--use-tis"


def test_slime_rc_train_refuses_a_bad_launch_line():
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--tis-level", "sequence"],
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 2 and "--use-tis" in proc.stderr


def test_plot_and_study_summary_read_runs(tmp_path):
    import json

    from slime_rc.cli import main
    from slime_rc.demo.train.study import summarize
    for cfg, base in (("a", 0.1), ("b", 0.5)):
        for seed in (0, 1):
            d = tmp_path / cfg / f"seed{seed}"
            d.mkdir(parents=True)
            rows = [{"step": i, "reward_mean": base + 0.01 * i + 0.1 * seed, "grad_norm": 1.0 + i,
                     "loss": 0.0, "rollout_corr/k3_kl": 1e-3, "rollout_corr/kl": 2e-3,
                     "rollout_corr/rollout_rs_masked_fraction": 0.25, "time/step": 0.5} for i in range(12)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "curves.png"
    assert main(["plot", str(tmp_path / "a" / "seed0"), str(tmp_path / "b" / "seed0"), "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    table = summarize(str(tmp_path))
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))
    # last 10 steps of seed 0: 0.1 + 0.01 * (2..11) -> mean 0.165; seed 1: 0.265 -> 0.215 ± 0.071
    assert "0.215 ± 0.071" in row_a and "| 12.00 |" in row_a and "0.250" in row_a
    (tmp_path / "bad").mkdir()
    assert main(["plot", str(tmp_path / "bad"), "-o", str(out)]) == 2


def test_train_with_an_sglang_server(tmp_path):
    """``--rollout-engine sglang``: rollouts and their log-probs come from a server's /generate (a stub here)."""
    import json
    import os
    import subprocess
    import sys

    from tests.demo.test_rollout import _Stub
    answer = [{"output_ids": [1, 2, 3, 11],
               "meta_info": {"output_token_logprobs": [[-2.7, t, None] for t in (1, 2, 3, 11)]}}] * 4
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with _Stub(canned=answer) as stub:
        proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--num-steps", "2", "--prompts-per-step",
                               "2", "--group-size", "2", "--rollout-engine", "sglang", "--sglang-url", stub.url,
                               "--get-mismatch-metrics", "--output-dir", str(tmp_path)],
                              capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(stub.requests) == 2 and all(body["return_logprob"] for _, body in stub.requests)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the trainer's log-probs of the server's tokens vs the server's -2.7: a mismatch the metrics see
    assert len(rows) == 2 and rows[0]["rollout_corr/rollout_log_ppl"] == __import__("pytest").approx(2.7, rel=1e-5)
    bad = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--rollout-engine", "sglang"],
                         capture_output=True, text=True, cwd=root, timeout=120)
    assert bad.returncode == 2 and "--sglang-url" in bad.stderr


@pytest.mark.parametrize("spec", ["mis", SLIME_FN])
def test_train_with_a_custom_tis_function(tmp_path, spec):
    """``--custom-tis-function-path``: the loss takes the weights from the function (its metrics get their prefix).
    A function written like slime's example reads ``args.tis_upper_bound`` (``1.0 / args.tis_upper_bound``) although
    the launch line gives only ``--use-tis``: it gets the resolved default (2.0), not the flag's None."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--num-steps", "2", "--prompts-per-step", "8",
                           "--use-tis", "--logit-noise", "0.5", "--custom-tis-function-path", spec,
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("rollout_corr/tis_function/") for k in rows[0]), sorted(rows[0])
    if spec == SLIME_FN:
        assert all(abs(r["rollout_corr/tis_function/lower_bound"] - 0.5) < 1e-7 for r in rows), rows
