"""NCCL collective metadata from Kineto events: op, sizes, process group, peers.

Why apart: the same call is described in up to three places (the kernel's own args in new Kineto, the
``record_param_comms`` CPU op and the ``nccl:*`` annotation in old Kineto), with names and size fields
that differ by PyTorch version; this module turns any of them into one ``CommMeta`` and says which
message size nccl-tests would report for it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields

import msgspec

from fleetscope.producers.kineto_load import Args
from fleetscope.schemas.vocabulary import normalize_collective

NCCL_PREFIXES = ("ncclDevKernel_", "ncclKernel_")
# Bytes per element, keyed by Kineto's ScalarType names ("Float") and the C++ names of "Input type" ("float").
DTYPE_BYTES = {
    **dict.fromkeys(("float", "float32", "int", "int32", "unsigned int", "uint32", "complexhalf"), 4),
    **dict.fromkeys(("double", "float64", "long", "long int", "int64", "long long", "uint64"), 8),
    **dict.fromkeys(("complexfloat", "complex<float>"), 8),
    **dict.fromkeys(("complexdouble", "complex<double>"), 16),
    **dict.fromkeys(("half", "float16", "bfloat16", "short", "short int", "int16", "uint16"), 2),
    **dict.fromkeys(("char", "signed char", "int8", "byte", "unsigned char", "uint8", "bool"), 1),
    **dict.fromkeys(("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"), 1),
}


@dataclass(slots=True)
class CommMeta:
    """What is known about one collective call; fields stay None until some source fills them."""

    op: str | None = None
    in_bytes: int | None = None
    out_bytes: int | None = None
    group_size: int | None = None
    pg: str | None = None
    seq: int | None = None
    desc: str | None = None
    ranks: tuple[int, ...] | None = None
    peer: int | None = None
    """The other end of a send/recv (``Dst Rank``/``Src Rank``), as written: group-local or global."""

    def fill(self, other: CommMeta | None) -> None:
        if other is not None:
            for f in fields(self):
                if getattr(self, f.name) is None:
                    setattr(self, f.name, getattr(other, f.name))


def int_or_none(v: object) -> int | None:
    return v if type(v) is int else None


def canonical_op(raw: str) -> str:
    """``nccl:_all_gather_base`` / ``allreduce_coalesced`` / ``AllReduce`` -> the vocabulary's name."""
    op = raw.strip().lower().removeprefix("nccl:").strip("_")
    for suffix in ("_base", "_coalesced"):
        op = op.removesuffix(suffix)
    return normalize_collective(op)


def dtype_bytes(dtype: object) -> int | None:
    if type(dtype) is not str:
        return None
    return DTYPE_BYTES.get(dtype.strip().lower().removeprefix("c10::").removeprefix("at::"))


def meta_from_args(args: Args, op: str | None = None) -> CommMeta:
    """NCCL metadata written by ``record_param_comms`` (and copied onto kernels by new Kineto)."""
    meta = CommMeta(op=op)
    name = args.collective
    if type(name) is str and name:
        meta.op = canonical_op(name)
    elem = dtype_bytes(args.dtype)
    n_in, n_out = int_or_none(args.in_nelems), int_or_none(args.out_nelems)
    if elem is not None:
        meta.in_bytes = n_in * elem if n_in is not None and n_in >= 0 else None
        meta.out_bytes = n_out * elem if n_out is not None and n_out >= 0 else None
    if meta.in_bytes is None and args.input_dims and args.input_type:
        meta.in_bytes = _input_dims_bytes(_raw_json(args.input_dims), _raw_json(args.input_type))
    size = int_or_none(args.group_size)
    meta.group_size = size if size is not None and size > 0 else None
    pg = args.pg_name
    meta.pg = pg if type(pg) is str and pg else (str(pg) if type(pg) is int else None)
    meta.seq = int_or_none(args.seq)
    desc = args.pg_desc
    meta.desc = desc if type(desc) is str and desc else None
    ranks = args.pg_ranks
    meta.ranks = _rank_list(ranks) if type(ranks) is str else _rank_tuple(ranks)
    for value in (args.dst_rank, args.src_rank):
        peer = int_or_none(value)
        if peer is not None and peer >= 0 and meta.peer is None:
            meta.peer = peer
    return meta


def _raw_json(raw: msgspec.Raw) -> object:
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):  # a raw field is bytes as found: they may not be UTF-8
        return None


@functools.lru_cache(maxsize=4096)
def _rank_list(text: str) -> tuple[int, ...] | None:
    """``"[0, 1, 2]"`` (how PyTorch writes ``Process Group Ranks``) -> global ranks; parsed once per text."""
    try:
        return _rank_tuple(json.loads(text))
    except ValueError:
        return None


def _rank_tuple(value: object) -> tuple[int, ...] | None:
    if type(value) is not list or not value or not all(type(r) is int and 0 <= r < 2**31 for r in value):
        return None
    return tuple(value)


def _input_dims_bytes(dims: object, types: object) -> int | None:
    """Bytes of the tensor inputs of an old-style CPU op (``Input Dims`` + ``Input type``); None if none."""
    if type(dims) is not list or type(types) is not list:
        return None
    total, seen = 0, False
    for shape, dtype in zip(dims, types, strict=False):
        elem = dtype_bytes(dtype)
        if elem is None or type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
            continue
        total += math.prod(shape) * elem
        seen = True
    return total if seen else None


def op_from_kernel(name: str) -> str | None:
    """``ncclKernel_AllReduce_RING_LL_Sum_float(...)`` -> ``allreduce`` (the name classify_kernel matched)."""
    for prefix in NCCL_PREFIXES:
        if name.startswith(prefix):
            word = name[len(prefix) :].split("(")[0].split("_")[0]
            return canonical_op(word) if word else None
    return None


def nbytes_of(meta: CommMeta) -> int:
    """nccl-tests message size S (reference §5.1): output for all-gather, input for the rest."""
    n = meta.group_size or 1
    if meta.op == "allgather":
        if meta.out_bytes:
            return meta.out_bytes
        return meta.in_bytes * n if meta.in_bytes else 0
    if meta.op == "reduce_scatter" and not meta.in_bytes and meta.out_bytes:
        return meta.out_bytes * n
    return meta.in_bytes or meta.out_bytes or 0
