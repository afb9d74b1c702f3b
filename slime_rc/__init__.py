"""slime-rc: rollout correction (IS / RS / veto / mismatch metrics) for RL on Megatron + SGLang.

The public names below load on first use (PEP 562): ``slime-rc --help`` and a slime launch that only reads its
arguments do not import torch for them."""

from importlib import import_module

# public name -> the module that defines it
_EXPORTS = {
    "add_rollout_correction_arguments": "slime_rc.config.arguments",
    "config_from_args": "slime_rc.config.arguments",
    "IS_LEVELS": "slime_rc.config.schema", "IS_MODES": "slime_rc.config.schema", "LOSS_TYPES": "slime_rc.config.schema",
    "MODES": "slime_rc.config.schema", "RS_OPTIONS": "slime_rc.config.schema",
    "RejectionCriterion": "slime_rc.config.schema", "RolloutCorrectionConfig": "slime_rc.config.schema",
    "parse_rejection_criteria": "slime_rc.config.schema",
    "CorrectionResult": "slime_rc.correction.engine", "compute_rollout_correction": "slime_rc.correction.engine",
    "LossNormalizer": "slime_rc.losses", "compute_policy_loss": "slime_rc.losses", "loss_normalizer": "slime_rc.losses",
    "METRICS": "slime_rc.correction.metrics",
    "cu_seqlens_from_lengths": "slime_rc.correction.packed",
    "load_function": "slime_rc.plugins",
    "PRESETS": "slime_rc.config.presets",
    "DistributedReducer": "slime_rc.correction.reducer", "LocalReducer": "slime_rc.correction.reducer",
    "megatron_reducer": "slime_rc.megatron.reducers",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'slime_rc' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
