"""``slime-rc train``: parse the launch line, start the processes, run :func:`slime_rc.demo.train.loop.run_training`.

Started under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set) every process joins that process group
(NCCL when CUDA is present, else gloo): the same command scales to many nodes.  Otherwise it spawns ``--nproc``
local processes.

Every launch value is checked before any process starts (``TrainSettings.check_values``, :func:`check_layout`): a
bad one is one ``slime-rc train: error:`` line naming the flag, the value and the fix, exit 2.  An SGLang server that
fails the run (``SGLangError``) ends it with one such line, exit 1.

Each thing is done once, before any process starts (:func:`main`): the rollout-correction configuration is resolved
(``resolve_args``) and checked against the run settings, and the ``--custom-tis-function-path`` function is loaded
(``tis_function_from_args``; a bad spec fails the launch).  The workers get the resolved configuration
(:class:`Launch`) and never resolve it again.  The TIS function is loaded once per process: the launching process
hands the loaded function to the worker it runs itself (``--nproc 1``, and every process under ``torchrun``, which
runs its own launcher), while each spawned worker (``--nproc N > 1``) gets the spec (the launch line's ``args``)
and loads it once there -- a function crosses a process boundary only by name, which a function loaded from a
file path does not have.

Rank 0 prints one line per step and writes ``--output-dir``: ``config.json`` (the resolved rollout-correction config
and the run settings), ``metrics.jsonl`` (one JSON object per step, flushed each step) and TensorBoard event files
when tensorboard is installed; with ``--use-wandb`` it logs to wandb too (:mod:`slime_rc.demo.train.loggers`: slime's
flags and key names, ``train/<key>`` against ``train/step``).  A directory that already holds a previous run's
files (``metrics.jsonl``, ``config.json``, TensorBoard event files, a ``wandb/`` folder), or a ``--dump-logprobs``
directory that holds a previous dump, is refused before anything starts, unless ``--overwrite``, which removes them
first (:func:`check_output_dir`, :func:`remove_previous_run`).

SIGTERM and Ctrl-C stop a run cleanly (:mod:`slime_rc.demo.train.interrupt`): every line of ``metrics.jsonl`` is
complete, rank 0 says in one line at which step the run stopped, and the launcher exits ``128 + signal`` (130, 143)
once its workers are gone; a spawned worker also stops when the launcher dies, even by SIGKILL.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Dict, List, Optional

import torch

from slime_rc.config._text import unknown_flags_message
from slime_rc.config.arguments import add_rollout_correction_arguments, resolve_args, tis_function_from_args
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.demo.rollout.sglang_client import SGLangError
from slime_rc.slime.tis_bridge import TisContractError
from slime_rc.sglang_output import check_sampling_consistency
from slime_rc.demo.train import interrupt
from slime_rc.demo.train.interrupt import Interrupted
from slime_rc.demo.train.loggers import (LoggingPlan, RejectionWatch, add_logging_arguments, open_loggers,
                                         plan_logging)
from slime_rc.demo.train.loop import MODELS, TrainSettings, run_training, settings_dict
from slime_rc.demo.train.study import run_summary, summary_lines, write_summary

# flag -> TrainSettings field (Megatron's spelling for the parallel sizes)
_FLAGS = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
          "--context-parallel-size": "cp", "--virtual-pipeline-model-parallel-size": "vpp",
          "--sequence-parallel": "sequence_parallel", "--num-steps": "num_steps", "--seed": "seed", "--lr": "lr",
          "--task": "task", "--digits": "digits", "--prompts-per-step": "prompts_per_step",
          "--group-size": "group_size", "--micro-batches": "micro_batches", "--rollout-temperature": "temperature",
          "--top-p": "top_p", "--rollout-dtype": "rollout_dtype", "--stale-steps": "stale_steps",
          "--logit-noise": "logit_noise", "--rollout-prob-floor": "rollout_prob_floor",
          "--warm-start-steps": "warm_start_steps", "--model": "model",
          "--hf-checkpoint": "hf_checkpoint", "--hidden-size": "hidden_size", "--num-layers": "num_layers",
          "--rollout-engine": "rollout_engine", "--sglang-url": "sglang_url", "--sglang-timeout": "sglang_timeout",
          "--decoupled-metrics": "decoupled_metrics", "--dump-logprobs": "dump_logprobs"}


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = TrainSettings()
    types = {f.name: f.type for f in fields(TrainSettings)}
    g = parser.add_argument_group("training (slime-rc train)")
    for flag, name in _FLAGS.items():
        default = getattr(defaults, name)
        if name == "sequence_parallel":
            g.add_argument(flag, dest=name, action="store_true")
        elif name == "decoupled_metrics":
            g.add_argument(flag, dest=name, action="store_true",
                           help="bypass mode: a forward-only pass per step logs the global-batch metrics of pi_old "
                                "vs pi_rollout as rollout_corr_decoupled/...")
        elif name == "dump_logprobs":
            g.add_argument(flag, dest=name, default=None, metavar="DIR",
                           help="write each step's train/rollout log-probs to DIR/step_NNNNNN.jsonl "
                                "(for slime-rc analyze)")
        elif name == "vpp":
            g.add_argument(flag, dest=name, type=int, default=None)
        elif name == "sglang_url":
            g.add_argument(flag, dest=name, default=None, help="SGLang server for --rollout-engine sglang")
        elif name == "sglang_timeout":
            g.add_argument(flag, dest=name, type=float, default=default, metavar="SECONDS",
                           help=f"seconds to wait for SGLang's answer to one /generate (default {default}; the "
                                f"connection itself must open within 5 s)")
        elif name == "rollout_prob_floor":
            g.add_argument(flag, dest=name, type=float, default=default, metavar="F",
                           help="in-process rollout engine: sample from and report q = (1 - V*F) p + F, a "
                                f"probability floor F on every vocabulary entry (default {default}: off)")
        elif name == "warm_start_steps":
            g.add_argument(flag, dest=name, type=int, default=default, metavar="N",
                           help="supervised steps on the correct answers (cross-entropy on answer + EOS) before the "
                                f"GRPO steps (default {default})")
        elif name == "model":
            g.add_argument(flag, dest=name, choices=MODELS, default=default,
                           help="the trained model: tiny-gpt (the demo's GPT: LayerNorm, GELU, biases) or qwen2-tiny "
                                "(Qwen2's architecture: RMSNorm, SwiGLU, q/k/v bias, RoPE base 1e6, grouped-query "
                                f"attention) at --hidden-size / --num-layers (default {default})")
        elif name == "hf_checkpoint":
            g.add_argument(flag, dest=name, default=None, metavar="DIR",
                           help="with --model qwen2-tiny: start from this HF Qwen2 checkpoint directory (config.json + "
                                "model.safetensors or pytorch_model.bin); its config.json sets the model's sizes")
        elif name == "rollout_engine":
            g.add_argument(flag, dest=name, choices=("torch", "sglang", "vllm"), default=default,
                           help="torch: the in-process pure-torch engine; sglang: an SGLang server (--sglang-url); "
                                "vllm: vLLM in the trainer's process serving the Qwen2-architecture model -- in "
                                "global rank 0 of a multi-process job, which hands every rank its samples (pip "
                                "install 'slime-rc[vllm]' on a CPU machine; docs/train.md)")
        else:
            kind = {"int": int, "float": float, "str": str}[str(types[name])]
            g.add_argument(flag, dest=name, type=kind, default=default, help=f"default {default}")
    g.add_argument("--nproc", type=int, default=1,
                   help="local processes to spawn, 1 or more (ignored under torchrun)")
    g.add_argument("--output-dir", default=None,
                   help="where metrics.jsonl, config.json, TensorBoard and (by default) wandb go")
    g.add_argument("--overwrite", action="store_true",
                   help="replace a previous run in --output-dir: its metrics.jsonl, config.json, TensorBoard event "
                        "files and wandb/ folder (and a previous dump in --dump-logprobs) are removed before the run "
                        "starts; without it a directory holding them is refused")
    add_logging_arguments(parser)
    add_rollout_correction_arguments(parser)
    return parser


# the files a run writes into --output-dir that a second run would replace (metrics.jsonl is truncated at open)
RUN_FILES = ("metrics.jsonl", "config.json")
SUMMARY_FILE = "summary.json"  # the end-of-run summary (slime_rc.demo.train.study.run_summary)
TENSORBOARD_FILES = "events.out.tfevents.*"  # SummaryWriter's event files (a second run would add its own beside them)
WANDB_FOLDER = "wandb"  # wandb.init(dir=--output-dir) makes --output-dir/wandb/ (a second run would add its run there)
DUMP_FILES = "step_*.jsonl"  # --dump-logprobs DIR/step_NNNNNN.jsonl (a second run would replace some, keep others)


def previous_run_files(output_dir: Optional[str]) -> List[str]:
    """What a previous run left in ``output_dir`` (paths inside it): :data:`RUN_FILES`, TensorBoard event files and
    the ``wandb/`` folder."""
    if not output_dir or not os.path.isdir(output_dir):
        return []
    found = [name for name in RUN_FILES + (SUMMARY_FILE,) if os.path.exists(os.path.join(output_dir, name))]
    found += sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(output_dir), TENSORBOARD_FILES)))
    if os.path.isdir(os.path.join(output_dir, WANDB_FOLDER)):
        found.append(WANDB_FOLDER)
    return found


def previous_dump_files(dump_dir: Optional[str]) -> List[str]:
    """The ``step_NNNNNN.jsonl`` files of a previous ``--dump-logprobs`` dump in ``dump_dir``."""
    if not dump_dir or not os.path.isdir(dump_dir):
        return []
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(dump_dir), DUMP_FILES)))


def _describe(found: List[str]) -> str:
    """The found files in words: the run files by name first (they alone, when present), then the others."""
    named = [n for n in found if n in RUN_FILES] or [n for n in found if n == SUMMARY_FILE]
    if not named:
        events = sum(n.startswith("events.out.tfevents.") for n in found)
        if events:
            named.append(f"TensorBoard event file{'s' if events > 1 else ''} ({TENSORBOARD_FILES})")
        if WANDB_FOLDER in found:
            named.append(f"{WANDB_FOLDER}/ folder")
    return " and ".join(named)


def check_output_dir(output_dir: Optional[str], overwrite: bool, dump_dir: Optional[str] = None) -> None:
    """Refuse, before anything runs, an ``--output-dir`` that holds a previous run's files
    (:func:`previous_run_files`: ``metrics.jsonl``, ``config.json``, TensorBoard event files, ``wandb/``) and a
    ``--dump-logprobs`` directory that holds a previous dump, unless ``overwrite``; and a path that is not a
    directory.  ``ValueError`` naming the directory and the fix."""
    if output_dir:
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise ValueError(f"--output-dir {output_dir} is a file, not a directory; give a directory path")
        found = previous_run_files(output_dir)
        if found and not overwrite:
            raise ValueError(f"--output-dir {output_dir} already holds a previous run's {_describe(found)}; give a "
                             f"fresh --output-dir, or add --overwrite to replace them")
    dumped = previous_dump_files(dump_dir)
    if dumped and not overwrite:
        raise ValueError(f"--dump-logprobs {dump_dir} already holds a previous dump ({len(dumped)} "
                         f"step_NNNNNN.jsonl file{'s' if len(dumped) > 1 else ''}); give a fresh --dump-logprobs "
                         f"directory, or add --overwrite to replace them")


def remove_previous_run(output_dir: Optional[str], dump_dir: Optional[str] = None) -> List[str]:
    """``--overwrite``: remove what a previous run left (:func:`previous_run_files` in ``output_dir``,
    :func:`previous_dump_files` in ``dump_dir``) so that the directories hold the new run only; returns the removed
    paths.  Nothing else in the directories is touched."""
    removed = []
    for directory, names in ((output_dir, previous_run_files(output_dir)), (dump_dir, previous_dump_files(dump_dir))):
        for name in names:
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    return removed


def check_layout(settings: TrainSettings, nproc: int, world: Optional[int] = None) -> None:
    """The sizes against the processes, before any starts: ``nproc`` >= 1 and a multiple of tp*pp*cp, the
    micro-batches split over the data-parallel ranks (``world``: ``WORLD_SIZE`` under torchrun, else ``nproc``).
    ``ValueError`` naming the flags, the values and the fix."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc {nproc}: a run needs at least one process; give --nproc 1 or more (default 1)")
    s = settings
    need = s.tp * s.pp * s.cp
    if world is None:
        world, what = nproc, f"--nproc {nproc}"
        if nproc % need:
            raise ValueError(f"--nproc {nproc} is not a multiple of tp*pp*cp = {need}; data parallel is nproc / "
                             f"(tp*pp*cp)")
    else:
        what = f"WORLD_SIZE {world}"
        if world % need:
            raise ValueError(f"torchrun's WORLD_SIZE {world} is not a multiple of tp*pp*cp = {need}; data parallel "
                             f"is WORLD_SIZE / (tp*pp*cp)")
    dp = world // need
    if s.micro_batches % dp:
        raise ValueError(f"--micro-batches {s.micro_batches}: {s.micro_batches} micro-batches do not split over "
                         f"the {dp} data-parallel ranks ({what} / tp*pp*cp {need}); give a multiple of {dp}")
    if s.vpp and s.vpp > 1 and not torch.cuda.is_available() and s.micro_batches // dp <= s.pp:
        raise ValueError(f"--micro-batches {s.micro_batches}: the interleaved pipeline (--virtual-pipeline-model-"
                         f"parallel-size {s.vpp}) on gloo needs more than pp = {s.pp} micro-batches per "
                         f"data-parallel rank (got {s.micro_batches // dp}); give --micro-batches "
                         f"{2 * s.pp * dp} or more, a multiple of {dp}")
    if s.dump_logprobs and os.path.exists(s.dump_logprobs) and not os.path.isdir(s.dump_logprobs):
        raise ValueError(f"--dump-logprobs {s.dump_logprobs} is a file, not a directory; give a directory path")


