"""The policy losses and the Megatron loss on the hot path: no host synchronisation, tensors on their inputs' device.

Counted with :class:`slime_rc.testing.host_reads.HostReads` (every device->host read, data-dependent size and
blocking host->device copy, on the CPU too).  Each read is attributed by its stack: inside
``compute_rollout_correction`` it is the engine's; in ``DeferredChecks.raise_if_any`` it is the call's one sanctioned
read (``on_nonfinite='error'``); anything else is the loss code's own.  The loss code's own reads must be 0; the
totals (the engine included) 0 with ``on_nonfinite='reject'`` and at most 1 with ``'error'``.  On the ``meta``
device any host read raises, so a loss that runs there reads nothing and creates nothing off its inputs' device.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, compute_policy_loss, cu_seqlens_from_lengths
from slime_rc.correction.reducer import LocalReducer
from slime_rc.slime.tis_bridge import tis_function_correction_for
from slime_rc.testing.host_reads import HostReads
from tests.test_losses import CONFIGS, _batch, _micro_batch

ENGINE = "compute_rollout_correction"
NO_ENGINE = [n for n, c in CONFIGS.items() if not (c.corrects or c.get_mismatch_metrics)]


def _cfg(name: str, on_nonfinite: str) -> RolloutCorrectionConfig:
    return dataclasses.replace(CONFIGS[name], on_nonfinite=on_nonfinite)


def _split(reads: HostReads) -> Dict[str, List]:
    """The events of ``reads`` as ``{"engine": [...], "checks": [...], "own": [...]}`` (see the module docstring)."""
    out = {"engine": [], "checks": [], "own": []}
    for event in reads.events:
        where = event[2]
        if f" {ENGINE}:" in where:
            out["engine"].append(event)
        elif "checks.py" in where and " raise_if_any:" in where:
            out["checks"].append(event)
        else:
            out["own"].append(event)
    return out


def _report(events) -> str:
    return "\n".join(f"{what} [{op}]\n{where}" for what, op, where in events)


def _count(fn):
    with HostReads(stack_depth=64) as reads:
        result = fn()
    return result, reads


def _loss_call(name: str, mode: str, seed: int = 0, lengths=(5, 1, 7, 3, 6)):
    b = _batch(seed, lengths=lengths)
    lp = b["theta"].clone().requires_grad_(True)
    cfg = _cfg(name, mode)
    return lambda: compute_policy_loss(lp, b["old"], b["rollout"], b["adv"], b["mask"], b["cu"], cfg)


def _tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
                  response_lengths):
    """A slime-contract function with no host read of its own: weights exp(train - rollout) capped at 2, the masks
    as given (full length), one per-token metric."""
    log_ratio = torch.cat(train_log_probs) - torch.cat(rollout_log_probs)
    return pg_loss * torch.exp(log_ratio).clamp(max=2.0), list(loss_masks), {"log_ratio": log_ratio}


def _tis_micro_batch(device="cpu"):
    from slime_rc.slime.tis_bridge import with_sample_fields
    b = _batch(13)
    cu = b["cu"]
    b["mask"][cu[1:] - 1] = 0.0  # the last position of a sequence has no target
    mb, logits = _micro_batch(b, 0, 5, seed=4)
    mb = with_sample_fields(mb)  # pre-step data preparation (host lists), outside the counted region
    mb["position_ids"] = torch.cat([torch.arange(int(n)) for n in cu[1:] - cu[:-1]])
    mb = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
    mb["sample_loss_masks"] = [m.to(device) for m in mb["sample_loss_masks"]]
    return mb, logits.to(device)


@pytest.fixture
def local_cp(monkeypatch):
    """make_loss_func's loss_fn in one process: its CP reducer (megatron's CP group) is a LocalReducer."""
    import slime_rc.megatron.loss as megatron_loss
    monkeypatch.setattr(megatron_loss, "_cp_reducer", LocalReducer)


# ---- the loss code's own reads: none ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compute_policy_loss_makes_no_host_read_of_its_own(name, mode):
    (loss, metrics), reads = _count(_loss_call(name, mode))
    parts = _split(reads)
    assert torch.isfinite(loss) and "pg_loss" in metrics
    assert not parts["own"], _report(parts["own"])
    assert len(parts["checks"]) == (1 if mode == "error" else 0), _report(parts["checks"])


@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("variant", ["in_loss", "prepared", "tis_function"])
def test_megatron_loss_function_makes_no_host_read_of_its_own(variant, mode, local_cp):
    from slime_rc.megatron.loss import make_loss_func, policy_loss, prepare_global_batch
    cfg = _cfg("decoupled_seq_tis_rs", mode)
    b = _batch(12)
    mb, logits = _micro_batch(b, 0, 5, seed=1)
    if variant == "in_loss":
        loss_fn = make_loss_func(cfg)
        call = lambda: loss_fn(logits, mb)  # noqa: E731
    elif variant == "prepared":
        (p,) = prepare_global_batch([mb], cfg, reducer=LocalReducer())
        call = lambda: policy_loss(logits, mb, cfg, prepared=p, reducer=LocalReducer())  # noqa: E731
    else:
        mb, logits = _tis_micro_batch()
        loss_fn = make_loss_func(cfg, external=tis_function_correction_for(_tis_function, None))
        call = lambda: loss_fn(logits, mb)  # noqa: E731
    (loss, metrics), reads = _count(call)
    parts = _split(reads)
    assert torch.isfinite(loss) and float(metrics["pg_loss"]) != 0.0
    if variant == "tis_function":
        assert "rollout_corr/tis_function/log_ratio" in metrics
    assert not parts["own"], _report(parts["own"])
    assert len(parts["checks"]) == (1 if mode == "error" else 0), _report(parts["checks"])


def test_vocab_parallel_log_probs_makes_no_host_read():
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 17, generator=g, requires_grad=True)
    target = torch.randint(0, 17, (9,), generator=g)
    (lp, ent), reads = _count(lambda: vocab_parallel_log_probs(logits, target, 0.8, with_entropy=True))
    assert reads.count == 0, reads.report()
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.8, -1).gather(-1, target[:, None])[:, 0])
    assert bool((ent > 0).all())


@pytest.mark.parametrize("mode", ["reject", "error"])
def test_prepare_global_batch_reads_do_not_grow_with_the_batch(mode):
    """The pre-step path outside the engine reads nothing (whatever the number of sequences and micro-batches);
    with 'error' it reads its deferred checks once."""
    from slime_rc.megatron.loss import prepare_global_batch
    cfg = _cfg("decoupled_veto_norm", mode)
    counts = {}
    for n_seq, n_mb in ((4, 2), (40, 8)):
        b = _batch(3, lengths=tuple(3 + (i * 5) % 7 for i in range(n_seq)))
        edges = [round(i * n_seq / n_mb) for i in range(n_mb + 1)]
        mbs = [_micro_batch(b, lo, hi)[0] for lo, hi in zip(edges[:-1], edges[1:])]
        prepared, reads = _count(lambda: prepare_global_batch(mbs, cfg, reducer=LocalReducer()))
        assert len(prepared) == n_mb
        parts = _split(reads)
        assert not parts["own"], _report(parts["own"])
        assert len(parts["checks"]) == (1 if mode == "error" else 0), _report(parts["checks"])
        counts[n_seq] = reads.count
    assert counts[4] == counts[40], counts  # the engine's reads included


# ---- the totals, engine included (they need the engine's deferred checks) -------------------------------
@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compute_policy_loss_total_host_reads(name, mode):
    _, reads = _count(_loss_call(name, mode))
    assert reads.count <= (1 if mode == "error" else 0), reads.report()


@pytest.mark.parametrize("mode", ["reject", "error"])
@pytest.mark.parametrize("variant", ["in_loss", "prepared", "tis_function"])
def test_megatron_loss_function_total_host_reads(variant, mode, local_cp):
    from slime_rc.megatron.loss import make_loss_func, policy_loss, prepare_global_batch
    cfg = _cfg("decoupled_token_tis", mode)
    b = _batch(12)
    mb, logits = _micro_batch(b, 0, 5, seed=1)
    if variant == "prepared":
        (p,) = prepare_global_batch([mb], cfg, reducer=LocalReducer())
        _, reads = _count(lambda: policy_loss(logits, mb, cfg, prepared=p, reducer=LocalReducer()))
    elif variant == "tis_function":
        mb, logits = _tis_micro_batch()
        loss_fn = make_loss_func(cfg, external=tis_function_correction_for(_tis_function, None))
        _, reads = _count(lambda: loss_fn(logits, mb))
    else:
        loss_fn = make_loss_func(cfg)
        _, reads = _count(lambda: loss_fn(logits, mb))
    assert reads.count <= (1 if mode == "error" else 0), reads.report()


@pytest.mark.parametrize("mode", ["reject", "error"])
def test_diffusion_makes_no_host_read_of_its_own(mode):
    from slime_rc import parse_rejection_criteria
    from slime_rc.diffusion import compute_diffusion_rollout_correction, compute_diffusion_step_loss
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 2, generator=g)
    rollout = old + 0.2 * torch.randn(6, 2, generator=g)
    adv = torch.randn(6, generator=g)
    dec = RolloutCorrectionConfig(is_level="sequence", rs=parse_rejection_criteria("seq_mean_k1", "0.5_2.0"),
                                  on_nonfinite=mode)
    byp = RolloutCorrectionConfig(mode="bypass", loss_type="reinforce", is_level="sequence", on_nonfinite=mode)
    out, reads = _count(lambda: compute_diffusion_rollout_correction(old, rollout, dec))
    assert not _split(reads)["own"], _report(_split(reads)["own"])
    lp = old[:, 0].clone().requires_grad_(True)
    for call in (lambda: compute_diffusion_step_loss(lp, old[:, 0], rollout[:, 0], adv, dec,
                                                     rollout_is_weights=out.rollout_is_weights[:, 0]),
                 lambda: compute_diffusion_step_loss(lp, None, rollout[:, 0], adv, byp)):
        (loss, _), reads = _count(call)
        parts = _split(reads)
        assert torch.isfinite(loss)
        assert not parts["own"], _report(parts["own"])
        assert len(parts["checks"]) == (1 if mode == "error" else 0), _report(parts["checks"])


# ---- value checks: deferred, still naming the tensor, the sample and the position ---------------------------------
def test_nonfinite_advantage_on_a_kept_token_raises_naming_it_once():
    b = _batch(2)
    b["adv"][8] = float("nan")  # sequence 2 (lengths 5, 1, 7, ...), position 2
    b["mask"][8] = 1.0
    lp = b["theta"].clone().requires_grad_(True)
    cfg = _cfg("standard", "error")
    with HostReads() as reads:
        with pytest.raises(ValueError, match=r"advantages .*sample 2, position 2 \(packed token 8\) = nan"):
            compute_policy_loss(lp, b["old"], b["rollout"], b["adv"], b["mask"], b["cu"], cfg)
    assert reads.count >= 1  # the slow path may read: it is raising anyway
    # on a masked-out token the value never reaches the loss: no error
    b["mask"][8] = 0.0
    loss, _ = compute_policy_loss(lp, b["old"], b["rollout"], b["adv"], b["mask"], b["cu"], cfg)
    assert torch.isfinite(loss)


def test_tis_bridge_layout_check_is_deferred_and_still_names_the_sample(local_cp):
    from slime_rc.megatron.loss import make_loss_func
    mb, logits = _tis_micro_batch()
    mb["position_ids"] = mb["position_ids"].clone()
    mb["position_ids"][7:9] = mb["position_ids"][7:9].flip(0)  # sample 2 (lengths 5, 1, 7, ...): swapped
    cfg = _cfg("decoupled_token_tis", "error")
    with pytest.raises(ValueError, match=r"sample 2 .*this rank holds response positions .*packed_zigzag_positions"):
        make_loss_func(cfg, external=tis_function_correction_for(_tis_function, None))(logits, mb)
    with pytest.raises(RuntimeError, match="zigzag layout"):  # reject mode: a device-side assert (CPU: raises)
        make_loss_func(_cfg("decoupled_token_tis", "reject"),
                       external=tis_function_correction_for(_tis_function, None))(logits, mb)


# ---- on the meta device: no host read is possible, and nothing may be created off the inputs' device ---------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compute_policy_loss_runs_on_the_meta_device(name):
    b = {k: v.to("meta") for k, v in _batch(0).items()}
    lp = b["theta"].clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp, b["old"], b["rollout"], b["adv"], b["mask"], b["cu"],
                                        _cfg(name, "reject"))
    loss.backward()
    assert loss.device.type == "meta" and lp.grad.device.type == "meta" and lp.grad.shape == lp.shape
    assert {v.device.type for v in metrics.values()} == {"meta"}


@pytest.mark.parametrize("name", NO_ENGINE)
def test_megatron_loss_runs_on_the_meta_device(name):
    from slime_rc.megatron.loss import policy_loss
    b = _batch(12)
    mb, logits = _micro_batch(b, 0, 5, seed=1)
    mb = {k: v.to("meta") for k, v in mb.items()}
    loss, metrics = policy_loss(logits.to("meta"), mb, _cfg(name, "reject"), reducer=LocalReducer())
    assert loss.device.type == "meta" and {v.device.type for v in metrics.values()} == {"meta"}


def test_tis_bridge_runs_on_the_meta_device():
    from slime_rc.slime.tis_bridge import tis_function_correction
    mb, _ = _tis_micro_batch("meta")
    corr = tis_function_correction(_tis_function, None, mb, mb["old_log_probs"],
                                   config=_cfg("decoupled_token_tis", "reject"))
    assert corr.keep_mask.device.type == "meta" and corr.is_weights.device.type == "meta"
    assert corr.keep_mask.shape == mb["loss_mask"].shape
    assert {v.device.type for v in corr.metrics.values()} == {"meta"}


def test_token_mean_coefficients_equal_the_host_computed_ones():
    """The token-mean coefficient is computed on the device (no float() of the denominator): the same float32."""
    from slime_rc.losses import _token_coefficients, loss_normalizer
    cfg = RolloutCorrectionConfig(loss_agg="token_mean")
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    cu = cu_seqlens_from_lengths([3, 4])
    norm = loss_normalizer(mask, cu)
    coef = _token_coefficients(norm, cfg, cu, 7)
    want = torch.full((7,), 1.0 / max(float(norm.tokens), 1.0))
    assert coef.dtype == torch.float32 and torch.equal(coef, want)
