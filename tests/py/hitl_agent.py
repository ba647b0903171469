"""A production-shaped LangGraph agent for custody's tests, and a CLI that writes its threads.

The agent is `langchain.agents.create_agent` (langchain 1.4) with:
  - tools from the basket MCP server, loaded by the agent toolkit's own `load_mcp_tools`
    (langgraph-agent-toolkit 0.10.1), which adapts them through `langchain.mcp.MCPAdapter` over
    streamable HTTP and names them `<alias>_<tool>` (alias `shop` unless configured);
  - `HumanInTheLoopMiddleware(interrupt_on=…)` pausing before the write tools (batched mode: one
    interrupt per model turn, its value a HITLRequest with `action_requests`);
  - `CustodyMiddleware`, the agent side of handle custody: it records the basket handle in agent
    state when `create_basket` answers (`basket`: the HandleRecord, `mint_inputs`, `items`: the
    replay log), fills `basket_id` from state into `add_item` calls that lack it, and routes on
    custody's verdict at `custody`: after `escalated` or `failed` no tool is called and the run
    ends with a final message `handle_gone: custody <verdict>: <reason>`;
  - `ScriptedModel`, a deterministic fake chat model (a `GenericFakeChatModel` whose `bind_tools`
    returns itself). It reads its script from the conversation, not from an iterator, so a run
    resumed in another process continues where it stopped: first `create_basket`, then one
    `add_item` per item of the plan, then a final `ok items=N`; a failed or rejected tool call
    ends the run with `stopped: <the tool message>`.

The plan is the first user message, JSON: {"customer": str, "items": [{"sku", "qty"}],
"handle_in_args": bool}. With `handle_in_args` the model copies the basket id into each
`add_item` call, as a model reading the create_basket result would; without it the calls carry
only sku and qty and the middleware fills the handle from state when the call runs.

CLI (progress on stderr, results as JSON on stdout):
  hitl_agent.py write  --server URL (--sqlite PATH | --postgres DSN) --thread T [--principal P]
                       [--items JSON] [--handle-in-args] [--approve N] [--interrupt-on a,b]
      runs the plan and answers the first N interrupts with approve, leaving the thread parked
      at interrupt N+1 (or finished)
  hitl_agent.py resume --thread T (--sqlite PATH | --postgres DSN) --server URL [--principal P]
                       --decisions JSON [--interrupt-on a,b]
      resumes with Command(resume={"decisions": DECISIONS})
  hitl_agent.py state  --thread T (--sqlite PATH | --postgres DSN)
  hitl_agent.py tools  [--server URL] [--interrupt-on a,b]
      {"tools": names, "writes": names that may write, "interrupted": names the agent's
      HumanInTheLoopMiddleware pauses before}; without --server from MCP_SERVERS and
      MCP_AGENT_SERVERS (agent `create-agent`) through the toolkit's Settings, as the toolkit
      service reads them

The state JSON: values (basket, mint_inputs, items, custody), next, interrupts (their values),
messages (type, content, tool_calls, status, name), final (the last AI message's text).
`--interrupt-on` defaults to every tool that may write (readOnlyHint false or absent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, NotRequired, TypedDict

from langchain.agents import AgentState, create_agent
from langchain.agents.middleware import AgentMiddleware, HumanInTheLoopMiddleware, hook_config
from langchain_core._api import LangChainBetaWarning
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.types import Command
from langgraph_agent_toolkit.core.mcp import MCPServerConfig, load_mcp_tools

# `langchain.mcp` warns once that it is in beta; that is known here.
warnings.filterwarnings("ignore", category=LangChainBetaWarning)

ALIAS = "shop"
# custody's verdicts after which the agent must not spend the handle (README "Acting").
STOP_VERDICTS = ("escalated", "failed")


def log(message: str) -> None:
    print(f"hitl_agent: {message}", file=sys.stderr, flush=True)


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ----------------------------------------------------------------------------- the agent side of custody
# README "Using custody with the agent toolkit" shows this section, from `class HandleRecord` to
# the end of `CustodyMiddleware`; tests/agent.rs checks that it is the same text.


class HandleRecord(TypedDict):
    """The handle-custody record: what the agent knows about its handle, plain types only."""

    value: str
    server: str
    tool: str
    principal: str
    minted_at: str
    assumed_ttl_s: int | None


class CustodyState(AgentState):
    """The agent's state: create_agent's own (messages) plus the custody channels."""

    basket: NotRequired[HandleRecord | None]
    mint_inputs: NotRequired[dict[str, Any]]
    items: NotRequired[list[dict[str, Any]]]
    custody: NotRequired[dict[str, Any] | None]


def stopped_by_custody(state: Any) -> str | None:
    """`handle_gone: custody <verdict>: <reason>` when custody's verdict says stop, else None."""
    custody = state.get("custody") or {}
    if custody.get("verdict") in STOP_VERDICTS:
        return f"handle_gone: custody {custody['verdict']}: {custody.get('reason', 'no reason given')}"
    return None


