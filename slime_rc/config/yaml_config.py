"""``--custom-config-path``: a YAML file in slime's or verl's dialect, read with ``yaml.safe_load``.

The keys of each dialect are the knob table's spellings (:data:`slime_rc.config.knobs.SPELLINGS`); this module
only finds them in the file (flat, or under verl's ``algorithm.rollout_correction``) and refuses what slime would
misread.

* slime: a flat mapping of slime keys (``use_tis: true``, ``tis_level: sequence``, ``mis_*`` aliases, ...) — the
  spec's ``mis.yaml``.  slime copies ONE such YAML onto ``args`` for every plugin, so it also holds keys of slime
  itself and of other plugins: keys slime-rc does not know are ignored (listed in ``Layer.ignored``), except a
  near-miss of one of ours (``tis_uper_bound``; :func:`slime_rc.config._text.near_miss`), which is refused naming the
  file, the key and the closest valid key.  A number written as a quoted string (``tis_upper_bound: '2.0'``) is
  refused: slime copies values onto ``args`` as they are, so slime's side would get a string;
* verl: ``algorithm: {rollout_correction: {rollout_is, rollout_is_threshold, rollout_rs, bypass_mode, loss_type,
  ...}}``, and the older framework keys ``rollout_is*`` directly under ``algorithm``.  The rest of a verl config
  (other ``algorithm`` keys, ``actor_rollout_ref``, ...) is not ours and is ignored; inside what is ours an
  unknown key is an error naming the key and the closest valid one.

``load_yaml_layer(path, slime=True)`` reads the file the way it acts inside slime (``slime-rc config --slime``):
``loss_type`` is slime's own key there (a slime value such as ``custom_loss`` is ignored, ours is refused), and a
value slime's ``yaml.safe_load`` reads as a string where this loader reads a number (``1e-4``: YAML 1.1 wants a
dot, ``1.0e-4``) is refused.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List

import yaml

from slime_rc.config._text import near_miss
from slime_rc.config.knobs import BAND_SPELLINGS, SPELLINGS
from slime_rc.config.stack import Layer


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


# slime's own --loss-type values (slime/utils/arguments.py at 624b824a8)
SLIME_LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
_NUMBER_TEXT = re.compile(r"^\s*[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\s*$")


def _dotted(value: Any) -> str:
    """``1e-4`` -> ``1.0e-4``: the spelling YAML 1.1 (slime's ``yaml.safe_load``) reads as a number."""
    text = str(value).strip()
    return re.sub(r"^([-+]?[0-9]+)([eE])", r"\1.0\2", text)


def _slime_settings(data: Dict[str, Any], raw: Dict[str, Any], path: str, slime: bool) -> tuple:
    """Split a slime-dialect mapping into (our keys, ignored keys); refuse near-misses and string numbers."""
    ours: Dict[str, Any] = {}
    ignored: List[str] = []
    for key, value in data.items():
        key_text = str(key)
        if key_text not in SPELLINGS:
            close = near_miss(key_text, SPELLINGS)
            if close is not None:
                raise ValueError(
                    f"{path}: unknown rollout-correction key {key_text!r}. Did you mean {close!r}? (Keys slime-rc "
                    f"does not know are left to slime and other plugins, but {key_text!r} is a near-miss of "
                    f"slime-rc's {close!r}: rename it, or it would silently do nothing.)")
            ignored.append(key_text)
            continue
        if slime and key_text == "loss_type":
            if value in SLIME_LOSS_TYPES:
                ignored.append(key_text)  # slime's own --loss-type, set through the shared YAML
                continue
            raise ValueError(
                f"{path}: loss_type: {value!r} — inside slime, loss_type is slime's own --loss-type "
                f"({', '.join(SLIME_LOSS_TYPES)}): slime copies it onto args.loss_type and fails with 'Unknown "
                f"loss type'. Write rollout_correction_loss_type: {value} (the attribute of "
                f"--rollout-correction-loss-type) instead.")
        if isinstance(value, str) and _NUMBER_TEXT.match(value):
            raise ValueError(
                f"{path}: {key_text}: {value!r} is a quoted string, not a number. slime copies YAML values onto "
                f"args as they are, so slime's side would get the string {value!r}; write "
                f"{key_text}: {_dotted(value)} without quotes.")
        if slime and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and isinstance(raw.get(key), str):
            raise ValueError(
                f"{path}: {key_text}: {raw[key]} is read by slime's yaml.safe_load (YAML 1.1) as the string "
                f"{raw[key]!r}, not a number, and slime copies it onto args.{key_text} as that string. Write "
                f"{key_text}: {_dotted(raw[key])} (a dot in the mantissa).")
        if slime and isinstance(value, str) and isinstance(raw.get(key), (int, float)) \
                and not isinstance(raw.get(key), bool) and key_text not in BAND_SPELLINGS:
            raise ValueError(
                f"{path}: {key_text}: {value} is read by slime's yaml.safe_load (YAML 1.1, where '_' separates "
                f"digits) as the number {raw[key]!r}, and by slime-rc as the band {value!r}, but {key_text} takes "
                f"one number: write it without an underscore (a band is for rs_upper_bound; an IS band is "
                f"tis_lower_bound and tis_upper_bound).")
        if slime and isinstance(value, str) and isinstance(raw.get(key), (int, float)) \
                and not isinstance(raw.get(key), bool):
            raise ValueError(
                f"{path}: {key_text}: {value} is read by slime's yaml.safe_load (YAML 1.1, where '_' separates "
                f"digits) as the number {raw[key]!r}, not as the band {value!r}. Quote it: {key_text}: '{value}'.")
        ours[key_text] = value
    return ours, ignored


def load_yaml_layer(path: str, *, slime: bool = False) -> Layer:
    """The settings of the YAML file at ``path`` as a layer of kind ``yaml``; ``slime``: as the file acts inside
    slime (see the module docstring)."""
    abspath = os.path.abspath(path)
    try:
        with open(abspath) as f:
            text = f.read()
        data = yaml.load(text, Loader=_Loader)
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
    ignored: List[str] = []
    if "algorithm" in data:
        ours = [k for k in data if k != "algorithm" and k in SPELLINGS]
        if ours:
            raise ValueError(f"{abspath}: mixes slime keys ({', '.join(ours)}) with a verl 'algorithm' block; "
                             f"use one dialect per file.")
        data = _verl_settings(data["algorithm"], abspath)
    else:
        raw = yaml.safe_load(text) if slime else {}  # what slime itself reads
        data, ignored = _slime_settings(data, raw if isinstance(raw, dict) else {}, abspath, slime)
    try:
        layer = Layer.from_mapping(data, kind="yaml", where=abspath)
    except ValueError as e:
        raise ValueError(str(e) if abspath in str(e) else f"{abspath}: {e}") from None
    layer.ignored = ignored
    return layer
