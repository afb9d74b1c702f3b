"""How ``slime-rc train`` stops when told to: SIGTERM and Ctrl-C (SIGINT) end a run cleanly, and no process of the run
outlives the launcher.

* :func:`install` (every process of a run): the first SIGINT or SIGTERM raises :class:`Interrupted` (a
  ``KeyboardInterrupt``) in the main thread, so the ``finally`` clauses run (loggers closed, process group destroyed)
  and the launcher prints one line and exits ``128 + signal`` (130 for SIGINT, 143 for SIGTERM).  Later signals are
  ignored while the run winds down; a process whose winding down hangs is ended :data:`HARD_EXIT_S` seconds after the
  first signal.
* :func:`atomic` marks a section a signal must not cut (one step's metrics line, ``config.json``): a signal that
  comes inside it is held and raised when the section ends, so every line of ``metrics.jsonl`` is complete.
* :func:`die_with_parent` (each spawned worker, first thing): the worker gets SIGTERM when the launcher dies, even by
  SIGKILL (``prctl(PR_SET_PDEATHSIG)`` on Linux; a thread that watches the parent pid elsewhere), and stops itself
  at once when the launcher is already gone.
* :func:`stop_processes` (the launcher, on a signal): SIGTERM to each live worker, SIGKILL to those still alive after
  ``grace`` seconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from typing import Iterator, List, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)
HARD_EXIT_S = 20.0  # a process still winding down this long after the first signal exits at once
STOP_GRACE_S = 10.0  # the launcher waits this long for its workers after SIGTERM before SIGKILL
_PR_SET_PDEATHSIG = 1


class Interrupted(KeyboardInterrupt):
    """The run was stopped by ``signum`` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal_name(self.signum)


def signal_name(signum: int) -> str:
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


def exit_code(signum: int) -> int:
    """The status of a run stopped by ``signum``: the shell's ``128 + signal``."""
    return 128 + int(signum)


_received: Optional[int] = None  # the first signal
_held = False  # it came inside an atomic() section: raised when the section ends
_depth = 0  # nesting of atomic() sections


def received() -> Optional[int]:
    """The signal that stopped this process (None: none came)."""
    return _received


def _hard_exit(signum: int) -> None:
    time.sleep(HARD_EXIT_S)
    print(f"slime-rc train: still stopping {HARD_EXIT_S:g} s after {signal_name(signum)}; exiting now",
          file=sys.stderr, flush=True)
    os._exit(exit_code(signum))


def _handler(signum, frame) -> None:
    global _received, _held
    if _received is not None:  # the run is already stopping: the first signal's clean-up goes on
        return
    _received = signum
    threading.Thread(target=_hard_exit, args=(signum,), daemon=True, name="slime-rc-hard-exit").start()
    if _depth:
        _held = True
        return
    raise Interrupted(signum)


def install() -> dict:
    """SIGINT and SIGTERM raise :class:`Interrupted` in this process (from the main thread; elsewhere a no-op);
    returns the handlers they replace, for :func:`restore`."""
    global _received, _held, _reported
    _received, _held, _reported = None, False, False
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _handler) for sig in SIGNALS}


def restore(previous: dict) -> None:
    """Put back the handlers :func:`install` replaced (a caller of ``main`` in its own process gets its own back)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


_reported = False  # a line said where the run stopped


def report(line: Optional[str]) -> None:
    """Print ``line`` (the one line saying where the run stopped) to stderr, once; None: another process says it."""
    global _reported
    if line is not None and not _reported:
        print(line, file=sys.stderr, flush=True)
    _reported = True


def reported() -> bool:
    return _reported


@contextlib.contextmanager
def atomic() -> Iterator[None]:
    """A section no signal cuts: one that comes inside is raised as :class:`Interrupted` when it ends."""
    global _depth, _held
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _held:
        _held = False
        raise Interrupted(_received)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when ``parent_pid`` (the launcher) dies, however it dies; at once if it already has."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="slime-rc-parent-watch").start()
    if os.getppid() != parent_pid:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def stop_processes(processes: List, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to every live ``multiprocessing.Process`` of ``processes``; SIGKILL to those alive after ``grace`` s;
    returns when all have exited."""
    for p in processes:
        if p.is_alive():
            with contextlib.suppress(OSError):
                p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            with contextlib.suppress(OSError):
                p.kill()
            p.join()
