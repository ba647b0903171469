"""A small, real LangGraph order graph that holds an MCP basket handle, and a CLI that
writes custody's checkpoint fixtures with it.

Graph:  START -> create_basket -> add_item --(resume {"sku","qty"})--> add_item (parks again)
                                           --(resume "done")---------> finalize -> END
                                           --(dead / missing handle)-> handle_gone -> END

  create_basket  mints a basket on the basket server over MCP (Streamable HTTP, python `mcp`
                 client) and stores a HandleRecord; with `mint: False` it stores basket None.
  add_item       first honours a custody verdict an external sweeper wrote (escalated or
                 failed -> handle_gone), then parks on interrupt(); a resumed item is added on
                 the server (an isError answer -> handle_gone) and the node loops to itself.

Per-thread knobs ride in config["configurable"] next to thread_id and principal:
  basket_ttl_seconds  passed to create_basket as ttl_seconds (a test knob: kept out of mint_inputs)
  assumed_ttl_s       written into the HandleRecord (default None)

CLI (progress on stderr, results as JSON on stdout):
  order_graph.py write  --server URL (--sqlite PATH | --postgres DSN) [--manifest OUT] [--expire-wait] [--thread-prefix P] [--only T,T]
  order_graph.py resume --thread T (--sqlite PATH | --postgres DSN) --server URL --principal P --value JSON
  order_graph.py state  --thread T (--sqlite PATH | --postgres DSN)
  order_graph.py write-many --server URL (--sqlite PATH | --postgres DSN) --count N --thread-prefix P
                 [--tag T] [--clock-step S]

write-many writes N parked threads like t-live (one basket each, principal user-1), with
configurable.lifetime_tag = T (so a HandleClass can select them by metadata), and prints each
thread's handle, minted_at and the TTL the server gave its basket (get_basket's
expires_in_seconds right after the mint). With ORDER_GRAPH_CLOCK_FILE set (a file holding Unix
seconds, the basket server's BASKET_CLOCK_FILE), minted_at is that clock's time, and
--clock-step S adds S seconds to it after each thread, so mint times spread like a real day's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, interrupt
from mcp import Client

SERVER_NAME = "basket"
MINT_TOOL = "create_basket"
QUESTION = "Which item should be added?"
# Custody verdicts after which the graph must not spend the handle.
STOP_VERDICTS = ("escalated", "failed")


class HandleRecord(TypedDict):
    """Everything the graph knows about a handle; recorded at mint time, plain types only."""

    value: str
    server: str
    tool: str
    principal: str
    minted_at: str
    assumed_ttl_s: int | None


class OrderState(TypedDict, total=False):
    customer: str
    mint: bool
    basket: HandleRecord | None
    mint_inputs: dict[str, Any]  # the business inputs create_basket was called with
    items: list[dict[str, Any]]  # every {"sku", "qty"} added so far: the replay log
    custody: dict[str, Any] | None  # written by an external sweeper: {"verdict", "handle_class", "reason", "at"}
    verdict: str


def log(message: str) -> None:
    print(f"order_graph: {message}", file=sys.stderr, flush=True)


def utc_now_iso() -> str:
    clock = os.environ.get("ORDER_GRAPH_CLOCK_FILE")
    if clock:
        with open(clock, encoding="ascii") as f:
            now = datetime.fromtimestamp(float(f.read().strip()), UTC)
    else:
        now = datetime.now(UTC)
    return now.isoformat(timespec="microseconds").replace("+00:00", "Z")


# ----------------------------------------------------------------------------- MCP calls


class ToolFailed(Exception):
    """The server answered the tool call with isError: true."""


async def _call_tool(server_url: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    async with Client(server_url) as client:
        result = await client.call_tool(tool, arguments)
    if result.is_error:
        text = " ".join(getattr(block, "text", "") for block in result.content).strip()
        raise ToolFailed(text or f"{tool} failed without a message")
    if not isinstance(result.structured_content, dict):
        raise RuntimeError(f"{tool} returned no structured content")
    return result.structured_content


def call_tool(server_url: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Synchronous wrapper: graph nodes run synchronously under graph.invoke."""
    return asyncio.run(_call_tool(server_url, tool, arguments))


