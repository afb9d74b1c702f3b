"""The rejection level shared by ``slime-rc analyze`` (which never recommends a preset above it) and ``slime-rc train``
(which warns when a step goes above it): one constant, so both commands call the same amount of rejection too much.

A rejected token or sample leaves the loss: it teaches nothing, and a rejected sample no longer counts in its group's
baseline.  Above a fifth of the batch, the correction is throwing away the data rather than correcting it -- its
bounds do not fit the mismatch (widen them) or the mismatch itself is the problem (investigate it).
"""

from __future__ import annotations

from typing import Optional

MAX_REJECTED_FRACTION = 0.2  # of tokens or of samples: more rejected than this is warned about / not recommended


def exceeds(token_fraction: Optional[float], sample_fraction: Optional[float]) -> bool:
    """Whether a rejected token fraction or a rejected sample fraction (``None``: not measured) is above
    :data:`MAX_REJECTED_FRACTION`."""
    return any(f is not None and f > MAX_REJECTED_FRACTION for f in (token_fraction, sample_fraction))


def level_sentence() -> str:
    """The threshold in words, for messages: what the number is and why it matters."""
    return (f"{100 * MAX_REJECTED_FRACTION:g}%, the rejection level at which slime-rc train warns and slime-rc "
            f"analyze recommends a safer preset")
