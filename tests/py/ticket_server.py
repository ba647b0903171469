"""A ticketing MCP server with idempotency keys, for custody's audit-settlement tests.

It runs on the official Python SDK (`mcp` 2.3.0, `MCPServer`) over Streamable HTTP, like
basket_server.py. Tickets live in one in-process store; a ticket is created at most once per
idempotency key, so a retried create_ticket returns the first ticket.

Tools:

  create_ticket(idempotency_key, title, simulate="ok") -> {"ticket": {"id": "TCK-000001", ...}}
      simulate="hang_after_commit": create the ticket, then sleep TICKET_HANG_SECONDS before
          answering (the client times out; the write landed);
      simulate="hang_before_commit": sleep TICKET_HANG_SECONDS, then answer an error without
          creating anything (the client times out; the write did not land).
  find_ticket(idempotency_key) -> {"ticket": {...}}; read-only. isError with text starting
      TICKET_NOT_FOUND when no ticket has that key. Sleeps TICKET_FIND_DELAY_SECONDS first.
  stats() -> {"creates": calls, "finds": calls, "tickets": tickets}; read-only.

Environment:
  TICKET_HOST                 bind address                    (127.0.0.1)
  TICKET_PORT                 TCP port                        (18941)
  TICKET_HANG_SECONDS         the simulated hang, float       (30)
  TICKET_FIND_DELAY_SECONDS   delay before find_ticket, float (0)
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp_types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel

HOST = os.environ.get("TICKET_HOST", "127.0.0.1")
PORT = int(os.environ.get("TICKET_PORT", "18941"))
HANG_SECONDS = float(os.environ.get("TICKET_HANG_SECONDS", "30"))
FIND_DELAY_SECONDS = float(os.environ.get("TICKET_FIND_DELAY_SECONDS", "0"))


class Ticket(BaseModel):
    id: str
    title: str
    idempotency_key: str


class TicketAnswer(BaseModel):
    ticket: Ticket


class Stats(BaseModel):
    creates: int
    finds: int
    tickets: int


class Store:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, Ticket] = {}
        self.creates = 0
        self.finds = 0

    def create(self, key: str, title: str) -> Ticket:
        with self._lock:
            found = self._by_key.get(key)
            if found is None:
                found = Ticket(id=f"TCK-{len(self._by_key) + 1:06d}", title=title, idempotency_key=key)
                self._by_key[key] = found
            return found

    def find(self, key: str) -> Ticket | None:
        with self._lock:
            self.finds += 1
            return self._by_key.get(key)

    def stats(self) -> Stats:
        with self._lock:
            return Stats(creates=self.creates, finds=self.finds, tickets=len(self._by_key))


STORE = Store()


def _ok(model: BaseModel) -> CallToolResult:
    data = model.model_dump(mode="json")
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))], structured_content=data)


def _error(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _hints(*, read_only: bool, title: str) -> ToolAnnotations:
    return ToolAnnotations(
        title=title, read_only_hint=read_only, destructive_hint=False, idempotent_hint=True, open_world_hint=False
    )


server = MCPServer(name="ticket-server", title="Ticket test server", version="0.1.0", log_level="WARNING")


@server.tool(
    title="Create ticket",
    description="Create a ticket. The same idempotency_key always yields the same ticket.",
    annotations=_hints(read_only=False, title="Create ticket"),
)
async def create_ticket(
    idempotency_key: str,
    title: str,
    simulate: Literal["ok", "hang_after_commit", "hang_before_commit"] = "ok",
) -> Annotated[CallToolResult, TicketAnswer]:
    with STORE._lock:
        STORE.creates += 1
    if simulate == "hang_before_commit":
        await asyncio.sleep(HANG_SECONDS)
        return _error("TICKET_BACKEND_TIMEOUT: nothing was created")
    ticket = STORE.create(idempotency_key, title)
    if simulate == "hang_after_commit":
        await asyncio.sleep(HANG_SECONDS)
    return _ok(TicketAnswer(ticket=ticket))


@server.tool(
    title="Find ticket",
    description="Read-only: the ticket created with this idempotency key, or isError TICKET_NOT_FOUND.",
    annotations=_hints(read_only=True, title="Find ticket"),
)
async def find_ticket(idempotency_key: str) -> Annotated[CallToolResult, TicketAnswer]:
    if FIND_DELAY_SECONDS > 0:
        await asyncio.sleep(FIND_DELAY_SECONDS)
    found = STORE.find(idempotency_key)
    if found is None:
        return _error(f"TICKET_NOT_FOUND: no ticket with idempotency key {idempotency_key}")
    return _ok(TicketAnswer(ticket=found))


@server.tool(
    title="Stats",
    description="Read-only: create_ticket and find_ticket calls so far, and tickets that exist.",
    annotations=_hints(read_only=True, title="Stats"),
)
def stats() -> Annotated[CallToolResult, Stats]:
    return _ok(STORE.stats())


if __name__ == "__main__":
    server.run(transport="streamable-http", host=HOST, port=PORT, streamable_http_path="/mcp")
