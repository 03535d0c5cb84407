"""A rank's live state, written by the training thread and read by the heartbeat: a flight recorder.

Why: a rank blocked in a collective (or before one) publishes no events, and neither do the peers waiting
for it; only a thread that does not train can still say where each rank is. The training thread writes
plain attributes (no lock: one attribute write per collective entry and exit, one per step); the
recorder's background thread reads them every heartbeat interval and publishes a ``heartbeat`` record with
the last completed step and the collective the rank is in or last entered (op, process group, the group's
global ranks, per-group sequence number, size, when it entered). Sequence numbers come from one per-group
counter that every rank advances in the same order, so the stream side can tell which member never
entered a collective. Nothing here imports torch.
"""

from __future__ import annotations

from typing import NamedTuple


class CollectiveEntry(NamedTuple):
    """One collective as the rank entered it (a tuple: built on the hot path)."""

    op: str
    pg: str
    group_ranks: tuple[int, ...]
    seq: int
    nbytes: int
    entered_ns: int


class RankState:
    """What the heartbeat reports; written by the training thread, read by the recorder's thread.

    ``inside`` is the collective the rank entered last and has not seen complete; ``last`` the one it
    entered last (kept after completion). Async collectives complete in order on a process group, so
    clearing ``inside`` only when its own entry completes keeps the newest still in flight.
    """

    __slots__ = ("inside", "last", "last_step", "last_step_ns")

    def __init__(self) -> None:
        self.last_step = -1
        self.last_step_ns = 0
        self.inside: CollectiveEntry | None = None
        self.last: CollectiveEntry | None = None

    def enter(self, entry: CollectiveEntry) -> None:
        self.last = entry
        self.inside = entry

    def leave(self, entry: CollectiveEntry) -> None:
        if self.inside is entry:
            self.inside = None

    def step_done(self, step: int, now_ns: int) -> None:
        self.last_step_ns = now_ns
        self.last_step = step


def heartbeat_record(
    *,
    job: str,
    rank: int,
    host: str,
    world_size: int,
    producer_id: str,
    seq: int,
    sent_ns: int,
    state: RankState,
    profiling: bool,
) -> dict[str, object]:
    """The ``heartbeat`` record (schema ``heartbeat.v1``) of ``state`` now."""
    inside = state.inside  # read once: the training thread may change it meanwhile
    entry = inside if inside is not None else state.last
    record: dict[str, object] = {
        "job": job,
        "rank": rank,
        "host": host,
        "world_size": world_size,
        "producer_id": producer_id,
        "seq": seq,
        "sent_ns": sent_ns,
        "last_step": state.last_step,
        "last_step_ns": state.last_step_ns,
        "in_collective": inside is not None,
        "profiling": profiling,
    }
    if entry is not None:
        record |= {
            "collective_op": entry.op,
            "collective_pg": entry.pg,
            "collective_group_ranks": list(entry.group_ranks),
            "collective_seq": entry.seq,
            "collective_nbytes": entry.nbytes,
            "collective_entered_ns": entry.entered_ns,
        }
    return record
