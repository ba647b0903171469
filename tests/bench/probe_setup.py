"""Set up the probe-cost benchmark (issue 8, item 2) on a database multiplied to M threads.

  probe_setup.py --postgres DSN --m M --distinct D --servers URL,URL,... --resources DIR

* mints D baskets in total, D/K on each of the K basket servers (one MCP session per server);
* gives thread g (1..M) the basket minted for slot g % D, rewriting its bsk_<g as 16 hex>
  everywhere multiply.sql put it (same length, so msgpack stays valid): M threads, 0.8 M of
  them parked with a handle, only D distinct handles;
* writes local-mode resources to DIR: K MCPServers basket-0..K-1, K HandleClasses (each probes
  the `basket` record on its own server with get_basket) and one CheckpointStore.

Every parked thread with a handle gives K rows (one per class); custody must send exactly one
probe per distinct (server, handle): K * (distinct handles held by parked threads). The number is
printed as JSON {"expect_probes": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import uuid
from pathlib import Path

import psycopg
from mcp import Client

KIND_PARKED_WITH_HANDLE = {0, 1, 2, 3, 4, 5, 6, 7}  # g % 10, see multiply.sql


async def mint(url: str, count: int) -> list[str]:
    out = []
    async with Client(url) as client:
        for i in range(count):
            result = await client.call_tool("create_basket", {"customer": f"bench-{i}", "ttl_seconds": 86400})
            out.append(result.structured_content["basket_id"])
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--postgres", required=True)
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--distinct", type=int, required=True)
    p.add_argument("--servers", required=True)
    p.add_argument("--resources", required=True)
    args = p.parse_args()
    servers = args.servers.split(",")
    k = len(servers)
    per = args.distinct // k
    handles: list[str] = []
    for url in servers:
        handles += asyncio.run(mint(url, per))
    d = len(handles)

    def thread_of(g: int) -> str:
        return str(uuid.UUID(hashlib.md5(f"t{g}".encode()).hexdigest()))

    with psycopg.connect(args.postgres, autocommit=False) as conn, conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE remap (thread_id text PRIMARY KEY, old bytea, new bytea)")
        with cur.copy("COPY remap FROM STDIN") as copy:
            for g in range(1, args.m + 1):
                copy.write_row((thread_of(g), f"bsk_{g:016x}".encode(), handles[g % d].encode()))
        for table in ("checkpoint_blobs", "checkpoint_writes"):
            cur.execute(f"""
                UPDATE {table} t SET blob = overlay(t.blob PLACING r.new FROM position(r.old IN t.blob))
                FROM remap r WHERE t.thread_id = r.thread_id AND position(r.old IN t.blob) > 0""")
        cur.execute("""
            UPDATE checkpoints t SET checkpoint = replace(t.checkpoint::text, convert_from(r.old, 'UTF8'), convert_from(r.new, 'UTF8'))::jsonb
            FROM remap r WHERE t.thread_id = r.thread_id AND strpos(t.checkpoint::text, convert_from(r.old, 'UTF8')) > 0""")
        conn.commit()
    held = {handles[g % d] for g in range(1, args.m + 1) if g % 10 in KIND_PARKED_WITH_HANDLE}

    res = Path(args.resources)
    res.mkdir(parents=True, exist_ok=True)
    docs = []
    for i, url in enumerate(servers):
        docs.append(f"""apiVersion: custody.dev/v1alpha1
kind: MCPServer
metadata: {{name: basket-{i}, namespace: default}}
spec: {{url: "{url}", mode: auto, timeoutSeconds: 30}}
---
apiVersion: custody.dev/v1alpha1
kind: HandleClass
metadata: {{name: basket-{i}, namespace: default}}
spec:
  serverRef: basket-{i}
  statePath: basket
  probe:
    tool: get_basket
    arguments: {{basket_id: "{{{{handle}}}}"}}
    goneWhen: {{errorTextPrefixes: [BASKET_EXPIRED, BASKET_NOT_FOUND]}}
""")
    docs.append(f"""apiVersion: custody.dev/v1alpha1
kind: CheckpointStore
metadata: {{name: probe-bench, namespace: default}}
spec: {{backend: postgres, dsn: "{args.postgres}", principalKey: principal, minParkedSeconds: 0}}
""")
    (res / "bench.yaml").write_text("---\n".join(docs))
    print(json.dumps({"servers": k, "minted": d, "held_distinct": len(held), "expect_probes": k * len(held)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
