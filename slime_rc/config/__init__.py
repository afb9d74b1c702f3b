"""What the user sets, and how it becomes one validated :class:`~slime_rc.RolloutCorrectionConfig`.

Where are flags defined?  In :mod:`slime_rc.config.knobs`, the knob table: one row per setting (its key, config
field, flag, help, default, how it is read and checked, its spellings in slime's / this project's / verl's dialect,
slime's own definitions).  Every other view is derived from it.  The modules, bottom to top (each imports only
modules listed before it, never one after it):

* :mod:`~slime_rc.config._text`: did-you-mean hints, near-misses, numbers and thresholds written as text;
* :mod:`~slime_rc.config.rejection`: the RS options, ``RejectionCriterion`` and ``parse_rejection_criteria``;
* :mod:`~slime_rc.config.presets`: the named presets, plain functions returning settings;
* :mod:`~slime_rc.config.knobs`: the knob table and its derived views;
* :mod:`~slime_rc.config.stack`: a ``Layer`` of settings per source, stacked by precedence, building the config;
* :mod:`~slime_rc.config.schema`: ``RolloutCorrectionConfig`` (fields, validation, ``from_dict``, ``preset``);
* :mod:`~slime_rc.config.resolution`: ``resolve``: the config, who set each field, and notes;
* :mod:`~slime_rc.config.yaml_config`: ``--custom-config-path`` in slime's or verl's dialect;
* :mod:`~slime_rc.config.arguments`: the argparse flags, ``config_from_args``, ``resolve_args``.
"""
