"""The slime surface: what slime loads and calls, and slime's own semantics on slime's keys.

* ``policy_loss``: :func:`policy_loss_function`, a slime custom loss running slime-rc's policy loss in every mode
  (``--loss-type custom_loss --custom-loss-function-path slime_rc.slime.policy_loss_function``; docs/slime.md);
* ``settings``: slime's keys read off slime's ``args`` (YAML keys set as attributes, slime's flags), with slime's
  defaults, validated once per ``args``;
* ``mis``: slime's example ``mis.py`` semantics (IS / RS / veto / batch norm / the ``mis_*`` metrics) over packed
  CP-local tokens, with O(B) reductions over the CP group instead of gathering sequences.

The TIS functions slime loads by dotted path (``--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp``,
...) live in ``custom_tis``.  The other direction -- a resolved config as slime's ``args`` attributes, for slime's
functions run inside slime-rc -- is :mod:`slime_rc.config.slime_attributes`.
"""

from slime_rc.slime.policy_loss import policy_loss_function

__all__ = ["policy_loss_function"]
