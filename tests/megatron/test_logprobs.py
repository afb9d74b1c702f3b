"""``vocab_parallel_log_probs``: the chunked autograd function equals the unfused formula, under TP and CP too, and
keeps nothing vocabulary-sized for backward but the logits it was given.

The reference is the formula the function replaced, written with plain autograd ops (every intermediate kept):
``z = logits / T``, ``s = z - max z``, ``log p = s_t - log sum exp s``, ``H = log S - sum(exp(s) s) / S``.  Under
tensor parallelism (TP = 2, 4) each rank holds a vocabulary shard and megatron's TP group; under context parallelism
(CP = 2) each rank holds its zigzag halves of the rows (chunks r and 2cp-1-r).  Every rank's log-probs, entropy and
gradient shard must equal the single-process reference on the same rows and columns, to 1e-6 relative.
"""

from __future__ import annotations

import pytest
import torch

from slime_rc.megatron.logprobs import vocab_parallel_log_probs
from slime_rc.testing.traffic import VocabTraffic, saved_for_backward
from tests.dist_utils import run_distributed

ROWS, VOCAB = 45, 96  # VOCAB splits into 2 and 4 shards; ROWS into 4 zigzag chunks unevenly
TEMPERATURE = 0.7


def unfused(logits: torch.Tensor, target: torch.Tensor, temperature: float):
    """``(log_probs, entropy)`` by the plain formula (the previous implementation, every intermediate saved)."""
    z = logits.float() / temperature
    shifted = z - z.max(dim=-1, keepdim=True).values.detach()
    exp = shifted.exp()
    total = exp.sum(-1)
    log_probs = shifted.gather(-1, target[:, None]).squeeze(-1) - total.log()
    return log_probs, total.log() - (exp * shifted).sum(-1) / total


