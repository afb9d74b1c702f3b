"""Where ``slime-rc train``'s per-step metrics go: ``metrics.jsonl``, TensorBoard and wandb, named as slime names them.

slime (THUDM/slime at 624b824a8, ``slime/observability/``) logs each training step as ``train/<key>`` together with
``train/step``, the step axis: wandb gets ``define_metric("train/step")`` and
``define_metric("train/*", step_metric="train/step")``, TensorBoard gets ``train/step`` as the global step.  The
same names here put our metrics (``train/loss``, ``train/rollout_corr/k3_kl``, ...) in the ``train`` section of a
slime user's dashboards, next to slime's own ``train/pg_loss`` and ``train/grad_norm``, on the same axis.

The flags are slime's where slime has them (``--use-wandb``, ``--wandb-mode``, ``--wandb-project``,
``--wandb-group``, ``--wandb-dir``, ``--use-tensorboard``, ``--tb-project-name``, ``--tb-experiment-name``).
Two defaults differ, both documented in ``docs/train.md``: TensorBoard is on whenever the ``tensorboard`` package
is installed and there is a directory to write to (``--no-use-tensorboard`` turns it off; slime's default is off),
and wandb writes under ``--output-dir`` unless told otherwise (slime's: ``./wandb``).

:func:`plan_logging` runs once in the launcher (a flag asking for a package that is not installed fails the launch
there); rank 0 opens the plan with :func:`open_loggers`.

:class:`RejectionWatch` watches the same per-step metrics for a correction that rejects more than
:data:`~slime_rc.tools.analyze.thresholds.MAX_REJECTED_FRACTION` of a step's tokens or samples (the level at which
``slime-rc analyze`` recommends a safer preset): one console warning at the first such step, a count at the end of
the run, and the same in ``summary.json`` (``rejection_warning``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.tools.analyze.thresholds import MAX_REJECTED_FRACTION, exceeds, level_sentence

STEP_KEY = "train/step"  # slime's step axis of the training metrics
PREFIX = "train/"
WANDB_MODES = ("online", "offline", "disabled")


def add_logging_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("logging (slime's flags)")
    g.add_argument("--use-tensorboard", action=argparse.BooleanOptionalAction, default=None,
                   help="TensorBoard event files (default: on when tensorboard is installed and there is a "
                        "directory: --output-dir, --tb-project-name or TENSORBOARD_DIR)")
    g.add_argument("--tb-project-name", default=None,
                   help="write TensorBoard to tensorboard_log/PROJECT/EXPERIMENT (slime's layout) instead of "
                        "--output-dir; TENSORBOARD_DIR, when set, wins")
    g.add_argument("--tb-experiment-name", default=None,
                   help="EXPERIMENT of --tb-project-name (default: the launch time, YYYYmmdd_HHMMSS)")
    g.add_argument("--use-wandb", action="store_true", default=False, help="log to wandb too")
    g.add_argument("--wandb-mode", choices=WANDB_MODES, default=None,
                   help="wandb mode (default: WANDB_MODE, else wandb's own: online); offline needs no network")
    g.add_argument("--wandb-project", default=None, help="wandb project (default: WANDB_PROJECT, else wandb's)")
    g.add_argument("--wandb-group", default=None, help="wandb group; also the run's name")
    g.add_argument("--wandb-dir", default=None,
                   help="where wandb writes its wandb/ folder (default: WANDB_DIR, else --output-dir)")
    return parser


def logging_flags() -> List[str]:
    """Every option string :func:`add_logging_arguments` adds (what ``docs/train.md`` documents)."""
    parser = add_logging_arguments(argparse.ArgumentParser(add_help=False))
    return [s for a in parser._actions for s in a.option_strings]


def missing_package_message(flag: str, package: str) -> str:
    return f"{flag} needs the {package} package, which is not installed: pip install 'slime-rc[{package}]'"


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _import(module: str, flag: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{missing_package_message(flag, package)} ({e})") from e


@dataclass(frozen=True)
class WandbSettings:
    mode: Optional[str] = None  # None: WANDB_MODE, else wandb's default
    project: Optional[str] = None
    group: Optional[str] = None
    dir: Optional[str] = None


@dataclass(frozen=True)
class LoggingPlan:
    """Where rank 0 logs besides ``metrics.jsonl``: the TensorBoard directory (None: off) and wandb (None: off)."""

    tensorboard_dir: Optional[str] = None
    wandb: Optional[WandbSettings] = None

    def describe(self) -> Optional[str]:
        parts = []
        if self.tensorboard_dir is not None:
            parts.append(f"TensorBoard in {self.tensorboard_dir}")
        if self.wandb is not None:
            where = f" under {self.wandb.dir}" if self.wandb.dir else ""
            parts.append(f"wandb ({self.wandb.mode or os.environ.get('WANDB_MODE') or 'online'}){where}")
        return "logging to " + " and ".join(parts) + " as train/<key> against train/step" if parts else None


def _tensorboard_dir(args) -> Optional[str]:
    """slime's choice (``TENSORBOARD_DIR`` first, else ``tensorboard_log/<project>/<experiment>``), then ours."""
    if os.environ.get("TENSORBOARD_DIR"):
        return os.environ["TENSORBOARD_DIR"]
    if args.tb_project_name:
        experiment = args.tb_experiment_name or datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
        return os.path.join("tensorboard_log", args.tb_project_name, experiment)
    return args.output_dir


