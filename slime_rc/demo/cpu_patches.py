"""Run real megatron-core on a machine without a GPU (gloo, CPU tensors): the ONE place with CUDA -> CPU patches.

``apply_cpu_patches()`` is idempotent and does nothing at all when ``torch.cuda.is_available()``.  Call it in every
process (e.g. every spawned test worker) before building a model, an optimizer or calling a schedule
(``slime_rc.demo.model.initialize_parallel`` does).  It patches process-global functions of torch and
megatron-core, so call it in worker processes, not in a test runner that runs unrelated tests.

Each patch was confirmed necessary with megatron-core 0.16.1 + torch 2.13.0+cpu by removing it and running the
tiny-GPT training step of ``slime_rc.demo.model`` (the first failure is quoted):

1. ``torch.cuda.current_device`` -> ``"cpu"`` and ``torch.cuda.synchronize`` -> no-op.  Megatron allocates with
   ``device=torch.cuda.current_device()`` (DDP's ``_ParamAndGradBuffer``, p2p receive buffers) and synchronises
   around p2p.  Without it: ``AssertionError: Torch not compiled with CUDA enabled`` (DDP construction).
   ``torch.cuda.current_stream`` -> ``torch.cpu.current_stream()`` (whose ``wait_event`` / ``wait_stream`` are
   no-ops): megatron-core 0.19's ``_ParamAndGradBucketGroup.start_grad_sync`` takes the current stream on every
   gradient sync (to wait for CUDA-graph events).  Without it (0.19.2, torch 2.15 CUDA build on a machine without
   a GPU): ``RuntimeError: Found no NVIDIA driver on your system`` from ``torch.cuda.current_stream()`` in
   ``start_grad_sync``; 0.16 never calls it here.
2. Tensor factories ``torch.zeros / ones / empty / full / tensor / arange`` called with ``device="cuda"`` (or a
   ``torch.device("cuda")`` or an int GPU index) allocate on the CPU instead, and ``pin_memory=True`` is dropped.
   Hit by the optimizer (``FP32Optimizer._scale = torch.tensor([1.0], device='cuda')``), the schedules' token
   counter, the grad-norm helpers; megatron's non-packed CP RoPE asks for ``pin_memory=True``.
   Without it: ``AssertionError: Torch not compiled with CUDA enabled`` (``get_megatron_optimizer``), resp.
   ``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend``.  PyTorch's cached set of
   factory functions that ``with torch.device(...)`` redirects is filled with the originals first; filled after
   the swap it would hold the wrappers, and ``torch.tensor`` & co. would ignore a ``meta`` / ``cpu`` device
   context from then on (tests/demo/test_cpu_patches.py).
3. ``Tensor.cuda`` -> identity.  Used when the last pipeline stage sets up its copy of tied word embeddings (and by
   megatron's non-packed CP RoPE slicing).  Without it (PP2 with ``tie_embeddings=True``):
   ``AssertionError: Torch not compiled with CUDA enabled``.
4. CUDA RNG -> the CPU default generator: ``torch.cuda.manual_seed / get_rng_state / set_rng_state`` (also under
   ``torch.cuda.random``) and megatron's own ``tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state``,
   so ``model_parallel_cuda_manual_seed`` and the ``CudaRNGStatesTracker`` (``fork()`` around dropout and
   initialisation) work unchanged.  (``torch.cuda.manual_seed_all`` is left alone: ``torch.manual_seed`` calls it
   and it is a harmless lazy no-op.)  Without it: ``AssertionError: Torch not compiled with CUDA enabled`` in
   ``model_parallel_cuda_manual_seed``; the unpatched ``_set_cuda_rng_state`` would even do *nothing*, silently
   (``torch.cuda._lazy_call`` queues the callback forever).
5. Gradient clipping: ``clip_grad_by_total_norm_fp32`` (as imported by ``megatron.core.optimizer.optimizer``)
   asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``; replaced by the same scaling without the check.
   Needed whenever ``OptimizerConfig.clip_grad > 0``.  Without it: a bare ``AssertionError`` in
   ``clip_grad_by_total_norm_fp32`` at the first ``optimizer.step()``.
6. Pipeline shape exchange (``variable_seq_lengths=True``): ``P2PCommunicator._communicate_shapes`` posts its
   sends/receives with ``batch_isend_irecv`` in a fixed order (send-prev, recv-prev, send-next, recv-next).  With
   PP=2 the previous and the next stage are the same rank and gloo matches messages between a pair of ranks in
   posting order, so the shape meant for "recv-next" arrives in "recv-prev": with the interleaved (VPP) schedule the
   ranks then post tensors of the wrong sizes.  Replaced by the same exchange in the even/odd order megatron's
   non-batched ``_p2p_ops`` uses for the tensors themselves.  Without it (PP2 + VPP2, variable lengths): gloo
   aborts the process -- ``Received data size doesn't match expected size``.  (The tensors themselves need
   ``batch_p2p_comm=False`` on gloo for the same reason; ``model.transformer_config`` sets it.)

Not patched (not needed here): the distributed optimizer's ``Tensor.type()`` checks for cuda type names only
matter with ``use_distributed_optimizer=True``, which ``slime_rc.demo.model.build_optimizer`` does not use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_APPLIED = False
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


def cpu_patches_applied() -> bool:
    return _APPLIED


def _is_cuda_device(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # a GPU index
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper._slime_rc_cpu_patch = True
    return wrapper


def _cpu_current_stream(device: Any = None) -> "torch.cpu.Stream":
    return torch.cpu.current_stream()  # its wait_event / wait_stream / record_event are no-ops


def _tensor_cuda_identity(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls torch.cuda.manual_seed_all


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """megatron's ``clip_grad_by_total_norm_fp32`` without its ``torch.cuda.FloatTensor`` assertion."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            assert grad.dtype in (torch.float32, torch.bfloat16), grad.dtype
            grads.append(to_local_if_dtensor(grad).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _communicate_shapes_in_order(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """megatron's ``P2PCommunicator._communicate_shapes`` with the point-to-point order of ``_p2p_ops``."""
    from megatron.core.pipeline_parallel.p2p_communication import _p2p_ops

    def shape(t):
        return None if t is None else torch.tensor(list(t.size()), dtype=torch.int64)

    recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
    recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
    reqs = _p2p_ops(tensor_send_prev=shape(tensor_send_prev), tensor_recv_prev=recv_prev_shape,
                    tensor_send_next=shape(tensor_send_next), tensor_recv_next=recv_next_shape,
                    group=self.pp_group, prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank)
    for req in reqs.values():
        req.wait()
    return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
            [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())


def apply_cpu_patches() -> bool:
    """Apply the patches listed in the module docstring (once per process).  Returns True when the patches are in
    place, False when CUDA is available (then nothing is touched)."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    # 1. current device / synchronize / current stream
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_stream = _cpu_current_stream

    # 2. tensor factories.  First fill PyTorch's cached set of factory functions (``torch.utils._device``'s
    # ``lru_cache``d ``_device_constructors``, read by ``with torch.device(...)`` and ``torch.set_default_device``)
    # with the ORIGINAL functions: filled after the swap it would hold our wrappers, and a device context would no
    # longer recognise ``torch.tensor`` & co. (the mode sees the original function) -- tensors made under
    # ``with torch.device("meta")`` would land on the CPU (transformers' rotary ``inv_freq`` came out as garbage).
    try:
        import torch.utils._device as torch_device_mode  # not imported by ``import torch``: import it to fill it
    except ImportError:
        torch_device_mode = None
    getattr(torch_device_mode, "_device_constructors", lambda: None)()
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "_slime_rc_cpu_patch", False):
            setattr(torch, name, _cpu_factory(fn))

    # 3. Tensor.cuda
    torch.Tensor.cuda = _tensor_cuda_identity

    # 4. CUDA RNG -> CPU generator
    torch.cuda.manual_seed = _cpu_manual_seed
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.random.manual_seed = _cpu_manual_seed
    torch.cuda.random.get_rng_state = _cpu_get_rng_state
    torch.cuda.random.set_rng_state = _cpu_set_rng_state
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state

    # 5. grad clipping
    from megatron.core.optimizer import clip_grads as mclip
    from megatron.core.optimizer import optimizer as mopt

    mclip.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    mopt.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32

    # 6. pipeline shape exchange (variable sequence lengths) in a consistent point-to-point order
    from megatron.core.pipeline_parallel import p2p_communication as mp2p

    mp2p.P2PCommunicator._communicate_shapes = _communicate_shapes_in_order

    _APPLIED = True
    return True
