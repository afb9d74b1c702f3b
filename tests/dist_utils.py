"""Spawn a small gloo world on CPU and bring each rank's results back to the parent (pytest) process.

``run_distributed(fn, world_size)`` starts ``world_size`` processes with ``torch.multiprocessing`` (spawn),
initializes ``torch.distributed`` with the gloo backend in each, calls ``fn(rank, world_size, *args)`` and returns
the list of per-rank return values.  Each rank writes its return value (or its traceback) to a file in a temporary
directory; the parent reads them after the join.  A rank that raises, dies or hangs past ``timeout`` makes
``run_distributed`` raise :class:`DistributedRunError` naming the ranks and their tracebacks, after killing the
processes that are still alive — the parent never waits forever on a deadlocked collective.

``fn`` must be a module-level function of an importable module (it is pickled by name into the children) and
its return value must be picklable by ``torch.save`` (tensors, numbers, strings, dicts, lists).

The parent never imports megatron-core; each child imports it itself inside ``fn`` (~6 s of CPU per process).
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List, Sequence

import torch
import torch.multiprocessing as mp

# Collectives in the children give up after this long (gloo default is 30 min).
COLLECTIVE_TIMEOUT_S = 60


class DistributedRunError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port that was free a moment ago (for a ``tcp://`` rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, init_method: str, out_dir: str, fn: Callable, args: Sequence[Any]):
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            payload = {"ok": True, "result": fn(rank, world_size, *args)}
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - shutting down after a failure must not hide it
                pass
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        payload = {"ok": False, "traceback": traceback.format_exc()}
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)  # the parent only ever sees complete files


def run_distributed(fn: Callable, world_size: int = 4, *, args: Sequence[Any] = (), timeout: float = 120.0,
                    rendezvous: str = "file") -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``rendezvous``: ``"file"`` (a FileStore in the temporary directory: no port to race for with concurrent
    test runs) or ``"tcp"`` (a free localhost port).
    """
    out_dir = tempfile.mkdtemp(prefix="slime_rc_dist_")
    try:
        if rendezvous == "file":
            init_method = "file://" + os.path.join(out_dir, "store")
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.start_processes(_entry, args=(world_size, init_method, out_dir, fn, tuple(args)),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        timed_out = False
        problems = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            try:
                if ctx.join(timeout=min(remaining, 1.0)):
                    break
            except Exception as e:  # a child died (signal, os._exit): report it, stop the others
                problems.append(f"process failure: {e}")
                break
        alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
        for i in alive:
            ctx.processes[i].kill()
        for p in ctx.processes:
            p.join(5)

        results: List[Any] = [None] * world_size
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                problems.append(f"rank {rank}: no result" + (" (killed at the timeout)" if rank in alive else ""))
                continue
            payload = torch.load(path, weights_only=False)
            if payload["ok"]:
                results[rank] = payload["result"]
            else:
                problems.append(f"rank {rank} raised:\n{payload['traceback']}")
        if timed_out:
            silent = [r for r in range(world_size) if results[r] is None]
            problems.insert(0, f"timed out after {timeout:.0f} s; ranks without a result: {silent} (deadlock?)")
        if problems:
            raise DistributedRunError("distributed run failed:\n" + "\n".join(problems))
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
