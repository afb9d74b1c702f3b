"""An in-process rollout engine, separate from the trainer as in production: a pure-torch copy of the tiny GPT that
``slime_rc.demo.model.build_model`` builds, fed by weight syncs from the trainer, that samples responses and
reports SGLang-style rollout log-probs -- with knobs that create a real, controllable train/rollout mismatch.

No megatron, no ``torch.distributed``: the rollout engine only needs ``full_parameters(model)`` (``{global parameter
name: full unsharded tensor}``) and the :class:`~slime_rc.demo.model.TinyGPTConfig`.

:class:`TorchGPT` -- the forward of megatron-core's ``GPTModel`` with the local layer spec (as built by
``build_model``), read from megatron-core 0.16's source
------------------------------------------------------------------------------------------------------------------
With ``h`` hidden size, ``nh`` heads, ``ng`` query groups (``num_query_groups or nh``), ``hn = h / nh``,
``r = nh / ng``, tokens ``[B, T]``::

    x      = word_embeddings[tokens]                                   [B, T, h]   (RoPE model: no position table)
    for each layer l:
      a    = LayerNorm(x; input_layernorm, eps=1e-5)
      qkv  = a @ linear_qkv.W^T + linear_qkv.b                         [B, T, ng * (r + 2) * hn]
             viewed [B, T, ng, (r + 2) * hn] and split along the last dim into
             q [.., ng, r * hn] -> [B, T, nh, hn] (query head g * r + j belongs to group g), k, v [B, T, ng, hn]
             (megatron's per-query-group interleaved layout ``q1 .. qr k v | q1 .. qr k v | ...``)
      q, k = RoPE(q), RoPE(k):  inv_freq_i = 10000 ** (-2 i / hn), i < hn / 2 (fp32); theta = pos * inv_freq;
             emb = cat(theta, theta); t' = t * cos(emb) + rotate_half(t) * sin(emb), rotate_half(t) =
             cat(-t[hn/2:], t[:hn/2]) (not interleaved; cos/sin computed in fp32, cast to the compute dtype);
             ``pos`` is the position inside the sequence (megatron's packed ``thd`` RoPE restarts at every sequence)
      att  = softmax(q k^T / sqrt(hn) + causal mask) v    (k, v repeated r times per group), heads concatenated
      x    = x + att @ linear_proj.W^T + linear_proj.b
      m    = LayerNorm(x; pre_mlp_layernorm, eps=1e-5)
      x    = x + gelu(m @ linear_fc1.W^T + linear_fc1.b) @ linear_fc2.W^T + linear_fc2.b    (exact erf GELU)
    logits = LayerNorm(x; decoder.final_layernorm) @ W_out^T          [B, T, V]   (no bias)

``W_out`` is ``output_layer.weight``, or ``embedding.word_embeddings.weight`` with ``tie_embeddings``.  In a low
precision (``bf16``/``fp16``) every weight is cast to that dtype and every matmul / layer norm / GELU runs in it; the
attention softmax is taken in fp32 and rounded back (as flash-attention kernels do); logits come out in the dtype.
Left padding (for batched prompts of different lengths): ``pad [B]`` leading pad tokens per row; positions are
``t - pad`` and pad keys are masked out, so a padded row computes the same function as the unpadded sequence.

:class:`RolloutEngine` -- sampling and reported log-probs (the SGLang convention)
---------------------------------------------------------------------------------
At each generated position, with ``z`` the last-position logits (``dtype``) and ``T = temperature > 0``::

    y      = z.float() / T                                           (fp32, the tempered logits)
    p      = softmax(y)
    y'     = y + logit_noise * (1 - p) ** 2 * eps,  eps ~ N(0, 1) iid per vocabulary entry and position
    logp   = log_softmax(y')
    logq   = log((1 - V * f) * exp(logp) + f)   if prob_floor f > 0  (mixture with the uniform distribution)
           = max(logp, finfo(dtype).min)         if f = 0             (the rollout engine's full distribution, no -inf)
    sample ~ softmax(y') restricted to the top-p nucleus and renormalised (SGLang's rule: in sorted order, keep
             token i iff cumsum_i - q_i <= top_p; the most probable token is always kept)
    rollout_log_prob = logq[sample]                                  (full distribution, NOT renormalised over top-p)

The probability floor (``prob_floor`` f, ``--rollout-prob-floor``): ``q = (1 - V f) p + f`` with ``V`` the vocabulary
size, i.e. a mixture of the engine's distribution ``p`` (weight ``1 - V f``) and the uniform distribution (weight
``V f``).  It sums to 1 exactly, every entry has ``q >= f``, and the order of the tokens is kept; it needs
``0 <= f < 1 / V`` (``V f < 1``).  Computed as ``logaddexp(log(1 - V f) + logp, log f)`` (no underflow), and the
reported rollout log-prob is ``log q`` of the sampled token.  It models an inference engine that keeps sampling tail
tokens the trainer has driven towards probability 0 (a sampler that never gives a token less than f; smoothing in a
low-precision softmax): the trainer's ``log p`` of such a token goes to -inf while the rollout's ``log q`` stays at
``log f``, so the token ratio ``p / q`` of those tokens goes to 0 and, without correction, the policy gradient keeps
pushing the tail down on samples the trainer would (almost) never draw -- the mismatch under which uncorrected GRPO
collapses in ``docs/results.md``.  With ``f = 0`` (the default) nothing changes.

The noise term ``sigma * (1 - p_v)^2`` leaves probable tokens almost untouched (p = 0.9: 1% of sigma) and perturbs
improbable ones by ~sigma in tempered-logit units, so the mismatch concentrates on low-probability tokens, as the
field reports for real rollout engines at scale (log p ~ -30 is below bf16 resolution).  At this toy scale (V = 128)
the rollout engine's own bf16/fp16 mismatch is *not* concentrated that way (measured: about equal on the least and most
probable quartiles of sampled tokens) -- use ``logit_noise`` when that shape matters.  The trainer scores the same
tokens with ``vocab_parallel_log_probs(logits, targets, temperature)`` = ``log_softmax(logits / T)`` in fp32.

Generation recomputes the whole left-padded prefix of the still-running rows at every step (no KV cache): exact, and
64 prompts x 12 new tokens of the default 4-layer model take ~0.1 s (fp32) / ~0.2 s (bf16, fp16) on 2 CPU cores.

Temperature must be > 0 (a ValueError otherwise): SGLang's temperature 0 means greedy decoding, and a trainer cannot
divide its logits by 0 to score it -- for near-greedy rollouts use a small temperature on both sides.

Weight syncs (``stale_steps``): :meth:`RolloutEngine.load_weights` is called once per training step; the rollout
engine keeps the last ``stale_steps + 1`` versions and generates with the one loaded ``stale_steps`` syncs ago (before
that many syncs have happened, with the oldest one it has) -- an asynchronous rollout worker lagging the trainer.

Output of :meth:`RolloutEngine.generate`: one dict per prompt with ``prompt`` (the 1-D int64 prompt),
``response`` (1-D int64, the generated tokens: ends with ``stop_token`` when that was sampled, nothing padded),
``rollout_log_probs`` (1-D float32, one per response token), ``finish_reason`` (``"stop"`` / ``"length"``) and
``weight_version`` (the number of the sync whose weights generated it, counting from 0).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from slime_rc.demo.rollout.torch_qwen2 import TorchQwen2

__all__ = ["TorchGPT", "RolloutEngine", "DTYPES", "resolve_dtype", "sampling_mask", "floor_log_probs", "check_prob_floor",
           "LAYERNORM_EPS", "ROTARY_BASE", "forward_class"]

LAYERNORM_EPS = 1e-5  # TransformerConfig.layernorm_epsilon default (build_model does not change it)
ROTARY_BASE = 10000.0  # GPTModel(rotary_base=10000) default; TransformerConfig has no rotary_base field
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_LAYER_KEYS = ("input_layernorm.weight", "input_layernorm.bias",
               "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
               "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
               "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
               "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")


def resolve_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} not supported; use one of {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {list(DTYPES)}")
    return DTYPES[dtype]


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat((-t2, t1), dim=-1)


# One forward for every architecture the demo builds (the GPT above and Qwen2's): ``TorchQwen2`` computes the
# formulas of this module's docstring on the demo GPT's config, bit for bit (tests/demo/test_qwen2_tiny.py).
TorchGPT = TorchQwen2

def check_prob_floor(prob_floor: float, vocab_size: int) -> None:
    """``ValueError`` unless ``0 <= prob_floor < 1 / vocab_size`` (a finite number): the floor is given to every
    vocabulary entry, so ``vocab_size * prob_floor`` must stay below 1."""
    ok = (isinstance(prob_floor, (int, float)) and not isinstance(prob_floor, bool) and math.isfinite(prob_floor)
          and 0.0 <= prob_floor < 1.0 / vocab_size)
    if not ok:
        raise ValueError(f"prob_floor={prob_floor!r} must be a finite number in [0, 1/{vocab_size}) = "
                         f"[0, {1.0 / vocab_size:g}): it is given to each of the {vocab_size} vocabulary entries")


def floor_log_probs(logp: torch.Tensor, prob_floor: float) -> torch.Tensor:
    """``log q`` with ``q = (1 - V f) p + f`` over the last dim (``V`` its size, ``f = prob_floor``) from a normalised
    log-distribution ``logp [..., V]``: ``q`` sums to 1 and every entry is ``>= f`` (module docstring)."""
    v = logp.shape[-1]
    check_prob_floor(prob_floor, v)
    if prob_floor == 0:
        return logp
    return torch.logaddexp(logp + math.log1p(-v * prob_floor), torch.full_like(logp, math.log(prob_floor)))


def forward_class(cfg):
    """The pure-torch forward for ``cfg``: ``TorchQwen2`` (``slime_rc.demo.rollout.torch_qwen2``, also named
    :data:`TorchGPT`), the one forward of every architecture the demo builds; called ``cls(full_parameters, cfg,
    dtype, device)``."""
    return TorchQwen2


def sampling_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs [N, V]`` -> bool ``[N, V]``: the top-p nucleus by SGLang's rule (sorted descending, keep token i iff
    ``cumsum_i - p_i <= top_p``; the most probable token is always kept)."""
    if top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) <= top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


