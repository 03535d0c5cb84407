"""Producers: everything that creates events on a node and sends them to Kafka.

In: activity of a training rank (here: a simulated TP x PP x DP fleet with injected faults).
Out: ``EventBatch`` es (kernels, collectives, python, throughput), published by ``Publisher`` as Avro
messages on the raw topics, keyed ``job/rank``. Producers speak to the rest of the pipeline only through
``fleetscope.schemas``; they never import ``streams`` or ``sinks``.
"""

from fleetscope.producers.kineto import TraceError, TraceRank, parse_trace
from fleetscope.producers.publisher import Publisher, PublisherConfig, PublisherStats
from fleetscope.producers.simulation import (
    FAULT_KINDS,
    HOST_FUNCTIONS,
    ExpectedFinding,
    Fault,
    SimulatorConfig,
    parse_fault,
    simulate,
)

__all__ = [
    "FAULT_KINDS",
    "HOST_FUNCTIONS",
    "ExpectedFinding",
    "Fault",
    "Publisher",
    "PublisherConfig",
    "PublisherStats",
    "SimulatorConfig",
    "TraceError",
    "TraceRank",
    "parse_fault",
    "parse_trace",
    "simulate",
]
