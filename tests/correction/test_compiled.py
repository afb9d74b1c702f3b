"""The compiled engine (``slime_rc.correction.compiled``, opt-in) against the eager engine.

``compiled=True`` runs stages 1-5 through ``torch.compile`` (inductor's C++ backend on the CPU) for batches of
``compiled.MIN_TOKENS`` (8,192) tokens and more, eagerly below.  Each test compiles for real (~15-45 s per config
here), so the grid is a few configs that together take every branch of the engine:
token/sequence/geometric IS in truncate/clip/mask mode, token and sequence RS on k1/k2/k3 with sum/mean/max, veto,
batch normalization, ``on_nonfinite`` both ways, metrics only.  Each config runs on four batches: a micro-batch
(eager either way: nothing compiles), then three past the threshold that share one compiled graph (dynamic shapes),
with an empty and a fully masked sequence, ``N % 64 == 0``, and more samples.  Plus: a 2-rank gloo
context-parallel split against the single-process eager result, graph breaks and host reads, the error messages,
the eager fallback when compiling fails or dynamo is off, and the environment variable.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import replace

import pytest
import torch

from slime_rc import RolloutCorrectionConfig, compute_rollout_correction, cu_seqlens_from_lengths, \
    parse_rejection_criteria
from slime_rc.correction import compiled
from slime_rc.correction.reducer import LocalReducer
from slime_rc.testing.host_reads import HostReads

from tests.dist_utils import run_distributed

RS = parse_rejection_criteria
CONFIGS = {
    "token_truncate_rs_veto_norm": RolloutCorrectionConfig(
        is_level="token", is_upper_bound=2.0, is_batch_normalize=True, rs=RS("token", 2.0), veto_threshold=1e-4),
    "sequence_clip_max_k2_veto_reject": RolloutCorrectionConfig(
        is_level="sequence", is_mode="clip", is_upper_bound=3.0, rs=RS("seq_max_k2", 0.05), veto_threshold=1e-4,
        on_nonfinite="reject"),
    "geometric_mask_mean_k3_token_k1_norm": RolloutCorrectionConfig(
        is_level="geometric", is_mode="mask", is_upper_bound=1.5, is_batch_normalize=True,
        rs=RS("seq_mean_k3,token_k1", "0.01,0.85_1.1")),
    "token_mask_token_k2_reject": RolloutCorrectionConfig(
        is_level="token", is_mode="mask", is_upper_bound=1.3, rs=RS("token_k2", 0.5), on_nonfinite="reject"),
    "rs_only_seq_sum_k1_token_k3_seq_mean_k1": RolloutCorrectionConfig(
        rs=RS("seq_sum_k1,token_k3,seq_mean_k1", "0.5_2.0,0.5,0.7_1.4")),
    "metrics_only": RolloutCorrectionConfig(get_mismatch_metrics=True),
}


def _batch(lengths, seed=0, nan=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    rollout = -torch.rand(n, generator=g) * 3
    train = rollout + 0.15 * torch.randn(n, generator=g)
    train[:: 997] -= 12.0  # catastrophic tokens (veto)
    mask = (torch.rand(n, generator=g) > 0.1).float()
    cu = cu_seqlens_from_lengths(lengths)
    if len(lengths) > 3:  # sequence 2 fully masked, sequence 3 empty (length 0 in `lengths`)
        mask[int(cu[2]):int(cu[3])] = 0.0
    if nan:
        mask[5] = 1.0
        train[5] = float("nan")
    return train, rollout, mask, cu


BATCHES = {  # the first below compiled.MIN_TOKENS (eager in either mode), the rest past it (compiled)
    "micro": [37, 120, 64, 0, 500, 1, 2000, 311],  # an empty sequence (3) and a fully masked one (2)
    "large": [30_000, 41_000, 500, 0, 7],  # a fully masked sequence (2), an empty one (3), one of 7 tokens
    "whole_blocks": [64 * 600, 64 * 500],  # N % 64 == 0
    "more_samples": [1700] * 40 + [3],  # another N and B: the same graphs
}
LARGE = "large"


def _compare(eager, fast, where):
    assert torch.equal(eager.keep_mask, fast.keep_mask), where
    if eager.is_weights is None:
        assert fast.is_weights is None, where
    else:
        torch.testing.assert_close(fast.is_weights, eager.is_weights, rtol=1e-6, atol=1e-7, msg=where)
    assert list(eager.metrics) == list(fast.metrics), where
    for name in eager.metrics:
        e, f = float(eager.metrics[name]), float(fast.metrics[name])
        # k2/k3 (r - 1 - log r, (log r)^2 / 2) are ~1e-3 of r: float32 cancellation leaves them ~1e-4 relative
        # precision a token, and inductor's exp differs from ATen's by an ulp -- their statistics agree to 1e-5
        rel = 1e-5 if ("_k2" in name or "_k3" in name or name == "k3_kl") else 1e-6
        assert math.isclose(e, f, rel_tol=rel, abs_tol=1e-9), (where, name, e, f)
    assert list(eager.sequences) == list(fast.sequences), where
    for name in eager.sequences:
        torch.testing.assert_close(fast.sequences[name], eager.sequences[name], rtol=1e-6, atol=1e-9,
                                   msg=f"{where}: sequences[{name!r}]")


def _graphs() -> int:
    import torch._dynamo.utils
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def dynamo_enabled():
    """tests/conftest.py turns dynamo off for the session (TORCHDYNAMO_DISABLE=1: torch.compile is then a no-op);
    on inside, with the compiled functions made afresh (one made while it was off would stay eager)."""
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "0"
    compiled._STAGES.clear()
    try:
        yield compiled
    finally:
        compiled._STAGES.clear()
        if saved is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved


@pytest.fixture(autouse=True, scope="module")
def dynamo_on():
    """Dynamo on for this module (:func:`dynamo_enabled`)."""
    with dynamo_enabled():
        yield


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_equals_eager_on_every_batch_with_one_graph(name):
    """Below compiled.MIN_TOKENS eagerly, past it compiled once, into one graph without a break: then any N and B
    (B > 1) reuse the graph.  A graph runs without Python, so a host read could only come from a graph break (dynamo
    breaks the graph at ``.item()``, a data-dependent shape, ``.tolist()``); what runs around it (the metadata checks,
    the deferred check) is what tests/correction/test_host_reads.py counts: 0 reads with ``'reject'``, 1 with
    ``'error'`` -- and so does HostReads here (under a dispatch mode the engine runs eagerly: compiled.py)."""
    import torch._dynamo.utils

    config = CONFIGS[name]
    nan = config.on_nonfinite == "reject"
    graphs, breaks = _graphs(), sum(torch._dynamo.utils.counters["graph_break"].values())
    for i, (label, lengths) in enumerate(BATCHES.items()):
        batch = _batch(lengths, seed=i, nan=nan)
        assert (batch[0].numel() >= compiled.MIN_TOKENS) == (i > 0), label
        eager = compute_rollout_correction(*batch, config, compiled=False)
        fast = compute_rollout_correction(*batch, config, compiled=True)
        assert not compiled._FAILED, compiled._FAILED
        _compare(eager, fast, f"{name} on {label}")
        if i == 0:
            assert _graphs() == graphs, f"{name}: {label} is below compiled.MIN_TOKENS, yet something compiled"
        elif i == 1:
            assert _graphs() == graphs + 1, f"{name}: {_graphs() - graphs} graphs compiled rather than one"
            graphs = _graphs()
        else:
            assert _graphs() == graphs, f"{name}: {label} compiled again (dynamic shapes should reuse the graph)"
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks, \
        dict(torch._dynamo.utils.counters["graph_break"])
    with HostReads() as reads:
        compute_rollout_correction(*batch, config, compiled=True)
    assert reads.count == (1 if config.on_nonfinite == "error" else 0), reads.report()


def test_configs_called_in_turn_keep_their_graphs():
    """A graph is never invalidated by another config's call: nothing in it guards on the engine's process-wide caches
    (the eager metric plans and positions fill them; a graph that read them recompiled on the next call, and on
    every call that followed another config's)."""
    names = ["token_truncate_rs_veto_norm", "metrics_only"]
    batch = _batch(BATCHES[LARGE])
    for name in names:
        compute_rollout_correction(*batch, CONFIGS[name], compiled=True)
    graphs = _graphs()
    for name in names * 2:
        eager = compute_rollout_correction(*batch, CONFIGS[name], compiled=False)  # fills the eager caches
        _compare(eager, compute_rollout_correction(*batch, CONFIGS[name], compiled=True), f"{name} in turn")
    assert _graphs() == graphs, _graphs() - graphs


def test_a_config_compiled_after_another_keeps_its_values_constant(monkeypatch):
    """Two configs compiled one after the other (the cache emptied between them, as when it fills up) each get a
    graph whose only inputs are the batch's tensors and sizes: no config value is made symbolic.  Dynamo's
    automatic-dynamic profile is keyed by the function's file, line and name (across processes too where a
    ``torch.compiler.config.job_id`` is set); when both configs' functions shared a name, the values that differ
    between them became graph inputs, and on CUDA the tables built from them were made on the host and copied to the
    device on every call, a stream sync (seen on an H200 with torch 2.11).  The graphs are captured
    with the aot_eager backend (no inductor: the inputs and the constants are what is asserted)."""
    from torch._dynamo.backends.common import aot_autograd
    graphs = []
    original = torch.compile
    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: graphs.append(gm) or gm)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: original(fn, backend=backend, dynamic=kw.get("dynamic")))
    batch = _batch(BATCHES[LARGE])
    for config in (CONFIGS["token_truncate_rs_veto_norm"], CONFIGS["sequence_clip_max_k2_veto_reject"]):
        compiled._STAGES.clear()
        _compare(compute_rollout_correction(*batch, config, compiled=False),
                 compute_rollout_correction(*batch, config, compiled=True), repr(config))
    compiled._STAGES.clear()
    assert len(graphs) == 2
    for gm in graphs:
        inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        tensors = [v for v in inputs if isinstance(v, torch.Tensor)]
        assert len(tensors) == 4 and all(v.dim() == 1 for v in tensors), inputs  # train, rollout, mask, cu_seqlens
        assert all(isinstance(v, torch.SymInt) for v in inputs if not isinstance(v, torch.Tensor)), inputs
        # no table stacked from scalars at run time (what made the host -> device copy): constants only
        constant = {n for n in gm.graph.nodes if n.op == "get_attr"}
        for n in gm.graph.nodes:
            if n.op == "call_function" and all(a in constant for a in n.all_input_nodes):
                constant.add(n)
                assert "stack" not in str(n.target), (n.name, n.meta.get("stack_trace"))


