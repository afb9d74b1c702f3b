"""A synthetic task a tiny model learns in minutes on a laptop, with a programmatic reward (no downloads).

Vocabulary: digits ``0..9`` are tokens ``0..9``; ``SEP`` (10) ends the prompt; ``EOS`` (11) ends the answer; the
model's vocabulary may be larger (unused tokens are simply wrong answers).  A prompt is ``d_1 .. d_n SEP``; the
answer is a transformation of the digits followed by ``EOS``:

* ``reverse``: the digits reversed;  * ``sort``: the digits in increasing order;  * ``copy``: the digits as given.

Reward of a response (tokens up to and including the first ``EOS``, or all of them): the fraction of answer positions
with the right digit, plus 0.5 if the whole answer and the ``EOS`` are exact — in [0, 1.5].  Dense enough that GRPO
gets a signal from the first step.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

SEP, EOS = 10, 11
MIN_VOCAB = 12
TASKS = ("reverse", "sort", "copy")


def _answer(task: str, digits: torch.Tensor) -> torch.Tensor:
    if task == "reverse":
        return digits.flip(0)
    if task == "sort":
        return digits.sort().values
    if task == "copy":
        return digits.clone()
    raise ValueError(f"task={task!r} is not a task; choose one of {TASKS}")


def make_prompts(task: str, n: int, length: int, generator: torch.Generator) -> List[torch.Tensor]:
    """``n`` prompts ``[d_1 .. d_length, SEP]`` (int64) of random digits."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a task; choose one of {TASKS}")
    if length < 1:
        raise ValueError(f"length={length} must be >= 1 digit")
    digits = torch.randint(0, 10, (n, length), generator=generator)
    return [torch.cat([row, torch.tensor([SEP])]) for row in digits]


def reward(task: str, prompt: torch.Tensor, response: torch.Tensor) -> float:
    """Reward of one ``response`` (generated tokens) to ``prompt`` (see the module docstring)."""
    digits = prompt[prompt != SEP] if prompt[-1] == SEP else prompt
    target = _answer(task, digits)
    ends = (response == EOS).nonzero()
    answer = response[:int(ends[0])] if ends.numel() else response
    n = target.numel()
    got = answer[:n]
    correct = int((got == target[:got.numel()]).sum())
    exact = ends.numel() > 0 and answer.numel() == n and correct == n
    return correct / n + (0.5 if exact else 0.0)


def rewards(task: str, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([reward(task, p, r) for p, r in zip(prompts, responses)], dtype=torch.float32)
