"""SGLang ingestion: the rollout side's log-probs as tensors the correction can trust, and the sampling settings
that must agree between the rollout engine and the trainer.

``meta_info["output_token_logprobs"]`` (``/generate`` with ``"return_logprob": true``) holds one
``[logprob, token_id, text or null]`` item per generated token (``logprob_start_len`` -1: output tokens only).  The
log-prob of response token ``i`` is ``log_softmax(logits / temperature)`` at position ``prompt_len + i - 1``: the full
tempered distribution, not renormalised over top-p / top-k, floored at the dtype minimum.  NaN and +-Inf reach the
client as JSON ``null``; :func:`rollout_log_probs_from_meta_info` refuses them, naming the token index, instead of
building a tensor that would silently poison the correction.

:func:`check_sampling_consistency` compares the rollout's ``sampling_params`` with the trainer's log-prob settings:
a trainer that scores ``logits / 1.0`` against rollouts sampled at temperature 0.7 measures a "mismatch" that is
only the temperature.  The HTTP client that uses all of this is :class:`slime_rc.demo.rollout.sglang_client.SGLangEngine`.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, List, Mapping, Optional, Sequence

import torch

__all__ = ["rollout_log_probs_from_meta_info", "response_tokens_from_meta_info", "check_sampling_consistency"]

# SGLang's defaults for the sampling parameters a request may leave out
_SGLANG_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def _items(meta_info: Mapping[str, Any]) -> list:
    if not isinstance(meta_info, Mapping) or "output_token_logprobs" not in meta_info:
        raise ValueError("meta_info has no 'output_token_logprobs' (send \"return_logprob\": true)")
    items = meta_info["output_token_logprobs"]
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"output_token_logprobs must be a list, got {type(items).__name__}")
    for i, item in enumerate(items):
        if not isinstance(item, (list, tuple)) or len(item) < 2:
            raise ValueError(f"output_token_logprobs[{i}] = {item!r}: expected [logprob, token_id, text]")
    return list(items)


def response_tokens_from_meta_info(meta_info: Mapping[str, Any]) -> torch.Tensor:
    """``meta_info["output_token_logprobs"]`` -> int64 ``[n]`` token ids."""
    ids = []
    for i, item in enumerate(_items(meta_info)):
        tok = item[1]
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"output_token_logprobs[{i}]: token id {tok!r} is not an integer")
        ids.append(tok)
    return torch.tensor(ids, dtype=torch.int64)  # host: parsed from SGLang's JSON; the caller batches it


def rollout_log_probs_from_meta_info(meta_info: Mapping[str, Any],
                                     response_tokens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``meta_info["output_token_logprobs"]`` (``[[logprob, token_id, text], ...]``) -> float32 ``[n]`` log-probs.

    ``response_tokens`` (optional): the response the trainer will score; its length and every token id must match
    the items'.  Raises ``ValueError`` naming the token index for a missing (``None`` = JSON null, i.e. NaN/Inf on
    the server), NaN, infinite or positive log-prob, or a mismatching token id."""
    items = _items(meta_info)
    if response_tokens is not None:
        resp = torch.as_tensor(response_tokens).reshape(-1).tolist()  # host: token ids, compared here
        if len(resp) != len(items):
            raise ValueError(f"{len(items)} output_token_logprobs for a response of {len(resp)} tokens")
    values = []
    for i, item in enumerate(items):
        lp, tok = item[0], item[1]
        if lp is None:
            raise ValueError(f"output_token_logprobs[{i}]: log-prob is null (NaN/Inf on the server) for token "
                             f"{tok!r}")
        if isinstance(lp, bool) or not isinstance(lp, (int, float)):
            raise ValueError(f"output_token_logprobs[{i}]: log-prob {lp!r} is not a number")
        lp = float(lp)
        if not math.isfinite(lp):
            raise ValueError(f"output_token_logprobs[{i}]: log-prob {lp} is not finite")
        if lp > 1e-4:  # a log-prob: <= 0 (small positive slack for rounding)
            raise ValueError(f"output_token_logprobs[{i}]: log-prob {lp} > 0")
        if response_tokens is not None and tok != resp[i]:
            raise ValueError(f"output_token_logprobs[{i}]: token id {tok!r} != response token {resp[i]}")
        values.append(lp)
    return torch.tensor(values, dtype=torch.float32)  # host: parsed from SGLang's JSON; the caller batches it


def check_sampling_consistency(rollout_sampling_params: Mapping[str, Any], trainer_temperature: float, *,
                               warn: bool = True) -> List[str]:
    """What makes the trainer's log-probs and SGLang's disagree for reasons other than numerics.

    ``rollout_sampling_params``: the request's ``sampling_params`` (``temperature``, ``top_p``, ``top_k``,
    ``min_p``; missing keys take SGLang's defaults).  ``trainer_temperature``: what the trainer divides its logits
    by before ``log_softmax`` (``slime_rc.megatron.logprobs.vocab_parallel_log_probs(..., temperature)``).

    Returns one message per problem (empty when consistent) and, with ``warn``, issues each as a
    ``RuntimeWarning``:

    * temperatures differ: every ratio ``pi_train / pi_rollout`` then carries the temperature gap (a systematic
      ``log_ppl_diff``, KL far above bf16 levels) -- a configuration error, not a kernel mismatch;
    * temperature 0 (greedy): the rollout is not a sample of ``pi_rollout``; its log-probs still come from the
      temperature-1 distribution, and importance ratios do not describe how the tokens were chosen;
    * truncated sampling (``top_p < 1``, ``top_k > 0``, ``min_p > 0``): both sides report the full distribution's
      log-probs, so the metrics compare like with like, but the tokens were drawn from the truncated one, which
      the IS ratio does not correct.
    """
    if not isinstance(rollout_sampling_params, Mapping):
        raise ValueError(f"rollout_sampling_params must be the request's sampling_params mapping, got "
                         f"{type(rollout_sampling_params).__name__}")
    if not (isinstance(trainer_temperature, (int, float)) and trainer_temperature > 0):
        raise ValueError(f"trainer_temperature={trainer_temperature!r} must be > 0: the trainer divides its logits "
                         f"by it")
    p = {**_SGLANG_DEFAULTS, **{k: v for k, v in rollout_sampling_params.items() if v is not None}}
    problems = []
    temp = float(p["temperature"])
    if temp <= 0:
        problems.append(f"rollout temperature={temp:g} is greedy decoding: the responses are not samples of "
                        f"pi_rollout, so importance ratios do not describe them; sample with temperature > 0 "
                        f"for RL")
    elif not math.isclose(temp, float(trainer_temperature), rel_tol=1e-6):
        problems.append(f"rollout temperature={temp:g} but the trainer scores logits / {trainer_temperature:g}: "
                        f"SGLang's log-probs are log_softmax(logits / {temp:g}), so the measured mismatch would be "
                        f"a temperature artefact; give the trainer the rollout temperature (slime: "
                        f"--rollout-temperature {temp:g})")
    truncation = [f"{k}={p[k]:g}" for k, off in (("top_p", lambda v: v >= 1.0), ("top_k", lambda v: v <= 0),
                                                 ("min_p", lambda v: v <= 0.0)) if not off(float(p[k]))]
    if truncation:
        problems.append(f"truncated sampling ({', '.join(truncation)}): SGLang reports the full distribution's "
                        f"log-probs (not renormalised), as the trainer does, so the metrics compare like with like, "
                        f"but the tokens come from the truncated distribution, which the IS ratio does not "
                        f"correct; use top_p=1, top_k=-1, min_p=0 for an unbiased correction")
    if warn:
        for message in problems:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    return problems
