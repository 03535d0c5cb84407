"""Serve the embedded chDB store over a ClickHouse-compatible HTTP interface on loopback.

chDB admits one process per data directory, and ``fleetscope up`` is that process while it runs; it
serves the store so that ``fleetscope sql/findings/report``, clickhouse-connect's HTTP client and
Grafana's ClickHouse datasource can query it meanwhile. Implemented: ``/ping``, queries in the URL
(``query=``) or the body, ``database``, ``param_<name>`` server-side parameters, settings as URL
parameters, any output format chDB writes (Native, RowBinary, JSON...), request bodies compressed as
the client negotiates (lz4, zstd, gzip, deflate) or chunked, and inserts (``INSERT ... FORMAT X``
followed by the data).

Bounded by construction (``http_framing``, ``embedded.store_server``): the token is checked before
a body is read; a body is read and inflated incrementally under its token's caps (413 once over); malformed
framing is 400 and one log line; a silent connection is closed after the idle timeout, and connections over
the limit are answered 503 by the accepting thread. While the engine runs a statement its client's socket is
watched: once the client goes away the query is killed in the engine (``ChdbExecutor.cancel``).

Two tokens (HTTP basic password, ``X-ClickHouse-Key`` or ``password=``): the write token may do
anything; the read token runs every statement on a chDB connection locked down as ``run_sql``'s read-only
session is (``user_sql.lockdown_settings``: only allowlisted client settings, the ``read_*`` bounds, no
``Python()``, no introspection, then ``readonly=1``, which the engine enforces and the client cannot lift),
and only once the engine's parser and AST show one read statement without ``INTO OUTFILE`` (which chDB
writes in-process even read-only) calling only pure functions (``sinks.clickhouse.user_sql.vet_canonical``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fleetscope.sinks.clickhouse.http_framing import BodyRefused, BodyTooLarge, ClientWatch, inflate, raw_body
from fleetscope.sinks.clickhouse.user_sql import (
    FUNCTION_CATALOG_QUERY,
    FunctionCatalog,
    lockdown_settings,
    set_statement,
    sql_string,
    vet_canonical,
)
from fleetscope.sinks.store import Tokens
from fleetscope.sinks.store_config import StoreConfig, StoreServerBounds

log = logging.getLogger(__name__)

# Parameters that steer the HTTP exchange, never settings of the query.
_TRANSPORT_PARAMS = frozenset(
    {
        "query", "database", "default_format", "user", "password", "quota_key", "query_id", "session_id",
        "session_timeout", "session_check", "compress", "decompress", "enable_http_compression",
        "http_zlib_compression_level", "client_protocol_version", "wait_end_of_query", "buffer_size",
        "send_progress_in_http_headers", "http_headers_progress_interval_ms", "add_http_cors_header",
        "http_response_buffer_size", "cancel_http_readonly_queries_on_client_close", "role",
    }
)  # fmt: skip
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INSERT_WITH_DATA = re.compile(r"^\s*(INSERT\s+INTO\s.*?\bFORMAT\s+[A-Za-z0-9_]+)[ \t]*(?:\r?\n|$)", re.I | re.S)
_INSERT_PARTS = re.compile(r"^(.*?)(\s+SETTINGS\s+.*?)?\s+FORMAT\s+([A-Za-z0-9_]+)$", re.I | re.S)
_ERROR_CODE = re.compile(r"Code: (\d+)\.")
_STATUS_OF_CODE = {
    62: HTTPStatus.BAD_REQUEST,  # SYNTAX_ERROR
    307: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,  # TOO_MANY_BYTES
    47: HTTPStatus.NOT_FOUND,  # UNKNOWN_IDENTIFIER
    60: HTTPStatus.NOT_FOUND,  # UNKNOWN_TABLE
    81: HTTPStatus.NOT_FOUND,  # UNKNOWN_DATABASE
    164: HTTPStatus.FORBIDDEN,  # READONLY
    497: HTTPStatus.FORBIDDEN,  # ACCESS_DENIED
    516: HTTPStatus.UNAUTHORIZED,  # AUTHENTICATION_FAILED
}


_LINGER_S = 1.0
_LINGER_BYTES = 1 << 20
_BUSY_TEXT = b"Code: 202. DB::Exception: too many connections. (TOO_MANY_SIMULTANEOUS_QUERIES)\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=UTF-8\r\nConnection: close\r\n"
    b"X-ClickHouse-Exception-Code: 202\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT)
)


class QueryRefused(Exception):
    """A request the server will not run; ``code`` is the ClickHouse error code it answers with."""

    def __init__(self, code: int, name: str, message: str) -> None:
        super().__init__(f"Code: {code}. DB::Exception: {message}. ({name})")
        self.code = code


def _wrong_token() -> QueryRefused:
    return QueryRefused(516, "AUTHENTICATION_FAILED", "fleetscope: authentication failed: wrong token")


def split_request(query_param: str, body: bytes) -> tuple[str, bytes]:
    """(statement, insert data) as ClickHouse reads them: the URL's ``query`` followed by the body; an
    ``INSERT ... FORMAT X`` statement ends its line and the rest of the body is its data."""
    if query_param:
        match = _INSERT_WITH_DATA.match(query_param)
        if match and match.end() >= len(query_param.rstrip()):
            return match.group(1), body
        return (query_param + ("\n" + body.decode() if body else "")), b""
    match = _INSERT_WITH_DATA.match(body.decode("utf-8", "replace")[:65536])
    if match:
        head = match.group(0).encode()
        return match.group(1), body[len(head) :]
    return body.decode(), b""


def infile_insert(statement: str, data_path: str) -> str:
    """``INSERT INTO t (cols) [SETTINGS ...] FORMAT X`` as chDB runs it: reading ``data_path``."""
    match = _INSERT_PARTS.match(statement.strip())
    if match is None:
        raise QueryRefused(62, "SYNTAX_ERROR", f"cannot read the INSERT statement {statement[:200]!r}")
    head, settings, fmt = match.group(1), match.group(2) or "", match.group(3)
    return f"{head} FROM INFILE {sql_string(data_path)}{settings} FORMAT {fmt}"


class ChdbExecutor:
    """Runs one request on a fresh chDB connection to the process's engine (0.1 ms to open), so the
    settings it SETs, read-only mode included, die with it. ``config`` bounds the read-only requests."""

    def __init__(self, path: str, config: StoreConfig | None = None) -> None:
        import chdb

        connect: Callable[[str], Any] = chdb.connect
        self._connect: Callable[[], Any] = lambda: connect(path)
        self._config = config or StoreConfig()
        conn = self._connect()  # fail now, not on the first request
        try:
            rows = (conn.query(FUNCTION_CATALOG_QUERY, "TabSeparated").bytes() or b"").decode().splitlines()
            self._catalog = FunctionCatalog.from_rows(tuple(line.split("\t")) for line in rows)
        finally:
            conn.close()

    def run(
        self,
        statement: str,
        data: bytes,
        *,
        database: str,
        settings: Mapping[str, str],
        params: Mapping[str, str],
        output_format: str,
        readonly: bool,
        query_id: str = "",
    ) -> tuple[bytes, dict[str, str]]:
        """(output, summary) of one statement; ``query_id`` tags it (``log_comment``) for ``cancel``. Read-only:
        the client's settings reach the session only through ``lockdown_settings`` (allowlisted, before the
        bounds and ``readonly=1``)."""
        conn = self._connect()
        tmp_name = ""
        try:
            if database:
                conn.query("USE {db:Identifier}", "TabSeparated", params={"db": database})
            for name in settings:
                if not _SETTING_NAME.match(name):
                    raise QueryRefused(115, "UNKNOWN_SETTING", f"setting name {name!r} is not an identifier")
            if query_id:  # first: no read client may set log_comment (not allowlisted), so none untags it
                conn.query(set_statement("log_comment", query_id), "TabSeparated")
            chosen = lockdown_settings(self._config, settings) if readonly else list(settings.items())
            for name, value in chosen:
                conn.query(set_statement(name, value), "TabSeparated")
            if readonly:
                statement = _vetted(conn, statement, params, self._catalog)
            if data:
                with tempfile.NamedTemporaryFile(prefix="fleetscope-insert-", delete=False) as tmp:
                    tmp.write(data)
                    tmp_name = tmp.name
                statement = infile_insert(statement, tmp_name)
            result = conn.query(statement, output_format, params=dict(params))
            out = result.bytes() or b""
            summary = {"read_rows": str(_stat(result, "rows_read")), "read_bytes": str(_stat(result, "bytes_read"))}
            return out, summary
        finally:
            conn.close()
            if tmp_name:
                os.unlink(tmp_name)

    def cancel(self, query_id: str) -> None:
        """Stop the statement ``run`` tagged ``query_id`` in the engine (``KILL QUERY`` from a connection of
        its own: the engine checks for it between blocks and gives the cores back within milliseconds)."""
        conn = self._connect()
        try:
            conn.query("KILL QUERY WHERE Settings['log_comment'] = {id:String} ASYNC", "TabSeparated",
                       params={"id": query_id})  # fmt: skip
        finally:
            conn.close()


def _vetted(conn: Any, statement: str, params: Mapping[str, str], catalog: FunctionCatalog) -> str:
    """The engine's canonical text of a read-only client's statement, once the engine's parser and AST show it
    is one read statement calling only functions that compute on their arguments (``vet_canonical``)."""
    # query parameters are read in the escaped (TSV) form: backslashes, tabs and newlines escaped
    escaped = statement.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    rendered = conn.query("SELECT formatQuerySingleLine({q:String})", "TabSeparatedRaw", params={"q": escaped})
    canonical = (rendered.bytes() or b"").decode().rstrip("\n")

    def explain_ast(text: str) -> str:
        return (conn.query(f"EXPLAIN AST {text}", "TabSeparatedRaw", params=dict(params)).bytes() or b"").decode()

    try:
        return vet_canonical(canonical, explain_ast, catalog)
    except PermissionError as exc:
        raise QueryRefused(164, "READONLY", str(exc)) from exc


def _stat(result: Any, name: str) -> int:
    try:
        return int(getattr(result, name)())
    except Exception:  # statistics are optional in the summary header
        return 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall
    server: StoreHTTPServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.bounds.idle_timeout_s)  # every read and write of it

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        log.debug("%s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        parts = urlsplit(self.path)
        if parts.path == "/ping" or (parts.path == "/" and "query" not in dict(parse_qsl(parts.query))):
            self._reply(HTTPStatus.OK, b"Ok.\n", {})  # liveness, as ClickHouse answers it
            return
        self._serve(b"", self._access())

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        """The token first, then the body under that token's caps: a stranger's body is never read."""
        access = self._access()
        if access is None:
            self._refuse(HTTPStatus.UNAUTHORIZED, _wrong_token())
            return
        raw_cap, decoded_cap = self.server.bounds.caps(access)
        try:
            chunks = raw_body(
                self.rfile, self.headers.get("Transfer-Encoding", ""), self.headers.get("Content-Length"), raw_cap
            )
            body = inflate(chunks, self.headers.get("Content-Encoding", ""), decoded_cap)
        except BodyRefused as exc:
            log.warning("store server: %d for %s: %s", exc.status, self.client_address[0], exc.args[0])
            self._refuse(exc.status, exc)
            return
        except TimeoutError:
            idle = self.server.bounds.idle_timeout_s
            log.warning("store server: closed %s: no body byte for %.0f s", self.client_address[0], idle)
            self.close_connection = True
            return
        self._serve(body, access)

    def _params(self) -> dict[str, str]:
        return dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True))

    def _access(self) -> str | None:
        return self.server.tokens.access(self._token(self._params()))

    def _token(self, params: Mapping[str, str]) -> str:
        auth = self.headers.get("Authorization", "")
        if auth.lower().startswith("basic "):
            import base64

            try:
                return base64.b64decode(auth[6:]).decode().partition(":")[2]
            except ValueError:
                return ""
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        return self.headers.get("X-ClickHouse-Key") or params.get("password", "")

    def _serve(self, body: bytes, access: str | None) -> None:
        query_id = str(uuid.uuid4())
        params = self._params()
        headers = {"X-ClickHouse-Query-Id": query_id, "X-ClickHouse-Timezone": "UTC"}
        try:
            if access is None:
                raise _wrong_token()
            statement, data = split_request(params.get("query", ""), body)
            if len(statement) > self.server.bounds.read_decoded_bytes:  # the write token's cap is for insert data
                raise BodyTooLarge(f"statement of {len(statement)} bytes exceeds the cap of a statement")
            if not statement.strip():
                raise QueryRefused(62, "SYNTAX_ERROR", "empty query")
            settings = {k: v for k, v in params.items() if k not in _TRANSPORT_PARAMS and not k.startswith("param_")}
            query_params = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
            fmt = params.get("default_format") or self.headers.get("X-ClickHouse-Format") or "TabSeparated"
            t0 = time.perf_counter()
            executor = self.server.executor
            with ClientWatch(self.connection, lambda: executor.cancel(query_id)) as watch:
                try:
                    out, summary = executor.run(
                        statement,
                        data,
                        database=params.get("database")
                        or self.headers.get("X-ClickHouse-Database")
                        or self.server.database,
                        settings=settings,
                        params=query_params,
                        output_format=fmt,
                        readonly=access != "write" or self.command == "GET",
                        query_id=query_id,
                    )
                except Exception:
                    if not watch.gone:
                        raise
            if watch.gone:
                log.info("store server: query %s cancelled after %.1f s: its client went away", query_id,
                         time.perf_counter() - t0)  # fmt: skip
                self.close_connection = True
                return
            summary["elapsed_ns"] = str(int((time.perf_counter() - t0) * 1e9))
            headers["X-ClickHouse-Summary"] = json.dumps(summary)
            headers["X-ClickHouse-Format"] = fmt
            self._reply(HTTPStatus.OK, out, headers)
        except Exception as exc:  # every failure goes back to the client as ClickHouse reports it
            message = str(exc).strip() or type(exc).__name__
            code_match = _ERROR_CODE.search(message)
            code = exc.code if isinstance(exc, QueryRefused) else int(code_match.group(1)) if code_match else 1002
            if not code_match:
                message = f"Code: {code}. DB::Exception: {message}. (UNKNOWN_EXCEPTION)"
            headers["X-ClickHouse-Exception-Code"] = str(code)
            status = _STATUS_OF_CODE.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
            self._reply(status, (message + "\n").encode(), headers)

    def _refuse(self, status: HTTPStatus, exc: Exception) -> None:
        """Answer a request whose body stays unread, then close the connection: what is left of the body is
        discarded for at most a second and a MiB (so the client reads the answer, not a reset), never kept."""
        code = getattr(exc, "code", 1002)
        self.close_connection = True
        try:
            self._reply(
                status, (str(exc) + "\n").encode(), {"X-ClickHouse-Exception-Code": str(code), "Connection": "close"}
            )
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            deadline, left = time.monotonic() + _LINGER_S, _LINGER_BYTES
            while left > 0 and time.monotonic() < deadline:
                piece = self.connection.recv(min(left, 65536))
                if not piece:
                    break
                left -= len(piece)
        except OSError:
            pass  # the client is gone: nothing to tell it

    def _reply(self, status: HTTPStatus, body: bytes, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        kind = "application/octet-stream" if status == HTTPStatus.OK else "text/plain; charset=UTF-8"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)


class StoreHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``bounds.max_connections`` of them: one more is answered 503 by the
    accepting thread and closed, so a flood of half-open connections costs sockets, not threads."""

    daemon_threads = True
    request_queue_size = 128  # connections beyond the limit are answered 503 at once, not left to SYN retries

    def __init__(
        self,
        address: tuple[str, int],
        executor: ChdbExecutor,
        tokens: Tokens,
        database: str,
        bounds: StoreServerBounds | None = None,
    ) -> None:
        super().__init__(address, _Handler)
        self.executor = executor
        self.tokens = tokens
        self.database = database
        self.bounds = bounds or StoreServerBounds()
        self._slots = threading.BoundedSemaphore(self.bounds.max_connections)
        self._refused = 0
        self._refused_logged = 0.0

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse_busy(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, request: socket.socket) -> None:
        self._refused += 1
        if time.monotonic() - self._refused_logged > 10:  # one line per 10 s of a flood, not one per socket
            self._refused_logged = time.monotonic()
            log.warning(
                "store server: %d connections open: refused %d with 503", self.bounds.max_connections, self._refused
            )
        try:
            request.settimeout(0.2)
            request.sendall(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, no traceback: a client's failure is the client's (the stdlib prints a traceback)."""
        exc = sys.exc_info()[1]
        log.warning("store server: request from %s failed: %s: %s", client_address[0], type(exc).__name__, exc)


class StoreServer:
    """The HTTP interface of a chDB store on 127.0.0.1, served by a background thread."""

    def __init__(
        self,
        chdb_path: str,
        tokens: Tokens,
        *,
        database: str = "default",
        port: int = 0,
        bounds: StoreServerBounds | None = None,
        config: StoreConfig | None = None,
    ) -> None:
        executor = ChdbExecutor(chdb_path, config)
        self._httpd = StoreHTTPServer(("127.0.0.1", port), executor, tokens, database, bounds)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="store-server", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StoreServer:
        self._thread.start()
        log.info("store served on %s", self.url)
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
