"""The whole pipeline with a schema registry: producers, the Faust worker (another process, configured by
``kafka.registry_url``) and the sink frame messages with registry ids and find the same fault.

The registry is the stdlib stand-in of tests/unit/schemas/test_registry.py (no registry server installs on
this machine), on 127.0.0.1, reachable from the worker process."""

from __future__ import annotations

import importlib.util
import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from fleetscope.cli import main
from fleetscope.config import load_config
from fleetscope.demo import run_demo
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.schemas import CATALOG, Topics
from fleetscope.schemas.codec import use_resolver

pytestmark = pytest.mark.integration
pytest.importorskip("confluent_kafka.schema_registry", reason="pip install 'fleetscope[registry]'")


def _stand_in_class() -> Any:
    path = Path(__file__).resolve().parents[1] / "unit" / "schemas" / "test_registry.py"
    spec = importlib.util.spec_from_file_location("_registry_stand_in", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RegistryStandIn


def test_the_pipeline_finds_the_same_fault_with_registry_ids(
    broker: str, tmp_path: Path, chdb_path: Path, database: str
) -> None:
    prefix = f"sr{uuid.uuid4().hex[:6]}"
    with _stand_in_class()() as registry:
        config = load_config(
            env={},
            overrides={
                "data_dir": str(tmp_path),
                "store.url": f"chdb://{chdb_path}",
                "store.database": database,
                "kafka.bootstrap_servers": broker,
                "kafka.topic_prefix": prefix,
                "kafka.registry_url": registry.url,
            },
        )
        config_file = tmp_path / "fleetscope.json"
        config_file.write_text(json.dumps(config.to_dict()))
        previous = use_resolver(None)
        try:
            # `fleetscope init` creates the topics and registers every schema before anything runs; its
            # process set-up installs the registry resolver, as in every fleetscope process.
            assert main(["init", "--config", str(config_file)]) == 0
            assert set(registry.subjects) == {f"{prefix}.{s}-value" for s in CATALOG.subjects()}
            sim = SimulatorConfig(job="sr-job", ranks=8, iterations=10, faults=(parse_fault("slow_gpu:6:1.5"),))
            result = run_demo(config, sim, Progress(enabled=False), timeout_s=120)
        finally:
            use_resolver(previous)

        assert [(f["rank"], f["category"]) for f in result.findings] == [(6, "gpu_slow")]
        subjects = set(registry.subjects)
        for subject in (
            "kernels",
            "collectives",
            "python",
            "throughput",
            "iterations",
            "patterns",
            "findings",
        ):
            assert f"{prefix}.{subject}-value" in subjects, subject
        fetched = {path for method, path in registry.requests if method == "GET"}
        assert fetched, "consumers resolved writer schemas through the registry"

        topic = Topics(prefix=prefix).findings
        consumer = Consumer({"bootstrap.servers": broker, "group.id": f"peek-{prefix}"})
        try:  # assign, not subscribe: no group join to wait for
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
            msg = None
            for _ in range(50):
                msg = consumer.poll(0.2)
                if msg is not None and msg.error() is None:
                    break
        finally:
            consumer.close()
        assert msg is not None and msg.value() is not None
        magic, schema_id = struct.unpack(">bI", msg.value()[:5])
        assert magic == 0 and schema_id in registry.schemas
        assert registry.subjects[f"{prefix}.findings-value"] == [schema_id]
        assert schema_id != CATALOG.latest("findings").schema_id
