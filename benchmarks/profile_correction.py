"""Where one engine call's time goes, eager and compiled, on the benchmark's batches (``bench_correction.py``).

For each batch and each path (``eager``: ``compiled=False``; ``compiled``: ``compiled=True``, compiled in a warm-up
call) this runs a few warm calls under ``torch.profiler`` and prints, per call:

* the host side: wall time, the number of ops dispatched (``aten::`` events), kernels launched (``cudaLaunchKernel``
  / ``cuLaunchKernel``), and the synchronising runtime calls the host made (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaMemcpy`` / ``cudaMemcpyAsync`` with their direction where the profiler names it);
* the device side (CUDA only): kernels run, their summed time, and the ten longest by total time;
* CUDA's own sync detector (``torch.cuda.set_sync_debug_mode("warn")``) over one more call: what it reports.

Then the same call right after ~20 ms of queued bf16 matrix products (``--in-step``; CUDA only), profiled, to see
whether the call's host work overlaps the queued work or waits for it.

Run: ``python benchmarks/profile_correction.py [--device cuda] [--batches micro,large] [--calls 3] [--in-step]``
(on a CPU it profiles the host side only).  ``.ci/gpu``'s ``profile`` step runs it on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from typing import Dict, List

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_correction as bench  # noqa: E402  (the benchmark's batches and config)

import slime_rc as rc  # noqa: E402

BATCHES = {"micro": bench.MICRO, "small": bench.SMALL, "large": bench.LARGE, "long": bench.LONG}
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cuMemcpyHtoD", "cuMemcpyDtoH")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _device_time_us(event) -> float:
    for attr in ("device_time_total", "cuda_time_total", "self_device_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0


def summarize(prof, calls: int, on_cuda: bool) -> Dict[str, object]:
    """Per-call counts from one profile of ``calls`` calls."""
    events = prof.events()
    host = Counter()
    kernels: Dict[str, List[float]] = {}
    for e in events:
        name = e.name
        if name.startswith("aten::"):
            host["ops"] += 1
        elif name in LAUNCHES:
            host["launches"] += 1
        elif name in SYNC_CALLS:
            host[name] += 1
        if on_cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(name, []).append(float(e.time_range.elapsed_us()))
    out: Dict[str, object] = {k: v / calls for k, v in host.items()}
    if on_cuda:
        out["kernels run"] = sum(len(v) for v in kernels.values()) / calls
        out["kernel time (us)"] = sum(sum(v) for v in kernels.values()) / calls
        out["top kernels"] = sorted(((sum(v) / calls, len(v) // calls, k) for k, v in kernels.items()),
                                    reverse=True)[:10]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="micro,large", help=f"comma list of {', '.join(BATCHES)}")
    ap.add_argument("--calls", type=int, default=3, help="calls profiled per batch and path")
    ap.add_argument("--in-step", action="store_true", help="also profile a call behind ~20 ms of queued GPU work")
    args = ap.parse_args()
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "0")
    device = bench.DEVICE = torch.device(args.device)  # (bench.sync and bench.stream_syncs read it)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: CUDA is not available here")
    torch.set_num_threads(1)
    lengths_of = dict(bench.cases())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    where = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    print(f"torch {torch.__version__}, {where}; config: the benchmark's (bench_correction.CONFIG)")
    for key in args.batches.split(","):
        label = BATCHES[key]
        train, rollout, mask, cu = (t.to(device) for t in bench.make_batch(lengths_of[label]))
        for path, compiled in (("eager", False), ("compiled", True)):
            def call():
                return rc.compute_rollout_correction(train, rollout, mask, cu, bench.CONFIG, compiled=compiled)
            for _ in range(3):  # warm-up (compiles on the first compiled call)
                call()
            if on_cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.calls):
                call()
            if on_cuda:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / args.calls
            with profile(activities=activities) as prof:
                for _ in range(args.calls):
                    call()
                if on_cuda:
                    torch.cuda.synchronize()
            s = summarize(prof, args.calls, on_cuda)
            print(f"\n== {label}, {path}: {wall * 1e3:.2f} ms a call (wall, unprofiled)")
            for k, v in s.items():
                if k == "top kernels":
                    print("   top kernels (us a call, launches a call, name):")
                    for us, count, name in v:
                        print(f"     {us:9.1f} {count:4d}  {name[:110]}")
                else:
                    print(f"   {k}: {v:.1f}" if isinstance(v, float) else f"   {k}: {v}")
            if on_cuda:
                print(f"   CUDA sync detector, one call: {bench.stream_syncs(call)} synchronising call(s)")
                if args.in_step:
                    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
                    a @ a
                    torch.cuda.synchronize()
                    with profile(activities=activities) as prof:
                        for _ in range(10):  # ~20 ms of queued work on an H100/H200
                            a @ a
                        t = time.perf_counter()
                        call()
                        host = time.perf_counter() - t
                        torch.cuda.synchronize()
                    waits = Counter(e.name for e in prof.events() if e.name in SYNC_CALLS)
                    print(f"   in a step: the call's host side took {host * 1e3:.2f} ms behind the queued work "
                          f"(~the call's own host time: it overlapped; ~the work's time: it waited); host syncs "
                          f"{dict(waits)}")


if __name__ == "__main__":
    main()
