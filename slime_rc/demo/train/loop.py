"""The GRPO training loop of ``slime-rc train``: rollout -> reward -> (recompute pi_old) -> correction-aware group
advantages -> one optimizer step with the rollout-correction loss, on a real megatron-core GPT under any layout.

Runs in every rank of an initialised process group (:func:`run_training`).  Per step:

1. weight sync: ``full_parameters(model)`` -> the rollout engine (``slime_rc.demo.rollout``; separate from the
   trainer, with its own precision / staleness / noise knobs).  Every rank runs the same deterministic rollout engine,
   so every rank holds the same samples without a broadcast -- except vLLM and SGLang (``--rollout-engine vllm`` /
   ``sglang``), which run in global rank 0 alone in a multi-process job: rank 0 syncs (vLLM) and generates, and hands
   the samples to the other ranks (:class:`RankZeroRollout`, one ``broadcast_object_list``), so every rank holds the
   same samples too;
2. ``prompts_per_step`` prompts x ``group_size`` samples, rewards from the task (``slime_rc.demo.train.task``);
3. packed micro-batches (``micro_batches`` of the global batch, contiguous blocks per DP rank): each sample is one
   sequence prompt + response; loss on the positions that predict response tokens, rollout log-probs there;
4. standard / decoupled mode: a forward-only pass recomputes log pi_old of the global batch;
5. decoupled mode: the pre-step correction of the global batch (``prepare_global_batch`` on this rank's sharded
   micro-batches, one collective round over DP x CP) -- the step's only correction call: the loss uses it, and the
   samples it keeps (:func:`kept_samples`) are the baselines';
6. advantages (``group_advantages``) over the samples the correction keeps, so a rejected sample never feeds its
   group's baseline: in decoupled mode from the recomputed pi_old (step 5); in bypass mode with rejection (RS, veto,
   mask mode) from a forward-only pass at the step's starting weights (= the pi_theta the loss sees; bypass without
   rejection skips that pass) and :func:`global_correction`;
7. one step: decoupled mode with the pre-step correction of step 5, bypass mode with the in-loss correction
   (``slime_rc.megatron.loss``).

Warm start (``warm_start_steps``, before step 1): supervised steps on the correct answers
(:func:`warm_start_batch`, :func:`supervised_loss_func`: cross-entropy of ``log_softmax(logits / T)`` on the answer
tokens and EOS, the token mean of the global batch) through the same ``train_step``, layout and optimizer; their
metrics rows carry ``"warm_start": True`` (``step`` 0..N-1; the GRPO steps are then N, N+1, ...) and only ``loss``,
``grad_norm``, ``loss_tokens`` and the times.  Their prompts come from their own generator, so the GRPO steps see the
same prompts with or without a warm start.

Metrics-only monitoring (``--get-mismatch-metrics`` without IS/RS/veto) changes neither the loss nor the gradients:
the correction's keep mask is then every loss token and no weight is applied.  In bypass mode it adds no forward pass:
the metrics come from the loss's own pi_theta.  ``decoupled_metrics`` (bypass only) asks for the forward-only pass
and logs the global-batch metrics of pi_old (the weights at the step's start) vs pi_rollout as
``rollout_corr_decoupled/...``.  ``dump_logprobs`` writes each step's per-sample train / rollout log-probs
(``slime_rc.tools.dump``, JSONL) for ``slime-rc analyze``; in bypass mode it needs the same forward-only pass.

Per-step metrics (equal on every rank): ``step``, ``loss``, ``grad_norm``, ``reward_mean``, ``reward_std``,
``exact_fraction``, ``response_length``, ``kept_fraction``, ``loss_tokens`` (the step's response tokens),
``rejected_tokens`` (those the correction removed from the loss: each micro-batch's
``rollout_corr/rejected_token_fraction`` times its tokens; absent when a correction that rejects logged no such
fraction), ``rollout_corr/...`` (the mean over micro-batches of the correction metrics; global-batch values in
decoupled mode), ``rollout_corr/tis_function/<name>`` (a
``--custom-tis-function-path`` function's own metrics, reduced as slime reduces them: per-sample means over the
original loss mask, summed over the step's micro-batches and DP x CP ranks, divided by the step's number of samples
-- of tokens with ``--calculate-per-token-loss``), ``rollout_corr_decoupled/...`` (``decoupled_metrics``),
``time/rollout``, ``time/train``, ``time/step`` (seconds).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.engine import compute_rollout_correction
from slime_rc.correction.packed import cu_seqlens_from_lengths
from slime_rc.demo.train.advantages import group_advantages
from slime_rc.demo.train.task import EOS, MIN_VOCAB, TASKS, _answer, make_prompts, rewards

ROLLOUT_DTYPES = ("fp32", "bf16", "fp16")  # slime_rc.demo.rollout.in_process.DTYPES
ROLLOUT_ENGINES = ("torch", "sglang", "vllm")
MODELS = ("tiny-gpt", "qwen2-tiny")  # slime_rc.demo.model: TinyGPTConfig(), qwen2_tiny()
VLLM_HEAD_SIZE = 32  # the smallest head size of vLLM's CPU attention (slime_rc.demo.rollout.vllm_engine)
MAX_SEED = 2**31 - 1


@dataclass
class TrainSettings:
    """What ``slime-rc train`` runs (the embedded default: a tiny model learning to copy 3 digits, ~1 minute on
    2 CPU cores; measured: mean reward 0.06 -> ~0.7 in 150 steps)."""

    task: str = "copy"
    digits: int = 3
    prompts_per_step: int = 32
    group_size: int = 8
    num_steps: int = 150
    seed: int = 0
    lr: float = 3e-3
    micro_batches: int = 4  # of the global batch
    temperature: float = 1.0
    top_p: float = 1.0
    rollout_dtype: str = "bf16"  # the classic mismatch: bf16 rollouts, fp32 trainer
    stale_steps: int = 0
    logit_noise: float = 0.0
    rollout_prob_floor: float = 0.0  # in-process engine: sample from / report q = (1 - V f) p + f (0 = off)
    warm_start_steps: int = 0  # supervised steps on the correct answers before the GRPO steps
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    rollout_engine: str = "torch"  # or "sglang": a running server at sglang_url (it serves its own weights), or
    # "vllm": vLLM in this process, serving the Qwen2-architecture model (slime_rc.demo.rollout.vllm_engine)
    sglang_url: Optional[str] = None
    sglang_timeout: float = 60.0  # seconds to wait for the answer of one /generate (the connection: 5 s)
    decoupled_metrics: bool = False  # bypass mode: forward-only pass -> global pi_old vs pi_rollout metrics
    dump_logprobs: Optional[str] = None  # directory for per-step log-prob dumps (slime_rc.tools.dump)
    vocab_size: int = 16
    model: str = "tiny-gpt"  # or "qwen2-tiny": Qwen2's architecture (RMSNorm, SwiGLU, q/k/v bias, RoPE 1e6, GQA)
    hf_checkpoint: Optional[str] = None  # a HF Qwen2 checkpoint directory to start from (sizes from its config.json)
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4

    def check(self, config: RolloutCorrectionConfig) -> None:
        """Refuse a value no run can use (:meth:`check_values`) and settings that would do nothing under
        ``config`` (said at launch, before any process starts)."""
        self.check_values()
        if self.decoupled_metrics and config.mode != "bypass":
            raise ValueError(f"--decoupled-metrics is for bypass mode (it recomputes pi_old to measure pi_old vs "
                             f"pi_rollout); in mode={config.mode!r} pi_old is recomputed anyway and the rollout_corr/ "
                             f"metrics already are pi_old vs pi_rollout: drop the flag, or add "
                             f"--get-mismatch-metrics for them in standard mode")

    def check_values(self) -> None:
        """Every value on its own and the sizes together: ``ValueError``, one line naming the flag, the value and
        the fix.  The launcher calls it (through :meth:`check`) before any process starts."""
        def count(flag, value, minimum, what):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                default = getattr(TrainSettings, _FIELD_OF[flag])
                raise ValueError(f"{flag} {value}: {what}; give {flag} {minimum} or more (default {default})")

        def number(flag, value, what, low, low_open, high=None, why=""):
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and (value > low if low_open else value >= low) and (high is None or value <= high))
            if not ok:
                default = getattr(TrainSettings, _FIELD_OF[flag])
                band = (f"{'>' if low_open else '>='} {low:g}" if high is None else
                        f"in {'(' if low_open else '['}{low:g}, {high:g}]")
                raise ValueError(f"{flag} {value}: {what} must be a finite number {band}{why}; give e.g. {flag} "
                                 f"{default} (the default)")

        for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
            count(flag, getattr(self, _FIELD_OF[flag]), 1, "a parallel size is a number of ranks")
        if self.vpp is not None:
            if isinstance(self.vpp, bool) or not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(f"--virtual-pipeline-model-parallel-size {self.vpp}: virtual pipeline stages per "
                                 f"rank must be 2 or more (with --pipeline-model-parallel-size 2 or more); give 2, or "
                                 f"drop the flag")
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(f"--virtual-pipeline-model-parallel-size {self.vpp} needs "
                                 f"--pipeline-model-parallel-size 2 or more (got 1); raise the pipeline size or drop "
                                 f"the flag")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size 2 or more (got 1): it splits "
                             "activations over the tensor-parallel group; raise the tensor-parallel size or drop "
                             "the flag")
        count("--num-steps", self.num_steps, 1, "a run needs at least one step (nothing would be trained or "
                                                "logged)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed {self.seed}: give a seed from 0 to {MAX_SEED} (default {TrainSettings.seed})")
        number("--lr", self.lr, "the learning rate", 0.0, True)
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task}: not a task; give one of {', '.join(TASKS)} (default "
                             f"{TrainSettings.task})")
        count("--digits", self.digits, 1, "a prompt needs at least one digit")
        count("--prompts-per-step", self.prompts_per_step, 1, "a step needs at least one prompt")
        count("--group-size", self.group_size, 1, "each prompt needs at least one sample")
        if self.group_size == 1:
            raise ValueError("--group-size 1: GRPO advantages compare each sample with the other samples of its "
                             "prompt, so with one sample per prompt every advantage is 0 and nothing is learned; "
                             f"give --group-size 2 or more (default {TrainSettings.group_size})")
        count("--micro-batches", self.micro_batches, 1, "a step needs at least one micro-batch")
        samples = self.prompts_per_step * self.group_size
        if samples % self.micro_batches:
            fits = max(d for d in range(1, self.micro_batches + 1) if samples % d == 0)
            raise ValueError(f"--micro-batches {self.micro_batches}: the global batch of {self.prompts_per_step} "
                             f"prompts x {self.group_size} samples = {samples} does not split into "
                             f"{self.micro_batches} micro-batches; give a divisor of {samples} (e.g. "
                             f"--micro-batches {fits})")
        number("--rollout-temperature", self.temperature, "the sampling temperature", 0.0, True,
               why=" (the trainer divides its logits by it)")
        number("--top-p", self.top_p, "the nucleus mass", 0.0, True, 1.0)
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise ValueError(f"--rollout-dtype {self.rollout_dtype}: not a rollout precision; give one of "
                             f"{', '.join(ROLLOUT_DTYPES)} (default {TrainSettings.rollout_dtype})")
        count("--stale-steps", self.stale_steps, 0, "a number of weight syncs")
        number("--logit-noise", self.logit_noise, "the noise sigma", 0.0, False)
        floor, top = self.rollout_prob_floor, 1.0 / self.vocab_size
        if (isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor)
                or not 0.0 <= floor < top):
            raise ValueError(f"--rollout-prob-floor {floor}: the rollout engine's probability floor must be a finite "
                             f"number in [0, {top:g}) (every one of the {self.vocab_size} vocabulary entries gets at "
                             f"least the floor, so {self.vocab_size} x floor must stay below 1); give e.g. "
                             f"--rollout-prob-floor 0.002, or 0 (the default: no floor)")
        if floor > 0 and self.rollout_engine != "torch":
            raise ValueError(f"--rollout-prob-floor {floor}: the floor is a mismatch knob of the in-process rollout "
                             f"engine (--rollout-engine torch); --rollout-engine {self.rollout_engine} samples from its "
                             f"own distribution: drop the flag, or use --rollout-engine torch")
        count("--warm-start-steps", self.warm_start_steps, 0, "a number of supervised steps")
        count("--hidden-size", self.hidden_size, 1, "the model needs a hidden size")
        count("--num-layers", self.num_layers, 1, "the model needs a layer")
        heads = self.num_attention_heads  # the flags' sizes (a --hf-checkpoint's own: _check_model)
        if self.hf_checkpoint is None and self.hidden_size % heads:
            raise ValueError(f"--hidden-size {self.hidden_size}: not a multiple of the model's {heads} attention "
                             f"heads; give a multiple of {heads} (default {TrainSettings.hidden_size})")
        if self.hf_checkpoint is None and heads % self.tp or self.vocab_size % self.tp:
            fits = [t for t in range(1, heads + 1) if heads % t == 0 and self.vocab_size % t == 0]
            raise ValueError(f"--tensor-model-parallel-size {self.tp}: the model's {heads} attention heads and "
                             f"{self.vocab_size}-token vocabulary do not split over {self.tp} ranks; give one of "
                             f"{', '.join(map(str, fits))}")
        stages = self.pp * (self.vpp or 1)
        if self.hf_checkpoint is None and self.num_layers % stages:
            raise ValueError(f"--num-layers {self.num_layers}: does not split over {stages} pipeline stages "
                             f"(--pipeline-model-parallel-size {self.pp}"
                             + (f" x --virtual-pipeline-model-parallel-size {self.vpp}" if self.vpp else "")
                             + f"); give a multiple of {stages}")
        self._check_model(stages)
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(f"--rollout-engine {self.rollout_engine}: give torch (in-process), sglang or vllm")
        if self.rollout_engine == "vllm":
            self._check_vllm()
        if self.rollout_engine == "sglang" and not self.sglang_url:
            raise ValueError("--rollout-engine sglang needs --sglang-url http://host:port")
        if self.sglang_url is not None:
            from slime_rc.demo.rollout.sglang_client import check_sglang_url
            check_sglang_url(self.sglang_url)
        number("--sglang-timeout", self.sglang_timeout, "seconds to wait for SGLang's answer", 0.0, True)

    def _check_model(self, stages: int) -> None:
        """``--model`` / ``--hf-checkpoint``: a known model, a checkpoint only with ``--model qwen2-tiny`` (its
        config.json read and refused as ``config_from_hf`` does, naming the key), and the Qwen2 model's key/value
        groups, vocabulary and layers split over the layout."""
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model}: not a demo model; give one of {', '.join(MODELS)} (default "
                             f"{TrainSettings.model})")
        if self.hf_checkpoint is not None and self.model != "qwen2-tiny":
            raise ValueError(f"--hf-checkpoint {self.hf_checkpoint}: a HF checkpoint holds a Qwen2 model; give "
                             f"--model qwen2-tiny with it (--model {self.model} is the demo's own GPT, which has no HF "
                             f"format)")
        if self.model != "qwen2-tiny":
            return
        try:
            cfg = self.model_config()
        except (ValueError, FileNotFoundError) as e:
            if self.hf_checkpoint is None:
                raise
            raise ValueError(f"--hf-checkpoint {self.hf_checkpoint}: {e}") from None
        groups = cfg.num_query_groups or cfg.num_attention_heads
        if groups % self.tp or cfg.num_attention_heads % self.tp or cfg.vocab_size % self.tp:
            fits = [t for t in range(1, groups + 1) if groups % t == 0 and cfg.vocab_size % t == 0]
            raise ValueError(f"--tensor-model-parallel-size {self.tp}: the Qwen2 model's {groups} key/value groups "
                             f"and {cfg.vocab_size}-token vocabulary do not split over {self.tp} ranks; give one of "
                             f"{', '.join(map(str, fits))}")
        if cfg.num_layers % stages:
            raise ValueError(f"--hf-checkpoint {self.hf_checkpoint}: its {cfg.num_layers} layers do not split over "
                             f"{stages} pipeline stages; give a --pipeline-model-parallel-size (x virtual stages) "
                             f"that divides {cfg.num_layers}")

    def _check_vllm(self) -> None:
        """``--rollout-engine vllm``: the model is the Qwen2 architecture with heads of ``VLLM_HEAD_SIZE`` (vLLM's
        CPU attention has no smaller head size), the torch engine's mismatch knobs do not apply, and the sampling
        settings must give vLLM log-probs in the trainer's convention
        (``slime_rc.demo.rollout.vllm_engine.check_vllm_sampling``; vLLM itself is not imported here)."""
        from slime_rc.demo.rollout.vllm_engine import check_vllm_sampling
        if self.hidden_size % VLLM_HEAD_SIZE:
            raise ValueError(f"--hidden-size {self.hidden_size}: --rollout-engine vllm builds the model with attention "
                             f"heads of {VLLM_HEAD_SIZE} (vLLM's CPU attention has no smaller head size), so the "
                             f"hidden size must be a multiple of {VLLM_HEAD_SIZE}; give e.g. --hidden-size 64")
        heads = self.hidden_size // VLLM_HEAD_SIZE
        groups = heads // 2 if heads % 2 == 0 else heads  # qwen2_tiny's key/value groups
        if groups % self.tp:
            raise ValueError(f"--tensor-model-parallel-size {self.tp}: with --rollout-engine vllm the model has "
                             f"{heads} heads of {VLLM_HEAD_SIZE} in {groups} key/value groups (--hidden-size "
                             f"{self.hidden_size}), which do not split over {self.tp} ranks; give a larger "
                             f"--hidden-size (a multiple of {VLLM_HEAD_SIZE * 2 * self.tp}) or a smaller tensor-"
                             f"parallel size")
        if self.logit_noise > 0:
            raise ValueError(f"--logit-noise {self.logit_noise}: the noise is a mismatch knob of the in-process torch "
                             f"engine; vLLM samples from its own distribution: drop the flag, or use "
                             f"--rollout-engine torch")
        try:
            check_vllm_sampling({"temperature": self.temperature, "top_p": self.top_p}, self.temperature,
                                "raw_logprobs" if self.temperature == 1.0 else "processed_logprobs")
        except ValueError as e:
            raise ValueError(f"--rollout-engine vllm --rollout-temperature {self.temperature} --top-p {self.top_p}: "
                             f"{e}") from None

    def model_config(self):
        """The model's :class:`~slime_rc.demo.model.TinyGPTConfig`: ``--model tiny-gpt`` (the demo GPT) or
        ``qwen2-tiny`` (``qwen2_tiny``) at the flags' sizes, or, with ``--hf-checkpoint``, the checkpoint's
        config.json (``slime_rc.demo.hf_checkpoint.config_from_hf``: its sizes, not the flags').
        ``--rollout-engine vllm`` serves an HF architecture: the Qwen2 model, with heads of ``VLLM_HEAD_SIZE``."""
        from slime_rc.demo.model import TinyGPTConfig, qwen2_tiny
        if self.hf_checkpoint is not None:
            from slime_rc.demo.hf_checkpoint import config_from_hf
            cfg = config_from_hf(self.hf_checkpoint, seed=1234 + self.seed)
            if cfg.vocab_size < MIN_VOCAB:
                raise ValueError(f"config.json vocab_size={cfg.vocab_size}: below the task's {MIN_VOCAB} tokens; give "
                                 f"a checkpoint with a vocabulary of {MIN_VOCAB} tokens or more")
            return cfg
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(f"vocab_size={self.vocab_size} is below the task's {MIN_VOCAB} tokens")
        if self.model == "qwen2-tiny" or self.rollout_engine == "vllm":
            heads = self.hidden_size // VLLM_HEAD_SIZE if self.rollout_engine == "vllm" else self.num_attention_heads
            return qwen2_tiny(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                              num_attention_heads=heads, max_seq_len=4 * (self.digits + 2) + 8,
                              seed=1234 + self.seed)
        return TinyGPTConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                             num_attention_heads=self.num_attention_heads, ffn_hidden_size=4 * self.hidden_size,
                             max_seq_len=4 * (self.digits + 2) + 8, seed=1234 + self.seed)


# the flag of each checked field (the launcher's _FLAGS, reversed where needed): messages name the flag a user typed
_FIELD_OF = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
             "--context-parallel-size": "cp", "--num-steps": "num_steps", "--lr": "lr", "--digits": "digits",
             "--prompts-per-step": "prompts_per_step", "--group-size": "group_size", "--micro-batches": "micro_batches",
             "--rollout-temperature": "temperature", "--top-p": "top_p", "--stale-steps": "stale_steps",
             "--logit-noise": "logit_noise", "--hidden-size": "hidden_size", "--num-layers": "num_layers",
             "--sglang-timeout": "sglang_timeout", "--warm-start-steps": "warm_start_steps",
             "--rollout-prob-floor": "rollout_prob_floor"}


def make_rollout_engine(s: TrainSettings, cfg):
    """The rollout engine: the in-process one with its mismatch knobs, an SGLang server's ``/generate`` or vLLM.
    SGLang and vLLM sample at random: in a multi-process job they run in rank 0, which hands every rank the same
    samples (:class:`RankZeroRollout`; one server request per step, not one per rank)."""
    if s.rollout_engine in ("sglang", "vllm"):
        if s.rollout_engine == "sglang":
            from slime_rc.demo.rollout.sglang_client import SGLangEngine
            if not s.sglang_url:
                raise ValueError("--rollout-engine sglang needs --sglang-url http://host:port")

            def build():
                return SGLangEngine(s.sglang_url, temperature=s.temperature, top_p=s.top_p, timeout=s.sglang_timeout)
        else:
            def build():
                return make_vllm_engine(s, cfg)
        return RankZeroRollout(build) if dist.is_initialized() and dist.get_world_size() > 1 else build()
    if s.rollout_engine != "torch":
        raise ValueError(f"--rollout-engine {s.rollout_engine!r}: use torch (in-process), sglang or vllm")
    from slime_rc.demo.rollout.in_process import RolloutEngine
    return RolloutEngine(cfg, dtype=s.rollout_dtype, stale_steps=s.stale_steps, logit_noise=s.logit_noise,
                         noise_seed=s.seed + 1, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                         prob_floor=s.rollout_prob_floor)


def make_vllm_engine(s: TrainSettings, cfg):
    """vLLM in this process (``slime_rc.demo.rollout.vllm_engine.VllmRolloutEngine``), built from an HF Qwen2
    checkpoint directory of ``cfg`` written to a temporary directory (removed at exit): vLLM takes the architecture
    and the shapes from it; the weights come with the first sync (``megatron_to_hf`` of ``full_parameters``), so
    the checkpoint's are zeros.  ``--rollout-dtype`` is vLLM's dtype."""
    import atexit
    import shutil
    import tempfile

    from slime_rc.demo.hf_checkpoint import megatron_to_hf, write_hf_checkpoint
    from slime_rc.demo.model import parameter_shapes
    from slime_rc.demo.rollout.vllm_engine import VllmRolloutEngine

    directory = tempfile.mkdtemp(prefix="slime_rc_vllm_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    write_hf_checkpoint(directory, {n: torch.zeros(shape) for n, shape in parameter_shapes(cfg).items()}, cfg)
    return VllmRolloutEngine(directory, lambda params: megatron_to_hf(params, cfg).items(), dtype=s.rollout_dtype,
                             stale_steps=s.stale_steps, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                             max_model_len=cfg.max_seq_len)


class RankZeroRollout:
    """A rollout engine that runs in global rank 0 alone, for the other ranks too: vLLM in a multi-process job
    (``slime_rc.demo.rollout.vllm_engine``: one in-process vLLM, not one per rank), and the SGLang client (one
    ``/generate`` per step: each rank's own request would draw other samples for the same sequences).

    ``build()`` makes the engine, in rank 0 only (the other ranks never import vLLM).  Each method is called by every
    rank, in the same order, as the loop calls any engine: :meth:`load_weights` pushes the sync to rank 0's engine
    (the other ranks only count it); :meth:`generate` samples in rank 0 and hands its samples -- prompts, responses,
    rollout log-probs, finish reasons, weight versions -- to every rank with one ``broadcast_object_list`` on the
    default group, so every rank trains on the same samples, those a 1-process run draws (the prompts come from the
    same seeded generator in every rank, the engine's sampling seeds from its own).  Staleness is the engine's.  A
    failure in rank 0 (building the engine, a weight sync, generating) is handed on too: rank 0 raises it, the other
    ranks a ``RuntimeError`` quoting it, instead of waiting in a collective."""

    SOURCE = 0

    def __init__(self, build: Callable[[], object]):
        self.rank = dist.get_rank()
        self.engine = None
        self._syncs = 0
        self._sync_error: Optional[Exception] = None  # rank 0: a refused weight sync, handed on by generate
        error = None
        if self.rank == self.SOURCE:
            try:
                self.engine = build()
            except Exception as e:  # a signal (KeyboardInterrupt, Interrupted) stops every rank anyway
                error = e
        self._hand_on("to start", None, error)

    def _hand_on(self, what: str, result, error: Optional[BaseException]):
        """Rank 0's ``result`` to every rank, or its ``error`` (what it ``failed``) as a ``RuntimeError``."""
        box = [("error", f"failed {what}: {type(error).__name__}: {error}") if error is not None else ("ok", result)]
        dist.broadcast_object_list(box, src=self.SOURCE)
        if error is not None:
            raise error
        status, value = box[0]
        if status == "error":
            raise RuntimeError(f"the rollout engine (in rank {self.SOURCE}) {value}")
        return value

    def load_weights(self, full_params) -> int:
        """Weight sync: rank 0's engine takes it (a refusal is handed on by the next :meth:`generate`); every rank
        returns the sync's version (from 0)."""
        if self.engine is not None and self._sync_error is None and hasattr(self.engine, "load_weights"):
            try:
                self.engine.load_weights(full_params)
            except Exception as e:
                self._sync_error = e
        self._syncs += 1
        return self._syncs - 1

    def generate(self, prompts, max_new_tokens: int, stop_token: Optional[int] = None) -> List[dict]:
        samples, error = None, self._sync_error
        what = "to take the weights" if error is not None else "to generate"
        if self.engine is not None and error is None:
            try:
                samples = self.engine.generate(prompts, max_new_tokens=max_new_tokens, stop_token=stop_token)
            except Exception as e:
                error = e
        return self._hand_on(what, samples, error)

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()


def pack_micro_batches(samples: List[dict], advantages: torch.Tensor, n_micro: int) -> List[dict]:
    """Samples -> ``n_micro`` packed micro-batches (contiguous blocks).  Position ``k`` of a sequence predicts token
    ``k + 1``: the response token ``j`` (at ``P + j``) is predicted at ``P - 1 + j``.  ``response_lengths`` (one per
    sequence) is slime's ``response_lengths`` for a TIS function (``slime_rc.slime.tis_bridge.with_sample_fields``)."""
    if len(samples) % n_micro:
        raise ValueError(f"{len(samples)} samples do not split into micro_batches={n_micro}")
    per = len(samples) // n_micro
    out = []
    for b in range(n_micro):
        block = range(b * per, (b + 1) * per)
        toks, mask, rlp, adv, lengths, responses = [], [], [], [], [], []
        for i in block:
            p, r = samples[i]["prompt"], samples[i]["response"]
            n = p.numel() + r.numel()
            m, lp = torch.zeros(n), torch.zeros(n)
            m[p.numel() - 1:n - 1] = 1.0
            lp[p.numel() - 1:n - 1] = samples[i]["rollout_log_probs"]
            toks.append(torch.cat([p, r]))
            mask.append(m)
            rlp.append(lp)
            adv.append(torch.full((n,), float(advantages[i])))
            lengths.append(n)
            responses.append(int(r.numel()))
        out.append(dict(tokens=torch.cat(toks), cu_seqlens=cu_seqlens_from_lengths(lengths),
                        loss_mask=torch.cat(mask), rollout_log_probs=torch.cat(rlp), advantages=torch.cat(adv),
                        sample_index=list(block), response_lengths=responses))
    return out


def _gather_from_reporters(local: dict) -> dict:
    """Merge per-rank dicts (non-empty only on the ranks that report) into one, on every rank."""
    parts: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged = {}
    for p in parts:
        merged.update(p or {})
    return merged


def _is_reporter() -> bool:
    from megatron.core import parallel_state as ps
    return (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def self_log_probs(M, model, batch: List[dict], temperature: float, log_probs_fn) -> dict:
    """A forward-only pass: the model's log-probs of every target of the global batch, ``{first sample index of a
    micro-batch: [T] in its packed order}``, on every rank."""
    from megatron.core import parallel_state as ps

    def record(logits, lmb):
        logp = log_probs_fn(logits, lmb["targets"], temperature)
        return logp.sum() * 0.0, {"logp": logp.detach()}
    mine = M.data_parallel_slice(batch)
    fwd = M.train_step(model, None, mine, record, forward_only=True)
    local = {}
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for mb, o, lmb in zip(mine, fwd.outputs, fwd.local_micro_batches):
            full = M.gather_to_global(o["logp"], lmb).cpu()  # the unsharded batch is host data
            if _is_reporter():
                local[mb["sample_index"][0]] = full
    return _gather_from_reporters(local)


def global_correction(batch: List[dict], train_log_probs: dict, config: RolloutCorrectionConfig):
    """The correction of the whole global batch (every rank holds it all: no collective) against ``train_log_probs``
    (:func:`self_log_probs`): the kept samples and ``decoupled_metrics`` where no pre-step correction runs."""
    cat = (lambda k: torch.cat([mb[k] for mb in batch]))
    lengths = [int(n) for mb in batch for n in (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1])]
    train = torch.cat([train_log_probs[mb["sample_index"][0]] for mb in batch])
    return compute_rollout_correction(train, cat("rollout_log_probs"), cat("loss_mask"),
                                      cu_seqlens_from_lengths(lengths), config)


def kept_samples(micro_batches: List[dict], prepared, n_samples: int) -> torch.Tensor:
    """``[n_samples]`` bool, on every rank: the samples the pre-step correction keeps, read off this rank's
    ``prepare_global_batch`` result (``prepared[i]`` of ``micro_batches[i]``: each sequence's ``kept``) and gathered
    over the DP ranks."""
    local = {}
    if _is_reporter():
        for mb, p in zip(micro_batches, prepared):
            local.update(zip(mb["sample_index"], (p.correction.sequences["kept"] > 0).tolist()))
    merged = _gather_from_reporters(local)
    if sorted(merged) != list(range(n_samples)):
        raise RuntimeError(f"the pre-step correction reported {len(merged)} of {n_samples} samples")
    return torch.tensor([merged[i] for i in range(n_samples)], dtype=torch.bool)


def dump_step(directory: str, step: int, batch: List[dict], train_log_probs: dict, rewards: torch.Tensor,
              advantages: torch.Tensor, mode: str) -> str:
    """Write one step's samples (their response tokens only) with :class:`slime_rc.tools.dump.DumpWriter`:
    ``train_log_probs`` = pi_old (standard / decoupled) or pi_theta at the step's start (bypass), from
    :func:`self_log_probs`."""
    from slime_rc.tools.dump import DumpWriter, sample_record
    records = []
    for mb in batch:
        cu = mb["cu_seqlens"].tolist()
        train = train_log_probs[mb["sample_index"][0]]
        for j, i in enumerate(mb["sample_index"]):
            span = slice(cu[j], cu[j + 1])
            keep = mb["loss_mask"][span] > 0  # the response tokens: positions that predict them
            records.append(sample_record(train[span][keep], mb["rollout_log_probs"][span][keep],
                                         mb["loss_mask"][span][keep], step=step, sample=i, reward=float(rewards[i]),
                                         advantage=float(advantages[i]), mode=mode))
    return DumpWriter(directory).write_step(step, records)


WARM_START_SEED_OFFSET = 7919  # the warm start's prompts: their own stream, so the GRPO prompts do not move


def warm_start_batch(s: TrainSettings, generator: torch.Generator) -> List[dict]:
    """One supervised step's packed micro-batches: ``prompts_per_step * group_size`` fresh prompts, each followed by
    its correct answer and ``EOS`` (the loss mask covers the positions that predict them), in the GRPO steps'
    format (:func:`pack_micro_batches`)."""
    prompts = make_prompts(s.task, s.prompts_per_step * s.group_size, s.digits, generator)
    samples = []
    for p in prompts:
        response = torch.cat([_answer(s.task, p[:-1]), torch.tensor([EOS])])
        samples.append({"prompt": p, "response": response, "rollout_log_probs": torch.zeros(response.numel())})
    return pack_micro_batches(samples, torch.zeros(len(samples)), s.micro_batches)


def supervised_loss_func(temperature: float, global_tokens: float, log_probs_fn) -> Callable:
    """``loss_fn(logits, local_mb)`` of a warm-start step: cross-entropy ``-log softmax(logits / T)[target]`` on the
    loss-mask positions (answer tokens + EOS), the token mean of the global batch under megatron's legacy
    convention (``local_sum * M * dp / global_tokens``, ``slime_rc.demo.model``)."""
    def loss_fn(logits, lmb):
        logp = log_probs_fn(logits.reshape(-1, logits.shape[-1]), lmb["targets"].reshape(-1), temperature)
        mask = lmb["loss_mask"].to(logp.dtype)
        local = -(logp * mask).sum()
        scale = float(lmb["num_micro_batches"] * lmb["dp_size"]) / global_tokens
        return local * scale, {"ce_sum": local.detach(), "tokens": mask.sum().detach()}
    return loss_fn


def run_training(settings: TrainSettings, config: RolloutCorrectionConfig,
                 on_step: Callable[[dict], None] = lambda m: None, *, tis_function: Optional[Callable] = None,
                 tis_args=None) -> List[dict]:
    """Train ``settings.num_steps`` steps in this (initialised) process group; returns the per-step metrics.
    ``tis_function`` (``--custom-tis-function-path``, slime's contract): the weights and keep mask come from it, in
    the loss (so decoupled mode then uses the in-loss path, not the pre-step one).  It is called with a copy of
    ``tis_args`` carrying slime's attributes resolved from ``config``
    (:func:`slime_rc.config.slime_attributes.with_slime_attributes`), and sees slime's ``total_lengths`` /
    ``response_lengths`` (prompt + response, response) of every sample."""
    from megatron.core import parallel_state as ps

    from slime_rc.demo import model as M
    from slime_rc.megatron.logprobs import vocab_parallel_log_probs
    from slime_rc.megatron.loss import make_loss_func, prepare_global_batch
    from slime_rc.slime.tis_bridge import (TIS_FUNCTION_METRICS, reduce_tis_function_metrics,
                                           tis_function_correction_for, with_sample_fields)

    s = settings
    s.check(config)
    # the slime integration's bridge, handed to the loss as its correction (the loss does not import it)
    external = None if tis_function is None else tis_function_correction_for(tis_function, tis_args)
    M.initialize_parallel(s.tp, s.pp, s.cp, s.vpp, s.sequence_parallel, seed=1234 + s.seed)
    try:
        cfg = s.model_config()
        model = M.build_model(cfg, calculate_per_token_loss=False)
        if s.hf_checkpoint is not None:  # before the optimizer: it starts from the loaded weights
            from slime_rc.demo.hf_checkpoint import load_hf_checkpoint
            load_hf_checkpoint(model, s.hf_checkpoint, cfg)
        optimizer = M.build_optimizer(model, lr=s.lr)
        rollout_engine = make_rollout_engine(s, cfg)
        prompt_gen = torch.Generator().manual_seed(s.seed)
        history = []
        # warm start: supervised steps on the correct answers (same train_step path, layouts and optimizer)
        warm_gen = torch.Generator().manual_seed(s.seed + WARM_START_SEED_OFFSET)
        for step in range(s.warm_start_steps):
            t0 = time.perf_counter()
            batch = warm_start_batch(s, warm_gen)
            tokens = float(sum(float(mb["loss_mask"].sum()) for mb in batch))
            result = M.train_step(model, optimizer, M.data_parallel_slice(batch),
                                  supervised_loss_func(s.temperature, tokens, vocab_parallel_log_probs))
            metrics = {"step": step, "warm_start": True, "loss": result.loss, "grad_norm": result.grad_norm,
                       "loss_tokens": int(tokens), "time/train": time.perf_counter() - t0,
                       "time/step": time.perf_counter() - t0}
            history.append(metrics)
            on_step(metrics)
        for step in range(s.warm_start_steps, s.warm_start_steps + s.num_steps):
            t0 = time.perf_counter()
            state = M.full_parameters(model)  # collective: every rank
            if hasattr(rollout_engine, "load_weights"):  # an SGLang server's weights are updated by the user's own path
                rollout_engine.load_weights(state)
            prompts = [p for p in make_prompts(s.task, s.prompts_per_step, s.digits, prompt_gen)
                       for _ in range(s.group_size)]
            samples = rollout_engine.generate(prompts, max_new_tokens=s.digits + 1, stop_token=EOS)
            r = rewards(s.task, prompts, [x["response"] for x in samples])
            t_rollout = time.perf_counter() - t0

            batch = pack_micro_batches(samples, torch.zeros(len(samples)), s.micro_batches)
            kept = torch.ones(len(samples), dtype=torch.bool)
            # log-probs of the current weights: pi_old (standard / decoupled), or, in bypass mode with rejection,
            # pi_theta at the start of the step -- what the loss will see -- to know the rejected samples before the
            # baselines (that forward pass is the price of correct baselines; bypass without rejection skips it)
            bypass = config.mode == "bypass"
            current = None
            if not bypass or config.rejects or s.decoupled_metrics or s.dump_logprobs:
                current = self_log_probs(M, model, batch, s.temperature, vocab_parallel_log_probs)
                if not bypass:
                    for mb in batch:
                        mb["old_log_probs"] = current[mb["sample_index"][0]]

            t1 = time.perf_counter()
            mine = M.data_parallel_slice(batch)
            if tis_function is not None:
                mine = [with_sample_fields(mb) for mb in mine]
            local_mbs = M.shard_for_step(model, mine)  # advantages filled in below, once the kept samples are known
            prestep = config.mode == "decoupled" and tis_function is None
            # decoupled mode: the step's one correction, of the global batch; its keep mask is also the baselines'
            prepared = prepare_global_batch(local_mbs, config) if prestep else None
            global_metrics = {}
            if prepared is not None:
                if config.rejects:
                    kept = kept_samples(mine, prepared, len(samples))
            elif config.rejects or s.decoupled_metrics:  # the correction of the global batch, on every rank
                corr = global_correction(batch, current, config)
                if config.rejects:  # which samples the correction keeps, for the group baselines
                    kept = corr.sequences["kept"] > 0
                if s.decoupled_metrics:
                    global_metrics = {k: float(v) for k, v in corr.prefixed("rollout_corr_decoupled/").items()}
            adv = group_advantages(r, s.group_size, kept)
            for mb, lmb in zip(mine, local_mbs):
                cu = mb["cu_seqlens"]
                mb["advantages"] = torch.repeat_interleave(adv[mb["sample_index"]], cu[1:] - cu[:-1])
                lmb["advantages"] = M.shard_field(lmb, mb["advantages"])
            if s.dump_logprobs and dist.get_rank() == 0:
                dump_step(s.dump_logprobs, step, batch, current, r, adv, config.mode)

            loss_fn = make_loss_func(config, temperature=s.temperature, prepared=prepared,
                                     num_microbatches=len(mine), external=external)
            result = M.train_step(model, optimizer, mine, loss_fn, local_micro_batches=local_mbs)
            per_mb, function_metrics = {}, {}
            if tis_function is not None and ps.is_pipeline_last_stage(ignore_virtual=True):
                # slime's reduction of the function's metrics: over micro-batches and DP x CP, per global sample
                function_metrics = reduce_tis_function_metrics(result.outputs, result.local_micro_batches, config)
            if _is_reporter():
                per_mb = {mb["sample_index"][0]: {k: float(v) for k, v in o.items() if k.startswith("rollout_corr/")
                                                  and not k.startswith(TIS_FUNCTION_METRICS)}
                          for mb, o in zip(mine, result.outputs)}
                per_mb["function"] = function_metrics
            per_mb = _gather_from_reporters(per_mb)
            function_metrics = per_mb.pop("function", {})
            t_train = time.perf_counter() - t1

            exact = sum(float(x) >= 1.5 for x in r) / len(samples)
            tokens_of = {mb["sample_index"][0]: float(mb["loss_mask"].sum()) for mb in batch}
            metrics = {"step": step, "loss": result.loss, "grad_norm": result.grad_norm,
                       "reward_mean": float(r.mean()), "reward_std": float(r.std(unbiased=False)),
                       "exact_fraction": exact,
                       "response_length": sum(x["response"].numel() for x in samples) / len(samples),
                       "kept_fraction": float(kept.float().mean()),
                       "loss_tokens": int(sum(tokens_of.values()))}
            names = sorted({k for m in per_mb.values() for k in m})
            for k in names:
                vals = [m[k] for m in per_mb.values() if k in m]
                metrics[k] = sum(vals) / len(vals)
            # tokens the correction removed from the loss: each micro-batch's fraction times its loss tokens
            # (decoupled mode: the global fraction in every micro-batch; bypass: each micro-batch's own)
            frac = "rollout_corr/rejected_token_fraction"
            if per_mb and all(frac in m for m in per_mb.values()):
                metrics["rejected_tokens"] = int(round(sum(m[frac] * tokens_of[i] for i, m in per_mb.items())))
            elif not config.rejects:
                metrics["rejected_tokens"] = 0
            metrics.update(function_metrics)
            metrics.update(global_metrics)
            metrics.update({"time/rollout": t_rollout, "time/train": t_train,
                            "time/step": time.perf_counter() - t0})
            history.append(metrics)
            on_step(metrics)
        return history
    finally:
        if "rollout_engine" in locals() and hasattr(rollout_engine, "close"):
            rollout_engine.close()  # vLLM's engine core, before the process group it shares goes
        M.destroy_parallel()


def settings_dict(settings: TrainSettings) -> dict:
    return asdict(settings)
