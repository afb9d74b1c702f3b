"""slime-rc: rollout correction (IS / RS / veto / mismatch metrics) for RL on Megatron + SGLang."""

from .arguments import add_rollout_correction_arguments, config_from_args
from .config import (IS_LEVELS, IS_MODES, LOSS_TYPES, MODES, RS_OPTIONS, RejectionCriterion, RolloutCorrectionConfig,
                     parse_rejection_criteria)
from .correction import CorrectionResult, compute_rollout_correction
from .losses import LossNormalizer, compute_policy_loss, loss_normalizer
from .metrics import METRICS
from .packed import cu_seqlens_from_lengths
from .plugins import load_function
from .presets import PRESETS
from .reducer import DistributedReducer, LocalReducer, megatron_reducer

__all__ = [
    "compute_policy_loss", "loss_normalizer", "LossNormalizer", "add_rollout_correction_arguments", "config_from_args", "load_function", "PRESETS", "LOSS_TYPES", "MODES",
    "IS_LEVELS", "IS_MODES", "RS_OPTIONS", "RejectionCriterion", "RolloutCorrectionConfig",
    "parse_rejection_criteria", "CorrectionResult", "compute_rollout_correction", "METRICS",
    "cu_seqlens_from_lengths", "DistributedReducer", "LocalReducer", "megatron_reducer",
]
__version__ = "0.1.0"