def test_a_single_sequence_compiles_a_graph_of_its_own():
    """Dynamic shapes specialize a size of 1: ``B = 1`` compiles a second graph (once), equal to eager too."""
    config = CONFIGS["metrics_only"]
    compute_rollout_correction(*_batch(BATCHES[LARGE]), config, compiled=True)
    graphs = _graphs()
    for seed, n in enumerate((20_000, 33_333)):
        batch = _batch([n], seed=seed)
        _compare(compute_rollout_correction(*batch, config, compiled=False),
                 compute_rollout_correction(*batch, config, compiled=True), f"one sequence of {n}")
    assert _graphs() == graphs + 1, _graphs() - graphs


def test_standard_deviations_over_sequences_of_nearly_equal_means():
    """Two long sequences whose mean token weights (and k3) agree to ~1e-3: their standard deviation over sequences
    is a difference of two sums that share ~99.9% of their value, so the sums behind it must be float64 even when
    compiled (float32 blocks moved ``rollout_is_seq_std`` by up to 7e-5 of itself)."""
    config = RolloutCorrectionConfig(is_level="token", is_upper_bound=2.0, rs=RS("token_k3", 0.5))
    for seed in range(3):
        batch = _batch([60_000, 10_000], seed=seed)
        eager = compute_rollout_correction(*batch, config, compiled=False)
        fast = compute_rollout_correction(*batch, config, compiled=True)
        assert float(eager.metrics["rollout_is_seq_std"]) < 1e-2  # nearly equal means indeed
        _compare(eager, fast, f"two long sequences, seed {seed}")