def plan_logging(args) -> LoggingPlan:
    """The launch line's logging, decided once; a ``ValueError`` names the flag that cannot be honoured."""
    tb_dir = _tensorboard_dir(args)
    use_tb = args.use_tensorboard
    if use_tb is None:  # not asked either way: on when possible
        use_tb = tb_dir is not None and _installed("tensorboard")
    elif use_tb:
        if not _installed("tensorboard"):
            raise ValueError(missing_package_message("--use-tensorboard", "tensorboard"))
        if tb_dir is None:
            raise ValueError("--use-tensorboard needs a directory: --output-dir, --tb-project-name or TENSORBOARD_DIR")
    wandb = None
    if args.use_wandb:
        if not _installed("wandb"):
            raise ValueError(missing_package_message("--use-wandb", "wandb"))
        wandb = WandbSettings(mode=args.wandb_mode, project=args.wandb_project, group=args.wandb_group,
                              dir=args.wandb_dir or os.environ.get("WANDB_DIR") or args.output_dir)
    return LoggingPlan(tb_dir if use_tb else None, wandb)


def slime_names(metrics: dict) -> dict:
    """One step's metrics as slime names them: ``train/step`` and ``train/<key>`` for every number (``None`` and
    anything else that is no number are left out)."""
    named = {STEP_KEY: metrics["step"]}
    for key, value in metrics.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            named[PREFIX + key] = value
    return named


