"""Per-sequence sums (``packed.segment_sums``): the matrix path (micro-batches) and the blocked path (large
batches) against a float64 sum of each sequence on its own, and the engine's outputs equal on both paths (the
large-batch paths forced on a small batch by lowering their thresholds, so that they run here in milliseconds)."""

import math

import pytest
import torch

import slime_rc.correction.packed as packed
from slime_rc import RolloutCorrectionConfig, compute_rollout_correction, parse_rejection_criteria
from slime_rc.correction.packed import cu_seqlens_from_lengths, segment_sums

# boundaries on, just before and just after block edges (64), empty sequences, one inside a block, a tail past the
# last whole block, and N a multiple of 64
LENGTHS = [[5, 3], [64], [64, 0, 64], [63, 1, 1, 65, 0], [1, 999], [0, 10, 0, 290, 0], [130, 7, 200, 3, 300]]


@pytest.fixture(params=["matrix", "blocked"])
def path(request, monkeypatch):
    if request.param == "blocked":
        monkeypatch.setattr(packed, "MATRIX_TOKENS", 0)
        monkeypatch.setattr(packed, "_CHUNK_TOKENS", 128)  # several float64 conversion pieces even here
    return request.param


def _own_sums(column: torch.Tensor, lengths) -> torch.Tensor:
    """Each sequence's sum on its own, in float64 (the definition)."""
    return torch.stack([piece.double().sum() for piece in column.split(lengths)])


@pytest.mark.parametrize("lengths", LENGTHS)
def test_equals_each_sequence_summed_alone(path, lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    n = sum(lengths)
    values = torch.randn(n, generator=g) * 3
    flags = values > 0.5
    float_flags = (values < -0.5).float()
    cu = cu_seqlens_from_lengths(lengths)
    got = segment_sums([values, flags, float_flags, values], cu, counts=(float_flags,))
    want = torch.stack([_own_sums(values, lengths), _own_sums(flags, lengths), _own_sums(float_flags, lengths),
                        _own_sums(values, lengths)])
    assert got.dtype == torch.float64 and got.shape == (4, len(lengths))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # counts are exact
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_a_huge_value_does_not_round_away_a_neighbour(path):
    """Sequences share blocks of 64; one sequence's 4e8 costs its neighbours (one shares its block) no more than
    float64 roundings of the running total (~1e-16 x 4e8 per block in the blocked path, per token in the matrix
    path's prefix sum), where a float32 sum of the shared block would lose ~30."""
    lengths = [70, 50, 100]
    values = torch.full((220,), 0.001)
    values[69] = 4e8  # last token of sequence 0, in the block where sequence 1 starts
    got = segment_sums([values], cu_seqlens_from_lengths(lengths))[0]
    torch.testing.assert_close(got[1:], _own_sums(values, lengths)[1:], rtol=0,
                               atol=4e8 * 2.0 ** -50 * (1 if path == "blocked" else 220))


def test_extreme_finite_values_do_not_overflow(path):
    values = torch.full((200,), -3.0e38)
    got = segment_sums([values], cu_seqlens_from_lengths([100, 100]))[0]
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, torch.full((2,), -3.0e40, dtype=torch.float64), rtol=1e-6, atol=0)


def test_permuting_a_sequences_tokens_keeps_its_sum(path):
    g = torch.Generator().manual_seed(3)
    lengths = [150, 77, 300]
    values = torch.randn(sum(lengths), generator=g)
    cu = cu_seqlens_from_lengths(lengths)
    perm = torch.cat([torch.randperm(n, generator=g) + s for s, n in zip(cu[:-1].tolist(), lengths)])
    a, b = segment_sums([values], cu), segment_sums([values[perm]], cu)
    torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


CONFIGS = [
    RolloutCorrectionConfig(is_level="token", is_mode="truncate", is_upper_bound=2.0, is_batch_normalize=True,
                            rs=parse_rejection_criteria("token", 2.0), veto_threshold=1e-4),
    RolloutCorrectionConfig(is_level="sequence", is_mode="mask", is_upper_bound=3.0, on_nonfinite="reject",
                            rs=parse_rejection_criteria("seq_mean_k3,seq_max_k2", "0.5,2.0")),
    RolloutCorrectionConfig(is_level="geometric", is_mode="clip", is_upper_bound=1.5, is_lower_bound=0.7,
                            rs=parse_rejection_criteria("token_k1", "0.5_2.0")),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["token", "sequence-mask", "geometric-clip"])
