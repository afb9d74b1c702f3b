"""The fused Triton kernels (``slime_rc.megatron.logprobs_triton``) equal the eager ``vocab_parallel_log_probs``.

Without a GPU the kernels run under Triton's interpreter on CPU tensors, in a spawned process (``TRITON_INTERPRET=1``
must be set before Triton is first imported, and megatron-core or torch's inductor may have imported it in the pytest
process already); with CUDA they run compiled on the GPU, in this process, on the same data.  Sizes are tiny (37
rows, 300 columns) and the tile is 128 columns (both kernels' ``BLOCK_V``), so every row has a partial last tile;
the backward's column splits (several programs per row) are exercised too.  Checked against the eager path,
per row: log-probs, entropy and the logits' gradient, with and without the entropy's gradient, at temperatures 1.0
and 0.7, for float32, bfloat16 and float16 logits; under megatron's TP = 2 in a 2-process gloo spawn (the
interpreter again); with ``-inf`` logits against a float64 reference (where the eager entropy is NaN).

Tolerances, relative to the largest magnitude of each tensor (as ``tests/megatron/test_logprobs.py``): 1e-6 for
log-probs and entropy; for the gradient 1e-6 against the float64 truth's scale is not what either float32 path
achieves (its terms ``p (c + gh log p)`` cancel: eager and kernel are each up to ~1.5e-6 off), so 2e-6 against
float64 and 3e-6 between the two paths; bfloat16 / float16 gradients are rounded to 8 / 11 bits on both sides.

``combine_shards``' algebra needs no Triton: shards' float64 statistics by the documented formulas, merged, equal the
whole vocabulary's, in one process (1 to 4 shards, one of them all ``-inf``) and with the real collectives in a
2-process gloo spawn.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from slime_rc.megatron import logprobs_triton as lt
from slime_rc.megatron.logprobs import vocab_parallel_log_probs
from slime_rc.testing.traffic import saved_for_backward
from tests.dist_utils import run_distributed
from tests.megatron.test_logprobs import _data as logprobs_data, assert_rel, reference64

ROWS, VOCAB = 37, 300  # 300 = 2 x 128 + 44: a partial last tile; 300 splits into 2 shards of 150 (2 tiles each)
BLOCK = 128
TEMPERATURE = 0.7
HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


# ---- helpers -------------------------------------------------------------------------------------------------------
def _data(seed: int = 0, dtype=torch.float32, rows: int = ROWS, vocab: int = VOCAB):
    return logprobs_data(seed, dtype, rows, vocab)


def _grads(fn, logits, target, grad_lp, grad_h, entropy_grad: bool, device=DEVICE):
    """``(log_probs, entropy, d objective / d logits)`` on the CPU, for ``objective = sum lp * grad_lp (+ sum h *
    grad_h)``, with ``fn`` run on ``device``."""
    x = logits.to(device).requires_grad_()
    lp, h = fn(x, target.to(device))
    objective = (lp * grad_lp.to(device)).sum() + ((h * grad_h.to(device)).sum() if entropy_grad else 0)
    (g,) = torch.autograd.grad(objective, x)
    return lp.detach().cpu(), h.detach().cpu(), g.cpu()


def _triton_fn(temperature: float, with_entropy: bool, entropy_grad: bool):
    return lambda x, t: lt.TritonLogProbsEntropy.apply(x, t, 1.0 / temperature, 0, with_entropy,
                                                       with_entropy and entropy_grad)


def _eager_fn(temperature: float, with_entropy: bool, entropy_grad: bool):
    def fn(x, t):
        out = vocab_parallel_log_probs(x, t, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
        return out if with_entropy else (out, torch.empty(0))
    return fn


# ---- the kernels' results: computed once, in a fresh process under the interpreter where there is no GPU -------
# name -> (seed, dtype, temperature, with_entropy, entropy_grad, n_split, masked)
GRAD_CASES = {
    **{("eager", dt, temp, eg): (1, dt, temp, True, eg, None, False)
       for dt in ("float32", "bfloat16", "float16") for temp in (1.0, TEMPERATURE) for eg in (True, False)},
    **{("alone", dt): (2, dt, TEMPERATURE, False, False, None, False) for dt in ("float32", "bfloat16")},
    **{("split", n): (3, "float32", TEMPERATURE, True, True, n, False) for n in (1, 2, 3)},
    **{("masked", eg): (5, "float32", TEMPERATURE, True, eg, None, True) for eg in (True, False)},
}
SHARD_START = 100  # test_statistics_of_a_shard: this shard holds ids [100, 400)


def _masked_data(seed: int):
    """``-inf`` logits: a masked vocabulary tail, and row 7 masked but for its target."""
    logits, target, grad_lp, grad_h = _data(seed)
    logits[:, 250:] = float("-inf")
    target = target % 250
    logits[7] = float("-inf")
    logits[7, target[7]] = 1.5
    return logits, target, grad_lp, grad_h


def _case_data(seed, dtype, masked):
    return _masked_data(seed) if masked else _data(seed, getattr(torch, dtype))


def kernel_worker(rank: int, world: int, device: str) -> dict:
    """Every Triton result the single-process tests check, on ``device`` (run in a fresh process on the CPU: the
    interpreter must be on before Triton is first imported)."""
    lt.TritonLogProbsEntropy._block_v = BLOCK
    try:
        return _kernel_results(device)
    finally:  # in this process on a GPU: leave the defaults to whatever runs next
        lt.TritonLogProbsEntropy._block_v = lt.TritonLogProbsEntropy._n_split = None


def _kernel_results(device: str) -> dict:
    out = {}
    for key, (seed, dtype, temp, we, eg, n_split, masked) in GRAD_CASES.items():
        lt.TritonLogProbsEntropy._n_split = n_split
        logits, target, grad_lp, grad_h = _case_data(seed, dtype, masked)
        out[key] = _grads(_triton_fn(temp, we, eg), logits, target, grad_lp, grad_h, we and eg, device=device)
        lt.TritonLogProbsEntropy._n_split = None

    logits, target, *_ = _data(4)
    stats = lt.forward_stats(logits.to(device), target.to(device), 1.0 / TEMPERATURE, SHARD_START, block_v=BLOCK)
    out["stats"] = [t.cpu() for t in stats]

    logits, target, *_ = _data(6)  # what autograd saves
    x = logits.to(device).requires_grad_()
    with saved_for_backward(VOCAB) as wide:
        lp, h = _triton_fn(TEMPERATURE, True, True)(x, target.to(device))
        (lp.sum() + h.sum()).backward()
    out["saved"] = [t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in wide]

    logits, target, *_ = _data(7)  # entropy_grad=False; no rows
    x = logits.to(device).requires_grad_()
    lp, h = _triton_fn(1.0, True, False)(x, target.to(device))
    empty = torch.empty(0, VOCAB, device=device, requires_grad=True)
    lp0, h0 = _triton_fn(1.0, True, True)(empty, torch.empty(0, dtype=torch.long, device=device))
    (g0,) = torch.autograd.grad(lp0.sum() + h0.sum(), empty)
    out["flags"] = dict(lp_grad=lp.requires_grad, h_grad=h.requires_grad,
                        empty=(tuple(lp0.shape), tuple(h0.shape), tuple(g0.shape)))
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    """``kernel_worker``'s results: in this process on a GPU, else in one spawned process with
    ``TRITON_INTERPRET=1`` (this process may have imported Triton already, for the GPU: megatron-core does)."""
    pytest.importorskip("triton")
    if HAS_CUDA:
        return kernel_worker(0, 1, "cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # inherited by the spawned process
        return run_distributed(kernel_worker, 1, args=("cpu",), timeout=600)[0]


# ---- the kernels against the eager path ------------------------------------------------------------------------
GRAD_TOL = {torch.float32: (2e-6, 3e-6), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_equals_the_eager_path(results, dtype, temperature, entropy_grad):
    logits, target, grad_lp, grad_h = _data(1, getattr(torch, dtype))
    ours = results[("eager", dtype, temperature, entropy_grad)]
    eager = _grads(_eager_fn(temperature, True, entropy_grad), logits, target, grad_lp, grad_h, entropy_grad,
                   device="cpu")
    truth = reference64(logits, target, temperature, grad_lp, grad_h, entropy_grad)
    assert_rel(ours[0], eager[0], "log-probs")
    assert_rel(ours[1], eager[1], "entropy")
    vs_truth, vs_eager = GRAD_TOL[getattr(torch, dtype)]
    assert_rel(ours[2], eager[2], "gradient vs eager", vs_eager)
    assert_rel(ours[2], truth[2], "gradient vs float64", vs_truth)
    assert ours[2].dtype == logits.dtype and ours[0].dtype == ours[1].dtype == torch.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_log_probs_alone(results, dtype):
    """``with_entropy=False``: an empty entropy, the log-probs' gradient only."""
    logits, target, grad_lp, grad_h = _data(2, getattr(torch, dtype))
    ours = results[("alone", dtype)]
    eager = _grads(_eager_fn(TEMPERATURE, False, False), logits, target, grad_lp, grad_h, False, device="cpu")
    assert ours[1].numel() == 0
    assert_rel(ours[0], eager[0], "log-probs")
    assert_rel(ours[2], eager[2], "gradient", GRAD_TOL[getattr(torch, dtype)][1])