class CustodyMiddleware(AgentMiddleware):
    """Records the handle in state and routes on custody's verdict (see the module docstring).

    It must come after HumanInTheLoopMiddleware in `middleware=[…]`, so that it wraps the tool
    call innermost and sees a reviewer's edited arguments.
    """

    state_schema = CustodyState

    def __init__(self, alias: str) -> None:
        super().__init__()
        self.create = f"{alias}_create_basket"
        self.add = f"{alias}_add_item"
        self.alias = alias

    @hook_config(can_jump_to=["end"])
    def before_model(self, state: CustodyState, runtime: Any) -> dict[str, Any] | None:
        stop = stopped_by_custody(state)
        if stop is None:
            return None
        return {"jump_to": "end", "messages": [AIMessage(content=stop)]}

    async def awrap_tool_call(
        self, request: Any, handler: Callable[[Any], Awaitable[ToolMessage | Command[Any]]]
    ) -> ToolMessage | Command[Any]:
        call = request.tool_call
        state = request.state
        stop = stopped_by_custody(state)
        if stop is not None:
            # Approved or edited, the call would spend a handle custody gave up on.
            return ToolMessage(content=stop, name=call["name"], tool_call_id=call["id"], status="error")
        basket = state.get("basket")
        if call["name"] == self.add and "basket_id" not in call["args"] and basket:
            request = request.override(tool_call={**call, "args": {**call["args"], "basket_id": basket["value"]}})
            call = request.tool_call
        result = await handler(request)
        if not isinstance(result, ToolMessage) or result.status == "error":
            return result
        if call["name"] == self.create:
            configurable = request.runtime.config.get("configurable", {})
            record = HandleRecord(
                value=result.artifact["structured_content"]["basket_id"],
                server=self.alias,
                tool="create_basket",
                principal=configurable["principal"],
                minted_at=utc_now_iso(),
                assumed_ttl_s=None,
            )
            inputs = {"customer": call["args"]["customer"]}
            return Command(update={"messages": [result], "basket": record, "mint_inputs": inputs, "items": []})
        if call["name"] == self.add:
            item = {"sku": call["args"]["sku"], "qty": int(call["args"].get("qty", 1))}
            return Command(update={"messages": [result], "items": [*(state.get("items") or []), item]})
        return result


# ----------------------------------------------------------------------------- the model


class ScriptedModel(GenericFakeChatModel):
    """A deterministic chat model for create_agent: its next message follows from the
    conversation so far (see the module docstring). `bind_tools` returns itself: the script
    already knows the tool names."""

    messages: Any = iter(())
    alias: str = ALIAS

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:
        return self

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self.next_message(messages))])

    def next_message(self, messages: list[BaseMessage]) -> AIMessage:
        plan = json.loads(next(m for m in messages if isinstance(m, HumanMessage)).content)
        turn = sum(isinstance(m, AIMessage) for m in messages)
        results = [m for m in messages if isinstance(m, ToolMessage)]
        if results and results[-1].status == "error":
            return AIMessage(content=f"stopped: {results[-1].content}")
        created = [r for r in results if r.name == f"{self.alias}_create_basket"]
        if not created:
            call = {"name": f"{self.alias}_create_basket", "args": {"customer": plan["customer"]}}
        else:
            added = sum(r.name == f"{self.alias}_add_item" for r in results)
            if added == len(plan["items"]):
                return AIMessage(content=f"ok items={added}")
            args = dict(plan["items"][added])
            if plan.get("handle_in_args"):
                args["basket_id"] = created[-1].artifact["structured_content"]["basket_id"]
            call = {"name": f"{self.alias}_add_item", "args": args}
        return AIMessage(content="", tool_calls=[{**call, "id": f"call_{turn}", "type": "tool_call"}])