def _settings(args) -> TrainSettings:
    return TrainSettings(**{name: getattr(args, name) for name in _FLAGS.values()})


def _line(m: dict, total: int, warm_start_steps: int = 0) -> str:
    """The console line of a step: a warm-start step (``warm-start k/N``, its cross-entropy) or a GRPO step
    (``step k/total``, counted from the first GRPO step)."""
    def show(key, fmt):  # a metric the configuration does not compute shows as "-"
        return format(m[key], fmt) if key in m else "-"
    if m.get("warm_start"):
        return (f"warm-start {m['step'] + 1:>4}/{warm_start_steps}  supervised cross-entropy {m['loss']:.4f}  "
                f"grad {m['grad_norm']:.3f}  {m['time/step']:.2f}s")
    rejected = m.get("rollout_corr/rejected_token_fraction", m.get("rollout_corr/rollout_rs_masked_fraction", 0.0))
    return (f"step {m['step'] - warm_start_steps + 1:>4}/{total}  reward {m['reward_mean']:.3f}  "
            f"loss {m['loss']:+.4f}  grad {m['grad_norm']:.3f}  k3 {show('rollout_corr/k3_kl', '.2e')}  "
            f"ess {show('rollout_corr/rollout_is_eff_sample_size', '.3f')}  "
            f"rejected {rejected:.3f}  {m['time/step']:.2f}s")


