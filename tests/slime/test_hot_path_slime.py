"""slime's custom loss on the hot path: no host synchronisation per micro-batch, tensors on the inputs'
device, a fixed number of kernels whatever the number of samples.

* :class:`~slime_rc.testing.host_reads.HostReads` around ``policy_loss_function`` in every mode (correction off,
  decoupled TIS, bypass PPO, bypass REINFORCE + IS; per-sample and per-token loss): none of its own reads, none in
  all with ``on_nonfinite='reject'``, at most one with ``'error'`` (the deferred checks, read once at the end);
* the whole loss (forward and backward) on the ``meta`` device, where any host read raises;
* the index tensors built from slime's Python ints equal megatron's zigzag layout (``slime_rc.megatron.cp_layout``)
  under context parallelism, and the number of kernels does not grow with the number of samples.
"""

from __future__ import annotations

import math
import traceback
import warnings
from dataclasses import replace

import pytest
import torch

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.megatron.cp_layout import response_positions, response_runs, zigzag_token_positions
from slime_rc.slime import policy_loss_function
from slime_rc.slime.policy_loss import _Layout
from slime_rc.testing.host_reads import HostReads, KernelsFrom
from tests.slime.test_policy_loss import PAD, SAMPLES, make_batch, slime_args
from tests.test_losses import CONFIGS

OWN = ("slime_rc/slime/", "custom_tis/")  # the files of this surface; the engine and losses are counted in totals

# every mode of the custom loss: (name, config or None for slime's own flags, extra slime args)
MODES = {
    "off": (RolloutCorrectionConfig(), {}),
    "off_slime_flags": (None, {}),
    "decoupled_token_tis": (CONFIGS["decoupled_token_tis"], {}),
    "decoupled_seq_tis_rs": (CONFIGS["decoupled_seq_tis_rs"], {}),
    "decoupled_veto_norm": (CONFIGS["decoupled_veto_norm"], {}),
    "decoupled_slime_flags_tis": (None, dict(use_tis=True, tis_clip=1.5)),
    "bypass_ppo": (CONFIGS["bypass_ppo"], {}),
    "bypass_ppo_rs_is": (CONFIGS["bypass_ppo_rs_diag_is"], {}),
    "bypass_reinforce_seq_is": (CONFIGS["bypass_reinforce_seq_is"], {}),
    "bypass_reinforce_geo_rs_token": (CONFIGS["bypass_reinforce_geo_rs_token"], {}),
}


def _args(mode: str, per_token: bool, on_nonfinite: str = "error"):
    config, extra = MODES[mode]
    kw = dict(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.05, calculate_per_token_loss=per_token, **extra)
    if config is None:  # slime's own flags (on_nonfinite: slime-rc's default, 'error')
        assert on_nonfinite == "error"
        return slime_args(**kw)
    config = replace(config, loss_agg="token_mean" if per_token else "sample_mean", on_nonfinite=on_nonfinite)
    return slime_args(rollout_correction_config=config, use_rollout_logprobs=config.mode == "bypass", **kw)


def own_events(reads: HostReads):
    """The reads whose innermost slime-rc frame lies in this surface's files."""
    return [e for e in reads.events if any(o in e[2].split("\n")[0] for o in OWN)]


def count_reads(fn):
    fn()  # the first call resolves and caches the config
    with HostReads(stack_depth=1) as reads:
        fn()
    return reads


MODE_IDS = sorted(MODES)


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_no_host_read_of_its_own_and_at_most_one_in_all(mode, per_token):
    batch, logits = make_batch(3)
    modes = ("reject", "error") if MODES[mode][0] is not None else ("error",)
    for on_nonfinite in modes:
        args = _args(mode, per_token, on_nonfinite)
        reads = count_reads(lambda: policy_loss_function(args, batch, logits, None))
        assert own_events(reads) == [], reads.report()
        if on_nonfinite == "reject":
            assert reads.count == 0, reads.report()
        else:
            assert reads.count <= 1, reads.report()


