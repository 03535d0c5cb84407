"""A seeded, deterministic simulated training fleet (TP x PP x DP) with fault injection.

In: a ``SimulatorConfig`` (layout, physics, noise, faults). Out: each rank's ``EventBatch`` es (kernels,
collectives, python, throughput), iteration by iteration, and ``expected_findings()``: the ground truth.

Modules: ``faults`` (kinds, spec grammar), ``config`` (the job, its layout, the ground truth), ``engine``
(the physics of one iteration, vectorised across ranks), ``samples`` (NVML-style link throughput),
``emit`` (per-rank batches), ``fleet`` (faults and noise per iteration, ``simulate``).
"""

from fleetscope.producers.simulation.config import DEFAULT_START_NS, ExpectedFinding, SimulatorConfig
from fleetscope.producers.simulation.emit import ALL_STREAMS, COMPUTE_STREAM, MAX_BATCH_EVENTS, gpu_uuid
from fleetscope.producers.simulation.faults import (
    CATEGORIES,
    DEFAULT_FACTORS,
    FAULT_KINDS,
    HOST_FUNCTIONS,
    Fault,
    parse_fault,
)
from fleetscope.producers.simulation.fleet import simulate
from fleetscope.producers.simulation.samples import METRICS

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
