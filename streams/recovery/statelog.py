"""State records: the latest value per key in a compacted topic partitioned like the stage's source.

A value larger than a message may be (a job of a thousand ranks keeps megabytes of noise history; Kafka
refuses messages over its ``max.message.bytes``, 1 MB by default) is written in chunks under keys of its
own, then a manifest under the key. Chunks alternate between two slots, each write in the slot the
current manifest does not name, and the manifest follows them once they are delivered: a worker that dies
mid-write leaves the previous value whole.
"""

from __future__ import annotations

import logging
import struct
import time
import uuid
import zlib
from collections.abc import Collection

import faust
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

log = logging.getLogger(__name__)

_FENCE_KEY = b"\x00fence"
_CHUNK_KEY = b"\x00chunk"
_MANIFEST = b"\x00chunked\x00"
_MANIFEST_FIELDS = struct.Struct(">BIQI")
"""slot, chunks, total bytes, CRC-32 of the value."""
_CHUNK_INDEX = struct.Struct(">BI")
CHUNK_BYTES = 512 * 1024
"""Values above this are written in chunks of it: well under Kafka's default message size with its key."""


def chunk_key(key: bytes, slot: int, index: int) -> bytes:
    return _CHUNK_KEY + _CHUNK_INDEX.pack(slot, index) + key


def chunked(key: bytes, value: bytes, slot: int, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[bytes, bytes]]:
    """The records that hold ``value`` under ``key``: its chunks in ``slot``, then the manifest."""
    parts = [value[at : at + chunk_bytes] for at in range(0, len(value), chunk_bytes)]
    manifest = _MANIFEST + _MANIFEST_FIELDS.pack(slot, len(parts), len(value), zlib.crc32(value))
    return [(chunk_key(key, slot, i), part) for i, part in enumerate(parts)] + [(key, manifest)]


def joined(records: dict[bytes, bytes]) -> tuple[dict[bytes, bytes], dict[bytes, int], list[bytes]]:
    """The latest records of a partition read back: values by key (chunked ones put together, chunks left
    out), the slot each chunked key's manifest names, and the keys whose chunks are missing or damaged."""
    values: dict[bytes, bytes] = {}
    slots: dict[bytes, int] = {}
    broken: list[bytes] = []
    for key, value in records.items():
        if key.startswith(_CHUNK_KEY):
            continue
        if not value.startswith(_MANIFEST) or len(value) != len(_MANIFEST) + _MANIFEST_FIELDS.size:
            values[key] = value
            continue
        slot, n, total, crc = _MANIFEST_FIELDS.unpack_from(value, len(_MANIFEST))
        parts = [records.get(chunk_key(key, slot, i)) for i in range(n)]
        whole = b"".join(p for p in parts if p is not None)
        if None in parts or len(whole) != total or zlib.crc32(whole) != crc:
            broken.append(key)
            continue
        values[key] = whole
        slots[key] = slot
    return values, slots, broken


class RecoveryError(RuntimeError):
    """A stage could not read its state records; it must not run without them."""


class StateLog:
    """One stage's state records: latest value per key in a compacted topic partitioned like its source."""

    def __init__(
        self,
        app: faust.App,
        name: str,
        partitions: int,
        bootstrap_servers: str,
        read_timeout_s: float = 30.0,
        chunk_bytes: int = CHUNK_BYTES,
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
        self.chunk_bytes = chunk_bytes
        self.writes = 0
        self._declared = False
        self._slots: dict[bytes, int] = {}
        """Per chunked key, the slot its latest manifest names (the next write goes to the other)."""

    async def write(self, partition: int, key: bytes, value: bytes) -> None:
        """Queue a record in the producer; Faust delivers it before it commits any later ack. A value over
        ``chunk_bytes`` goes in chunks, delivered before its manifest is queued."""
        if len(value) <= self.chunk_bytes:
            await self.topic.send(key=key, value=value, partition=partition)
            self.writes += 1
            return
        slot = 1 - self._slots.get(key, 1)
        *chunks, (_, manifest) = chunked(key, value, slot, self.chunk_bytes)
        sent = [await self.topic.send(key=k, value=v, partition=partition) for k, v in chunks]
        for delivered in sent:
            await delivered
        await self.topic.send(key=key, value=manifest, partition=partition)
        self._slots[key] = slot
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
        for p, records in out.items():
            out[p], slots, broken = joined(records)
            self._slots.update(slots)
            for key in broken:
                log.error("%s: the chunks of state record %r are missing or damaged; it is left out", self.name, key)
        return out
