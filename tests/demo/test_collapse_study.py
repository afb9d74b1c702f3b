"""The collapse study's pieces: the rollout engine's probability floor (``--rollout-prob-floor``), the
supervised warm start (``--warm-start-steps``), the end-of-run summary (``summary.json``), and ``slime-rc plot`` /
``python -m slime_rc.demo.train.study`` of a study directory.

Cheap on purpose (CI: 2 cores): the floor is checked on a pure-torch engine with random weights; one 1-process
spawn trains two tiny runs (with and without warm start) and one 2-process spawn the warm start under TP2; one
``slime-rc train`` subprocess of 2 + 3 steps checks the summary against its own ``metrics.jsonl``; plots and tables
are drawn from synthetic study directories."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

from slime_rc.demo.model import TinyGPTConfig
from slime_rc.demo.rollout.in_process import RolloutEngine, TorchGPT, _LAYER_KEYS, floor_log_probs
from tests.dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------------------------------
# the probability floor
# ---------------------------------------------------------------------------------------------------------------
def random_params(cfg: TinyGPTConfig, scale: float = 1.0, seed: int = 0) -> dict:
    """A state dict of ``build_model(cfg)``'s names and shapes, random (no megatron needed for the engine)."""
    g = torch.Generator().manual_seed(seed)
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    hn = h // cfg.num_attention_heads
    groups = cfg.num_query_groups or cfg.num_attention_heads
    qkv = groups * (cfg.num_attention_heads // groups + 2) * hn
    shapes = {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
              "self_attention.linear_qkv.weight": (qkv, h), "self_attention.linear_qkv.bias": (qkv,),
              "self_attention.linear_proj.weight": (h, h), "self_attention.linear_proj.bias": (h,),
              "pre_mlp_layernorm.weight": (h,), "pre_mlp_layernorm.bias": (h,),
              "mlp.linear_fc1.weight": (f, h), "mlp.linear_fc1.bias": (f,), "mlp.linear_fc2.weight": (h, f),
              "mlp.linear_fc2.bias": (h,)}
    assert set(shapes) == set(_LAYER_KEYS)
    rnd = (lambda *s: scale * torch.randn(*s, generator=g) / math.sqrt(s[-1]))
    p = {"embedding.word_embeddings.weight": torch.randn(v, h, generator=g),
         "decoder.final_layernorm.weight": torch.ones(h), "decoder.final_layernorm.bias": torch.zeros(h),
         "output_layer.weight": 4.0 * scale * torch.randn(v, h, generator=g) / math.sqrt(h)}
    for i in range(cfg.num_layers):
        for k, s in shapes.items():
            p[f"decoder.layers.{i}.{k}"] = (torch.ones(s) if k.endswith("norm.weight") else rnd(*s))
    return p


CFG = TinyGPTConfig(vocab_size=16, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=64,
                    max_seq_len=16)


def test_floor_formula_is_a_distribution_with_every_entry_at_least_the_floor():
    g = torch.Generator().manual_seed(0)
    logits = 12.0 * torch.randn(64, 16, generator=g)  # peaked rows: most entries far below any floor
    logp = torch.log_softmax(logits, -1)
    for f in (1e-6, 2e-3, 0.05):
        logq = floor_log_probs(logp, f)
        q = logq.exp().double()
        assert torch.allclose(q.sum(-1), torch.ones(64, dtype=torch.float64), atol=1e-6)
        assert float(q.min()) >= f * (1 - 1e-5)
        expect = (1 - 16 * f) * logp.double().exp() + f  # q = (1 - V f) p + f, independently
        assert torch.allclose(q, expect, rtol=1e-5, atol=1e-12)
        ranked = logq.gather(-1, logp.argsort(dim=-1))  # order kept: ascending p -> non-decreasing q
        assert bool((ranked[:, 1:] >= ranked[:, :-1]).all())
    assert torch.equal(floor_log_probs(logp, 0.0), logp)
    for bad in (-1e-3, 1 / 16, 0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"\[0, 1/16\)"):
            floor_log_probs(logp, bad)


def test_engine_samples_from_the_floored_distribution_and_reports_its_log_probs():
    f, temperature = 2e-3, 0.8
    params = random_params(CFG, scale=3.0)
    engine = RolloutEngine(CFG, dtype="fp32", prob_floor=f, temperature=temperature, seed=3)
    engine.load_weights(params)
    prompt = torch.tensor([1, 2, 3, 10])
    n = 40000
    out = engine.generate([prompt] * n, max_new_tokens=1)
    # log q computed here, from the plain pure-torch model: the floor applied to log_softmax(logits / T)
    p = torch.softmax(TorchGPT(params, CFG).logits(prompt[None])[0, -1].double() / temperature, -1)
    q = (1 - 16 * f) * p + f
    assert float(p.min()) < f / 10, "the test needs tail tokens far below the floor"
    tokens = torch.stack([o["response"][0] for o in out])
    reported = torch.stack([o["rollout_log_probs"][0] for o in out]).double()
    assert torch.allclose(reported, q.log()[tokens], atol=1e-5)
    freq = torch.bincount(tokens, minlength=16).double() / n
    sigma = (q * (1 - q) / n).sqrt()
    assert bool(((freq - q).abs() <= 5 * sigma + 1e-12).all()), (freq, q)
    tail = p < f / 10  # the tokens the model itself almost never samples: drawn at about the floor's rate
    assert abs(float(freq[tail].sum()) - float(q[tail].sum())) <= 5 * float(sigma[tail].square().sum().sqrt())
    # longer generations: each reported log-prob is log q of its token (teacher-forced score, same weights)
    many = engine.generate([prompt, torch.tensor([4, 4, 10])], max_new_tokens=5)
    scored = engine.score([o["prompt"] for o in many], [o["response"] for o in many])
    for o, s in zip(many, scored):
        assert torch.allclose(o["rollout_log_probs"], s, atol=1e-5)
        assert float(o["rollout_log_probs"].min()) >= math.log(f) - 1e-5


def test_engine_without_floor_reports_the_plain_distribution_and_a_bad_floor_is_refused():
    params = random_params(CFG, scale=3.0)
    engine = RolloutEngine(CFG, seed=5, prob_floor=0.0)
    engine.load_weights(params)
    model = TorchGPT(params, CFG)
    for o in engine.generate([torch.tensor([1, 2, 10])] * 8, 4):
        seq = torch.cat([o["prompt"], o["response"]])
        plain = torch.log_softmax(model.logits(seq[None])[0].float(), -1)  # no floor: log_softmax(logits)
        n = o["response"].numel()
        expect = plain[2:2 + n].gather(-1, o["response"][:, None]).squeeze(-1)
        assert torch.allclose(o["rollout_log_probs"], expect, atol=1e-5)
    for bad in (-0.01, 0.0625, 1.0, float("nan")):
        with pytest.raises(ValueError, match="prob_floor"):
            RolloutEngine(CFG, prob_floor=bad)


@pytest.mark.parametrize("value", [-0.001, 0.0625, 0.5, float("nan"), float("inf")])
def test_the_floor_flag_refuses_bad_values_naming_flag_value_range_and_fix(value):
    from slime_rc.demo.train.loop import TrainSettings
    with pytest.raises(ValueError) as e:
        TrainSettings(rollout_prob_floor=value).check_values()
    msg = str(e.value)
    assert msg.startswith(f"--rollout-prob-floor {value}:"), msg
    assert "[0, 0.0625)" in msg and "give e.g. --rollout-prob-floor 0.002" in msg and "\n" not in msg
    TrainSettings(rollout_prob_floor=0.002).check_values()  # a valid one passes
    TrainSettings(rollout_prob_floor=0.0624).check_values()


def test_the_new_flags_on_the_launch_line():
    from slime_rc.demo.train.loop import TrainSettings
    with pytest.raises(ValueError, match=r"^--rollout-prob-floor 0.002: .*--rollout-engine torch"):
        TrainSettings(rollout_prob_floor=0.002, rollout_engine="sglang", sglang_url="http://127.0.0.1:1").check_values()
    with pytest.raises(ValueError, match=r"^--warm-start-steps -1: .*give --warm-start-steps 0 or more \(default 0\)"):
        TrainSettings(warm_start_steps=-1).check_values()
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--rollout-prob-floor", "0.1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slime-rc train: error: --rollout-prob-floor 0.1: "), lines
    from slime_rc.demo.train.launch import add_train_arguments
    import argparse
    args = add_train_arguments(argparse.ArgumentParser()).parse_args([])
    assert args.rollout_prob_floor == 0.0 and args.warm_start_steps == 0  # off by default


# ---------------------------------------------------------------------------------------------------------------
# the warm start
# ---------------------------------------------------------------------------------------------------------------
WARM = dict(digits=2, prompts_per_step=8, group_size=4, micro_batches=2, lr=1e-2, rollout_dtype="fp32",
            hidden_size=32, num_layers=1)


def warm_worker(rank, world, runs):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    from slime_rc import RolloutCorrectionConfig
    from slime_rc.demo.train.loop import TrainSettings, run_training
    out = {}
    for name, extra in runs.items():
        out[name] = run_training(TrainSettings(**{**WARM, **extra}), RolloutCorrectionConfig(mode="bypass"))
    return out


@pytest.fixture(scope="module")
def warm_runs():
    runs = run_distributed(warm_worker, 1, args=({"cold": dict(num_steps=2), "warm": dict(num_steps=2,
                                                                                          warm_start_steps=30)},),
                           timeout=300)[0]
    return runs


def test_warm_start_lowers_the_supervised_loss_and_raises_the_first_reward(warm_runs):
    warm, cold = warm_runs["warm"], warm_runs["cold"]
    steps = [m for m in warm if m.get("warm_start")]
    assert [m["step"] for m in warm] == list(range(32)) and len(steps) == 30
    assert [m["step"] for m in cold] == [0, 1] and not any("warm_start" in m for m in cold)
    assert all(m["warm_start"] is True and "reward_mean" not in m for m in steps)
    assert steps[0]["loss"] > math.log(12) * 0.9  # a random model: about uniform over the task's tokens
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"], [round(m["loss"], 3) for m in steps]
    # the GRPO steps see the same prompts with or without warm start (its prompts have their own stream)
    first_warm, first_cold = warm[30], cold[0]
    assert first_warm["loss_tokens"] > 0 and first_cold["reward_mean"] < 0.5
    assert first_warm["reward_mean"] > first_cold["reward_mean"] + 0.3, (first_warm["reward_mean"],
                                                                          first_cold["reward_mean"])


def tp_worker(rank, world):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    from slime_rc import RolloutCorrectionConfig
    from slime_rc.demo.train.loop import TrainSettings, run_training
    hist = run_training(TrainSettings(**dict(WARM, num_layers=2), tp=2, num_steps=1, warm_start_steps=3),
                        RolloutCorrectionConfig(mode="bypass"))
    return [(m["loss"], m["grad_norm"]) for m in hist if m.get("warm_start")]


def test_warm_start_is_the_same_under_tensor_parallelism():
    """The warm start runs megatron's train_step in the run's layout: TP2 gives the 1-process losses."""
    single = run_distributed(warm_worker, 1, args=({"w": dict(num_layers=2, num_steps=1, warm_start_steps=3)},),
                             timeout=300)[0]["w"]
    ref = [(m["loss"], m["grad_norm"]) for m in single if m.get("warm_start")]
    got = run_distributed(tp_worker, 2, timeout=300)
    for rank_result in got:
        assert len(rank_result) == 3
        for (a, ga), (b, gb) in zip(rank_result, ref):
            assert abs(a - b) <= 1e-4 * max(1, abs(b)) and abs(ga - gb) <= 1e-3 * max(1, abs(gb)), (a, b, ga, gb)


# ---------------------------------------------------------------------------------------------------------------
# the end-of-run summary
# ---------------------------------------------------------------------------------------------------------------
def test_train_prints_and_writes_the_summary_of_its_own_metrics(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "slime_rc", "train", "--num-steps", "3", "--warm-start-steps", "2",
                           "--prompts-per-step", "4", "--group-size", "4", "--micro-batches", "2", "--hidden-size",
                           "32", "--num-layers", "1", "--rollout-dtype", "fp32", "--rollout-prob-floor", "0.02",
                           "--use-tis", "--use-rs", "--rs-level", "token", "--rs-upper-bound", "0.83_1.2",
                           "--no-use-tensorboard", "--output-dir", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(x.startswith("warm-start ") for x in lines) == 2 and "warm-start    2/2  supervised" in proc.stdout
    assert "step    3/3" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    grpo = [r for r in rows if not r.get("warm_start")]
    assert len(rows) == 5 and len(grpo) == 3 and [r["step"] for r in grpo] == [2, 3, 4]
    # every value again, from metrics.jsonl
    assert summary["grpo_steps"] == 3 and summary["warm_start_steps"] == 2
    assert summary["final_reward"] == pytest.approx(statistics.mean(r["reward_mean"] for r in grpo))
    for r in grpo:  # decoupled mode: the global fraction times the step's tokens
        assert r["rejected_tokens"] == round(r["rollout_corr/rejected_token_fraction"] * r["loss_tokens"])
    rejected, tokens = sum(r["rejected_tokens"] for r in grpo), sum(r["loss_tokens"] for r in grpo)
    assert rejected > 0, "the test needs rejected tokens"
    assert (summary["rejected_tokens"], summary["loss_tokens"]) == (rejected, tokens)
    assert summary["rejected_fraction"] == pytest.approx(rejected / tokens)
    assert summary["mean_ess"] == pytest.approx(statistics.mean(r["rollout_corr/rollout_is_eff_sample_size"]
                                                                for r in grpo))
    assert summary["worst_k3"] == pytest.approx(max(r["rollout_corr/k3_kl"] for r in grpo))
    assert summary["worst_grad_norm"] == pytest.approx(max(r["grad_norm"] for r in grpo))
    assert summary["worst_grad_norm_step"] in (2, 3, 4)
    # the printed lines say the same numbers
    text = "\n".join(x for x in lines if x.startswith("summary"))
    assert f"final reward {summary['final_reward']:.3f} (mean of the last 3 steps" in text
    assert f"rejected {rejected} of {tokens} tokens ({100 * rejected / tokens:.2f}%)" in text
    assert f"mean ESS {summary['mean_ess']:.3f}" in text and f"worst k3 {summary['worst_k3']:.2e}" in text
    assert f"worst grad norm {summary['worst_grad_norm']:.3f} at step " in text
    # summary.json is a previous run's file: a second run is refused, --overwrite removes it
    from slime_rc.demo.train.launch import previous_run_files
    assert "summary.json" in previous_run_files(str(out))


def test_run_summary_detects_a_collapse_and_leaves_the_warm_start_out():
    from slime_rc.demo.train.study import run_summary
    warm = [{"step": i, "warm_start": True, "loss": 2.0, "grad_norm": 100.0} for i in range(3)]
    rise = [0.1 * i for i in range(15)]  # 0 .. 1.4, then down to 0.5: the best 10-step mean is early
    fall = [1.4 - 0.06 * i for i in range(15)]
    rows = warm + [{"step": 3 + i, "reward_mean": r, "grad_norm": 1.0 + (i == 20) * 9, "loss_tokens": 10,
                    "rejected_tokens": i % 2} for i, r in enumerate(rise + fall)]
    s = run_summary(rows)
    means = [statistics.mean((rise + fall)[i:i + 10]) for i in range(21)]
    assert s["final_reward"] == pytest.approx(statistics.mean(fall[-10:]))
    assert s["peak_reward"] == pytest.approx(max(means))
    assert s["collapsed"] is True and s["final_reward"] < 0.8 * s["peak_reward"]
    assert s["worst_grad_norm"] == 10.0 and s["worst_grad_norm_step"] == 23  # not the warm start's 100
    assert (s["rejected_tokens"], s["loss_tokens"]) == (15, 300) and s["warm_start_steps"] == 3
    assert s["mean_ess"] is None and s["worst_k3"] is None  # not logged: no number made up
    steady = run_summary([{"step": i, "reward_mean": 0.05 * i, "grad_norm": 1.0} for i in range(30)])
    assert steady["collapsed"] is False and steady["final_reward"] == steady["peak_reward"]
    assert steady["rejected_tokens"] is None


# ---------------------------------------------------------------------------------------------------------------
# a study directory: table and plot
# ---------------------------------------------------------------------------------------------------------------
def make_study(root, configs):
    """``root/<config>/seed<k>/metrics.jsonl`` from ``{config: [reward list per seed]}`` (2 warm-start rows each)."""
    for config, seeds in configs.items():
        for k, rewards in enumerate(seeds):
            d = root / config / f"seed{k}"
            d.mkdir(parents=True)
            rows = [{"step": i, "warm_start": True, "loss": 2.0, "grad_norm": 50.0, "loss_tokens": 8}
                    for i in range(2)]
            rows += [{"step": 2 + i, "reward_mean": r, "grad_norm": 1.0 + i + k, "loss": 0.0, "loss_tokens": 100,
                      "rejected_tokens": 10 * (config == "rs"), "exact_fraction": r / 1.5,
                      "rollout_corr/k3_kl": 1e-3 * (1 + i), "rollout_corr/rejected_token_fraction": 0.1 * (config == "rs"),
                      "time/step": 0.5} for i, r in enumerate(rewards)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_study_table_of_a_synthetic_study(tmp_path, capsys):
    up = [0.1 * i for i in range(14)]
    collapse = up + [0.0] * 10  # the last 10 steps' mean (0) is well below the best 10-step mean
    make_study(tmp_path, {"rs": [up, up, collapse], "none": [collapse, collapse, [r + 0.05 for r in up]]})
    from slime_rc.demo.train.study import main, study_table
    table = {row["config"]: row for row in study_table(str(tmp_path))}
    assert set(table) == {"rs", "none"}
    assert table["rs"]["seeds"] == 3 and table["rs"]["collapsed"] == 1 and table["none"]["collapsed"] == 2
    finals = [statistics.mean(up[-10:])] * 2 + [statistics.mean(collapse[-10:])]
    assert table["rs"]["final_rewards"] == pytest.approx(finals)
    # GRPO steps only (the warm start's 50 left out): grad_norm = 1 + i + k, the longest run is seed 2's
    assert table["rs"]["worst_grad_norm"] == 1.0 + (len(collapse) - 1) + 2
    assert table["rs"]["rejected_fraction"] == pytest.approx(0.1) and table["none"]["rejected_fraction"] == 0.0
    assert table["rs"]["worst_k3"] == pytest.approx(1e-3 * len(collapse))
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    row = next(x for x in text.splitlines() if x.startswith("| rs |"))
    assert (f"| rs | 3 | {statistics.mean(finals):.3f} ± {statistics.stdev(finals):.3f} | 1/3 | "
            f"{table['rs']['worst_grad_norm']:.2f} |") in row
    assert main([str(tmp_path / "rs" / "seed0")]) == 2  # a run directory is not a study
    assert "no <config>/seed<k>/metrics.jsonl" in capsys.readouterr().err


def test_plot_of_a_study_directory_writes_one_png_with_the_mean_and_band_over_seeds(tmp_path):
    from slime_rc.cli import main
    from slime_rc.demo.train.plot import _grpo, plot_study, seed_band
    make_study(tmp_path / "study", {"a": [[0.1, 0.2, 0.3], [0.3, 0.4, 0.5]], "b": [[1.0, 1.0], [0.0, 0.5], [0.5, 0.0]]})
    out = tmp_path / "curves.png"
    assert main(["plot", str(tmp_path / "study"), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 20_000
    study = plot_study(str(tmp_path / "study"), str(tmp_path / "again.png"))
    assert set(study) == {"a", "b"} and len(study["b"]) == 3
    steps, mean, low, high = seed_band(list(study["b"].values()), "reward_mean")
    assert steps == [0, 1] and mean == pytest.approx([0.5, 0.5]) and low == [0.0, 0.0] and high == [1.0, 1.0]
    assert [r["step"] for r in _grpo([{"step": 0, "warm_start": True}, {"step": 1}, {"step": 2}])] == [0, 1]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty), "-o", str(out)]) == 2
