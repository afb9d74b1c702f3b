"""The one place where flags, YAML files, presets and dictionaries become a :class:`RolloutCorrectionConfig`:
:func:`resolve`.

A source is a :class:`Layer` of flat settings (:meth:`Layer.from_mapping` reads every spelling of
:data:`slime_rc.config.knobs.SPELLINGS`; :func:`preset_layer` a preset;
:func:`slime_rc.config.yaml_config.load_yaml_layer` a YAML file; :func:`slime_rc.config.arguments.resolve_args` the
flags).  :func:`resolve` stacks them by precedence (:data:`KINDS`, or :data:`SLIME_KINDS` inside slime:
:mod:`slime_rc.config.stack`), builds the validated config and says who set each field (``slime-rc config``'s
sources) and what a user should know (notes).  :func:`near_miss` tells a typo of one of our keys from another
plugin's key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from slime_rc.config._text import near_miss
from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.config.stack import KINDS, SLIME_KINDS, Layer, Stack, preset_layer

__all__ = ["KINDS", "SLIME_KINDS", "Layer", "Resolution", "near_miss", "preset_layer", "resolve"]


@dataclass
class Resolution:
    """What :func:`resolve` returns: the config, who set each config field, and notes a user should see."""

    config: RolloutCorrectionConfig
    sources: Dict[str, str]
    notes: List[str]


def resolve(layers: List[Layer], order: Tuple[str, ...] = KINDS) -> Resolution:
    """Merge ``layers`` and build the validated config.  ``order``: the precedence of the layer kinds, lowest
    first (:data:`KINDS`; :data:`SLIME_KINDS` for the resolution slime applies: YAML over flags)."""
    stack = Stack(layers, order)
    config = stack.build(RolloutCorrectionConfig)
    notes = list(stack.notes)  # settings that cannot act here, left beside what made them dead
    if config.is_enabled and not config.is_weights_applied:
        notes.append(
            f"IS weights are diagnostics only: in bypass mode with loss_type='ppo_clip' the PPO ratio "
            f"pi_theta/pi_rollout already is the importance weight, so the {config.is_level}-level weights are "
            f"reported in the metrics but not multiplied into the loss"
            + (" (mask-mode rejection still applies)" if config.is_mode == "mask" else "")
            + ". For explicit IS weights use loss_type='reinforce' (--rollout-correction-loss-type reinforce).")
    return Resolution(config, stack.sources(config), notes)
