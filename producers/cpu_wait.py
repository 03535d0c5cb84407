"""The training thread's run-queue wait: how long it was ready to run while no CPU ran it.

Why: a step that takes longer because other processes took the CPU (a shared host, or the tool's own
pipeline beside the job) is no regression of the job's own work. Linux counts that time per thread (the
second field of ``/proc/thread-self/schedstat``, in ns); the torch hook publishes each step's share of it
(``schemas.CPU_WAIT``), and the differential judges ``job_regression`` on the steps' time less it. So too
for each host span (``SpanWaits``): a rank descheduled inside its ``optimizer.step`` on a shared host is no
slow host; the span's self time leaves the wait out (``schemas.SPAN_CPU_WAIT_DEPTH``).
"""

from __future__ import annotations

import os
import threading

SCHEDSTAT = "/proc/thread-self/schedstat"


class CpuWaitClock:
    """The run-queue wait so far of the thread that first reads it (about 2 µs a read: the file stays open,
    bound to that thread). ``read`` gives None where the kernel does not say, and from then on."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self._path = path
        self._fd: int | None = None
        self._failed = False

    def read(self) -> int | None:
        if self._failed:
            return None
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            self.close()
            self._failed = True
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


SpanMark = tuple[int, int]
"""At a span's start: the thread's run-queue wait so far, and the wait already given to spans by then."""


class SpanWaits:
    """Each host span's own run-queue wait, on the thread that made it: the wait from its start to its end
    less that of the spans that ended in between (the spans of one thread that end inside a span are nested
    in it), so that a wrapper span and the span inside it never both claim the same wait.

    Two reads of ``clock`` per span (a few µs); on any other thread, or where the kernel does not say,
    ``mark`` gives None and nothing is measured."""

    def __init__(self, clock: CpuWaitClock) -> None:
        self._clock = clock
        self._thread = threading.get_ident()
        self._given = 0

    def mark(self) -> SpanMark | None:
        if threading.get_ident() != self._thread:
            return None
        wait = self._clock.read()
        return None if wait is None else (wait, self._given)

    def own(self, mark: SpanMark) -> int:
        """The span's own wait, at its end (``mark``: from its start)."""
        wait = self._clock.read()
        if wait is None:
            return 0
        own = max(wait - mark[0] - (self._given - mark[1]), 0)
        self._given += own
        return own

    def give(self, wait: int) -> None:
        """A span measured otherwise on this thread claimed ``wait`` (elsewhere: nothing)."""
        if threading.get_ident() == self._thread:
            self._given += wait
