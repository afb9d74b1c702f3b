"""THE slime integration: what slime loads and calls, read in one place.

What runs in your slime loss, by launch line (every path reads its settings through the one resolution,
:func:`slime_rc.config.resolution.resolve`; slime's keys mean what slime's example ``mis.py`` makes of them):

==========================================================  =====================================================
launch line                                                 what runs
==========================================================  =====================================================
``--loss-type custom_loss --custom-loss-function-path       :func:`policy_loss_function` (``policy_loss.py``):
slime_rc.slime.policy_loss_function``                       slime-rc's policy loss in every mode, the correction
                                                            engine inside it (``slime_rc.correction``)
``--use-tis --custom-tis-function-path                      slime's own policy loss; our function
custom_tis.mis.compute_mis_weights_with_cp``                (``tis_hooks.py``): slime's example semantics
                                                            (``mis.py``) on slime's keys, the engine beyond them
``--custom-tis-function-path custom_tis.tis.* / .icepop.*``  slime's vanilla TIS / IcePop (``tis_hooks.py``)
``--get-mismatch-metrics --custom-tis-function-path          metrics only (``tis_hooks.py``): loss and masks as
custom_tis.metrics_only.compute_metrics_only_with_cp``      they came, slime's ``mis_*`` mismatch set
==========================================================  =====================================================

The modules:

* ``settings``: slime's keys on slime's ``args`` (YAML keys set as attributes, slime's flags) -> the one resolution
  (:func:`~slime_rc.slime.settings.hook_config`) -> slime's example's view of it (``SlimeMisSettings``);
* ``tis_contract``: slime's TIS-function contract over packed tokens (slime's batch in its one representation,
  :class:`slime_rc.megatron.cp_layout.ResponseLayout`); ``tis_hooks``: the TIS functions (``custom_tis`` re-exports
  them under the paths slime loads); ``mis``: slime's example semantics with O(B) reductions over the CP group;
* ``policy_loss``: the custom loss;
* ``tis_bridge``: the other direction -- a function written to slime's contract run inside slime-rc's Megatron loss
  (``slime-rc train --custom-tis-function-path``), handed to the loss as an argument.
"""

from slime_rc.slime.policy_loss import policy_loss_function

__all__ = ["policy_loss_function"]
