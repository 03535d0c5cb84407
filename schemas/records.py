"""In-memory shapes of the records that cross topics, with explicit record adapters."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt


class EventKind(enum.StrEnum):
    """The four raw event kinds, one topic and one Avro record type each.

    The values are wire names (topic ``<prefix>.<value>``, catalog subject, the header's ``streams``) that
    ranks already running write, so they stay; the members say what the events are: host spans (Python
    functions, annotations, step markers) and hardware samples of the rank's GPU (NVML: links, clocks)."""

    KERNELS = "kernels"
    COLLECTIVES = "collectives"
    HOST = "python"
    SAMPLES = "throughput"


class FunctionKind(enum.IntEnum):
    """What a pattern's function is; decides which peer comparison and which fault category apply."""

    COMPUTE = 0
    MEMORY = 1
    COLLECTIVE = 2
    PYTHON = 3


# Column name -> numpy dtype, per raw kind. ``names`` is the per-batch string dictionary that the
# ``*_id`` columns index. Optional columns (added by a later schema version) may be empty.
COLUMNS: dict[EventKind, dict[str, type[np.generic]]] = {
    EventKind.KERNELS: {
        "start_ns": np.int64,
        "dur_ns": np.int64,
        "name_id": np.int32,
        "stream": np.int32,
        "launch_ns": np.int64,
    },
    EventKind.COLLECTIVES: {
        "start_ns": np.int64,
        "dur_ns": np.int64,
        "name_id": np.int32,
        "op_id": np.int32,
        "pg_id": np.int32,
        "seq": np.int64,
        "group_size": np.int32,
        "nbytes": np.int64,
        "launch_ns": np.int64,
    },
    EventKind.HOST: {
        "start_ns": np.int64,
        "dur_ns": np.int64,
        "name_id": np.int32,
        "depth": np.int32,
    },
    EventKind.SAMPLES: {
        "t_ns": np.int64,
        "metric_id": np.int32,
        "value": np.float64,
    },
}

OPTIONAL_COLUMNS = frozenset({"launch_ns"})
ID_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys(c for cols in COLUMNS.values() for c in cols if c.endswith("_id")))
"""The columns that index a batch's ``names`` dictionary: the codec, the windower and the trace reader remap
them together."""

PATTERN_TIMELINE_FIELDS = (
    "sync_function", "sync_seq", "sync_gap_us", "sync_dur_us", "sync_compute_less_gap_us", "sync_tail_compute_us",
)  # fmt: skip
"""The pattern record's timeline (``patterns.v4``): one entry per synchronisation call, not per function, so
the store, whose rows are functions, keeps none of them."""

THREAD_BUSY_DEPTH = -1
"""A host row with this depth is no function: a stretch of time its thread worked outside every host span
of its own (a trace parser sends the outermost CPU ops it drops, e.g. the autograd engine's thread), so
that an annotation of another thread that waits meanwhile (``## backward ##``) shows no self time."""

SPAN_CPU_WAIT_DEPTH = -2
"""A host row with this depth is no function: the run-queue wait (time its thread was ready to run while no
CPU ran it) inside the host span of the same name and start, less that of the spans nested in it. A span's
self time leaves it out: a rank descheduled by other processes on a shared host did no more work."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchHeader:
    """Identity of the rank that sent a batch (see header.avsc)."""

    job: str
    rank: int
    world_size: int
    producer_id: str
    seq: int
    cluster: str = ""
    local_rank: int = 0
    host: str = ""
    gpu_uuid: str = ""
    tp_rank: int = -1
    pp_rank: int = -1
    dp_rank: int = -1
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    streams: tuple[str, ...] = ()
    """Event kinds published for this rank by all its producers; empty when unknown. The windower
    waits for every declared stream before it closes a step."""
    clock: str = "realtime"
    sent_ns: int = 0

    def to_record(self) -> dict[str, Any]:
        record = asdict(self)
        record["streams"] = list(self.streams)
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BatchHeader:
        values = {k: v for k, v in record.items() if k in _HEADER_FIELDS}
        values["streams"] = tuple(values.get("streams", ()))
        return cls(**values)


_HEADER_FIELDS = frozenset(f.name for f in fields(BatchHeader))


@dataclass(kw_only=True, slots=True)
class EventBatch:
    """A batch of one kind of events from one rank, held as numpy columns.

    ``len(batch)`` is the number of events; every column of ``COLUMNS[kind]`` has that length,
    except optional columns, which are either that length or empty (unknown).
    """

    kind: EventKind
    header: BatchHeader
    names: list[str]
    columns: dict[str, npt.NDArray[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        spec = COLUMNS[self.kind]
        n = -1
        for name, dtype in spec.items():
            col = np.asarray(self.columns.get(name, ()), dtype=dtype)
            self.columns[name] = col
            if name in OPTIONAL_COLUMNS and col.size == 0:
                continue
            if n < 0:
                n = col.size
            elif col.size != n:
                raise ValueError(f"{self.kind.value} column {name!r} has {col.size} values, expected {n}")
        unknown = set(self.columns) - set(spec)
        if unknown:
            raise ValueError(f"unknown {self.kind.value} columns: {sorted(unknown)}")

    def __len__(self) -> int:
        first = next(iter(COLUMNS[self.kind]))
        return int(self.columns[first].size)

    def __getitem__(self, column: str) -> npt.NDArray[Any]:
        return self.columns[column]

    def to_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"header": self.header.to_record(), "names": list(self.names)}
        for name, col in self.columns.items():
            record[name] = col.tolist()
        return record

    @classmethod
    def from_record(cls, kind: EventKind, record: dict[str, Any]) -> EventBatch:
        return cls(
            kind=kind,
            header=BatchHeader.from_record(record["header"]),
            names=list(record["names"]),
            columns={name: record.get(name, ()) for name in COLUMNS[kind]},
        )