def _data(seed: int = 0, dtype=torch.float32, rows: int = ROWS, vocab: int = VOCAB):
    """``(logits [rows, vocab], target [rows], d objective / d log-probs, d objective / d entropy)``."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    grad_lp = torch.randn(rows, generator=g, dtype=torch.float64).float()
    grad_h = torch.randn(rows, generator=g, dtype=torch.float64).float()
    return logits, target, grad_lp, grad_h


def _grads(fn, logits, target, grad_lp, grad_h, entropy_grad: bool):
    x = logits.clone().requires_grad_()
    lp, h = fn(x, target)
    objective = (lp * grad_lp).sum() + ((h * grad_h).sum() if entropy_grad else 0)
    (g,) = torch.autograd.grad(objective, x)
    return lp.detach(), h.detach(), g


def assert_rel(got, want, what, tol=1e-6):
    """``max |got - want| <= tol * max |want|`` (NaN anywhere fails)."""
    err = float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def reference64(logits, target, temperature, grad_lp, grad_h, entropy_grad: bool):
    """Float64 truth: log-probs, entropy (``0 log 0 = 0`` at ``-inf`` logits) and the gradient of
    ``sum lp * grad_lp (+ sum h * grad_h)``."""
    x = logits.double().requires_grad_()
    log_p = torch.log_softmax(x / temperature, dim=-1)
    lp = log_p.gather(-1, target[:, None]).squeeze(-1)
    # p log p with 0 log 0 = 0, its gradient too (a where() after the product would back-propagate 0 * -inf)
    h = -(log_p.exp() * torch.where(log_p == float("-inf"), torch.zeros_like(log_p), log_p)).sum(-1)
    objective = (lp * grad_lp.double()).sum() + ((h * grad_h.double()).sum() if entropy_grad else 0)
    (g,) = torch.autograd.grad(objective, x)
    return lp.detach(), h.detach(), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("chunk_rows", [None, 7, 1])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_equals_the_unfused_formula(dtype, temperature, chunk_rows, entropy_grad):
    logits, target, grad_lp, grad_h = _data(1, dtype)
    ours = _grads(lambda x, t: vocab_parallel_log_probs(x, t, temperature, with_entropy=True,
                                                        entropy_grad=entropy_grad, chunk_rows=chunk_rows),
                  logits, target, grad_lp, grad_h, entropy_grad)
    ref = _grads(lambda x, t: unfused(x, t, temperature), logits, target, grad_lp, grad_h, entropy_grad)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16 on both sides
    for got, want, what in zip(ours, ref, ("log-probs", "entropy", "gradient")):
        assert_rel(got, want, what, 1e-6 if what != "gradient" else tol)
    assert ours[2].dtype == dtype


def test_entropy_without_its_gradient_is_not_differentiable_and_log_probs_alone_work():
    logits, target, *_ = _data(2)
    x = logits.clone().requires_grad_()
    lp, h = vocab_parallel_log_probs(x, target, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not h.requires_grad
    only = vocab_parallel_log_probs(x, target)
    assert torch.equal(only, lp)
    shaped = vocab_parallel_log_probs(x.reshape(5, 9, VOCAB), target.reshape(5, 9))
    assert shaped.shape == (5, 9) and torch.equal(shaped.reshape(-1), lp)
    with pytest.raises(ValueError, match="target"):
        vocab_parallel_log_probs(x, target[:-1])


def test_saves_nothing_vocabulary_sized_but_the_logits():
    """What autograd keeps between forward and backward: the input logits (the same storage, no copy) and
    per-row vectors -- not the softmax, the shifted logits or their exponential."""
    logits, target, *_ = _data(3)
    x = logits.clone().requires_grad_()
    with saved_for_backward(VOCAB) as wide:
        lp, h = vocab_parallel_log_probs(x, target, TEMPERATURE, with_entropy=True, chunk_rows=8)
        (lp.sum() + h.sum()).backward()
    assert wide, "the logits themselves must be saved (backward recomputes from them)"
    assert all(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in wide)


@pytest.mark.parametrize("entropy_grad,bound", [(False, 14), (True, 17)])
def test_vocabulary_traffic_is_bounded(entropy_grad, bound):
    """Bytes moved over ``[rows, V]`` tensors by forward + backward, in float32 ``[rows, V]`` passes: 8 forward
    (max, shift, exp, sum, and the entropy's sum of exp * shift reading two) + 6 backward (log p, exp, scale),
    9 with the entropy's gradient.  slime's ``_VocabParallelLogProbEntropy`` (its CUDA branch) makes 10 + 4
    without the entropy's gradient and 10 + 14 with it; the bench measures it (benchmarks/bench_slime_loss.py)."""
    logits, target, grad_lp, grad_h = _data(4)
    x = logits.clone().requires_grad_()
    with VocabTraffic(VOCAB) as traffic:
        lp, h = vocab_parallel_log_probs(x, target, TEMPERATURE, with_entropy=True, entropy_grad=entropy_grad,
                                         chunk_rows=8)
        objective = (lp * grad_lp).sum() + ((h * grad_h).sum() if entropy_grad else 0)
        torch.autograd.grad(objective, x)
    passes = traffic.passes(ROWS * VOCAB * 4)
    assert bound - 1 < passes <= bound + 0.1, (passes, dict(traffic.by_op))  # + the target gathers


# ---- tensor and context parallelism: spawned gloo worlds with megatron's parallel state --------------------------
def _zigzag_rows(n_rows: int, cp: int, rank: int) -> torch.Tensor:
    """The rows CP rank ``rank`` holds: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp`` (the last one short)."""
    chunk = -(-n_rows // (2 * cp))
    parts = [torch.arange(i * chunk, min((i + 1) * chunk, n_rows)) for i in (rank, 2 * cp - 1 - rank)]
    return torch.cat(parts)


def layout_worker(rank: int, world: int, layouts):
    """Per layout ``(tp, cp)``: this rank's log-probs, entropy and gradient shard from its rows and vocab slice."""
    from megatron.core import parallel_state as ps
    out = {}
    logits, target, grad_lp, grad_h = _data(5)
    for tp, cp in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
            rows = _zigzag_rows(ROWS, cp, cp_rank)
            width = VOCAB // tp
            cols = slice(tp_rank * width, (tp_rank + 1) * width)
            shard = logits[rows][:, cols].contiguous()
            for entropy_grad in (True, False):
                lp, h, g = _grads(lambda x, t: vocab_parallel_log_probs(x, t, TEMPERATURE, with_entropy=True,
                                                                        entropy_grad=entropy_grad, chunk_rows=5),
                                  shard, target[rows], grad_lp[rows], grad_h[rows], entropy_grad)
                out[(tp, cp, entropy_grad)] = dict(rows=rows, cols=(cols.start, cols.stop), lp=lp, h=h, g=g)
        finally:
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def layouts():
    """One 2-process spawn (TP2, CP2) and one 4-process spawn (TP4, TP2 x CP2)."""
    results = {}
    for world, names in ((2, [(2, 1), (1, 2)]), (4, [(4, 1), (2, 2)])):
        for per_rank in run_distributed(layout_worker, world, args=(names,), timeout=300):
            for key, value in per_rank.items():
                results.setdefault(key, []).append(value)
    return results


@pytest.mark.parametrize("tp,cp", [(2, 1), (4, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_each_rank_equals_the_single_process_result(layouts, tp, cp, entropy_grad):
    logits, target, grad_lp, grad_h = _data(5)
    lp, h, g = _grads(lambda x, t: unfused(x, t, TEMPERATURE), logits, target, grad_lp, grad_h, entropy_grad)
    ranks = layouts[(tp, cp, entropy_grad)]
    assert len(ranks) == tp * cp
    covered = torch.zeros(ROWS, VOCAB, dtype=torch.int64)
    for r in ranks:
        rows, (c0, c1) = r["rows"], r["cols"]
        assert_rel(r["lp"], lp[rows], "log-probs")
        assert_rel(r["h"], h[rows], "entropy")
        assert_rel(r["g"], g[rows][:, c0:c1], "gradient shard")
        covered[rows, c0:c1] += 1
    assert bool((covered == 1).all()), "the layout's shards must tile the logits exactly once"
