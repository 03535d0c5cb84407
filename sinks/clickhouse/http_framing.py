"""The HTTP framing of the store server: its bounds, and a request body read incrementally under them.

Every body is bounded where it enters: its raw size (a ``Content-Length`` over the cap is refused before a byte
is read; chunked bodies are counted chunk by chunk) and its decompressed size (each codec inflates at most the
bytes left under the cap per call, so a 200 KB gzip bomb costs the cap, never the 200 MB it expands to).
Malformed framing (a length that is not a number, a bad chunk size, a body shorter than announced) is a
``BadFraming``: the server answers 400 and logs one line. No I/O here but reading the file object it is given.
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import threading
import zlib
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any, Protocol

log = logging.getLogger("fleetscope.sinks.clickhouse.server")

READ_PIECE = 65536
"""Bytes read from the socket (and inflated) at a time."""
_MAX_LINE = 1024
"""A chunk-size line, extensions included, is no longer than this."""

_HEX = re.compile(rb"^[0-9A-Fa-f]{1,16}$")


class BodyRefused(Exception):
    """A request body the server will not take; ``status`` and the ClickHouse ``code`` it answers with."""

    status = HTTPStatus.BAD_REQUEST
    code = 27  # CANNOT_PARSE_INPUT_ASSERTION_FAILED
    name = "CANNOT_PARSE_INPUT_ASSERTION_FAILED"

    def __str__(self) -> str:
        return f"Code: {self.code}. DB::Exception: {self.args[0]}. ({self.name})"


class BadFraming(BodyRefused):
    """Malformed HTTP framing: the answer is 400, the connection is closed (its next byte is unknown)."""


class BodyTooLarge(BodyRefused):
    """A body over a cap, raw or decompressed: 413."""

    status = HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    code = 307
    name = "TOO_MANY_BYTES"


class UnsupportedEncoding(BodyRefused):
    status = HTTPStatus.UNSUPPORTED_MEDIA_TYPE
    code = 1
    name = "UNSUPPORTED_METHOD"


class Readable(Protocol):
    """A buffered binary stream: the socket file of a request."""

    def read(self, size: int, /) -> bytes: ...
    def readline(self, size: int, /) -> bytes: ...


def _read_exact(rfile: Readable, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``rfile`` in pieces; a body that ends sooner is ``BadFraming``."""
    left = size
    while left:
        piece = rfile.read(min(left, READ_PIECE))
        if not piece:
            raise BadFraming(f"body truncated: {size - left} of {size} bytes arrived")
        left -= len(piece)
        yield piece


def raw_body(rfile: Readable, transfer_encoding: str, content_length: str | None, cap: int) -> Iterator[bytes]:
    """The body's bytes as they arrive, never more than ``cap`` of them (``BodyTooLarge``): a Content-Length
    over the cap is refused before anything is read, a chunk before it is read."""
    if "chunked" in transfer_encoding.lower():
        return _chunked(rfile, cap)
    text = (content_length or "0").strip()
    if not text.isascii() or not text.isdigit():
        raise BadFraming(f"Content-Length {text[:40]!r} is not a number")
    length = int(text)
    if length > cap:
        raise BodyTooLarge(f"body of {length} bytes exceeds the cap of {cap} bytes")
    return _read_exact(rfile, length)


