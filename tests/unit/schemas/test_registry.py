"""Schema ids through a schema registry: the same logical records as the embedded catalog.

No schema-registry server installs on this machine, so the registry is a stand-in: a stdlib HTTP server on
127.0.0.1 that implements the two endpoints confluent-kafka's ``SchemaRegistryClient`` calls here
(``POST /subjects/{subject}/versions`` and ``GET /schemas/ids/{id}``) with Confluent's semantics: one id
per distinct schema across subjects, ids counted from 1, 404 with error code 40403 for an unknown id.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from fastavro import parse_schema, schemaless_writer

from fleetscope.broker import free_port
from fleetscope.schemas import (
    CATALOG,
    BatchHeader,
    EventBatch,
    EventKind,
    SchemaError,
    decode,
    decode_event_batch,
    encode,
    encode_event_batch,
)
from fleetscope.schemas.codec import use_resolver
from fleetscope.schemas.registry import (
    CatalogResolver,
    RegistryConfig,
    RegistryError,
    RegistryResolver,
    schema_text,
)

pytest.importorskip("confluent_kafka.schema_registry", reason="pip install 'fleetscope[registry]'")


class RegistryStandIn:
    """The registry endpoints the client uses, in memory, on a free loopback port."""

    def __init__(self, username: str = "", password: str = "") -> None:
        self.schemas: dict[int, str] = {}
        self.subjects: dict[str, list[int]] = {}
        self.requests: list[tuple[str, str]] = []
        self._auth = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode() if username else ""
        self._lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:  # keep test output clean
                pass

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                if stand_in._auth and self.headers.get("Authorization") != stand_in._auth:
                    self._reply(401, {"error_code": 401, "message": "Unauthorized"})
                    return False
                return True

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                path = urlsplit(self.path).path
                stand_in.requests.append(("POST", path))
                if not self._authorised():
                    return
                parts = path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "subjects" or parts[2] != "versions":
                    self._reply(404, {"error_code": 404, "message": f"no route {path}"})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("schemaType", "AVRO") != "AVRO":
                    self._reply(422, {"error_code": 42201, "message": "only AVRO here"})
                    return
                self._reply(200, {"id": stand_in.register(unquote(parts[1]), body["schema"])})

            def do_GET(self) -> None:  # noqa: N802
                path = urlsplit(self.path).path
                stand_in.requests.append(("GET", path))
                if not self._authorised():
                    return
                parts = path.strip("/").split("/")
                if len(parts) == 3 and parts[:2] == ["schemas", "ids"] and parts[2].isdigit():
                    text = stand_in.schemas.get(int(parts[2]))
                    if text is not None:
                        self._reply(200, {"schema": text})
                        return
                    self._reply(404, {"error_code": 40403, "message": f"Schema {parts[2]} not found"})
                    return
                self._reply(404, {"error_code": 404, "message": f"no route {path}"})

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def register(self, subject: str, text: str) -> int:
        """Confluent semantics: the same schema gets the same id under every subject."""
        canonical = json.dumps(json.loads(text), sort_keys=True)
        with self._lock:
            same = [
                i for i, known in self.schemas.items() if json.dumps(json.loads(known), sort_keys=True) == canonical
            ]
            schema_id = same[0] if same else len(self.schemas) + 1
            self.schemas.setdefault(schema_id, text)
            versions = self.subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
        return schema_id

    def __enter__(self) -> RegistryStandIn:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def registry() -> Iterator[RegistryStandIn]:
    with RegistryStandIn() as stand_in:
        yield stand_in


def resolver_for(registry: RegistryStandIn, **kwargs: Any) -> RegistryResolver:
    return RegistryResolver(RegistryConfig(url=registry.url, topic_prefix="fs", **kwargs))


HEADER = BatchHeader(job="job-1", rank=3, world_size=8, producer_id="p", seq=7, host="node000")


def kernel_batch() -> EventBatch:
    return EventBatch(
        kind=EventKind.KERNELS,
        header=HEADER,
        names=["gemm", "flash_fwd_kernel"],
        columns={
            "start_ns": np.arange(5) * 10,
            "dur_ns": np.full(5, 5),
            "name_id": np.arange(5) % 2,
            "stream": np.full(5, 7),
            "launch_ns": np.arange(5) * 10 - 3,
        },
    )


FINDING = {
    "finding_id": "j/gpu_slow/3/0",
    "status": "open",
    "version": 1,
    "job": "j",
    "rank": 3,
    "ranks": [3],
    "host": "node000",
    "category": "gpu_slow",
    "function": "gemm",
    "metric": "mean_ns",
    "value": 2.0e6,
    "peer_median": 1.4e6,
    "score": 52.0,
    "iteration_first": 0,
    "iteration_last": 9,
    "est_loss_ns": 40_000_000,
    "evidence": "{}",
    "emitted_ns": 1_767_225_600_000_000_000,
    "subject": "rank:3",
    "reason": "",
    "local_rank": 3,
    "gpu_uuid": "GPU-0f3c",
    "pci_bus_id": "00000000:3B:00.0",
}

ITERATION = {
    "job": "j",
    "rank": 3,
    "host": "node000",
    "world_size": 8,
    "tp_rank": -1,
    "pp_rank": -1,
    "dp_rank": 3,
    "iteration": 4,
    "detected_by": "step_marker",
    "start_ns": 1,
    "end_ns": 130_000_001,
    "duration_ns": 130_000_000,
    "gpu_busy_ns": 120_000_000,
    "compute_ns": 80_000_000,
    "collective_ns": 40_000_000,
    "exposed_collective_ns": 30_000_000,
    "idle_ns": 10_000_000,
    "max_idle_gap_ns": 2_000_000,
    "kernels": 100,
    "functions": 12,
    "profiled": False,
    "local_rank": 3,
    "gpu_uuid": "GPU-0f3c",
    "cpu_wait_ns": 21_000_000,
}


def test_registry_path_decodes_the_same_records_as_the_catalog_path(registry: RegistryStandIn) -> None:
    producer, consumer = resolver_for(registry), resolver_for(registry)
    for subject, record in (("findings", FINDING), ("iterations", ITERATION)):
        via_catalog = encode(subject, record)
        via_registry = encode(subject, record, resolver=producer)
        assert via_registry[5:] == via_catalog[5:], "same Avro body, only the schema id differs"
        assert decode(via_registry, resolver=consumer) == decode(via_catalog) == (subject, record)

    batch = kernel_batch()
    previous = use_resolver(producer)
    try:
        message = encode_event_batch(batch)
        use_resolver(consumer)
        back = decode_event_batch(message)
    finally:
        use_resolver(previous)
    reference = decode_event_batch(encode_event_batch(batch))
    assert back.header == reference.header and back.names == reference.names
    for name, column in reference.columns.items():
        assert np.array_equal(back[name], column) and back[name].dtype == column.dtype


def test_producers_register_clean_schemas_under_topic_value_subjects(registry: RegistryStandIn) -> None:
    resolver = resolver_for(registry)
    ids = resolver.register_catalog()

    assert set(registry.subjects) == {f"fs.{s}-value" for s in CATALOG.subjects()}
    assert sorted(ids.values()) == list(range(1, len(ids) + 1)), "the registry's ids, not the catalog's"
    message = encode("findings", FINDING, resolver=resolver)
    assert struct.unpack(">bI", message[:5]) == (0, ids["findings"])
    for text in registry.schemas.values():
        assert "__" not in text, "fastavro's private keys must not reach the registry"
        parse_schema(json.loads(text))
    kernels = json.loads(registry.schemas[ids["kernels"]])
    assert kernels["name"] == "fleetscope.KernelBatch"
    assert any("default" in f for f in kernels["fields"]), "defaults are kept for compatibility checks"
    assert schema_text(CATALOG.latest("kernels")) == registry.schemas[ids["kernels"]]


def test_ids_and_schemas_are_asked_once_then_cached(registry: RegistryStandIn) -> None:
    producer, consumer = resolver_for(registry), resolver_for(registry)
    messages = [encode("findings", FINDING | {"version": v}, resolver=producer) for v in range(5)]
    for message in messages:
        decode(message, resolver=consumer)
    assert registry.requests.count(("POST", "/subjects/fs.findings-value/versions")) == 1
    assert [r for r in registry.requests if r[0] == "GET"] == [("GET", f"/schemas/ids/{messages[0][4]}")]


def test_an_older_writer_schema_in_the_registry_resolves_to_the_newest_reader(
    registry: RegistryStandIn,
) -> None:
    v1 = CATALOG.by_id(101)
    assert v1 is not None and v1.subject == "kernels" and CATALOG.latest("kernels").version == 2
    old_id = registry.register("fs.kernels-value", schema_text(v1))
    record = {k: v for k, v in kernel_batch().to_record().items() if k in {f["name"] for f in v1.parsed["fields"]}}
    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, old_id))
    schemaless_writer(buf, v1.parsed, record)
    catalog_framed = struct.pack(">bI", 0, 101) + buf.getvalue()[5:]

    resolver = resolver_for(registry)
    assert resolver.writer_schema(old_id).version == 1
    assert decode(buf.getvalue(), resolver=resolver) == decode(catalog_framed)


def test_an_unknown_id_is_a_bad_message_but_an_unreachable_registry_is_not(
    registry: RegistryStandIn,
) -> None:
    with pytest.raises(SchemaError, match="not in the schema registry"):
        decode(struct.pack(">bI", 0, 999) + b"\x00", resolver=resolver_for(registry))

    down = RegistryResolver(RegistryConfig(url=f"http://127.0.0.1:{free_port()}", timeout_s=1, max_retries=0))
    with pytest.raises(RegistryError) as raised:
        decode(struct.pack(">bI", 0, 1) + b"\x00", resolver=down)
    assert not isinstance(raised.value, SchemaError), "a consumer must not dead-letter good messages"
    with pytest.raises(RegistryError):
        encode("findings", FINDING, resolver=down)


def test_a_foreign_record_in_the_registry_is_a_bad_message(registry: RegistryStandIn) -> None:
    foreign = registry.register("other-value", json.dumps({"type": "record", "name": "x.Y", "fields": []}))
    with pytest.raises(SchemaError, match="no fleetscope topic"):
        decode(struct.pack(">bI", 0, foreign), resolver=resolver_for(registry))


def test_basic_auth_credentials_reach_the_registry_and_are_never_in_repr() -> None:
    with RegistryStandIn(username="svc", password="s3cret") as secured:
        with pytest.raises(RegistryError, match="401"):
            resolver_for(secured).schema_id("findings")
        resolver = resolver_for(secured, username="svc", password="s3cret")
        message = encode("findings", FINDING, resolver=resolver)
        assert decode(message, resolver=resolver_for(secured, username="svc", password="s3cret"))[1] == FINDING
        assert "s3cret" not in repr(resolver.config)


def test_the_catalog_resolver_is_the_embedded_default() -> None:
    resolver = CatalogResolver()
    assert resolver.schema_id("kernels") == 102
    assert encode("findings", FINDING, resolver=resolver) == encode("findings", FINDING)
    with pytest.raises(SchemaError, match="unknown schema id"):
        resolver.writer_schema(5)


def test_registry_config_rejects_bad_urls_and_lone_passwords() -> None:
    with pytest.raises(ValueError, match="url"):
        RegistryConfig(url="registry:8081")
    with pytest.raises(ValueError, match="password"):
        RegistryConfig(url="http://r:8081", password="x")
