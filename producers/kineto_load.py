"""One Kineto trace file -> its top-level facts and its events, decoding only the fields the parser reads.

Why msgspec: a trace is mostly ``cpu_op`` events whose ``args`` (input shapes, types, call stacks) the
parser never reads; the stdlib ``json`` builds a Python object for every one of those values. A typed
decoder skips unknown keys in C, so a file costs about a quarter of ``json.loads``, and the events come
out as small structs with slots (no dict per event, no GC tracking). Every field is ``Any`` so a value of
an unexpected type never fails the file: the parser checks types itself and skips the event. Input the
typed decoder refuses (``args`` that is not an object, NaN, lone surrogates, a malformed document) is
read again with the stdlib ``json``, which decides the error message; its events are converted one by
one and an event that is not an object is skipped and counted.

Every file is bounded before it is trusted (``TraceLimits``): only a regular file is opened; its first
non-blank byte (after gzip, if any) must be ``{`` or ``[``, checked on a small prefix before the rest is
read; a plain file larger than ``max_trace_bytes`` is refused by its size, a gzip file is expanded in
chunks and refused as soon as it passes its cap. Bytes that are not UTF-8 are replaced (U+FFFD) in the
names that hold them, not allowed to cost the file.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec


class TraceError(ValueError):
    """A file that is not a readable Kineto trace: ``str(exc)`` is ``"<path>: <one-line reason>"``."""


class Args(msgspec.Struct, gc=False):
    """The ``args`` keys the parser reads: correlation and stream of GPU work, NCCL metadata."""

    correlation: object = None
    stream: object = None
    device: object = None
    external_id: object = msgspec.field(default=None, name="External id")
    collective: object = msgspec.field(default=None, name="Collective name")
    dtype: object = None
    in_nelems: object = msgspec.field(default=None, name="In msg nelems")
    out_nelems: object = msgspec.field(default=None, name="Out msg nelems")
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    """Kept undecoded: every ``cpu_op`` of a ``record_shapes`` trace has one; only comms ops read it."""
    input_type: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")
    group_size: object = msgspec.field(default=None, name="Group size")
    pg_name: object = msgspec.field(default=None, name="Process Group Name")
    seq: object = msgspec.field(default=None, name="Seq")
    pg_desc: object = msgspec.field(default=None, name="Process Group Description")
    pg_ranks: object = msgspec.field(default=None, name="Process Group Ranks")
    dst_rank: object = msgspec.field(default=None, name="Dst Rank")
    src_rank: object = msgspec.field(default=None, name="Src Rank")


NO_ARGS = Args()


class Event(msgspec.Struct, gc=False):
    """One ``traceEvents`` entry, as far as the parser reads it."""

    ph: object = None
    cat: object = None
    name: object = None
    ts: object = None
    dur: object = None
    pid: object = None
    tid: object = None
    args: Args | None = None


class TraceDoc(msgspec.Struct, gc=False):
    """The top level of a trace file: events, identity and time base."""

    traceEvents: list[Event]  # noqa: N815 - the file's own key
    distributedInfo: object = None  # noqa: N815
    baseTimeNanoseconds: object = None  # noqa: N815
    metadata: object = None
    hostname: object = None
    host: object = None
    host_name: object = None
    skipped: int = 0
    """Entries of ``traceEvents`` that are not objects (the typed path never has any)."""


_DECODER = msgspec.json.Decoder(TraceDoc)
GZIP_MAGIC = b"\x1f\x8b"
PREFIX_BYTES = 64 * 1024
"""How much of a file (after gzip) is read to find its first non-blank byte: JSON never starts later."""
GZIP_FLOOR_BYTES = 64 * 2**20
"""A small gzip file may always expand this far, whatever its ratio (tiny, repetitive traces)."""
_CHUNK = 4 * 2**20
_BLANK = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, kw_only=True)
class TraceLimits:
    """How far one trace file (and an archive of them) may grow in memory and on disk: each bad file is
    refused by its own bound, with its reason, before it can cost the run its memory or its disk."""

    max_trace_bytes: int = 2 * 2**30
    """A trace's JSON bytes: a plain file's size, a gzip file's expanded size."""
    max_gzip_ratio: int = 100
    """A gzip file expands to at most this many times its size (Kineto JSON compresses 5-20x; a bomb
    1000x), or ``GZIP_FLOOR_BYTES``, whichever is larger (never past ``max_trace_bytes``)."""
    max_unpacked_bytes: int = 16 * 2**30
    """All trace members written out of tar archives in one run, together."""

    def __post_init__(self) -> None:
        for name in ("max_trace_bytes", "max_gzip_ratio", "max_unpacked_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")

    def expanded_cap(self, compressed_bytes: int) -> int:
        """The most a gzip file of ``compressed_bytes`` may expand to."""
        return min(self.max_trace_bytes, max(GZIP_FLOOR_BYTES, self.max_gzip_ratio * compressed_bytes))


