"""`slime-rc study estimators`: the toy problem's exact gradient, the estimators' statistics, the command line.

Statistical checks use fixed seeds and compare against the estimator's own Monte Carlo noise floor
(``Measurement.floor`` = sqrt(tr Cov(g_hat) / R) / ||g||: the relative bias an unbiased estimator reads).  For an
unbiased estimator ``bias^2 / floor^2`` is about a chi-square over the gradient's dimensions divided by their number,
so ``bias < 3 floor`` fails only for a real bias; the margins below were chosen from the measured values.
"""

import itertools
import json
import math

import pytest
import torch

from slime_rc.tools.estimators import (ESTIMATORS, Batch, estimator_configs, engine_coefficients, enumerate_objective,
                                 gradient_estimates, main, make_problem, measure, sample_actions)


def _batch(problem, n_seqs, seed, replications=1):
    u = torch.rand(n_seqs, problem.length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return Batch.build(problem, sample_actions(problem, u), replications)


def _measure_all(length, delta, samples, replications, seed=0, names=ESTIMATORS, geo_band="0.95_1.05"):
    batch = _batch(make_problem(length, delta, seed), samples * replications, seed + 100, replications)
    configs = estimator_configs(2.0, geo_band)
    return {name: measure(batch, configs[name]) for name in names}


# ---- the problem ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length,delta,seed", [(1, 0.3, 0), (2, 0.0, 1), (3, 0.5, 2), (5, 0.2, 3)])
def test_exact_gradient_equals_enumeration(length, delta, seed):
    problem = make_problem(length, delta, seed)
    theta = problem.log_pi.clone().requires_grad_(True)  # log-softmax rows are valid logits of pi
    objective = enumerate_objective(theta, problem.log_f)
    objective.backward()
    assert abs(objective.item() - 1.0) < 1e-12  # the reward is normalized: J = E_pi[R] = 1
    torch.testing.assert_close(theta.grad, problem.exact_gradient(), atol=1e-13, rtol=0)
    assert problem.exact_gradient().norm() > 0.01


def test_exact_gradient_matches_finite_differences():
    problem = make_problem(3, 0.1, 4)
    theta0, h = problem.log_pi.clone(), 1e-6
    fd = torch.zeros_like(theta0)
    for t, k in itertools.product(range(3), range(theta0.shape[1])):
        plus, minus = theta0.clone(), theta0.clone()
        plus[t, k] += h
        minus[t, k] -= h
        fd[t, k] = (enumerate_objective(plus, problem.log_f) - enumerate_objective(minus, problem.log_f)) / (2 * h)
    torch.testing.assert_close(fd, problem.exact_gradient(), atol=1e-8, rtol=0)


def test_estimator_formula_weighted_over_every_sequence_is_the_exact_gradient():
    """Feeding all K^T sequences with coefficient K^T pi(tau) turns the sample mean into E_pi: g_hat must be g."""
    problem = make_problem(4, 0.3, 5)
    k = problem.log_pi.shape[1]
    actions = torch.cartesian_prod(*[torch.arange(k)] * 4)
    log_p = problem.log_pi[torch.arange(4), actions].sum(-1)
    coeffs = (k ** 4 * log_p.exp())[:, None].expand(-1, 4)
    kept = torch.ones(actions.shape[0], dtype=torch.float64)
    est = gradient_estimates(Batch.build(problem, actions, 1), coeffs, kept)
    torch.testing.assert_close(est[0], problem.exact_gradient(), atol=1e-12, rtol=0)


def test_mismatch_is_the_same_kl_at_every_position():
    for delta in (0.05, 0.2, 0.5):
        problem = make_problem(64, delta, 0)
        torch.testing.assert_close(problem.kl_per_token(), torch.full((64,), delta * delta / 2, dtype=torch.float64),
                                   atol=1e-9, rtol=0)
        assert bool((problem.chi2_per_token() > 0).all())
    assert make_problem(8, 0.0, 0).kl_per_token().abs().max() == 0
    # nested: a shorter problem is the prefix of a longer one
    torch.testing.assert_close(make_problem(4, 0.2, 1).log_mu, make_problem(16, 0.2, 1).log_mu[:4])


def test_weights_come_from_the_engine():
    problem = make_problem(6, 0.4, 0)
    batch = _batch(problem, 64, 1)
    configs = estimator_configs(2.0, "0.95_1.05")
    pos = torch.arange(6)
    log_rho = (problem.log_pi[pos, batch.actions] - problem.log_mu[pos, batch.actions]).float()
    c, kept, _, lrs = engine_coefficients(batch, configs["token-tis"])
    torch.testing.assert_close(c.float(), log_rho.exp().clamp(max=2.0), atol=1e-6, rtol=1e-5)
    assert kept.min() == 1
    c, kept, _, _ = engine_coefficients(batch, configs["seq-mis"])
    seq = log_rho.double().sum(-1)
    inside = (seq.abs() <= math.log(2.0)).double()
    torch.testing.assert_close(kept, inside)
    torch.testing.assert_close(c, (seq.exp() * inside)[:, None].expand(-1, 6), atol=1e-5, rtol=1e-5)
    c, kept, _, _ = engine_coefficients(batch, configs["geo-rs"])
    torch.testing.assert_close(c, kept[:, None].expand(-1, 6))
    assert 0 < kept.mean() < 1


# ---- statistics ------------------------------------------------------------------------------------------------
def test_without_mismatch_every_estimator_is_unbiased_and_identical():
    stats = _measure_all(8, 0.0, samples=128, replications=64)
    for name, m in stats.items():
        assert m.rejected == 0 and abs(m.ess - 1) < 1e-9, name
        assert m.bias < 3 * m.floor, (name, m)
        assert m.floor < 0.05
    # the same samples with all weights 1: the same estimates
    assert len({round(m.bias, 12) for m in stats.values()}) == 1


def test_seq_is_unbiased_and_token_tis_bias_grows_with_length():
    names = ("none", "token-tis", "seq-is")
    short = _measure_all(2, 0.5, samples=256, replications=128, names=names)
    long = _measure_all(16, 0.5, samples=256, replications=128, names=names)
    for stats in (short, long):
        assert stats["seq-is"].bias < 3 * stats["seq-is"].floor
    assert short["token-tis"].bias > 5 * short["token-tis"].floor  # biased already at T=2 ...
    # ... and clearly more at T=16 (measured 0.15 -> 0.34).  The measured bias is ||b + n|| with ||n|| ~ floor, so
    # it is off from ||b|| by at most about one floor: a gap of 3 floors leaves a true gap of at least one.
    gap = long["token-tis"].bias - short["token-tis"].bias
    assert gap > 3 * (long["token-tis"].floor + short["token-tis"].floor), (short["token-tis"], long["token-tis"])
    # the uncorrected estimator is worse than token-TIS at both lengths
    assert long["none"].bias > long["token-tis"].bias and short["none"].bias > short["token-tis"].bias


def test_seq_is_variance_grows_like_the_sequence_chi2():
    problem = make_problem(16, 0.2, 0)
    seq_chi2 = float(torch.expm1(torch.log1p(problem.chi2_per_token()).sum()))
    stats = _measure_all(16, 0.2, samples=256, replications=64, names=("none", "seq-tis", "seq-is"))
    ratio = stats["seq-is"].variance / stats["none"].variance
    assert 1 + 0.3 * seq_chi2 < ratio < 1 + 3 * seq_chi2, (ratio, seq_chi2)
    assert stats["seq-tis"].variance < stats["seq-is"].variance  # truncation trades it for bias


def test_geometric_statistic_is_length_invariant_and_rejection_does_not_grow_while_kl_is_inside_the_band():
    delta, band = 0.2, "0.95_1.05"  # KL/token 0.02 < log(1.05) = 0.049
    configs = estimator_configs(2.0, band)
    rejected = {}
    for length in (4, 64):
        batch = _batch(make_problem(length, delta, 0), 4096, 7)
        _, kept_geo, _, log_rho = engine_coefficients(batch, configs["geo-rs"])
        _, kept_mis, _, _ = engine_coefficients(batch, configs["seq-mis"])
        geo = log_rho / length
        # E_mu[mean_t log rho_t] = -KL/token at every length; the sequence sum drifts like -T KL
        assert abs(float(geo.mean()) + delta * delta / 2) < 4 * float(geo.std()) / math.sqrt(geo.numel())
        rejected[length] = (1 - float(kept_geo.mean()), 1 - float(kept_mis.mean()))
    assert rejected[64][0] <= rejected[4][0]  # geo-RS: measured 0.61 -> 0.11
    assert rejected[64][1] > rejected[4][1] + 0.3  # seq-MIS (sequence band [0.5, 2]): 0.09 -> 0.75


def test_geometric_rejection_grows_with_length_once_kl_exceeds_the_band():
    """The caveat of docs/estimators.md: the geometric mean concentrates at -KL, outside a band narrower than KL."""
    configs = estimator_configs(2.0, "0.95_1.05")
    rejected = []
    for length in (8, 256):
        batch = _batch(make_problem(length, 0.5, 0), 2048, 3)  # KL/token 0.125 > 0.049
        _, kept, _, _ = engine_coefficients(batch, configs["geo-rs"])
        rejected.append(1 - float(kept.mean()))
    assert rejected[1] > 0.97 and rejected[1] > rejected[0] + 0.1, rejected


# ---- command line ----------------------------------------------------------------------------------------------
def test_cli_quick_json_has_the_keys(capsys):
    from slime_rc.cli import main as cli_main
    code = cli_main(["study", "estimators", "--quick", "--json", "--lengths", "2,8", "--replications", "8"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert {"setup", "rows", "seconds"} <= set(data)
    assert data["setup"]["lengths"] == [2, 8] and data["setup"]["replications"] == 8
    assert len(data["rows"]) == 2 * len(data["setup"]["mismatch"])
    row = data["rows"][0]
    assert {"mismatch", "length", "kl_per_token", "chi2_per_token", "seq_chi2", "clamp_fraction"} <= set(row)
    assert set(row["estimators"]) == set(ESTIMATORS)
    for cell in row["estimators"].values():
        assert set(cell) == {"bias", "floor", "variance", "rejected", "ess"}
        assert all(math.isfinite(v) for v in cell.values())


def test_cli_tables_and_plot(capsys, tmp_path):
    png = tmp_path / "est.png"
    code = main(["--lengths", "2,4", "--mismatch", "0.3", "--samples", "16", "--replications", "4", "--seeds", "1",
                 "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "**Relative bias**" in out and "| 0.3 | 4 |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,needles", [
    (["--lengths", "2,x"], ["--lengths", "'x' is not an integer"]),
    (["--lengths", "0,4"], ["--lengths", "out of range"]),
    (["--mismatch", "-0.1"], ["--mismatch", "-0.1", "out of range"]),
    (["--mismatch", "nan"], ["--mismatch", "out of range"]),
    (["--samples", "1"], ["--samples 1", "[2,"]),
    (["--replications", "many"], ["--replications", "'many' is not an integer"]),
    (["--seeds", "0"], ["--seeds 0", "out of range"]),
    (["--cap", "0.5"], ["--cap 0.5", "> 1"]),
    (["--geo-band", "1.1_0.9"], ["--geo-band '1.1_0.9'", "lower_upper"]),
    (["--plot", "out.jpg"], ["--plot 'out.jpg'", ".png"]),
    (["--plot", "/no/such/dir/x.png"], ["--plot", "does not exist"]),
    (["--samples", "100000", "--replications", "100000"], ["--samples", "--replications", "tokens"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
])
def test_bad_arguments_exit_2_naming_the_flag(capsys, argv, needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("slime-rc study estimators: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    assert "--mismatch" in capsys.readouterr().out
