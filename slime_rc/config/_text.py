"""Text helpers every configuration module shares: did-you-mean hints, near-misses, numbers and thresholds.

The bottom of :mod:`slime_rc.config` (it imports nothing of ours), so that the knob table, the rejection criteria,
the presets and the config record all give the same hint and the same message for the same mistake.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

# A threshold as a user writes it: a number (an upper bound), or "lower_upper" (a band, e.g. "0.5_2.0").
Threshold = Union[float, int, str]


def did_you_mean(name: Any, choices: Iterable[str]) -> str:
    """``" Did you mean 'x'?"`` for the choice closest to ``name``, or ``""`` when none is close."""
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def close_matches(name: Any, choices: Iterable[str], n: int = 3) -> List[str]:
    """Up to ``n`` choices closest to ``name``, for a hint after a typo: those at the smallest edit distance
    (:func:`_edit_distance`; case and ``-`` for ``_`` ignored) when it is at most a third of ``name``'s length
    (``trian`` -> ``train``, ``--tis-clp`` -> ``--tis-clip``), else difflib's best match above 0.6; ``[]`` when
    nothing is close.  Ties keep ``choices``' order, so a flag's near twins (``--tis-clip`` / ``--tis-clip-low``)
    are both offered only when they are equally close."""
    choices = list(dict.fromkeys(choices))
    norm = str(name).lower().replace("-", "_")
    distances = [(_edit_distance(norm, c.lower().replace("-", "_")), c) for c in choices]
    best = min((d for d, _ in distances), default=None)
    if best is not None and best <= max(1, len(norm) // 3):
        return [c for d, c in distances if d == best][:n]
    return difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)


def did_you_mean_any(name: Any, choices: Iterable[str]) -> str:
    """``" Did you mean 'a' or 'b'?"`` for :func:`close_matches` of ``name``, or ``""`` when none is close.  Unlike
    :func:`did_you_mean` (one difflib match at 0.5) it offers only what is a likely typo."""
    matches = close_matches(name, choices)
    return f" Did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


def unknown_flags_message(leftover: Sequence[str], known: Iterable[str]) -> str:
    """argparse's ``unrecognized arguments: ...`` for ``leftover`` (what ``parse_known_args`` left), followed by
    one sentence per unknown flag naming it and the closest of ``known`` (the parser's option strings).

    Why: argparse names what it could not place but not what was meant, and a mistyped flag (``--tis-clp 2``)
    silently differs from the intended one by one letter.  Tokens that are not flags (a value, a number such as
    ``-1``) get no sentence; ``--flag=value`` is looked up as ``--flag``."""
    known = [k for k in known if k not in ("-h", "--help")]  # never what a mistyped setting meant
    text = f"unrecognized arguments: {' '.join(leftover)}."
    for token in leftover:
        flag = token.split("=", 1)[0]
        if not flag.startswith("-") or flag == "-" or _is_number(flag):
            continue
        hint = did_you_mean_any(flag, known) or _initials_hint(flag, known)
        text += f" Unknown flag {flag!r}.{hint}"
    return text


def _initials_hint(flag: str, known: Sequence[str]) -> str:
    """``--cp`` -> ``" Did you mean '--context-parallel-size'?"``: the flags whose words' initials start with the
    letters of a short flag (at most three such flags), for abbreviations other tools use."""
    letters = flag.lstrip("-").replace("_", "-")
    if not 2 <= len(letters) <= 4 or "-" in letters:
        return ""
    hits = [k for k in known if k.startswith("--")
            and "".join(w[:1] for w in k[2:].split("-")).startswith(letters.lower())]
    return f" Did you mean {' or '.join(repr(k) for k in hits)}?" if 0 < len(hits) <= 3 else ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of neighbours."""
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def near_miss(key: str, known: Iterable[str]) -> Optional[str]:
    """The key of ``known`` that ``key`` is probably a typo of, or ``None``.

    ``None`` when ``key`` is itself in ``known`` or is not close to any of them.  Close means a small edit
    distance (insertions, deletions, substitutions, swapped neighbours; case and ``-`` for ``_`` ignored):
    none for keys of up to 4 characters (only ``RS`` -> ``rs``), at most 1 edit up to 11 characters
    (``use_tiss`` -> ``use_tis``, ``tis_levle`` -> ``tis_level``), at most 2 beyond (``rs_veto_treshold`` ->
    ``rs_veto_threshold``, ``tis_uper_bound`` -> ``tis_upper_bound``).  Ties go to the first closest key in
    ``known``'s order.

    The cutoff is tight on purpose: slime copies ONE ``--custom-config-path`` YAML onto ``args`` for every
    plugin, so a YAML read by slime-rc also holds slime's, Megatron-LM's and other plugins' keys
    (``use_kl_loss``, ``kl_coef``, ``eps_clip``, ``use_opsm``, ``loss_type``, ``advantage_estimator``, ...),
    which must be ignored, not flagged.  tests/config/test_arguments_in_slime.py checks slime's and Megatron-LM's
    arg names nearest to ours (Megatron-LM's ``test_mode`` is 2 edits from ``tis_mode``: why 9-11 characters allow
    only 1 edit); none of the 948 names of slime's real parser at 624b824a8 is flagged.
    """
    known = list(known)
    if key in known:
        return None
    norm = key.lower().replace("-", "_")
    limit = 0 if len(norm) <= 4 else 1 if len(norm) <= 11 else 2
    best, best_d = None, limit + 1
    for k in known:
        cand = k.lower().replace("-", "_")
        if abs(len(cand) - len(norm)) >= best_d:
            continue
        d = _edit_distance(norm, cand)
        if d < best_d:
            best, best_d = k, d
    return best


def parse_number(what: str, value: Any) -> Any:
    """A string as a float, refusing what Python's ``float`` would misread (``"2_0"`` is 20.0 there); other
    values are returned as they are (validated where they are used).  ``what`` names the setting in the message."""
    if not isinstance(value, str):
        return value
    try:
        if "_" in value:
            raise ValueError
        return float(value)
    except ValueError:
        raise ValueError(f"{what}={value!r} is not a number") from None


def band_refusal(given: str, name: str, value: str, hint: str) -> str:
    """The one message for a ``'lower_upper'`` band given to a setting that takes one number: ``given`` is how the
    user wrote it (``tis_upper_bound='0.5_5'`` in a mapping, ``--tis-upper-bound 0.5_5`` on the command line),
    ``name`` the setting or flag, ``hint`` the fix."""
    lower, _, upper = value.strip().partition("_")
    return (f"{given} is a 'lower_upper' band (lower {lower}, upper {upper}), but {name} takes one number "
            f"(underscores never group digits here): write a single number without an underscore; {hint}")


def refuse_band(name: str, value: Any, hint: str) -> None:
    """``ValueError`` when ``value`` is text with an underscore (``'0.5_5'``) for a setting that takes one number.

    Underscores never group digits here (Python's ``float('0.5_5')`` and YAML 1.1 read 0.55): such text is a
    ``'lower_upper'`` band, which only the threshold settings take (``rs_upper_bound``, verl's
    ``rollout_is_threshold`` / ``rollout_rs_threshold``; :func:`split_threshold`).  The message names the setting,
    the value and the fix (``hint``): :func:`band_refusal`, as the command line's flags say it."""
    if isinstance(value, str) and "_" in value:
        raise ValueError(band_refusal(f"{name}={value!r}", name, value, hint))


def positive_finite(name: str, value: Any, hint: str) -> float:
    """``value`` as a finite float > 0; else ``ValueError`` naming ``name`` and the value, with ``hint``.  Text
    with an underscore is refused as a band (:func:`refuse_band`), not read as Python's ``float`` reads it."""
    refuse_band(name, value, hint)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a number; {hint}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0; {hint}")
    return value


def not_a_threshold(what: str, value: Any) -> str:
    """The one message for a threshold that cannot be read (a flag's comma list included)."""
    return (f"{what}={value!r} is not a threshold: give a number (2.0) or 'lower_upper' with one underscore "
            f"(e.g. '0.5_2.0'; a comma list gives one per rs_level option)")


def split_threshold(what: str, threshold: Threshold) -> Tuple[Threshold, Optional[float]]:
    """``2.0`` -> (upper=2.0, lower=None); ``"0.5_2.0"`` -> (upper=2.0, lower=0.5).  ``what`` names the setting
    in the error message (:func:`not_a_threshold`)."""
    try:
        if isinstance(threshold, str) and "_" in threshold:
            lo, _, hi = threshold.strip().partition("_")
            return parse_number(what, hi), parse_number(what, lo)
        return parse_number(what, threshold), None
    except ValueError:
        raise ValueError(not_a_threshold(what, threshold)) from None
