import io
import struct

import numpy as np
import pytest
from fastavro import schemaless_writer
from hypothesis import given
from hypothesis import strategies as st

from fleetscope.schemas import (
    CATALOG,
    BatchHeader,
    EventBatch,
    EventKind,
    FunctionKind,
    SchemaError,
    bus_bandwidth_factor,
    classify_kernel,
    decode,
    decode_event_batch,
    encode,
    encode_event_batch,
    parse_step_marker,
)

HEADER = BatchHeader(job="job-1", rank=3, world_size=8, producer_id="p", seq=7, host="node000")


def kernels(n: int) -> EventBatch:
    return EventBatch(
        kind=EventKind.KERNELS,
        header=HEADER,
        names=["gemm", "flash_fwd_kernel"],
        columns={
            "start_ns": np.arange(n) * 10,
            "dur_ns": np.full(n, 5),
            "name_id": np.arange(n) % 2,
            "stream": np.full(n, 7),
            "launch_ns": np.arange(n) * 10 - 3,
        },
    )


@given(st.integers(0, 300))
def test_event_batches_round_trip(n):
    batch = kernels(n)
    back = decode_event_batch(encode_event_batch(batch))
    assert back.header == HEADER
    assert back.names == batch.names
    for name, col in batch.columns.items():
        assert np.array_equal(back[name], col)
        assert back[name].dtype == col.dtype


def test_wire_format_is_confluent_framing_with_the_newest_schema_id():
    msg = encode_event_batch(kernels(1))
    magic, schema_id = struct.unpack(">bI", msg[:5])
    assert magic == 0
    assert schema_id == CATALOG.latest("kernels").schema_id == 102


def test_a_batch_written_with_the_old_schema_decodes_with_the_new_one():
    """kernels v2 added launch_ns with a default; v1 writers' batches still decode."""
    v1 = CATALOG.by_id(101)
    record = kernels(3).to_record()
    del record["launch_ns"]
    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, 101))
    schemaless_writer(buf, v1.parsed, record)
    back = decode_event_batch(buf.getvalue())
    assert back["launch_ns"].size == 0  # unknown, so the windower falls back to start times
    assert np.array_equal(back["start_ns"], [0, 10, 20])


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"", "shorter"),
        (b"\x01\x00\x00\x00\x65abc", "magic"),
        (b"\x00\x00\x00\x03\xe7abc", "unknown schema id"),
        (b"\x00\x00\x00\x00\x66\xff\xff\xff", "malformed"),
    ],
)
def test_bad_messages_raise_schema_error_with_a_reason(message, reason):
    with pytest.raises(SchemaError, match=reason):
        decode(message)


def test_truncated_and_padded_messages_are_rejected():
    msg = encode_event_batch(kernels(50))
    with pytest.raises(SchemaError):
        decode(msg[:-7])
    with pytest.raises(SchemaError, match="trailing"):
        decode(msg + b"\x00")


def test_ids_outside_the_name_dictionary_are_rejected():
    record = kernels(2).to_record()
    record["name_id"] = [0, 5]
    with pytest.raises(SchemaError, match="outside"):
        decode_event_batch(encode("kernels", record))


def test_columns_of_unequal_length_are_rejected():
    with pytest.raises(ValueError, match="expected"):
        EventBatch(
            kind=EventKind.HOST,
            header=HEADER,
            names=["f"],
            columns={"start_ns": [1, 2], "dur_ns": [1], "name_id": [0, 0], "depth": [0, 0]},
        )


def test_every_catalog_schema_is_self_contained_json():
    import json

    for entry in CATALOG.entries():
        doc = json.loads(entry.json)
        assert doc["type"] == "record"
        assert "fleetscope.BatchHeader" not in entry.json or '"fields"' in entry.json


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (
            "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
            FunctionKind.COLLECTIVE,
        ),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", FunctionKind.COLLECTIVE),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", FunctionKind.COLLECTIVE),
        ("Memcpy HtoD (Pageable -> Device)", FunctionKind.MEMORY),
        ("Memset (Device)", FunctionKind.MEMORY),
        ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_tn", FunctionKind.COMPUTE),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
            FunctionKind.COMPUTE,
        ),
    ],
)
def test_classify_kernel_on_real_names(name, kind):
    assert classify_kernel(name) == kind


def test_step_markers_and_bus_bandwidth_factors():
    assert parse_step_marker("ProfilerStep#551") == 551
    assert parse_step_marker("ProfilerStep#x") is None
    assert parse_step_marker("Optimizer.step#SGD.step") is None
    assert bus_bandwidth_factor("allreduce", 8) == pytest.approx(1.75)
    assert bus_bandwidth_factor("_allgather_base", 4) == pytest.approx(0.75)
    assert bus_bandwidth_factor("broadcast", 4) == 1.0