@pytest.mark.parametrize("n_split", [1, 2, 3])
def test_backward_column_splits(results, n_split):
    """Several backward programs per row (its small-batch path: 1, 2 or 3 programs over the 3 tiles) give the
    eager gradient."""
    logits, target, grad_lp, grad_h = _data(3)
    eager = _grads(_eager_fn(TEMPERATURE, True, True), logits, target, grad_lp, grad_h, True, device="cpu")
    for got, want, what, tol in zip(results[("split", n_split)], eager, ("log-probs", "entropy", "gradient"),
                                    (1e-6, 1e-6, 3e-6)):
        assert_rel(got, want, what, tol)


def test_statistics_of_a_shard(results):
    """``forward_stats`` by its documented formulas (float64), targets outside the shard included."""
    logits, target, *_ = _data(4)
    m, s, w, z_t, in_shard = results["stats"]
    z = logits.double() / TEMPERATURE
    m64 = z.amax(-1)
    e = (z - m64[:, None]).exp()
    local = target - SHARD_START
    inside = (local >= 0) & (local < VOCAB)
    assert_rel(m, m64, "m")
    assert_rel(s, e.sum(-1), "S")
    assert_rel(w, (e * (z - m64[:, None])).sum(-1), "W")
    assert torch.equal(in_shard, inside.float()) and 0 < int(inside.sum()) < ROWS
    want_zt = torch.where(inside, z.gather(-1, local.clamp(0, VOCAB - 1)[:, None]).squeeze(-1), 0.0)
    assert_rel(z_t, want_zt, "z_t")


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_masked_logits(results, entropy_grad):
    """``-inf`` logits (a masked vocabulary tail; one row with all but its target masked): finite log-probs, entropy
    and gradient equal to the float64 truth, zero gradient at the masked columns.  (The eager path's entropy is NaN
    there: ``0 * -inf``.)"""
    logits, target, grad_lp, grad_h = _masked_data(5)
    ours = results[("masked", entropy_grad)]
    truth = reference64(logits, target, TEMPERATURE, grad_lp, grad_h, entropy_grad)
    for got, want, what in zip(ours, truth, ("log-probs", "entropy", "gradient")):
        assert bool(torch.isfinite(got).all()), what
        assert_rel(got, want, what, 2e-6)
    assert bool((ours[2][:, 250:] == 0).all())
    assert abs(float(ours[0][7])) < 1e-6 and abs(float(ours[1][7])) < 1e-6