def mint_basket(
    server_url: str, customer: str, principal: str, ttl_seconds: float | None, assumed_ttl_s: int | None
) -> HandleRecord:
    arguments: dict[str, Any] = {"customer": customer}
    if ttl_seconds is not None:
        arguments["ttl_seconds"] = ttl_seconds
    created = call_tool(server_url, MINT_TOOL, arguments)
    return HandleRecord(
        value=created["basket_id"],
        server=SERVER_NAME,
        tool=MINT_TOOL,
        principal=principal,
        minted_at=utc_now_iso(),
        assumed_ttl_s=assumed_ttl_s,
    )


# ----------------------------------------------------------------------------- the graph


def build_graph(checkpointer: BaseCheckpointSaver[Any], server_url: str | None) -> CompiledStateGraph[Any]:
    def server() -> str:
        if server_url is None:
            raise RuntimeError("this command was started without --server, but the graph needs the basket server")
        return server_url

    def create_basket(state: OrderState, config: RunnableConfig) -> dict[str, Any]:
        if state.get("mint") is False:
            return {"basket": None, "items": []}
        configurable = config["configurable"]
        customer = state["customer"]
        record = mint_basket(
            server(),
            customer,
            principal=configurable["principal"],
            ttl_seconds=configurable.get("basket_ttl_seconds"),
            assumed_ttl_s=configurable.get("assumed_ttl_s"),
        )
        return {"basket": record, "mint_inputs": {"customer": customer}, "items": []}

    def add_item(state: OrderState) -> Command[Literal["add_item", "finalize", "handle_gone"]]:
        custody = state.get("custody") or {}
        if custody.get("verdict") in STOP_VERDICTS:
            reason = f"custody {custody['verdict']}: {custody.get('reason', 'no reason given')}"
            return Command(goto="handle_gone", update={"verdict": f"handle_gone: {reason}"})

        basket = state.get("basket")
        answer = interrupt({"question": QUESTION, "basket": basket["value"] if basket else None})

        if answer == "done":
            return Command(goto="finalize")
        if not (isinstance(answer, dict) and isinstance(answer.get("sku"), str)):
            raise ValueError(f'resume with "done" or {{"sku": str, "qty": int}}, got {answer!r}')
        if basket is None:
            return Command(goto="handle_gone", update={"verdict": "handle_gone: no basket handle in state"})

        item = {"sku": answer["sku"], "qty": int(answer.get("qty", 1))}
        try:
            call_tool(server(), "add_item", {"basket_id": basket["value"], **item})
        except ToolFailed as failed:
            return Command(goto="handle_gone", update={"verdict": f"handle_gone: {failed}"})
        return Command(goto="add_item", update={"items": [*state.get("items", []), item]})

    def handle_gone(state: OrderState) -> dict[str, Any]:
        verdict = state.get("verdict", "")
        return {"verdict": verdict if verdict.startswith("handle_gone: ") else "handle_gone: unknown reason"}

    def finalize(state: OrderState) -> dict[str, Any]:
        basket = state.get("basket")
        value = basket["value"] if basket else None
        return {"verdict": f"ok basket={value} items={len(state.get('items', []))}"}

    builder = StateGraph(OrderState)
    builder.add_node("create_basket", create_basket)
    builder.add_node("add_item", add_item)
    builder.add_node("handle_gone", handle_gone)
    builder.add_node("finalize", finalize)
    builder.add_edge(START, "create_basket")
    builder.add_edge("create_basket", "add_item")
    builder.add_edge("handle_gone", END)
    builder.add_edge("finalize", END)
    return builder.compile(checkpointer=checkpointer)


# ----------------------------------------------------------------------------- savers


@contextlib.contextmanager
def open_saver(args: argparse.Namespace) -> Iterator[BaseCheckpointSaver[Any]]:
    if args.sqlite:
        from langgraph.checkpoint.sqlite import SqliteSaver

        with SqliteSaver.from_conn_string(args.sqlite) as saver:
            saver.setup()
            yield saver
    else:
        from langgraph.checkpoint.postgres import PostgresSaver

        with PostgresSaver.from_conn_string(args.postgres) as saver:
            saver.setup()
            yield saver


def thread_config(thread_id: str, principal: str, **extra: Any) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "principal": principal, **extra}}


def snapshot_json(graph: CompiledStateGraph[Any], config: RunnableConfig) -> dict[str, Any]:
    snap = graph.get_state(config)
    return {
        "values": snap.values,
        "next": list(snap.next),
        "interrupts": [i.value for i in snap.interrupts],
        "checkpoint_id": snap.config["configurable"].get("checkpoint_id"),
        "metadata": snap.metadata,
    }


