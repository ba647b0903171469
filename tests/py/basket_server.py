"""A small MCP server that mints perishable handles (shopping baskets), for custody's tests.

It runs on the official Python SDK (`mcp` 2.3.0, `MCPServer`) over Streamable HTTP. The
SDK serves both protocol eras on the one endpoint: the 2025-11-25 handshake (initialize,
Mcp-Session-Id) and the stateless 2026-07-28 era (server/discover, `_meta` on every
request). Baskets live in one in-process store shared by every session and both eras,
so a basket_id is an explicit, server-minted handle and not session state.

Tools (all declare an outputSchema and set every annotation hint explicitly):

  create_basket(customer, ttl_seconds=None, idempotency_key=None) -> {"basket_id": "bsk_<16 hex>"}
  add_item(basket_id, sku, qty=1)   -> basket view; refreshes the inactivity timer
  get_basket(basket_id)             -> basket view; read-only, never refreshes the timer
  delete_basket(basket_id)          -> {"basket_id", "deleted": true}; destructive
  count_baskets(customer=None)      -> {"count": baskets ever created, "live": live now,
                                        "sessions": sessions clients have opened}

A failing call on an unknown, deleted or expired basket is a tool error (isError: true)
whose text starts with `BASKET_NOT_FOUND:` or `BASKET_EXPIRED:`.

Environment:
  BASKET_HOST              bind address                                (127.0.0.1)
  BASKET_PORT              TCP port                                    (18931)
  BASKET_PATH              endpoint path                               (/mcp)
  BASKET_TTL_SECONDS       default inactivity TTL in seconds, float    (600)
  BASKET_JSON_RESPONSE     1 = application/json instead of SSE         (0)
  BASKET_TOOLS_PAGE_SIZE   >0 = paginate tools/list with nextCursor    (0 = one page)
  BASKET_LIST_TTL_MS       ttlMs on 2026-07-28 tools/list results      (60000)
  BASKET_LIST_CACHE_SCOPE  cacheScope on 2026-07-28 tools/list: public|private (public)
  BASKET_ID_PREFIX         prefix of minted basket ids; any text, e.g. template syntax (bsk_)
  BASKET_REQUIRE_BEARER    non-empty: every HTTP request must carry
                           `Authorization: Bearer <this>`, else 401                      (unset)
  BASKET_ALLOWED_HOSTS     comma-separated Host headers accepted besides loopback's, e.g.
                           `10.99.0.1:*` for Pods reaching it through a relay; the SDK's
                           DNS-rebinding protection answers others 421               (unset)
  BASKET_TTL_RANDOM        `LO:HI`: a basket created without ttl_seconds gets a TTL drawn
                           uniformly from [LO, HI] seconds instead of BASKET_TTL_SECONDS (unset)
  BASKET_SEED              seed of those draws, for a repeatable run                 (unset)
  BASKET_CLOCK_FILE        a file holding the server's clock in Unix seconds (a float), read
                           on every call instead of the monotonic clock, so a test moves time
                           by rewriting it (custody's lifetime tests)                (unset)
  BASKET_NOTIFICATION_STATUS  an HTTP status (200 or 204) sent instead of the 202 Accepted the
                           transport requires for a POST carrying a notification; custody's
                           conformance tests                                         (unset)
  BASKET_OFF_SCHEMA        1 = get_basket's structuredContent carries item_count as a string of
                           digits, against its outputSchema ("integer"); the SDK's own check is
                           pydantic's lax mode, which lets it through              (0)

Since probes (get_basket) never refresh the timer, a basket nobody adds to lives exactly its
TTL: the known lifetime custody's lifetime estimate is tested against.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from mcp.server.caching import CacheHint
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, CallToolResult, ListToolsResult, TextContent, ToolAnnotations
from pydantic import BaseModel, Field

log = logging.getLogger("basket_server")


def _env_bool(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise SystemExit(f"{name} must be 0 or 1, got {value!r}")


HOST = os.environ.get("BASKET_HOST", "127.0.0.1")
PORT = int(os.environ.get("BASKET_PORT", "18931"))
PATH = os.environ.get("BASKET_PATH", "/mcp")
TTL_SECONDS = float(os.environ.get("BASKET_TTL_SECONDS", "600"))
JSON_RESPONSE = _env_bool("BASKET_JSON_RESPONSE", "0")
TOOLS_PAGE_SIZE = int(os.environ.get("BASKET_TOOLS_PAGE_SIZE", "0"))
LIST_TTL_MS = int(os.environ.get("BASKET_LIST_TTL_MS", "60000"))
LIST_CACHE_SCOPE = os.environ.get("BASKET_LIST_CACHE_SCOPE", "public")
ID_PREFIX = os.environ.get("BASKET_ID_PREFIX", "bsk_")
REQUIRE_BEARER = os.environ.get("BASKET_REQUIRE_BEARER", "")
if LIST_CACHE_SCOPE not in ("public", "private"):
    raise SystemExit(f"BASKET_LIST_CACHE_SCOPE must be public or private, got {LIST_CACHE_SCOPE!r}")
if TTL_SECONDS <= 0:
    raise SystemExit(f"BASKET_TTL_SECONDS must be > 0, got {TTL_SECONDS}")
CLOCK_FILE = os.environ.get("BASKET_CLOCK_FILE", "")
NOTIFICATION_STATUS = int(os.environ.get("BASKET_NOTIFICATION_STATUS", "0") or "0")
if NOTIFICATION_STATUS not in (0, 200, 204):
    raise SystemExit(f"BASKET_NOTIFICATION_STATUS must be 200 or 204, got {NOTIFICATION_STATUS}")
OFF_SCHEMA = _env_bool("BASKET_OFF_SCHEMA", "0")


def _ttl_random() -> tuple[float, float] | None:
    text = os.environ.get("BASKET_TTL_RANDOM", "")
    if not text:
        return None
    try:
        low, high = (float(part) for part in text.split(":"))
    except ValueError:
        raise SystemExit(f"BASKET_TTL_RANDOM must be LO:HI, got {text!r}") from None
    if not 0 < low <= high:
        raise SystemExit(f"BASKET_TTL_RANDOM needs 0 < LO <= HI, got {text!r}")
    return low, high


TTL_RANDOM = _ttl_random()
_DRAWS = random.Random(os.environ.get("BASKET_SEED") or None)


def _clock() -> float:
    """The server's clock: the monotonic clock, or BASKET_CLOCK_FILE's number when set."""
    if not CLOCK_FILE:
        return time.monotonic()
    with open(CLOCK_FILE, encoding="ascii") as clock:
        return float(clock.read().strip())


# ----------------------------------------------------------------------------- the store


@dataclass
class Basket:
    basket_id: str
    customer: str
    ttl_seconds: float
    items: dict[str, int] = field(default_factory=dict)
    last_activity: float = field(default_factory=lambda: _clock())

    def expired(self, now: float) -> bool:
        return now - self.last_activity > self.ttl_seconds

    def remaining(self, now: float) -> float:
        return max(0.0, self.ttl_seconds - (now - self.last_activity))


class BasketStore:
    """Baskets with lazy inactivity expiry.

    Expired and deleted ids are remembered, so an error can say which of the two
    happened instead of a bare "unknown". `created` counts every basket ever minted,
    per customer, so a test can tell exactly how many baskets a run created.
    """

    def __init__(self, default_ttl: float) -> None:
        self.default_ttl = default_ttl
        self._lock = threading.Lock()
        self._live: dict[str, Basket] = {}
        self._expired: dict[str, float] = {}  # basket_id -> the TTL it expired under
        self._deleted: set[str] = set()
        self._by_idempotency_key: dict[str, str] = {}
        self._created: dict[str, int] = {}  # customer -> baskets ever created

    def _expire_due(self, now: float) -> None:
        for basket_id in [b.basket_id for b in self._live.values() if b.expired(now)]:
            basket = self._live.pop(basket_id)
            self._expired[basket_id] = basket.ttl_seconds
            log.info("basket %s expired", basket_id)

    def create(self, customer: str, ttl_seconds: float | None, idempotency_key: str | None) -> tuple[str, bool]:
        """Return (basket_id, created). A known idempotency key returns its basket again."""
        with self._lock:
            self._expire_due(_clock())
            if idempotency_key is not None and idempotency_key in self._by_idempotency_key:
                return self._by_idempotency_key[idempotency_key], False
            basket_id = ID_PREFIX + secrets.token_hex(8)
            if ttl_seconds is not None:
                ttl = ttl_seconds
            elif TTL_RANDOM is not None:
                ttl = _DRAWS.uniform(*TTL_RANDOM)
            else:
                ttl = self.default_ttl
            self._live[basket_id] = Basket(basket_id=basket_id, customer=customer, ttl_seconds=ttl)
            self._created[customer] = self._created.get(customer, 0) + 1
            if idempotency_key is not None:
                self._by_idempotency_key[idempotency_key] = basket_id
            return basket_id, True

    def _find_locked(self, basket_id: str, touch: bool) -> Basket | str:
        now = _clock()
        self._expire_due(now)
        basket = self._live.get(basket_id)
        if basket is not None:
            if touch:
                basket.last_activity = now
            return basket
        if basket_id in self._expired:
            return (
                f"BASKET_EXPIRED: basket {basket_id} expired after {self._expired[basket_id]:g} "
                "seconds of inactivity; create a new basket"
            )
        if basket_id in self._deleted:
            return f"BASKET_NOT_FOUND: basket {basket_id} was deleted"
        return f"BASKET_NOT_FOUND: no basket with id {basket_id!r}"

    def find(self, basket_id: str, *, touch: bool) -> Basket | str:
        """The basket, or an error text starting BASKET_EXPIRED: / BASKET_NOT_FOUND:."""
        with self._lock:
            return self._find_locked(basket_id, touch)

    def add(self, basket_id: str, sku: str, qty: int) -> BasketView | str:
        with self._lock:
            found = self._find_locked(basket_id, touch=True)
            if isinstance(found, str):
                return found
            found.items[sku] = found.items.get(sku, 0) + qty
            return _view(found)

    def view(self, basket_id: str) -> BasketView | str:
        with self._lock:
            found = self._find_locked(basket_id, touch=False)
            return found if isinstance(found, str) else _view(found)

    def delete(self, basket_id: str) -> str | None:
        with self._lock:
            found = self._find_locked(basket_id, touch=False)
            if isinstance(found, str):
                return found
            del self._live[basket_id]
            self._deleted.add(basket_id)
            return None

    def count(self, customer: str | None) -> tuple[int, int]:
        with self._lock:
            self._expire_due(_clock())
            if customer is None:
                return sum(self._created.values()), len(self._live)
            live = sum(1 for b in self._live.values() if b.customer == customer)
            return self._created.get(customer, 0), live


# ----------------------------------------------------------------------------- wire models


class CreatedBasket(BaseModel):
    basket_id: str = Field(description="Opaque basket handle, prefix bsk_")


class Line(BaseModel):
    sku: str
    qty: int


class BasketView(BaseModel):
    basket_id: str
    customer: str
    items: list[Line]
    item_count: int
    expires_in_seconds: float = Field(description="Seconds of inactivity left before the basket expires")


class Deleted(BaseModel):
    basket_id: str
    deleted: bool


class BasketCount(BaseModel):
    count: int = Field(description="Baskets ever created (for the customer, when given)")
    live: int = Field(description="Of those, baskets neither expired nor deleted")
    sessions: int = Field(description="MCP sessions clients have opened on this server so far")


def _view(basket: Basket) -> BasketView:
    return BasketView(
        basket_id=basket.basket_id,
        customer=basket.customer,
        items=[Line(sku=sku, qty=qty) for sku, qty in sorted(basket.items.items())],
        item_count=sum(basket.items.values()),
        expires_in_seconds=round(basket.remaining(_clock()), 3),
    )


def _ok(model: BaseModel) -> CallToolResult:
    data = model.model_dump(mode="json")
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(data))], structured_content=data)


def _tool_error(text: str) -> CallToolResult:
    # A tool-execution failure is reported in-band (isError: true), not as a JSON-RPC
    # error. Built by hand because a raised ToolError would prefix the text with
    # "Error executing tool ...", and callers match on the leading BASKET_ code.
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _hints(*, read_only: bool, destructive: bool, idempotent: bool, title: str) -> ToolAnnotations:
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


# ----------------------------------------------------------------------------- server


class BasketServer(MCPServer):
    """MCPServer with optional tools/list pagination (opaque offset cursors)."""

    async def _handle_list_tools(self, ctx: Any, params: Any) -> ListToolsResult:  # type: ignore[override]
        tools = await self.list_tools()
        if TOOLS_PAGE_SIZE <= 0:
            return ListToolsResult(tools=tools)
        cursor = getattr(params, "cursor", None) if params is not None else None
        start = 0
        if cursor:
            try:
                decoded = base64.urlsafe_b64decode(cursor.encode("ascii")).decode("ascii")
                if not decoded.startswith("page:"):
                    raise ValueError(decoded)
                start = int(decoded.removeprefix("page:"))
                if not 0 <= start < len(tools):
                    raise ValueError(start)
            except ValueError:
                raise MCPError(INVALID_PARAMS, f"Invalid cursor: {cursor!r}") from None
        end = start + TOOLS_PAGE_SIZE
        next_cursor = base64.urlsafe_b64encode(f"page:{end}".encode("ascii")).decode("ascii") if end < len(tools) else None
        return ListToolsResult(tools=tools[start:end], next_cursor=next_cursor)


STORE = BasketStore(TTL_SECONDS)
_TTL_TEXT = f"{TTL_SECONDS:g}"
_SCOPE: Literal["public", "private"] = "public" if LIST_CACHE_SCOPE == "public" else "private"

server = BasketServer(
    name="basket-server",
    title="Basket test server",
    version="0.2.0",
    instructions=(
        "Shopping-basket test server. Call create_basket first and pass the returned basket_id to the "
        f"other tools. Baskets expire after {_TTL_TEXT} seconds of inactivity unless created with ttl_seconds."
    ),
    cache_hints={"tools/list": CacheHint(ttl_ms=LIST_TTL_MS, scope=_SCOPE)},
    log_level="WARNING",
)

# Negotiations answered (initialize and server/discover requests): one per client session in
# either era, so a test can tell whether a client reused its session (count_baskets' sessions).
_SESSIONS = 0


async def _count_sessions(ctx: Any, call_next: Any) -> Any:
    global _SESSIONS
    if ctx.method in ("initialize", "server/discover"):
        _SESSIONS += 1
    return await call_next(ctx)


server.middleware.append(_count_sessions)


@server.tool(
    title="Create basket",
    description=(
        "Create a new empty shopping basket for a customer and return its handle in "
        f"structuredContent.basket_id (prefix bsk_). Baskets expire after {_TTL_TEXT} seconds of "
        "inactivity (ttl_seconds overrides that for this basket); add_item refreshes the timer. "
        "Calling again with the same idempotency_key returns the same basket_id and creates nothing."
    ),
    annotations=_hints(read_only=False, destructive=False, idempotent=False, title="Create basket"),
)
def create_basket(
    customer: str,
    ttl_seconds: Annotated[float | None, Field(gt=0)] = None,
    idempotency_key: str | None = None,
) -> Annotated[CallToolResult, CreatedBasket]:
    basket_id, created = STORE.create(customer, ttl_seconds, idempotency_key)
    log.info("create_basket -> %s (%s)", basket_id, "new" if created else "idempotent replay")
    return _ok(CreatedBasket(basket_id=basket_id))


@server.tool(
    title="Add item",
    description=(
        "Add qty units of sku to an existing basket and return the updated basket. Refreshes the "
        "basket's inactivity timer. isError (BASKET_EXPIRED / BASKET_NOT_FOUND) if the basket is gone."
    ),
    annotations=_hints(read_only=False, destructive=False, idempotent=False, title="Add item"),
)
def add_item(
    basket_id: str, sku: str, qty: Annotated[int, Field(ge=1, le=1000)] = 1
) -> Annotated[CallToolResult, BasketView]:
    found = STORE.add(basket_id, sku, qty)
    return _tool_error(found) if isinstance(found, str) else _ok(found)


@server.tool(
    title="Get basket",
    description=(
        "Read-only probe: return the basket's contents and remaining lifetime. Does not refresh the "
        "inactivity timer. isError with text starting BASKET_EXPIRED or BASKET_NOT_FOUND when the "
        "handle is expired, deleted or unknown."
    ),
    annotations=_hints(read_only=True, destructive=False, idempotent=True, title="Get basket"),
)
def get_basket(basket_id: str) -> Annotated[CallToolResult, BasketView]:
    found = STORE.view(basket_id)
    if isinstance(found, str):
        return _tool_error(found)
    result = _ok(found)
    if OFF_SCHEMA and result.structured_content is not None:
        result.structured_content["item_count"] = str(found.item_count)
    return result


@server.tool(
    title="Delete basket",
    description="Permanently delete a basket and all its items. isError if the basket is unknown or expired.",
    annotations=_hints(read_only=False, destructive=True, idempotent=True, title="Delete basket"),
)
def delete_basket(basket_id: str) -> Annotated[CallToolResult, Deleted]:
    error = STORE.delete(basket_id)
    return _tool_error(error) if error is not None else _ok(Deleted(basket_id=basket_id, deleted=True))


@server.tool(
    title="Count baskets",
    description=(
        "Read-only: how many baskets were ever created (count) and how many are live now (live), "
        "for one customer or for all, and how many MCP sessions clients have opened (sessions)."
    ),
    annotations=_hints(read_only=True, destructive=False, idempotent=True, title="Count baskets"),
)
def count_baskets(customer: str | None = None) -> Annotated[CallToolResult, BasketCount]:
    created, live = STORE.count(customer)
    return _ok(BasketCount(count=created, live=live, sessions=_SESSIONS))


def main() -> None:
    # MCPServer() already configured the root logger at WARNING (quiet uvicorn and SDK);
    # our own lines get a handler of their own.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s basket_server %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    log.info(
        "listening on http://%s:%d%s ttl=%ss json_response=%s tools_page_size=%d list_ttl_ms=%d cache_scope=%s",
        HOST,
        PORT,
        PATH,
        _TTL_TEXT,
        JSON_RESPONSE,
        TOOLS_PAGE_SIZE,
        LIST_TTL_MS,
        LIST_CACHE_SCOPE,
    )
    security = None
    extra_hosts = [h for h in os.environ.get("BASKET_ALLOWED_HOSTS", "").split(",") if h]
    if extra_hosts:
        # The SDK's own loopback defaults, plus the relayed names.
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*", *extra_hosts],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    if not REQUIRE_BEARER and not NOTIFICATION_STATUS:
        server.run(
            transport="streamable-http",
            host=HOST,
            port=PORT,
            streamable_http_path=PATH,
            json_response=JSON_RESPONSE,
            transport_security=security,
        )
        return
    import uvicorn

    app = server.streamable_http_app(
        streamable_http_path=PATH, json_response=JSON_RESPONSE, host=HOST, transport_security=security
    )
    if REQUIRE_BEARER:
        app = _require_bearer(app, REQUIRE_BEARER)
    if NOTIFICATION_STATUS:
        app = _notification_status(app, NOTIFICATION_STATUS)
    uvicorn.run(app, host=HOST, port=PORT, log_level="warning")


def _notification_status(app: Any, status: int) -> Any:
    """ASGI wrapper: every 202 the SDK sends (its answer to a notification or a client's
    response, with an empty body) goes out as `status` instead."""

    async def rewritten(scope: dict, receive: Any, send: Any) -> None:
        async def send_rewritten(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 202:
                log.info("%s %s -> %d instead of 202", scope["method"], scope["path"], status)
                message = {**message, "status": status}
            await send(message)

        await app(scope, receive, send_rewritten)

    return rewritten


def _require_bearer(app: Any, token: str) -> Any:
    """ASGI wrapper: 401 unless `Authorization: Bearer <token>` (the token is never logged)."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != expected:
            log.info("%s %s -> 401 (missing or wrong bearer token)", scope["method"], scope["path"])
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b'Bearer realm="basket"')]})
            await send({"type": "http.response.body", "body": b"unauthorized\n"})
            return
        await app(scope, receive, send)

    return guarded


if __name__ == "__main__":
    main()
