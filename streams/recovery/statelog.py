"""State records: the latest value per key in a compacted topic partitioned like the stage's source."""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection

import faust
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

_FENCE_KEY = b"\x00fence"


class RecoveryError(RuntimeError):
    """A stage could not read its state records; it must not run without them."""


class StateLog:
    """One stage's state records: latest value per key in a compacted topic partitioned like its source."""

    def __init__(
        self, app: faust.App, name: str, partitions: int, bootstrap_servers: str, read_timeout_s: float = 30.0
    ) -> None:
        self.name = name
        self.topic = app.topic(
            name,
            partitions=partitions,
            compacting=True,
            internal=True,
            key_serializer="raw",
            value_serializer="raw",
        )
        self.bootstrap_servers = bootstrap_servers
        self.security = dict(credentials_to_aiokafka_auth(app.conf.broker_credentials))
        """The app's own SASL/TLS settings, as aiokafka arguments: the reader talks to the same brokers."""
        self.read_timeout_s = read_timeout_s
        self.writes = 0
        self._declared = False

    async def write(self, partition: int, key: bytes, value: bytes) -> None:
        """Queue a record in the producer; Faust delivers it before it commits any later ack."""
        await self.topic.send(key=key, value=value, partition=partition)
        self.writes += 1

    def consumer(self) -> AIOKafkaConsumer:
        """The reader's consumer (not started; needs a running event loop), secured like the app."""
        return AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers, enable_auto_commit=False, **self.security)

    async def read(self, partitions: Collection[int]) -> dict[int, dict[bytes, bytes]]:
        """The latest record of every key in ``partitions``, read up to a fence written now.

        A fence, not the high watermark: Tansu reports the base offset of the last batch as the end."""
        if not self._declared:
            await self.topic.maybe_declare()
            self._declared = True
        token = uuid.uuid4().bytes
        for p in partitions:
            delivered = await self.topic.send(key=_FENCE_KEY, value=token, partition=p)
            await delivered
        out: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}
        consumer = self.consumer()
        await consumer.start()
        try:
            tps = [TopicPartition(self.name, p) for p in partitions]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            waiting = set(partitions)
            deadline = time.monotonic() + self.read_timeout_s
            while waiting:
                if time.monotonic() > deadline:
                    raise RecoveryError(
                        f"{self.name}: no fence in partitions {sorted(waiting)} after {self.read_timeout_s} s"
                    )
                for tp, records in (await consumer.getmany(*tps, timeout_ms=500)).items():
                    for rec in records:
                        if rec.key == _FENCE_KEY:
                            if rec.value == token:
                                waiting.discard(tp.partition)
                        elif tp.partition in waiting and rec.key is not None and rec.value is not None:
                            out[tp.partition][rec.key] = rec.value
        finally:
            await consumer.stop()
        return out