# ----------------------------------------------------------------------------- write


def write_fixtures(args: argparse.Namespace) -> dict[str, Any]:
    prefix = args.thread_prefix
    threads: dict[str, dict[str, Any]] = {}

    with open_saver(args) as saver:
        graph = build_graph(saver, args.server)

        def run(name: str, payload: Any, principal: str, **extra: Any) -> dict[str, Any]:
            config = thread_config(prefix + name, principal, **extra)
            graph.invoke(payload, config)
            return snapshot_json(graph, config)

        def record(name: str, expected: str, snap: dict[str, Any], principal: str, **more: Any) -> None:
            basket = snap["values"].get("basket")
            threads[prefix + name] = {
                "expected": expected,
                "handle": basket["value"] if basket else None,
                "principal": principal,
                "record_principal": basket["principal"] if basket else None,
                # Parked = a node is pending. After update_state (t-updated) it is pending
                # without an __interrupt__ write: "parked, edited".
                "parked": bool(snap["next"]),
                "interrupt_pending": bool(snap["interrupts"]),
                "next": snap["next"],
                **more,
            }
            log(f"{prefix + name}: next={snap['next']} handle={threads[prefix + name]['handle']} expected={expected}")

        for name in ("t-live", "t-expired", "t-absent", "t-other-principal", "t-done", "t-updated", "t-ttl"):
            if saver.get_tuple(thread_config(prefix + name, "-")) is not None:
                raise SystemExit(f"thread {prefix + name} already has checkpoints; use a fresh database or --thread-prefix")

        start = {"customer": "user-1", "mint": True}
        only = set(args.only.split(",")) if args.only else None

        def wanted(name: str) -> bool:
            return only is None or name in only

        if wanted("t-live"):
            record("t-live", "ok", run("t-live", start, "user-1"), "user-1")

        expired_by = None
        if wanted("t-expired"):
            snap = run("t-expired", start, "user-1", basket_ttl_seconds=1)
            expired_by = time.time() + 1.5
            record(
                "t-expired",
                "gone",
                snap,
                "user-1",
                expired_by=datetime.fromtimestamp(expired_by, UTC).isoformat().replace("+00:00", "Z"),
            )

        if wanted("t-absent"):
            record("t-absent", "absent", run("t-absent", {"customer": "user-1", "mint": False}, "user-1"), "user-1")

        if wanted("t-other-principal"):
            run("t-other-principal", start, "user-1")
            snap = run("t-other-principal", Command(resume={"sku": "widget", "qty": 2}), "user-2")
            record("t-other-principal", "gone", snap, "user-2")

        if wanted("t-done"):
            run("t-done", start, "user-1")
            run("t-done", Command(resume={"sku": "widget", "qty": 1}), "user-1")
            record("t-done", "finished", run("t-done", Command(resume="done"), "user-1"), "user-1")

        if wanted("t-updated"):
            snap = run("t-updated", start, "user-1")
            replaced = snap["values"]["basket"]["value"]
            fresh = mint_basket(args.server, "user-1", principal="user-1", ttl_seconds=None, assumed_ttl_s=None)
            config = thread_config(prefix + "t-updated", "user-1")
            graph.update_state(config, {"basket": fresh})
            record("t-updated", "ok", snapshot_json(graph, config), "user-1", replaced_handle=replaced)

        if wanted("t-ttl"):
            # Within its assumed_ttl_s, yet probed: the sweep's sample of young handles
            # (HandleClass spec.probesWithinTtl, default 10).
            record("t-ttl", "ok", run("t-ttl", start, "user-1", assumed_ttl_s=3600), "user-1", probe_expected=True)

    if args.expire_wait and expired_by is not None:
        # Wait once, at the end, until the 1-second basket of t-expired has surely
        # expired, then check on the server that it has (get_basket never refreshes it).
        time.sleep(max(0.0, expired_by - time.time()))
        handle = threads[prefix + "t-expired"]["handle"]
        try:
            call_tool(args.server, "get_basket", {"basket_id": handle})
        except ToolFailed as failed:
            if not str(failed).startswith("BASKET_EXPIRED:"):
                raise SystemExit(f"t-expired basket {handle}: unexpected answer {failed}") from None
        else:
            raise SystemExit(f"t-expired basket {handle} is still live after the wait")
        log(f"{prefix}t-expired: basket {handle} has expired")

    return {
        "server": args.server,
        "backend": "sqlite" if args.sqlite else "postgres",
        "written_at": utc_now_iso(),
        "threads": threads,
    }


