"""Which function each event of a batch of iterations is: kernels by name, collectives by (op, process group,
size class), host spans by name, and a launch wait where kernels carry launch times (pure, numpy).

Functions are numbered across the batch, iteration by iteration: its kernels, its collectives, its host
functions, then its launch wait. The numbering depends only on the events' names and sizes, which repeat from
step to step of a training job, so a rank's name table keeps the last plans by their inputs' bytes
(``FunctionPlans``): a step like one before costs a dictionary look-up, not the numbering.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import FunctionKind
from fleetscope.schemas.vocabulary import LAUNCH_WAIT_FUNCTION

I64 = npt.NDArray[np.int64]

_COLLECTIVE = int(FunctionKind.COLLECTIVE)
_PLANS_KEPT = 64
"""Plans a rank keeps (its recent steps' shapes); past that it starts afresh."""


@dataclass(frozen=True, slots=True)
class FunctionPlan:
    """A batch's functions (read-only arrays): per iteration, per function and per event."""

    n: int
    """Functions in the batch."""
    n_fn: I64
    first_fn: I64
    """Per iteration: its functions, and the first one's number."""
    wait_at: I64
    """Per iteration: the number its launch wait has (or would have)."""
    wait_fn: I64
    """The launch waits' numbers, of the iterations whose kernels carry launch times."""
    fn_kind: I64
    fn_it: I64
    row: I64
    """Per function: its ``FunctionKind``, iteration and row in its iteration."""
    group: I64
    """Per event (kernels, collectives, host functions, in that order): its function."""
    is_comm: npt.NDArray[np.bool_]
    """Per kernel: whether it is a collective (NCCL) kernel."""
    gpu_class: npt.NDArray[np.intp]
    """Per kernel, then per collective call: 1 for collective work, 0 for compute."""
    c_fn: I64
    """Per distinct collective function of the batch (iteration, op, group, size class): its number."""
    c_rows: list[tuple[int, int]]
    """Per distinct collective function: its iteration and op name id."""
    c_group: I64
    c_local: I64
    """Per collective call: its function, and that function's row in its iteration."""
    names: list[list[str]]
    """Per iteration: its functions' names, in their order."""


class FunctionPlans:
    """A rank's recent plans by their inputs' bytes (names ids, collective keys, event counts)."""

    def __init__(self) -> None:
        self._kept: dict[bytes, FunctionPlan] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: bytes) -> FunctionPlan | None:
        return self._kept.get(key)

    def keep(self, key: bytes, plan: FunctionPlan) -> None:
        if len(self._kept) >= _PLANS_KEPT:
            self._kept.clear()
        self._kept[key] = plan


def size_bucket_label(nbytes: int) -> str:
    """Power-of-two size class, so calls of a collective with similar sizes form one function."""
    if nbytes <= 0:
        return "0B"
    exp = int(np.ceil(np.log2(nbytes)))
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if exp >= shift:
            return f"{1 << (exp - shift)}{unit}"
    return f"{1 << exp}B"


@functools.lru_cache(maxsize=4096)
def collective_function_name(op: str, pg: str, nbytes: int) -> str:
    """One function per process-group instance: only members of one group finish a collective together,
    so only they can be compared for arrival lateness."""
    return f"nccl:{op}[pg={pg},<={size_bucket_label(nbytes)}]"


def plan_key(parts: list[npt.NDArray[np.generic]]) -> bytes:
    """The bytes of a plan's inputs (each of a fixed dtype, their lengths implied by the counts among them)."""
    return b"".join([len(parts).to_bytes(4, "little"), *(p.tobytes() for p in parts)])


