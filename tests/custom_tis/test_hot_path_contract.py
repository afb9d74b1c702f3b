"""The TIS functions slime loads (``custom_tis``) on the hot path: no host synchronisation of their own
per call, at most one in all (the deferred checks, read once at the end) and none with the engine's
``on_nonfinite='reject'``; tensors on the inputs' device; a fixed number of kernels whatever the number of samples;
the zigzag positions and full-length masks as megatron's layout has them."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace as NS

import pytest
import torch

from slime_rc.slime.tis_contract import Batch
from custom_tis.icepop import compute_icepop_weights, compute_icepop_weights_with_cp
from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp
from custom_tis.tis import compute_tis_weights, compute_tis_weights_with_cp
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.checks import DeferredChecks
from slime_rc.megatron.cp_layout import zigzag_response_indices
from slime_rc.slime.mis import NonFiniteLogProbs
from slime_rc.testing.host_reads import HostReads, KernelsFrom
from tests.slime_reference import make_samples, rank_inputs

OWN = ("slime_rc/slime/", "custom_tis/")

# slime's semantics (no config: slime's example raises on bad input, so one read at the end)
SLIME_KEYS = {
    "mis_token_truncate": dict(use_tis=True),
    "mis_token_mask_rs_veto_bn": dict(use_tis=True, tis_mode="mask", use_rs=True, rs_level="token",
                                      rs_veto_threshold=1e-4, tis_batch_normalize=True),
    "mis_sequence_clip_rs_geo": dict(use_tis=True, tis_level="sequence", tis_mode="clip", use_rs=True,
                                     rs_level="geometric", tis_batch_normalize=True),
    "mis_metrics_only": dict(),
}
# slime-rc's engine behind the contract, in both on_nonfinite modes
ENGINE = {
    "engine_seq_tis_rs": RolloutCorrectionConfig(is_level="sequence", is_upper_bound=1.6),
    "engine_token_veto_norm": RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, veto_threshold=0.6),
}


def _calls(args, cp=1, rank=0, samples=None):
    """``{form: call}`` for the CP and list forms of every function."""
    samples = make_samples(0) if samples is None else samples
    idx, inputs = rank_inputs(samples, cp, rank)
    pg = torch.randn(sum(len(i) for i in idx), generator=torch.Generator().manual_seed(1))
    lists = dict(train_log_probs=[s["train"] for s in samples], rollout_log_probs=[s["rollout"] for s in samples],
                 loss_masks=[s["mask"] for s in samples])
    return {
        "mis_cp": lambda: compute_mis_weights_with_cp(args, pg_loss=pg, **inputs),
        "mis_lists": lambda: compute_mis_weights(args, **lists),
        "tis_cp": lambda: compute_tis_weights_with_cp(args, pg_loss=pg, **inputs),
        "tis_lists": lambda: compute_tis_weights(args, **lists),
        "icepop_cp": lambda: compute_icepop_weights_with_cp(args, pg_loss=pg, **inputs),
        "icepop_lists": lambda: compute_icepop_weights(args, **lists),
    }


def _count(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn()  # the first call resolves and caches the settings
        with HostReads(stack_depth=1) as reads:
            fn()
    return reads


def _own(reads):
    return [e for e in reads.events if any(o in e[2].split("\n")[0] for o in OWN)]


@pytest.mark.parametrize("name", sorted(SLIME_KEYS))
def test_slime_semantics_read_the_host_once_at_most_and_never_of_their_own(name):
    for form, call in _calls(NS(**SLIME_KEYS[name], tis_clip=1.8, tis_clip_low=0.2)).items():
        reads = _count(call)
        assert _own(reads) == [], (form, reads.report())
        assert reads.count <= 1, (form, reads.report())


@pytest.mark.parametrize("on_nonfinite", ["reject", "error"])
@pytest.mark.parametrize("name", sorted(ENGINE))
def test_engine_behind_the_contract_reads_nothing_with_reject_and_once_at_most_with_error(name, on_nonfinite):
    args = NS(rollout_correction_config=replace(ENGINE[name], on_nonfinite=on_nonfinite))
    for form, call in _calls(args).items():
        reads = _count(call)
        assert _own(reads) == [], (form, reads.report())
        # IcePop is IcePop under a launch config too (its band from the config): its non-finite check is read once
        engine = not form.startswith("icepop")
        assert reads.count == 0 if on_nonfinite == "reject" and engine else reads.count <= 1, (form, reads.report())


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_positions_and_full_length_masks_are_megatrons_layout(cp):
    """The positions from the runs equal ``zigzag_response_indices``; the full-length masks hold the decisions at
    this rank's positions and the original mask times the sequence decision elsewhere (per sample, as before)."""
    samples = make_samples(3)
    for rank in range(cp):
        idx, inputs = rank_inputs(samples, cp, rank)
        batch = Batch(inputs["train_log_probs"], inputs["rollout_log_probs"], inputs["loss_masks"],
                      inputs["total_lengths"], inputs["response_lengths"], (cp, rank))
        want = [zigzag_response_indices(s["P"] + s["R"], s["R"], cp, rank) for s in samples]
        assert torch.equal(batch.positions, torch.cat(want))
        assert batch.sample_of_token.tolist() == [i for i, w in enumerate(want) for _ in range(w.numel())]
        keep = (torch.arange(batch.positions.numel()) % 3 != 0).float()
        seq_keep = torch.tensor([i % 2 == 0 for i in range(len(samples))])
        masks = batch.full_length_masks(keep, seq_keep)
        expected = [((m != 0) & s).to(m.dtype).index_copy(0, j, k.to(m.dtype))
                    for m, j, k, s in zip(inputs["loss_masks"], want, keep.split([w.numel() for w in want]), seq_keep)]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(masks, expected))


