"""A trace file is read within bounds, and one file's failure is that file's: a gzip bomb is refused at
its cap, a sparse or huge file by its first bytes or its size before it is read whole, a tar member that
is not a trace is never written, bad UTF-8 costs the name, and a file the parser fails on costs only it."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fleetscope.producers import TraceError, parse_trace
from fleetscope.producers.kineto_load import load_trace
from fleetscope.producers.tracegen import TraceJob, write_traces
from fleetscope.traces_cli import LoadOptions, analyze_traces, find_traces

MIB = 2**20


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Python's peak allocation while ``fn`` runs (what it reads and decodes), whatever it raises."""
    tracemalloc.start()
    try:
        fn()
    except TraceError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def gzip_bomb(path: Path, expanded_mib: int) -> None:
    """A small gzip file that expands to ``expanded_mib`` MiB of JSON whitespace (one member repeated)."""
    blank = gzip.compress(b" " * MIB, 9)
    path.write_bytes(gzip.compress(b'{"traceEvents": [', 9) + blank * expanded_mib)


def test_a_gzip_bomb_is_refused_at_its_cap_not_expanded(tmp_path: Path) -> None:
    bomb = tmp_path / "rank-0.json.gz"
    gzip_bomb(bomb, 256)  # 256 MiB from ~260 KB: past max(64 MiB, 100 x its size)
    with pytest.raises(TraceError, match="gzip expands past"):
        load_trace(bomb)
    assert peak_bytes(lambda: load_trace(bomb)) < 100 * MIB  # the 64 MiB cap and its growth, not 256 MiB


def test_a_file_is_refused_by_its_first_bytes_or_its_size_before_it_is_read(tmp_path: Path) -> None:
    sparse = tmp_path / "rank-0.json"
    with open(sparse, "wb") as f:
        f.truncate(256 * MIB)  # NUL bytes, no disk
    assert peak_bytes(lambda: load_trace(sparse)) < MIB
    with pytest.raises(TraceError, match="not JSON"):
        load_trace(sparse)
    huge = tmp_path / "rank-1.json"
    with open(huge, "wb") as f:
        f.write(b'{"traceEvents": [')
        f.truncate(2 * MIB)
    from fleetscope.producers.kineto_load import TraceLimits

    with pytest.raises(TraceError, match="over the 1048576-byte limit"):
        load_trace(huge, TraceLimits(max_trace_bytes=MIB))
    with pytest.raises(TraceError, match="not a regular file"):
        load_trace(Path("/dev/zero"))


def test_bad_utf8_in_a_name_costs_the_name_not_the_file(tmp_path: Path) -> None:
    (path,) = write_traces(TraceJob(dp=1, steps=2, seed=3), tmp_path / "job")
    data = path.read_bytes()
    good = parse_trace(path)
    kernel = json.dumps("flash_fwd_kernel").encode()
    assert kernel in data
    path.write_bytes(data.replace(kernel, b'"flash_fwd\xff\xfe_kernel"'))  # two bytes that are not UTF-8
    trace = parse_trace(path)
    assert trace.kernels == good.kernels and trace.steps == good.steps
    names = {n for b in trace.batches for n in b.names}
    assert "flash_fwd\ufffd\ufffd_kernel" in names and "flash_fwd_kernel" not in names


def test_a_tar_archive_writes_only_its_traces(tmp_path: Path) -> None:
    write_traces(TraceJob(dp=4, steps=2, seed=5), tmp_path / "src" / "myjob")
    archive = tmp_path / "profiles.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "myjob", arcname="myjob")
        for name, size in (("myjob/core.bin", 64 * MIB), ("myjob/rank-9.json", 64 * MIB)):
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))  # NUL bytes: not a trace, whatever its name
    out = tmp_path / "out"
    out.mkdir()
    found = find_traces([archive], unpack_into=out)
    assert sorted(p.name for p in found) == [f"rank-{r}.pt.trace.json" for r in range(4)]
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert written == sum(f.stat().st_size for f in (tmp_path / "src" / "myjob").iterdir())  # nothing else
    whole = analyze_traces([archive], None, LoadOptions(on_skip=lambda _p, _e: None))
    assert len(whole.ranks) == 4
    assert [(Path(s["path"]).name, s["reason"]) for s in whole.skipped] == [
        ("rank-9.json", "not JSON (its first non-blank byte is not { or [)")
    ]
    from fleetscope.producers.kineto_load import TraceLimits

    budget = 5 * (tmp_path / "src" / "myjob" / "rank-0.pt.trace.json").stat().st_size // 2
    part = analyze_traces(
        [archive], None, LoadOptions(on_skip=lambda _p, _e: None, limits=TraceLimits(max_unpacked_bytes=budget))
    )
    assert len(part.ranks) == 2 and len(part.skipped) == 3
    assert all("max_unpacked_bytes" in s["reason"] for s in part.skipped)


def test_a_file_the_parser_fails_on_costs_only_that_file(tmp_path: Path) -> None:
    """A step name of 5,000 digits (past Python's int conversion limit) in one of four files."""
    paths = write_traces(TraceJob(dp=4, steps=3, seed=5), tmp_path / "job")
    doc = json.loads(paths[3].read_text())
    step = next(e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    step["name"] = "ProfilerStep#" + "7" * 5000
    paths[3].write_text(json.dumps(doc))
    paths[2].write_bytes(zlib.compress(b"{}"))  # not a trace at all
    result = analyze_traces([tmp_path / "job"], None, LoadOptions(on_skip=lambda _p, _e: None))
    analysed = {r.rank for r in result.ranks}
    assert {0, 1} <= analysed and 2 not in analysed  # rank 3: analysed once its step is bounded, else skipped
    names = {r: f"rank-{r}.pt.trace.json" for r in range(4)}
    assert {Path(s["path"]).name for s in result.skipped} == {names[r] for r in range(4) if r not in analysed}
    assert all("\n" not in s["reason"] and len(s["reason"]) <= 300 for s in result.skipped)
