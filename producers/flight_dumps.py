"""PyTorch Flight Recorder dumps, read into the heartbeat records the live flight recorder publishes.

Why: a job that timed out leaves each rank's Flight Recorder ring buffer (``_dump_fr_trace``: a pickle,
``_dump_fr_trace_json``: JSON; one file per rank, named ``<prefix><rank>``). Each rank's dump becomes one
``heartbeat`` record (``producers/flight_recorder.py``): the oldest entry that has not completed is where
its training thread waits (``in_collective``), else its newest entry is the last it left. The stream side
judges these records with the live path's own verdict (``streams/analysis/hangs.py``).

Format, field by field as torch's own reader (``torch/distributed/flight_recorder``) reads it: a dict
with ``version`` ("2.x"), ``entries`` and ``pg_config`` (``{pg name: {"ranks": "[0, 1]", ...}}``); per
entry ``process_group`` (name, description), ``collective_seq_id`` (per group, from 1), ``p2p_seq_id``,
``profiling_name`` (``nccl:all_reduce``), ``input_sizes``, ``input_dtypes``, ``state``
(scheduled/started/completed), ``retired`` (the work finished) and ``time_created_ns`` (wall clock).
Gloo records entries too, but never moves ``state`` past ``scheduled`` and writes no usable
``pg_config``: an entry is completed when its state says so or it is retired, and a group the dump does
not list has the world (the default group) or the ranks whose dumps name it as members.

Sends and receives are numbered per rank (``p2p_seq_id``), not per pair, so they are not matched across
ranks: a rank waiting in one is inside a collective of its own (it waits; it names nobody).
Nothing here imports torch; a pickle may hold only plain data (a class in it refuses the file).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetscope.producers.kineto_comms import canonical_op, dtype_bytes
from fleetscope.producers.kineto_load import TraceError

HEAD_BYTES = 4096
"""How much of a file tells a dump from a Kineto trace (``is_dump``)."""
MAX_DUMP_BYTES = 256 * 2**20
"""A dump larger than this is refused: torch's default buffer (2000 entries, with stacks) is megabytes."""
_JSON_MARKS = (b'"comm_lib_version"', b'"pg_status"', b'"nccl_comm_state"', b'"collective_seq_id"')
"""Keys only a dump has (a Kineto trace's ``distributedInfo`` has a ``pg_config`` too)."""
_TRACE_MARKS = (b'"traceEvents"', b'"schemaVersion"')
_RANK_IN_NAME = re.compile(r"(\d+)(\.json|\.pkl|\.pickle|\.bin)?$")


class _PlainUnpickler(pickle.Unpickler):
    """Dicts, lists, tuples, strings and numbers only: a dump never names a class, so none is loaded."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which no Flight Recorder dump holds")


@dataclass(frozen=True, slots=True)
class DumpEntry:
    """One recorded collective (or send/receive), as the verdict reads it."""

    record_id: int
    pg: str
    pg_desc: str
    seq: int
    """``collective_seq_id``, or ``p2p_seq_id`` for a send/receive."""
    p2p: bool
    op: str
    """The vocabulary's name (``allreduce``); ``profiling_name`` keeps the backend's."""
    profiling_name: str
    sizes: str
    """``input_sizes`` as compact JSON; empty where members may legitimately differ (all-to-all, ``_v``)."""
    dtypes: str
    nbytes: int
    """Bytes of the inputs; -1 where a dtype is unknown or sizes may differ."""
    completed: bool
    created_ns: int
    timeout_ms: int


@dataclass(frozen=True, slots=True)
class RankDump:
    """One rank's dump: its entries in record order and the groups it lists."""

    rank: int
    path: str
    version: str
    entries: tuple[DumpEntry, ...]
    pg_ranks: Mapping[str, tuple[int, ...]]
    """Group name -> global ranks, where ``pg_config`` lists them."""
    as_of_ns: int
    """When the dump was written (the file's time), never before its newest entry."""

    def waiting(self) -> DumpEntry | None:
        """The oldest entry not completed: where the rank's training thread waits."""
        return next((e for e in self.entries if not e.completed), None)


