"""slime-rc's custom loss against slime's REAL loss: one packed micro-batch at a slime user's scale, forward + backward.

Usage::

    # slime's source (nothing of slime is shipped here; any checkout works, 624b824a8 was the one measured):
    git clone https://github.com/THUDM/slime.git /tmp/slime-src
    python benchmarks/bench_slime_loss.py --slime-src /tmp/slime-src                       # CPU, T = 2048
    python benchmarks/bench_slime_loss.py --slime-src /tmp/slime-src --tokens 4096         # CPU, ~2x the memory
    python benchmarks/bench_slime_loss.py --slime-src /tmp/slime-src --device cuda \\
        --json slime_loss.json                                                              # GPU, T = 8192,32768

Options: ``--tokens`` (comma list; CPU default 2048, CUDA default 8192,32768), ``--vocab`` (151936, Qwen2.5's),
``--samples-per-8k`` (samples per 8192 tokens, 8), ``--repeats`` (timed rounds, CPU 5 / CUDA 10),
``--only`` (comma list of contender numbers), ``--threads``, ``--slime-commit`` (printed where ``--slime-src`` has no
git metadata), ``--glibc-default`` (CPU: see "time ms" below), ``--json PATH``.  CPU memory: the inputs plus ~3
float32 ``[T, V]`` (3.5 GiB at T = 2048; [4096, 151936] float32 alone is 2.3 GiB).

What is driven
--------------
slime's own ``slime.backends.megatron_utils.loss.loss_function(args, batch, num_microbatches=1,
step_global_batch_size=B, logits)`` imported from ``--slime-src`` -- the function slime's actor runs per micro-batch
-- on megatron-core's parallel state initialised for one process (TP = CP = PP = 1; gloo on CPU, NCCL on CUDA).
slime's imports need no Megatron-LM (``megatron.training``) for that; only slime's parser module imports sglang,
so ``sglang``, ``sglang.srt.server_args`` (``ServerArgs``), ``sglang_router`` and
``sglang_router.launch_router`` (``RouterArgs``) are replaced by empty stub modules when they are not installed
(nothing of them is used: slime's sglang arguments are never parsed here).

``args`` are what slime's parser leaves: slime's own flag definitions
(``slime.utils.arguments.get_slime_extra_args_provider()`` on an ``argparse`` parser, ``parse_known_args`` as slime
does), the pre-parsed mode flags (``--debug-train-only``: no sglang), then slime's ``slime_validate_args`` (which sets
``eps_clip_high = eps_clip``, checks the TIS flags and copies the ``--custom-config-path`` YAML keys onto ``args``).
Megatron-LM's own parser and ``validate_args`` are not run (they need ``megatron.training``); slime's loss reads no
flag of theirs except ``--calculate-per-token-loss``, which slime's provider defines.  The two ``mis.yaml``
contenders pass ``--custom-config-path <slime-src>/examples/train_infer_mismatch_helper/mis.yaml``: slime's example
YAML, read by slime's validation at run time, as a user launches it.

The batch (one micro-batch, created once per size, the same for every contender)
--------------------------------------------------------------------------------
``[1, T, V]`` bf16 logits (``N(0, 2)``), the input, a leaf with ``requires_grad``; inside the timed call they are
converted to float32 (``logits.float()``, as Megatron's ``Float16Module`` does) and the gradient flows back into the
bf16 leaf.  ``B = round(T / 8192 * samples_per_8k)`` samples of equal length ``T / B`` (the last takes the
remainder), prompt ``1/8`` of each; per sample (slime's batch keys, device tensors as slime's actor makes them):
``unconcat_tokens`` (random ids), ``total_lengths``, ``response_lengths``, ``loss_masks`` (``torch.int`` ones),
``rollout_mask_sums`` (each sample's own mask sum, a 0-d float32 tensor), ``advantages`` (one ``N(0, 1)`` value per
sample, GRPO-like), ``log_probs`` (pi_old: the model's current log-probs + ``N(0, 0.05)``) and ``rollout_log_probs``
(current + ``N(0, 0.1)``).

Contenders (each on the same batch; flags are slime's)
------------------------------------------------------
 1. slime's own policy loss (GRPO, no TIS): ``--loss-type policy_loss``
 2. slime's own with ``--use-tis`` (slime's ``vanilla_tis_function``)
 3. slime's own + ``--custom-tis-function-path custom_tis.mis.compute_mis_weights_with_cp`` (ours) with slime's
    ``mis.yaml`` and ``--get-mismatch-metrics``
 4. slime's own + slime's example ``examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp`` (from
    ``--slime-src``), the same YAML and flag
 5. ours: ``--loss-type custom_loss --custom-loss-function-path slime_rc.slime.policy_loss_function``, correction off
 6. ours, decoupled token TIS (``--use-tis``: truncate at ``--tis-clip`` 2)
 7. slime's own with ``--log-probs-chunk-size 4096``
 8. slime's own with ``--entropy-coef 0.01``
 9. ours, correction off, ``--entropy-coef 0.01``
10. ours with slime's ``mis.yaml`` (IS + RS + veto + batch norm in our loss: the settings of 3 and 4)
11. ours with ``--log-probs-chunk-size 4096``
12. 5 and 13. 9 with ``SLIME_RC_FUSED_LOGPROBS=0``: on a GPU with Triton, ours uses the fused log-prob kernels
    (``slime_rc/megatron/logprobs_triton.py``); these two keep the eager chunked path.  On the CPU all of ours are
    eager.
14. slime's own + ``--custom-tis-function-path custom_tis.metrics_only.compute_metrics_only_with_cp
    --get-mismatch-metrics`` (monitoring only: must agree with 1 exactly)
(7 and 11 chunk only where T > 4096: at the CPU default they time the unchunked path again.)
And rows timed alone, outside slime's loss, on the inputs slime hands a TIS function (contender 3's ``args``,
``pg_loss`` a float32 leaf with gradient, the batch's lists):
 a. ``custom_tis.mis.compute_mis_weights_with_cp`` (ours) alone;
 b. slime's example ``compute_mis_weights_with_cp`` alone;
 c. slime's handling of the metrics dict ours returns, alone: what ``policy_loss_function`` and ``loss_function`` do
    with it -- slime's per-sample reducer (``get_sum_of_sample_mean`` with the original masks) on each metric, then
    ``torch.tensor([0] + values, device=...)``, which reads every value to the host (one sync per key on a GPU);
 d. the same for slime's ``vanilla_tis_function``'s three metrics (contender 2's).
So contender 3's time over contender 2's splits into a (ours) + c (slime's own reduction and logging of the 23
``mis_*`` metrics) - d + the rest.

Measurements (per contender and size)
-------------------------------------
* ``time ms``: one call = ``logits = leaf.float()``; ``loss_function(...)``; ``loss.backward()``; ``leaf.grad =
  None``; on CUDA bracketed by ``torch.cuda.synchronize()`` (the time until its kernels are done, host reads
  included).  Median of ``--repeats`` rounds after one warm-up call each (plus the untimed calls below); every round
  runs every contender once, in a new (seeded) shuffled order, so that drift and a noisy neighbour affect all alike.
  ``vs slime's own``: the time over contender 1's, within the run.  On CPU the script re-executes itself with
  ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=64GiB`` (unless ``--glibc-default``): glibc then serves every block from
  its heap and keeps what is freed, as a GPU's caching allocator does; with glibc's defaults every ``[T, V]`` buffer
  is a fresh mmap whose pages fault in on first touch (at T = 2048: ~3.5x the time, mostly system time, +-40 %
  between rounds).  CPU times are the CPU path of slime's code (its non-einsum branch, below).
* ``peak above inputs GiB``: the most memory the call holds at once beyond what was allocated before it, with the
  inputs (logits, batch) alive and no gradient held: the float32 copy, every activation saved for backward, the
  gradients (the bf16 leaf's included) and temporaries.  CUDA: ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, minus ``memory_allocated()`` before the call.  CPU: ``torch.profiler`` with
  ``profile_memory=True`` records every allocation and free of torch's CPU allocator (kernels' internal buffers
  included); the peak of their running sum over one call, measured as slime runs on a GPU (``Tensor.is_cuda``
  reading True, see ``[T,V] GB``; the JSON's ``peak_bytes_cpu_branch`` is the CPU path: +1 ``[T, V]`` float32 for
  slime's contenders, its materialised product).  Allocator rounding and caching are not in it.
* ``syncs``: CUDA: the synchronising calls CUDA's own detector reports in one call
  (``torch.cuda.set_sync_debug_mode("warn")``, one warning each; ``bench_correction.stream_syncs``).  CPU: the host
  reads a GPU would wait for, counted by ``slime_rc.testing.host_reads.HostReads`` (``bench_correction.host_syncs``:
  ``.item()``, data-dependent shapes, ``torch.tensor(list)`` on the device...).
* ``[T,V] GB``: bytes read + written by the aten ops of one call on tensors that have a dimension equal to the
  vocabulary (``V / tp``), counted by a ``TorchDispatchMode`` (forward and backward): per op, each such input's and
  output's addressed bytes (broadcast dimensions, stride 0, count once); view ops and ops that read only their
  input's shape (``new_empty``, ``zeros_like``...) count 0; indexing ops (``index``, ``gather``, ``index_put_``,
  ``scatter_add_``...) count only the elements they touch; the destination of ``copy_`` / ``fill_`` / ``zero_`` and
  ``out=`` arguments are written, not read.  A lower bound of what the kernels move (a kernel may read its input
  twice; ``select_backward`` zero-fills before it copies), the same rule for everyone; the JSON has it per op.
  On CPU, slime's ``_VocabParallelLogProbEntropy`` (``slime/utils/ppo_utils.py``) takes a branch its GPU path does not:
  ``if softmax.is_cuda: einsum`` else ``(softmax * logits).sum`` (one more ``[T, V]`` product written and read), so
  on CPU the count runs under a ``TorchFunctionMode`` under which ``Tensor.is_cuda`` reads True (slime's forward
  takes its CUDA branch, computed by the CPU kernels; nothing else in the loss reads ``is_cuda``): the column is
  what slime moves on a GPU; the JSON also has ``tv_bytes_cpu_branch`` (as the CPU runs it, the timed path).  On
  CUDA the count is of the real run.
* ``loss``: the loss ``loss_function`` returns (slime's scaling: ``* num_microbatches / step_global_batch_size * dp``)
  from one untimed call; the agreement section compares it, every log key two contenders share, and the float32
  gradient of 16 response rows of the logits (``||g - g_ref|| / ||g_ref||``) between contenders that compute the same
  thing.

A contender that fails prints its error in its row; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.overrides

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import bench_correction as bench  # noqa: E402  (sync, host_syncs, stream_syncs)

from slime_rc.megatron.logprobs import FUSED_ENV  # noqa: E402
from slime_rc.testing.traffic import VocabTraffic  # noqa: E402

GiB = 1024 ** 3
OURS = ["--loss-type", "custom_loss", "--custom-loss-function-path", "slime_rc.slime.policy_loss_function"]
OUR_TIS = "custom_tis.mis.compute_mis_weights_with_cp"
METRICS_ONLY = "custom_tis.metrics_only.compute_metrics_only_with_cp"
EXAMPLE_TIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
MIS_YAML = os.path.join("examples", "train_infer_mismatch_helper", "mis.yaml")  # inside --slime-src
GRAD_ROWS = 16
# CPU: glibc serves no block with mmap and keeps what is freed (as a GPU's caching allocator does): without it every
# [T, V] buffer is a fresh mmap whose pages fault in on first touch (measured at T = 2048: ~3.5x the time, most of it
# system time, and +-40 % between rounds)
KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 * GiB)}


def contenders(slime_src: str) -> List[dict]:
    """The loss contenders: number, label, slime flags; ``ref``: the contender it must agree with."""
    yaml_path = os.path.join(slime_src, MIS_YAML)
    mis = ["--custom-config-path", yaml_path, "--get-mismatch-metrics"]
    return [
        dict(n=1, label="slime policy_loss (GRPO)", flags=[]),
        dict(n=2, label="slime --use-tis", flags=["--use-tis"]),
        dict(n=3, label="slime + our TIS fn (mis.yaml)", flags=["--custom-tis-function-path", OUR_TIS] + mis),
        dict(n=4, label="slime + example mis.py (mis.yaml)", flags=["--custom-tis-function-path", EXAMPLE_TIS] + mis,
             ref=3),
        dict(n=5, label="ours, correction off", flags=OURS, ref=1),
        dict(n=6, label="ours, token TIS (--use-tis)", flags=OURS + ["--use-tis"], ref=2),
        dict(n=7, label="slime --log-probs-chunk-size 4096", flags=["--log-probs-chunk-size", "4096"], ref=1),
        dict(n=8, label="slime --entropy-coef 0.01", flags=["--entropy-coef", "0.01"]),
        dict(n=9, label="ours, --entropy-coef 0.01", flags=OURS + ["--entropy-coef", "0.01"], ref=8),
        dict(n=10, label="ours, mis.yaml", flags=OURS + ["--custom-config-path", yaml_path], ref=3),
        dict(n=11, label="ours --log-probs-chunk-size 4096", flags=OURS + ["--log-probs-chunk-size", "4096"], ref=1),
        # on a GPU with Triton the contenders above use the fused log-prob kernels; these keep the eager chunks
        dict(n=12, label="ours, correction off, eager log-probs", flags=OURS, ref=1, env={FUSED_ENV: "0"}),
        dict(n=13, label="ours, --entropy-coef 0.01, eager log-probs", flags=OURS + ["--entropy-coef", "0.01"],
             ref=8, env={FUSED_ENV: "0"}),
        # monitoring only: slime's own loss, the mismatch metrics logged, nothing corrected (bit-identical to 1)
        dict(n=14, label="slime + custom_tis.metrics_only", ref=1,
             flags=["--custom-tis-function-path", METRICS_ONLY, "--get-mismatch-metrics"]),
    ]


ALONE = [  # rows timed alone: key, label
    ("a", "a. our TIS fn alone"),
    ("b", "b. example mis.py fn alone"),
    ("c", "c. slime reduces+logs our TIS metrics"),
    ("d", "d. slime reduces+logs vanilla TIS metrics"),
]


# ---------------------------------------------------------------------------------------------------------------
# slime: import from --slime-src, args from slime's parser
# ---------------------------------------------------------------------------------------------------------------
_STUBS = {  # module -> attributes; only where the top-level package is not installed
    "sglang": {}, "sglang.srt": {}, "sglang.srt.server_args": {"ServerArgs": type("ServerArgs", (), {})},
    "sglang_router": {}, "sglang_router.launch_router": {"RouterArgs": type("RouterArgs", (), {})},
    "wandb": {},  # slime's logging module imports it; nothing here logs to it
}


def import_slime(slime_src: str) -> types.SimpleNamespace:
    """slime's loss module and argument module, imported from ``slime_src`` (after slime-rc on ``sys.path``)."""
    src = os.path.abspath(slime_src)
    if not os.path.isfile(os.path.join(src, "slime", "backends", "megatron_utils", "loss.py")):
        raise SystemExit(f"--slime-src {slime_src}: no slime/backends/megatron_utils/loss.py there; give a checkout "
                         f"of THUDM/slime (git clone https://github.com/THUDM/slime.git)")
    if src not in sys.path:
        sys.path.insert(sys.path.index(ROOT) + 1, src)
    stubbed = []
    for name, attrs in _STUBS.items():
        top = name.split(".")[0]
        if top in sys.modules and not getattr(sys.modules[top], "__slime_bench_stub__", False):
            continue
        if top not in sys.modules and importlib.util.find_spec(top) is not None:
            continue
        module = types.ModuleType(name)
        module.__dict__.update(attrs, __slime_bench_stub__=True)
        sys.modules[name] = module
        stubbed.append(name)
    loss = importlib.import_module("slime.backends.megatron_utils.loss")
    arguments = importlib.import_module("slime.utils.arguments")
    cp_utils = importlib.import_module("slime.backends.megatron_utils.cp_utils")
    return types.SimpleNamespace(src=src, loss=loss, arguments=arguments, cp_utils=cp_utils, stubbed=stubbed,
                                 commit=_slime_commit(src))


