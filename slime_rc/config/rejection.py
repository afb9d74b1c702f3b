"""Rejection sampling (RS): the options, :class:`RejectionCriterion` and :func:`parse_rejection_criteria`.

The one place an RS option name is checked (:func:`rs_options`, with one message per mistake): the ``--rs-level``
flag checks its text with it while parsing, and every :class:`RejectionCriterion` checks its option with it when
built.  Criteria are built once, from the settings' text (:func:`parse_rejection_criteria`) or given as objects
(``RolloutCorrectionConfig(rs=...)``, ``from_dict({"rs": [...]})``), and stay objects up to the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

from slime_rc.config._text import Threshold, did_you_mean, positive_finite, refuse_band, split_threshold

# Rejection options.  Each is (granularity, aggregate, statistic):
#   granularity "token" rejects single tokens, "sequence" rejects whole sequences;
#   aggregate is how the per-token statistic becomes a per-sequence one;
#   statistic "k1" is the log-ratio log r, "k2" is (log r)^2 / 2, "k3" is r - 1 - log r.
# "k1" options are bounded as ratios: exp(statistic) must lie in [lower, upper].
# "k2"/"k3" options are divergences (>= 0): the statistic must be <= upper.
RS_OPTIONS = {
    "token": ("token", "token", "k1"),
    "sequence": ("sequence", "sum", "k1"),
    "geometric": ("sequence", "mean", "k1"),
    "token_k1": ("token", "token", "k1"),
    "token_k2": ("token", "token", "k2"),
    "token_k3": ("token", "token", "k3"),
    "seq_sum_k1": ("sequence", "sum", "k1"),
    "seq_sum_k2": ("sequence", "sum", "k2"),
    "seq_sum_k3": ("sequence", "sum", "k3"),
    "seq_mean_k1": ("sequence", "mean", "k1"),
    "seq_mean_k2": ("sequence", "mean", "k2"),
    "seq_mean_k3": ("sequence", "mean", "k3"),
    "seq_max_k2": ("sequence", "max", "k2"),
    "seq_max_k3": ("sequence", "max", "k3"),
}


def check_rs_option(name: Any) -> str:
    """``name`` if it is a rejection option; else ``ValueError`` naming it, the valid options and the closest one."""
    if name not in RS_OPTIONS:
        raise ValueError(f"rs_level={name!r} is not a rejection option; choose from {', '.join(RS_OPTIONS)}."
                         + did_you_mean(name, RS_OPTIONS))
    return name


def rs_options(levels: Union[str, Sequence[str], None]) -> Tuple[str, ...]:
    """The options of ``levels`` (one option, a comma list or a list; de-duplicated, in order), each checked by
    :func:`check_rs_option`."""
    if levels is None:
        return ()
    names = levels.split(",") if isinstance(levels, str) else [str(s) for s in levels]
    return tuple(check_rs_option(n) for n in dict.fromkeys(n.strip() for n in names if n.strip()))


@dataclass(frozen=True)
class RejectionCriterion:
    """One rejection-sampling rule.  Several criteria are ANDed: a token is kept only if every one keeps it.

    ``option``: a key of :data:`RS_OPTIONS`.  ``upper``/``lower``: for k1 options (``token``, ``sequence``,
    ``geometric``, ``*_k1``) bounds on the ratio exp(statistic), ``lower`` defaulting to ``1/upper``; for
    k2/k3 options ``upper`` bounds the divergence and ``lower`` must stay unset.
    """

    option: str
    upper: float
    lower: Optional[float] = None

    def __post_init__(self):
        check_rs_option(self.option)
        hint = f"set the bound of rejection option {self.option!r} to e.g. 2.0"
        upper = positive_finite(f"rs upper bound for {self.option!r}", self.upper, hint)
        object.__setattr__(self, "upper", upper)
        if self.statistic == "k1":
            lower = 1.0 / upper if self.lower is None else positive_finite(
                f"rs lower bound for {self.option!r}", self.lower, "use a ratio such as 0.5")
            if not lower < upper:
                raise ValueError(
                    f"rs bounds for {self.option!r}: lower={lower} must be < upper={upper}; "
                    f"write them as 'lower_upper', e.g. '0.5_2.0'.")
            object.__setattr__(self, "lower", lower)
        elif self.lower is not None:
            raise ValueError(
                f"rejection option {self.option!r} bounds a divergence (>= 0) from above only; "
                f"got lower={self.lower!r}. Give a single upper bound such as 0.01, or use a *_k1 option "
                f"for a two-sided ratio band.")

    @property
    def granularity(self) -> str:
        return RS_OPTIONS[self.option][0]

    @property
    def aggregate(self) -> str:
        return RS_OPTIONS[self.option][1]

    @property
    def statistic(self) -> str:
        return RS_OPTIONS[self.option][2]

    @property
    def log_bounds(self) -> tuple[float, float]:
        """Bounds in the space the statistic lives in: log-ratio for k1, the divergence itself for k2/k3."""
        if self.statistic == "k1":
            return math.log(self.lower), math.log(self.upper)
        return -math.inf, self.upper


def parse_rejection_criteria(
    levels: Union[str, Sequence[str], None],
    upper: Union[Threshold, Sequence[Threshold], None],
    lower: Optional[float] = None,
) -> tuple[RejectionCriterion, ...]:
    """Build criteria from slime/verl style settings.

    ``levels``: ``"geometric"``, ``"token,seq_mean_k3"`` or a list.  ``upper``: one threshold shared by every
    option, or a comma list / list with one per option; a threshold is a number or ``"lower_upper"``.
    ``lower``: a plain lower ratio bound for the k1 options whose threshold does not carry one.
    """
    names = rs_options(levels or None)
    if not names:
        return ()
    refuse_band("rs_lower_bound", lower, f"a band goes into the threshold instead (rs_upper_bound: '{lower}')")
    if upper is None:
        raise ValueError(
            f"rejection sampling on {','.join(names)!r} needs a threshold: set rs_upper_bound "
            f"(e.g. 2.0 for ratio options, '0.999_1.001' for geometric, 0.01 for k2/k3 options).")
    if isinstance(upper, str):
        thresholds: list = [t.strip() for t in upper.split(",")]
    elif isinstance(upper, (list, tuple)):
        thresholds = list(upper)
    else:
        thresholds = [upper]
    if len(thresholds) == 1:
        thresholds = thresholds * len(names)
    if len(thresholds) != len(names):
        raise ValueError(
            f"rs thresholds {upper!r}: give one threshold shared by all {len(names)} options {list(names)} "
            f"or exactly one per option (comma separated).")
    out, lower_used = [], False
    for name, thr in zip(names, thresholds):
        hi, lo = split_threshold(f"rs threshold for {name!r}", thr)
        if RS_OPTIONS[name][2] == "k1" and lo is None and lower is not None:
            lo, lower_used = lower, True
        out.append(RejectionCriterion(name, hi, lo))
    if lower is not None and not lower_used:
        raise ValueError(
            f"rs_lower_bound={lower!r} has no effect on {','.join(names)!r}: it applies to ratio (k1) options whose "
            f"threshold carries no 'lower_upper' band, and k2/k3 options bound a divergence from above only. Drop "
            f"it, or write the band into the threshold (e.g. '0.5_2.0').")
    return tuple(out)