@dataclass
class Launch:
    """What the launcher resolved, handed to every worker (picklable: spawned workers receive it)."""

    settings: TrainSettings
    config: RolloutCorrectionConfig  # the resolved rollout-correction configuration
    sources: Dict[str, str] = field(default_factory=dict)  # who set each field (written to config.json)
    notes: List[str] = field(default_factory=list)  # the resolution's notes (rank 0 prints them)
    tis_function: Optional[Callable] = None  # --custom-tis-function-path, loaded in this process
    load_tis_function: bool = False  # a spawned worker: load it from the launch line's args, once there
    logging: LoggingPlan = field(default_factory=LoggingPlan)  # TensorBoard / wandb (rank 0 opens them)

    def for_spawned_workers(self) -> "Launch":
        """This launch for workers in new processes: the TIS function travels as its spec (in ``args``)."""
        return replace(self, tis_function=None, load_tis_function=self.tis_function is not None)

    def tis_function_here(self, args: argparse.Namespace) -> Optional[Callable]:
        """The TIS function in this process: the one the launcher loaded, or (a spawned worker) loaded now."""
        return tis_function_from_args(args) if self.load_tis_function else self.tis_function


def interrupted_message(signum: int, finished: int, total: int, output_dir: Optional[str]) -> str:
    """Rank 0's one line when a signal stopped the run after ``finished`` of ``total`` steps."""
    at = f"after its last step ({total}/{total})" if finished >= total else f"at step {finished + 1}/{total}"
    done = ("no step finished" if finished == 0 else "step 1 finished" if finished == 1
            else f"steps 1-{finished} finished")
    line = f"slime-rc train: interrupted by {interrupt.signal_name(signum)} {at}: {done}"
    if not output_dir:
        return line + " (no --output-dir: nothing was written)"
    if finished:
        line += (f" and {'is' if finished == 1 else 'are'} logged, {'a' if finished == 1 else 'each a'} complete "
                 f"line, in {os.path.join(output_dir, 'metrics.jsonl')}")
    if previous_run_files(output_dir):
        line += f"; to run again into {output_dir} add --overwrite, or give a fresh --output-dir"
    return line


