"""The tables of the ClickHouse store (their DDL is ``sql/*.sql``) and each one's natural key."""

from __future__ import annotations

ITERATIONS = "iterations"
FUNCTION_PATTERNS = "function_patterns"
FINDING_UPDATES = "finding_updates"
FINDINGS = "findings"
"""The view with the current state of each finding."""
TABLES = (ITERATIONS, FUNCTION_PATTERNS, FINDING_UPDATES)

NATURAL_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    ITERATIONS: (("job", "String"), ("rank", "Int32"), ("iteration", "Int64")),
    FUNCTION_PATTERNS: (("job", "String"), ("rank", "Int32"), ("iteration", "Int64")),
    FINDING_UPDATES: (("job", "String"), ("finding_id", "String"), ("version", "Int64")),
}
"""Per table, the record fields (and ClickHouse types) naming one source message's rows: one iteration,
one PatternBatch, one finding state change. A record whose key is stored already is a replay."""

FINDING_COLUMNS = (
    "job",
    "finding_id",
    "status",
    "version",
    "rank",
    "ranks",
    "host",
    "category",
    "function",
    "metric",
    "value",
    "peer_median",
    "score",
    "iteration_first",
    "iteration_last",
    "est_loss_ns",
    "evidence",
    "first_seen_ns",
    "last_seen_ns",
    "subject",
    "reason",
    "local_rank",
    "gpu_uuid",
    "pci_bus_id",
)
"""What ``current_findings`` reads from the ``findings`` view, in this order."""
