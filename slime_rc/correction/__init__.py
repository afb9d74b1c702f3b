"""The correction engine over packed tensors: :func:`compute_rollout_correction` (``engine.py``; its stages in
``stages.py``)."""

from slime_rc.correction.engine import CorrectionResult, compute_rollout_correction

__all__ = ["CorrectionResult", "compute_rollout_correction"]
