#!/usr/bin/env python3
"""An MCP server whose replies to one method are malformed in one chosen way, for custody's
bad-input tests (tests/bad_input.rs). Standard library only, so every byte is exact.

Outside its one bad reply it is a correct Streamable HTTP server of the handshake era, shaped
after research/mcp/transcripts/ (as tests/py/misbehaving_server.py, which covers hangs, drops
and slow bytes; this one covers replies that arrive in time but are wrong):

  * `initialize` -> 200 SSE with a new `mcp-session-id`; notifications -> 202;
  * a request without a session (the 2026-07-28 `server/discover` probe included) -> the
    TypeScript SDK v1's 400 -32000 "Server not initialized", so clients fall back to
    `initialize`; an unknown session -> 404;
  * tools `get_basket(basket_id)` (read-only) and `create_basket(customer)`; `get_basket`
    answers success for any id, so a probe that survives the bad reply says `ok`.

BAD_REPLY_CASE (one per process), applied to every request of method BAD_REPLY_ON:
  ok                 no bad reply (the control)
  wrong_id           a valid result whose JSON-RPC id is the request's + 1000
  unknown_content    a successful result whose content holds a block of type "hologram"
                     (not in the spec's ContentBlock union) before the text block
                     (tools/call only; other methods answer correctly)
  extra_content      a successful result with the spec's other block types (image, audio,
                     resource_link, embedded resource) and unknown extra fields (`_meta`,
                     `annotations`, a field the spec does not define): valid, extensible
                     (tools/call only)
  huge_event         SSE whose one event is larger than BAD_REPLY_BYTES
  huge_body          application/json whose body is larger than BAD_REPLY_BYTES
  invalid_utf8       application/json whose body has the bytes E9, FF FE and C3 28 in a string
  invalid_utf8_sse   the same bytes inside an SSE event's data
  not_json           200 application/json with an HTML error page as the body
  not_json_sse       200 SSE whose event data is not JSON

Environment:
  BAD_REPLY_PORT    TCP port on 127.0.0.1 (required)
  BAD_REPLY_CASE    one of the cases above                         (ok)
  BAD_REPLY_ON      the JSON-RPC method that gets the bad reply      (tools/call)
  BAD_REPLY_BYTES   huge_event / huge_body: the filler size          (2097152)

Logs one line per request on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Any

CASES = ("ok", "wrong_id", "unknown_content", "extra_content", "huge_event", "huge_body",
         "invalid_utf8", "invalid_utf8_sse", "not_json", "not_json_sse")
VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")

CASE = os.environ.get("BAD_REPLY_CASE", "ok")
if CASE not in CASES:
    raise SystemExit(f"BAD_REPLY_CASE must be one of {', '.join(CASES)}; got {CASE!r}")
ON = os.environ.get("BAD_REPLY_ON", "tools/call")
PORT = int(os.environ["BAD_REPLY_PORT"])
FILLER = int(os.environ.get("BAD_REPLY_BYTES", str(2 * 1024 * 1024)))
SESSIONS: set[str] = set()

TOOLS = [
    {"name": "get_basket", "title": "Get basket", "description": "Read-only probe.",
     "inputSchema": {"type": "object", "properties": {"basket_id": {"type": "string"}},
                     "required": ["basket_id"]},
     "annotations": {"readOnlyHint": True, "destructiveHint": False, "idempotentHint": True,
                     "openWorldHint": False}},
    {"name": "create_basket", "title": "Create basket", "description": "Mint a basket.",
     "inputSchema": {"type": "object", "properties": {"customer": {"type": "string"}},
                     "required": ["customer"]},
     "annotations": {"readOnlyHint": False}},
]


def log(line: str) -> None:
    print(f"bad_reply[{CASE} on {ON}] {line}", file=sys.stderr, flush=True)


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def good_result(method: str, params: dict) -> dict:
    if method == "tools/list":
        return {"tools": TOOLS}
    if method == "tools/call":
        basket = (params.get("arguments") or {}).get("basket_id", "bsk_new")
        view = {"basket_id": basket, "customer": "user-1", "items": [], "item_count": 0}
        return {"content": [{"type": "text", "text": json.dumps(view)}],
                "structuredContent": view, "isError": False}
    return {}


def bad_result(result: dict) -> dict:
    if CASE == "unknown_content":
        result["content"].insert(0, {"type": "hologram", "frames": 3})
    elif CASE == "extra_content":
        result["content"] = [
            {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png",
             "annotations": {"audience": ["user"], "priority": 0.5}},
            {"type": "audio", "data": "UklGRg==", "mimeType": "audio/wav"},
            {"type": "resource_link", "uri": "basket://b/1", "name": "basket"},
            {"type": "resource", "resource": {"uri": "basket://b/1", "mimeType": "text/plain",
                                              "text": "basket"}},
            {**result["content"][0], "_meta": {"example.com/trace": "t-1"}, "futureField": 1},
        ]
        result["_meta"] = {"example.com/cost": 1}
        result["futureResultField"] = {"any": "thing"}
    return result


class Reply:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    async def send(self, status: int, content_type: str | None, body: bytes,
                   sid: str | None = None) -> None:
        head = [f"HTTP/1.1 {status} X", f"content-length: {len(body)}"]
        if content_type:
            head.append(f"content-type: {content_type}")
        if sid:
            head.append(f"mcp-session-id: {sid}")
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await self.writer.drain()

    async def sse(self, data: bytes, sid: str | None) -> None:
        await self.send(200, "text/event-stream", b"event: message\r\ndata: " + data + b"\r\n\r\n", sid)


async def answer(reply: Reply, sid: str, rid: Any, method: str, params: dict) -> None:
    result = good_result(method, params)
    message = {"jsonrpc": "2.0", "id": rid, "result": result}
    content_case = CASE in ("unknown_content", "extra_content")
    if method != ON or CASE == "ok" or (content_case and method != "tools/call"):
        await reply.sse(dumps(message), sid)
        return
    log(f"{method} id={rid} -> {CASE}")
    if CASE == "wrong_id":
        message["id"] = rid + 1000 if isinstance(rid, int) else f"{rid}-wrong"
        await reply.sse(dumps(message), sid)
    elif content_case:
        message["result"] = bad_result(result)
        await reply.sse(dumps(message), sid)
    elif CASE in ("huge_event", "huge_body"):
        if method == "tools/call":
            result["content"][0]["text"] = "x" * FILLER
        else:
            result["tools"][0]["description"] = "x" * FILLER
        if CASE == "huge_event":
            await reply.sse(dumps(message), sid)
        else:
            await reply.send(200, "application/json", dumps(message), sid)
    elif CASE in ("invalid_utf8", "invalid_utf8_sse"):
        body = dumps(message).replace(b'"isError"', b'"bad\xe9\xff\xfe\xc3\x28":1,"isError"')
        body = body.replace(b'"tools":[{', b'"tools":[{"bad\xe9\xff\xfe\xc3\x28":1,')
        if CASE == "invalid_utf8":
            await reply.send(200, "application/json", body, sid)
        else:
            await reply.sse(body, sid)
    elif CASE == "not_json":
        await reply.send(200, "application/json",
                         b"<html><body><h1>502 Bad Gateway</h1></body></html>", sid)
    elif CASE == "not_json_sse":
        await reply.sse(b"upstream said: no", sid)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    reply = Reply(writer)
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = head.decode("latin-1").split("\r\n")
            verb = lines[0].split(" ")[0]
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            sid = headers.get("mcp-session-id")
            if verb == "DELETE":
                SESSIONS.discard(sid or "")
                await reply.send(200, None, b"")
                continue
            if verb != "POST":
                await reply.send(405, "text/plain", b"Method Not Allowed\n")
                continue
            msg = json.loads(body)
            method, rid = msg.get("method"), msg.get("id")
            if method == "initialize":
                new_sid = uuid.uuid4().hex
                SESSIONS.add(new_sid)
                asked = (msg.get("params") or {}).get("protocolVersion")
                version = asked if asked in VERSIONS else VERSIONS[0]
                await reply.sse(dumps({"jsonrpc": "2.0", "id": rid, "result": {
                    "capabilities": {"tools": {"listChanged": False}}, "protocolVersion": version,
                    "serverInfo": {"name": "bad-reply-server", "version": "0.1.0"}}}), new_sid)
            elif not sid:
                await reply.send(400, "application/json", dumps({"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32000, "message": "Bad Request: Server not initialized"}}))
            elif sid not in SESSIONS:
                await reply.send(404, "application/json", dumps({"jsonrpc": "2.0", "id": None, "error": {
                    "code": -32600, "message": "Session not found"}}))
            elif "id" not in msg or method is None:
                await reply.send(202, None, b"", sid)
            else:
                await answer(reply, sid, rid, method, msg.get("params") or {})
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", PORT, limit=1 << 20)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    log(f"listening on 127.0.0.1:{PORT}")
    async with server:
        await stop


if __name__ == "__main__":
    asyncio.run(main())
