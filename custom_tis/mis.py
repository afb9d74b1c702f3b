"""``--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp``: slime's example ``mis.py`` contract
(:mod:`slime_rc.slime.tis_hooks`)."""

from slime_rc.slime.tis_hooks import compute_mis_weights, compute_mis_weights_with_cp

__all__ = ["compute_mis_weights", "compute_mis_weights_with_cp"]
