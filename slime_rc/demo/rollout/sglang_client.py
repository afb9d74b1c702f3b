"""A client for a real SGLang server with the same ``generate`` interface as
:class:`slime_rc.demo.rollout.in_process.RolloutEngine` -- standard library only (``http.client`` + ``json``).

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

Failures are bounded and say what happened, naming the URL: the TCP (and TLS) connection must be made within
``connect_timeout`` seconds (5 by default: a host that drops packets fails in seconds, not minutes), the answer must
come within ``timeout`` seconds (``--sglang-timeout``).  Connection refused, no connection, no answer, a broken
connection and an HTTP error status raise :class:`SGLangError` (a ``RuntimeError``); an answer that is not JSON (an
HTML page), not one result per prompt, a result without ``meta_info`` or with a null / non-finite log-prob raises
:class:`SGLangResponseError` (an ``SGLangError`` and a ``ValueError``).  Each message is one line.  The client
connects directly (``http.client``; HTTP proxy variables are not used).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import urllib.parse
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from slime_rc.sglang_output import response_tokens_from_meta_info, rollout_log_probs_from_meta_info

__all__ = ["SGLangEngine", "SGLangError", "SGLangResponseError", "check_sglang_url",
           "rollout_log_probs_from_meta_info", "response_tokens_from_meta_info"]

CONNECT_TIMEOUT = 5.0  # seconds to open the connection
REQUEST_TIMEOUT = 60.0  # seconds to wait for the answer of one batched /generate (--sglang-timeout)


class SGLangError(RuntimeError):
    """The SGLang server could not be reached, did not answer in time, or answered with an HTTP error status."""


class SGLangResponseError(SGLangError, ValueError):
    """The SGLang server answered, but not with what ``/generate`` returns (not JSON, too few results, a result
    without log-probs or with a null / non-finite one)."""


def check_sglang_url(url: Any, flag: str = "--sglang-url") -> str:
    """``url`` if it is an ``http(s)://host[:port][/path]`` URL, else ``ValueError`` naming ``flag``, the value and
    the fix."""
    fix = f"give {flag} http://host:port (SGLang's default port is 30000, e.g. http://127.0.0.1:30000)"
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{flag} {url!r} is not an http(s) URL; {fix}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL ({e}); {fix}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL; {fix}")
    if parts.query or parts.fragment or port == 0 or any(c.isspace() for c in url):
        raise ValueError(f"{flag} {url!r}: give the server's base address only (no query, fragment, spaces or "
                         f"port 0); {fix}")
    return url


def _snippet(body: bytes, limit: int = 200) -> str:
    """The start of a body on one line (whitespace collapsed), for an error message."""
    text = " ".join(body[:limit * 2].decode(errors="replace").split())
    return text[:limit] + (" ..." if len(text) > limit or len(body) > limit * 2 else "")


class SGLangEngine:
    """``generate`` through an SGLang server's native ``/generate`` (module docstring).  ``url``: the server's base
    address (``http://host:port``); ``connect_timeout``: seconds to open the connection; ``timeout``: seconds to
    wait for the answer once connected."""

    def __init__(self, url: str, temperature: float = 1.0, top_p: float = 1.0, timeout: float = REQUEST_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT):
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (SGLang's 0 is greedy; the "
                             "trainer divides its logits by the same temperature)")
        if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
        self.url = check_sglang_url(url, "url").rstrip("/")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)

    def request_payload(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                        stop_token: Optional[int] = None) -> Dict[str, Any]:
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": int(max_new_tokens)}
        if stop_token is not None:
            sampling["stop_token_ids"] = [int(stop_token)]
        ids = [torch.as_tensor(p).reshape(-1).tolist() for p in prompts]
        return {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}

    def _post(self, payload: Dict[str, Any]) -> Any:
        """One POST to ``/generate``; the decoded JSON answer, or :class:`SGLangError` saying what happened."""
        where = f"SGLang {self.url}/generate"
        parts = urllib.parse.urlsplit(self.url)
        connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = connection(parts.hostname, parts.port, timeout=self.connect_timeout)
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise SGLangError(f"{where}: no connection within {self.connect_timeout:g} s (connect timeout): is "
                                  f"the server up and {parts.netloc} reachable from here?") from None
            except ConnectionRefusedError:
                raise SGLangError(f"{where}: connection refused: nothing listens at {parts.netloc}; start the "
                                  f"SGLang server or fix --sglang-url") from None
            except socket.gaierror as e:
                raise SGLangError(f"{where}: unknown host {parts.hostname!r} ({e.strerror}); fix --sglang-url") \
                    from None
            except OSError as e:
                raise SGLangError(f"{where}: cannot connect: {e.strerror or e}") from None
            conn.sock.settimeout(self.timeout)
            try:
                conn.request("POST", parts.path.rstrip("/") + "/generate", body=json.dumps(payload).encode(),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                body = resp.read()
            except TimeoutError:
                raise SGLangError(f"{where}: connected, but no answer within {self.timeout:g} s (--sglang-timeout): "
                                  f"is the server overloaded or stuck?") from None
            except (http.client.HTTPException, OSError) as e:
                raise SGLangError(f"{where}: the connection broke before a complete answer "
                                  f"({type(e).__name__}: {e})") from None
        finally:
            conn.close()
        if not 200 <= resp.status < 300:
            raise SGLangError(f"{where}: HTTP {resp.status} {resp.reason}: {_snippet(body) or '(empty body)'}")
        try:
            return json.loads(body)
        except ValueError:
            kind = resp.getheader("Content-Type") or "no Content-Type"
            raise SGLangResponseError(f"{where}: the answer is not JSON ({kind}, {len(body)} bytes: "
                                      f"{_snippet(body, 80)!r}); is {self.url} an SGLang server?") from None

    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                 stop_token: Optional[int] = None) -> List[Dict[str, object]]:
        """Same output as ``RolloutEngine.generate``: ``{prompt, response, rollout_log_probs, finish_reason}``."""
        prompts = [torch.as_tensor(p, dtype=torch.int64).reshape(-1) for p in prompts]
        if not prompts:
            return []
        where = f"SGLang {self.url}/generate"
        result = self._post(self.request_payload(prompts, max_new_tokens, stop_token))
        if isinstance(result, Mapping):
            result = [result]
        if not isinstance(result, list):
            raise SGLangResponseError(f"{where}: the answer is a JSON {type(result).__name__}, not a list of "
                                      f"results for {len(prompts)} prompts")
        if len(result) != len(prompts):
            raise SGLangResponseError(f"{where}: {len(result)} results for {len(prompts)} prompts (one per prompt "
                                      f"expected)")
        out = []
        for k, (prompt, r) in enumerate(zip(prompts, result)):
            meta = r.get("meta_info") if isinstance(r, Mapping) else None
            if not isinstance(meta, Mapping):
                got = f"keys {sorted(r)[:8]}" if isinstance(r, Mapping) else f"a JSON {type(r).__name__}"
                raise SGLangResponseError(f"{where}: result {k}: no meta_info ({got}); the server must answer "
                                          f"/generate with return_logprob")
            try:
                response = response_tokens_from_meta_info(meta)
                if r.get("output_ids") is not None and list(r["output_ids"]) != response.tolist():
                    raise ValueError(f"output_ids {r['output_ids']} != output_token_logprobs ids "
                                     f"{response.tolist()}")
                logps = rollout_log_probs_from_meta_info(meta, response)
            except (ValueError, TypeError) as e:
                raise SGLangResponseError(f"{where}: result {k}: {' '.join(str(e).split())}") from None
            finish = meta.get("finish_reason")
            if isinstance(finish, Mapping):
                finish = finish.get("type")
            out.append({"prompt": prompt, "response": response, "rollout_log_probs": logps,
                        "finish_reason": finish})
        return out
