"""The training thread's run-queue wait: how long it was ready to run while no CPU ran it.

Why: a step that takes longer because other processes took the CPU (a shared host, or the tool's own
pipeline beside the job) is no regression of the job's own work. Linux counts that time per thread (the
second field of ``/proc/thread-self/schedstat``, in ns); the torch hook publishes each step's share of it
(``schemas.CPU_WAIT``), and the differential judges ``job_regression`` on the steps' time less it.
"""

from __future__ import annotations

import os

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
