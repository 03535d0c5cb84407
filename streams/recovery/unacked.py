"""Messages a stage keeps un-acked until replaying them could change nothing."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import Generic, TypeVar

from faust.types import Message

K = TypeVar("K")

EARLIEST = -(2**63)
"""Horizon of a message that nothing later depends on: taken by the next ``take_harmless``."""


class UnackedMessages(Generic[K]):
    """Messages kept un-acked per owner (a rank, a job), each with the horizon past which it is harmless."""

    def __init__(self) -> None:
        self._held: dict[K, list[tuple[int, int, Message]]] = {}
        self._order = itertools.count()

    def keep(self, owner: K, horizon: int, message: Message) -> None:
        heapq.heappush(self._held.setdefault(owner, []), (horizon, next(self._order), message))

    def take_harmless(self, owner: K, below: int) -> list[Message]:
        """Pop the owner's messages whose horizon is below ``below``."""
        heap = self._held.get(owner)
        out: list[Message] = []
        while heap and heap[0][0] < below:
            out.append(heapq.heappop(heap)[2])
        if heap is not None and not heap:
            del self._held[owner]
        return out

    def take_all(self, owner: K) -> list[Message]:
        return [m for _, _, m in self._held.pop(owner, [])]

    def forget(self, owners: Iterable[K]) -> None:
        """Drop the owners' messages without acking them (their partitions were revoked)."""
        for owner in owners:
            self._held.pop(owner, None)

    def owners(self) -> list[K]:
        return list(self._held)

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())