def write_many(args: argparse.Namespace) -> dict[str, Any]:
    clock = os.environ.get("ORDER_GRAPH_CLOCK_FILE")
    if args.clock_step and not clock:
        raise SystemExit("--clock-step needs ORDER_GRAPH_CLOCK_FILE")
    threads: dict[str, dict[str, Any]] = {}
    with open_saver(args) as saver:
        graph = build_graph(saver, args.server)
        for i in range(args.count):
            name = f"{args.thread_prefix}{i:04d}"
            config = thread_config(name, "user-1", lifetime_tag=args.tag)
            graph.invoke({"customer": "user-1", "mint": True}, config)
            basket = snapshot_json(graph, config)["values"]["basket"]
            view = call_tool(args.server, "get_basket", {"basket_id": basket["value"]})
            threads[name] = {
                "handle": basket["value"],
                "minted_at": basket["minted_at"],
                "ttl_seconds": view["expires_in_seconds"],
            }
            if args.clock_step:
                with open(clock, encoding="ascii") as f:
                    now = float(f.read().strip())
                with open(clock, "w", encoding="ascii") as f:
                    f.write(repr(now + args.clock_step))
    log(f"wrote {args.count} threads {args.thread_prefix}*")
    return {"threads": threads}


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="order_graph.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def backend(p: argparse.ArgumentParser) -> None:
        group = p.add_mutually_exclusive_group(required=True)
        group.add_argument("--sqlite", metavar="PATH", help="SQLite checkpoint database file")
        group.add_argument("--postgres", metavar="DSN", help="PostgreSQL DSN, e.g. postgres://postgres@127.0.0.1:5432/postgres")

    write = commands.add_parser("write", help="write the fixture threads and print their manifest")
    backend(write)
    write.add_argument("--server", required=True, metavar="URL", help="basket server MCP endpoint")
    write.add_argument("--manifest", metavar="OUT.json", help="also write the manifest to this file")
    write.add_argument("--expire-wait", action="store_true", help="wait until t-expired's basket has expired")
    write.add_argument("--thread-prefix", default="", metavar="P", help="prefix for every thread id (default none)")
    write.add_argument("--only", metavar="T,T", help="write only these fixture threads (default all)")

    resume = commands.add_parser("resume", help="resume a parked thread with Command(resume=VALUE)")
    backend(resume)
    resume.add_argument("--thread", required=True)
    resume.add_argument("--server", required=True, metavar="URL")
    resume.add_argument("--principal", required=True)
    resume.add_argument("--value", required=True, metavar="JSON", help='e.g. \'"done"\' or \'{"sku": "x", "qty": 1}\'')

    many = commands.add_parser("write-many", help="write COUNT parked threads holding one basket each")
    backend(many)
    many.add_argument("--server", required=True, metavar="URL", help="basket server MCP endpoint")
    many.add_argument("--count", required=True, type=int)
    many.add_argument("--thread-prefix", required=True, metavar="P")
    many.add_argument("--tag", default="", metavar="T", help="configurable.lifetime_tag of every thread")
    many.add_argument("--clock-step", type=float, default=0.0, metavar="S", help="seconds added to ORDER_GRAPH_CLOCK_FILE after each thread")

    state = commands.add_parser("state", help="print a thread's get_state as JSON")
    backend(state)
    state.add_argument("--thread", required=True)
    return parser.parse_args(argv)


def emit(document: dict[str, Any]) -> None:
    json.dump(document, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command == "write":
        manifest = write_fixtures(args)
        if args.manifest:
            with open(args.manifest, "w", encoding="utf-8") as out:
                json.dump(manifest, out, indent=2, sort_keys=True)
                out.write("\n")
        emit(manifest)
    elif args.command == "write-many":
        emit(write_many(args))
    elif args.command == "resume":
        with open_saver(args) as saver:
            graph = build_graph(saver, args.server)
            config = thread_config(args.thread, args.principal)
            if graph.get_state(config).config["configurable"].get("checkpoint_id") is None:
                raise SystemExit(f"thread {args.thread} has no checkpoints")
            graph.invoke(Command(resume=json.loads(args.value)), config)
            emit(snapshot_json(graph, config))
    else:
        with open_saver(args) as saver:
            graph = build_graph(saver, None)
            emit(snapshot_json(graph, thread_config(args.thread, "-")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