def function_plan(
    k_it: npt.NDArray[np.intp],
    k_name: npt.NDArray[np.integer],
    c_it: npt.NDArray[np.intp],
    c_cols: tuple[npt.NDArray[np.integer], npt.NDArray[np.integer], I64],
    p_it: npt.NDArray[np.intp],
    p_name: npt.NDArray[np.integer],
    launch_known: npt.NDArray[np.bool_],
    kind_of: npt.NDArray[np.int8],
    name_base: I64,
    names_of: list[list[str]],
) -> FunctionPlan:
    """Number the functions of a batch of ``m`` iterations (``names_of``: each one's name list; ``c_cols``:
    the collectives' op, process group and bytes); every array of the plan is read-only, so a kept plan
    serves again."""
    m = len(names_of)
    n_names = max(max(len(names) for names in names_of), 1)
    op, pg, nbytes = c_cols
    k_uniq, k_inv = _distinct(k_it * n_names + k_name, m * n_names)
    k_row_it, k_id = k_uniq // n_names, k_uniq % n_names
    exp = np.where(nbytes > 0, np.ceil(np.log2(np.maximum(nbytes, 1))), 0).astype(np.int64)
    c_rows, c_inv = _collective_keys(c_it, op, pg, exp, n_names)
    p_uniq, p_inv = _distinct(p_it * n_names + p_name, m * n_names)
    p_row_it, p_id = p_uniq // n_names, p_uniq % n_names
    nk = np.bincount(k_row_it, minlength=m)
    nc = np.bincount(c_rows[:, 0], minlength=m)
    npy = np.bincount(p_row_it, minlength=m)
    # An iteration whose kernels carry launch times has one more host function, its launch wait, last in its
    # block: every such rank has it (zero where its GPU never waited), so its peers compare it.
    n_fn = nk + nc + npy + launch_known
    n = int(n_fn.sum())
    first_fn = n_fn.cumsum() - n_fn

    def numbered(it: I64, before: I64, count: I64) -> I64:
        ids: I64 = first_fn[it] + before[it] + np.arange(it.size) - (count.cumsum() - count)[it]
        return ids

    k_fn = numbered(k_row_it, np.zeros(m, dtype=np.int64), nk)
    c_fn = numbered(c_rows[:, 0], nk, nc)
    p_fn = numbered(p_row_it, nk + nc, npy)
    fn_kind = np.empty(n, dtype=np.int64)
    fn_kind[k_fn] = kind_of[k_id + name_base[k_row_it]]
    fn_kind[c_fn] = _COLLECTIVE
    fn_kind[p_fn] = int(FunctionKind.PYTHON)
    wait_at = first_fn + nk + nc + npy
    wait_fn = wait_at[launch_known]
    fn_kind[wait_fn] = int(FunctionKind.PYTHON)
    c_group = c_fn[c_inv]
    fn_it = np.repeat(np.arange(m), n_fn)
    is_comm = kind_of[k_name + name_base[k_it]] == _COLLECTIVE
    gpu_class = np.ones(k_name.size + c_it.size, dtype=np.intp)
    gpu_class[: k_name.size] = is_comm

    k_ids, p_ids, c_list = k_id.tolist(), p_id.tolist(), c_rows.tolist()
    k_at, c_at, p_at = ([0, *x.cumsum().tolist()] for x in (nk, nc, npy))
    fn_names: list[list[str]] = []
    for i, (names, known) in enumerate(zip(names_of, launch_known.tolist(), strict=True)):
        listed = [names[j] for j in k_ids[k_at[i] : k_at[i + 1]]]
        listed += [
            collective_function_name(names[op], names[pg], 1 << e if e else 0)
            for _it, op, pg, e in c_list[c_at[i] : c_at[i + 1]]
        ]
        listed += [names[j] for j in p_ids[p_at[i] : p_at[i + 1]]]
        if known:
            listed.append(LAUNCH_WAIT_FUNCTION)
        fn_names.append(listed)
    plan = FunctionPlan(
        n=n,
        n_fn=n_fn,
        first_fn=first_fn,
        wait_at=wait_at,
        wait_fn=wait_fn,
        fn_kind=fn_kind,
        fn_it=fn_it,
        row=np.arange(n) - first_fn[fn_it],
        group=np.concatenate([k_fn[k_inv], c_group, p_fn[p_inv]]),
        is_comm=is_comm,
        gpu_class=gpu_class,
        c_fn=c_fn,
        c_rows=[(it, op) for it, op, _pg, _e in c_list],
        c_group=c_group,
        c_local=c_group - first_fn[c_it],
        names=fn_names,
    )
    for value in (plan.n_fn, plan.first_fn, plan.wait_at, plan.wait_fn, plan.fn_kind, plan.fn_it, plan.row,
                  plan.group, plan.is_comm, plan.gpu_class, plan.c_fn, plan.c_group, plan.c_local):  # fmt: skip
        value.flags.writeable = False
    return plan


def _distinct(keys: I64, size: int) -> tuple[I64, I64]:
    """``np.unique(keys, return_inverse=True)`` for keys in [0, size): a presence table when it is small
    beside the keys (a rank's names grow by a step marker a step: after 100,000 steps a table of them cost
    18.5 us for 100 keys, a sort 6.5 us), else one sort."""
    if size > min(1 << 22, max(128 * keys.size, 1 << 15)):
        return _unique(keys)
    present = np.zeros(size, dtype=bool)
    present[keys] = True
    uniq = present.nonzero()[0]
    rank = np.zeros(size, dtype=np.int64)
    rank[uniq] = np.arange(uniq.size)
    return uniq, rank[keys]


def _unique(keys: I64) -> tuple[I64, I64]:
    """``np.unique(keys, return_inverse=True)`` for 1-D int keys, by one stable sort."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.ones(ordered.size, dtype=bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(keys.size, dtype=np.int64)
    inverse[order] = first.cumsum() - 1
    return ordered[first], inverse


def _collective_keys(
    it: npt.NDArray[np.integer],
    op: npt.NDArray[np.integer],
    pg: npt.NDArray[np.integer],
    exp: I64,
    n_names: int,
) -> tuple[I64, I64]:
    """Distinct (iteration, op, process group, size exponent) rows in sorted order, and each call's row.

    One int64 key per call (exponents are below 64, ids below ``n_names``), so one sort."""
    m = int(it.max()) + 1 if it.size else 1
    if m * n_names * n_names * 64 < 2**62:
        key = ((it.astype(np.int64) * n_names + op) * n_names + pg) * 64 + exp
        uniq, inv = _unique(key)
        pair = uniq // 64
        within = pair // n_names
        rows = np.empty((uniq.size, 4), dtype=np.int64)
        rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = within // n_names, within % n_names, pair % n_names, uniq % 64
        return rows, inv
    rows = np.stack([it.astype(np.int64), op.astype(np.int64), pg.astype(np.int64), exp], axis=1)
    uniq_rows, inv = np.unique(rows, axis=0, return_inverse=True)
    return uniq_rows, inv.reshape(-1).astype(np.int64)