def test_the_environment_variable_switches_it_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.delenv(compiled.ENV, raising=False)
    assert compiled.use_compiled(None) is False
    assert compiled.use_compiled(True) is True
    for value, on in (("1", True), ("0", False), ("", False), (" 1 ", True)):
        monkeypatch.setenv(compiled.ENV, value)
        assert compiled.use_compiled(None) is on
        assert compiled.use_compiled(False) is False  # an explicit argument wins
    monkeypatch.setenv(compiled.ENV, "yes")
    with pytest.raises(ValueError, match=r"SLIME_RC_COMPILE='yes': set it to 1 .* or 0"):
        compute_rollout_correction(*_batch([5, 6]), CONFIGS["metrics_only"])


def test_a_dispatch_mode_does_not_slow_the_compiled_engine_down_afterwards():
    """torch 2.13: a compiled function called once under a TorchDispatchMode runs at eager speed ever after; the
    engine runs eagerly under a mode, so the compiled graph is still the one that runs after it."""
    import torch._dynamo.utils

    config = CONFIGS["token_truncate_rs_veto_norm"]
    batch = _batch(BATCHES[LARGE])
    compute_rollout_correction(*batch, config, compiled=True)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    with HostReads():
        compute_rollout_correction(*batch, config, compiled=True)
    # the compiled graph still runs: inductor's C++ kernel is called (counted by the profiler as a compiled graph)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compute_rollout_correction(*batch, config, compiled=True)
    names = [e.key for e in prof.key_averages()]
    assert any("CompiledFxGraph" in n or "Torch-Compiled Region" in n for n in names), names[:20]
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks


