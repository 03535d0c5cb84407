"""One iteration's differential split by function: shards that each hold some functions' columns, one merge.

A 100k-GPU job's iterations exceed one core (docs/scaling.md), and most of the scoring is per function:
turning the records' lists into matrices and each column's peer statistics. So the functions are dealt
to shards by a stable hash of their name (``shard_of``: every rank's entries of one function, and every
iteration's, go to the same shard); each shard builds its columns (``outliers.score_columns``), and the
merge (``outliers.merge_columns``) puts the shards' columns back in the order one unsharded build gives
them, where the per-rank tests sum across functions. The order matters: a row sum adds its columns in
memory order, so the same columns in the same order give the same roundings, and the merged result is
the unsharded one exactly (a test, on the quality suite's jobs).

The order is each column's first appearance, reading ranks in order: the row of the first rank that has
the function, then its position in that rank's whole list (``position``, which ``split_records`` adds to
each shard's copy of a record). Row and position say where a column goes without any shard seeing the
others' names.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.schemas.records import PATTERN_TIMELINE_FIELDS
from fleetscope.streams.analysis.peermatrix import PeerMatrices, PeerMatrix
from fleetscope.streams.analysis.stats import F64, I64, RobustScores

POSITION = "position"
"""The field of a shard's record that holds each entry's position in the rank's whole list."""
_WHOLE = frozenset({POSITION, *PATTERN_TIMELINE_FIELDS})
"""Lists a shard's copy keeps whole: they are not per function (the timeline is per call), whatever their length."""


def shard_of(function: str, shards: int) -> int:
    """The shard of a function: CRC-32 of its name (stable across processes and runs, unlike ``hash``)."""
    return zlib.crc32(function.encode()) % shards


def split_records(records: Sequence[dict[str, Any]], shards: int) -> list[list[dict[str, Any]]]:
    """Each shard's copy of every record: the rank's fields, and of its per-function lists the entries of
    the shard's functions, with their positions in the whole list (``POSITION``). What a windower keyed by
    (job, shard) would send; every rank has a record in every shard, empty where it has none of its functions.
    """
    cache: dict[str, int] = {}
    out: list[list[dict[str, Any]]] = [[] for _ in range(shards)]
    for rec in records:
        names = rec["function"]
        n = len(names)
        shard = np.fromiter(
            (cache[f] if f in cache else cache.setdefault(f, shard_of(f, shards)) for f in names), np.int64, n
        )
        listed = [k for k, v in rec.items() if k not in _WHOLE and not isinstance(v, str) and _sized(v, n)]
        for k in range(shards):
            keep = np.flatnonzero(shard == k).tolist()
            part = {name: v for name, v in rec.items() if name not in listed}
            for name in listed:
                values = rec[name]
                part[name] = [values[j] for j in keep]
            part[POSITION] = [rec[POSITION][j] for j in keep] if POSITION in rec else keep
            out[k].append(part)
    return out


def _sized(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple, np.ndarray)) and len(value) == n


@dataclass(slots=True)
class Columns:
    """One block's matrices (every rank, or one peer group) and, per kind, each column's place in the
    unsharded order: (row of first appearance, position in that rank's whole list)."""

    pms: PeerMatrices
    keys: dict[int, tuple[I64, I64]]


@dataclass(slots=True)
class ShardColumns:
    """What one shard hands the merge: its columns for every rank and for each peer group (None where
    the group is too small to score, ``whole`` itself where the group is every rank)."""

    whole: Columns
    groups: list[Columns | None] = field(default_factory=list)


def first_keys(
    pms: PeerMatrices,
    records: Sequence[dict[str, Any]],
    rows: I64,
    row_ids: list[I64] | None = None,
    names: list[str] | None = None,
) -> dict[int, tuple[I64, I64]]:
    """Each column's (row, position) of first appearance among ``rows`` (``pms`` holds those rows).

    ``row_ids`` and ``names`` (from ``gather`` and its ``FunctionIndex``): every row's function ids, so
    rows of one layout share one array, and the scan stops once every column is placed."""
    needed = {f for pm in pms.by_kind.values() for f in pm.functions}
    first: dict[str, tuple[int, int]] = {}
    done: set[int] = set()
    for r in rows.tolist():
        if len(first) == len(needed):
            break
        rec = records[r]
        if row_ids is not None and names is not None:
            if id(row_ids[r]) in done:
                continue
            done.add(id(row_ids[r]))
            listed = [names[i] for i in row_ids[r].tolist()]
        else:
            listed = rec["function"]
        pos = rec.get(POSITION)
        for j, name in enumerate(listed):
            if name in needed and name not in first:
                first[name] = (r, pos[j] if pos is not None else j)
    keys = {}
    for k, pm in pms.by_kind.items():
        placed = [first[f] for f in pm.functions]
        keys[k] = (
            np.fromiter((p[0] for p in placed), np.int64, len(placed)),
            np.fromiter((p[1] for p in placed), np.int64, len(placed)),
        )
    return keys


def assemble(parts: Sequence[Columns]) -> PeerMatrices:
    """The shards' columns of one block as one set of matrices, each kind's columns in the unsharded order,
    each matrix laid out as its parts (column-major from ``gather``), cached column scores included."""
    first = parts[0].pms
    if len(parts) == 1:
        return first
    by_kind: dict[int, PeerMatrix] = {}
    for k in first.by_kind:
        pms = [p.pms.of_kind(k) for p in parts]
        rows = np.concatenate([p.keys[k][0] for p in parts])
        pos = np.concatenate([p.keys[k][1] for p in parts])
        order = np.lexsort((pos, rows))
        functions = [f for pm in pms for f in pm.functions]
        # a built part has every feature; a gathered one some, some of them on demand: the ones all parts have
        names = [
            name
            for name in dict.fromkeys(name for pm in pms for name in pm.features)
            if all(name in pm.features or name in pm.on_demand for pm in pms)
        ]
        every = np.arange(first.ranks.size)
        features = {
            name: _columns(
                [pm.features[name] if name in pm.features else pm.on_demand[name](every) for pm in pms], order
            )
            for name in names
        }
        lazy = [name for name in pms[0].on_demand if name not in features]
        on_demand = {name: _fetch_columns([pm.on_demand[name] for pm in pms], order) for name in lazy}
        scores = {}
        for name in pms[0].scores:
            if all(name in pm.scores for pm in pms):
                got = [pm.scores[name] for pm in pms]
                scores[name] = RobustScores(
                    median=np.concatenate([s.median for s in got])[order],
                    scale=np.concatenate([s.scale for s in got])[order],
                    z=_columns([s.z for s in got], order),
                    rel_gap=_columns([s.rel_gap for s in got], order),
                )
        by_kind[k] = PeerMatrix(
            ranks=first.ranks,
            hosts=first.hosts,
            functions=[functions[j] for j in order.tolist()],
            kind=np.concatenate([pm.kind for pm in pms])[order],
            iteration_ns=first.iteration_ns,
            features=features,
            on_demand=on_demand,
            scores=scores,
        )
    return PeerMatrices(first.ranks, first.hosts, first.iteration_ns, by_kind)


def _columns(parts: list[F64], order: I64) -> F64:
    """(ranks x columns) parts side by side, columns reordered; column-major where every part is."""
    if all(p.flags.f_contiguous for p in parts):
        return np.ascontiguousarray(np.concatenate([p.T for p in parts])[order]).T
    return np.concatenate(parts, axis=1)[:, order]


def _fetch_columns(fetches: list[Callable[[I64], F64]], order: I64) -> Callable[[I64], F64]:
    return lambda rows: _columns([fetch(rows) for fetch in fetches], order)