def is_dump(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a Flight Recorder dump: a pickle (protocol 2 to 5), or a JSON
    object naming the dump's own keys (a Kineto trace names none of them)."""
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return True
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    return (
        text.startswith(b"{")
        and any(mark in head for mark in _JSON_MARKS)
        and not any(mark in head for mark in _TRACE_MARKS)
    )


def rank_of(name: str) -> int | None:
    """The rank in a dump's file name: its trailing digits (``nccl_trace_rank_3``, ``rank3.json``)."""
    m = _RANK_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def rank_prefix(name: str) -> str | None:
    """A dump's file name without its rank (``nccl_trace_rank_``, ``rank.json``): the same for every rank."""
    m = _RANK_IN_NAME.search(name)
    return None if m is None else name[: m.start(1)] + name[m.end(1) :]


def parse_dump(data: bytes, name: str, written_ns: int) -> RankDump:
    """One rank's dump from its bytes (pure); ``TraceError`` with a one-line reason if it is not one."""
    rank = rank_of(Path(name).name)
    if rank is None:
        raise TraceError(f"{name}: no rank at the end of its name (PyTorch names dumps <prefix><rank>)")
    doc = _decode(data, name)
    if not isinstance(doc, dict):
        raise TraceError(f"{name}: a {type(doc).__name__}, not a Flight Recorder dump (a dict)")
    version = doc.get("version")
    if not isinstance(version, str) or not re.fullmatch(r"2\.\d+", version):
        raise TraceError(f"{name}: version {version!r}, not a Flight Recorder dump version 2.x")
    raw = doc.get("entries")
    if not isinstance(raw, list):
        raise TraceError(f"{name}: no list of entries")
    entries = []
    for i, item in enumerate(raw):
        try:
            entries.append(_entry(item))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{name}: entry {i} unreadable ({type(exc).__name__}: {exc})"[:300]) from None
    entries.sort(key=lambda e: e.record_id)
    newest = max((e.created_ns for e in entries), default=0)
    return RankDump(
        rank=rank, path=name, version=version, entries=tuple(entries), pg_ranks=_pg_ranks(doc.get("pg_config")),
        as_of_ns=max(written_ns, newest),
    )  # fmt: skip


def load_dump(path: Path, max_bytes: int = MAX_DUMP_BYTES) -> RankDump:
    """Read one dump file (``TraceError`` with a one-line reason if it cannot be read or is not a dump)."""
    try:
        stat = path.stat()
        if stat.st_size > max_bytes:
            raise TraceError(f"{path}: {stat.st_size} bytes, past the {max_bytes} a dump may hold")
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return parse_dump(data, str(path), stat.st_mtime_ns)


def _decode(data: bytes, name: str) -> object:
    if is_dump(data[:HEAD_BYTES]) and data[:1] == b"\x80":
        try:
            return _PlainUnpickler(io.BytesIO(data)).load()
        except Exception as exc:  # noqa: BLE001 - a truncated or forged pickle raises anything
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise TraceError(f"{name}: not a readable pickle ({type(exc).__name__}: {text})"[:300]) from None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise TraceError(f"{name}: neither a pickle nor JSON ({type(exc).__name__}: {exc})"[:300]) from None


def _int(value: object, default: int | None = None) -> int:
    """An int field (JSON dumps write some as strings); ``default`` for None/absent, else ValueError."""
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def _entry(item: object) -> DumpEntry:
    if not isinstance(item, dict):
        raise TypeError(f"a {type(item).__name__}, not a dict")
    pg = item["process_group"]
    if not isinstance(pg, list | tuple) or len(pg) != 2 or not all(isinstance(x, str) for x in pg):
        raise ValueError(f"process_group {pg!r} is not (name, description)")
    name = item["profiling_name"]
    if not isinstance(name, str) or not name.split(":", 1)[-1].split():
        raise ValueError(f"profiling_name {name!r} names no operation")
    word = name.split(":", 1)[-1].split()[0]  # "nccl:send 0->1" -> "send"
    op = canonical_op(word)
    p2p = bool(item.get("is_p2p", False)) or op in ("send", "recv")
    sizes, dtypes = item["input_sizes"], item.get("input_dtypes") or []
    if not isinstance(sizes, list) or not all(isinstance(s, list) for s in sizes):
        raise ValueError(f"input_sizes {sizes!r} is not a list of shapes")
    if not isinstance(dtypes, list):
        raise ValueError(f"input_dtypes {dtypes!r} is not a list")
    variable = "all_to_all" in word or word.endswith("_v") or op == "scatter"  # sizes differ by design
    state = item["state"]
    return DumpEntry(
        record_id=_int(item.get("record_id"), 0), pg=pg[0], pg_desc=pg[1],
        seq=_int(item["p2p_seq_id"] if p2p else item["collective_seq_id"]), p2p=p2p,
        op=op, profiling_name=name,
        sizes="" if variable else _shapes(sizes), dtypes=",".join(sorted(set(map(str, dtypes)))),
        nbytes=-1 if variable else _nbytes(sizes, dtypes),
        completed=state == "completed" or item.get("retired") is True, created_ns=_int(item["time_created_ns"]),
        timeout_ms=_int(item.get("timeout_ms"), 0),
    )  # fmt: skip


SHAPES_CHARS = 120
"""Shapes longer than this as JSON (a coalesced call of many tensors) are summed up: count and elements."""


def _shapes(sizes: list[object]) -> str:
    text = json.dumps(sizes, separators=(",", ":"))
    if len(text) <= SHAPES_CHARS:
        return text
    elements = sum(math.prod(dims) for dims in map(_dims, sizes) if dims is not None)
    return f"{len(sizes)} tensors of {elements} elements"


def _nbytes(sizes: list[object], dtypes: list[object]) -> int:
    """Bytes of the inputs: each shape's elements times its dtype's size; -1 if a dtype is unknown."""
    if len(dtypes) != len(sizes):
        return -1
    total = 0
    for shape, dtype in zip(sizes, dtypes, strict=True):
        elem = dtype_bytes(dtype)
        dims = _dims(shape)
        if elem is None or dims is None or min(dims, default=0) < 0:
            return -1
        total += math.prod(dims) * elem
    return total


def _dims(shape: object) -> list[int] | None:
    """A tensor shape's dimensions; None unless it is a list of integers."""
    if not isinstance(shape, list | tuple) or not all(isinstance(d, int) for d in shape):
        return None
    return [int(d) for d in shape]


def _pg_ranks(config: object) -> dict[str, tuple[int, ...]]:
    """Group name -> ranks from ``pg_config`` (its ranks written as ``"[0, 1]"``); groups with none skipped."""
    out: dict[str, tuple[int, ...]] = {}
    if not isinstance(config, dict):
        return out
    for key, group in config.items():
        ranks = group.get("ranks") if isinstance(group, dict) else None
        try:
            parsed = json.loads(ranks) if isinstance(ranks, str) else ranks
        except ValueError:
            continue
        if isinstance(key, str) and key and isinstance(parsed, list) and parsed:
            if all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in parsed):
                out[key] = tuple(sorted(parsed))
    return out


