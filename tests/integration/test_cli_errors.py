"""Every CLI error path prints at most three lines, cause first, and no traceback (``--debug`` adds it).

Real parts: each command runs as its own process on a real chDB store; "broker unreachable" is a closed
loopback port; "store locked" is another process holding the store open."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetscope.broker import free_port

pytestmark = pytest.mark.integration

ENV = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}


def fleetscope(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetscope", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=ENV | (env or {}),
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder whose .fleetscope holds a migrated, empty store (made by a process that then exits)."""
    root = tmp_path_factory.mktemp("cli-errors")
    code = (
        "from fleetscope.config import load_config\n"
        "from fleetscope.sinks import connect, migrate\n"
        "c = load_config(env={}).store\n"
        "migrate(connect(c), c.database)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, env=ENV, timeout=120)
    (root / "bad.toml").write_text('[kafka]\nbootstrap_server = "x:1"\nraw_partitions = 0\n')
    (root / "trace.json").write_text('{"traceEvents": []}')
    return root


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Path]:
    """A folder whose store another process holds open."""
    store = tmp_path / ".fleetscope" / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import chdb, time; c = chdb.connect({str(store)!r}); print('held', flush=True); "
         "time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=ENV,
    )  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    yield tmp_path
    holder.kill()
    holder.wait()


DEAD = f"127.0.0.1:{free_port()}"
CASES: dict[str, tuple[list[str], str]] = {
    "bad sql is a syntax error, not a write": (["sql", "SELEC 1"], "Syntax error"),
    "unknown table": (["sql", "SELECT * FROM no_such_table"], "UNKNOWN_TABLE"),
    "a write without --write": (["sql", "DROP TABLE iterations"], "--write"),
    "two statements": (["sql", "SELECT 1; SELECT 2"], "one SQL statement"),
    "bad --param": (["sql", "SELECT {a:Int32}", "--param", "a"], "NAME=VALUE"),
    "missing parameter": (["sql", "SELECT {a:Int32}"], "the store refused"),
    "unknown job": (["report", "--job", "no-such-job", "-o", "r.html"], "no-such-job"),
    "bad config file": (["findings", "--config", "bad.toml"], "bootstrap_server"),
    "config is a device": (["findings", "--config", "/dev/zero"], "not a regular file"),
    "bad trace limit": (["analyze", "trace.json", "--max-gzip-ratio", "-1"], "max_gzip_ratio"),
    "missing config file": (["findings", "--config", "missing.toml"], "missing.toml"),
    "bad fault": (["simulate", "--fault", "bogus:1", "--bootstrap", DEAD], "bogus"),
    "broker unreachable: simulate": (["simulate", "--bootstrap", DEAD], "no Kafka broker answers"),
    "broker unreachable: init": (["init", "--bootstrap", DEAD], "no Kafka broker answers"),
    "broker unreachable: profile": (["profile", "--job", "j", "--bootstrap", DEAD], "no Kafka broker answers"),
    "broker unreachable: replay": (["replay", "trace.json", "--bootstrap", DEAD], "no Kafka broker answers"),
    "no broker at all": (["alerts"], "needs a broker"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_error_is_three_lines_at_most_without_traceback(folder: Path, name: str) -> None:
    args, expected = CASES[name]
    res = fleetscope(*args, cwd=folder)
    out = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode != 0, out
    assert len(out) <= 3 and "Traceback" not in res.stderr, "\n".join(out)
    assert out[0].startswith(f"fleetscope {args[0]}:"), out
    assert expected in "\n".join(out), out
    if name == "bad sql is a syntax error, not a write":
        assert "read-only" not in out[0] and "--write" not in "\n".join(out)


def test_a_folder_without_a_store_says_so_and_creates_none(tmp_path: Path) -> None:
    res = fleetscope("findings", cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) <= 3 and "no store at" in lines[0], res.stderr
    assert not (tmp_path / ".fleetscope").exists()


def test_a_locked_store_is_named_in_one_line(locked: Path) -> None:
    t0 = time.monotonic()
    res = fleetscope("findings", cwd=locked)
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode != 0 and len(lines) <= 3 and "Traceback" not in res.stderr, lines
    assert "open in another process" in lines[0], lines
    assert time.monotonic() - t0 < 60


def test_debug_adds_the_traceback(folder: Path) -> None:
    res = fleetscope("sql", "SELECT * FROM no_such_table", "--debug", cwd=folder)
    assert res.returncode != 0 and "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-2].startswith("fleetscope sql: the store refused")


def test_analyze_loses_only_the_bad_files(tmp_path: Path) -> None:
    """Good traces mixed with a 5,000-digit step, a gzip bomb, a sparse file, bad UTF-8 and an archive
    holding a core dump and a fake trace: every good file is analysed, each bad one skipped with its
    one-line reason (stderr and --json), exit 0; nothing analysable at all is exit 1."""
    import gzip
    import io
    import json
    import tarfile

    from fleetscope.producers.tracegen import TraceJob, write_traces

    job = tmp_path / "job"
    paths = write_traces(TraceJob(dp=5, steps=3, seed=5), job)
    doc = json.loads(paths[4].read_text())
    next(e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))["name"] = (
        "ProfilerStep#" + "7" * 5000
    )
    paths[4].write_text(json.dumps(doc))
    paths[0].write_bytes(paths[0].read_bytes().replace(b'"flash_fwd_kernel"', b'"flash\xff\xfe_fwd_kernel"'))
    (job / "bomb.json.gz").write_bytes(gzip.compress(b"{" + b" " * (2**20), 9) * 128)  # 128 MiB from 130 KB
    with open(job / "sparse.json", "wb") as f:
        f.truncate(256 * 2**20)
    with tarfile.open(job / "more.tgz", "w:gz") as tar:
        for name, size in (("more/core", 2**24), ("more/rank-7.json", 2**20)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
    res = fleetscope("analyze", str(job), "--json", "--quiet", "--workers", "2", cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    out = json.loads(res.stdout)
    analysed = {r["rank"] for r in out["ranks"]}
    assert {0, 1, 2, 3} <= analysed  # rank 4: analysed once its step is bounded, else skipped
    skipped = {Path(s["path"]).name: s["reason"] for s in out["skipped"]}
    assert {"bomb.json.gz", "sparse.json", "rank-7.json"} <= set(skipped) <= {
        "bomb.json.gz", "sparse.json", "rank-7.json", "rank-4.pt.trace.json"}  # fmt: skip
    assert "gzip expands past" in skipped["bomb.json.gz"] and "not JSON" in skipped["sparse.json"]
    assert all("\n" not in r for r in skipped.values())
    lines = [line for line in res.stderr.splitlines() if line.startswith("fleetscope analyze: skipped ")]
    assert len(lines) == len(skipped)
    none = fleetscope("analyze", str(job / "sparse.json"), "--quiet", cwd=tmp_path)
    assert none.returncode == 1 and "no trace could be parsed" in none.stderr
