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
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import List, Optional

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
