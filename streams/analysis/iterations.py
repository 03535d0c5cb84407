"""Iteration boundaries when a rank has no step markers (pure, incremental detectors).

1. ``HostSequenceDetector`` (PerfTracker): an iteration runs from the first ``dataloader.next`` to
   the last ``optimizer.step``; the sequence of those calls is learned after ``repeats`` identical
   segments and re-learned after ``relearn_events`` unmatched events (eval phases, code changes).
2. ``CollectivePeriodDetector`` (Greyhound-style): the per-rank sequence of collectives repeats every
   iteration; its period comes from the collective keys (or from the idle gaps when every key is
   alike), its phase from the largest gap (the forward pass between two iterations' collectives).
   Iterations are numbered from collective sequence numbers, which every member of a process group
   shares, so iteration N means the same on every rank whatever the clocks say.

Both emit complete spans ``(iteration, start_ns, end_ns)``; the partial iteration before the first
boundary is never emitted (truncated).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.vocabulary import host_phase

Span = tuple[int, int, int]


@dataclass
class HostSequenceDetector:
    repeats: int = 10
    relearn_events: int = 200
    signature: tuple[int, int] | None = None
    _segment: list[tuple[str, int, int]] = field(default_factory=list)
    _learning: list[tuple[tuple[int, int], int, int]] = field(default_factory=list)
    _open_start: int | None = None
    _next_iteration: int = 0
    _unmatched: int = 0

    def feed(self, names: list[str], start: npt.NDArray[np.int64], end: npt.NDArray[np.int64]) -> list[Span]:
        """Take host spans in time order; return the iterations they completed."""
        out: list[Span] = []
        for name, s, e in zip(names, start.tolist(), end.tolist(), strict=True):
            phase = host_phase(name)
            if phase == "dataloader" and any(host_phase(n) == "optimizer" for n, _, _ in self._segment):
                out += self._close_segment(next_start=s)
            if phase is not None or self._segment:
                self._segment.append((name, s, e))
        return out

    def finish(self) -> list[Span]:
        """The input ended: a last segment that ends with optimizer.step is a complete iteration."""
        if self._segment and host_phase(self._segment[-1][0]) == "optimizer":
            last_end = max(e for _, _, e in self._segment)
            return self._close_segment(next_start=last_end)
        return []

    def _close_segment(self, next_start: int) -> list[Span]:
        seg, self._segment = self._segment, []
        phases = Counter(host_phase(n) for n, _, _ in seg)
        sig = (phases["dataloader"], phases["optimizer"])
        start = seg[0][1]
        if self.signature is None:
            self._learning.append((sig, start, next_start))
            recent = self._learning[-self.repeats :]
            if len(recent) == self.repeats and len({s for s, _, _ in recent}) == 1:
                self.signature = sig
                self._learning = []
                return [self._span(s, e) for _, s, e in recent]
            return []
        if sig == self.signature:
            self._unmatched = 0
            return [self._span(start, next_start)]
        self._unmatched += len(seg)
        if self._unmatched >= self.relearn_events:
            self.signature, self._unmatched = None, 0
        return []

    def _span(self, start: int, end: int) -> Span:
        span = (self._next_iteration, start, end)
        self._next_iteration += 1
        return span


@dataclass
class CollectivePeriodDetector:
    max_period: int = 256
    min_repeats: int = 3
    period: int = 0
    phase_seq: int = 0
    _key: list[int] = field(default_factory=list)
    _seq: list[int] = field(default_factory=list)
    _start: list[int] = field(default_factory=list)
    _end: list[int] = field(default_factory=list)
    _emitted_upto: int = -1

    def feed(
        self,
        key: npt.NDArray[np.int64],
        seq: npt.NDArray[np.int64],
        start: npt.NDArray[np.int64],
        end: npt.NDArray[np.int64],
    ) -> list[Span]:
        """Take collectives in time order (``key`` identifies op/group/size); return complete iterations."""
        self._key += key.tolist()
        self._seq += seq.tolist()
        self._start += start.tolist()
        self._end += end.tolist()
        if not self.period and not self._lock():
            return []
        return self._emit()

    def _lock(self) -> bool:
        keys = np.asarray(self._key)
        n = keys.size
        if n < 2 * self.min_repeats:
            return False
        gaps = np.diff(np.asarray(self._start)) if n > 1 else np.zeros(0)
        period = 0
        for p in range(1, min(self.max_period, n // self.min_repeats) + 1):
            tail = keys[-self.min_repeats * p :]
            if np.array_equal(tail[:-p], tail[p:]):
                period = p
                break
        if period == 1:  # every key alike: the period is the spacing of the large gaps, if any
            big = np.flatnonzero(gaps > 3 * np.median(gaps))
            if big.size:
                if big.size < self.min_repeats:
                    return False
                period = int(np.median(np.diff(big)))
        if period < 1 or n < self.min_repeats * period:
            return False
        residues = (np.arange(1, n)) % period
        mean_gap = np.bincount(residues, weights=gaps, minlength=period) / np.maximum(
            np.bincount(residues, minlength=period), 1
        )
        first = int(np.argmax(mean_gap))  # index (mod period) of an iteration's first collective
        self.period = period
        self.phase_seq = self._seq[first]
        return True

    def _emit(self) -> list[Span]:
        out: list[Span] = []
        p, seqs = self.period, np.asarray(self._seq)
        group = (seqs - self.phase_seq) // p
        for g in np.unique(group):
            if g <= self._emitted_upto:
                continue
            members = np.flatnonzero(group == g)
            prev = np.flatnonzero(group == g - 1)
            if members.size < p or prev.size == 0:
                continue
            start = self._end[int(prev[-1])]
            end = self._end[int(members[-1])]
            out.append((int(g), start, end))
            self._emitted_upto = int(g)
        keep = max(0, len(self._key) - 2 * p)
        self._key, self._seq = self._key[keep:], self._seq[keep:]
        self._start, self._end = self._start[keep:], self._end[keep:]
        return out
