"""The engine's two passes over the tokens under ``torch.compile``: stage 1 reduced (``reductions.token_reductions``)
and stage 4 (``weights.keep_and_weights``).

Eager, each of stage 1's ~60 elementwise ops and reductions reads and writes ``[N]`` buffers (memory-bound on a
large batch); compiled, inductor fuses the token quantities into the reductions that consume them, so the inputs
are read a few times and only the token keep flags and IS weights are written.  The same Python runs either way
(the config's branches are resolved while tracing); a few helpers take a compiler-friendly form while tracing
(``packed.tracing()``).  Numbers: the same as eager but for summation order, except that the per-sequence counts
(exact either way) and ``sum log pi_rollout`` are summed in float32 within 64-token blocks, then in float64: a
same-sign sum that no metric subtracts from another, so its relative error stays below 1e-6 (a few float32
roundings per block).  ``sum log r``, the token weights' and k2/k3 sums (whose per-sequence means have standard
deviations over sequences among the metrics) and every token total are float64, as eager.

One compiled function per config for stage 1, one for stage 4 (dynamic shapes: any ``N`` and ``B`` reuse them);
below :data:`MIN_TOKENS` (65,536) tokens a call runs eagerly (no gain there; an empty batch would not compile); if
compiling fails (no C++ compiler, an unsupported backend) the engine warns once and runs eagerly; under an active
``TorchDispatchMode``, and with ``TORCHDYNAMO_DISABLE=1`` (torch.compile is then a no-op: a warning says so), it
runs eagerly too.  Opt-in:
``compute_rollout_correction(..., compile_token_pass=True)`` or ``SLIME_RC_COMPILE=1``.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Callable, Dict, Optional, Set

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from slime_rc.config.schema import RolloutCorrectionConfig
from slime_rc.correction.records import PackedBatch, TokenReductions
from slime_rc.correction.reductions import token_reductions
from slime_rc.correction.weights import keep_and_weights

ENV = "SLIME_RC_COMPILE"
# Below this many tokens a call runs eagerly: there the O(B) part and the dispatch cost of ~300 ops are the call
# (measured: no gain at 10k tokens), and every config then compiles one graph, for one size class (inductor's C++
# reductions change form at 4096 elements; an empty batch would not compile at all).  The eager path's own switch
# from its small-batch matrix to block sums is at the same size (packed.MATRIX_TOKENS).
MIN_TOKENS = 1 << 16
_REDUCTIONS: Dict[RolloutCorrectionConfig, Callable] = {}
_KEEP_AND_WEIGHTS: Dict[str, Callable] = {}
_FAILED: Dict[str, str] = {}  # device type -> why compiling failed there (warned once; eager there since)
_SAID: Set[str] = set()  # the other reasons to run eagerly that were warned about (once each)


def use_compiled(requested: Optional[bool]) -> bool:
    """``requested`` if given, else the environment variable ``SLIME_RC_COMPILE`` (``1``: on; unset, empty or
    ``0``: off; anything else raises, naming it)."""
    if requested is not None:
        return bool(requested)
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: set it to 1 to compile the correction's token passes, or 0 (or unset) "
                         f"to run them eagerly")
    return value == "1"


def _reductions_of(config: RolloutCorrectionConfig) -> Callable:
    def reductions(train, rollout, mask, cu_seqlens, lengths, sequence_ids):
        return token_reductions(PackedBatch(train, rollout, mask, cu_seqlens, lengths, sequence_ids), config)
    # a code object of its own for each config: dynamo keeps at most torch._dynamo.config.recompile_limit (8) graphs
    # per code object and then runs it eagerly without a word; the configs' closures would share this one (more than
    # 8 configs in a process: the analysis tools, a test suite)
    code = reductions.__code__.replace(co_name=f"token_reductions_{len(_REDUCTIONS)}")
    own = types.FunctionType(code, reductions.__globals__, code.co_name, None, reductions.__closure__)
    return torch.compile(own, dynamic=True)


def _run(device: str, n_tokens: int, compiled: Callable, eager: Callable, *args):
    """``compiled(*args)``, or ``eager(*args)`` where the compiled form cannot or should not run (module docstring)."""
    if n_tokens < MIN_TOKENS:
        return eager(*args)
    if os.environ.get("TORCHDYNAMO_DISABLE", "").strip() == "1":  # torch.compile would be a silent no-op
        if "TORCHDYNAMO_DISABLE" not in _SAID:
            _SAID.add("TORCHDYNAMO_DISABLE")
            warnings.warn(f"rollout correction: the token passes were asked to compile ({ENV}=1 or "
                          f"compile_token_pass=True) but TORCHDYNAMO_DISABLE=1 turns torch.compile off; running them "
                          f"eagerly (unset TORCHDYNAMO_DISABLE to compile them)", RuntimeWarning, stacklevel=3)
        return eager(*args)
    # Under a TorchDispatchMode (an op counter such as slime_rc.testing.host_reads, a flop counter) eagerly: a
    # compiled function called once under one runs at eager speed ever after (torch 2.13, measured: 8.7 -> 27 ms
    # at 560k tokens), and the mode sees the ops it counts.
    if device not in _FAILED and _get_current_dispatch_mode() is None:
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 -- any compiler failure: the eager path computes the same
            _FAILED[device] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"rollout correction: torch.compile of the token passes failed on {device} "
                          f"({_FAILED[device][:300]}); running them eagerly", RuntimeWarning, stacklevel=3)
    return eager(*args)


def compiled_token_reductions(batch: PackedBatch, config: RolloutCorrectionConfig) -> TokenReductions:
    """:func:`reductions.token_reductions`, compiled (eager where compiling is not possible)."""
    fn = _REDUCTIONS.get(config)
    if fn is None:
        if len(_REDUCTIONS) >= 16:
            _REDUCTIONS.clear()
        fn = _REDUCTIONS[config] = _reductions_of(config)
    return _run(batch.device.type, batch.n_tokens, fn, lambda *a: token_reductions(PackedBatch(*a), config),
                batch.train, batch.rollout, batch.mask, batch.cu_seqlens, batch.lengths, batch.sequence_ids)


def compiled_keep_and_weights(*args):
    """:func:`weights.keep_and_weights`, compiled (eager where compiling is not possible)."""
    fn = _KEEP_AND_WEIGHTS.get("fn")
    if fn is None:
        fn = _KEEP_AND_WEIGHTS["fn"] = torch.compile(keep_and_weights, dynamic=True)
    return _run(args[0].device.type, args[0].numel(), fn, keep_and_weights, *args)