def test_one_deferred_check_still_names_sample_and_position_and_reject_mode_reads_nothing():
    """Deferring the checks keeps the messages (error) and the rejection of non-finite log-probs (reject)."""
    batch, logits = make_batch(0)
    bad = dict(batch, advantages=[a.clone() for a in batch["advantages"]])
    bad["advantages"][4][0] = float("inf")
    with pytest.raises(ValueError, match=r"batch\['advantages'\] is inf at a loss token \(sample 4, response token 0\)"):
        policy_loss_function(_args("decoupled_token_tis", False), bad, logits, None)
    # reject: a NaN rollout log-prob on a loss token is rejected on the device, with no host read at all
    nan = dict(batch, rollout_log_probs=[r.clone() for r in batch["rollout_log_probs"]])
    nan["rollout_log_probs"][1][2] = float("nan")
    args = _args("decoupled_token_tis", False, "reject")
    reads = count_reads(lambda: policy_loss_function(args, nan, logits, None))
    assert reads.count == 0, reads.report()
    x = logits.clone().requires_grad_(True)
    loss, log = policy_loss_function(args, nan, x, None)
    loss.backward()
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(x.grad).all())
    assert float(log["rollout_corr/nonfinite_seq_fraction"]) > 0 and float(log["rollout_corr/rejected_seq_fraction"]) > 0
    assert float(policy_loss_function(args, batch, logits, None)[1]["rollout_corr/rejected_seq_fraction"]) == 0
    # reject mode cannot read: a non-finite advantage is a device-side assert (RuntimeError at once on the CPU)
    with pytest.raises(RuntimeError, match=r"batch\['advantages'\] is not finite at a loss token"):
        policy_loss_function(_args("decoupled_token_tis", False, "reject"), bad, logits, None)


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, list):
        return [_meta(v) for v in x]
    return x


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("mode", [m for m in MODE_IDS if MODES[m][0] is not None])
def test_the_whole_loss_runs_on_the_meta_device(mode, per_token):
    """Meta tensors raise on any host read: in reject mode forward and backward run and every output follows the
    logits' device; in error mode the one read is the deferred checks' at the end."""
    batch, logits = make_batch(3)
    meta_batch = {k: _meta(v) for k, v in batch.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = _meta(logits).requires_grad_(True)
        loss, log = policy_loss_function(_args(mode, per_token, "reject"), meta_batch, x, None)
        loss.backward()
    assert loss.device.type == "meta" and x.grad.shape == logits.shape
    assert log and all(v.device.type == "meta" and v.shape == () for v in log.values())
    with pytest.raises(Exception) as info:
        policy_loss_function(_args(mode, per_token, "error"), meta_batch, _meta(logits), None)
    last = [f for f in traceback.extract_tb(info.value.__traceback__)
            if "site-packages" not in f.filename and ("/slime_rc/" in f.filename or "/custom_tis/" in f.filename)]
    assert last[-1].filename.endswith("slime_rc/correction/checks.py") and last[-1].name == "raise_if_any", last[-1]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_response_runs_are_megatrons_zigzag_layout(cp_size):
    for total in range(1, 40):
        for resp in range(0, total):
            for rank in range(cp_size):
                pos = zigzag_token_positions(total, cp_size, rank)
                here, j = response_positions(pos, total, resp)
                local, runs = response_runs(total, resp, cp_size, rank)
                assert local == pos.numel()
                rows = [at + i for at, _, n in runs for i in range(n)]
                js = [j0 + i for _, j0, n in runs for i in range(n)]
                assert rows == torch.nonzero(here).reshape(-1).tolist(), (total, resp, cp_size, rank)
                assert js == j[here].tolist(), (total, resp, cp_size, rank)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_layout_equals_the_per_sample_construction_under_cp(cp_size):
    """Rows, target tokens, masks and cu_seqlens from the runs equal the per-sample construction of the zigzag
    layout (one nonzero / mask index per sample, as the loss built them before)."""
    batch, _ = make_batch(2)
    batch["loss_masks"][0][1] = 0
    for rank in range(cp_size):
        rows, targets, mask, counts, offset = [], [], [], [], 0
        for tok, total, resp, m in zip(batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
                                       batch["loss_masks"]):
            pos = zigzag_token_positions(total, cp_size, rank)
            here, j = response_positions(pos, total, resp)
            rows.append(offset + torch.nonzero(here).reshape(-1))
            targets.append(tok[pos[here] + 1])
            mask.append(m[j[here]] != 0)
            counts.append(int(here.sum()))
            offset += pos.numel()
        layout = _Layout(batch, offset, cp_size, rank, torch.device("cpu"))
        assert torch.equal(layout.rows, torch.cat(rows))
        assert torch.equal(layout.targets, torch.cat(targets).long())
        assert torch.equal(layout.mask, torch.cat(mask))
        assert layout.counts == counts
        assert layout.cu_seqlens.tolist() == [0] + torch.tensor(counts).cumsum(0).tolist()
        assert torch.equal(layout.sample_of_token, torch.repeat_interleave(torch.arange(len(counts)),
                                                                           torch.tensor(counts)))
        sums = [float(m.sum()) for m in batch["loss_masks"]]
        assert layout.full_mask_sums.tolist() == sums and layout.full_mask_sums.dtype == torch.float64


def _doubled():
    """make_batch(3) followed by make_batch(4): twice the samples."""
    (a, la), (b, lb) = make_batch(3), make_batch(4)
    batch = {k: (a[k] + b[k] if isinstance(a[k], list) else torch.cat([a[k], b[k]])) for k in a}
    return batch, torch.cat([la[:, :-PAD], lb], 1)


@pytest.mark.parametrize("mode", ["off", "decoupled_seq_tis_rs", "bypass_reinforce_seq_is"])
def test_kernels_do_not_grow_with_the_number_of_samples(mode):
    one = make_batch(3)
    two = _doubled()
    assert len(two[0]["loss_masks"]) == 2 * len(SAMPLES)
    counts = []
    for batch, logits in (one, two):
        args = _args(mode, False)
        policy_loss_function(args, batch, logits, None)
        with KernelsFrom(OWN) as ops:
            policy_loss_function(args, batch, logits, None)
        counts.append(ops.ops)
    assert len(counts[0]) == len(counts[1]), (len(counts[0]), len(counts[1]))