def looks_like_json(prefix: bytes) -> bool | None:
    """Whether ``prefix`` (a file's first bytes) starts like a JSON document or array: its first
    non-blank byte (after a UTF-8 byte-order mark) is ``{`` or ``[``. None: only blanks so far."""
    head = prefix[len(_BOM) :] if prefix.startswith(_BOM) else prefix
    body = head.lstrip(_BLANK)
    return None if not body else body[:1] in (b"{", b"[")


def check_prefix(path: Path, prefix: bytes, complete: bool) -> bool:
    """Refuse a file whose first ``PREFIX_BYTES`` (all of it, if ``complete``) do not start a JSON
    document; True once they do, False while only blanks have been seen."""
    starts = looks_like_json(prefix[:PREFIX_BYTES])
    if starts is False:
        raise TraceError(f"{path}: not JSON (its first non-blank byte is not {{ or [)")
    if starts is None and (complete or len(prefix) >= PREFIX_BYTES):
        raise TraceError(f"{path}: not JSON (blank in its first {min(len(prefix), PREFIX_BYTES)} bytes)")
    return bool(starts)


def read_trace_bytes(path: Path, limits: TraceLimits) -> bytes | bytearray:
    """A trace file's JSON bytes, within ``limits``; ``TraceError`` says why a file is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without blocking, then is refused
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TraceError(f"{path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            prefix = f.read(PREFIX_BYTES)
            f.seek(0)
            if prefix[:2] == GZIP_MAGIC:
                return _gunzipped(path, f, limits.expanded_cap(info.st_size))
            if info.st_size > limits.max_trace_bytes:
                raise TraceError(f"{path}: {info.st_size} bytes, over the {limits.max_trace_bytes}-byte limit")
            check_prefix(path, prefix, complete=len(prefix) < PREFIX_BYTES)
            data = f.read(limits.max_trace_bytes + 1)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > limits.max_trace_bytes:  # it grew while it was read
        raise TraceError(f"{path}: over the {limits.max_trace_bytes}-byte limit")
    return data


def _gunzipped(path: Path, f: BinaryIO, cap: int) -> bytearray:
    """Expand a gzip file in chunks, its prefix checked first; refused as soon as it passes ``cap``."""
    out = bytearray()
    pending = True
    try:
        with gzip.GzipFile(fileobj=f) as g:
            while chunk := g.read(_CHUNK):
                out += chunk
                if pending:
                    pending = not check_prefix(path, bytes(out[:PREFIX_BYTES]), complete=False)
                if len(out) > cap:
                    raise TraceError(f"{path}: gzip expands past {cap} bytes (the limit for its size)")
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise TraceError(f"{path}: truncated or corrupt gzip ({exc})") from None
    if pending:
        check_prefix(path, bytes(out[:PREFIX_BYTES]), complete=True)
    return out


def load_trace(path: Path, limits: TraceLimits | None = None) -> TraceDoc:
    """Read and decode one file (gzip detected by its magic bytes, not its name), within ``limits``."""
    data = read_trace_bytes(path, limits or TraceLimits())
    try:
        return _DECODER.decode(data)
    except (ValueError, RecursionError):  # msgspec.DecodeError/ValidationError, UnicodeDecodeError
        pass
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # bytes that are not UTF-8 cost the names that hold them (U+FFFD), not the file
        text = data.decode("utf-8", errors="replace")
        del data
        try:
            return _DECODER.decode(text)
        except (ValueError, RecursionError):
            pass
    else:
        del data
    return _load_untyped(path, text)


def _load_untyped(path: Path, text: str) -> TraceDoc:
    """The stdlib path: exact error messages, and events checked one at a time."""
    try:
        doc = json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: truncated or invalid JSON ({exc.msg} at line {exc.lineno})") from None
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
