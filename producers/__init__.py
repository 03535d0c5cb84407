"""Producers: everything that creates events on a node and sends them to Kafka.

In: activity of a training rank (here: a simulated TP x PP x DP fleet with injected faults).
Out: ``EventBatch`` es (kernels, collectives, python, throughput), published by ``Publisher`` as Avro
messages on the raw topics, keyed ``job/rank``. Producers speak to the rest of the pipeline only through
``fleetscope.schemas``; they never import ``streams`` or ``sinks``.
"""

from typing import Any

from fleetscope.schemas.lazy import load_export

_EXPORTS = {
    "TraceError": "kineto",
    "TraceRank": "kineto",
    "parse_trace": "kineto",
    "Publisher": "publisher",
    "PublisherConfig": "publisher",
    "PublisherStats": "publisher",
    "FAULT_KINDS": "simulation",
    "HOST_FUNCTIONS": "simulation",
    "ExpectedFinding": "simulation",
    "Fault": "simulation",
    "SimulatorConfig": "simulation",
    "parse_fault": "simulation",
    "simulate": "simulation",
}
"""Public name -> submodule, imported on first use: a training rank that imports the torch hook loads
neither the simulator nor the trace parser."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name)
