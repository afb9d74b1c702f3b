"""GRPO advantages: each prompt's ``G`` samples are normalised against their own group.

    A_i = (r_i - mean_{j in K} r_j) / (std_{j in K} r_j + eps)     for i in K,   A_i = 0 for i not in K

where ``K`` is the set of the group's samples that the rollout correction keeps.  A rejected sample never feeds the
baseline (a known bug elsewhere: rejection applied after the advantages were computed still shifts every other
sample's advantage).  ``std`` is the population standard deviation; a group with fewer than 2 kept samples, or with
all kept rewards equal, gets zero advantages (no learning signal, no division by ~0).
"""

from __future__ import annotations

from typing import Optional

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, kept: Optional[torch.Tensor] = None,
                     eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    """``rewards [N]`` (groups of ``group_size`` consecutive samples), ``kept [N]`` bool (default: all) -> ``[N]``."""
    n = rewards.numel()
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of group_size={group_size}")
    r = rewards.float().view(-1, group_size)
    k = torch.ones_like(r, dtype=torch.bool) if kept is None else kept.bool().view(-1, group_size)
    count = k.sum(1, keepdim=True)
    mean = torch.where(k, r, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    var = torch.where(k, (r - mean) ** 2, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    adv = r - mean
    if normalize_std:
        adv = adv / (var.sqrt() + eps)
    live = (count >= 2) & (var > 0)
    return torch.where(k & live, adv, 0.0).view(-1)
