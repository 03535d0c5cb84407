"""Serve the embedded chDB store over a ClickHouse-compatible HTTP interface on loopback.

chDB admits one process per data directory, and ``fleetscope up`` is that process while it runs; it
serves the store so that ``fleetscope sql/findings/report``, clickhouse-connect's HTTP client and
Grafana's ClickHouse datasource can query it meanwhile. Implemented: ``/ping``, queries in the URL
(``query=``) or the body, ``database``, ``param_<name>`` server-side parameters, settings as URL
parameters, any output format chDB writes (Native, RowBinary, JSON...), request bodies compressed as
the client negotiates (lz4, zstd, gzip, deflate, br) or chunked, and inserts (``INSERT ... FORMAT X``
followed by the data).

Two tokens (HTTP basic password, ``X-ClickHouse-Key`` or ``password=``): the write token may do
anything; the read token runs every statement on a chDB connection locked down as ``run_sql``'s read-only
session is (``user_sql.lockdown_settings``: only allowlisted client settings, the ``read_*`` bounds, no
``Python()``, no introspection, then ``readonly=1``, which the engine enforces and the client cannot lift),
and only once the engine's parser and AST show one read statement without ``INTO OUTFILE`` (which chDB
writes in-process even read-only) calling only pure functions (``sinks.clickhouse.user_sql.vet_canonical``).
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from fleetscope.endpoint import Tokens
from fleetscope.sinks.clickhouse.user_sql import (
    FUNCTION_CATALOG_QUERY,
    FunctionCatalog,
    lockdown_settings,
    set_statement,
    vet_canonical,
)
from fleetscope.sinks.store_config import ClickHouseConfig

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
    47: HTTPStatus.NOT_FOUND,  # UNKNOWN_IDENTIFIER
    60: HTTPStatus.NOT_FOUND,  # UNKNOWN_TABLE
    81: HTTPStatus.NOT_FOUND,  # UNKNOWN_DATABASE
    164: HTTPStatus.FORBIDDEN,  # READONLY
    497: HTTPStatus.FORBIDDEN,  # ACCESS_DENIED
    516: HTTPStatus.UNAUTHORIZED,  # AUTHENTICATION_FAILED
}


class QueryRefused(Exception):
    """A request the server will not run; ``code`` is the ClickHouse error code it answers with."""

    def __init__(self, code: int, name: str, message: str) -> None:
        super().__init__(f"Code: {code}. DB::Exception: {message}. ({name})")
        self.code = code


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
    quoted = data_path.replace("\\", "\\\\").replace("'", "\\'")
    return f"{head} FROM INFILE '{quoted}'{settings} FORMAT {fmt}"


def decompress(data: bytes, encoding: str) -> bytes:
    """A request body in the Content-Encoding the client chose (concatenated frames included)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity", "none"):
        return data
    if encoding == "gzip":
        return gzip.decompress(data)
    if encoding == "deflate":
        return zlib.decompress(data)
    if encoding == "lz4":
        import lz4.frame

        out = bytearray()
        rest = data
        while rest:
            d = lz4.frame.LZ4FrameDecompressor()
            out += d.decompress(rest)
            rest = d.unused_data if d.eof else b""
        return bytes(out)
    if encoding == "zstd":
        from backports import zstd  # clickhouse-connect's own zstd (the stdlib's compression.zstd in 3.14)

        return bytes(zstd.decompress(data))
    if encoding == "br":
        try:
            import brotli
        except ImportError:
            raise QueryRefused(1, "UNSUPPORTED_METHOD", "br bodies need the brotli package; use lz4") from None
        return bytes(brotli.decompress(data))
    raise QueryRefused(1, "UNSUPPORTED_METHOD", f"unknown Content-Encoding {encoding!r}")


class ChdbExecutor:
    """Runs one request on a fresh chDB connection to the process's engine (0.1 ms to open), so the
    settings it SETs, read-only mode included, die with it. ``config`` bounds the read-only requests."""

    def __init__(self, path: str, config: ClickHouseConfig | None = None) -> None:
        import chdb

        connect: Callable[[str], Any] = chdb.connect
        self._connect: Callable[[], Any] = lambda: connect(path)
        self._config = config or ClickHouseConfig()
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
    ) -> tuple[bytes, dict[str, str]]:
        """(output, summary) of one statement. Read-only: the client's settings reach the session only
        through ``lockdown_settings`` (allowlisted, before the bounds and ``readonly=1``)."""
        conn = self._connect()
        tmp_name = ""
        try:
            if database:
                conn.query(f"USE `{database.replace('`', '')}`", "TabSeparated")
            for name in settings:
                if not _SETTING_NAME.match(name):
                    raise QueryRefused(115, "UNKNOWN_SETTING", f"setting name {name!r} is not an identifier")
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

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        log.debug("%s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        parts = urlsplit(self.path)
        if parts.path == "/ping" or (parts.path == "/" and "query" not in dict(parse_qsl(parts.query))):
            self._reply(HTTPStatus.OK, b"Ok.\n", {})  # liveness, as ClickHouse answers it
            return
        self._serve(b"")

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self._serve(self._body())

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

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

    def _serve(self, raw_body: bytes) -> None:
        query_id = str(uuid.uuid4())
        params = dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True))
        headers = {"X-ClickHouse-Query-Id": query_id, "X-ClickHouse-Timezone": "UTC"}
        try:
            access = self.server.tokens.access(self._token(params))
            if access is None:
                raise QueryRefused(516, "AUTHENTICATION_FAILED", "fleetscope: authentication failed: wrong token")
            body = decompress(raw_body, self.headers.get("Content-Encoding", ""))
            statement, data = split_request(params.get("query", ""), body)
            if not statement.strip():
                raise QueryRefused(62, "SYNTAX_ERROR", "empty query")
            settings = {k: v for k, v in params.items() if k not in _TRANSPORT_PARAMS and not k.startswith("param_")}
            query_params = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
            fmt = params.get("default_format") or self.headers.get("X-ClickHouse-Format") or "TabSeparated"
            t0 = time.perf_counter()
            out, summary = self.server.executor.run(
                statement,
                data,
                database=params.get("database") or self.headers.get("X-ClickHouse-Database") or self.server.database,
                settings=settings,
                params=query_params,
                output_format=fmt,
                readonly=access != "write" or self.command == "GET",
            )
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
    daemon_threads = True

    def __init__(self, address: tuple[str, int], executor: ChdbExecutor, tokens: Tokens, database: str) -> None:
        super().__init__(address, _Handler)
        self.executor = executor
        self.tokens = tokens
        self.database = database


class StoreServer:
    """The HTTP interface of a chDB store on 127.0.0.1, served by a background thread."""

    def __init__(
        self,
        chdb_path: str,
        tokens: Tokens,
        *,
        database: str = "default",
        port: int = 0,
        config: ClickHouseConfig | None = None,
    ) -> None:
        executor = ChdbExecutor(chdb_path, config)
        self._httpd = StoreHTTPServer(("127.0.0.1", port), executor, tokens, database)
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
