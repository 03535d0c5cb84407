"""One raw message into the windower: decode, validate, window; a dead-letter reason instead of a crash.

The windower agent calls ``intake`` once per message and only sends what it returns, so every way a
message can be bad is decided here, in a pure function the fuzz tests drive without Faust or Kafka.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fleetscope.schemas import EventBatch, EventKind, IntakeLimits, SchemaError, decode_event_batch
from fleetscope.streams import reasons
from fleetscope.streams.analysis.validation import batch_reach_ns, check_batch, check_clock_jump
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower, WindowerConfig

log = logging.getLogger(__name__)

_DEFAULT_LIMITS = IntakeLimits()


@dataclass(frozen=True, slots=True)
class IntakeResult:
    """What one message produced: closed iterations and the windower it touched, or a dead-letter reason.

    ``horizon_ns`` is the message's latest event time as the windower files events (launch for GPU work,
    start for host spans, sample time): once the rank's emitted iterations end after it, replaying the
    message after a crash would add nothing, so it may be acked."""

    closed: list[ClosedIteration] = field(default_factory=list)
    windower: RankWindower | None = None
    key: tuple[str, int] | None = None
    events: int = 0
    reason: str | None = None
    horizon_ns: int = -(2**63)


def intake(
    message: bytes | None,
    windowers: dict[tuple[str, int], RankWindower],
    now_ns: int,
    config: WindowerConfig | None,
    *,
    wall_ns: int,
    limits: IntakeLimits = _DEFAULT_LIMITS,
) -> IntakeResult:
    """Feed one raw message to its rank's windower (created on first sight); never raises.

    ``now_ns`` is the windower's processing clock (monotonic), ``wall_ns`` the wall clock the timestamp
    rules compare with. Reasons start with ``size:``, ``schema:``, ``header:``, ``value:`` or ``windower:``.
    An oversized message is refused before it is decoded: it costs its length check, not a decode."""
    size = len(message or b"")
    if size > limits.max_message_bytes:
        return IntakeResult(reason=f"size: message of {size} bytes > max_message_bytes {limits.max_message_bytes}")
    try:
        batch = decode_event_batch(message or b"")
    except SchemaError as exc:
        return IntakeResult(reason=reasons.reason("schema", exc))
    return intake_batch(batch, windowers, now_ns, config, wall_ns=wall_ns, limits=limits, paced=True)


def intake_batch(
    batch: EventBatch,
    windowers: dict[tuple[str, int], RankWindower],
    now_ns: int,
    config: WindowerConfig | None,
    *,
    wall_ns: int,
    limits: IntakeLimits = _DEFAULT_LIMITS,
    paced: bool = False,
) -> IntakeResult:
    """``intake`` of a batch already decoded (trace files read in-process): the same rules from validation on.

    ``paced``: a message from the broker, which anyone may write claiming any rank, also keeps its rank's
    pace (``pace_reason``); a trace file the operator hands in is whole and may span gaps of any length."""
    reason = check_batch(batch, wall_ns, limits)
    key = (batch.header.job, batch.header.rank)
    w = windowers.get(key)
    if reason is None and paced and w is not None:
        reason = pace_reason(batch, w, windowers, now_ns, limits, wall_ns=wall_ns)
    if reason is not None:
        return IntakeResult(reason=reason[: reasons.MAX_REASON_CHARS])
    if w is None:
        w = windowers[key] = RankWindower(config) if config is not None else RankWindower()
    try:
        closed = w.add(batch, now_ns)
    except Exception as exc:  # a windower bug must cost one message, not the stream
        log.warning("windower rejected a %s batch of %s rank %d: %r", batch.kind.value, *key, exc)
        return IntakeResult(windower=w, key=key, reason=reasons.reason("windower", exc))
    return IntakeResult(closed=closed, windower=w, key=key, events=len(batch), horizon_ns=horizon_ns(batch))


def pace_reason(
    batch: EventBatch,
    w: RankWindower,
    windowers: dict[tuple[str, int], RankWindower],
    now_ns: int,
    limits: IntakeLimits,
    *,
    wall_ns: int | None = None,
) -> str | None:
    """Why ``batch`` would jump its rank's clock (``check_clock_jump``), or None. The job's peers held here
    are looked at only for a batch ahead of its own rank: the common case costs no scan."""
    reach = batch_reach_ns(batch)
    if reach is None:
        return None
    quiet = now_ns - w.last_arrival_ns
    reason = check_clock_jump(reach, w.clock_ns, w.mean_iteration_ns, quiet, None, limits, wall_ns)
    if reason is None:
        return None
    job, rank = batch.header.job, batch.header.rank
    clocks = [c for (j, r), p in windowers.items() if j == job and r != rank and (c := p.clock_ns) is not None]
    peer = max(clocks, default=None)
    return check_clock_jump(reach, w.clock_ns, w.mean_iteration_ns, quiet, peer, limits, wall_ns)


def horizon_ns(batch: EventBatch) -> int:
    """Latest event time of a batch by the windower's filing rule (see ``IntakeResult``)."""
    if len(batch) == 0:
        return -(2**63)
    if batch.kind in (EventKind.KERNELS, EventKind.COLLECTIVES):
        launch = batch["launch_ns"]
        times = launch if launch.size == len(batch) else batch["start_ns"]
    elif batch.kind is EventKind.HOST:
        times = batch["start_ns"]
    else:
        times = batch["t_ns"]
    return int(times.max())
