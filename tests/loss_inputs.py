"""Small packed inputs for ``compute_policy_loss`` and the checks on what comes out (shared by the bad-input tests)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from slime_rc import compute_policy_loss, cu_seqlens_from_lengths


def with_(cfg, **kw):
    return dataclasses.replace(cfg, **kw)


def loss_inputs(lengths: Sequence[int], seed: int = 0, adv_sign=None) -> dict:
    """Deterministic log-probs (pi_rollout, pi_old, pi_theta near each other), advantages (of sign ``adv_sign`` when
    given), an all-ones loss mask and ``cu_seqlens`` for samples of ``lengths`` tokens."""
    n = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(n, generator=g) - 0.1
    old = rollout + 0.05 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    if adv_sign is not None:
        adv = adv.abs() * adv_sign
    return dict(log_probs=(old + 0.05 * torch.randn(n, generator=g)), old_log_probs=old, rollout_log_probs=rollout,
                advantages=adv, loss_mask=torch.ones(n), cu_seqlens=cu_seqlens_from_lengths(list(lengths)))


def call_loss(cfg, inputs, **kw):
    """``(loss, grad of log_probs, metrics)`` after ``loss.backward()``."""
    lp = inputs["log_probs"].detach().clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(lp, inputs["old_log_probs"], inputs["rollout_log_probs"],
                                        inputs["advantages"], inputs["loss_mask"], inputs["cu_seqlens"], cfg, **kw)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def all_finite(loss, grad, metrics):
    assert torch.isfinite(loss), loss
    assert grad is not None and torch.isfinite(grad).all(), grad  # no NaN/inf reaches .grad
    bad = {k: v for k, v in metrics.items() if not torch.isfinite(v).all()}
    assert not bad, bad


def loss_host_reads(cfg, inputs):
    """``(loss, host reads of one compute_policy_loss call, those not in the one deferred check)``."""
    from slime_rc.testing.host_reads import HostReads

    lp = inputs["log_probs"].clone().requires_grad_(True)
    with HostReads(stack_depth=64) as reads:
        loss, _ = compute_policy_loss(lp, inputs["old_log_probs"], inputs["rollout_log_probs"], inputs["advantages"],
                                      inputs["loss_mask"], inputs["cu_seqlens"], cfg)
    return loss, reads.events, [e for e in reads.events if " raise_if_any:" not in e[2]]
