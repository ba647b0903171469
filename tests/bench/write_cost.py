"""LangGraph's write cost on a benchmark database, for the optional partial indexes of issue 20
(run by tests/bench/run.sh --parked-pct, once without and once with them).

  write_cost.py --postgres DSN --threads K --label without|with

Runs K threads of the real order graph (tests/py/order_graph.py, PostgresSaver) through one
interrupt each and to the end: start with `mint: False` (no MCP call, so the figure is
LangGraph's and PostgreSQL's own), parked at add_item (an `__interrupt__` write), resumed with
"done" (finalize, END). Prints one JSON line: wall seconds per thread, the WAL bytes written per
thread (pg_current_wal_lsn before and after; the index entries are WAL too), the rows the threads
wrote, the load average; then deletes the threads again, so the database stays as it was built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))

import psycopg  # noqa: E402
from langgraph.checkpoint.postgres import PostgresSaver  # noqa: E402
from langgraph.types import Command  # noqa: E402
from order_graph import build_graph, thread_config  # noqa: E402

TABLES = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", required=True)
    parser.add_argument("--threads", type=int, default=300)
    parser.add_argument("--label", required=True)
    args = parser.parse_args()
    prefix = f"wc-{args.label}-{os.getpid()}-"

    with psycopg.connect(args.postgres, autocommit=True) as admin, \
            PostgresSaver.from_conn_string(args.postgres) as saver:
        graph = build_graph(saver, None)
        wal0 = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        for i in range(args.threads):
            config = thread_config(f"{prefix}{i}", "user-1")
            graph.invoke({"customer": "user-1", "mint": False}, config)
            graph.invoke(Command(resume="done"), config)
        wall = time.perf_counter() - t0
        wal = admin.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (wal0,)).fetchone()[0]
        rows = {t: admin.execute(f"SELECT count(*) FROM {t} WHERE thread_id LIKE %s", (prefix + "%",)).fetchone()[0]
                for t in TABLES}
        indexes = [r[0] for r in admin.execute(
            "SELECT relname FROM pg_class WHERE relname IN ('custody_interrupts', 'custody_updates') ORDER BY 1")]
        for t in TABLES:
            admin.execute(f"DELETE FROM {t} WHERE thread_id LIKE %s", (prefix + "%",))
    print(json.dumps({
        "label": args.label,
        "indexes": indexes,
        "threads": args.threads,
        "wall_s": round(wall, 3),
        "ms_per_thread": round(1000 * wall / args.threads, 3),
        "wal_bytes_per_thread": round(float(wal) / args.threads),
        "rows": rows,
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