def test_engine_outputs_equal_on_both_paths(config, monkeypatch):
    g = torch.Generator().manual_seed(5)
    lengths = [int(x) for x in torch.randint(0, 400, (24,), generator=g)]
    n = sum(lengths)
    rollout = -4.0 * torch.rand(n, generator=g)
    train = rollout + 0.2 * torch.randn(n, generator=g)
    train[torch.randint(0, n, (5,), generator=g)] -= 12.0
    mask = (torch.rand(n, generator=g) > 0.1).float()
    if config.on_nonfinite == "reject":
        train[7] = math.nan
    cu = cu_seqlens_from_lengths(lengths)
    matrix = compute_rollout_correction(train, rollout, mask, cu, config)
    monkeypatch.setattr(packed, "MATRIX_TOKENS", 0)
    monkeypatch.setattr(packed, "_CHUNK_TOKENS", 640)  # block sums and token totals in several float64 pieces
    blocked = compute_rollout_correction(train, rollout, mask, cu, config)
    assert torch.equal(matrix.keep_mask, blocked.keep_mask)
    assert 0 < float(matrix.keep_mask.sum()) < n  # something is kept and something rejected: the test can fail
    torch.testing.assert_close(blocked.is_weights, matrix.is_weights, rtol=1e-6, atol=0)
    for k in matrix.sequences:
        torch.testing.assert_close(blocked.sequences[k], matrix.sequences[k], rtol=1e-12, atol=1e-12)
    for k in matrix.metrics:
        assert math.isclose(float(blocked.metrics[k]), float(matrix.metrics[k]), rel_tol=1e-9, abs_tol=1e-12), k


@pytest.mark.parametrize("lengths", LENGTHS + [[], [0], [0, 0, 0], [1] * 70])
def test_token_sequence_ids_equal_repeat_interleave(lengths):
    """``token_sequence_ids`` (marks at the sequence ends, prefix-summed) is the ``repeat_interleave`` form, empty
    sequences included; the broadcast built on it repeats each value over its sequence's tokens."""
    cu, n = cu_seqlens_from_lengths(lengths), sum(lengths)
    want = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    ids = packed.token_sequence_ids(cu, n)
    assert ids.shape == (n,) and ids.dtype == torch.int32
    assert torch.equal(ids.long(), want)
    ids64 = packed.token_sequence_ids(cu, n, torch.int64)  # for a caller that scatters by them
    assert ids64.dtype == torch.int64 and torch.equal(ids64, want)
    values = torch.randn(len(lengths))
    assert torch.equal(packed.broadcast_to_tokens(values, cu, n), values[want])


def test_token_sequence_ids_random_lengths():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = torch.randint(0, 50, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        lengths[torch.rand(lengths.shape, generator=g) < 0.3] = 0  # many empty sequences, runs of them too
        cu = cu_seqlens_from_lengths(lengths)
        ids = packed.token_sequence_ids(cu, int(lengths.sum()))
        assert torch.equal(ids.long(), torch.repeat_interleave(torch.arange(lengths.numel()), lengths))


def test_segment_max_equals_float64_max():
    """``segment_max`` reduces in the values' dtype: the same maxima as over float64 copies; -inf when empty."""
    lengths = [3, 0, 64, 1, 0, 200]
    cu, n = cu_seqlens_from_lengths(lengths), sum(lengths)
    values = torch.randn(n) * 1e3
    got = packed.segment_max(values, packed.token_sequence_ids(cu, n), len(lengths))
    want = torch.tensor([p.double().max().item() if p.numel() else -math.inf for p in values.split(lengths)],
                        dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, want)


@pytest.mark.parametrize("n", [100, 640, 1000])
def test_token_moments_transform_piece_by_piece(monkeypatch, n):
    """``moments64`` with a transform (|x|, a clamp) applied piece by piece as it converts: the float64 sum and sum
    of squares of the transformed column, however many pieces (here 1, 5 and 8 of 128 tokens)."""
    monkeypatch.setattr(packed, "_CHUNK_TOKENS", 128)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    band = lambda v: v.clamp(-0.5, 2.0)  # noqa: E731
    for transform, made in ((None, x), (torch.abs, x.abs()), (band, band(x))):
        want = made.double()
        total, squares = packed.moments64(x, transform, square=True)
        torch.testing.assert_close(total, want.sum(), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(squares, want.dot(want), rtol=1e-14, atol=1e-14)
        alone, none = packed.moments64(x, transform)
        assert none is None and torch.equal(alone, total)
    assert not torch.equal(packed.moments64(x, torch.abs)[0], packed.moments64(x)[0])  # the transform acts


def test_token_counts_past_the_stack_are_exact():
    """Past the stacked micro-batch sums, 0/1 flags are counted in float32 (every partial sum an integer below
    2**24): the exact count, as float64."""
    from slime_rc.correction.metrics import _TokenSums

    flags = (torch.rand(300_000, generator=torch.Generator().manual_seed(1)) < 0.37).float()
    sums = _TokenSums(flags.numel())
    assert not sums.stacked
    got = sums.count(flags)
    assert got.dtype == torch.float64 and float(got) == int(flags.bool().sum())
