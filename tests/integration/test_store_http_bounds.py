"""The served store's HTTP bounds against the real chDB engine: the token before the body, capped and streamed
bodies (raw, decompressed, chunked), malformed framing, half-open connections, and a query cancelled in the
engine when its client goes away. Raw sockets, so the tests send what no well-behaved client would."""

from __future__ import annotations

import gzip
import logging
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import clickhouse_connect
import lz4.frame
import pytest
from backports import zstd

from fleetscope.config import ConfigError, load_config
from fleetscope.sinks import StoreConfig, connect, migrate
from fleetscope.sinks.clickhouse.server import StoreServer, Tokens
from fleetscope.sinks.store_config import StoreServerBounds

pytestmark = pytest.mark.integration

TOKENS = Tokens(read="read-secret", write="write-secret")
CAP = 64 * 1024
BOUNDS = StoreServerBounds(read_body_bytes=CAP, read_decoded_bytes=CAP, idle_timeout_s=10.0)
CODECS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "lz4": lz4.frame.compress,
    "zstd": zstd.compress,
}


@pytest.fixture(scope="module")
def served(chdb_path: Path) -> Iterator[tuple[StoreServer, str]]:
    database = f"bnd_{uuid.uuid4().hex[:10]}"
    migrate(connect(StoreConfig(url=f"chdb://{chdb_path}", database=database)), database)
    server = StoreServer(str(chdb_path), TOKENS, database=database, bounds=BOUNDS).start()
    yield server, database
    server.stop()


def _head(token: str, *lines: str) -> bytes:
    return ("POST / HTTP/1.1\r\nHost: x\r\n" + f"X-ClickHouse-Key: {token}\r\n" + "".join(lines) + "\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one response, read to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed without an answer after {data!r}")
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def _exchange(port: int, request: bytes, *, shut: bool = False) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        return _answer(sock)


def test_the_token_and_the_length_are_checked_before_the_body_is_read(served: tuple[StoreServer, str]) -> None:
    """A wrong token is 401 and a Content-Length over the cap 413 with none of the 50 MB body sent."""
    server, _ = served
    t0 = time.perf_counter()
    assert _exchange(server.port, _head("wrong", "Content-Length: 50000000\r\n"))[0] == 401
    assert _exchange(server.port, _head(TOKENS.read + "x", "Content-Length: 50000000\r\n"))[0] == 401
    status, body = _exchange(server.port, _head(TOKENS.read, "Content-Length: 50000000\r\n"))
    assert (status, b"TOO_MANY_BYTES" in body) == (413, True)
    assert time.perf_counter() - t0 < 4.0  # answered, not waiting for a body (each answer lingers <= 1 s)


@pytest.mark.parametrize("encoding", sorted(CODECS))
def test_a_decompression_bomb_is_refused_at_the_cap(served: tuple[StoreServer, str], encoding: str) -> None:
    """8 MiB of statement in a few KB: 413 once the decompressed size passes the cap, the engine never sees it,
    whichever the token; the same codec still carries a query under the cap."""
    server, _ = served
    compress = CODECS[encoding]
    bomb = compress(b"SELECT 1" + b" " * (8 << 20))
    assert len(bomb) < CAP
    head = _head(TOKENS.read, f"Content-Encoding: {encoding}\r\n", f"Content-Length: {len(bomb)}\r\n")
    status, body = _exchange(server.port, head + bomb)
    assert (status, b"TOO_MANY_BYTES" in body) == (413, True), body
    head = _head(TOKENS.write, f"Content-Encoding: {encoding}\r\n", f"Content-Length: {len(bomb)}\r\n")
    assert _exchange(server.port, head + bomb)[0] == 413  # the write token's larger cap is for insert data
    two_frames = compress(b"SELECT 41 ") + compress(b"+ 1")  # concatenated frames inflate as one body
    head = _head(TOKENS.read, f"Content-Encoding: {encoding}\r\n", f"Content-Length: {len(two_frames)}\r\n")
    assert _exchange(server.port, head + two_frames) == (200, b"42\n")


def test_chunked_bodies_count_against_the_same_cap(served: tuple[StoreServer, str]) -> None:
    server, _ = served
    piece = b" " * (40 * 1024)

    def chunked(*chunks: bytes) -> bytes:
        return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"

    head = _head(TOKENS.read, "Transfer-Encoding: chunked\r\n")
    assert _exchange(server.port, head + chunked(b"SELECT 1", piece))[0] == 200
    status, body = _exchange(server.port, head + chunked(b"SELECT 1", piece, piece))
    assert (status, b"TOO_MANY_BYTES" in body) == (413, True)


