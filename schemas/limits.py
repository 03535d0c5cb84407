"""Bounds every raw message must respect: part of the contract, so a producer refuses what the intake
would dead-letter instead of shipping it."""

from __future__ import annotations

from dataclasses import dataclass

CLOCKS = frozenset({"realtime"})
"""Clock labels a batch header may carry. ``realtime``: nanoseconds since the Unix epoch (wall clock),
which the intake's timestamp rules check; a label outside this set is refused, never trusted."""


@dataclass(frozen=True, kw_only=True)
class IntakeLimits:
    """Upper bounds on one raw message; each violation is dead-lettered with its reason.

    ``max_message_bytes`` defaults to Kafka's own default message size; kernel names (C++ templates) are
    long, labels (job, host, cluster, producer id, GPU UUID, stream kinds) short."""

    max_message_bytes: int = 1_000_000
    max_events_per_batch: int = 200_000
    max_world_size: int = 1_048_576
    max_label_chars: int = 256
    max_name_chars: int = 8_192
    max_clock_jump_ms: int = 60_000
    """How far one message's events may reach past its rank's clock (the latest event end the rank sent)
    at the least; more where the rank's iterations are long (``clock_jump_iterations``) or where the rank
    was quiet (its clock may move as far as the time it was silent). A clock's real jump is rarer than a
    forged one: refused too, until ``clock_step_accept_ms``."""
    clock_jump_iterations: int = 20
    """A message may reach this many of the rank's recent mean iterations past its clock."""
    clock_step_accept_ms: int = 60_000
    """A rank that had no message accepted for this long (input clock) gets its jump accepted: every batch
    of a host whose clock really stepped is ahead, while a forger's batches leave the real ones in pace.
    The longest a real clock step blinds a rank."""

    def __post_init__(self) -> None:
        errors = [
            f"{name} must be >= {low}, got {getattr(self, name)}"
            for name, low in (
                ("max_message_bytes", 1_024),
                ("max_events_per_batch", 1),
                ("max_world_size", 1),
                ("max_label_chars", 16),
                ("max_name_chars", 64),
                ("max_clock_jump_ms", 1_000),
                ("clock_jump_iterations", 1),
                ("clock_step_accept_ms", 1_000),
            )
            if getattr(self, name) < low
        ]
        if errors:
            raise ValueError("; ".join(errors))