class JsonlLogger:
    """``metrics.jsonl``: one JSON object per step, our own key names, flushed each step."""

    def __init__(self, path: str):
        self._file = open(path, "w")

    def log(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """``train/<key>`` scalars at global step ``train/step`` (slime leaves the step itself out, as here)."""

    def __init__(self, log_dir: str):
        tensorboard = _import("torch.utils.tensorboard", "--use-tensorboard", "tensorboard")
        os.makedirs(log_dir, exist_ok=True)
        self._writer = tensorboard.SummaryWriter(log_dir)

    def log(self, metrics: dict) -> None:
        named = slime_names(metrics)
        step = named.pop(STEP_KEY)
        for key, value in named.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # a dashboard watching the run sees each step

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """One wandb run (rank 0's) with slime's step axis; its config is the run's ``config.json``."""

    def __init__(self, settings: WandbSettings, config: Optional[dict] = None):
        self._wandb = wandb = _import("wandb", "--use-wandb", "wandb")
        if settings.dir:
            os.makedirs(settings.dir, exist_ok=True)  # as slime does: wandb fails on a missing directory
        self._run = wandb.init(project=settings.project, group=settings.group, name=settings.group,
                               dir=settings.dir, mode=settings.mode,
                               config=json.loads(json.dumps(config or {}, default=str)))
        self._run.define_metric(STEP_KEY)
        self._run.define_metric(PREFIX + "*", step_metric=STEP_KEY)

    def log(self, metrics: dict) -> None:
        self._run.log(slime_names(metrics))

    def close(self) -> None:
        self._run.finish()
        # finish() can return before wandb's service has written the run's file (seen offline, wandb 0.31);
        # teardown waits for it, so the run directory is complete when this returns
        self._wandb.teardown()


class Loggers:
    """The loggers of one run, fed and closed together."""

    def __init__(self, loggers: list):
        self.loggers = loggers

    def log(self, metrics: dict) -> None:
        for logger in self.loggers:
            logger.log(metrics)

    def close(self) -> None:
        for logger in reversed(self.loggers):
            logger.close()


def open_loggers(plan: LoggingPlan, output_dir: Optional[str], config: Optional[dict] = None) -> Loggers:
    """Rank 0's loggers: ``metrics.jsonl`` in ``output_dir`` (when given), then what ``plan`` asks for."""
    opened: list = []
    try:
        if output_dir:
            opened.append(JsonlLogger(os.path.join(output_dir, "metrics.jsonl")))
        if plan.tensorboard_dir is not None:
            opened.append(TensorBoardLogger(plan.tensorboard_dir))
        if plan.wandb is not None:
            opened.append(WandbLogger(plan.wandb, config))
    except BaseException:
        Loggers(opened).close()
        raise
    return Loggers(opened)


def rejected_fractions(metrics: dict) -> Tuple[Optional[float], Optional[float]]:
    """``(token fraction, sample fraction)`` one GRPO step rejected (``None``: not logged).  Tokens: the step's
    ``rejected_tokens`` over its ``loss_tokens``, else ``rollout_corr/rejected_token_fraction``; samples:
    ``rollout_corr/rejected_seq_fraction``, else the samples the group baselines left out (``1 - kept_fraction``)."""
    tokens = metrics.get("rollout_corr/rejected_token_fraction")
    if metrics.get("rejected_tokens") is not None and metrics.get("loss_tokens"):
        tokens = metrics["rejected_tokens"] / metrics["loss_tokens"]
    samples = metrics.get("rollout_corr/rejected_seq_fraction")
    if samples is None and metrics.get("kept_fraction") is not None:
        samples = 1.0 - metrics["kept_fraction"]
    return tokens, samples


def _from(sources: Dict[str, str], field: str) -> str:
    """`` (from <who set it>)`` for a config field set by a preset or a flag, else nothing."""
    who = sources.get(field)
    return f" (from {who})" if who and who != "default" else ""


def rejecting_settings(config: RolloutCorrectionConfig, sources: Optional[Dict[str, str]] = None) -> str:
    """What in ``config`` rejects and how to loosen it, in words (``sources``: who set each field, as in
    ``config.json``), so that a warning names the setting to change."""
    from slime_rc.tools.analyze.accumulate import describe_rs  # the band as analyze prints it
    sources = sources or {}
    parts = []
    if config.rs:
        parts.append(f"the rejection band {describe_rs(config)}{_from(sources, 'rs')}: widen it with "
                     f"--rs-upper-bound LOWER_UPPER")
    if config.veto_threshold is not None:
        parts.append(f"the veto at ratio {config.veto_threshold:g}{_from(sources, 'veto_threshold')}: lower "
                     f"--rs-veto-threshold")
    if config.is_enabled and config.is_mode == "mask":
        parts.append(f"IS mask mode [{config.is_lower:g}, {config.is_upper_bound:g}]{_from(sources, 'is_mode')}: "
                     f"widen --tis-lower-bound / --tis-upper-bound")
    if config.on_nonfinite == "reject":
        parts.append("on_nonfinite=reject: samples with a non-finite log-prob are dropped")
    if not parts:
        parts.append("no rejection setting of the resolved configuration (a --custom-tis-function-path function's "
                     "keep mask?)")
    return "; ".join(parts)


class RejectionWatch:
    """Rank 0's watch on rejection: :meth:`observe` each step's metrics (the warning line at the first GRPO step
    above :data:`MAX_REJECTED_FRACTION`, else None -- one line per run, not one per step), :meth:`summary` and
    :meth:`end_lines` at the end (how many steps, the first and the largest fractions, what to change)."""

    def __init__(self, config: RolloutCorrectionConfig, sources: Optional[Dict[str, str]] = None,
                 total_steps: int = 0, warm_start_steps: int = 0):
        self.settings = rejecting_settings(config, sources)
        self.total, self.warm = total_steps, warm_start_steps
        self.grpo_steps, self.above = 0, []  # above: (metrics step, token fraction, sample fraction)

    def _at(self, step: int) -> str:
        return f"step {step - self.warm + 1}/{self.total}"  # as the per-step console lines count

    def advice(self) -> str:
        return (f"the rejection comes from {self.settings}; or record --dump-logprobs DIR and run slime-rc analyze "
                f"DIR for a preset and band that fit this mismatch")

    def observe(self, metrics: dict) -> Optional[str]:
        """Record one step; the console warning when it is the run's first step above the level, else None."""
        if metrics.get("warm_start"):
            return None
        self.grpo_steps += 1
        tokens, samples = rejected_fractions(metrics)
        if not exceeds(tokens, samples):
            return None
        self.above.append((metrics["step"], tokens, samples))
        if len(self.above) > 1:
            return None
        return (f"warning: {self._at(metrics['step'])} rejected {_fractions(tokens, samples)}, above "
                f"{level_sentence()}: what is rejected teaches nothing, so such a step learns little or nothing; "
                f"{self.advice()} (said once; the end of the run counts such steps)")

    def summary(self) -> Optional[dict]:
        """``summary.json``'s ``rejection_warning``: None when no step went above the level."""
        if not self.above:
            return None
        first = self.above[0]
        return {"threshold": MAX_REJECTED_FRACTION, "steps_above": len(self.above), "grpo_steps": self.grpo_steps,
                "first_step": first[0], "first_token_fraction": first[1], "first_sample_fraction": first[2],
                "max_token_fraction": _largest(r[1] for r in self.above),
                "max_sample_fraction": _largest(r[2] for r in self.above), "message": self.end_lines()[0]}

    def end_lines(self) -> List[str]:
        """The end-of-run warning (one line), or no line."""
        if not self.above:
            return []
        step, tokens, samples = self.above[0]
        return [f"warning: {len(self.above)} of {self.grpo_steps} GRPO steps rejected more than "
                f"{100 * MAX_REJECTED_FRACTION:g}% of their tokens or samples (first {self._at(step)}: "
                f"{_fractions(tokens, samples)}); {self.advice()}"]


def _fractions(tokens: Optional[float], samples: Optional[float]) -> str:
    parts = [f"{100 * f:.1f}% of {what}" for f, what in ((tokens, "tokens"), (samples, "samples")) if f is not None]
    return " and ".join(parts)


def _largest(values) -> Optional[float]:
    known = [v for v in values if v is not None]
    return max(known) if known else None
