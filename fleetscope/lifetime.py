"""Child processes die with their parent, by construction.

A process that is SIGKILLed (or crashes) runs no ``finally``: without this, its broker kept its port and its
scoring processes their memory for hours. Linux delivers a signal to a child when its parent dies if the
child asked for it (``prctl(PR_SET_PDEATHSIG)``); the child asks before it runs anything else:

- a program started with ``subprocess.Popen`` (the Tansu broker): ``preexec_fn=
  child_preexec(...)`` asks between fork and exec;
- a ``fleetscope`` child (the stream worker of ``up``): ``child_env`` names its parent, and the child's
  ``watch_parent_from_env`` stops it (SIGTERM, then SIGKILL) when that process ends;
- a ``multiprocessing`` child (a scoring process): ``die_with_parent()`` in the pool's initializer. Its
  parent is the forkserver, which exits only when its owner *and every child* have closed the "alive" pipe
  (each child holds its write end): the forkserver and its children outlived a SIGKILLed worker for
  hours, each waiting on the other. So the child watches its owner (``multiprocessing.parent_process()``'s
  sentinel) in a thread, and asks for PR_SET_PDEATHSIG against the forkserver besides.

Each checks afterwards that the parent is still there: one that died between the fork and the request
would otherwise never signal. A ``Popen`` program that is not ours has no fallback where there is no
``prctl`` (not Linux): its owner's ``stop()`` stops it.

PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not only its process: ``child_preexec``
asks for it on the main thread only (a broker restarted from a helper thread is stopped by its owner's
``stop()``, as elsewhere). A ``fleetscope`` child watches the process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``: the signal a process gets when its parent dies."""


def _find_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, resolved once here (a child between fork and exec must not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _find_prctl()


def parent_death_signal(sig: int) -> bool:
    """Ask for ``sig`` when this process's parent dies; False where the system cannot (not Linux)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def child_preexec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``Popen`` ``preexec_fn`` that makes the child get ``sig`` when the calling process dies (None where
    the system has no way, or off the main thread, whose end alone would signal: pass it as it is)."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None  # the signal would come when the calling thread ends: a restart from a helper thread
    parent = os.getpid()

    def preexec() -> None:
        parent_death_signal(sig)
        if os.getppid() != parent:  # the parent died before the request: nobody would signal
            os.kill(os.getpid(), sig)

    return preexec


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a ``multiprocessing`` child: end with ``sig`` when the process that started it dies (its owner,
    ``multiprocessing.parent_process()``, whose sentinel is readable once it is gone), or its parent."""
    parent_death_signal(sig)
    owner = multiprocessing.parent_process()
    sentinel = getattr(owner, "sentinel", None)
    if sentinel is None:
        return
    if multiprocessing.connection.wait([sentinel], timeout=0):  # gone before the request: now, not never
        os.kill(os.getpid(), sig)
    threading.Thread(target=_watch, args=(sentinel, sig), name="parent-watch", daemon=True).start()


def _watch(sentinel: int, sig: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), sig)


PARENT_ENV = "FLEETSCOPE_PARENT_PID"
"""The environment variable that tells a ``fleetscope`` child which process it lives for."""

STOP_GRACE_S = 5.0
"""How long a child whose parent died has to stop cleanly (SIGTERM: drain, commit) before it is killed. A
worker whose embedded broker died with ``up`` never finishes stopping (its consumer retries the fetch), and
what it did not commit is read again by the next worker: a few seconds, not Faust's shutdown timeout."""


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a ``fleetscope`` child process that must end with this one (``watch_parent`` reads it).

    For our own Python children this beats ``child_preexec``: the child watches the parent *process*
    (a pidfd), so it outlives the thread that started it (a restart from a helper thread), and it stops
    cleanly (SIGTERM) rather than being killed."""
    return {**env, PARENT_ENV: str(os.getpid())}


def watch_parent_from_env(sig: int = signal.SIGTERM) -> None:
    """In a ``fleetscope`` process started with ``child_env``: ``sig`` to itself when that parent dies,
    SIGKILL ``STOP_GRACE_S`` later if it has not stopped. Nothing when the variable is not set.

    The parent is watched by its pid, not as ``getppid()``: a launcher between them changes nothing."""
    value = os.environ.pop(PARENT_ENV, "")
    if not value.isdigit():
        return
    parent = int(value)
    fd: int | None = None
    try:
        fd = os.pidfd_open(parent)  # Linux 5.3+: readable when the process ends, whichever thread forked
    except ProcessLookupError:  # gone already
        _stop(sig)
        return
    except (AttributeError, OSError):
        fd = None
    threading.Thread(target=_await_parent, args=(parent, fd, sig), name="parent-watch", daemon=True).start()


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` is alive (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _await_parent(parent: int, fd: int | None, sig: int) -> None:
    if fd is not None:
        select.select([fd], [], [])
    else:
        while process_exists(parent):
            time.sleep(0.5)
    _stop(sig)


def _stop(sig: int) -> None:
    os.kill(os.getpid(), sig)
    if sig != signal.SIGKILL:
        time.sleep(STOP_GRACE_S)
        os.kill(os.getpid(), signal.SIGKILL)
