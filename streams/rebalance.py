"""What a rebalance changes for the stream stages: the epoch of in-memory state, the idle rules' clock, which
fetched messages still count, and the acks the stages take over from Faust (see ``recovery``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import faust
from faust.types import EventT, Message


@dataclass
class Gate:
    """Which in-memory state is current. ``epoch`` moves when partitions are revoked (their state is
    dropped): a batch that started in another epoch must neither record state nor ack. ``paused`` lasts
    from the revocation to the new assignment, whose seek to the committed offsets redelivers everything."""

    epoch: int = 0
    paused: bool = False


class InputClock:
    """Processing time that runs only while every agent of the worker waits for input.

    The idle rules (a rank's steps close after ``idle_close_ms`` without a batch, a job is flushed after
    ``job_idle_ms``) stand for "no more data is coming". Under a backlog (a restart re-reading its
    uncommitted offsets, a worker that fell behind) a rank's next batch can wait in the consumer longer
    than that, and wall time would close its steps with events missing; a job's next pattern record waits
    for the windower. This clock stands still while any agent works, so only real silence counts; and
    while this worker's partitions are being reassigned (a worker joined, left or died): until the new
    owners have restored their state and caught up, the ranks of moved partitions are late, not silent."""

    def __init__(self) -> None:
        self._banked = 0
        self._busy = 0
        self._since = time.monotonic_ns()
        self._rebalancing = False

    def now_ns(self) -> int:
        return self._banked + (time.monotonic_ns() - self._since if self._busy == 0 else 0)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Stop the clock while an agent works on a batch."""
        self.working()
        try:
            yield
        finally:
            self.waiting()

    def rebalancing(self, on: bool) -> None:
        """Stop the clock from a revocation to the next assignment (idempotent: Faust may signal twice)."""
        if on and not self._rebalancing:
            self.working()
        elif not on and self._rebalancing:
            self.waiting()
        self._rebalancing = on

    def working(self) -> None:
        if self._busy == 0:
            self._banked += time.monotonic_ns() - self._since
        self._busy += 1

    def waiting(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._since = time.monotonic_ns()


def take_over(events: Iterable[EventT], app: faust.App, gate: Gate) -> list[EventT]:
    """Keep Faust from acking ``events`` when the batch ends (the stage acks them) and return the ones it
    should process: none while paused, and none fetched before the last rebalance (they come again)."""
    events = list(events)
    for event in events:
        event.message.incref()
    if gate.paused:
        return []
    generation = app.consumer_generation_id
    return [e for e in events if e.message.generation_id == generation]


def ack(messages: Iterable[Message], app: faust.App) -> None:
    for message in messages:
        message.ack(app.consumer)
