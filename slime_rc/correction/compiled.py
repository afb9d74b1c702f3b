"""The engine's stages 1-5 (``stages.correction_stages``) under ``torch.compile``: opt-in.

Eager, each of the engine's ~300 ops is dispatched from Python, and each elementwise op and reduction of stage 1
reads and writes ``[N]`` buffers (memory-bound on a large batch, dispatch-bound on a micro-batch); compiled, dynamo
traces the whole call into one graph and inductor fuses the token quantities into the reductions that consume
them, so the inputs are read a few times, only the token keep flags and IS weights are written, and the O(B) part
runs as a few C++ loops.  The same Python runs either way (the config's branches are resolved while tracing); a few
helpers take a compiler-friendly form while tracing (``packed.tracing()``).  Under a distributed reducer the graph
breaks at its two collectives (``reducer.DistributedReducer``: they run eagerly between the graphs).

Numbers: the same as eager but for summation order, except that the per-sequence counts (exact either way) and
``sum log pi_rollout`` are summed in float32 within 64-token blocks, then in float64: a same-sign sum that no metric
subtracts from another, so its relative error stays below 1e-6 (a few float32 roundings per block).
``sum log r``, the token weights' and k2/k3 sums (whose per-sequence means have standard deviations over sequences
among the metrics) and every token total are float64, as eager.

One compiled function per config (dynamic shapes: any ``N`` and ``B`` reuse its graph; one sequence, ``B = 1``,
compiles a second).  Eager instead: below :data:`MIN_TOKENS` tokens; with ``TORCHDYNAMO_DISABLE=1`` (torch.compile
is then a no-op: a warning says so); under an active ``TorchDispatchMode``; after compiling failed on the device
(no C++ compiler, an unsupported backend: warned once).  Opt-in: ``compute_rollout_correction(..., compiled=True)``
or ``SLIME_RC_COMPILE=1``.
"""

from __future__ import annotations

import hashlib
import os
import types
import warnings
from typing import Callable, Dict, Optional, Set

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.reducer import LocalReducer
from slime_rc.correction.stages import StageOutputs, correction_stages

ENV = "SLIME_RC_COMPILE"
# Below this many tokens a call runs eagerly: every config would compile a graph for each of inductor's size
# classes (its C++ reductions change form at 4096 elements; an empty batch would not compile at all).  At 10k
# tokens the compiled call is already 2-3x faster than eager (a micro-batch is dispatch-bound).
MIN_TOKENS = 1 << 13
_STAGES: Dict[RolloutCorrectionConfig, Callable] = {}
_FAILED: Dict[str, str] = {}  # device type -> why compiling failed there (warned once; eager there since)
_SAID: Set[str] = set()  # the other reasons to run eagerly that were warned about (once each)


def use_compiled(requested: Optional[bool]) -> bool:
    """``requested`` if given, else the environment variable ``SLIME_RC_COMPILE`` (``1``: on; unset, empty or
    ``0``: off; anything else raises, naming it)."""
    if requested is not None:
        return bool(requested)
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: set it to 1 to compile the rollout correction, or 0 (or unset) to run "
                         f"it eagerly")
    return value == "1"


