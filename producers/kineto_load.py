"""One Kineto trace file -> its top-level facts and its events, decoding only the fields the parser reads.

Why msgspec: a trace is mostly ``cpu_op`` events whose ``args`` (input shapes, types, call stacks) the
parser never reads; the stdlib ``json`` builds a Python object for every one of those values. A typed
decoder skips unknown keys in C, so a file costs about a quarter of ``json.loads``, and the events come
out as small structs with slots (no dict per event, no GC tracking). Every field is ``Any`` so a value of
an unexpected type never fails the file: the parser checks types itself and skips the event. Input the
typed decoder refuses (``args`` that is not an object, NaN, lone surrogates, a malformed document) is
read again with the stdlib ``json``, which decides the error message; its events are converted one by
one and an event that is not an object is skipped and counted.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import msgspec


class TraceError(ValueError):
    """A file that is not a readable Kineto trace: ``str(exc)`` is ``"<path>: <one-line reason>"``."""


class Args(msgspec.Struct, gc=False):
    """The ``args`` keys the parser reads: correlation and stream of GPU work, NCCL metadata."""

    correlation: Any = None
    stream: Any = None
    device: Any = None
    external_id: Any = msgspec.field(default=None, name="External id")
    collective: Any = msgspec.field(default=None, name="Collective name")
    dtype: Any = None
    in_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    """Kept undecoded: every ``cpu_op`` of a ``record_shapes`` trace has one; only comms ops read it."""
    input_type: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")
    group_size: Any = msgspec.field(default=None, name="Group size")
    pg_name: Any = msgspec.field(default=None, name="Process Group Name")
    seq: Any = msgspec.field(default=None, name="Seq")
    pg_desc: Any = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    dst_rank: Any = msgspec.field(default=None, name="Dst Rank")
    src_rank: Any = msgspec.field(default=None, name="Src Rank")


NO_ARGS = Args()


class Event(msgspec.Struct, gc=False):
    """One ``traceEvents`` entry, as far as the parser reads it."""

    ph: Any = None
    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    tid: Any = None
    args: Args | None = None


class TraceDoc(msgspec.Struct, gc=False):
    """The top level of a trace file: events, identity and time base."""

    traceEvents: list[Event]  # noqa: N815 - the file's own key
    distributedInfo: Any = None  # noqa: N815
    baseTimeNanoseconds: Any = None  # noqa: N815
    metadata: Any = None
    hostname: Any = None
    host: Any = None
    host_name: Any = None
    skipped: int = 0
    """Entries of ``traceEvents`` that are not objects (the typed path never has any)."""


_DECODER = msgspec.json.Decoder(TraceDoc)


def load_trace(path: Path) -> TraceDoc:
    """Read and decode one file (gzip detected by its magic bytes, not its name)."""
    try:
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{path}: truncated or corrupt gzip ({exc})") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return _DECODER.decode(data)
    except (ValueError, RecursionError):  # msgspec.DecodeError/ValidationError, UnicodeDecodeError
        return _load_untyped(path, data)


def _load_untyped(path: Path, data: bytes) -> TraceDoc:
    """The stdlib path: exact error messages, and events checked one at a time."""
    try:
        doc = json.loads(data)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: truncated or invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not a text (UTF-8) JSON file") from None
    except (ValueError, RecursionError) as exc:
        raise TraceError(f"{path}: invalid JSON ({(str(exc) or repr(exc)).splitlines()[0]})") from None
    if type(doc) is not dict or type(doc.get("traceEvents")) is not list:
        what = "no traceEvents list" if type(doc) is dict else f"top-level JSON is a {type(doc).__name__}"
        raise TraceError(f"{path}: not a Kineto trace ({what})")
    events: list[Event] = []
    skipped = 0
    for e in doc["traceEvents"]:
        if type(e) is not dict:
            skipped += 1
            continue
        if "args" in e and type(e["args"]) is not dict:
            e = {k: v for k, v in e.items() if k != "args"}  # unusable args count as none, as in any event
        try:
            events.append(msgspec.convert(e, Event))
        except msgspec.ValidationError:
            skipped += 1
    top = {k: doc.get(k) for k in ("distributedInfo", "baseTimeNanoseconds", "metadata", "hostname", "host")}
    return TraceDoc(traceEvents=events, host_name=doc.get("host_name"), skipped=skipped, **top)