def _write_config(output_dir: str, run_config: dict) -> None:
    """``config.json``, whole or not at all: written beside it, then renamed over it."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "config.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(run_config, f, indent=2, default=str)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _worker(rank: int, world: int, init_method: str, args: argparse.Namespace, launch: Launch) -> None:
    """One process of the run.  A signal (:mod:`~slime_rc.demo.train.interrupt`) ends it with the loggers closed and
    the process group destroyed; rank 0 then prints :func:`interrupted_message` and :class:`Interrupted` goes on up."""
    import torch.distributed as dist

    settings, config = launch.settings, launch.config
    loggers = None
    finished = 0  # steps logged (rank 0)
    # heavy rejection: warned once at its first step, counted at the end and in summary.json
    watch = RejectionWatch(config, launch.sources, settings.num_steps, settings.warm_start_steps)

    def on_step(m: dict) -> None:
        nonlocal finished
        if rank != 0:
            return
        with interrupt.atomic():  # a signal now stops the run after this step's line, never inside it
            print(_line(m, settings.num_steps, settings.warm_start_steps), flush=True)
            warning = watch.observe(m)
            if warning:
                print(warning, flush=True)
            loggers.log(m)
            finished += 1

    try:
        try:
            from slime_rc.demo.model import quiet_megatron_fallback_warnings
            quiet_megatron_fallback_warnings()  # before megatron's first import (in run_training)
            if os.environ.get("SLIME_RC_COMPILE", "").strip() != "1":  # (the compiled engine needs dynamo)
                os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
            if not torch.cuda.is_available():
                torch.set_num_threads(1)
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if init_method == "env://":
                dist.init_process_group(backend)
                rank = dist.get_rank()
                if torch.cuda.is_available():
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            else:
                dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
            if rank == 0:
                print(f"slime-rc train: {settings.task} on {settings.digits} digits, {dist.get_world_size()} "
                      f"process(es) (tp {settings.tp}, pp {settings.pp}, cp {settings.cp}), mode {config.mode} / "
                      f"{config.loss_type}", flush=True)
                for note in launch.notes:
                    print(f"note: {note}", flush=True)
                for note in check_sampling_consistency({"temperature": settings.temperature,
                                                        "top_p": settings.top_p}, settings.temperature, warn=False):
                    print(f"note: {note}", flush=True)
                logging_line = launch.logging.describe()
                if logging_line:
                    print(logging_line, flush=True)
                run_config = {"rollout_correction": config.to_dict(), "sources": launch.sources,
                              "settings": settings_dict(settings)}
                if args.output_dir:
                    with interrupt.atomic():
                        _write_config(args.output_dir, run_config)
                with interrupt.atomic():  # metrics.jsonl, TensorBoard, wandb: opened whole
                    loggers = open_loggers(launch.logging, args.output_dir, run_config)
            history = run_training(settings, config, on_step, tis_function=launch.tis_function_here(args),
                                   tis_args=args)
            grpo = [m for m in history if not m.get("warm_start")]
            if rank == 0 and grpo:
                first, last = grpo[0], grpo[-1]
                print(f"done: mean reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}, exact answers "
                      f"{first['exact_fraction']:.0%} -> {last['exact_fraction']:.0%}"
                      + (f"; metrics in {args.output_dir}/metrics.jsonl" if args.output_dir else ""), flush=True)
                summary = run_summary(history)
                summary["rejection_warning"] = watch.summary()
                for line in summary_lines(summary) + watch.end_lines():
                    print(line, flush=True)
                if args.output_dir:
                    with interrupt.atomic():
                        path = write_summary(args.output_dir, summary)
                    print(f"summary in {path}", flush=True)
        finally:
            if loggers is not None:
                loggers.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException as e:
        signum = interrupt.received()
        if signum is None:  # no signal: the error is the run's own
            raise
        # stopped by a signal: whatever the stop raised (in a peer's collective, say) is part of it, said in one line
        interrupt.report(interrupted_message(signum, finished, settings.warm_start_steps + settings.num_steps,
                                             args.output_dir)
                         if rank == 0 else None)
        raise Interrupted(signum) from (None if isinstance(e, Interrupted) else e)


def _spawned_worker(rank: int, world: int, init_method: str, args: argparse.Namespace, launch: Launch,
                    launcher_pid: Optional[int] = None) -> None:
    """:func:`_worker` in a spawned process: it stops when the launcher (``launcher_pid``) dies, however it dies; an
    SGLang failure is said in one line and the process exits 1; a signal ends it with ``128 + signal``."""
    interrupt.install()
    if launcher_pid is not None:
        interrupt.die_with_parent(launcher_pid)
    try:
        _worker(rank, world, init_method, args, launch)
    except Interrupted as e:
        sys.exit(interrupt.exit_code(e.signum))
    except (SGLangError, TisContractError) as e:
        print(f"slime-rc train: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def _run_spawned(args: argparse.Namespace, launch: Launch, store: str) -> int:
    """``--nproc N > 1``: spawn the workers and wait for them.  A signal to the launcher stops them (SIGTERM, then
    SIGKILL after :data:`~slime_rc.demo.train.interrupt.STOP_GRACE_S` s): no worker outlives it."""
    import torch.multiprocessing as mp
    context = None
    try:
        with interrupt.atomic():  # a signal while they start: every started worker is stopped below
            context = mp.start_processes(_spawned_worker, args=(args.nproc, store, args, launch.for_spawned_workers(),
                                                                os.getpid()),
                                         nprocs=args.nproc, start_method="spawn", join=False)
        while not context.join():
            pass
    except mp.ProcessExitedException as e:  # a worker said why (_spawned_worker) and exited
        if e.exit_code in {interrupt.exit_code(s) for s in interrupt.SIGNALS}:
            name = interrupt.signal_name(e.exit_code - 128)
            print(f"slime-rc train: error: worker process {e.error_index} was stopped by {name} (not sent by this "
                  f"launcher); the other workers are stopped", file=sys.stderr, flush=True)
        elif e.exit_code != 1:
            print(f"slime-rc train: error: worker process {e.error_index} exited with code {e.exit_code}",
                  file=sys.stderr, flush=True)
        return 1
    except Interrupted as e:
        processes = context.processes if context is not None else []
        interrupt.stop_processes(processes)
        codes = {interrupt.exit_code(s) for s in interrupt.SIGNALS}
        if not processes or processes[0].exitcode not in codes:  # rank 0 did not say where the run stopped
            interrupt.report(f"slime-rc train: interrupted by {e.name}; its {len(processes)} worker processes are "
                             f"stopped")
        interrupt.report(None)
        return interrupt.exit_code(e.signum)
    return 0


# The flag whose function main() loads: argparse's own check of it while parsing would be a second load.
_TIS_FUNCTION_FLAG = "--custom-tis-function-path"


DESCRIPTION = (
    "Run GRPO training with rollout correction: a small megatron-core model learns a synthetic task (--task) from "
    "rollouts of a separate engine (in-process torch, SGLang or vLLM) with tunable train/rollout mismatch, and the "
    "rollout-correction flags (the same as slime-rc config) correct it. Writes metrics.jsonl and config.json to "
    "--output-dir. Every value is checked before any process starts.")


def build_parser() -> argparse.ArgumentParser:
    """The ``slime-rc train`` parser: the training flags and the rollout-correction flags, no abbreviations (a
    prefix of a flag is refused, not guessed).  The ``--custom-tis-function-path`` spec stays a string while
    parsing: :func:`_main` loads the function once (argparse's own check of it would be a second load)."""
    parser = add_train_arguments(argparse.ArgumentParser(
        prog="slime-rc train", allow_abbrev=False, description=DESCRIPTION,
        usage="%(prog)s [training flags...] [rollout-correction flags...]"))
    tis_flag = parser._option_string_actions.get(_TIS_FUNCTION_FLAG)  # argparse has no public lookup
    if tis_flag is not None:
        tis_flag.type = None
    return parser


def parse_launch_line(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but an unknown flag is refused naming it and the closest real flag
    (``--tis-clp 2`` -> ``Did you mean '--tis-clip'?``): argparse alone only lists what it could not place."""
    args, leftover = parser.parse_known_args(argv)
    if leftover:
        parser.error(unknown_flags_message(leftover, parser._option_string_actions))
    return args


def _main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parse_launch_line(parser, argv)
    try:
        tis_function = tis_function_from_args(args)
    except ValueError as e:  # as argparse reports a bad flag value
        parser.error(f"argument {_TIS_FUNCTION_FLAG}: {e}")
    try:
        resolution = resolve_args(args)
        settings = _settings(args)
        settings.check(resolution.config)  # refuse a bad configuration before starting anything
        logging_plan = plan_logging(args)  # a logger asked for but not installed fails here
        torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        check_layout(settings, args.nproc, int(os.environ["WORLD_SIZE"]) if torchrun else None)
        if "RANK" not in os.environ or os.environ.get("RANK") == "0":  # under torchrun rank 0 alone writes
            # last: nothing else can refuse the launch after it
            check_output_dir(args.output_dir, args.overwrite, settings.dump_logprobs)
    except ValueError as e:
        print(f"slime-rc train: error: {e}", file=sys.stderr)
        return 2
    args.rollout_correction_config = resolution.config  # what the custom_tis adapters read (travels with args)
    launch = Launch(settings, resolution.config, sources=dict(resolution.sources), notes=list(resolution.notes),
                    tis_function=tis_function, logging=logging_plan)
    if args.overwrite and ("RANK" not in os.environ or os.environ.get("RANK") == "0"):
        removed = remove_previous_run(args.output_dir, settings.dump_logprobs)
        if removed:
            print(f"note: --overwrite: removed the previous run's {', '.join(removed)}", flush=True)
    try:
        if torchrun:
            _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args, launch)
            return 0
        store = "file://" + os.path.join(tempfile.mkdtemp(prefix="slime_rc_train_"), "store")
        if args.nproc == 1:
            _worker(0, 1, store, args, launch)
            return 0
    except (SGLangError, TisContractError) as e:  # the server, or the TIS function, failed the run: one line
        print(f"slime-rc train: error: {e}", file=sys.stderr, flush=True)
        return 1
    return _run_spawned(args, launch, store)


def main(argv: Optional[List[str]] = None) -> int:
    """``slime-rc train``.  SIGINT (Ctrl-C) and SIGTERM stop the run cleanly (:mod:`slime_rc.demo.train.interrupt`):
    one line says where, and the exit status is ``128 + signal``."""
    previous = interrupt.install()
    try:
        return _main(argv)
    except BaseException:
        signum = interrupt.received()
        if signum is None:
            raise
        interrupt.report(f"slime-rc train: interrupted by {interrupt.signal_name(signum)} before the run started")
        return interrupt.exit_code(signum)
    finally:
        interrupt.restore(previous)
