"""The slime surface: what slime loads and calls, and slime's own semantics on slime's keys.

* ``settings``: slime's keys read off slime's ``args`` (YAML keys set as attributes, slime's flags), with slime's
  defaults, validated once per ``args``;
* ``mis``: slime's example ``mis.py`` semantics (IS / RS / veto / batch norm / the ``mis_*`` metrics) over packed
  CP-local tokens, with O(B) reductions over the CP group instead of gathering sequences;
* ``attributes``: a resolved :class:`~slime_rc.RolloutCorrectionConfig` as slime's ``args`` attributes, for slime
  functions run inside slime-rc (``--custom-tis-function-path`` in ``slime_rc.megatron.loss`` / ``slime-rc train``).

The entry points slime loads by dotted path live in ``custom_tis`` (``custom_tis.mis.compute_mis_weights_with_cp``,
...).
"""
