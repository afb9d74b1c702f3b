"""``--custom-tis-function-path custom_tis.tis.compute_tis_weights_with_cp``: slime's vanilla truncated IS
(:mod:`slime_rc.slime.tis_hooks`)."""

from slime_rc.slime.tis_hooks import compute_tis_weights, compute_tis_weights_with_cp

__all__ = ["compute_tis_weights", "compute_tis_weights_with_cp"]
