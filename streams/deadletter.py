"""The stages' dead-letter topic: what a stage refuses goes there whole (or cut to the size limit), with
its reason and where it came from in the headers, and is counted."""

from __future__ import annotations

import faust
from faust.types import Message

from fleetscope.streams.counters import StageCounters


class DeadLetters:
    """Sends refused messages to the dead-letter topic and counts them by reason."""

    def __init__(self, topic: faust.TopicT, counters: StageCounters, max_message_bytes: int) -> None:
        self.topic = topic
        self.counters = counters
        self.max_message_bytes = max_message_bytes

    async def send(self, msg: Message, reason: str) -> None:
        """Send the message as it came (its key and value bytes) with ``reason``."""
        self.counters.dead_letter(reason)
        headers = {
            "reason": reason.encode(),
            "topic": str(msg.topic).encode(),
            "partition": str(msg.partition).encode(),
            "offset": str(msg.offset).encode(),
        }
        value = msg.value
        if value is not None and len(value) > self.max_message_bytes:  # the raw topic keeps it whole
            headers["truncated_from_bytes"] = str(len(value)).encode()
            value = value[: self.max_message_bytes]
        await self.topic.send(key=msg.key, value=value, headers=headers)
