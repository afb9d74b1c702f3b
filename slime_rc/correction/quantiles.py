"""Streaming quantiles of log-ratios: a fixed-size histogram that sums exactly across ranks.

Sorting (``torch.quantile``) needs every value on one rank and fails on large inputs.  Instead each value
``x`` (a log-ratio, |x| <= safety bound) falls into a bin of a log-magnitude grid read straight off the
float32 bit pattern: ``bins_per_octave`` bins per power of two of |x|, so a bin spans at most
``|x| / bins_per_octave``.  Magnitudes below ``2**MIN_EXPONENT`` share the central bin (ratio 1).
Counts are integers, so histograms from any split of the batch add up to the same histogram, and the
quantiles read from it are identical however the batch was distributed.

A quantile ``q`` is the nearest-rank order statistic (rank ``ceil(q * n)``); we report the centre of the bin
holding it, hence ``|reported - true| <= |true| / (2 * bins_per_octave) + 2**MIN_EXPONENT`` in log space.
"""

from __future__ import annotations

import math

import torch

from slime_rc.correction.packed import process_cached, upload

MIN_EXPONENT = -24
QUANTILES = (0.25, 0.50, 0.75, 0.95, 0.99)


def _half_bins(bins_per_octave: int, bound: float) -> int:
    top_exponent = math.frexp(bound)[1]  # bound < 2**top_exponent
    return (top_exponent - MIN_EXPONENT) * bins_per_octave


def num_bins(bins_per_octave: int, bound: float) -> int:
    return 2 * _half_bins(bins_per_octave, bound) + 1


def bin_index(x: torch.Tensor, bins_per_octave: int, bound: float) -> torch.Tensor:
    """``[N] float32 -> [N] int32`` bin of each value; bin order follows value order, centre bin = 0."""
    shift = 23 - int(math.log2(bins_per_octave))
    offset = (127 + MIN_EXPONENT) << (23 - shift)
    mag = x.abs().clamp_(min=2.0 ** MIN_EXPONENT, max=bound)
    # For positive floats the IEEE-754 bit pattern grows with the value: exponent, then mantissa.  Shifted in place
    # (mag is this function's own buffer): a fresh [N] output costs more in page faults than the shift on a CPU.
    k = mag.view(torch.int32).bitwise_right_shift_(shift).sub_(offset)
    # negative values (their sign bit set, -0.0 too: its k is 0) go below the centre bin: s = -1 there, 0 elsewhere,
    # and (k ^ s) - s is -k where s = -1 (two's complement), k elsewhere -- integer arithmetic, no float round trip
    s = x.view(torch.int32) >> 31
    half = _half_bins(bins_per_octave, bound)
    # clamped into the grid: NaN (its bits above every bound's) would index past it; the compiled engine's gathers
    # and scatters are not bounds-checked (compiled.py)
    return k.bitwise_xor_(s).sub_(s).add_(half).clamp_(0, 2 * half)


def histogram(x: torch.Tensor, bins_per_octave: int, bound: float, weights=None) -> torch.Tensor:
    """Histogram (float64 counts) of ``x`` on the grid above; ``weights`` count each value that many times."""
    n = num_bins(bins_per_octave, bound)
    idx = bin_index(x.float().contiguous(), bins_per_octave, bound)
    counts = torch.zeros(n, dtype=torch.float64, device=x.device)
    # index_add_, not bincount: bincount reads the largest index on the host (a GPU stall)
    if weights is None:
        return counts.index_add_(0, idx, torch.ones((), dtype=torch.float64, device=x.device).expand(idx.numel()))
    return counts.index_add_(0, idx, weights.double())


_CENTRES: dict = {}
_LEVELS: dict = {}


def bin_centres(bins_per_octave: int, bound: float, device=None) -> torch.Tensor:
    """Log-space value reported for each bin (float64, ``[num_bins]``), built once per grid and device."""
    return process_cached(_CENTRES, (bins_per_octave, bound, str(device)), 16,
                          lambda: _bin_centres(bins_per_octave, bound, device))


def _bin_centres(bins_per_octave: int, bound: float, device) -> torch.Tensor:
    shift = 23 - int(math.log2(bins_per_octave))
    half = _half_bins(bins_per_octave, bound)
    k = torch.arange(half + 2, dtype=torch.int64, device=device)
    edges = ((k + ((127 + MIN_EXPONENT) << (23 - shift))) << shift).to(torch.int32).view(torch.float32).double()
    mags = (edges[:-1] + edges[1:]) / 2
    mags[:1].fill_(0.0)  # the centre bin holds |x| < 2**MIN_EXPONENT (and exact zeros)
    mags = mags.clamp(max=bound)
    return torch.cat([-mags.flip(0)[:-1], mags])


def _levels(qs: tuple, device) -> torch.Tensor:
    """The quantile levels on ``device``: uploaded once per device, then cached."""
    return process_cached(_LEVELS, (qs, str(device)), 16, lambda: upload(list(qs), torch.float64, device))


def quantiles_from_histogram(counts: torch.Tensor, bins_per_octave: int, bound: float,
                             qs=QUANTILES) -> torch.Tensor:
    """Log-space quantiles ``[len(qs)]`` (float64) from histogram counts; zeros if the histogram is empty.  No host
    read: the empty case is a ``where``."""
    total = counts.sum()
    cum = counts.cumsum(0)
    ranks = torch.ceil(_levels(tuple(qs), counts.device) * total).clamp(min=1)
    pos = torch.searchsorted(cum, ranks - 0.5)  # first bin whose cumulative count reaches the rank
    values = bin_centres(bins_per_octave, float(bound), counts.device)[pos.clamp(max=counts.numel() - 1)]
    return torch.where(total > 0, values, 0.0)
