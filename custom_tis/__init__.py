"""slime-compatible custom TIS functions (``--custom-tis-function-path``), thin adapters over
:func:`slime_rc.compute_rollout_correction`:

* ``custom_tis.mis.compute_mis_weights[_with_cp]``: IS / RS / veto / mismatch metrics from slime's keys;
* ``custom_tis.tis.compute_tis_weights[_with_cp]``: vanilla truncated IS (``tis_clip``, ``tis_clip_low``);
* ``custom_tis.icepop.compute_icepop_weights[_with_cp]``: token-level mask-mode IS (IcePop).
"""

from custom_tis.icepop import compute_icepop_weights, compute_icepop_weights_with_cp
from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp
from custom_tis.tis import compute_tis_weights, compute_tis_weights_with_cp

__all__ = [
    "compute_mis_weights", "compute_mis_weights_with_cp",
    "compute_tis_weights", "compute_tis_weights_with_cp",
    "compute_icepop_weights", "compute_icepop_weights_with_cp",
]
