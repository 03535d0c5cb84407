"""The stream worker's command line: profiled only when asked."""

from __future__ import annotations

import sys
from pathlib import Path

from fleetscope.stack import worker_command


def test_the_worker_runs_bare_unless_a_profile_folder_is_given() -> None:
    bare = worker_command(Path("/data/worker-config.json"), 4242, "worker")
    assert bare == [sys.executable, "-m", "fleetscope", "worker", "--config", "/data/worker-config.json",
                    "--web-port", "4242", "--log-level", "INFO"]  # fmt: skip
    profiled = worker_command(Path("/data/worker-config.json"), 4242, "worker-2", "/tmp/prof")
    assert profiled[1] == "-c" and "cProfile.Profile(time.process_time)" in profiled[2]
    assert profiled[3] == "/tmp/prof/worker-2.prof"
    assert profiled[4:] == bare[3:]
