"""``--custom-tis-function-path custom_tis.icepop.compute_icepop_weights_with_cp``: slime's IcePop
(:mod:`slime_rc.slime.tis_hooks`)."""

from slime_rc.slime.tis_hooks import compute_icepop_weights, compute_icepop_weights_with_cp

__all__ = ["compute_icepop_weights", "compute_icepop_weights_with_cp"]