def test_saves_nothing_vocabulary_sized_but_the_logits(results):
    """Autograd keeps the input logits (the same storage) and per-row vectors, nothing else of the vocabulary's
    size."""
    assert results["saved"] and all(results["saved"])


def test_entropy_without_its_gradient_is_not_differentiable_and_empty_rows(results):
    flags = results["flags"]
    assert flags["lp_grad"] and not flags["h_grad"]
    assert flags["empty"] == ((0,), (0,), (0, VOCAB))


def test_available():
    """Only contiguous 2-D CUDA float32 / bfloat16 / float16 with Triton importable."""
    x = torch.zeros(3, 5)
    assert not lt.available(x)  # CPU
    if HAS_CUDA and importlib.util.find_spec("triton") is not None:
        y = torch.zeros(3, 5, device="cuda")
        assert lt.available(y) and lt.available(y.bfloat16()) and lt.available(y.half())
        assert not lt.available(y.t()) and not lt.available(y.double()) and not lt.available(y[:, :0])
        assert not lt.available(y[None])


# ---- tensor parallelism: megatron's TP group in a 2-process gloo spawn -----------------------------------------
def tp_worker(rank: int, world: int):
    """Under TP = ``world``: this rank's (log-probs, entropy, gradient shard) from the kernels and from the eager
    path, on its vocabulary shard, with and without the entropy's gradient (CPU tensors and the interpreter; on a GPU
    CUDA tensors over gloo and the compiled kernels)."""
    from megatron.core import parallel_state as ps
    lt.TritonLogProbsEntropy._block_v = BLOCK
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        logits, target, grad_lp, grad_h = _data(8)
        width = VOCAB // world
        shard = logits[:, rank * width:(rank + 1) * width].contiguous()
        out = {}
        for entropy_grad in (True, False):
            out[entropy_grad] = dict(
                ours=_grads(_triton_fn(TEMPERATURE, True, entropy_grad), shard, target, grad_lp, grad_h,
                            entropy_grad, device=device),
                eager=_grads(_eager_fn(TEMPERATURE, True, entropy_grad), shard, target, grad_lp, grad_h,
                             entropy_grad, device=device))
        return out
    finally:
        ps.destroy_model_parallel()