def _chunked(rfile: Readable, cap: int) -> Iterator[bytes]:
    total = 0
    while True:
        line = rfile.readline(_MAX_LINE)
        if not line.endswith(b"\n"):
            raise BadFraming("chunk size line truncated or too long")
        size_text = line.split(b";")[0].strip()
        if not _HEX.match(size_text):
            raise BadFraming(f"bad chunk size {size_text[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            for _ in range(64):  # trailers, bounded in count and length
                trailer = rfile.readline(_MAX_LINE)
                if trailer in (b"\r\n", b"\n"):
                    return
                if not trailer.endswith(b"\n"):
                    raise BadFraming("chunked body truncated in its trailers")
            raise BadFraming("too many trailers")
        total += size
        if total > cap:
            raise BodyTooLarge(f"chunked body exceeds the cap of {cap} bytes")
        yield from _read_exact(rfile, size)
        if rfile.readline(_MAX_LINE) not in (b"\r\n", b"\n"):
            raise BadFraming("chunk not followed by CRLF")


class _Decoder(Protocol):
    """A streaming decompressor: ``decompress(data, max_length)`` yields at most ``max_length`` bytes and keeps
    the rest of its input for the next call (``b""``)."""

    @property
    def eof(self) -> bool: ...
    @property
    def unused_data(self) -> bytes: ...
    def decompress(self, data: bytes, max_length: int) -> bytes: ...
    def pending(self) -> bool:
        """Whether input it holds may produce more output without new input."""
        ...


class _Zlib:
    def __init__(self, wbits: int) -> None:
        self._d = zlib.decompressobj(wbits)

    @property
    def eof(self) -> bool:
        return self._d.eof

    @property
    def unused_data(self) -> bytes:
        return self._d.unused_data

    def decompress(self, data: bytes, max_length: int) -> bytes:
        return self._d.decompress(self._d.unconsumed_tail + data, max_length)

    def pending(self) -> bool:
        return bool(self._d.unconsumed_tail)


class _Framed:
    """lz4.frame's and zstd's decompressors (the ``needs_input`` protocol of ``bz2``/``lzma``)."""

    def __init__(self, d: Any) -> None:
        self._d = d

    @property
    def eof(self) -> bool:
        return bool(self._d.eof)

    @property
    def unused_data(self) -> bytes:
        return bytes(self._d.unused_data or b"")

    def decompress(self, data: bytes, max_length: int) -> bytes:
        return bytes(self._d.decompress(data, max_length=max_length))

    def pending(self) -> bool:
        return not self._d.needs_input


def _factory(encoding: str) -> Callable[[], _Decoder]:
    if encoding == "gzip":
        return lambda: _Zlib(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return lambda: _Zlib(zlib.MAX_WBITS)
    if encoding == "lz4":
        import lz4.frame

        return lambda: _Framed(lz4.frame.LZ4FrameDecompressor())
    if encoding == "zstd":
        from backports import zstd  # clickhouse-connect's own zstd (the stdlib's compression.zstd in 3.14)

        return lambda: _Framed(zstd.ZstdDecompressor())
    if encoding == "br":
        raise UnsupportedEncoding("br bodies cannot be inflated under a cap here; use lz4, zstd or gzip")
    raise UnsupportedEncoding(f"unknown Content-Encoding {encoding[:40]!r}")


def inflate(chunks: Iterator[bytes], encoding: str, cap: int) -> bytes:
    """The body in the Content-Encoding the client chose (concatenated frames included), decompressed
    incrementally: ``BodyTooLarge`` once it passes ``cap`` bytes, having held at most ``cap`` + one piece."""
    encoding = encoding.strip().lower()
    out = bytearray()
    if encoding in ("", "identity", "none"):
        for chunk in chunks:
            out += chunk
            if len(out) > cap:
                raise BodyTooLarge(f"body exceeds the cap of {cap} bytes")
        return bytes(out)
    make = _factory(encoding)
    decoder: _Decoder | None = None
    for chunk in chunks:
        data = chunk
        while data or (decoder is not None and decoder.pending()):
            if decoder is None:
                decoder = make()
            try:
                out += decoder.decompress(data, min(cap - len(out), READ_PIECE) + 1)
            except (zlib.error, RuntimeError, ValueError, OSError) as exc:
                raise BadFraming(f"{encoding} body does not decompress: {exc}") from None
            if len(out) > cap:
                raise BodyTooLarge(f"decompressed body exceeds the cap of {cap} bytes")
            data = b""
            if decoder.eof:  # the next frame, if any, starts in what this one left
                data, decoder = decoder.unused_data, None
    if decoder is not None:
        raise BadFraming(f"{encoding} body truncated")
    return bytes(out)


class ClientWatch:
    """Watches a client's socket while the engine runs its statement: once the peer closes (or resets) the
    connection, ``on_gone`` runs once, so the query stops burning cores nobody waits for. Pipelined bytes
    from the client are left unread. Used as a context manager around the statement."""

    def __init__(self, sock: socket.socket, on_gone: Callable[[], None]) -> None:
        self._sock = sock
        self._on_gone = on_gone
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="store-client-watch", daemon=True)
        self.gone = False

    def __enter__(self) -> ClientWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _watch(self) -> None:
        hangup = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        poller.register(self._sock.fileno(), select.POLLIN | hangup)
        while True:
            for fd, events in poller.poll():
                if fd == self._wake_r:
                    return
                if not events & hangup and self._peek():  # data, not a close: watch for the close only
                    poller.modify(fd, hangup)
                    continue
                self.gone = True
                try:
                    self._on_gone()
                except Exception as exc:  # a failed cancel must not kill the watcher's caller
                    log.warning("store server: could not cancel a query whose client went away: %s", exc)
                return

    def _peek(self) -> bool:
        """Whether the socket holds data (False: the peer closed it)."""
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True
        except OSError:
            return False
