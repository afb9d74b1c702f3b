"""A client for a real SGLang server with the same ``generate`` interface as
:class:`slime_rc.demo.rollout.in_process.RolloutEngine` -- standard library only (``urllib`` + ``json``).

Request (one batched POST to ``{url}/generate``)::

    {"input_ids": [[prompt 0 ids], [prompt 1 ids], ...],
     "sampling_params": {"temperature": T, "top_p": p, "max_new_tokens": n[, "stop_token_ids": [stop]]},
     "return_logprob": true}

Response: a JSON list (one object per prompt, in order; a bare object for a batch of one is accepted) with
``meta_info["output_token_logprobs"]``: one ``[logprob, token_id, text or null]`` item per generated token
(``logprob_start_len`` -1 default: output tokens only).  The log-prob of response token ``i`` is SGLang's
``log_softmax(logits / temperature)`` at position ``prompt_len + i - 1`` -- the full distribution, not
renormalised over top-p, floored at the dtype minimum.  NaN / +-Inf are serialised as JSON ``null``:
:func:`slime_rc.sglang_output.rollout_log_probs_from_meta_info` refuses them (ValueError naming the token index) instead of
building a tensor that would silently poison the correction.

The response tokens are the ``token_id`` of those items (``output_ids``, when the server sends it, must agree).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from slime_rc.sglang_output import response_tokens_from_meta_info, rollout_log_probs_from_meta_info

__all__ = ["SGLangEngine", "rollout_log_probs_from_meta_info", "response_tokens_from_meta_info"]


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