@pytest.mark.parametrize(
    ("framing", "body"),
    [
        ("Content-Length: abc\r\n", b"SELECT 1"),
        ("Transfer-Encoding: chunked\r\n", b"zz\r\nSELECT 1\r\n0\r\n\r\n"),
        ("Content-Length: 100\r\n", b"SELECT 1"),
    ],
    ids=["length-not-a-number", "bad-chunk-size", "truncated"],
)
def test_malformed_framing_is_answered_400_with_one_log_line(
    served: tuple[StoreServer, str], framing: str, body: bytes, caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    server, _ = served
    caplog.set_level(logging.INFO, logger="fleetscope")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(_head(TOKENS.read, framing) + body)
        sock.shutdown(socket.SHUT_WR)
        status, _ = _answer(sock)
        assert sock.recv(10) == b""  # then closed: what follows a broken frame cannot be read
    assert status == 400
    time.sleep(0.1)  # the handler's thread has logged all it will
    lines = [r for r in caplog.records if r.name.startswith("fleetscope") and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].exc_info is None, [r.getMessage() for r in lines]
    assert "Traceback" not in capfd.readouterr().err


def test_half_open_connections_are_closed_and_the_excess_refused(chdb_path: Path) -> None:
    """Twelve requests that never finish their headers against a limit of four: eight 503 at once, four
    threads (not twelve), each closed once the idle timeout passes."""
    bounds = StoreServerBounds(max_connections=4, idle_timeout_s=0.5)
    server = StoreServer(str(chdb_path), TOKENS, bounds=bounds).start()
    try:
        before = threading.active_count()
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=3) for _ in range(12)]
        for sock in socks:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le")
        time.sleep(0.2)
        assert threading.active_count() - before <= 4
        t0, refused, closed = time.perf_counter(), 0, 0
        for sock in socks:
            data = sock.recv(4096)
            refused += data.startswith(b"HTTP/1.1 503")
            closed += data == b""
            sock.close()
        assert (refused, closed) == (8, 4)
        assert time.perf_counter() - t0 < 2.0
    finally:
        server.stop()


def test_the_write_token_inserts_a_batch_over_the_read_cap(served: tuple[StoreServer, str]) -> None:
    """Insert batches are the write token's: its own, larger cap (configurable), while the read token's body
    of the same size is 413."""
    server, database = served
    writer = clickhouse_connect.get_client(
        host="127.0.0.1", port=server.port, username="any", password=TOKENS.write, database=database, compress=False
    )
    job = f"big-{uuid.uuid4().hex[:6]}"
    rows = [[job, r, i, 1_700_000_000 * 10**9 + i, 10**6 + i] for r in range(4) for i in range(5000)]
    writer.insert("iterations", rows, column_names=["job", "rank", "iteration", "start_ns", "duration_ns"])
    count = writer.query("SELECT count() FROM iterations WHERE job = {j:String}", parameters={"j": job})
    assert count.result_rows == [(20000,)]  # 20000 rows of 5 columns: some 600 KB of Native, over the 64 KiB cap
    big = b"SELECT 1" + b" " * (2 * CAP)
    assert _exchange(server.port, _head(TOKENS.read, f"Content-Length: {len(big)}\r\n") + big)[0] == 413


def test_a_query_is_cancelled_when_its_client_goes_away(
    served: tuple[StoreServer, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A runaway read (some 9 CPU seconds) whose client disconnects after 1 s: the engine stops it, so the
    process spends almost no CPU after; before, it burned a core until the query ended."""
    server, _ = served
    caplog.set_level(logging.INFO, logger="fleetscope")
    query = b"SELECT count() FROM numbers(1000000000) WHERE sipHash64(number) = 0"
    start = time.process_time()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(_head(TOKENS.read, f"Content-Length: {len(query)}\r\n") + query)
        time.sleep(1.0)
        running = time.process_time() - start
    time.sleep(0.3)
    c0 = time.process_time()
    time.sleep(1.0)
    after = time.process_time() - c0
    assert running > 0.1  # it was running (a core's worth on an idle machine) while the client waited
    assert after < min(0.3, running / 4), f"{after:.2f} CPU s in the second after, {running:.2f} in the one before"
    assert any("cancelled" in r.getMessage() for r in caplog.records)


def test_the_bounds_are_configured_and_validated() -> None:
    """``embedded.store_server`` in the one configuration: set by the environment, refused when not a bound
    (NaN, infinity, zero), every problem reported at once."""
    env = {"FLEETSCOPE__EMBEDDED__STORE_SERVER__MAX_CONNECTIONS": "8",
           "FLEETSCOPE__EMBEDDED__STORE_SERVER__WRITE_DECODED_BYTES": "1_073_741_824"}  # fmt: skip
    bounds = load_config(env=env).embedded.store_server
    assert (bounds.max_connections, bounds.write_decoded_bytes, bounds.read_body_bytes) == (8, 1 << 30, 1 << 20)
    for bad in ("nan", "inf", "0"):
        with pytest.raises(ConfigError, match="idle_timeout_s"):
            load_config(env={"FLEETSCOPE__EMBEDDED__STORE_SERVER__IDLE_TIMEOUT_S": bad})
    with pytest.raises(ConfigError, match="read_body_bytes.*max_connections"):
        load_config(overrides={"embedded.store_server.read_body_bytes": 0, "embedded.store_server.max_connections": 0})