@pytest.mark.parametrize("keys", [dict(use_tis=True, tis_mode="mask", use_rs=True, rs_veto_threshold=1e-4),
                                  dict(rollout_correction_config=ENGINE["engine_seq_tis_rs"])],
                         ids=["slime", "engine"])
def test_kernels_do_not_grow_with_the_number_of_samples(keys):
    counts = []
    for n in (7, 14):
        calls = _calls(NS(**keys), samples=make_samples(0, n=n))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calls["mis_cp"]()
            with KernelsFrom(OWN) as ops:
                calls["mis_cp"]()
        counts.append(len(ops.ops))
    assert counts[0] == counts[1] and counts[0] > 0, counts


def test_checks_keep_their_messages_and_types():
    samples = make_samples(0)
    samples[3]["rollout"][4] = float("nan")
    samples[3]["mask"][4] = 1
    calls = _calls(NS(use_tis=True), samples=samples)
    for form in ("mis_cp", "tis_cp", "icepop_cp"):
        with pytest.raises(NonFiniteLogProbs, match="rollout_log_probs is nan at sample 3, response position 4"):
            calls[form]()
    # engine with reject: rejected on the device, no read, no raise
    args = NS(rollout_correction_config=replace(ENGINE["engine_seq_tis_rs"], on_nonfinite="reject"))
    reads = _count(_calls(args, samples=samples)["mis_cp"])
    assert reads.count == 0, reads.report()
    out, masks, _ = _calls(args, samples=samples)["mis_cp"]()
    assert bool(torch.isfinite(out).all()) and int(masks[3].sum()) == 0  # the whole sequence is rejected
    # a loss mask that is not 0/1: ValueError with one read (slime's semantics); a device assert with reject
    bad = make_samples(0)
    bad[2]["mask"] = bad[2]["mask"] * 2
    with pytest.raises(ValueError, match="loss_masks must hold only 0 and 1"):
        _calls(NS(use_tis=True), samples=bad)["mis_cp"]()
    with pytest.raises(RuntimeError, match="loss_masks must hold only 0 and 1"):
        _calls(args, samples=bad)["mis_cp"]()


def _meta_inputs(samples, cp, rank):
    idx, inputs = rank_inputs(samples, cp, rank)
    lists = ("train_log_probs", "rollout_log_probs", "loss_masks")
    meta = {k: [torch.empty_like(t, device="meta") for t in v] if k in lists else v for k, v in inputs.items()}
    return torch.empty(sum(len(i) for i in idx), device="meta"), meta


def test_batch_and_engine_path_run_on_the_meta_device():
    """Meta tensors raise on any host read: the contract's plumbing (CP layout, full-length masks) and the engine
    path with reject run end to end there, and every output follows the inputs' device."""
    samples = make_samples(0)
    _, meta = _meta_inputs(samples, 2, 1)
    batch = Batch(meta["train_log_probs"], meta["rollout_log_probs"], meta["loss_masks"], meta["total_lengths"],
                  meta["response_lengths"], (2, 1), checks=DeferredChecks(read=False))
    assert batch.train.device.type == batch.positions.device.type == batch.cu_seqlens.device.type == "meta"
    masks = batch.full_length_masks(torch.ones_like(batch.mask), torch.ones(len(samples), dtype=torch.bool,
                                                                            device="meta"))
    assert [(m.device.type, m.shape, m.dtype) for m in masks] == [("meta", s["mask"].shape, s["mask"].dtype)
                                                                  for s in samples]
    pg, meta = _meta_inputs(samples, 1, 0)
    args = NS(rollout_correction_config=replace(ENGINE["engine_token_veto_norm"], on_nonfinite="reject"))
    for fn in (compute_mis_weights_with_cp, compute_tis_weights_with_cp):
        out, masks, metrics = fn(args, pg_loss=pg, **meta)
        assert out.device.type == "meta" and out.shape == pg.shape
        assert [(m.device.type, m.shape, m.dtype) for m in masks] == [("meta", s["mask"].shape, s["mask"].dtype)
                                                                      for s in samples]
        assert metrics and all(v.device.type == "meta" for v in metrics.values())
