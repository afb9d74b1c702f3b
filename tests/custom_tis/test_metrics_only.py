"""``custom_tis.metrics_only``: slime's TIS hook with ``--get-mismatch-metrics`` and nothing corrected.

Through slime's loss side (``tests.slime_reference.consume``: slime cuts the returned masks to its positions and
reduces per sample with the original masks' sums), the loss and the gradient of ``pg_loss`` are bit-identical to the
same call without a TIS function; the metrics are slime's example's mismatch set under ``mis_*`` names with the
example's values (``mis_reference`` with nothing corrected), at CP = 1 and on each rank of CP = 2 (positions of
megatron's zigzag layout; the per-sequence values combined in a 2-process gloo spawn).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from custom_tis.metrics_only import compute_metrics_only, compute_metrics_only_with_cp
from slime_rc.slime.mis import MISMATCH_METRICS
from tests.dist_utils import run_distributed
from tests.slime_reference import consume, make_samples, mis_reference, rank_inputs


def _run(samples, cp: int, rank: int, args=None):
    """This rank's ``(loss, grad, metrics)`` through slime's reduction with the function, and the loss and gradient
    of the same reduction without it (slime with no TIS function)."""
    idx, inputs = rank_inputs(samples, cp, rank)
    pg_full = [torch.linspace(-1, 1, s["R"], dtype=torch.float32) for s in samples]
    out = {}
    for name in ("with", "without"):
        pg = [p.clone().requires_grad_(True) for p in pg_full]
        local = torch.cat([p[i] for p, i in zip(pg, idx)])
        if name == "with":
            returned, masks, metrics = compute_metrics_only_with_cp(args or NS(), pg_loss=local, **inputs)
            assert returned is local, "pg_loss must come back as it went in"
            for m_out, m_in in zip(masks, inputs["loss_masks"]):
                assert m_out.dtype == m_in.dtype and torch.equal(m_out, m_in)
        else:
            returned, masks, metrics = local, inputs["loss_masks"], {}
        loss, reduced = consume(returned, masks, metrics, inputs["loss_masks"], idx)
        loss.backward()
        out[name] = (loss.detach(), [p.grad for p in pg], {k: v.detach() for k, v in reduced.items()})
    return out


def cp_worker(rank: int, world: int):
    """This rank's results under megatron's context-parallel group of ``world`` ranks."""
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(context_parallel_size=world, distributed_timeout_minutes=1)
    try:
        return _run(make_samples(3), world, ps.get_context_parallel_rank())
    finally:
        ps.destroy_model_parallel()


def _reference_metrics(samples):
    train, rollout, masks = ([s[k] for s in samples] for k in ("train", "rollout", "mask"))
    _, _, metrics = mis_reference({}, train, rollout, masks)
    _, red = consume(torch.zeros(sum(s["R"] for s in samples), dtype=torch.float64), masks,
                     {"mis_" + k: torch.cat(v) for k, v in metrics.items()}, masks,
                     [torch.arange(s["R"]) for s in samples])
    return red


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(cp_worker, 2, timeout=300)


def test_loss_and_gradient_are_bit_identical_to_no_tis_function():
    out = _run(make_samples(3), 1, 0)
    (loss_w, grad_w, _), (loss_o, grad_o, _) = out["with"], out["without"]
    assert torch.equal(loss_w, loss_o)
    assert all(torch.equal(a, b) for a, b in zip(grad_w, grad_o))


def test_metrics_are_slimes_mismatch_set_with_the_examples_values():
    samples = make_samples(3)
    metrics = _run(samples, 1, 0)["with"][2]
    assert set(metrics) == {"mis_" + k for k in MISMATCH_METRICS}
    want = _reference_metrics(samples)
    for k, v in want.items():
        assert float(metrics[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k


def test_context_parallel_ranks_add_up_to_the_single_process_metrics(cp2):
    samples = make_samples(3)
    single = _run(samples, 1, 0)["with"][2]
    for rank in cp2:
        assert torch.equal(rank["with"][0], rank["without"][0])
        assert all(torch.equal(a, b) for a, b in zip(rank["with"][1], rank["without"][1]))
    for k, v in single.items():
        total = sum(float(rank["with"][2][k]) for rank in cp2)
        assert total == pytest.approx(float(v), rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("attr,value", [("use_tis", True), ("use_rs", True),
                                        ("rollout_correction_preset", "bypass_pg_is")])
def test_a_correcting_setting_is_refused_not_ignored(attr, value):
    samples = make_samples(3)
    idx, inputs = rank_inputs(samples, 1, 0)
    pg = torch.zeros(sum(len(i) for i in idx))
    with pytest.raises(ValueError, match=f"args.{attr}=.*custom_tis.mis"):
        compute_metrics_only_with_cp(NS(**{attr: value}), pg_loss=pg, **inputs)


def test_the_list_form_returns_no_weights_and_the_masks():
    samples = make_samples(3)
    _, inputs = rank_inputs(samples, 1, 0)
    weights, masks, metrics = compute_metrics_only(NS(), train_log_probs=inputs["train_log_probs"],
                                                   rollout_log_probs=inputs["rollout_log_probs"],
                                                   loss_masks=inputs["loss_masks"])
    assert weights is None
    assert all(torch.equal(a, b) for a, b in zip(masks, inputs["loss_masks"]))
    assert set(metrics) == set(MISMATCH_METRICS)