def test_tensor_parallel_equals_the_eager_path():
    """TP = 2 (gloo; CPU tensors and the interpreter, or CUDA tensors on a GPU): the kernels' statistics combined
    over the shards by ``combine_shards`` give each rank the eager path's log-probs, entropy and gradient shard, and
    the single-process float64 truth."""
    pytest.importorskip("triton")
    pytest.importorskip("megatron.core")
    logits, target, grad_lp, grad_h = _data(8)
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():  # inherited by the spawned processes, before they import Triton
            mp.setenv("TRITON_INTERPRET", "1")
        ranks = run_distributed(tp_worker, 2, timeout=300)
    for entropy_grad in (True, False):
        truth = reference64(logits, target, TEMPERATURE, grad_lp, grad_h, entropy_grad)
        for rank, per_rank in enumerate(ranks):
            ours, eager = per_rank[entropy_grad]["ours"], per_rank[entropy_grad]["eager"]
            cols = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
            assert_rel(ours[0], eager[0], f"rank {rank} log-probs")
            assert_rel(ours[1], eager[1], f"rank {rank} entropy")
            assert_rel(ours[2], eager[2], f"rank {rank} gradient", 3e-6)
            assert_rel(ours[0], truth[0], f"rank {rank} log-probs vs float64")
            assert_rel(ours[1], truth[1], f"rank {rank} entropy vs float64")
            assert_rel(ours[2], truth[2][:, cols], f"rank {rank} gradient vs float64", 2e-6)


# ---- combine_shards: the algebra, no Triton ------------------------------------------------------------------------
def _shard_stats(z: torch.Tensor):
    """One shard's ``(m_local, S_local, W_local)`` by the module's formulas (float64): ``m = max z``, ``S = sum exp(z
    - m)``, ``W = sum exp(z - m) (z - m)`` (``0 log 0 = 0``; an all ``-inf`` shard gives ``(-inf, 0, 0)``)."""
    m = z.amax(-1)
    safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    s = z - safe[:, None]
    e = s.exp()
    return m, e.sum(-1), torch.where(e > 0, e * s, torch.zeros_like(e)).sum(-1)