# ----------------------------------------------------------------------------- the agent


def read_only(tool: BaseTool) -> bool:
    """The MCP spec's default: a tool may write unless it says readOnlyHint true (langchain.mcp
    keeps the annotations at metadata["mcp"]["tool"]["annotations"], in snake case)."""
    annotations = (tool.metadata or {}).get("mcp", {}).get("tool", {}).get("annotations") or {}
    return annotations.get("read_only_hint") is True


async def load_tools(server_url: str | None) -> list[BaseTool]:
    """The agent's tools: from `--server` as alias `shop`, else as the toolkit service reads
    MCP_SERVERS and MCP_AGENT_SERVERS (its Settings; the servers of agent `create-agent`)."""
    if server_url is not None:
        loaded = await load_mcp_tools({ALIAS: MCPServerConfig(url=server_url)})
    else:
        from langgraph_agent_toolkit.core._base_settings import Settings

        settings = Settings()
        names = settings.MCP_AGENT_SERVERS.get("create-agent", list(settings.MCP_SERVERS))
        loaded = await load_mcp_tools(
            {n: settings.MCP_SERVERS[n] for n in names}, discovery_timeout=settings.MCP_DISCOVERY_TIMEOUT
        )
    return [tool for tools in loaded.values() for tool in tools]


def approval(tools: list[BaseTool], interrupt_on: list[str] | None) -> HumanInTheLoopMiddleware:
    """The HITL middleware of the agent: on `interrupt_on`, by default on every tool that may write."""
    gated = interrupt_on if interrupt_on is not None else [t.name for t in tools if not read_only(t)]
    return HumanInTheLoopMiddleware(interrupt_on={name: True for name in gated})


def build_agent(tools: list[BaseTool], checkpointer: BaseCheckpointSaver[Any] | None, interrupt_on: list[str] | None) -> Any:
    return create_agent(
        model=ScriptedModel(),
        tools=tools,
        middleware=[approval(tools, interrupt_on), CustodyMiddleware(ALIAS)],
        state_schema=CustodyState,
        checkpointer=checkpointer,
    )


@contextlib.asynccontextmanager
async def open_saver(args: argparse.Namespace) -> AsyncIterator[BaseCheckpointSaver[Any]]:
    if args.sqlite:
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        async with AsyncSqliteSaver.from_conn_string(args.sqlite) as saver:
            await saver.setup()
            yield saver
    else:
        from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

        async with AsyncPostgresSaver.from_conn_string(args.postgres) as saver:
            await saver.setup()
            yield saver


def thread_config(thread_id: str, principal: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "principal": principal}}


def message_json(m: BaseMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"type": m.type, "content": m.content}
    if isinstance(m, AIMessage) and m.tool_calls:
        out["tool_calls"] = [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in m.tool_calls]
    if isinstance(m, ToolMessage):
        out["status"] = m.status
        out["name"] = m.name
    return out


async def snapshot_json(agent: Any, config: RunnableConfig) -> dict[str, Any]:
    snap = await agent.aget_state(config)
    messages = snap.values.get("messages", [])
    ai = [m for m in messages if isinstance(m, AIMessage)]
    return {
        "values": {k: snap.values.get(k) for k in ("basket", "mint_inputs", "items", "custody")},
        "next": list(snap.next),
        "interrupts": [i.value for i in snap.interrupts],
        "messages": [message_json(m) for m in messages],
        "final": ai[-1].content if ai and not ai[-1].tool_calls else None,
        "checkpoint_id": snap.config["configurable"].get("checkpoint_id"),
    }


# ----------------------------------------------------------------------------- CLI


def interrupt_on(args: argparse.Namespace) -> list[str] | None:
    return None if args.interrupt_on is None else [n for n in args.interrupt_on.split(",") if n]


