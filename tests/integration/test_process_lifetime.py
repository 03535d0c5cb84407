"""Children die with their parent, and ``up``'s data folder is the user's alone.

A SIGKILLed ``up`` leaves neither its broker nor its stream worker behind; a SIGKILLed owner of a scoring pool
(a worker with ``scoring_processes``) leaves neither the forkserver nor its processes; every file and folder
``up`` (chDB, Tansu, the worker, Faust) wrote under the data folder is private."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

POOL_OWNER = r"""
import json, multiprocessing.forkserver
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.scoring import ScoringPool

pool = ScoringPool(2, DifferentialConfig())
for future in [pool.submit("j", [], {}) for _ in range(4)]:
    future.result(30)
children = {
    "forkserver": multiprocessing.forkserver._forkserver._forkserver_pid,
    **{f"scoring-{i}": pid for i, pid in enumerate(pool._executor._processes)},
}
print(json.dumps(children), flush=True)
input()
"""

DEADLINE_S = 15.0
"""The worker gets SIGTERM (drain, commit) and is killed ``lifetime.STOP_GRACE_S`` later at the latest."""


def _alive(pid: int) -> bool:
    """Running (a zombie whose parent is gone but not reaped counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _children(pid: int) -> dict[str, int]:
    """The direct children of ``pid``, by program (``tansu``, ``python``)."""
    out: dict[str, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().split(" (", 1)[1].rsplit(") ", 1)
        except (OSError, IndexError, ValueError):
            continue
        if int(rest.split()[1]) == pid:
            out[name] = int(stat.parent.name)
    return out


def _gone_after_kill(owner: subprocess.Popen[str], children: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
    """SIGKILL ``owner`` (no finally, no atexit, no stop()); how long each child took to end, which are left."""
    owner.kill()
    owner.wait(10)
    t0 = time.monotonic()
    gone: dict[str, float] = {}
    while len(gone) < len(children) and time.monotonic() - t0 < DEADLINE_S:
        gone |= {n: round(time.monotonic() - t0, 2) for n, p in children.items() if n not in gone and not _alive(p)}
        time.sleep(0.05)
    return gone, {name: pid for name, pid in children.items() if _alive(pid)}


def _reap(owner: subprocess.Popen[str], children: dict[str, int]) -> None:
    if owner.poll() is None:
        owner.kill()
        owner.wait(10)
    for pid in children.values():
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and pidfd are Linux's")


@LINUX
def test_up_keeps_its_data_folder_private_and_a_sigkilled_up_leaves_no_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "fs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE__")}
    env |= {"FLEETSCOPE__EMBEDDED__BROKER_PORT": "0", "FLEETSCOPE__EMBEDDED__STORE_PORT": "0"}
    out = tmp_path / "up.out"
    with open(out, "w") as stdout:
        up = subprocess.Popen(
            [sys.executable, "-m", "fleetscope", "up", "--data-dir", str(data_dir)],
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            umask=0o022,  # a usual login's: files 0644, folders 0755
        )
    children: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 90
        while "Ctrl-C" not in out.read_text():
            assert up.poll() is None, out.read_text()
            assert time.monotonic() < deadline, "up did not start"
            time.sleep(0.2)
        children = _children(up.pid)
        assert {"tansu", "python"} <= children.keys(), children
        opened = {
            f"{path.relative_to(data_dir)} {path.stat().st_mode & 0o777:o}"
            for path in [data_dir, *data_dir.rglob("*")]
            if not path.is_symlink() and path.stat().st_mode & 0o077
        }
        files = sum(1 for _ in data_dir.rglob("*"))
        print(f"{files} paths under the data folder, {len(opened)} open to others: {sorted(opened)[:8]}")
        assert opened == set(), "every file 0600 (or 0700), every folder 0700: the store, logs, tokens"
        assert {"broker.log", "worker.log", "store-tokens.json"} <= {p.name for p in data_dir.iterdir()}
        broker = json.loads((data_dir / "endpoint.json").read_text())["bootstrap_servers"]
        gone, left = _gone_after_kill(up, children)
        print(f"seconds from up's SIGKILL to each child's end: {gone}; left: {left}")
        assert left == {}
        assert not _listening(int(broker.rsplit(":", 1)[1])), "the broker's port is free again"
    finally:
        _reap(up, children)


@LINUX
def test_a_sigkilled_owner_of_a_scoring_pool_leaves_no_scoring_process() -> None:
    """The forkserver and its children held each other alive after their worker's SIGKILL (each child holds
    the forkserver's "alive" pipe)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", POOL_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    children: dict[str, int] = {}
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line, f"the owner did not start (exit {owner.poll()})"
        children = json.loads(line)
        assert len(children) == 3 and all(_alive(pid) for pid in children.values()), children
        gone, left = _gone_after_kill(owner, children)
        print(f"seconds from the owner's SIGKILL to each child's end: {gone}; left: {left}")
        assert left == {}
    finally:
        _reap(owner, children)


class _StuckWorker:
    """A worker whose stop is interrupted (a second Ctrl-C while it drains)."""

    def stop(self) -> None:
        raise KeyboardInterrupt


def test_a_stack_whose_worker_fails_to_stop_still_stops_its_broker(tmp_path: Path) -> None:
    """The brokers of stopped stacks that kept their ports: stop() went no further than the part that
    failed, and start() stopped nothing on a failure it did not list (Ctrl-C while the worker starts)."""
    from fleetscope.broker import TansuBroker
    from fleetscope.config import load_config
    from fleetscope.stack import EmbeddedStack

    stack = EmbeddedStack(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    broker = TansuBroker()
    port = int(broker.start().rsplit(":", 1)[1])
    stack.broker, stack.worker = broker, _StuckWorker()  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            stack.stop()
        assert not _listening(port), "the broker must stop although the worker failed to"
        assert stack.broker is None and stack.worker is None
    finally:
        broker.stop()
