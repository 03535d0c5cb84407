"""Hangs diagnosed like a flight recorder: from every rank's latest heartbeat, not from its events.

A rank blocked in a collective publishes nothing, and when every rank is blocked no event clock moves;
the producer's background thread still publishes a heartbeat with the last completed step and the
collective the training thread is in. Each rank's stall is measured on its own heartbeat clock
(``sent_ns - last_step_ns``), so clock skew between hosts and a consumer's backlog (heartbeats read late
still carry the times they were built at) change nothing. When no rank completed a step for
``max(stall_factor x mean iteration, hang_min_stall_ms)``:

- the first collective (group, sequence number) not every member has entered names the culprits (the
  members that never entered it) and the waiters (those inside it). A member absent because it waits in a
  collective of another group is held up itself: where groups overlap (HSDP's shard pairs replicated
  over pairs), the culprit is a member absent and in no collective, the one the others' waits lead to;
- every member inside it: the collective itself does not complete (a link or NCCL problem);
- members in the same (group, sequence number) with different op, size or dtype: a desync.

A rank whose profiler window holds its events back is not stalled: the job is not hung while one is open.
The verdict itself (``hang_verdict``) reads only each rank's collective, so a job's Flight Recorder dumps,
turned into the same records (``producers/flight_dumps.py``), are judged by the same code. Each kind has a
name in the vocabulary of Meta's torchcomms analyzer (``VERDICTS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from fleetscope.streams.analysis.outliers import RankSignal

Heartbeat = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class _Entry:
    rank: int
    op: str
    nbytes: int
    inside: bool
    entered_ns: int
    sent_ns: int
    dtype: str = ""
    sizes: str = ""


class _Call(NamedTuple):
    """How a rank called a collective: what members must agree on (dtype and sizes where known)."""

    op: str
    nbytes: int
    dtype: str
    sizes: str

    def label(self) -> str:
        """``allreduce/4096``, with ``/Float/[[1024]]`` where the record names dtype and sizes."""
        return "/".join([self.op, str(self.nbytes)] + [x for x in (self.dtype, self.sizes) if x])


def _mismatch(calls: list[_Call]) -> list[str]:
    """What the members disagree on: ``op``, ``size`` (the shapes where known, else the bytes), ``dtype``."""
    out = ["op"] if len({c.op for c in calls}) > 1 else []
    sizes = {c.sizes for c in calls}
    if len(sizes) > 1 or (sizes == {""} and len({c.nbytes for c in calls}) > 1):
        out.append("size")
    if len({c.dtype for c in calls}) > 1:
        out.append("dtype")
    return out


def stalled_ns(hb: Heartbeat) -> int:
    """How long the rank has completed no step, on its own clock (0 before its first step)."""
    if int(hb["last_step"]) < 0 or int(hb["last_step_ns"]) <= 0:
        return 0
    return max(int(hb["sent_ns"]) - int(hb["last_step_ns"]), 0)


def stall_threshold_ns(mean_iteration_ns: float, stall_factor: float, min_stall_ms: int) -> float:
    """A rank is stalled after ``stall_factor`` of its mean iterations without progress, never sooner
    than ``min_stall_ms``: a slow job's ranks are not stalled for being slow."""
    return max(stall_factor * mean_iteration_ns, min_stall_ms * 1e6)


def job_stopped(latest: Mapping[int, Heartbeat], world_size: int, threshold_ns: float) -> bool:
    """Every rank reported, none is profiling, and none completed a step for ``threshold_ns``: each stalled
    on its own clock, or silent (its latest heartbeat that much older than the job's newest: a dead rank)."""
    if world_size < 1 or len(latest) < world_size:
        return False
    newest = max(int(hb["sent_ns"]) for hb in latest.values())
    return all(
        not hb.get("profiling", False)
        and (stalled_ns(hb) >= threshold_ns or newest - int(hb["sent_ns"]) >= threshold_ns)
        for hb in latest.values()
    )


VERDICTS = {
    "missing_member": "rank never joined",
    "collective_stuck": "stuck inside",
    "desync": "metadata mismatch",
    "outside_collectives": "stuck outside",
}
"""Each ``evidence["kind"]`` and its name in torchcomms' analyzer (JOB_STUCK_IN_NCCL_RANK_NOT_JOIN, ...)."""


def diagnose_hang(latest: Mapping[int, Heartbeat], world_size: int, threshold_ns: float) -> RankSignal | None:
    """The hang finding's signal when the job stopped progressing, else None (pure)."""
    if not job_stopped(latest, world_size, threshold_ns):
        return None
    return hang_verdict(latest, threshold_ns)


def snapshot_hang(latest: Mapping[int, Heartbeat], threshold_ns: float) -> RankSignal | None:
    """The verdict on one snapshot of the job (dumps written at a timeout): hung when some rank has been
    inside a collective for ``threshold_ns`` as of its snapshot, else None. A snapshot has no steps to
    tell a rank stopped outside collectives from a healthy one, so only a wait inside one counts."""
    if not any(
        hb.get("in_collective", False) and int(hb["sent_ns"]) - int(hb.get("collective_entered_ns", 0)) >= threshold_ns
        for hb in latest.values()
    ):
        return None
    return hang_verdict(latest, threshold_ns)


