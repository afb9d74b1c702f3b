"""``--get-mismatch-metrics --custom-tis-function-path custom_tis.metrics_only.compute_metrics_only_with_cp``:
monitoring only inside slime, ``pg_loss`` and masks returned as they came (:mod:`slime_rc.slime.tis_hooks`)."""

from slime_rc.slime.tis_hooks import compute_metrics_only, compute_metrics_only_with_cp

__all__ = ["compute_metrics_only", "compute_metrics_only_with_cp"]
