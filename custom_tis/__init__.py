"""The slime surface: the TIS functions slime loads by dotted path (``--custom-tis-function-path``), each taking
exactly what slime's policy loss passes and returning what it expects.  Re-exports only: the functions live in
:mod:`slime_rc.slime.tis_hooks`, the contract (slime's batch as packed tokens) in :mod:`slime_rc.slime.tis_contract`.

* ``custom_tis.mis.compute_mis_weights[_with_cp]``: IS / RS / veto / batch norm / the ``mis_*`` metrics on slime's
  keys with slime's example semantics (:mod:`slime_rc.slime.mis`); slime-rc's correction engine
  (:func:`slime_rc.compute_rollout_correction`) when the settings go beyond what slime's example can express;
* ``custom_tis.tis.compute_tis_weights[_with_cp]``: slime's vanilla truncated IS (``tis_clip``, ``tis_clip_low``);
* ``custom_tis.icepop.compute_icepop_weights[_with_cp]``: slime's IcePop (token-level mask-mode IS);
* ``custom_tis.metrics_only.compute_metrics_only[_with_cp]``: monitoring only (``--get-mismatch-metrics``): the
  mismatch metrics, the loss and masks untouched.

Under context parallelism the CP rank and group come from :func:`slime_rc.megatron.reducers.megatron_context_parallel`
and the zigzag positions from :mod:`slime_rc.megatron.cp_layout`.
"""

from custom_tis.icepop import compute_icepop_weights, compute_icepop_weights_with_cp
from custom_tis.metrics_only import compute_metrics_only, compute_metrics_only_with_cp
from custom_tis.mis import compute_mis_weights, compute_mis_weights_with_cp
from custom_tis.tis import compute_tis_weights, compute_tis_weights_with_cp

__all__ = [
    "compute_mis_weights", "compute_mis_weights_with_cp",
    "compute_tis_weights", "compute_tis_weights_with_cp",
    "compute_icepop_weights", "compute_icepop_weights_with_cp",
    "compute_metrics_only", "compute_metrics_only_with_cp",
]
