"""The engine on the hot path: no host synchronisation, every tensor on the inputs' device.

Counted with ``slime_rc.testing.host_reads.HostReads`` (a dispatch mode that sees ``.item()``/``int()``/``bool()``,
data-dependent sizes, ``torch.tensor(data)`` and ``.tolist()`` even on the CPU): with ``on_nonfinite='reject'``
``compute_rollout_correction`` makes none, with ``'error'`` exactly one (the deferred check), whatever the config
and the number of sequences; a bad value is still an error naming what to fix.  On the ``meta`` device, where any
host read raises, the engine runs whole and every output stays on ``meta``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths, \
    parse_rejection_criteria
from slime_rc.correction.checks import DeferredChecks
from slime_rc.testing.host_reads import HostReads

RS = parse_rejection_criteria
CONFIGS = {
    "metrics_only": RolloutCorrectionConfig(get_mismatch_metrics=True),
    "token_tis_rs_veto_norm": RolloutCorrectionConfig(is_level="token", is_batch_normalize=True, veto_threshold=1e-4,
                                                      rs=RS("token", 2.0)),
    "token_clip": RolloutCorrectionConfig(is_level="token", is_mode="clip", is_lower_bound=0.8),
    "token_mask": RolloutCorrectionConfig(is_level="token", is_mode="mask", is_upper_bound=1.3),
    "sequence_tis_geo_rs": RolloutCorrectionConfig(is_level="sequence", is_batch_normalize=True,
                                                   rs=RS("geometric", "0.8_1.25")),
    "geometric_mask": RolloutCorrectionConfig(is_level="geometric", is_mode="mask", is_upper_bound=1.05),
    "k_options": RolloutCorrectionConfig(rs=RS("token_k2,seq_sum_k3,seq_mean_k1,seq_max_k2", "0.5,4,0.7_1.4,0.3")),
    "rs_and_veto_only": RolloutCorrectionConfig(rs=RS("sequence", "0.1_10"), veto_threshold=0.05),
}


def _batch(n_seqs: int, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n_seqs,), generator=g)
    n = int(lengths.sum())
    rollout = -torch.rand(n, generator=g) * 3
    train = rollout + 0.3 * torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()
    cu = cu_seqlens_from_lengths(lengths)
    return [t.to(device) for t in (train, rollout, mask, cu)]


def _reads(batch, config, **kw) -> HostReads:
    compute_rollout_correction(*batch, config, **kw)  # warm: one-time per-device caches are not the hot path
    with HostReads() as reads:
        compute_rollout_correction(*batch, config, **kw)
    return reads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_read_with_reject_one_with_error(name):
    batch = _batch(12)
    reject = _reads(batch, replace(CONFIGS[name], on_nonfinite="reject"))
    assert reject.count == 0, reject.report()
    error = _reads(batch, replace(CONFIGS[name], on_nonfinite="error"))
    assert error.count == 1, error.report()
    assert "raise_if_any" in error.events[0][2]  # the one read is the deferred check


def test_count_does_not_grow_with_the_number_of_sequences():
    config = replace(CONFIGS["token_tis_rs_veto_norm"], on_nonfinite="error")
    counts = {b: _reads(_batch(b, seed=b), config).count for b in (1, 8, 96)}
    assert set(counts.values()) == {1}, counts


def test_a_caller_collects_the_engines_checks_and_reads_once():
    batch = _batch(6)
    config = CONFIGS["token_tis_rs_veto_norm"]
    checks = DeferredChecks()
    with HostReads() as reads:
        compute_rollout_correction(*batch, config, checks=checks)
        assert reads.count == 0, reads.report()  # nothing read until the caller asks
        assert len(checks) == 2  # malformed input, non-finite log-probs
        checks.raise_if_any()
    assert reads.count == 1, reads.report()


def test_the_counter_sees_what_it_must():
    """The instrument itself: each kind of synchronisation the engine used to make is counted."""
    x = torch.arange(6.0)
    with HostReads() as reads:
        int(x[0]), bool(x.any()), x.tolist(), torch.tensor([1.0]), x[x > 2], torch.bincount(x.long()), \
            torch.repeat_interleave(x, torch.ones(6, dtype=torch.int64))
    kinds = " ".join(reads.by_kind())
    for word in ("scalar read", "tolist", "torch.tensor", "boolean-mask", "bincount", "repeat_interleave"):
        assert word in kinds, (word, reads.report())
    with HostReads() as quiet:
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.int64), output_size=6), (x * 2).sum(), x.cumsum(0)
    assert quiet.count == 0, quiet.report()


def test_errors_still_name_sample_and_position():
    train, rollout, mask, cu = _batch(5)
    mask[:] = 1.0
    k = int(cu[3]) + 2
    train[k] = float("nan")
    with pytest.raises(ValueError, match=rf"train_log_probs is nan at sample 3, position 2 \(packed index {k}\)"):
        compute_rollout_correction(train, rollout, mask, cu, CONFIGS["token_tis_rs_veto_norm"])
    bad_cu = cu.clone()
    bad_cu[2] = bad_cu[3] + 1
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        compute_rollout_correction(rollout, rollout, mask, bad_cu, CONFIGS["token_tis_rs_veto_norm"])
    half = mask.clone()
    half[0] = 0.5
    with pytest.raises(ValueError, match=r"loss_mask must hold only 0 and 1"):
        compute_rollout_correction(rollout, rollout, half, cu, CONFIGS["token_tis_rs_veto_norm"])


def test_malformed_input_with_reject_is_an_assertion_without_a_read():
    """With ``on_nonfinite='reject'`` there is no read to spend: malformed ``cu_seqlens`` is a device-side assert
    (on the CPU it raises at once, with the message naming the argument)."""
    train, rollout, mask, cu = _batch(5)
    config = replace(CONFIGS["token_tis_rs_veto_norm"], on_nonfinite="reject")
    short = cu.clone()
    short[-1] -= 1
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0, be non-decreasing and end at the token count"):
        compute_rollout_correction(train, rollout, mask, short, config)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_runs_on_the_meta_device(name):
    """Meta tensors have no data: any host read would raise.  Every output follows the inputs' device."""
    batch = _batch(7, device="meta")
    result = compute_rollout_correction(*batch, replace(CONFIGS[name], on_nonfinite="reject"))
    assert result.keep_mask.device.type == "meta" and result.keep_mask.shape == batch[0].shape
    if result.is_weights is not None:
        assert result.is_weights.device.type == "meta" and result.is_weights.dtype == torch.float32
    assert result.metrics and all(v.device.type == "meta" and v.dtype == torch.float64 and v.dim() == 0
                                  for v in result.metrics.values())
    assert all(v.device.type == "meta" for v in result.sequences.values())


@pytest.mark.parametrize("cu, n, words", [
    ([5], 5, "1 entry (no sequence)"), ([0], 5, "1 entry (no sequence)"), ([3], 0, "must start at 0"),
    ([0, 6], 5, "end at the token count 5"), ([1, 5], 5, "must start at 0"), ([0, 4, 3, 5], 5, "non-decreasing"),
    ([0, 2, 9, 5], 5, "non-decreasing")])
def test_malformed_cu_seqlens_is_an_error_naming_it(cu, n, words):
    """The deferred check catches every malformation (the engine computes on a clamped copy meanwhile: no
    out-of-bounds index, no shape error before the message)."""
    x = torch.zeros(n)
    with pytest.raises(ValueError, match="cu_seqlens") as info:
        compute_rollout_correction(x, x, torch.ones(n), torch.tensor(cu), CONFIGS["token_tis_rs_veto_norm"])
    assert words in str(info.value)