def slime_args(slime, flags: Sequence[str]) -> argparse.Namespace:
    """``args`` as slime's ``parse_args`` leaves them for ``flags``: slime's flag definitions, its pre-parsed mode
    flags, ``slime_validate_args`` (Megatron-LM's parser and validation aside: see the module docstring)."""
    A = slime.arguments
    argv = ["--rollout-batch-size", "1", "--num-rollout", "1", "--debug-train-only"] + list(flags)
    parser = A.get_slime_extra_args_provider()(argparse.ArgumentParser(allow_abbrev=False))
    args, _unknown = parser.parse_known_args(argv)  # slime parses with parse_known_args too
    saved = sys.argv
    try:
        sys.argv = ["train.py"] + argv
        pre = A._pre_parse_mode()
    finally:
        sys.argv = saved
    for key, value in vars(pre).items():
        setattr(args, key, value)
    A.slime_validate_args(args)
    return args


def init_parallel(device: torch.device) -> None:
    """One process: ``torch.distributed`` (gloo / NCCL) and megatron's parallel state with TP = CP = PP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    store = os.path.join(tempfile.mkdtemp(prefix="bench_slime_loss_"), "store")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 context_parallel_size=1)


def shutdown_parallel() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# the batch
# ---------------------------------------------------------------------------------------------------------------
def make_batch(T: int, V: int, samples_per_8k: float, device: torch.device, seed: int = 0):
    """``(leaf, batch, info)``: bf16 ``[1, T, V]`` logits with ``requires_grad`` and slime's batch dict."""
    B = max(1, min(T // 8, round(T / 8192 * samples_per_8k)))
    lengths = [T // B] * B
    lengths[-1] += T - sum(lengths)
    responses = [L - max(1, L // 8) for L in lengths]
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    leaf = torch.randn((1, T, V), dtype=torch.bfloat16, device=device, generator=gd).mul_(2.0)
    tokens = torch.randint(0, V, (T,), generator=g).to(device)
    starts = [0]
    for L in lengths[:-1]:
        starts.append(starts[-1] + L)
    # rows of the logits that predict the response tokens: row p predicts token p + 1
    rows = torch.cat([torch.arange(s + L - R - 1, s + L - 1) for s, L, R in zip(starts, lengths, responses)])
    current = torch.empty(rows.numel(), device=device)
    with torch.no_grad():
        for i in range(0, rows.numel(), 1024):
            r = rows[i:i + 1024].to(device)
            lp = torch.log_softmax(leaf[0, r].float(), dim=-1)
            current[i:i + 1024] = lp.gather(1, tokens[r + 1].unsqueeze(1)).squeeze(1)
    n = current.numel()
    old = current + 0.05 * torch.randn(n, generator=g).to(device)
    rollout = current + 0.1 * torch.randn(n, generator=g).to(device)
    adv = torch.randn(B, generator=g).tolist()
    batch = dict(unconcat_tokens=[], total_lengths=lengths, response_lengths=responses, loss_masks=[], advantages=[],
                 log_probs=[], rollout_log_probs=[], rollout_mask_sums=[])
    offset = 0
    for s, L, R, a in zip(starts, lengths, responses, adv):
        batch["unconcat_tokens"].append(tokens[s:s + L])
        batch["loss_masks"].append(torch.ones(R, dtype=torch.int, device=device))
        batch["advantages"].append(torch.full((R,), a, device=device))
        batch["log_probs"].append(old[offset:offset + R].clone())
        batch["rollout_log_probs"].append(rollout[offset:offset + R].clone())
        batch["rollout_mask_sums"].append(torch.tensor(float(R), device=device))
        offset += R
    leaf.requires_grad_(True)
    pick = torch.linspace(0, n - 1, GRAD_ROWS).round().long()
    info = dict(samples=B, sample_length=lengths[0], prompt=lengths[0] - responses[0], response_tokens=n,
                grad_rows=rows[pick].tolist())
    return leaf, batch, info


def input_bytes(leaf: torch.Tensor, batch: dict) -> int:
    total = leaf.numel() * leaf.element_size()
    for value in batch.values():
        for t in value:
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


# ---------------------------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------------------------
class CudaBranch(torch.overrides.TorchFunctionMode):
    """``Tensor.is_cuda`` reads True (slime's forward takes its GPU branch on CPU tensors); nothing else changes."""

    IS_CUDA = torch.Tensor.is_cuda.__get__

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == self.IS_CUDA:
            return True
        return func(*args, **(kwargs or {}))


def cpu_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of the running sum of torch's CPU allocations and frees during ``fn()`` (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocation = torch._C._profiler._EventType.Allocation
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    cur = peak = 0
    for _, size in events:
        cur += size
        peak = max(peak, cur)
    return peak


def cuda_peak_bytes(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return max(torch.cuda.max_memory_allocated() - before, 0)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:160] if text else type(e).__name__


def _cleanup(leaf: Optional[torch.Tensor] = None) -> None:
    if leaf is not None:
        leaf.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _value(t) -> float:
    return float(t.detach().double().cpu()) if isinstance(t, torch.Tensor) else float(t)


class Case:
    """One size: the batch, the contenders' args and calls, and the measurements."""

    def __init__(self, slime, T: int, V: int, samples_per_8k: float, device: torch.device, only: Optional[set]):
        self.slime, self.T, self.V, self.device = slime, T, V, device
        self.leaf, self.batch, self.info = make_batch(T, V, samples_per_8k, device)
        self.B = self.info["samples"]
        self.rows: Dict[Any, dict] = {}
        for c in contenders(slime.src):
            if only and c["n"] not in only:
                continue
            row = dict(c, error=None)
            try:
                row["args"] = slime_args(slime, c["flags"])
                row["args"].bench_env = c.get("env") or {}  # set around each call (step)
            except BaseException as e:  # noqa: BLE001 - the row reports it
                row["error"] = "args: " + _first_line(e)
            self.rows[c["n"]] = row
        self.alone: Dict[str, dict] = {key: dict(n=key, label=label, error=None) for key, label in ALONE}

    # one call of a loss contender ------------------------------------------------------------------------------
    def step(self, args, keep: Optional[dict] = None):
        env = getattr(args, "bench_env", None) or {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return self._step(args, keep)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _step(self, args, keep: Optional[dict] = None):
        loss_function = self.slime.loss.loss_function
        logits = self.leaf.float()
        if keep is not None:
            rows = torch.tensor(self.info["grad_rows"], device=self.device)
            logits.register_hook(lambda g: keep.__setitem__("grad", g[0, rows].detach().double().cpu()))
        loss, _normalizer, log = loss_function(args, self.batch, 1, self.B, logits)
        loss.backward()
        self.leaf.grad = None
        if keep is not None:
            keep["loss"] = _value(loss)
            keep["log"] = dict(zip(log["keys"], (_value(v) for v in log["values"][1:])))
        return loss

    # the TIS-function inputs slime hands over, and the alone rows ----------------------------------------------
    def tis_inputs(self) -> dict:
        n = self.info["response_tokens"]
        pg = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(self.device).requires_grad_(True)
        return dict(pg_loss=pg, train_log_probs=self.batch["log_probs"],
                    rollout_log_probs=self.batch["rollout_log_probs"], loss_masks=self.batch["loss_masks"],
                    total_lengths=self.batch["total_lengths"], response_lengths=self.batch["response_lengths"])

    def alone_calls(self) -> Dict[str, Callable[[], Any]]:
        from slime.utils.misc import load_function

        calls: Dict[str, Callable[[], Any]] = {}
        mis_args = next((r["args"] for r in self.rows.values() if r["n"] in (3, 4) and "args" in r), None)
        if mis_args is None:
            try:
                mis_args = slime_args(self.slime, contenders(self.slime.src)[2]["flags"])
            except BaseException as e:  # noqa: BLE001
                for key in ("a", "b", "c"):
                    self.alone[key]["error"] = "args: " + _first_line(e)
        inputs = self.tis_inputs()
        b = self.batch
        reducer = self.slime.cp_utils.get_sum_of_sample_mean(b["total_lengths"], b["response_lengths"],
                                                             b["loss_masks"], b["rollout_mask_sums"], False)

        def log_metrics(metrics):  # slime: policy_loss_function's reduction, then loss_function's torch.tensor
            values = [reducer(v) for v in metrics.values()]
            return torch.tensor([0] + values, device=self.device)

        if mis_args is not None:
            for key, path in (("a", OUR_TIS), ("b", EXAMPLE_TIS)):
                try:
                    fn = load_function(path)
                    fn(args=mis_args, **inputs)  # fails here rather than in the timing
                    calls[key] = (lambda fn=fn: fn(args=mis_args, **inputs))
                except BaseException as e:  # noqa: BLE001
                    self.alone[key]["error"] = _first_line(e)
            if "a" in calls:
                metrics = calls["a"]()[2]
                self.alone["c"]["keys"] = len(metrics)
                calls["c"] = lambda: log_metrics(metrics)
        vargs = self.rows.get(2, {}).get("args") or argparse.Namespace(tis_clip=2.0, tis_clip_low=0.0)
        vanilla = self.slime.loss.vanilla_tis_function(vargs, **inputs)[2]
        self.alone["d"]["keys"] = len(vanilla)
        calls["d"] = lambda: log_metrics(vanilla)
        return calls

    # passes --------------------------------------------------------------------------------------------------
    def live(self) -> List[dict]:
        return [r for r in self.rows.values() if r["error"] is None]

    def check(self) -> None:
        """One untimed call each: loss, log values, gradient rows (and the warm-up of first calls)."""
        for row in self.live():
            keep: dict = {}
            try:
                self.step(row["args"], keep)
                row.update(loss=keep["loss"], log=keep["log"], grad=keep["grad"])
            except BaseException as e:  # noqa: BLE001
                row["error"] = _first_line(e)
                row["traceback"] = traceback.format_exc()
            _cleanup(self.leaf)

    def memory(self) -> None:
        """Peak above the inputs; on CPU as slime runs on a GPU (``CudaBranch``) and as the CPU runs it."""
        cpu = self.device.type == "cpu"
        passes = [("peak_bytes", cpu_peak_bytes if cpu else cuda_peak_bytes,
                   CudaBranch if cpu else contextlib.nullcontext)]
        if cpu:
            passes.append(("peak_bytes_cpu_branch", cpu_peak_bytes, contextlib.nullcontext))
        for row in self.live():
            for key, peak, outer in passes:
                try:
                    _cleanup(self.leaf)
                    with outer():
                        row[key] = peak(lambda: self.step(row["args"]))
                except BaseException as e:  # noqa: BLE001
                    row[key + "_error"] = _first_line(e)
                _cleanup(self.leaf)

    def traffic(self) -> None:
        for row in self.live():
            modes = [("tv_bytes", CudaBranch if self.device.type == "cpu" else contextlib.nullcontext)]
            if self.device.type == "cpu":
                modes.append(("tv_bytes_cpu_branch", contextlib.nullcontext))
            for key, outer in modes:
                try:
                    counter = VocabTraffic(self.V)
                    with outer(), counter:
                        self.step(row["args"])
                    row[key] = counter.read + counter.written
                    row[key + "_read"], row[key + "_written"] = counter.read, counter.written
                    if key == "tv_bytes":
                        row["tv_bytes_by_op"] = dict(counter.by_op.most_common())
                except BaseException as e:  # noqa: BLE001
                    row[key + "_error"] = _first_line(e)
                _cleanup(self.leaf)

    def syncs(self, calls: Dict[str, Callable[[], Any]]) -> None:
        count = bench.stream_syncs if self.device.type == "cuda" else bench.host_syncs
        targets = [(row, lambda row=row: self.step(row["args"])) for row in self.live()]
        targets += [(self.alone[k], fn) for k, fn in calls.items()]
        for row, fn in targets:
            try:
                row["syncs"] = count(fn)
            except BaseException as e:  # noqa: BLE001
                row["syncs_error"] = _first_line(e)
            _cleanup(self.leaf)

    def timing(self, calls: Dict[str, Callable[[], Any]], repeats: int) -> None:
        fns = {row["n"]: (row, lambda row=row: self.step(row["args"])) for row in self.live()}
        fns.update({k: (self.alone[k], fn) for k, fn in calls.items()})
        times: Dict[Any, List[float]] = {k: [] for k in fns}
        # no gc.collect / empty_cache between timed calls: on a GPU, cudaMalloc / cudaFree would be timed
        _cleanup(self.leaf)
        order = list(fns)
        for k in list(order):  # warm-up
            try:
                fns[k][1]()
                bench.sync()
            except BaseException as e:  # noqa: BLE001
                fns[k][0]["time_ms_error"] = "warm-up: " + _first_line(e)
                order.remove(k)
                _cleanup(self.leaf)
        rng = random.Random(0)
        for _ in range(repeats):
            rng.shuffle(order)
            for k in list(order):
                try:
                    bench.sync()
                    t = time.perf_counter()
                    fns[k][1]()
                    bench.sync()
                    times[k].append(time.perf_counter() - t)
                except BaseException as e:  # noqa: BLE001 - e.g. out of memory in one round: the row says so
                    fns[k][0]["time_ms_error"] = _first_line(e)
                    order.remove(k)
                    _cleanup(self.leaf)
        for k in order:
            fns[k][0]["time_ms"] = statistics.median(times[k]) * 1e3
            fns[k][0]["times_ms"] = [t * 1e3 for t in times[k]]

    def agreement(self) -> List[dict]:
        out = []
        for row in self.rows.values():
            ref = self.rows.get(row.get("ref"))
            if ref is None or "loss" not in row or "loss" not in ref:
                continue

            def rel(a, b):
                return abs(a - b) / max(abs(b), 1e-30)

            shared = sorted(set(row["log"]) & set(ref["log"]))
            log_rel = {k: rel(row["log"][k], ref["log"][k]) for k in shared}
            log_abs = {k: abs(row["log"][k] - ref["log"][k]) for k in shared}
            g, gr = row["grad"], ref["grad"]
            out.append(dict(contender=row["n"], reference=ref["n"], loss=row["loss"], reference_loss=ref["loss"],
                            loss_rel=rel(row["loss"], ref["loss"]), log_rel=log_rel, log_abs=log_abs,
                            worst_log=max(log_rel.items(), key=lambda kv: kv[1]) if log_rel else None,
                            grad_rel=float((g - gr).norm() / gr.norm().clamp_min(1e-30)),
                            only_in_contender=sorted(set(row["log"]) - set(ref["log"])),
                            only_in_reference=sorted(set(ref["log"]) - set(row["log"]))))
        return out

    def run(self, repeats: int) -> dict:
        self.check()
        calls = self.alone_calls()
        self.memory()
        self.traffic()
        self.syncs(calls)
        self.timing(calls, repeats)
        agreement = self.agreement()
        rows = []
        for row in self.rows.values():
            r = {k: v for k, v in row.items() if k not in ("args", "grad")}
            r["flags"] = [f if not f.startswith(self.slime.src) else "<slime-src>" + f[len(self.slime.src):]
                          for f in row["flags"]]
            rows.append(r)
        result = dict(tokens=self.T, vocab=self.V, **self.info, input_bytes=input_bytes(self.leaf, self.batch),
                      rows=rows, alone=list(self.alone.values()), agreement=agreement)
        del self.leaf, self.batch
        _cleanup()
        return result


# ---------------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------------
def _git(path: str, *cmd: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", path, *cmd], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def _slime_commit(src: str) -> str:
    """slime's commit from ``src``'s own git metadata; a checkout inside another repository (an archive extracted
    into this one, as for the device machine) has none of its own."""
    top = _git(src, "rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(src):
        return "unknown (no git metadata)"
    return _git(src, "rev-parse", "HEAD") or "unknown (no git metadata)"


def header(slime, device: torch.device, threads: int) -> dict:
    import megatron.core

    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    else:
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                     platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
        where = f"CPU {model}, {os.cpu_count()} cores, torch threads {threads}"
    ours = _git(ROOT, "rev-parse", "--short", "HEAD") or "unknown"
    if _git(ROOT, "status", "--porcelain", "--untracked-files=no"):
        ours += " + uncommitted changes"
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), machine=where,
                host=platform.node(), python=platform.python_version(), torch=torch.__version__,
                megatron_core=getattr(megatron.core, "__version__", "?"), slime_src=slime.src,
                slime_commit=slime.commit, slime_rc_commit=ours, stubbed_modules=slime.stubbed)


def _fmt(row: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """``row[key]`` formatted; ``error`` where its measurement failed (``<key>_error``), else ``-``."""
    if row.get(key) is not None:
        return fmt.format(row[key] / scale if scale != 1.0 else row[key])
    return "error" if key + "_error" in row else "-"


def print_case(result: dict, device: torch.device) -> None:
    T, B = result["tokens"], result["samples"]
    print(f"\n## T = {T} tokens, V = {result['vocab']}, {B} samples of {result['sample_length']} (prompt "
          f"{result['prompt']}), {result['response_tokens']} response tokens; inputs "
          f"{result['input_bytes'] / GiB:.2f} GiB")
    base = next((r.get("time_ms") for r in result["rows"] if r["n"] == 1), None)
    sync_kind = "CUDA sync detector" if device.type == "cuda" else "host reads (HostReads)"
    print(f"\n| # | contender | time ms | peak above inputs GiB | vs slime's own | syncs | [T,V] bytes GB | loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        if r["error"] is not None:
            print(f"| {r['n']} | {r['label']} | error: {r['error']} | | | | | |")
            continue
        vs = f"{r['time_ms'] / base:.2f}x" if base and r.get("time_ms") else "-"
        print(f"| {r['n']} | {r['label']} | {_fmt(r, 'time_ms', '{:.1f}')} | {_fmt(r, 'peak_bytes', '{:.2f}', GiB)} "
              f"| {vs} | {_fmt(r, 'syncs', '{}')} | {_fmt(r, 'tv_bytes', '{:.1f}', 1e9)} | "
              f"{_fmt(r, 'loss', '{:.7g}')} |")
    for r in result["alone"]:
        if r["error"] is not None:
            print(f"| {r['n']} | {r['label'][3:]} | error: {r['error']} | | | | | |")
            continue
        extra = f" ({r['keys']} keys)" if "keys" in r else ""
        vs = f"{r['time_ms'] / base:.3f}x" if base and r.get("time_ms") else "-"
        print(f"| {r['n']} | {r['label'][3:]}{extra} | {_fmt(r, 'time_ms', '{:.2f}')} | - | {vs} | "
              f"{_fmt(r, 'syncs', '{}')} | - | - |")
    print(f"\nsyncs: {sync_kind} in one call.")
    if device.type == "cpu":
        differ = [r for r in result["rows"] if r.get("tv_bytes_cpu_branch") not in (None, r.get("tv_bytes"))
                  or r.get("peak_bytes_cpu_branch") not in (None, r.get("peak_bytes"))]
        print("peak and [T,V] bytes: as slime runs on a GPU (slime's einsum branch, Tensor.is_cuda reading True); "
              "as the CPU runs it (the timed path): "
              + (", ".join(f"#{r['n']} {_fmt(r, 'peak_bytes_cpu_branch', '{:.2f}', GiB)} GiB "
                           f"{_fmt(r, 'tv_bytes_cpu_branch', '{:.1f}', 1e9)} GB" for r in differ) or "the same"))
    rows = {r["n"]: r for r in result["rows"]}
    t2, t3 = rows.get(2, {}).get("time_ms"), rows.get(3, {}).get("time_ms")
    alone = {r["n"]: r.get("time_ms") for r in result["alone"]}
    if t2 and t3 and all(alone.get(k) for k in "acd"):
        print(f"contender 3 over 2: {t3 - t2:+.1f} ms; of it, our TIS function alone {alone['a']:.1f} ms, slime's "
              f"reduction + logging of its {result['alone'][2].get('keys')} metrics {alone['c']:.1f} ms (vs "
              f"{alone['d']:.1f} ms for vanilla TIS's {result['alone'][3].get('keys')}); the rest "
              f"{t3 - t2 - alone['a'] - alone['c'] + alone['d']:+.1f} ms")
    if result["agreement"]:
        print("\nagreement (relative differences; grad: 16 response rows of the float32 logits' gradient):")
        for a in result["agreement"]:
            worst = (f"worst log key {a['worst_log'][0]}: rel {a['worst_log'][1]:.1e} (abs "
                     f"{a['log_abs'][a['worst_log'][0]]:.1e})") if a["worst_log"] else "no shared log keys"
            print(f"  #{a['contender']} vs #{a['reference']}: loss {a['loss']:.9g} vs {a['reference_loss']:.9g} "
                  f"(rel {a['loss_rel']:.1e}), grad rel {a['grad_rel']:.1e}, {worst}")
    failed = [f"#{r['n']} {k[:-6]}: {v}" for r in result["rows"] + result["alone"] for k, v in r.items()
              if k.endswith("_error") and v]
    if failed:
        print("\nmeasurements that failed (their cells read 'error'):\n  " + "\n  ".join(failed))
    errors = [r for r in result["rows"] if r.get("traceback")]
    for r in errors:
        print(f"\n#{r['n']} {r['label']} failed:\n" + r["traceback"].rstrip()[-3000:])


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slime-src", required=True, help="a checkout of THUDM/slime (put on sys.path)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", help="comma list of micro-batch sizes T (CPU default 2048; CUDA 8192,32768)")
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen2.5's 151,936)")
    ap.add_argument("--samples-per-8k", type=float, default=8.0, help="samples per 8192 tokens (default 8)")
    ap.add_argument("--repeats", type=int, help="timed rounds (CPU default 5, CUDA 10)")
    ap.add_argument("--only", help="comma list of contender numbers (default: all)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--slime-commit", help="slime's commit, to print where --slime-src has no git metadata")
    ap.add_argument("--glibc-default", action="store_true",
                    help="CPU: keep glibc's malloc settings (by default the run re-executes itself with "
                         + " ".join(f"{k}={v}" for k, v in KEEP_FREED_ENV.items()) + ")")
    a = ap.parse_args(argv)
    if a.device == "cpu" and not a.glibc_default and any(os.environ.get(k) != v for k, v in KEEP_FREED_ENV.items()):
        sys.stdout.flush()
        argv = list(sys.argv[1:] if argv is None else argv)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + argv,
                  dict(os.environ, **KEEP_FREED_ENV))
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here; use --device cpu")
    if a.threads:
        torch.set_num_threads(a.threads)
    bench.DEVICE = device  # bench.sync / stream_syncs read it
    tokens = [int(x) for x in (a.tokens or ("8192,32768" if device.type == "cuda" else "2048")).split(",")]
    repeats = a.repeats or (10 if device.type == "cuda" else 5)
    only = {int(x) for x in a.only.split(",")} if a.only else None
    slime = import_slime(a.slime_src)
    if a.slime_commit and slime.commit.startswith("unknown"):
        slime.commit = f"{a.slime_commit} (as given by --slime-commit)"
    init_parallel(device)
    head = header(slime, device, torch.get_num_threads())
    print("# slime's loss_function: slime's own loss vs slime-rc's custom loss (forward + backward, one micro-batch)")
    for key in ("date", "machine", "python", "torch", "megatron_core", "slime_src", "slime_commit", "slime_rc_commit"):
        print(f"{key}: {head[key]}")
    glibc = " ".join(f"{k}={os.environ.get(k)}" for k in KEEP_FREED_ENV)
    print(f"stub modules: {', '.join(head['stubbed_modules']) or 'none'}; median of {repeats} shuffled rounds"
          + (f"; glibc: {glibc}" if device.type == "cpu" else ""))
    head["malloc_env"] = {k: os.environ.get(k) for k in KEEP_FREED_ENV}
    report = dict(header=head, repeats=repeats, cases=[])
    try:
        for T in tokens:
            case = Case(slime, T, a.vocab, a.samples_per_8k, device, only)
            result = case.run(repeats)
            del case
            print_case(result, device)
            report["cases"].append(result)
            if a.json:  # after every size: a later size may run out of memory
                with open(a.json, "w") as f:
                    json.dump(report, f, indent=1, default=str)
    finally:
        shutdown_parallel()
    if a.json:
        print(f"\nwrote {a.json}")
    return report


if __name__ == "__main__":
    main()