def _bounds(n_shards: int):
    edges = [0, 70, 150, 230, VOCAB][:n_shards] + [VOCAB]  # uneven shards; any split must do
    return list(zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("n_shards", [1, 2, 3, 4])
def test_merged_shard_statistics_equal_the_whole_vocabulary(n_shards):
    """``max`` then the sum of ``merge_partials`` (what ``combine_shards``' two all-reduces compute) gives the
    whole-vocabulary ``m, S, W``, and from them log p and H; one shard is all ``-inf`` for some rows."""
    logits, target, *_ = _data(9, torch.float64)
    z = logits / TEMPERATURE
    if n_shards > 1:
        z[:5, :70] = float("-inf")  # rows 0..4: the first shard holds nothing
    stats = [_shard_stats(z[:, a:b]) for a, b in _bounds(n_shards)]
    m = torch.stack([st[0] for st in stats]).amax(0)
    merged = [lt.merge_partials(ml, sl, wl, m) for ml, sl, wl in stats]
    s = sum(p[0] for p in merged)
    w = sum(p[1] for p in merged)
    m_all, s_all, w_all = _shard_stats(z)
    torch.testing.assert_close(m, m_all, rtol=0, atol=0)
    torch.testing.assert_close(s, s_all, rtol=1e-12, atol=0)
    torch.testing.assert_close(w, w_all, rtol=1e-12, atol=1e-12)
    log_p = z.gather(-1, target[:, None]).squeeze(-1) - m - s.log()
    entropy = s.log() - w / s
    ref = torch.log_softmax(z, -1)
    torch.testing.assert_close(log_p, ref.gather(-1, target[:, None]).squeeze(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, -torch.where(ref.isinf(), 0.0, ref.exp() * ref).sum(-1), rtol=1e-12,
                               atol=1e-12)
    # merge_partials on stacked parts (as forward_stats merges its column splits) is the same
    sp, wp = lt.merge_partials(torch.stack([st[0] for st in stats]), torch.stack([st[1] for st in stats]),
                               torch.stack([st[2] for st in stats]), m)
    torch.testing.assert_close(sp.sum(0), s, rtol=1e-15, atol=0)
    torch.testing.assert_close(wp.sum(0), w, rtol=1e-15, atol=1e-15)


def test_combine_shards_with_one_shard_is_the_identity():
    m, s, w = torch.randn(4), torch.rand(4) + 1, torch.randn(4)
    z_t, flag = torch.randn(4), torch.tensor([1.0, 0.0, 1.0, 1.0])
    out = lt.combine_shards(m, s, w, None, z_target=z_t, in_shard=flag)
    assert out[0] is m and out[1] is s and out[2] is w
    torch.testing.assert_close(out[3], (z_t - m) * flag)
    assert lt.combine_shards(m, s, None)[2:] == (None, None)


def combine_worker(rank: int, world: int):
    """This rank's shard statistics (float64) combined over the world by ``combine_shards``."""
    import torch.distributed as dist
    logits, target, *_ = _data(10, torch.float64)
    z = logits / TEMPERATURE
    a, b = _bounds(world)[rank]
    m, s, w = _shard_stats(z[:, a:b])
    local = target - a
    inside = (local >= 0) & (local < b - a)
    z_t = torch.where(inside, z[:, a:b].gather(-1, local.clamp(0, b - a - 1)[:, None]).squeeze(-1), 0.0)
    with_w = lt.combine_shards(m, s, w, dist.group.WORLD, z_target=z_t, in_shard=inside.double())
    without_w = lt.combine_shards(m, s, None, dist.group.WORLD)
    return dict(with_w=with_w, without_w=without_w)


def test_combine_shards_over_gloo():
    """Two ranks, real collectives (a MAX and a SUM all-reduce): every rank gets the whole vocabulary's ``m, S, W``
    and the target's ``s_t = z_t - m`` (from the one shard that holds it)."""
    logits, target, *_ = _data(10, torch.float64)
    z = logits / TEMPERATURE
    m_all, s_all, w_all = _shard_stats(z)
    s_t = z.gather(-1, target[:, None]).squeeze(-1) - m_all
    for out in run_distributed(combine_worker, 2, timeout=120):
        m, s, w, st = out["with_w"]
        torch.testing.assert_close(m, m_all, rtol=0, atol=0)
        torch.testing.assert_close(s, s_all, rtol=1e-12, atol=0)
        torch.testing.assert_close(w, w_all, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(st, s_t, rtol=1e-12, atol=1e-12)
        m2, s2, w2, st2 = out["without_w"]
        assert w2 is None and st2 is None
        torch.testing.assert_close(s2, s_all, rtol=1e-12, atol=0)
