"""The Avro contract between producers, streams and sinks.

In: Python records (``EventBatch``, ``dict`` records for iterations/patterns/findings).
Out: bytes in the Confluent wire format (magic byte 0, 4-byte schema id, schemaless Avro body).
Everything that crosses a topic goes through ``codec.encode``/``codec.decode`` and nothing else.
"""

from fleetscope.schemas.catalog import CATALOG, SchemaCatalog
from fleetscope.schemas.codec import (
    SchemaError,
    decode,
    decode_event_batch,
    decode_event_batches,
    encode,
    encode_event_batch,
)
from fleetscope.schemas.limits import CLOCKS, IntakeLimits
from fleetscope.schemas.records import (
    COLUMNS,
    SPAN_CPU_WAIT_DEPTH,
    THREAD_BUSY_DEPTH,
    BatchHeader,
    EventBatch,
    EventKind,
    FunctionKind,
)
from fleetscope.schemas.topics import Topics
from fleetscope.schemas.vocabulary import (
    CATEGORIES,
    CPU_WAIT,
    GC_PAUSE,
    PROFILING_WINDOW,
    Category,
    bus_bandwidth_factor,
    classify_kernel,
    is_cpu_wait,
    is_profiling_window,
    parse_step_marker,
    step_marker_name,
)

__all__ = [
    "CATALOG",
    "CATEGORIES",
    "CLOCKS",
    "COLUMNS",
    "CPU_WAIT",
    "SPAN_CPU_WAIT_DEPTH",
    "THREAD_BUSY_DEPTH",
    "Category",
    "BatchHeader",
    "EventBatch",
    "EventKind",
    "FunctionKind",
    "GC_PAUSE",
    "PROFILING_WINDOW",
    "IntakeLimits",
    "SchemaCatalog",
    "SchemaError",
    "Topics",
    "bus_bandwidth_factor",
    "classify_kernel",
    "decode",
    "decode_event_batch",
    "decode_event_batches",
    "encode",
    "encode_event_batch",
    "is_cpu_wait",
    "is_profiling_window",
    "parse_step_marker",
    "step_marker_name",
]