def dump_heartbeats(dumps: Sequence[RankDump], job: str) -> dict[int, dict[str, object]]:
    """Each rank's dump as the ``heartbeat`` record its live flight recorder would have sent when the
    dump was written: the collective it waits in (or last entered), its group's ranks and when it entered."""
    world = max([d.rank + 1 for d in dumps] + [r + 1 for d in dumps for rs in d.pg_ranks.values() for r in rs])
    listed: dict[str, tuple[int, ...]] = {}
    named: dict[str, set[int]] = {}
    for d in dumps:
        listed |= d.pg_ranks
        for e in d.entries:
            named.setdefault(e.pg, set()).add(d.rank)
    out: dict[int, dict[str, object]] = {}
    for d in sorted(dumps, key=lambda d: d.rank):
        waiting = d.waiting()
        entry = waiting or (d.entries[-1] if d.entries else None)
        hb: dict[str, object] = {
            "job": job, "rank": d.rank, "host": "", "world_size": world, "producer_id": d.path, "seq": 0,
            "sent_ns": d.as_of_ns, "last_step": -1, "last_step_ns": 0, "in_collective": waiting is not None,
            "profiling": False,
        }  # fmt: skip
        if entry is not None:
            ranks: tuple[int, ...]
            if entry.p2p:  # numbered per rank: matched with no other rank's
                pg, ranks = f"{entry.pg}:p2p:{d.rank}", (d.rank,)
            elif entry.pg in listed:
                pg, ranks = entry.pg, listed[entry.pg]
            elif entry.pg_desc == "default_pg":
                pg, ranks = entry.pg, tuple(range(world))
            else:
                pg, ranks = entry.pg, tuple(sorted(named.get(entry.pg, {d.rank})))
            hb |= {
                "collective_op": entry.op, "collective_pg": pg, "collective_group_ranks": list(ranks),
                "collective_seq": entry.seq, "collective_nbytes": entry.nbytes,
                "collective_entered_ns": entry.created_ns, "collective_dtype": entry.dtypes,
                "collective_sizes": entry.sizes,
            }  # fmt: skip
        out[d.rank] = hb
    return out
