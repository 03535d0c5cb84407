"""One iteration's pattern records as (ranks x functions) matrices, one set per kind of function.

The records arrive as decoded from Avro: per rank, parallel Python lists (``function``, ``kind`` and
one list per feature). At 10,240 ranks x 300 functions each list is 3 M Python objects, and turning
them into arrays is most of the differential's cost. Every test reads the functions of one kind
(compute kernels, collectives, host functions), so ``PeerMatrices.gather``:

1. interns function names once per job, not per iteration (``FunctionIndex``): a rank's names usually
   equal its previous iteration's, or another rank's, and comparing two lists of strings costs a
   fraction of hashing every freshly decoded string;
2. converts a feature only for the kinds that read it (``reads``: kind -> features): whole lists when
   those kinds are most of the entries, else the entries picked by an ``itemgetter`` cached with the
   record's layout (link features: collectives only);
3. fills one (ranks x functions-of-that-kind) matrix per kind and feature, columns in first-seen
   order and column-major, as ``PeerMatrix.build`` then a column selection per kind gives them (the
   memory order decides the order of additions in row sums: same order, same roundings);
4. selects a peer group's rows, and the columns its ranks have, from those matrices (``rows``).

Assumes that a function has one kind in an iteration and appears once per record; where not,
``gather`` returns None and the caller falls back to ``PeerMatrix.build``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from fleetscope.streams.analysis.stats import F64, I64, RobustScores

Picker = Callable[[Sequence[Any]], Sequence[Any]]

PICK_SHARE = 0.4
"""Picking entries out of a list costs about twice converting them: below this share of entries it pays."""


def _picker(positions: list[int]) -> Picker:
    """A slice where the positions run on (the windower lists each kind's functions together)."""
    if not positions:
        return lambda values: ()
    if positions[-1] - positions[0] == len(positions) - 1:
        return operator.itemgetter(slice(positions[0], positions[-1] + 1))
    if len(positions) == 1:
        only = positions[0]

        def one(values: Sequence[Any]) -> tuple[Any, ...]:
            return (values[only],)

        return one
    return operator.itemgetter(*positions)


@dataclass(frozen=True, slots=True)
class _Part:
    """A layout's entries of one kind: their positions, their ids, and a picker for them."""

    positions: I64
    ids: I64
    pick: Picker


@dataclass(slots=True, eq=False)
class _Layout:
    """One record's function names and kinds, their job-wide ids, and its entries by kind."""

    names: list[str]
    kinds: list[int]
    ids: I64
    kind: I64
    unique: bool
    parts: dict[int, _Part] = field(default_factory=dict)

    def matches(self, names: list[str], kinds: list[int]) -> bool:
        return self.kinds == kinds and self.names == names

    def part(self, kind: int) -> _Part:
        got = self.parts.get(kind)
        if got is None:
            pos = np.flatnonzero(self.kind == kind)
            got = self.parts[kind] = _Part(pos, self.ids[pos], _picker(pos.tolist()))
        return got


class FunctionIndex:
    """Job-wide ids of function names and each rank's last layout, kept across the job's iterations.

    A cache: it pickles empty, so the differential's state records stay small.
    """

    def __init__(self, max_names: int = 1 << 20) -> None:
        self.max_names = max_names
        self.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        return (FunctionIndex, (self.max_names,))

    def clear(self) -> None:
        """Forget every name: ids start again from 0."""
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self._by_rank: dict[int, _Layout] = {}
        self._by_head: dict[tuple[Any, ...], _Layout] = {}
        self._shards: dict[int, FunctionIndex] = {}

    def shard(self, k: int) -> FunctionIndex:
        """The index of the job's shard ``k`` (``shards.split_records``): each shard's layouts apart."""
        got = self._shards.get(k)
        if got is None:
            got = self._shards[k] = FunctionIndex(self.max_names)
        return got

    def trim(self) -> None:
        """Forget everything once names keep changing (e.g. a name per step): ids stay bounded."""
        if len(self.names) > self.max_names:
            self.clear()

    def layout(self, rank: int, names: list[str], kinds: list[int]) -> _Layout:
        """The layout of these names and kinds: the rank's previous one or a recent one when equal."""
        lay = self._by_rank.get(rank)
        if lay is None or not lay.matches(names, kinds):
            head = (len(names), names[0], names[-1]) if names else (0,)
            lay = self._by_head.get(head)
            if lay is None or not lay.matches(names, kinds):
                lay = self._by_head[head] = self._new_layout(names, kinds)
            self._by_rank[rank] = lay
        return lay

    def _new_layout(self, names: list[str], kinds: list[int]) -> _Layout:
        ids = list(map(self._ids.get, names))
        if None in ids:
            for j, name in enumerate(names):
                if ids[j] is None:
                    ids[j] = self._ids.setdefault(name, len(self.names))
                    if ids[j] == len(self.names):
                        self.names.append(name)
        return _Layout(
            names=[self.names[i] for i in ids],  # type: ignore[index]  # the index's strings: no decoded copies held
            kinds=list(kinds),
            ids=np.fromiter(ids, dtype=np.int64, count=len(ids)),
            kind=np.fromiter(kinds, dtype=np.int64, count=len(kinds)),
            unique=len(set(ids)) == len(ids),
        )


@dataclass(slots=True)
class PeerMatrix:
    """Pattern records of one peer group in one iteration as (ranks x functions) matrices."""

    ranks: I64
    hosts: list[str]
    functions: list[str]
    kind: I64
    iteration_ns: F64
    features: dict[str, F64]
    on_demand: dict[str, Callable[[I64], F64]] = field(default_factory=dict)
    """Features that ``gather`` converts only for the rows asked (``feature_rows``)."""
    scores: dict[str, RobustScores] = field(default_factory=dict)
    """Column scores of features, once computed (``scored``): a shard computes them, the merge reads them."""

    def scored(self, name: str, scorer: Callable[[F64], RobustScores]) -> RobustScores:
        """The scores of feature ``name`` against each column's peers, computed once."""
        got = self.scores.get(name)
        if got is None:
            got = self.scores[name] = scorer(self.features[name])
        return got

    def feature_rows(self, name: str, rows: I64) -> F64:
        """These rows of one feature, converted now where ``gather`` left it for when it is needed."""
        if name in self.features:
            return self.features[name][rows]
        return self.on_demand[name](rows)

    @classmethod
    def build(cls, records: Sequence[dict[str, Any]], features: Iterable[str]) -> PeerMatrix:
        """Every entry of every feature, names interned afresh: the general case, and the reference.

        1. Intern function names in first-seen order (one C-level pass over every record's names);
        2. one (row, column) index pair per pattern entry; 3. scatter each feature's concatenated
        values into its NaN-filled matrix in one assignment (rank order kept: a later rank's kind wins).
        """
        names = [rec["function"] for rec in records]
        fid = {f: j for j, f in enumerate(dict.fromkeys(chain.from_iterable(names)))}
        lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
        total = int(lengths.sum())
        cols = np.fromiter(map(fid.__getitem__, chain.from_iterable(names)), dtype=np.int64, count=total)
        rows = np.repeat(np.arange(len(records), dtype=np.int64), lengths)
        n, m = len(records), len(fid)
        kind = np.full(m, -1, dtype=np.int64)
        kind[cols] = _concat(records, "kind", lengths, total, np.int64)
        mats = {}
        for name in features:
            mats[name] = np.full((n, m), np.nan)
            mats[name][rows, cols] = _concat(records, name, lengths, total, np.float64)
        return cls(
            ranks=np.array([r["rank"] for r in records], dtype=np.int64),
            hosts=[r["host"] for r in records],
            functions=list(fid),
            kind=kind,
            iteration_ns=np.array([r["iteration_ns"] for r in records], dtype=np.float64),
            features=mats,
        )

    def columns(self, cols: I64, features: Iterable[str]) -> PeerMatrix:
        """These columns (in this order) of these features."""
        return PeerMatrix(
            ranks=self.ranks,
            hosts=self.hosts,
            functions=[self.functions[j] for j in cols.tolist()],
            kind=self.kind[cols],
            iteration_ns=self.iteration_ns,
            features={name: self.features[name][:, cols] for name in features},
        )


@dataclass(slots=True)
class PeerMatrices:
    """One peer group's matrices by kind of function: ``of_kind(k)`` holds the functions of kind k.

    From ``gather`` only: ``row_ids`` (each row's job-wide function ids in its record's order),
    ``column_of`` and ``kind_of`` (each id's column within its kind's matrix, and its kind).
    """

    ranks: I64
    hosts: list[str]
    iteration_ns: F64
    by_kind: dict[int, PeerMatrix]
    row_ids: list[I64] | None = None
    column_of: I64 | None = None
    kind_of: I64 | None = None

    def of_kind(self, kind: int) -> PeerMatrix:
        """The functions of this kind (none when absent or not read)."""
        got = self.by_kind.get(kind)
        if got is None:
            empty = np.zeros(0, dtype=np.int64)
            got = PeerMatrix(self.ranks, self.hosts, [], empty, self.iteration_ns, {})
        return got

    @classmethod
    def split(cls, pm: PeerMatrix, reads: Mapping[int, Sequence[str]]) -> PeerMatrices:
        """Matrices of ``PeerMatrix.build`` cut by kind: each kind's columns, in their order."""
        by_kind = {k: pm.columns(np.flatnonzero(pm.kind == k), names) for k, names in reads.items()}
        return cls(ranks=pm.ranks, hosts=pm.hosts, iteration_ns=pm.iteration_ns, by_kind=by_kind)

    @classmethod
    def gather(
        cls,
        records: Sequence[dict[str, Any]],
        reads: Mapping[int, Sequence[str]],
        index: FunctionIndex | None = None,
        on_demand: Mapping[int, Sequence[str]] | None = None,
    ) -> PeerMatrices | None:
        """The matrices of ``split(PeerMatrix.build(records))``, converting only what ``reads`` names,
        and ``on_demand`` (features of kinds in ``reads`` that a test needs for a few rows only) when
        asked; None where a function has two kinds or appears twice in a record.

        1. Each record's layout from the job's index; 2. ids in first-seen order, one kind each
        (checked on the distinct layouts); 3. per kind, its ids' columns and the cell of each of
        its entries, from each layout's part of that kind; 4. per feature, its values (whole lists
        or each part picked) scattered into each reading kind's NaN-filled, column-major matrix.
        """
        index = index if index is not None else FunctionIndex()
        index.trim()
        n = len(records)
        layouts: list[_Layout] = []
        for rec in records:
            names, kinds = _as_list(rec["function"]), _as_list(rec["kind"])
            if len(kinds) != len(names):
                raise ValueError("pattern column 'kind' is not as long as the record's functions")
            lay = index.layout(int(rec["rank"]), names, kinds)
            if not lay.unique:
                return None
            layouts.append(lay)
        row_ids = [lay.ids for lay in layouts]
        n_ids = len(index.names)
        distinct = list({id(lay): lay for lay in layouts}.values())
        kind_of = np.full(n_ids, -1, dtype=np.int64)
        if distinct:
            ids_d, kinds_d = np.concatenate([d.ids for d in distinct]), np.concatenate([d.kind for d in distinct])
            kind_of[ids_d] = kinds_d
            if not np.array_equal(kind_of[ids_d], kinds_d):
                return None
        order = _first_seen(row_ids, n_ids)
        column_of = np.full(n_ids, -1, dtype=np.int64)
        lengths = np.fromiter((ids.size for ids in row_ids), dtype=np.int64, count=n)
        total = int(lengths.sum())
        offsets = np.cumsum(lengths) - lengths
        row_numbers = np.arange(n, dtype=np.int64)
        ranks = np.array([r["rank"] for r in records], dtype=np.int64)
        hosts = [r["host"] for r in records]
        iteration_ns = np.array([r["iteration_ns"] for r in records], dtype=np.float64)
        parts: dict[int, list[_Part]] = {}
        cells: dict[int, I64] = {}  # kind -> each of its entries' cell in its (columns x ranks) buffer
        by_kind: dict[int, PeerMatrix] = {}
        for k in reads:
            ids = order[kind_of[order] == k]
            column_of[ids] = np.arange(ids.size)
            parts[k] = [lay.part(k) for lay in layouts]
            counts = np.fromiter((p.ids.size for p in parts[k]), dtype=np.int64, count=n)
            ids_k = np.concatenate([p.ids for p in parts[k]]) if n else np.zeros(0, dtype=np.int64)
            cells[k] = column_of[ids_k]
            cells[k] *= n
            cells[k] += np.repeat(row_numbers, counts)
            functions = [index.names[i] for i in ids.tolist()]
            by_kind[k] = PeerMatrix(ranks, hosts, functions, np.full(ids.size, k, dtype=np.int64), iteration_ns, {})
        feature_kinds: dict[str, list[int]] = {}
        for k, wanted in reads.items():
            for name in wanted:
                feature_kinds.setdefault(name, []).append(k)
        for name, kinds in feature_kinds.items():
            columns = [rec[name] for rec in records]
            if n and not np.array_equal(np.fromiter(map(len, columns), dtype=np.int64, count=n), lengths):
                raise ValueError(f"pattern column {name!r} is not as long as the record's functions")
            whole = None
            if n and all(isinstance(c, np.ndarray) for c in columns):  # decoded or windowed: no object per value
                whole = np.concatenate(columns).astype(np.float64, copy=False)
            elif sum(cells[k].size for k in kinds) > PICK_SHARE * total:
                whole = np.fromiter(chain.from_iterable(columns), dtype=np.float64, count=total)
            for k in kinds:
                if whole is not None:
                    counts = np.fromiter((p.positions.size for p in parts[k]), dtype=np.int64, count=n)
                    positions = np.concatenate([p.positions for p in parts[k]]) if n else counts
                    positions += np.repeat(offsets, counts)
                    values = whole[positions]
                else:
                    picked = chain.from_iterable(map(operator.call, [p.pick for p in parts[k]], columns))
                    values = np.fromiter(picked, dtype=np.float64, count=cells[k].size)
                m = len(by_kind[k].functions)
                mat = np.full(m * n, np.nan)
                mat[cells[k]] = values
                by_kind[k].features[name] = mat.reshape(m, n).T
        for k, wanted in (on_demand or {}).items():
            for name in wanted:
                columns = [rec[name] for rec in records]
                if n and not np.array_equal(np.fromiter(map(len, columns), dtype=np.int64, count=n), lengths):
                    raise ValueError(f"pattern column {name!r} is not as long as the record's functions")
                block = by_kind[k]
                block.on_demand[name] = _fetcher(columns, parts[k], column_of, len(block.functions))
        return cls(ranks, hosts, iteration_ns, by_kind, row_ids, column_of, kind_of)

    def rows(self, rows: I64) -> PeerMatrices:
        """The peer group of these rows: the functions that any of them has, in their first-seen order."""
        if rows.size == self.ranks.size and np.array_equal(rows, np.arange(rows.size)):
            return self
        if self.row_ids is None or self.column_of is None or self.kind_of is None:
            raise ValueError("a subset of rows needs matrices from gather()")
        order = _first_seen([self.row_ids[i] for i in rows.tolist()], self.column_of.size)
        ranks, hosts = self.ranks[rows], [self.hosts[i] for i in rows.tolist()]
        by_kind = {}
        for k, pm in self.by_kind.items():
            cols = self.column_of[order[self.kind_of[order] == k]]
            sub = np.ix_(cols, rows)
            by_kind[k] = PeerMatrix(
                ranks=ranks,
                hosts=hosts,
                functions=[pm.functions[j] for j in cols.tolist()],
                kind=pm.kind[cols],
                iteration_ns=self.iteration_ns[rows],
                features={name: x.T[sub].T for name, x in pm.features.items()},
                on_demand={name: _subset(fetch, rows, cols) for name, fetch in pm.on_demand.items()},
            )
        return PeerMatrices(ranks, hosts, self.iteration_ns[rows], by_kind)


def _fetcher(columns: list[Any], parts: list[_Part], column_of: I64, m: int) -> Callable[[I64], F64]:
    """Rows of one feature of one kind, converted when asked: each row's part picked from its column."""

    def fetch(rows: I64) -> F64:
        out = np.full((rows.size, m), np.nan)
        for i, r in enumerate(rows.tolist()):
            part = parts[r]
            out[i, column_of[part.ids]] = np.fromiter(part.pick(columns[r]), dtype=np.float64, count=part.ids.size)
        return out

    return fetch


def _subset(fetch: Callable[[I64], F64], rows: I64, cols: I64) -> Callable[[I64], F64]:
    return lambda wanted: fetch(rows[wanted])[:, cols]


def _as_list(values: Any) -> list[Any]:
    if isinstance(values, list):
        return values
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def _first_seen(row_ids: list[I64], n_ids: int) -> I64:
    """Ids in order of first appearance, reading rows in order; a row sharing an earlier row's
    array adds nothing, and the scan stops once every id is seen."""
    seen = np.zeros(n_ids, dtype=bool)
    done: set[int] = set()
    out: list[I64] = []
    found = 0
    for ids in row_ids:
        if found == n_ids:
            break
        if id(ids) in done:
            continue
        done.add(id(ids))
        new = ids[~seen[ids]]
        if new.size:
            seen[new] = True
            out.append(new)
            found += new.size
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def _concat(
    records: Sequence[dict[str, Any]], name: str, lengths: I64, total: int, dtype: type[np.generic]
) -> np.ndarray:
    """Every record's ``name`` column end to end; each must be as long as the record's functions."""
    cols = [rec[name] for rec in records]
    if any(len(c) != k for c, k in zip(cols, lengths.tolist(), strict=True)):
        raise ValueError(f"pattern column {name!r} is not as long as the record's functions")
    if all(isinstance(c, list) for c in cols):
        return np.fromiter(chain.from_iterable(cols), dtype=dtype, count=total)
    return np.concatenate([np.asarray(c, dtype=dtype) for c in cols]) if cols else np.zeros(0, dtype)
