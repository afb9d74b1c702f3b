"""The main job's pure pieces: the synthetic task's reward and GRPO advantages that ignore rejected samples."""

import pytest
import torch

from slime_rc.demo.train.advantages import group_advantages
from slime_rc.demo.train.task import EOS, SEP, TASKS, make_prompts, reward


def test_reward_values():
    p = torch.tensor([3, 1, 2, SEP])
    assert reward("reverse", p, torch.tensor([2, 1, 3, EOS])) == 1.5
    assert reward("sort", p, torch.tensor([1, 2, 3, EOS, 7])) == 1.5  # tokens after EOS are ignored
    assert reward("copy", p, torch.tensor([3, 1, 2])) == 1.0  # right digits, no EOS: no bonus
    assert reward("reverse", p, torch.tensor([2, 0, 3, EOS])) == pytest.approx(2 / 3)
    assert reward("reverse", p, torch.tensor([EOS])) == 0.0
    assert reward("reverse", p, torch.tensor([2, 1, 3, 3, EOS])) == 1.0  # too long: no bonus


def test_prompts_and_bad_task():
    g = torch.Generator().manual_seed(0)
    ps = make_prompts("sort", 5, 4, g)
    assert len(ps) == 5 and all(p.shape == (5,) and p[-1] == SEP and (p[:-1] < 10).all() for p in ps)
    with pytest.raises(ValueError, match="task='revers'"):
        make_prompts("revers", 1, 3, g)
    assert set(TASKS) == {"reverse", "sort", "copy"}


def test_group_advantages_exclude_rejected_samples_from_the_baseline():
    r = torch.tensor([1.0, 0.0, 0.5, 9.0, 0.2, 0.2, 0.2, 0.2])
    kept = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    a = group_advantages(r, 4, kept)
    kr = torch.tensor([1.0, 0.0, 0.5])
    expected = (kr - kr.mean()) / (kr.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(a[:3], expected)
    assert a[3] == 0.0  # the rejected outlier gets nothing and moved nobody's baseline
    assert (a[4:] == 0).all()  # equal rewards: no signal
    # with the outlier kept the baseline moves: the bug this prevents
    assert not torch.allclose(group_advantages(r, 4)[:3], expected)


def test_group_with_one_kept_sample_and_bad_sizes():
    a = group_advantages(torch.tensor([1.0, 2.0]), 2, torch.tensor([True, False]))
    assert (a == 0).all()
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(4), 3)
