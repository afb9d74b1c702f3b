"""The CUDA path: the engine, the policy losses, the Megatron loss, slime's custom loss and the TIS
functions slime loads, run on a GPU, give the CPU's numbers and never synchronise the stream.

Each test computes the same call on the CPU and on the device and compares every output (weights, keep masks,
metrics, losses and gradients); in ``on_nonfinite='reject'`` mode the device call runs under CUDA's own
synchronisation detector (``torch.cuda.set_sync_debug_mode("error")``: any ``.item()``, data-dependent size or
blocking copy raises) and under :class:`~slime_rc.testing.host_reads.HostReads`, which must count 0 (1 with
``'error'``: the deferred check).  A 2-process spawn runs the engine and slime's TIS function under context
parallelism with CUDA tensors over gloo (one GPU cannot host two NCCL ranks) and compares with one process.

Where no GPU is present (CI) the module is skipped as a whole.  ``SLIME_RC_TEST_DEVICE=cpu`` runs it on the CPU
against itself (a dry run of the comparisons, without the CUDA detector) before a GPU is lent.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest
import torch

from slime_rc import compute_policy_loss, compute_rollout_correction, cu_seqlens_from_lengths
from slime_rc.correction.reducer import LocalReducer
from slime_rc.testing.host_reads import HostReads

_WANTED = os.environ.get("SLIME_RC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = pytest.mark.skipif(not _WANTED, reason="no GPU here: this module runs where CUDA is available "
                                                    "(or with SLIME_RC_TEST_DEVICE=cpu, as a dry run)")
DEVICE = torch.device(_WANTED or "cpu")
ON_CUDA = DEVICE.type == "cuda"


# ---- helpers -------------------------------------------------------------------------------------------------------
def to(obj, device=DEVICE):
    """``obj`` with every tensor moved to ``device`` (through dicts, lists, tuples; other values as they are)."""
    if isinstance(obj, torch.Tensor):
        out = obj.detach().to(device)
        return out.requires_grad_(obj.requires_grad) if obj.is_leaf else out
    if isinstance(obj, dict):
        return {k: to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to(v, device) for v in obj)
    return obj


def assert_same(cpu, dev, what="", rtol=1e-6, atol=1e-7):
    """``dev`` (any device) equals ``cpu`` to float32 rounding, walking dicts, lists, tuples and dataclass-like
    results; a tensor on the device must also keep the CPU tensor's dtype and shape."""
    if isinstance(cpu, torch.Tensor):
        assert isinstance(dev, torch.Tensor) and dev.device.type == DEVICE.type, (what, type(dev))
        assert dev.dtype == cpu.dtype and dev.shape == cpu.shape, (what, dev.dtype, cpu.dtype, dev.shape, cpu.shape)
        torch.testing.assert_close(dev.detach().cpu(), cpu.detach(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
    elif isinstance(cpu, dict):
        assert set(cpu) == set(dev), (what, sorted(set(cpu) ^ set(dev)))
        for k in cpu:
            assert_same(cpu[k], dev[k], f"{what}[{k!r}]", rtol, atol)
    elif isinstance(cpu, (list, tuple)):
        assert len(cpu) == len(dev), what
        for i, (a, b) in enumerate(zip(cpu, dev)):
            assert_same(a, b, f"{what}[{i}]", rtol, atol)
    elif hasattr(cpu, "__dataclass_fields__"):
        for k in cpu.__dataclass_fields__:
            assert_same(getattr(cpu, k), getattr(dev, k), f"{what}.{k}", rtol, atol)
    else:
        assert cpu == dev, (what, cpu, dev)


@contextlib.contextmanager
def no_stream_sync():
    """CUDA's own detector: a synchronising call inside raises ``RuntimeError`` (a no-op off CUDA)."""
    if not ON_CUDA:
        yield
        return
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def run_checked(call, mode: str):
    """``call()`` on the device after a warm-up call (one-time per-device caches are not the hot path): under the
    CUDA detector with ``'reject'``, and counted by ``HostReads`` (0 reads with ``'reject'``, at most 1 with
    ``'error'``).  Returns the result of the counted call."""
    call()
    if mode == "reject":
        with no_stream_sync():
            call()
    with HostReads() as reads:
        out = call()
    assert reads.count <= (0 if mode == "reject" else 1), reads.report()
    if ON_CUDA:
        torch.cuda.synchronize()
    return out


def test_the_detector_sees_a_sync():
    """The instrument: a scalar read of a device tensor raises under the detector (on CUDA)."""
    x = torch.arange(4.0, device=DEVICE)
    if ON_CUDA:
        with pytest.raises(RuntimeError, match="synchroniz"):
            with no_stream_sync():
                float(x.sum())
    with HostReads() as reads:
        float(x.sum())
    assert reads.count == 1


# ---- the engine ---------------------------------------------------------------------------------------------------
def _engine_batch(n_seqs: int, seed: int, nan: bool):
    from tests.correction.test_host_reads import _batch
    train, rollout, mask, cu = _batch(n_seqs, seed)
    train[int(cu[3]) + 1], mask[int(cu[3]) + 1] = rollout[int(cu[3]) + 1] - 12.0, 1.0  # a catastrophic token
    if nan:
        train[int(cu[5])], mask[int(cu[5])] = float("nan"), 1.0
    return train, rollout, mask, cu


def _engine_configs():
    from tests.correction.test_host_reads import CONFIGS
    return CONFIGS


def assert_same_correction(want, got, what: str, seq_atol: float = 1e-7) -> None:
    """Two ``CorrectionResult``: weights, keep mask and per-sequence values to float32 rounding, metrics to 1e-5."""
    assert_same(want.is_weights, got.is_weights, f"{what} is_weights")
    assert_same(want.keep_mask, got.keep_mask, f"{what} keep_mask")
    assert_same(want.sequences, got.sequences, f"{what} sequences", atol=seq_atol)
    assert_same(want.metrics, got.metrics, f"{what} metrics", rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("name", list(_engine_configs()))
def test_engine_on_the_device_equals_the_cpu(name, mode):
    config = replace(_engine_configs()[name], on_nonfinite=mode)
    cpu = _engine_batch(48, seed=3, nan=mode == "reject")
    dev = to(cpu)
    want = compute_rollout_correction(*cpu, config)
    got = run_checked(lambda: compute_rollout_correction(*dev, config), mode)
    assert_same_correction(want, got, name)


def test_engine_on_a_large_batch_on_the_device_equals_the_cpu():
    """Past 65,536 tokens the per-sequence sums are block sums and the float64 totals come in pieces on a CPU,
    whole on a GPU (``packed._pieces``): the same numbers."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 9000, (40,), generator=g)
    n = int(lengths.sum())
    rollout = -torch.rand(n, generator=g) * 4
    train = rollout + 0.1 * torch.randn(n, generator=g)
    train[torch.randint(0, n, (20,), generator=g)] -= 12.0
    mask = (torch.rand(n, generator=g) > 0.1).float()
    cpu = (train, rollout, mask, cu_seqlens_from_lengths(lengths))
    dev = to(cpu)
    assert n > 100_000
    for name in ("token_tis_rs_veto_norm", "k_options", "sequence_tis_geo_rs"):
        config = replace(_engine_configs()[name], on_nonfinite="reject")
        want = compute_rollout_correction(*cpu, config)
        got = run_checked(lambda: compute_rollout_correction(*dev, config), "reject")
        assert_same_correction(want, got, name, seq_atol=1e-6)


def test_engine_error_on_the_device_names_sample_and_position():
    train, rollout, mask, cu = _engine_batch(9, seed=1, nan=True)
    k = int(cu[5])
    config = replace(_engine_configs()["token_tis_rs_veto_norm"], on_nonfinite="error")
    with pytest.raises(ValueError, match=rf"train_log_probs is nan at sample 5, position 0 \(packed index {k}\)"):
        compute_rollout_correction(*to((train, rollout, mask, cu)), config)


# ---- the policy losses --------------------------------------------------------------------------------------------
def _loss_configs():
    from tests.test_losses import CONFIGS
    return CONFIGS


def _policy_loss(b, cfg):
    lp = b["theta"].detach().clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp, b["old"], b["rollout"], b["adv"], b["mask"], b["cu"], cfg)
    loss.backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("name", list(_loss_configs()))
def test_policy_loss_and_gradient_on_the_device_equal_the_cpu(name, mode):
    from tests.test_losses import _batch
    cfg = replace(_loss_configs()[name], on_nonfinite=mode)
    cpu = _batch(5, lengths=(5, 1, 7, 3, 6, 30, 2, 11))
    dev = to(cpu)
    want = _policy_loss(cpu, cfg)
    got = run_checked(lambda: _policy_loss(dev, cfg), mode)
    assert_same(want, got, name, rtol=1e-5, atol=1e-7)


# ---- the Megatron loss (one process: the CP reducer is a LocalReducer) --------------------------------------------
@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("variant", ["in_loss", "prepared", "tis_function"])
def test_megatron_loss_on_the_device_equals_the_cpu(variant, mode, monkeypatch):
    import slime_rc.megatron.loss as megatron_loss
    from slime_rc.megatron.loss import make_loss_func, policy_loss, prepare_global_batch
    from tests.test_hot_path_losses import _tis_function, _tis_micro_batch
    from tests.test_losses import _batch, _micro_batch
    monkeypatch.setattr(megatron_loss, "_cp_reducer", LocalReducer)
    cfg = replace(_loss_configs()["decoupled_seq_tis_rs"], on_nonfinite=mode)

    def build(device):
        if variant == "tis_function":
            mb, logits = _tis_micro_batch(device)
            from slime_rc.slime.tis_bridge import tis_function_correction_for
            return mb, logits, make_loss_func(cfg, external=tis_function_correction_for(_tis_function, None))
        mb, logits = _micro_batch(_batch(12), 0, 5, seed=1)
        mb, logits = to(mb, device), to(logits, device)
        if variant == "in_loss":
            return mb, logits, make_loss_func(cfg)
        (p,) = prepare_global_batch([mb], cfg, reducer=LocalReducer())
        return mb, logits, lambda x, m: policy_loss(x, m, cfg, prepared=p, reducer=LocalReducer())

    def call(device):
        mb, logits, loss_fn = build(device)
        x = logits.detach().clone().requires_grad_(True)

        def once():
            x.grad = None
            loss, metrics = loss_fn(x, mb)
            loss.backward()
            return loss.detach(), x.grad, metrics
        return once

    want = call(torch.device("cpu"))()
    got = run_checked(call(DEVICE), mode)
    assert_same(want, got, variant, rtol=1e-5, atol=1e-6)


# ---- log-probs and entropy from vocab-sharded logits ---------------------------------------------------------------
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "eager"])
def test_log_probs_on_the_device_equal_the_cpu(fused, dtype, entropy_grad, monkeypatch):
    """The fused Triton kernels (default on a GPU with Triton) and the eager chunks give the float64 log-probs,
    entropy and gradient, with no host read: 3e-6 of the largest value, 1e-5 for the entropy (a float32 difference
    of two sums; the CPU's own float32 path was 3e-6 off on an H200 run, both device paths alike) and for the
    gradient through it, bf16 gradients to bf16 rounding."""
    from slime_rc.megatron.logprobs import FUSED_ENV, vocab_parallel_log_probs
    from tests.megatron.test_logprobs import assert_rel, reference64
    monkeypatch.setenv(FUSED_ENV, fused)
    g = torch.Generator().manual_seed(7)
    rows, vocab, temperature = 300, 5003, 0.7
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(2, rows, generator=g)

    def call(logits, target, weights):
        def once():
            x = logits.detach().clone().requires_grad_(True)
            lp, h = vocab_parallel_log_probs(x, target, temperature, with_entropy=True, entropy_grad=entropy_grad)
            ((lp * weights[0]).sum() + ((h * weights[1]).sum() if entropy_grad else 0)).backward()
            return lp.detach(), h.detach(), x.grad
        return once

    want = reference64(logits, target, temperature, weights[0], weights[1], entropy_grad)
    got = run_checked(call(to(logits), to(target), to(weights)), "reject")
    for w, d, what in zip(want, got, ("log-probs", "entropy", "gradient")):
        assert d.device.type == DEVICE.type, what
        assert d.dtype == (dtype if what == "gradient" else torch.float32), what
        # the entropy's gradient p (log p + H) carries H's float32 error
        tol = {"entropy": 1e-5, "gradient": 1e-2 if dtype == torch.bfloat16 else 1e-5 if entropy_grad else 3e-6
               }.get(what, 3e-6)
        assert_rel(d.detach().cpu(), w, what, tol)


# ---- slime's custom loss ------------------------------------------------------------------------------------------
def _slime_modes():
    from tests.slime.test_hot_path_slime import MODES
    return sorted(m for m, (config, _) in MODES.items() if config is not None)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("mode", _slime_modes())
def test_slime_custom_loss_on_the_device_equals_the_cpu(mode, per_token):
    from slime_rc.slime import policy_loss_function
    from tests.slime.test_hot_path_slime import _args
    from tests.slime.test_policy_loss import make_batch
    batch, logits = make_batch(3)
    args = _args(mode, per_token, "reject")

    def call(batch, logits):
        def once():
            x = logits.detach().clone().requires_grad_(True)
            loss, log = policy_loss_function(args, batch, x, None)
            loss.backward()
            return loss.detach(), x.grad, log
        return once

    want = call(batch, logits)()
    got = run_checked(call(to(batch), to(logits)), "reject")
    assert_same(want[:2], got[:2], mode, rtol=1e-5, atol=1e-6)  # the loss and its gradient
    # the metrics: k3 = r - 1 - log r in float32 cancels (~ (log r)^2 / 2): the last-bit difference between the
    # CPU's and CUDA's exp grows to ~6e-5 of a sequence's mean k3 (measured on an H100: 3.3e-6 of 0.054)
    assert_same(want[2], got[2], mode, rtol=1e-4, atol=1e-5)


# ---- the TIS functions slime loads --------------------------------------------------------------------------------
TIS_ARGS = {
    "slime_mis_token_mask_rs_veto_bn": (dict(use_tis=True, tis_mode="mask", use_rs=True, rs_level="token",
                                             rs_veto_threshold=1e-4, tis_batch_normalize=True), "error"),
    "slime_mis_sequence_clip_rs_geo": (dict(use_tis=True, tis_level="sequence", tis_mode="clip", use_rs=True,
                                            rs_level="geometric", tis_batch_normalize=True), "error"),
    "engine_token_veto_norm_reject": (dict(rollout_correction_config=None), "reject"),
}


def _tis_args(name: str):
    from slime_rc.config.schema import RolloutCorrectionConfig
    keys, mode = TIS_ARGS[name]
    if "rollout_correction_config" in keys:
        keys = dict(rollout_correction_config=RolloutCorrectionConfig(
            is_level="token", is_batch_normalize=True, veto_threshold=0.6, on_nonfinite="reject"))
    return NS(**keys), mode


@pytest.mark.parametrize("form", ["lists", "cp"])
@pytest.mark.parametrize("name", list(TIS_ARGS))
def test_tis_functions_on_the_device_equal_the_cpu(name, form):
    from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp
    from tests.slime_reference import make_samples, rank_inputs
    args, mode = _tis_args(name)
    samples = make_samples(0)
    idx, inputs = rank_inputs(samples, 1, 0)
    pg = torch.randn(sum(len(i) for i in idx), generator=torch.Generator().manual_seed(1))
    lists = {k: inputs[k] for k in ("train_log_probs", "rollout_log_probs", "loss_masks")}

    def call(device):
        if form == "lists":
            data = to(lists, device)
            return lambda: compute_mis_weights(args, **data)
        data, p = to(inputs, device), to(pg, device)
        return lambda: compute_mis_weights_with_cp(args, pg_loss=p, **data)

    want = call(torch.device("cpu"))()
    got = run_checked(call(DEVICE), mode)
    assert_same(want, got, f"{name}/{form}", rtol=1e-5, atol=1e-6)


# ---- context parallelism with CUDA tensors (2 processes, gloo) ----------------------------------------------------
def _cp_worker(rank: int, world: int, device: str):
    """Rank ``rank`` of CP=``world``: the engine on its zigzag tokens with a CP reducer, and slime's TIS function
    (CP form) through megatron's parallel_state, both on ``device``."""
    from megatron.core import parallel_state as ps

    from custom_tis.mis import compute_mis_weights_with_cp
    from slime_rc.megatron.reducers import megatron_reducer
    from tests.correction.test_reducer_layouts import CONFIGS, make_samples, pack_samples, shard
    from tests.slime_reference import make_samples as slime_samples, rank_inputs

    if device == "cuda":
        torch.cuda.set_device(0)
    ps.initialize_model_parallel(context_parallel_size=world)
    try:
        out = {}
        samples = make_samples(8, seed=11)
        sh = shard(samples, 1, 0, world, rank)
        local = to(pack_samples(sh["local"]), torch.device(device))
        for name in ("token_tis_rs_veto_norm", "geo_mask", "token_k2_k3_seq_sum_k1"):
            res = compute_rollout_correction(*local, CONFIGS[name], reducer=megatron_reducer())
            out[name] = dict(index=sh["gidx"], keep=res.keep_mask.cpu(),
                             weights=None if res.is_weights is None else res.is_weights.cpu(),
                             metrics={k: float(v) for k, v in res.metrics.items()})
        full = slime_samples(0)
        idx, inputs = rank_inputs(full, world, rank)
        args, _ = _tis_args("slime_mis_token_mask_rs_veto_bn")
        pg = torch.ones(sum(len(i) for i in idx))
        loss, masks, metrics = compute_mis_weights_with_cp(args, pg_loss=to(pg, torch.device(device)),
                                                           **to(inputs, torch.device(device)))
        out["tis"] = dict(idx=idx, weights=loss.cpu(), masks=[m.cpu() for m in masks],
                          devices=sorted({loss.device.type, *(m.device.type for m in masks)}))
        return out
    finally:
        ps.destroy_model_parallel()


def test_context_parallel_with_device_tensors_equals_one_process():
    from custom_tis.mis import compute_mis_weights
    from tests.correction.test_reducer_layouts import CONFIGS, make_samples, pack_samples
    from tests.dist_utils import run_distributed
    from tests.slime_reference import make_samples as slime_samples

    world = 2
    results = run_distributed(_cp_worker, world, args=(DEVICE.type,), timeout=240)
    packed = pack_samples(make_samples(8, seed=11))
    for name in ("token_tis_rs_veto_norm", "geo_mask", "token_k2_k3_seq_sum_k1"):
        ref = compute_rollout_correction(*packed, CONFIGS[name])
        for rank, r in enumerate(results):
            got = r[name]
            torch.testing.assert_close(got["keep"], ref.keep_mask[got["index"]], msg=f"{name} keep, rank {rank}")
            if ref.is_weights is not None:
                torch.testing.assert_close(got["weights"], ref.is_weights[got["index"]], rtol=1e-6, atol=1e-7,
                                           msg=f"{name} weights, rank {rank}")
            for k, v in ref.metrics.items():
                assert got["metrics"][k] == pytest.approx(float(v), rel=1e-6, abs=1e-9), (name, k, rank)
    # slime's TIS function: each rank's weights are the one-process weights at its zigzag positions
    full = slime_samples(0)
    args, _ = _tis_args("slime_mis_token_mask_rs_veto_bn")
    weights, masks, _ = compute_mis_weights(args, train_log_probs=[s["train"] for s in full],
                                            rollout_log_probs=[s["rollout"] for s in full],
                                            loss_masks=[s["mask"] for s in full])
    for rank, r in enumerate(results):
        assert r["tis"]["devices"] == [DEVICE.type]
        want = torch.cat([w[i] for w, i in zip(weights, r["tis"]["idx"])]).float()
        torch.testing.assert_close(r["tis"]["weights"], want, rtol=1e-6, atol=1e-7, msg=f"TIS weights, rank {rank}")
        for m, m_ref, i in zip(r["tis"]["masks"], masks, r["tis"]["idx"]):
            assert torch.equal(m[i].to(m_ref.dtype), m_ref[i]), rank


# ---- the compiled engine on the device (inductor's Triton backend) ------------------------------------------------
@pytest.fixture
def dynamo_on():
    """Dynamo on for one test (``tests/correction/test_compiled.dynamo_enabled``); yields ``compiled.py``."""
    from tests.correction.test_compiled import dynamo_enabled
    with dynamo_enabled() as compiled:
        yield compiled


@pytest.mark.parametrize("name", ["token_truncate_rs_veto_norm", "sequence_clip_max_k2_veto_reject"])
def test_compiled_engine_on_the_device_equals_the_cpu(name, dynamo_on):
    """``compiled=True`` on the device: compiled for real (the call must not fall back to eager: nothing recorded
    in ``compiled._FAILED``, graphs made, none broken), its results on two batches that share the graph equal the
    CPU's eager results, and in ``'reject'`` mode the compiled call runs under CUDA's sync detector (the graph itself
    and what runs around it: no synchronisation).  The second config compiles after the first in the same process,
    as on the H200 where that made its constant tables host -> device copies (``compiled._stages_of``)."""
    import torch._dynamo.utils
    from tests.correction.test_compiled import BATCHES, CONFIGS, _batch
    config = CONFIGS[name]
    counters = torch._dynamo.utils.counters
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for batch in ("large", "more_samples"):
        cpu = _batch(BATCHES[batch], seed=2, nan=config.on_nonfinite == "reject")
        assert cpu[0].numel() >= dynamo_on.MIN_TOKENS
        dev = to(cpu)
        want = compute_rollout_correction(*cpu, config)
        got = compute_rollout_correction(*dev, config, compiled=True)  # compiles on the first batch
        if config.on_nonfinite == "reject":
            with no_stream_sync():
                got = compute_rollout_correction(*dev, config, compiled=True)
        assert DEVICE.type not in dynamo_on._FAILED, dynamo_on._FAILED
        what = f"{name}/{batch} compiled"
        assert_same(want.is_weights, got.is_weights, f"{what} is_weights")
        assert_same(want.keep_mask, got.keep_mask, f"{what} keep_mask")
        assert_same(want.sequences, got.sequences, f"{what} sequences", atol=1e-6)
        assert list(want.metrics) == list(got.metrics), what
        for k in want.metrics:  # k2/k3 cancel in float32: the device's exp differs from the CPU's in the last bit
            rtol = 1e-4 if ("_k2" in k or "_k3" in k or k == "k3_kl") else 1e-5
            assert_same(want.metrics[k], got.metrics[k], f"{what} metrics[{k!r}]", rtol=rtol, atol=1e-7)
    assert counters["stats"]["unique_graphs"] > graphs
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])  # one graph, no break