def hang_verdict(latest: Mapping[int, Heartbeat], threshold_ns: float) -> RankSignal:
    """Who holds up a job known to be stopped, from each rank's collective (pure)."""
    groups: dict[str, dict[int, _Entry]] = {}
    members: dict[str, tuple[int, ...]] = {}
    for rank, hb in latest.items():
        pg, seq = str(hb.get("collective_pg", "")), int(hb.get("collective_seq", -1))
        if not pg or seq < 0:
            continue
        known = tuple(int(r) for r in hb.get("collective_group_ranks") or ())
        if known:
            members[pg] = tuple(sorted(set(members.get(pg, ())) | set(known)))
        groups.setdefault(pg, {})[rank] = _Entry(
            rank=rank, op=str(hb.get("collective_op", "")), nbytes=int(hb.get("collective_nbytes", -1)),
            inside=bool(hb.get("in_collective", False)), entered_ns=int(hb.get("collective_entered_ns", 0)),
            sent_ns=int(hb["sent_ns"]), dtype=str(hb.get("collective_dtype", "")),
            sizes=str(hb.get("collective_sizes", "")),
        )  # fmt: skip
    busy = {r for r, hb in latest.items() if hb.get("in_collective", False)}
    candidates = []
    for pg, entries in groups.items():
        group = members.get(pg) or tuple(sorted(latest))
        seq = max(int(latest[r]["collective_seq"]) for r in entries)
        inside = [e for r, e in entries.items() if e.inside and int(latest[r]["collective_seq"]) == seq]
        if not inside:
            continue
        waited = max(e.sent_ns - e.entered_ns for e in inside)
        absent = [r for r in group if r not in {e.rank for e in inside}]
        blocking = bool(absent) and not busy.issuperset(absent)
        candidates.append((blocking, waited, pg, seq, group, inside))
    if not candidates:
        return _outside_collectives(latest, threshold_ns)
    _, waited, pg, seq, group, inside = max(candidates, key=lambda c: (c[0], c[1], c[2]))
    entered = sorted(e.rank for e in inside)
    missing = [r for r in group if r not in entered]
    evidence: dict[str, Any] = {
        "group": pg, "seq": seq, "entered": entered, "not_entered": missing, "waiting_ns": waited,
        "group_size": len(group), "last_step_by_rank": _compact({r: int(hb["last_step"]) for r, hb in latest.items()}),
    }  # fmt: skip
    shapes: dict[_Call, list[int]] = {}
    for e in inside:
        shapes.setdefault(_Call(e.op, e.nbytes, e.dtype, e.sizes), []).append(e.rank)
    if len(shapes) > 1:  # the same collective, called differently: ranks took different code paths
        call, _ = max(shapes.items(), key=lambda kv: (len(kv[1]), -min(kv[1])))
        op, nbytes = call.op, call.nbytes
        culprits = sorted(r for shape, ranks in shapes.items() if shape != call for r in ranks)
        evidence |= {"kind": "desync", "op": op, "nbytes": nbytes, "mismatch": _mismatch(list(shapes)),
                     "calls": {c.label(): sorted(rs) for c, rs in shapes.items()}}  # fmt: skip
    else:
        call = next(iter(shapes))
        op, nbytes = call.op, call.nbytes
        evidence |= {"op": op, "nbytes": nbytes}
        if missing:
            culprits = [r for r in missing if r not in busy] or missing
            evidence["kind"] = "missing_member"
            evidence["waiting_elsewhere"] = [r for r in missing if r in busy]
        else:  # everyone is inside and it does not complete: the transport, not a rank
            culprits = []
            evidence["kind"] = "collective_stuck"
    evidence["verdict"] = VERDICTS[evidence["kind"]]
    if unreported := [r for r in missing if r not in latest]:
        evidence["unreported"] = unreported  # no record of theirs at all (a snapshot's missing dump)
    ranks = tuple(culprits) or tuple(entered)
    first = ranks[0]
    host = str(latest[first]["host"]) if first in latest else ""
    return RankSignal(
        rank=first if len(ranks) == 1 else -1, host=host, category="hang", function=f"{op}#{pg}:{seq}",
        metric="waiting_ns", value=float(waited), peer_median=0.0, score=float(waited / max(threshold_ns, 1.0)),
        loss_ns=float(waited), evidence=evidence, ranks=ranks,
        subject=f"rank:{first}" if len(ranks) == 1 else "job",
    )  # fmt: skip


def _outside_collectives(latest: Mapping[int, Heartbeat], threshold_ns: float) -> RankSignal:
    """No rank waits in a collective: blame the rank that stopped first (its last step is the oldest)."""
    ages = {r: stalled_ns(hb) for r, hb in latest.items()}
    culprit = min(latest, key=lambda r: (int(latest[r]["last_step"]), -ages[r], r))
    return RankSignal(
        rank=culprit, host=str(latest[culprit]["host"]), category="hang", function="progress",
        metric="stalled_ns", value=float(ages[culprit]), peer_median=0.0,
        score=float(ages[culprit] / max(threshold_ns, 1.0)), loss_ns=float(ages[culprit]),
        subject=f"rank:{culprit}",
        evidence={"kind": "outside_collectives", "verdict": VERDICTS["outside_collectives"],
                  "last_step_by_rank": _compact({r: int(hb["last_step"]) for r, hb in latest.items()})},
    )  # fmt: skip


def _compact(by_rank: dict[int, int]) -> dict[str, list[int]]:
    """{value: ranks}: a few lines for thousands of ranks that mostly agree."""
    out: dict[str, list[int]] = {}
    for rank, value in sorted(by_rank.items()):
        out.setdefault(str(value), []).append(rank)
    return out
