"""The correction engine over packed tensors: :func:`compute_rollout_correction` (stages in ``engine.py``)."""

from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction

__all__ = ["CorrectionResult", "compute_rollout_correction"]