class RolloutEngine:
    """Rollout engine (module docstring): ``load_weights`` every step, ``generate`` batches of prompts.

    Knobs: ``dtype`` (``"fp32"``/``"bf16"``/``"fp16"``: weights and forward in that precision), ``stale_steps``
    (generate with the weights of ``stale_steps`` syncs ago), ``logit_noise`` (sigma of the improbable-token logit
    noise, seeded by ``noise_seed``), ``temperature`` (> 0) and ``top_p`` (sampling only; log-probs are the full
    distribution's), ``seed`` (the sampling generator), ``prob_floor`` (f: sample from and report
    ``q = (1 - V f) p + f``, module docstring; ``0 <= f < 1 / V``, 0 = off).  ``device``: where the rollout engine's
    copy of the model runs.
    """

    def __init__(self, cfg, *, dtype: Union[str, torch.dtype] = "fp32", stale_steps: int = 0,
                 logit_noise: float = 0.0, noise_seed: int = 0, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, device: Union[str, torch.device, None] = None, prob_floor: float = 0.0):
        if not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (greedy decoding, SGLang's "
                             "temperature 0, has no matching trainer log-probs; use a small temperature)")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        if stale_steps < 0 or int(stale_steps) != stale_steps:
            raise ValueError(f"stale_steps={stale_steps!r} must be an integer >= 0")
        if not logit_noise >= 0:
            raise ValueError(f"logit_noise={logit_noise!r} must be >= 0")
        check_prob_floor(prob_floor, cfg.vocab_size)
        self.prob_floor = float(prob_floor)
        self.cfg = cfg
        self.dtype = resolve_dtype(dtype)
        self.stale_steps = int(stale_steps)
        self.logit_noise = float(logit_noise)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._versions: Deque[Tuple[int, Union[TorchGPT, TorchQwen2]]] = deque(maxlen=self.stale_steps + 1)
        self._syncs = 0
        self._sample_gen = torch.Generator(device=self.device).manual_seed(seed)
        self._noise_gen = torch.Generator(device=self.device).manual_seed(noise_seed)

    # -- weights -------------------------------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        """Weight sync from the trainer (``full_parameters(model)``); returns this sync's version number.  The forward
        is the config's (:func:`forward_class`: :class:`TorchGPT` for the demo's GPT, ``TorchQwen2`` for Qwen2's)."""
        self._versions.append((self._syncs, forward_class(self.cfg)(state_dict, self.cfg, self.dtype, self.device)))
        self._syncs += 1
        return self._syncs - 1

    @property
    def model(self) -> Union[TorchGPT, TorchQwen2]:
        """The model generating now: the one loaded ``stale_steps`` syncs ago (or the oldest kept)."""
        return self._active()[1]

    @property
    def weight_version(self) -> int:
        return self._active()[0]

    def _active(self) -> Tuple[int, Union[TorchGPT, TorchQwen2]]:
        if not self._versions:
            raise RuntimeError("no weights: call load_weights(full_parameters(model)) first")
        return self._versions[0]  # deque of the last stale_steps + 1 versions: [0] is stale_steps syncs back

    # -- distribution --------------------------------------------------------------------------------------------
    def _distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """Rollout-engine logits ``[N, V]`` -> the full (noised, tempered) fp32 log-distribution ``[N, V]``, floored."""
        y = logits.float() / self.temperature
        if self.logit_noise > 0:
            p = torch.softmax(y, dim=-1)
            eps = torch.randn(y.shape, generator=self._noise_gen, device=y.device, dtype=torch.float32)
            y = y + self.logit_noise * (1.0 - p) ** 2 * eps
        logp = torch.log_softmax(y, dim=-1)
        if self.prob_floor > 0:
            return floor_log_probs(logp, self.prob_floor)
        return logp.clamp(min=torch.finfo(self.dtype).min)

    def _sample(self, logq: torch.Tensor) -> torch.Tensor:
        q = logq.exp()
        if self.top_p < 1.0:
            q = torch.where(sampling_mask(q, self.top_p), q, torch.zeros_like(q))
        return torch.multinomial(q, 1, generator=self._sample_gen).squeeze(-1)

    # -- generation ----------------------------------------------------------------------------------------------
    @staticmethod
    def _left_pad(seqs: Sequence[torch.Tensor], pad_id: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.int64)
        width = int(lengths.max())
        out = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
        for i, s in enumerate(seqs):
            if s.numel():
                out[i, width - s.numel():] = s
        return out, width - lengths

    @staticmethod
    def _check_prompts(prompts: Sequence[torch.Tensor], vocab: int) -> List[torch.Tensor]:
        out = []
        for i, p in enumerate(prompts):
            p = torch.as_tensor(p)
            if p.dim() != 1 or p.numel() == 0 or p.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise ValueError(f"prompt {i}: expected a non-empty 1-D integer tensor, got {p.dtype} "
                                 f"{tuple(p.shape)}")
            if int(p.min()) < 0 or int(p.max()) >= vocab:
                raise ValueError(f"prompt {i}: token ids outside [0, {vocab})")
            out.append(p.to(torch.int64).cpu())
        return out

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                 stop_token: Optional[int] = None) -> List[Dict[str, object]]:
        """Sample up to ``max_new_tokens`` tokens after each prompt (batched; a row stops after sampling
        ``stop_token``, which is kept as its last response token).  Output: see the module docstring."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        prompts = self._check_prompts(prompts, self.cfg.vocab_size)
        if not prompts:
            return []
        version, model = self._active()
        tokens, pad = self._left_pad(prompts)
        n = len(prompts)
        if tokens.shape[1] + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt ({tokens.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.cfg.max_seq_len}")
        tokens, pad = tokens.to(self.device), pad.to(self.device)
        new_tokens = torch.zeros(n, max_new_tokens, dtype=torch.int64, device=self.device)
        new_logps = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=self.device)
        lengths = torch.zeros(n, dtype=torch.int64)
        active = torch.arange(n, device=self.device)
        for step in range(max_new_tokens):
            # recompute the whole (left-padded) prefix of the still-running rows: exact, and cheap at this size
            seq = torch.cat([tokens[active], new_tokens[active, :step]], dim=1)
            logq = self._distribution(model.logits(seq, pad[active])[:, -1])
            nxt = self._sample(logq)
            new_tokens[active, step] = nxt
            new_logps[active, step] = logq.gather(-1, nxt[:, None]).squeeze(-1)
            lengths[active.cpu()] += 1
            if stop_token is not None:
                active = active[nxt != stop_token]
                if active.numel() == 0:
                    break
        out = []
        for i, prompt in enumerate(prompts):
            m = int(lengths[i])
            response = new_tokens[i, :m].cpu()
            stopped = stop_token is not None and m > 0 and int(response[-1]) == stop_token
            out.append({"prompt": prompt, "response": response, "rollout_log_probs": new_logps[i, :m].cpu(),
                        "finish_reason": "stop" if stopped else "length", "weight_version": version})
        return out

    @torch.no_grad()
    def full_log_probs(self, tokens: torch.Tensor, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The rollout engine's full next-token log-distribution at every position: ``tokens [B, T]`` (``pad [B]``
        leading pad tokens) -> fp32 ``[B, T, V]`` -- active weights, dtype, temperature and a fresh draw of the logit
        noise, floored (what :meth:`generate` reports a log-prob from)."""
        _, model = self._active()
        logits = model.logits(tokens, pad)
        return self._distribution(logits.reshape(-1, logits.shape[-1])).reshape(logits.shape)

    @torch.no_grad()
    def score(self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Teacher-forced rollout-engine log-probs of given responses (SGLang's ``input_token_logprobs`` of the
        response part), from :meth:`full_log_probs`.  Returns one fp32 ``[len(response)]`` tensor per pair."""
        prompts = self._check_prompts(prompts, self.cfg.vocab_size)
        if len(responses) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        responses = [torch.as_tensor(r, dtype=torch.int64).reshape(-1).cpu() for r in responses]
        tokens, pad = self._left_pad([torch.cat([p, r]) for p, r in zip(prompts, responses)])
        logq = self.full_log_probs(tokens, pad)  # [B, W, V]
        width = tokens.shape[1]
        out = []
        for i, r in enumerate(responses):
            m = r.numel()
            rows = logq[i, width - m - 1:width - 1]  # position prompt_len - 1 + j predicts response token j
            out.append(rows.gather(-1, r.to(rows.device)[:, None]).squeeze(-1).cpu())
        return out
