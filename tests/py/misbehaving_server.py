#!/usr/bin/env python3
"""A deliberately misbehaving MCP server, for testing how custody's MCP client copes.

Standard library only (asyncio with hand-written HTTP/1.1), so each misbehaviour is exact
down to the byte: a hang, a dropped connection, a slow body, broken JSON or UTF-8.

Outside its one misbehaviour it is a correct Streamable HTTP MCP server of the handshake
("legacy") era, shaped after the real exchanges in research/mcp/transcripts/:

  * POST /mcp `initialize` -> 200 SSE, a new `mcp-session-id` (32 hex), protocolVersion
    echoed when it is 2025-11-25/2025-06-18/2025-03-26/2024-11-05, otherwise 2025-11-25.
  * `notifications/initialized` (any notification or client response) -> 202, empty body.
  * `tools/list`, `tools/call`, `ping`; any other method -> -32601 inside the SSE reply.
    Tools: create_basket(customer) and get_basket(basket_id); get_basket answers
    `isError: true` with `BASKET_NOT_FOUND: ...` for an unknown id.
  * A request without a session id (including the 2026-07-28 probe `server/discover`) ->
    400 {"jsonrpc":"2.0","error":{"code":-32000,"message":"Bad Request: Server not
    initialized"},"id":null}, exactly as the TypeScript SDK v1 answers, so a client falls
    back to `initialize`.
  * An unknown session id -> 404 -32600 "Session not found" (Python SDK shape); in the
    stale_session_400 case the TypeScript SDK's 400 -32000 instead.
  * A bad MCP-Protocol-Version header -> 400 -32000 "Unsupported protocol version".
  * GET /mcp -> 405 (no standalone stream); DELETE /mcp -> 200 and the session is gone.
  * Replies are SSE framed like the Python SDK (`event: message\\r\\ndata: ...\\r\\n\\r\\n`,
    chunked, then the stream ends); notifications_first and drop_mid_stream use the
    TypeScript SDK's framing (LF, `id:` on every event, a priming event with empty data).

MISBEHAVE_CASE (one per process):
  ok                   no misbehaviour (the control)
  hang                 reads every request, never answers (until the client hangs up)
  hang_after_init      handshake and ping work; tools/list and tools/call never answer
  invalid_json         tools/list -> 200 application/json whose body is not JSON
  huge_event           tools/list -> SSE with one event larger than MISBEHAVE_EVENT_BYTES
  cursor_loop          tools/list -> one tool and the same nextCursor, forever
  jsonrpc_error        tools/list -> JSON-RPC error -32603 "internal error"
  notifications_first  tools/list -> SSE with progress/message notifications before the result
  forget_session       after the first tools/list page, the next request on that session
                       -> 404 "Session not found" (once; the session stays forgotten)
  stale_session_400    as forget_session, but the TypeScript SDK's 400 -32000 without id
  http_500             after initialize, every request -> 500 with an HTML body
  init_500             every POST, the first included -> 500 with an HTML body
  unauthorized         every POST -> 401 text/plain without a WWW-Authenticate challenge
  not_json_rpc         every POST -> 200 application/json {"hello": "world"}: JSON, not JSON-RPC
  forbidden            every POST -> 403 text/plain without a WWW-Authenticate challenge
  drop_mid_stream      tools/list -> SSE priming event with an id, then the connection closes
                       (a GET resume with Last-Event-ID gets the same treatment)
  slow_bytes           tools/list -> correct SSE reply, one byte every MISBEHAVE_BYTE_DELAY_MS
  wrong_id             tools/list -> a response whose id is not the request's
  invalid_utf8         tools/list -> application/json with invalid UTF-8 inside a string
  slow_list            tools/list -> the correct reply after MISBEHAVE_LIST_DELAY_MS, plus a
                       read-only tool listing_<N> numbering the listings (1, 2, ...), so a test
                       can tell whose listing reached a status; logs `listing <N> started`
  redirect             every request -> 307 to MISBEHAVE_REDIRECT_TO (a client must not follow)
  string_id            tools/list and tools/call -> the right answer with the id as a string
                       ("1" for 1: another JSON type, the same digits)
  string_id_init       initialize -> the right answer with the id as a string
  error_event          tools/list and tools/call -> SSE `event: error` whose data is a JSON-RPC
                       error response -32603 "database unavailable" with the request's id
                       (python-sdk and typescript-sdk issues on error events)
  unterminated_event   tools/list and tools/call -> SSE whose one event (the right answer) lacks
                       its closing blank line, then the stream ends
  unterminated_init    initialize -> the same
  bad_tool_names       tools/list -> the two good tools plus three whose exposed name
                       <server>_<tool> breaks the rules: `basket.peek` (a dot), `baskets/list`
                       (a slash), `x` * 70 (too long)
  refuse_eras          initialize -> 400 {"id": <the id>, "error": {-32600 "Unsupported protocol
                       version"}} (server/discover gets the usual 400 -32000): both eras refused

  The call_* cases misbehave on tools/call of the tools in MISBEHAVE_TOOLS only (discovery and
  every other tool work), for the first MISBEHAVE_TIMES such calls, so a test can show that the
  next run succeeds:
  call_hang            runs the tool (the write lands), then never answers
  call_http_500        answers 500 with an HTML body without running the tool (a gateway error)
  call_drop_mid_stream runs the tool, sends the SSE priming event with an id, then closes the
                       connection (a GET resume with Last-Event-ID gets the same treatment)
  call_slow_bytes      runs the tool; the correct SSE reply, one byte every MISBEHAVE_BYTE_DELAY_MS
  call_close_listener  runs the tool and answers it, then closes its listening socket and every
                       open connection (connections are refused, the state is kept) until the file
                       MISBEHAVE_REOPEN_FILE exists, then listens on the same port again

  Besides create_basket and get_basket (the only tools listed), tools/call also serves
  add_item(basket_id, sku, qty) and count_baskets() -> {"count": baskets ever created};
  create_basket takes an optional idempotency_key and returns the first basket created with it.

Environment:
  MISBEHAVE_PORT           TCP port on 127.0.0.1 (required; 0 = any free port, see stderr)
  MISBEHAVE_CASE           one of the cases above                      (ok)
  MISBEHAVE_PATH           endpoint path                               (/mcp)
  MISBEHAVE_EVENT_BYTES    huge_event: the event exceeds this size     (2097152)
  MISBEHAVE_BYTE_DELAY_MS  slow_bytes: delay between body bytes        (200)
  MISBEHAVE_LIST_DELAY_MS  slow_list: delay before the tools/list reply (5000)
  MISBEHAVE_REDIRECT_TO    redirect: the Location of every answer       (http://169.254.169.254/mcp)
  MISBEHAVE_PAGINATE       1 = tools/list in two pages in every case   (forget_session and
                           stale_session_400 always paginate)
  MISBEHAVE_TOOLS          call_*: comma-separated tools that misbehave (every tool)
  MISBEHAVE_ON             string_id, error_event, unterminated_event: the methods whose replies
                           misbehave, comma-separated              (tools/list,tools/call)
  MISBEHAVE_TIMES          call_*: misbehave on this many calls, then behave (0 = always) (0)
  MISBEHAVE_REOPEN_FILE    call_close_listener: listen again once this file exists (required)

Prints `ready` on stdout once listening; logs one line per request on stderr.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import http
import json
import os
import secrets
import signal
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

CASES = (
    "ok",
    "hang",
    "hang_after_init",
    "invalid_json",
    "huge_event",
    "cursor_loop",
    "jsonrpc_error",
    "notifications_first",
    "forget_session",
    "stale_session_400",
    "http_500",
    "drop_mid_stream",
    "slow_bytes",
    "wrong_id",
    "invalid_utf8",
    "slow_list",
    "redirect",
    "call_hang",
    "call_http_500",
    "call_drop_mid_stream",
    "call_slow_bytes",
    "call_close_listener",
    "string_id",
    "string_id_init",
    "error_event",
    "unterminated_event",
    "unterminated_init",
    "refuse_eras",
    "bad_tool_names",
    "init_500",
    "unauthorized",
    "forbidden",
    "not_json_rpc",
)

# Handshake-era versions, newest first (what the TS SDK v1 supports, minus 2024-10-07).
HANDSHAKE_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
LATEST = HANDSHAKE_VERSIONS[0]

MAX_HEAD = 64 * 1024  # request line + headers
MAX_BODY = 4 * 1024 * 1024
IO_CHUNK = 64 * 1024
EVENT_GAP_S = 0.05  # between the SSE events of notifications_first
DROP_AFTER_S = 0.1  # drop_mid_stream: pause between the first event and the close


def _env_int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SystemExit(f"{name} must be >= {minimum}, got {value}")
    return value


CASE = os.environ.get("MISBEHAVE_CASE", "ok").strip() or "ok"
if CASE not in CASES:
    raise SystemExit(f"MISBEHAVE_CASE must be one of {', '.join(CASES)}; got {CASE!r}")
if not os.environ.get("MISBEHAVE_PORT", "").strip():
    raise SystemExit("MISBEHAVE_PORT is required (0 = any free port)")
PORT = _env_int("MISBEHAVE_PORT", 0)
PATH = os.environ.get("MISBEHAVE_PATH", "/mcp")
EVENT_BYTES = _env_int("MISBEHAVE_EVENT_BYTES", 2 * 1024 * 1024, minimum=1)
BYTE_DELAY_S = _env_int("MISBEHAVE_BYTE_DELAY_MS", 200, minimum=1) / 1000.0
LIST_DELAY_S = _env_int("MISBEHAVE_LIST_DELAY_MS", 5000) / 1000.0
PAGINATE = os.environ.get("MISBEHAVE_PAGINATE", "0").strip() in ("1", "true", "yes", "on")
PAGINATE = PAGINATE or CASE in ("forget_session", "stale_session_400")
REDIRECT_TO = os.environ.get("MISBEHAVE_REDIRECT_TO", "http://169.254.169.254/mcp")
REPLY_METHODS = {m.strip() for m in
                 os.environ.get("MISBEHAVE_ON", "tools/list,tools/call").split(",") if m.strip()}
CALL_TOOLS = {t.strip() for t in os.environ.get("MISBEHAVE_TOOLS", "").split(",") if t.strip()}
CALL_TIMES = _env_int("MISBEHAVE_TIMES", 0)
REOPEN_FILE = os.environ.get("MISBEHAVE_REOPEN_FILE", "")
if CASE == "call_close_listener" and not REOPEN_FILE:
    raise SystemExit("call_close_listener needs MISBEHAVE_REOPEN_FILE")


@dataclass
class Listener:
    """The listening server and the open connections (call_close_listener closes them all)."""
    server: asyncio.base_events.Server | None = None
    port: int = 0
    writers: set = field(default_factory=set)


LISTENER = Listener()


def log(line: str) -> None:
    print(f"misbehave[{CASE}] {line}", file=sys.stderr, flush=True)


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# --------------------------------------------------------------------------- tools

def _tool(name: str, title: str, description: str, input_schema: dict, output_schema: dict,
          read_only: bool) -> dict:
    # Key order as the Python SDK writes it (transcripts 03, 52, 53).
    return {
        "annotations": {
            "destructiveHint": False,
            "idempotentHint": read_only,
            "openWorldHint": False,
            "readOnlyHint": read_only,
            "title": title,
        },
        "description": description,
        "inputSchema": input_schema,
        "name": name,
        "outputSchema": output_schema,
        "title": title,
    }


CREATE_BASKET = _tool(
    "create_basket",
    "Create basket",
    "Create a new empty shopping basket for a customer and return its handle in "
    "structuredContent.basket_id (prefix bsk_).",
    {
        "properties": {"customer": {"title": "Customer", "type": "string"}},
        "required": ["customer"],
        "type": "object",
        "title": "create_basketArguments",
    },
    {
        "properties": {
            "basket_id": {
                "description": "Opaque basket handle, prefix bsk_",
                "title": "Basket Id",
                "type": "string",
            }
        },
        "required": ["basket_id"],
        "type": "object",
        "title": "CreatedBasket",
    },
    read_only=False,
)

BASKET_VIEW_SCHEMA = {
    "properties": {
        "basket_id": {"title": "Basket Id", "type": "string"},
        "customer": {"title": "Customer", "type": "string"},
        "items": {"items": {"$ref": "#/$defs/Line"}, "title": "Items", "type": "array"},
        "item_count": {"title": "Item Count", "type": "integer"},
    },
    "required": ["basket_id", "customer", "items", "item_count"],
    "type": "object",
    "$defs": {
        "Line": {
            "properties": {
                "sku": {"title": "Sku", "type": "string"},
                "qty": {"title": "Qty", "type": "integer"},
            },
            "required": ["sku", "qty"],
            "title": "Line",
            "type": "object",
        }
    },
    "title": "BasketView",
}

GET_BASKET_DESCRIPTION = (
    "Read-only probe: return the basket's contents. Returns isError (text starting "
    "BASKET_NOT_FOUND) when the handle is unknown."
)


def get_basket_tool(description: str = GET_BASKET_DESCRIPTION) -> dict:
    return _tool(
        "get_basket",
        "Get basket",
        description,
        {
            "properties": {"basket_id": {"title": "Basket Id", "type": "string"}},
            "required": ["basket_id"],
            "type": "object",
            "title": "get_basketArguments",
        },
        BASKET_VIEW_SCHEMA,
        read_only=True,
    )


def cursor_for(offset: int) -> str:
    return base64.b64encode(f"off:{offset}".encode()).decode()  # like the Python SDK's "b2ZmOjI="


ALL_TOOLS = [CREATE_BASKET, get_basket_tool()]
PAGE2_CURSOR = cursor_for(1)
LOOP_CURSOR = cursor_for(1)


# --------------------------------------------------------------------------- state

@dataclass
class Session:
    sid: str
    protocol: str
    initialized: bool = False


@dataclass
class State:
    sessions: dict[str, Session] = field(default_factory=dict)
    baskets: dict[str, dict] = field(default_factory=dict)
    # forget_session / stale_session_400: "armed" -> "pending" (doomed sid set) -> "done"
    forget: str = "armed"
    doomed_sid: str | None = None
    cursor_loop_pages: int = 0
    listings: int = 0
    resumes: int = 0
    # create_basket's idempotency keys -> basket id; baskets ever created; call_* misbehaviours
    basket_keys: dict[str, str] = field(default_factory=dict)
    baskets_created: int = 0
    call_faults: int = 0


STATE = State()


class Close(Exception):
    """Drop the connection without another byte."""


# --------------------------------------------------------------------------- HTTP

@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.keep_alive = True

    async def read_request(self) -> Request | None:
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                log(f"connection closed mid-request ({len(e.partial)} bytes)")
            return None
        except asyncio.LimitOverrunError:
            await self.send(431, [("content-type", "text/plain")], b"Request Header Fields Too Large\n")
            raise Close from None
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ", 2)
        except ValueError:
            await self.send(400, [("content-type", "text/plain")], b"Bad Request\n")
            raise Close from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if version == "HTTP/1.0" or headers.get("connection", "").lower() == "close":
            self.keep_alive = False
        if headers.get("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = await self._read_chunked()
        elif headers.get("content-length"):
            try:
                length = int(headers["content-length"])
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY:
                await self.send(413, [("content-type", "text/plain")], b"Payload Too Large\n")
                raise Close
            body = await self.reader.readexactly(length)
        return Request(method, target, version, headers, body)

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            size_line = await self.reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await self.reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return bytes(body)
            if len(body) + size > MAX_BODY:
                await self.send(413, [("content-type", "text/plain")], b"Payload Too Large\n")
                raise Close
            body += await self.reader.readexactly(size)
            await self.reader.readexactly(2)

    def _head(self, status: int, headers: list[tuple[str, str]]) -> bytes:
        out = [f"HTTP/1.1 {status} {_reason(status)}",
               f"date: {email.utils.formatdate(usegmt=True)}",
               "server: misbehaving-mcp"]
        out += [f"{k}: {v}" for k, v in headers]
        if not self.keep_alive:
            out.append("connection: close")
        return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.writer.write(self._head(status, headers + [("content-length", str(len(body)))]) + body)
        await self.writer.drain()

    async def start_chunked(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.writer.write(self._head(status, headers + [("Transfer-Encoding", "chunked")]))
        await self.writer.drain()

    async def chunk(self, data: bytes) -> None:
        if self.writer.is_closing() or self.reader.at_eof():
            raise Close  # the client hung up: stop writing
        if data:
            self.writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await self.writer.drain()

    async def end_chunked(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    async def hang(self) -> None:
        """Never answer: read and discard until the peer hangs up, then drop the connection."""
        while await self.reader.read(IO_CHUNK):
            pass
        raise Close


def sse_headers(sid: str | None) -> list[tuple[str, str]]:
    headers = [("cache-control", "no-cache, no-transform"), ("connection", "keep-alive"),
               ("content-type", "text/event-stream")]
    if sid:
        headers.append(("mcp-session-id", sid))
    headers.append(("x-accel-buffering", "no"))
    return headers


def py_event(message: dict) -> bytes:
    """One SSE event as the Python SDK server writes it (CRLF)."""
    return b"event: message\r\ndata: " + dumps(message).encode() + b"\r\n\r\n"


def ts_event(data: str, event: bool = True) -> bytes:
    """One SSE event as the TypeScript SDK server writes it (LF, an id on each event)."""
    head = "event: message\n" if event else ""
    return f"{head}id: {uuid.uuid4()}\ndata: {data}\n\n".encode()


def ts_message(payload: dict, msg_id: Any = None, has_id: bool = False) -> str:
    # The TS SDK puts jsonrpc (and id) last: {"result":...,"jsonrpc":"2.0","id":3}.
    out = dict(payload)
    out["jsonrpc"] = "2.0"
    if has_id:
        out["id"] = msg_id
    return dumps(out)


def py_json_headers() -> list[tuple[str, str]]:
    return [("content-type", "application/json")]


async def send_sse(conn: Conn, sid: str | None, message: dict) -> None:
    await conn.start_chunked(200, sse_headers(sid))
    await conn.chunk(py_event(message))
    await conn.end_chunked()


async def send_reply(conn: Conn, sid: str | None, message: dict, init: bool = False,
                     method: str = "") -> None:
    """A reply to initialize (init) or to tools/list and tools/call (method), misbehaving as CASE
    says; a method not in MISBEHAVE_ON is answered correctly."""
    case = CASE.removesuffix("_init") if init == CASE.endswith("_init") else "ok"
    if method and method not in REPLY_METHODS:
        case = "ok"
    if case == "string_id":
        message = {**message, "id": str(message["id"])}
        log(f"  ... sent with the id as a string: {dumps(message['id'])}")
    if case == "error_event":
        error = {"jsonrpc": "2.0", "id": message["id"],
                 "error": {"code": -32603, "message": "database unavailable"}}
        log("  ... sent as `event: error` with a JSON-RPC error")
        await conn.start_chunked(200, sse_headers(sid))
        await conn.chunk(b"event: error\r\ndata: " + dumps(error).encode() + b"\r\n\r\n")
        await conn.end_chunked()
        return
    if case in ("unterminated_event", "unterminated"):
        log("  ... sent as one SSE event without its closing blank line")
        await conn.start_chunked(200, sse_headers(sid))
        await conn.chunk(b"event: message\r\ndata: " + dumps(message).encode())
        await conn.end_chunked()
        return
    await send_sse(conn, sid, message)


async def send_json_error(conn: Conn, status: int, body: dict, sid: str | None = None,
                          content_type: str = "application/json") -> None:
    headers = [("content-type", content_type)]
    if sid:
        headers.append(("mcp-session-id", sid))
    await conn.send(status, headers, dumps(body).encode())


# Canned error bodies, copied from the transcripts.
NOT_INITIALIZED = {"jsonrpc": "2.0", "error": {"code": -32000, "message": "Bad Request: Server not initialized"}, "id": None}  # 77, 79
SESSION_NOT_FOUND = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "Session not found"}}  # 10, 18
NO_VALID_SESSION = {"jsonrpc": "2.0", "error": {"code": -32000, "message": "Bad Request: No valid session ID provided"}}  # 76
HTML_500 = (b"<html>\r\n<head><title>500 Internal Server Error</title></head>\r\n<body>\r\n"
            b"<center><h1>500 Internal Server Error</h1></center>\r\n<hr><center>nginx</center>\r\n"
            b"</body>\r\n</html>\r\n")


def unknown_session_status() -> int:
    return 400 if CASE == "stale_session_400" else 404


async def send_unknown_session(conn: Conn) -> None:
    if CASE == "stale_session_400":
        await send_json_error(conn, 400, NO_VALID_SESSION, content_type="application/json; charset=utf-8")
    else:
        await send_json_error(conn, 404, SESSION_NOT_FOUND)


async def send_500(conn: Conn) -> None:
    await conn.send(500, [("content-type", "text/html")], HTML_500)


# --------------------------------------------------------------------------- MCP

def tools_page(cursor: Any) -> dict:
    """The legacy tools/list result for a cursor; raises ValueError for a bad cursor."""
    if not PAGINATE:
        if cursor is not None:
            raise ValueError("Invalid cursor")
        return {"tools": ALL_TOOLS}
    if cursor is None:
        return {"nextCursor": PAGE2_CURSOR, "tools": ALL_TOOLS[:1]}
    if cursor == PAGE2_CURSOR:
        return {"tools": ALL_TOOLS[1:]}
    raise ValueError("Invalid cursor")


def tool_text_result(text: str, is_error: bool, structured: dict | None = None) -> dict:
    result: dict[str, Any] = {"content": [{"text": text, "type": "text"}], "isError": is_error}
    if structured is not None:
        result["structuredContent"] = structured
    return result


def call_tool(params: dict) -> dict:
    name = params.get("name")
    args = params.get("arguments") or {}
    if not isinstance(args, dict):
        return tool_text_result(f"Error executing tool {name}: arguments must be an object", True)
    if name == "create_basket":
        customer = args.get("customer")
        if not isinstance(customer, str):
            return tool_text_result("Error executing tool create_basket: customer: Field required", True)
        key = args.get("idempotency_key")
        if isinstance(key, str) and key in STATE.basket_keys:
            value = {"basket_id": STATE.basket_keys[key]}
            return tool_text_result(json.dumps(value, indent=2), False, value)
        basket_id = "bsk_" + secrets.token_hex(8)
        STATE.baskets[basket_id] = {"basket_id": basket_id, "customer": customer, "items": [], "item_count": 0}
        STATE.baskets_created += 1
        if isinstance(key, str):
            STATE.basket_keys[key] = basket_id
        value = {"basket_id": basket_id}
        return tool_text_result(json.dumps(value, indent=2), False, value)
    if name == "add_item":
        basket = STATE.baskets.get(args.get("basket_id"))
        sku, qty = args.get("sku"), args.get("qty")
        if basket is None:
            return tool_text_result(f"BASKET_NOT_FOUND: no basket with id '{args.get('basket_id')}'", True)
        if not isinstance(sku, str) or not isinstance(qty, int):
            return tool_text_result("Error executing tool add_item: sku and qty required", True)
        basket["items"].append({"sku": sku, "qty": qty})
        basket["item_count"] = sum(line["qty"] for line in basket["items"])
        return tool_text_result(json.dumps(basket, indent=2), False, dict(basket))
    if name == "count_baskets":
        value = {"count": STATE.baskets_created}
        return tool_text_result(json.dumps(value), False, value)
    if name == "get_basket":
        basket_id = args.get("basket_id")
        if not isinstance(basket_id, str):
            return tool_text_result("Error executing tool get_basket: basket_id: Field required", True)
        basket = STATE.baskets.get(basket_id)
        if basket is None:
            return tool_text_result(f"BASKET_NOT_FOUND: no basket with id '{basket_id}'", True)
        return tool_text_result(json.dumps(basket, indent=2), False, dict(basket))
    return tool_text_result(f"Unknown tool: {name}", True)


def accepts_both(req: Request) -> bool:
    accept = [part.split(";")[0].strip().lower() for part in (req.header("accept") or "").split(",")]
    return ("application/json" in accept or "*/*" in accept) and (
        "text/event-stream" in accept or "*/*" in accept)


async def handle(conn: Conn, req: Request) -> None:
    sid = req.header("mcp-session-id")
    path = req.target.split("?", 1)[0]

    if CASE == "hang":
        log(f"{req.method} {path} session={sid or '-'} -> hang")
        await conn.hang()

    if CASE == "redirect":
        log(f"{req.method} {path} -> 307 {REDIRECT_TO}")
        await conn.send(307, [("location", REDIRECT_TO), ("content-type", "text/plain")], b"moved\n")
        return

    if path != PATH:
        log(f"{req.method} {path} -> 404 (not the MCP endpoint)")
        await conn.send(404, [("content-type", "text/plain")], b"Not Found\n")
        return

    if req.method == "POST":
        await handle_post(conn, req, sid)
    elif req.method == "GET":
        await handle_get(conn, req, sid)
    elif req.method == "DELETE":
        await handle_delete(conn, sid)
    else:
        log(f"{req.method} {path} -> 405")
        await conn.send(405, [("allow", "GET, POST, DELETE"), ("content-type", "text/plain")],
                        b"Method Not Allowed\n")


def session_trap(sid: str | None) -> bool:
    """forget_session / stale_session_400: is this the one request that finds its session gone?"""
    if STATE.forget == "pending" and sid is not None and sid == STATE.doomed_sid:
        STATE.forget = "done"
        STATE.sessions.pop(sid, None)
        return True
    return False


async def handle_get(conn: Conn, req: Request, sid: str | None) -> None:
    last_event_id = req.header("last-event-id")
    what = f"GET session={sid or '-'} last-event-id={last_event_id or '-'}"
    if session_trap(sid):
        log(f"{what} -> {unknown_session_status()} forgotten session (once)")
        await send_unknown_session(conn)
        return
    if not sid:
        log(f"{what} -> 400 (no session)")
        await send_json_error(conn, 400, NOT_INITIALIZED)
        return
    if sid not in STATE.sessions:
        log(f"{what} -> {unknown_session_status()} unknown session")
        await send_unknown_session(conn)
        return
    if CASE == "http_500":
        log(f"{what} -> 500")
        await send_500(conn)
        return
    if CASE in ("drop_mid_stream", "call_drop_mid_stream") and last_event_id:
        STATE.resumes += 1
        log(f"{what} -> resume #{STATE.resumes}: priming event, then drop")
        await conn.start_chunked(200, sse_headers(sid))
        await conn.chunk(ts_event("", event=False))
        await asyncio.sleep(DROP_AFTER_S)
        raise Close
    log(f"{what} -> 405 (no standalone SSE stream)")
    await conn.send(405, [("allow", "POST, DELETE"), ("content-type", "text/plain")],
                    b"Method Not Allowed\n")


async def handle_delete(conn: Conn, sid: str | None) -> None:
    what = f"DELETE session={sid or '-'}"
    if session_trap(sid):
        log(f"{what} -> {unknown_session_status()} forgotten session (once)")
        await send_unknown_session(conn)
        return
    if not sid:
        log(f"{what} -> 400 (no session)")
        await send_json_error(conn, 400, NOT_INITIALIZED)
        return
    if sid not in STATE.sessions:
        log(f"{what} -> {unknown_session_status()} unknown session")
        await send_unknown_session(conn)
        return
    if CASE == "http_500":
        log(f"{what} -> 500")
        await send_500(conn)
        return
    del STATE.sessions[sid]
    log(f"{what} -> 200 (session ended)")
    await conn.send(200, [("content-type", "application/json"), ("mcp-session-id", sid)], b"")


async def handle_post(conn: Conn, req: Request, sid: str | None) -> None:
    try:
        msg = json.loads(req.body)
    except (UnicodeDecodeError, ValueError):
        log(f"POST session={sid or '-'} -> 400 parse error")
        await send_json_error(conn, 400, {"jsonrpc": "2.0", "id": None,
                                          "error": {"code": -32700, "message": "Parse error"}})
        return
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
        log(f"POST session={sid or '-'} -> 400 invalid request (batch or not JSON-RPC 2.0)")
        await send_json_error(conn, 400, {"jsonrpc": "2.0", "id": None,
                                          "error": {"code": -32600, "message": "Invalid Request"}})
        return

    method = msg.get("method")
    has_id = "id" in msg
    rid = msg.get("id")
    what = f"POST {method or ('response' if has_id else '?')}" + (f" id={dumps(rid)}" if has_id else "") + \
        f" session={sid or '-'}"

    if not accepts_both(req):
        log(f"{what} -> 406")
        await send_json_error(conn, 406, {"jsonrpc": "2.0", "id": None, "error": {
            "code": -32600,
            "message": "Not Acceptable: Client must accept both application/json and text/event-stream"}})
        return

    if CASE == "not_json_rpc":
        log(f"{what} -> 200 JSON that is not JSON-RPC (every POST)")
        await conn.send(200, [("content-type", "application/json")], b'{"hello": "world"}')
        return

    every_post = {"init_500": 500, "unauthorized": 401, "forbidden": 403}.get(CASE)
    if every_post is not None:
        log(f"{what} -> {every_post} (every POST)")
        if every_post == 500:
            await send_500(conn)
        else:
            phrase = http.HTTPStatus(every_post).phrase
            await conn.send(every_post, [("content-type", "text/plain")], f"{phrase}\n".encode())
        return

    if method == "initialize" and has_id and CASE == "refuse_eras":
        log(f"{what} -> 400 -32600 Unsupported protocol version")
        await send_json_error(conn, 400, {"jsonrpc": "2.0", "id": rid, "error": {
            "code": -32600, "message": "Unsupported protocol version"}})
        return

    if method == "initialize" and has_id:
        params = msg.get("params") or {}
        asked = params.get("protocolVersion") if isinstance(params, dict) else None
        version = asked if asked in HANDSHAKE_VERSIONS else LATEST
        new_sid = uuid.uuid4().hex
        STATE.sessions[new_sid] = Session(new_sid, version)
        log(f"{what} -> 200 new session {new_sid} protocolVersion={version}")
        await send_reply(conn, new_sid, {"jsonrpc": "2.0", "id": rid, "result": {
            "capabilities": {"tools": {"listChanged": False}},
            "instructions": f"Misbehaving MCP test server (case {CASE}).",
            "protocolVersion": version,
            "serverInfo": {"name": "misbehaving-server", "title": "Misbehaving MCP test server",
                           "version": "0.1.0"},
        }}, init=True)
        return

    if session_trap(sid):
        log(f"{what} -> {unknown_session_status()} forgotten session (once)")
        await send_unknown_session(conn)
        return
    if not sid:
        log(f"{what} -> 400 (no session: server not initialized)")
        await send_json_error(conn, 400, NOT_INITIALIZED)
        return
    session = STATE.sessions.get(sid)
    if session is None:
        log(f"{what} -> {unknown_session_status()} unknown session")
        await send_unknown_session(conn)
        return
    header_version = req.header("mcp-protocol-version")
    if header_version is not None and header_version not in HANDSHAKE_VERSIONS:
        log(f"{what} -> 400 unsupported MCP-Protocol-Version {header_version}")
        await send_json_error(conn, 400, {"jsonrpc": "2.0", "error": {
            "code": -32000,
            "message": f"Bad Request: Unsupported protocol version: {header_version} "
                       f"(supported versions: {', '.join(HANDSHAKE_VERSIONS)})"}, "id": None})
        return

    if not has_id or method is None:
        # A notification, or the client's response to a server request: 202, empty body.
        if method == "notifications/initialized":
            session.initialized = True
        log(f"{what} -> 202")
        await conn.send(202, [("content-type", "application/json"), ("mcp-session-id", sid)], b"")
        return

    if CASE == "http_500":
        log(f"{what} -> 500 (HTML)")
        await send_500(conn)
        return
    if CASE == "hang_after_init" and method in ("tools/list", "tools/call"):
        log(f"{what} -> hang")
        await conn.hang()

    params = msg.get("params") or {}
    if not isinstance(params, dict):
        params = {}

    if method == "tools/list":
        await tools_list(conn, what, sid, session, rid, params)
    elif method == "tools/call" and call_fault(params):
        await misbehaving_call(conn, what, sid, rid, params)
    elif method == "tools/call":
        result = call_tool(params)
        log(f"{what} name={params.get('name')} -> 200 isError={str(result['isError']).lower()}")
        await send_reply(conn, sid, {"jsonrpc": "2.0", "id": rid, "result": result},
                         method="tools/call")
    elif method == "ping":
        log(f"{what} -> 200")
        await send_sse(conn, sid, {"jsonrpc": "2.0", "id": rid, "result": {}})
    else:
        log(f"{what} -> -32601 method not found")
        await send_sse(conn, sid, {"jsonrpc": "2.0", "id": rid,
                                   "error": {"code": -32601, "message": "Method not found", "data": method}})


def call_fault(params: dict) -> bool:
    """call_* cases: does this tools/call misbehave? Counts the misbehaviours."""
    if not CASE.startswith("call_"):
        return False
    if CALL_TOOLS and params.get("name") not in CALL_TOOLS:
        return False
    if CALL_TIMES and STATE.call_faults >= CALL_TIMES:
        return False
    STATE.call_faults += 1
    return True


async def misbehaving_call(conn: Conn, what: str, sid: str, rid: Any, params: dict) -> None:
    what = f"{what} name={params.get('name')} (fault #{STATE.call_faults})"
    if CASE == "call_http_500":
        log(f"{what} -> 500 (HTML), tool not run")
        await send_500(conn)
        return
    result = call_tool(params)
    if CASE == "call_close_listener":
        log(f"{what} -> tool run and answered, then the listener and every connection closed")
        await send_sse(conn, sid, {"jsonrpc": "2.0", "id": rid, "result": result})
        asyncio.get_running_loop().create_task(close_until_reopened())
        raise Close
    if CASE == "call_hang":
        log(f"{what} -> tool run (isError={str(result['isError']).lower()}), then hang")
        await conn.hang()
    if CASE == "call_drop_mid_stream":
        log(f"{what} -> tool run, SSE priming event with an id, then drop the connection")
        await conn.start_chunked(200, sse_headers(sid))
        await conn.chunk(ts_event("", event=False))
        await asyncio.sleep(DROP_AFTER_S)
        raise Close
    body = py_event({"jsonrpc": "2.0", "id": rid, "result": result})
    log(f"{what} -> tool run, {len(body)} bytes at one per {BYTE_DELAY_S * 1000:g} ms")
    await conn.start_chunked(200, sse_headers(sid))
    for i in range(len(body)):
        await asyncio.sleep(BYTE_DELAY_S)
        await conn.chunk(body[i:i + 1])
    await conn.end_chunked()


async def tools_list(conn: Conn, what: str, sid: str, session: Session, rid: Any, params: dict) -> None:
    cursor = params.get("cursor")

    if CASE == "cursor_loop":
        STATE.cursor_loop_pages += 1
        log(f"{what} cursor={cursor} -> page #{STATE.cursor_loop_pages}, same nextCursor {LOOP_CURSOR}")
        await send_sse(conn, sid, {"jsonrpc": "2.0", "id": rid, "result": {
            "nextCursor": LOOP_CURSOR, "tools": [get_basket_tool()]}})
        return

    try:
        page = tools_page(cursor)
    except ValueError as e:
        log(f"{what} cursor={cursor} -> -32602 {e}")
        await send_sse(conn, sid, {"jsonrpc": "2.0", "id": rid,
                                   "error": {"code": -32602, "message": str(e)}})
        return
    response = {"jsonrpc": "2.0", "id": rid, "result": page}

    if CASE in ("forget_session", "stale_session_400") and cursor is None and STATE.forget == "armed":
        STATE.forget = "pending"
        STATE.doomed_sid = sid
        log(f"{what} -> 200 page 1; the next request on this session finds it forgotten")
        await send_sse(conn, sid, response)
        return

    if CASE == "invalid_json":
        body = ('{"jsonrpc":"2.0","id":' + dumps(rid) +
                ',"result":{"tools":[{"name":"get_basket","description":"cut off here').encode()
        log(f"{what} -> 200 application/json, {len(body)} bytes of broken JSON")
        await conn.send(200, py_json_headers() + [("mcp-session-id", sid)], body)
        return

    if CASE == "invalid_utf8":
        marker = "@@BAD_UTF8@@"
        response["result"] = {"tools": [get_basket_tool(f"Read-only probe {marker} with bad bytes.")]}
        body = dumps(response).encode().replace(marker.encode(), b"caf\xe9 \xff\xfe \xc3\x28")
        log(f"{what} -> 200 application/json, {len(body)} bytes with invalid UTF-8 in a string")
        await conn.send(200, py_json_headers() + [("mcp-session-id", sid)], body)
        return

    if CASE == "bad_tool_names":
        bad = [_tool(name, name, "A tool whose name cannot be exposed.", {"type": "object", "properties": {}},
                     {"type": "object"}, read_only=True) for name in ("basket.peek", "baskets/list", "x" * 70)]
        response["result"] = {**page, "tools": page["tools"] + bad}
        log(f"{what} -> 200 SSE, {len(response['result']['tools'])} tools, 3 with names that cannot be exposed")
        await send_sse(conn, sid, response)
        return

    if CASE == "jsonrpc_error":
        log(f"{what} -> 200 SSE, JSON-RPC error -32603")
        await send_sse(conn, sid, {"jsonrpc": "2.0", "id": rid,
                                   "error": {"code": -32603, "message": "internal error"}})
        return

    if CASE == "wrong_id":
        wrong = rid + 1000 if isinstance(rid, int) and not isinstance(rid, bool) else f"{rid}-wrong"
        response["id"] = wrong
        log(f"{what} -> 200 SSE, response with id={dumps(wrong)}")
        await send_sse(conn, sid, response)
        return

    if CASE == "huge_event":
        await huge_event(conn, what, sid, rid)
        return

    if CASE == "notifications_first":
        await notifications_first(conn, what, sid, session, rid, params, page)
        return

    if CASE == "drop_mid_stream":
        log(f"{what} -> 200 SSE, priming event with an id, then drop the connection")
        await conn.start_chunked(200, sse_headers(sid))
        await conn.chunk(ts_event("", event=False))
        await asyncio.sleep(DROP_AFTER_S)
        raise Close

    if CASE == "slow_list":
        STATE.listings += 1
        n = STATE.listings
        log(f"{what} -> listing {n} started; answering in {LIST_DELAY_S:g} s")
        await asyncio.sleep(LIST_DELAY_S)
        numbered = _tool(f"listing_{n}", f"Listing {n}", f"Marks tools/list answer number {n}.",
                         {"type": "object", "properties": {}}, {"type": "object"}, read_only=True)
        response["result"] = {**page, "tools": page["tools"] + [numbered]}
        log(f"{what} -> 200 SSE, listing {n}")
        await send_sse(conn, sid, response)
        return

    if CASE == "slow_bytes":
        body = py_event(response)
        log(f"{what} -> 200 SSE, {len(body)} bytes at one per {BYTE_DELAY_S * 1000:g} ms "
            f"(~{len(body) * BYTE_DELAY_S:.0f} s)")
        await conn.start_chunked(200, sse_headers(sid))
        for i in range(len(body)):
            await asyncio.sleep(BYTE_DELAY_S)
            await conn.chunk(body[i:i + 1])
        await conn.end_chunked()
        return

    log(f"{what} cursor={cursor} -> 200 SSE, {len(page['tools'])} tool(s)"
        + (f", nextCursor {page['nextCursor']}" if "nextCursor" in page else ""))
    await send_reply(conn, sid, response, method="tools/list")


async def huge_event(conn: Conn, what: str, sid: str, rid: Any) -> None:
    marker = "@@HUGE@@"
    response = {"jsonrpc": "2.0", "id": rid, "result": {"tools": [get_basket_tool(marker)]}}
    before, after = py_event(response).split(marker.encode())
    filler = b"Lorem ipsum dolor sit amet. "
    total = len(before) + EVENT_BYTES + len(after)  # > EVENT_BYTES by the JSON around it
    log(f"{what} -> 200 SSE, one event of {total} bytes (limit under test {EVENT_BYTES})")
    await conn.start_chunked(200, sse_headers(sid))
    await conn.chunk(before)
    block = (filler * (IO_CHUNK // len(filler) + 1))[:IO_CHUNK]
    left = EVENT_BYTES
    while left > 0:
        n = min(left, IO_CHUNK)
        await conn.chunk(block[:n])
        left -= n
    await conn.chunk(after)
    await conn.end_chunked()


async def notifications_first(conn: Conn, what: str, sid: str, session: Session, rid: Any,
                              params: dict, page: dict) -> None:
    meta = params.get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    token = token if token is not None else "misbehave-unsolicited"
    events: list[bytes] = []
    if session.protocol >= "2025-11-25":  # the TS SDK primes only 2025-11-25 streams
        events.append(ts_event("", event=False))
    events.append(ts_event(ts_message({"method": "notifications/message", "params": {
        "level": "info", "logger": "misbehave", "data": "listing tools"}})))
    for step in (1, 2, 3):
        events.append(ts_event(ts_message({"method": "notifications/progress", "params": {
            "progress": step, "total": 3, "progressToken": token}})))
    events.append(ts_event(ts_message({"method": "notifications/message", "params": {
        "level": "warning", "logger": "misbehave", "data": "almost done"}})))
    events.append(ts_event(ts_message({"result": page}, rid, has_id=True)))
    log(f"{what} -> 200 SSE (LF), {len(events) - 1} events before the response")
    await conn.start_chunked(200, sse_headers(sid))
    for i, event in enumerate(events):
        if i:
            await asyncio.sleep(EVENT_GAP_S)
        await conn.chunk(event)
    await conn.end_chunked()


# --------------------------------------------------------------------------- main

async def close_until_reopened() -> None:
    """call_close_listener: refuse connections, keeping the state, until REOPEN_FILE exists."""
    LISTENER.server.close()
    for writer in list(LISTENER.writers):
        writer.close()
    log(f"listener closed; listening again once {REOPEN_FILE} exists")
    while not os.path.exists(REOPEN_FILE):
        await asyncio.sleep(0.05)
    LISTENER.server = await asyncio.start_server(serve_connection, "127.0.0.1", LISTENER.port,
                                                 limit=MAX_HEAD)
    log("listening again")


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    conn = Conn(reader, writer)
    LISTENER.writers.add(writer)
    try:
        while conn.keep_alive:
            req = await conn.read_request()
            if req is None:
                break
            await handle(conn, req)
    except (Close, ConnectionError, asyncio.IncompleteReadError):
        pass
    except Exception as e:  # keep serving other connections
        log(f"internal error: {e!r}")
    finally:
        LISTENER.writers.discard(writer)
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(serve_connection, "127.0.0.1", PORT, limit=MAX_HEAD)
    port = server.sockets[0].getsockname()[1]
    LISTENER.server, LISTENER.port = server, port
    log(f"listening on http://127.0.0.1:{port}{PATH}")
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    LISTENER.server.close()
    log("stopped")


if __name__ == "__main__":
    asyncio.run(main())
