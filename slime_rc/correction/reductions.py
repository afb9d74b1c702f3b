"""Stage 1 reduced: the per-token quantities of this rank's ``N`` tokens (``token_stats.py``) summed per sequence
and over the batch before any sequence decision, so that nothing after it reads an ``[N]`` column but the token
keep flags and IS weights (stage 4's inputs).

:func:`token_reductions` is the one place the engine passes over the token columns before the collectives: the
per-sequence sums and maxima (``sequence_stats.local_sequence_sums``) and the batch totals of the token columns
(``metrics.token_column_totals``: ``|log r|``, ``r``, ``r^2``, the quantile histogram, extremes, the RS band sums).
It is pure (no communication, no host read).  Ending stage 1 here also ends the life of its ``[N]`` temporaries
before stage 4 makes the keep mask and weights: the peak memory of a call fell from 68 to 60 bytes/token at 1M
tokens (the benchmark's sweep) when the batch totals stopped reading them after the decisions.
"""

from __future__ import annotations

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.metrics import token_column_totals
from slime_rc.correction.records import PackedBatch, TokenReductions
from slime_rc.correction.sequence_stats import local_sequence_sums
from slime_rc.correction.token_stats import token_statistics


def token_reductions(batch: PackedBatch, config: RolloutCorrectionConfig) -> TokenReductions:
    """Stage 1 and its reductions over this rank's tokens (see :class:`TokenReductions` for the fields)."""
    tokens = token_statistics(batch, config)
    local, k_maxes = local_sequence_sums(batch, tokens)
    return TokenReductions(local=local, k_maxes=k_maxes, totals=token_column_totals(tokens, config),
                           keep=tokens.keep, is_weight=tokens.is_weight)