def test_compiled_errors_name_sample_and_position():
    train, rollout, mask, cu = _batch(BATCHES[LARGE])
    mask[:] = 1.0
    k = int(cu[4]) + 3
    train[k] = float("nan")
    with pytest.raises(ValueError, match=rf"train_log_probs is nan at sample 4, position 3 \(packed index {k}\)"):
        compute_rollout_correction(train, rollout, mask, cu, CONFIGS["token_truncate_rs_veto_norm"],
                                   compiled=True)


def test_a_failing_compiler_warns_once_and_runs_eagerly(monkeypatch):
    """A machine without a working C++ compiler (inductor's real failure, not a stand-in): warned once, eager since;
    the numbers are the eager engine's."""
    import torch._inductor.config

    monkeypatch.setattr(compiled, "_STAGES", {})
    monkeypatch.setattr(compiled, "_FAILED", {})
    # a config of its own: none of its kernels is in inductor's cache, so the compiler must run
    config = replace(CONFIGS["geometric_mask_mean_k3_token_k1_norm"], is_upper_bound=1.75)
    batch = _batch(BATCHES[LARGE])
    failed = r"torch.compile failed on cpu \(InductorError: .*No working C\+\+ compiler"
    # inductor's own patch (monkeypatch's undo deletes the setting on torch 2.15, whose config class does not hold it)
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}), \
            pytest.warns(RuntimeWarning, match=failed):
        fast = compute_rollout_correction(*batch, config, compiled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the next call runs eagerly without a word
        again = compute_rollout_correction(*batch, config, compiled=True)
    eager = compute_rollout_correction(*batch, config, compiled=False)
    _compare(eager, fast, "fallback")
    _compare(eager, again, "fallback, second call")


def test_an_error_of_the_computation_is_not_taken_for_a_compiler_failure(monkeypatch):
    """Only a compiler's failure sends the call to the eager engine: any other exception (a collective's, under a
    distributed reducer) propagates, rather than run the collectives a second time."""
    class Failing(LocalReducer):
        def combine_sequences(self, sums, maxes):
            raise RuntimeError("peer gone")

    monkeypatch.setattr(compiled, "_FAILED", {})
    with pytest.raises(RuntimeError, match="peer gone"):
        compute_rollout_correction(*_batch(BATCHES[LARGE]), CONFIGS["metrics_only"], reducer=Failing(),
                                   compiled=True)
    assert not compiled._FAILED, compiled._FAILED


def test_dynamo_turned_off_is_said_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(compiled, "_SAID", set())
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    batch = _batch(BATCHES[LARGE])
    config = CONFIGS["token_truncate_rs_veto_norm"]
    with pytest.warns(RuntimeWarning, match=r"TORCHDYNAMO_DISABLE=1 turns torch.compile off; running it eagerly"):
        fast = compute_rollout_correction(*batch, config, compiled=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_rollout_correction(*batch, config, compiled=True)
    _compare(compute_rollout_correction(*batch, config, compiled=False), fast, "dynamo off")


def _cp_rank(rank, world, names, lengths):
    """Context parallelism over 2 gloo ranks, compiled, for each named config in turn: each rank holds alternate
    halves of every sequence."""
    import os

    import torch.distributed as dist
    from slime_rc.correction.reducer import DistributedReducer

    os.environ["TORCHDYNAMO_DISABLE"] = "0"  # tests.dist_utils turns dynamo off in its children
    out = {}
    for name in names:
        config = CONFIGS[name]
        train, rollout, mask, cu = _batch(lengths, nan=config.on_nonfinite == "reject")
        pieces, mine = [], []
        for i in range(len(lengths)):
            idx = torch.arange(int(cu[i]), int(cu[i + 1]))
            half = idx.numel() // 2
            own = idx[:half] if rank == 0 else idx[half:]
            mine.append(own)
            pieces.append(own.numel())
        own = torch.cat(mine)
        graphs = _graphs()
        res = compute_rollout_correction(train[own], rollout[own], mask[own], cu_seqlens_from_lengths(pieces),
                                         config, reducer=DistributedReducer(sequence_group=dist.group.WORLD),
                                         compiled=True)
        out[name] = {"own": own, "keep": res.keep_mask, "weights": res.is_weights,
                     "metrics": {k: float(v) for k, v in res.metrics.items()}, "sequences": res.sequences,
                     "failed": dict(compiled._FAILED), "graphs": _graphs() - graphs}
    return out


CP_LENGTHS = [40_000, 50_000, 45_000, 0, 7, 300]  # > 2 x compiled.MIN_TOKENS: each of 2 ranks compiles
CP_CONFIGS = ["token_truncate_rs_veto_norm", "sequence_clip_max_k2_veto_reject"]


@pytest.fixture(scope="module")
def cp_runs():
    """Both configs in one 2-process spawn (a spawn costs each process its imports)."""
    return run_distributed(_cp_rank, 2, args=(CP_CONFIGS, CP_LENGTHS), timeout=300)


@pytest.mark.parametrize("name", CP_CONFIGS)
def test_compiled_under_context_parallelism_equals_one_process(name, cp_runs):
    config, lengths = CONFIGS[name], CP_LENGTHS
    results = [per_rank[name] for per_rank in cp_runs]
    batch = _batch(lengths, nan=config.on_nonfinite == "reject")
    eager = compute_rollout_correction(*batch, config, compiled=False)
    for rank, r in enumerate(results):
        assert not r["failed"], r["failed"]
        # it compiled rather than ran eagerly: graphs around the two collectives (the reducer's methods break it)
        assert r["graphs"] >= 3, r["graphs"]
        where = f"{name}, CP rank {rank}"
        assert torch.equal(r["keep"], eager.keep_mask[r["own"]]), where
        if eager.is_weights is not None:
            torch.testing.assert_close(r["weights"], eager.is_weights[r["own"]], rtol=1e-6, atol=1e-7, msg=where)
        for k, v in eager.metrics.items():
            assert math.isclose(r["metrics"][k], float(v), rel_tol=1e-6, abs_tol=1e-9), (where, k)
        for k, v in eager.sequences.items():
            torch.testing.assert_close(r["sequences"][k], v, rtol=1e-6, atol=1e-9, msg=f"{where}: {k}")
