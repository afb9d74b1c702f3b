"""``--custom-config-path``: a YAML file in slime's or verl's dialect, read with ``yaml.safe_load``.

* slime: a flat mapping of slime keys (``use_tis: true``, ``tis_level: sequence``, ``mis_*`` aliases, ...) — the
  spec's ``mis.yaml``;
* verl: ``algorithm: {rollout_correction: {rollout_is, rollout_is_threshold, rollout_rs, bypass_mode, loss_type,
  ...}}``, and the older framework keys ``rollout_is*`` directly under ``algorithm``.  The rest of a verl config
  (other ``algorithm`` keys, ``actor_rollout_ref``, ...) is not ours and is ignored.

Inside what is ours an unknown key is an error naming the key and the closest valid one.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict

import yaml

from .settings import SPELLINGS, Layer


class _Loader(yaml.SafeLoader):
    """safe_load, except that numbers never contain underscores: YAML 1.1 reads ``0.5_5`` as 0.55 and
    ``1_000`` as 1000, which would silently turn a ``lower_upper`` band into a number.  Those stay strings (and
    are parsed as bands); ``1e-4`` is a float here, as a user means it (YAML 1.1 reads it as a string)."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
                                   for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_FLOAT, re.compile(
    r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))


def _verl_settings(algorithm: Any, path: str) -> Dict[str, Any]:
    if not isinstance(algorithm, dict):
        raise ValueError(f"{path}: 'algorithm' must be a mapping, got {type(algorithm).__name__}")
    block = algorithm.get("rollout_correction") or {}
    if not isinstance(block, dict):
        raise ValueError(f"{path}: 'algorithm.rollout_correction' must be a mapping, got {type(block).__name__}")
    older = {k: v for k, v in algorithm.items() if k.startswith("rollout_is")}  # the first framework's keys
    both = set(block) & set(older)
    if both:
        raise ValueError(f"{path}: {', '.join(sorted(both))} set both in algorithm.rollout_correction and directly "
                         f"under algorithm; keep one.")
    if not block and not older:
        raise ValueError(f"{path}: the verl config has no algorithm.rollout_correction block (nor "
                         f"algorithm.rollout_is* keys); add one, e.g. rollout_correction: {{rollout_is: token}}.")
    return {**older, **block}


def load_yaml_layer(path: str) -> Layer:
    """The settings of the YAML file at ``path`` as a layer of kind ``yaml``."""
    abspath = os.path.abspath(path)
    try:
        with open(abspath) as f:
            data = yaml.load(f, Loader=_Loader)
    except FileNotFoundError:
        raise ValueError(f"--custom-config-path: no such file: {abspath}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"--custom-config-path {abspath}: not valid YAML{where}: "
                         f"{getattr(e, 'problem', None) or e}") from None
    if data is None:
        raise ValueError(f"--custom-config-path {abspath}: the file is empty; give slime keys (use_tis: true, ...) "
                         f"or a verl algorithm.rollout_correction block.")
    if not isinstance(data, dict):
        raise ValueError(f"--custom-config-path {abspath}: expected a mapping of keys, got {type(data).__name__}")
    if "algorithm" in data:
        ours = [k for k in data if k != "algorithm" and k in SPELLINGS]
        if ours:
            raise ValueError(f"{abspath}: mixes slime keys ({', '.join(ours)}) with a verl 'algorithm' block; "
                             f"use one dialect per file.")
        data = _verl_settings(data["algorithm"], abspath)
    try:
        return Layer.from_mapping(data, kind="yaml", where=abspath)
    except ValueError as e:
        raise ValueError(str(e) if abspath in str(e) else f"{abspath}: {e}") from None

