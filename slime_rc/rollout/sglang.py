"""A client for a real SGLang server with the same ``generate`` interface as
:class:`slime_rc.rollout.engine.RolloutEngine` -- standard library only (``urllib`` + ``json``).

Request (one batched POST to ``{url}/generate``)::

    {"input_ids": [[prompt 0 ids], [prompt 1 ids], ...],
     "sampling_params": {"temperature": T, "top_p": p, "max_new_tokens": n[, "stop_token_ids": [stop]]},
     "return_logprob": true}

Response: a JSON list (one object per prompt, in order; a bare object for a batch of one is accepted) with
``meta_info["output_token_logprobs"]``: one ``[logprob, token_id, text or null]`` item per generated token
(``logprob_start_len`` -1 default: output tokens only).  The log-prob of response token ``i`` is SGLang's
``log_softmax(logits / temperature)`` at position ``prompt_len + i - 1`` -- the full distribution, not
renormalised over top-p, floored at the dtype minimum.  NaN / +-Inf are serialised as JSON ``null``:
:func:`rollout_log_probs_from_meta_info` refuses them (ValueError naming the token index) instead of building a
tensor that would silently poison the correction.

The response tokens are the ``token_id`` of those items (``output_ids``, when the server sends it, must agree).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

__all__ = ["SGLangEngine", "rollout_log_probs_from_meta_info", "response_tokens_from_meta_info"]


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
    return torch.tensor(ids, dtype=torch.int64)


def rollout_log_probs_from_meta_info(meta_info: Mapping[str, Any],
                                     response_tokens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``meta_info["output_token_logprobs"]`` (``[[logprob, token_id, text], ...]``) -> float32 ``[n]`` log-probs.

    ``response_tokens`` (optional): the response the trainer will score; its length and every token id must match
    the items'.  Raises ``ValueError`` naming the token index for a missing (``None`` = JSON null, i.e. NaN/Inf on
    the server), NaN, infinite or positive log-prob, or a mismatching token id."""
    items = _items(meta_info)
    if response_tokens is not None:
        resp = torch.as_tensor(response_tokens).reshape(-1).tolist()
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
    return torch.tensor(values, dtype=torch.float32)


class SGLangEngine:
    """``generate`` through an SGLang server's native ``/generate`` (module docstring).  ``url``: the server's base
    address (``http://host:port``); ``timeout``: seconds for the whole request."""

    def __init__(self, url: str, temperature: float = 1.0, top_p: float = 1.0, timeout: float = 60.0):
        if not temperature > 0:
            raise ValueError(f"temperature={temperature!r} must be > 0 (SGLang's 0 is greedy; the trainer divides "
                             "its logits by the same temperature)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        self.url = url.rstrip("/")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.timeout = float(timeout)

    def request_payload(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                        stop_token: Optional[int] = None) -> Dict[str, Any]:
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": int(max_new_tokens)}
        if stop_token is not None:
            sampling["stop_token_ids"] = [int(stop_token)]
        ids = [torch.as_tensor(p).reshape(-1).tolist() for p in prompts]
        return {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}

    def _post(self, payload: Dict[str, Any]) -> Any:
        data = json.dumps(payload).encode()
        req = urllib.request.Request(self.url + "/generate", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise RuntimeError(f"SGLang {self.url}/generate: HTTP {e.code}: {detail}") from e
        except urllib.error.URLError as e:
            raise RuntimeError(f"SGLang {self.url}/generate unreachable: {e.reason}") from e
        return json.loads(body)

    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                 stop_token: Optional[int] = None) -> List[Dict[str, object]]:
        """Same output as ``RolloutEngine.generate``: ``{prompt, response, rollout_log_probs, finish_reason}``."""
        prompts = [torch.as_tensor(p, dtype=torch.int64).reshape(-1) for p in prompts]
        if not prompts:
            return []
        result = self._post(self.request_payload(prompts, max_new_tokens, stop_token))
        if isinstance(result, Mapping):
            result = [result]
        if not isinstance(result, list) or len(result) != len(prompts):
            raise ValueError(f"SGLang returned {len(result) if isinstance(result, list) else type(result).__name__}"
                             f" results for {len(prompts)} prompts")
        out = []
        for k, (prompt, r) in enumerate(zip(prompts, result)):
            meta = r.get("meta_info") if isinstance(r, Mapping) else None
            if meta is None:
                raise ValueError(f"result {k}: no meta_info")
            try:
                response = response_tokens_from_meta_info(meta)
                if r.get("output_ids") is not None and list(r["output_ids"]) != response.tolist():
                    raise ValueError(f"output_ids {r['output_ids']} != output_token_logprobs ids "
                                     f"{response.tolist()}")
                logps = rollout_log_probs_from_meta_info(meta, response)
            except ValueError as e:
                raise ValueError(f"result {k}: {e}") from e
            finish = meta.get("finish_reason")
            if isinstance(finish, Mapping):
                finish = finish.get("type")
            out.append({"prompt": prompt, "response": response, "rollout_log_probs": logps,
                        "finish_reason": finish})
        return out