def _stages_of(config: RolloutCorrectionConfig) -> Callable:
    def stages(train, rollout, mask, cu_seqlens, reducer):
        return correction_stages(train, rollout, mask, cu_seqlens, config, reducer)
    # a code object of its own for each config: dynamo keeps at most torch._dynamo.config.recompile_limit (8) graphs
    # per code object and then runs it eagerly without a word; the configs' closures would share this one (more than
    # 8 configs in a process: the analysis tools, a test suite).  Named after the config's content: dynamo's
    # automatic-dynamic profile is keyed by (file, line, name) -- across processes too where a
    # torch.compiler.config.job_id is set (its PGO cache) -- and two configs under one name made the values that
    # differ between them symbolic: graph inputs, and on CUDA constant tables built on the host and copied to the
    # device each call (a stream sync; seen on an H200, torch 2.11)
    digest = hashlib.sha1(repr(config).encode()).hexdigest()[:16]
    code = stages.__code__.replace(co_name=f"correction_stages_{digest}")
    own = types.FunctionType(code, stages.__globals__, code.co_name, None, stages.__closure__)
    # No guards on module globals: what the stages read there is constant (functions, the METRICS table, the records'
    # field lists, all registered at import); ~1,000 guards cost ~70 us a call at 10k tokens, a sixth of the call.
    # No bounds check per indirect load (inductor's TORCH_CHECK on every vector of gathered indices: ~10% of the call
    # at 560k tokens): every index is in range by construction -- sequence ids from the clamped, non-decreasing
    # cu_seqlens (packed.packed_inputs), histogram bins clamped into the grid (quantiles.bin_index), quantile
    # positions clamped, the metric plan's positions -- and the tests compare every gather with the eager engine's.
    options = {"assert_indirect_indexing": False}
    skip_globals = getattr(torch.compiler, "skip_guard_on_globals_unsafe", None)  # (not in every torch >= 2.11)
    if skip_globals is not None:
        options["guard_filter_fn"] = skip_globals
    return torch.compile(own, dynamic=None, options=options)


def _runs_eagerly(device: str, n_tokens: int) -> bool:
    """Whether this call runs eagerly although compiling was asked for (module docstring)."""
    if n_tokens < MIN_TOKENS:
        return True
    if os.environ.get("TORCHDYNAMO_DISABLE", "").strip() == "1":  # torch.compile would be a silent no-op
        if "TORCHDYNAMO_DISABLE" not in _SAID:
            _SAID.add("TORCHDYNAMO_DISABLE")
            warnings.warn(f"rollout correction: asked to compile ({ENV}=1 or compiled=True) but "
                          f"TORCHDYNAMO_DISABLE=1 turns torch.compile off; running it eagerly (unset "
                          f"TORCHDYNAMO_DISABLE to compile it)", RuntimeWarning, stacklevel=4)
        return True
    # Under a TorchDispatchMode (an op counter such as slime_rc.testing.host_reads, a flop counter) eagerly: a
    # compiled function called once under one runs at eager speed ever after (torch 2.13, measured: 8.7 -> 27 ms
    # at 560k tokens), and the mode sees the ops it counts.
    return _get_current_dispatch_mode() is not None or device in _FAILED


def compiled_stages(config: RolloutCorrectionConfig, train: torch.Tensor, rollout: torch.Tensor,
                    mask: torch.Tensor, cu_seqlens: torch.Tensor, reducer: LocalReducer) -> StageOutputs:
    """``stages.correction_stages``, compiled (eagerly where it cannot or should not be: module docstring)."""
    device = train.device.type
    if not _runs_eagerly(device, train.numel()):
        fn = _STAGES.get(config)
        if fn is None:
            if len(_STAGES) >= 16:
                _STAGES.clear()
            fn = _STAGES[config] = _stages_of(config)
        try:
            # the token and sequence counts dynamic, nothing else: with dynamic=True torch 2.15 also made the config's
            # ints symbolic (the histogram's bins per octave), and inductor then failed on the histogram's size
            # (on views: the caller's tensors keep no mark)
            inputs = [t.detach() for t in (train, rollout, mask, cu_seqlens)]
            for t in inputs:
                torch._dynamo.maybe_mark_dynamic(t, 0)
            return fn(*inputs, reducer)
        # a compiler's failure only: an error of the computation itself (a collective's) propagates, rather than
        # run the collectives a second time eagerly
        except torch._dynamo.exc.TorchDynamoException as exc:
            _FAILED[device] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"rollout correction: torch.compile failed on {device} ({_FAILED[device][:300]}); "
                          f"running it eagerly", RuntimeWarning, stacklevel=3)
    return correction_stages(train, rollout, mask, cu_seqlens, config, reducer)