async def write(args: argparse.Namespace) -> dict[str, Any]:
    tools = await load_tools(args.server)
    async with open_saver(args) as saver:
        agent = build_agent(tools, saver, interrupt_on(args))
        config = thread_config(args.thread, args.principal)
        if (await saver.aget_tuple(config)) is not None:
            raise SystemExit(f"thread {args.thread} already has checkpoints")
        plan = {"customer": args.principal, "items": json.loads(args.items), "handle_in_args": args.handle_in_args}
        await agent.ainvoke({"messages": [HumanMessage(content=json.dumps(plan))]}, config)
        for _ in range(args.approve):
            snap = await agent.aget_state(config)
            if not snap.interrupts:
                break
            count = len(snap.interrupts[0].value["action_requests"])
            await agent.ainvoke(Command(resume={"decisions": [{"type": "approve"}] * count}), config)
        out = await snapshot_json(agent, config)
    log(f"{args.thread}: next={out['next']} basket={(out['values']['basket'] or {}).get('value')}")
    return out


async def resume(args: argparse.Namespace) -> dict[str, Any]:
    tools = await load_tools(args.server)
    async with open_saver(args) as saver:
        agent = build_agent(tools, saver, interrupt_on(args))
        config = thread_config(args.thread, args.principal)
        if (await saver.aget_tuple(config)) is None:
            raise SystemExit(f"thread {args.thread} has no checkpoints")
        await agent.ainvoke(Command(resume={"decisions": json.loads(args.decisions)}), config)
        return await snapshot_json(agent, config)


async def state(args: argparse.Namespace) -> dict[str, Any]:
    async with open_saver(args) as saver:
        agent = build_agent([], saver, [])
        return await snapshot_json(agent, thread_config(args.thread, "-"))


async def tools(args: argparse.Namespace) -> dict[str, Any]:
    loaded = await load_tools(args.server)
    build_agent(loaded, None, interrupt_on(args))  # create_agent accepts these tools
    names = {t.name for t in loaded}
    return {
        "tools": sorted(names),
        "writes": sorted(t.name for t in loaded if not read_only(t)),
        # The tools the agent's HumanInTheLoopMiddleware pauses before.
        "interrupted": sorted(n for n in approval(loaded, interrupt_on(args)).interrupt_on if n in names),
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hitl_agent.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def backend(p: argparse.ArgumentParser) -> None:
        group = p.add_mutually_exclusive_group(required=True)
        group.add_argument("--sqlite", metavar="PATH", help="SQLite checkpoint database file")
        group.add_argument("--postgres", metavar="DSN", help="PostgreSQL DSN")
        p.add_argument("--thread", required=True)

    def agent(p: argparse.ArgumentParser) -> None:
        p.add_argument("--server", required=True, metavar="URL", help="basket server MCP endpoint")
        p.add_argument("--principal", default="user-1")
        p.add_argument("--interrupt-on", metavar="A,B", help="tool names to interrupt (default: every write)")

    w = commands.add_parser("write", help="run the plan, approve N interrupts, print the state")
    backend(w)
    agent(w)
    w.add_argument("--items", default='[{"sku": "widget", "qty": 2}, {"sku": "gadget", "qty": 1}]', metavar="JSON")
    w.add_argument("--handle-in-args", action="store_true", help="the model copies the basket id into add_item")
    w.add_argument("--approve", type=int, default=0, metavar="N", help="interrupts to approve before leaving it parked")

    r = commands.add_parser("resume", help="resume a parked thread with human decisions")
    backend(r)
    agent(r)
    r.add_argument("--decisions", required=True, metavar="JSON", help='e.g. \'[{"type": "approve"}]\'')

    s = commands.add_parser("state", help="print a thread's state as JSON")
    backend(s)

    t = commands.add_parser("tools", help="list the agent's tools, its write tools and those it interrupts")
    t.add_argument("--server", metavar="URL", help="default: MCP_SERVERS from the environment")
    t.add_argument("--interrupt-on", metavar="A,B", help="tool names to interrupt (default: every write)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    command = {"write": write, "resume": resume, "state": state, "tools": tools}[args.command]
    document = asyncio.run(command(args))
    json.dump(document, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
