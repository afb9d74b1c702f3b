"""slime-rc: rollout correction (IS / RS / veto / mismatch metrics) for RL on Megatron + SGLang."""

from slime_rc.config.arguments import add_rollout_correction_arguments, config_from_args
from slime_rc.config.schema import (IS_LEVELS, IS_MODES, LOSS_TYPES, MODES, RS_OPTIONS, RejectionCriterion, RolloutCorrectionConfig,
                     parse_rejection_criteria)
from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction
from slime_rc.losses import LossNormalizer, compute_policy_loss, loss_normalizer
from slime_rc.correction.metrics import METRICS
from slime_rc.correction.packed import cu_seqlens_from_lengths
from slime_rc.plugins import load_function
from slime_rc.config.presets import PRESETS
from slime_rc.correction.reducer import DistributedReducer, LocalReducer
from slime_rc.megatron.reducers import megatron_reducer

__all__ = [
    "compute_policy_loss", "loss_normalizer", "LossNormalizer", "add_rollout_correction_arguments", "config_from_args", "load_function", "PRESETS", "LOSS_TYPES", "MODES",
    "IS_LEVELS", "IS_MODES", "RS_OPTIONS", "RejectionCriterion", "RolloutCorrectionConfig",
    "parse_rejection_criteria", "CorrectionResult", "compute_rollout_correction", "METRICS",
    "cu_seqlens_from_lengths", "DistributedReducer", "LocalReducer", "megatron_reducer",
]
__version__ = "0.1.0"
