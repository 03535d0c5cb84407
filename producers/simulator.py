"""The fleet simulator's public surface; the implementation lives in ``fleetscope.producers.simulation``.

Kept as a module so ``from fleetscope.producers.simulator import ...`` keeps working.
"""

from fleetscope.producers.simulation import (
    ALL_STREAMS,
    CATEGORIES,
    COMPUTE_STREAM,
    DEFAULT_FACTORS,
    DEFAULT_START_NS,
    FAULT_KINDS,
    HOST_FUNCTIONS,
    MAX_BATCH_EVENTS,
    METRICS,
    ExpectedFinding,
    Fault,
    SimulatorConfig,
    gpu_uuid,
    parse_fault,
    simulate,
)

__all__ = [
    "ALL_STREAMS",
    "CATEGORIES",
    "COMPUTE_STREAM",
    "DEFAULT_FACTORS",
    "DEFAULT_START_NS",
    "FAULT_KINDS",
    "HOST_FUNCTIONS",
    "MAX_BATCH_EVENTS",
    "METRICS",
    "ExpectedFinding",
    "Fault",
    "SimulatorConfig",
    "gpu_uuid",
    "parse_fault",
    "simulate",
]
