"""Write the benchmark's template threads with real LangGraph (the order graph of
tests/py/order_graph.py, PostgresSaver), to be multiplied by tests/bench/multiply.sql.

  templates.py --postgres DSN --server URL

Templates (thread ids `tpl-*`), each with several checkpoints:

  tpl-pb1   parked at add_item, basket minted                 (interrupt pending, handle)
  tpl-pb2   resumed once with an item, parked again           (older checkpoint: answered interrupt)
  tpl-pb4   resumed three times with an item, parked again    (a longer history)
  tpl-nb    parked at add_item without a basket (mint=False)  (interrupt pending, no handle)
  tpl-done  resumed with an item, then "done": finalize, END  (interrupts in history, none pending)
  tpl-fin   finished without an interrupt: a stop verdict in   (no interrupt write at all)
            the input sends add_item to handle_gone, END

Prints a JSON manifest: per template its basket handle (or null), whether LangGraph's get_state
says it is parked, and its row counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))

from langgraph.checkpoint.postgres import PostgresSaver  # noqa: E402
from langgraph.types import Command  # noqa: E402
from order_graph import build_graph, thread_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres", required=True)
    parser.add_argument("--server", required=True)
    args = parser.parse_args()

    start = {"customer": "user-1", "mint": True}
    item = Command(resume={"sku": "widget", "qty": 2})
    plans = {
        "tpl-pb1": [start],
        "tpl-pb2": [start, item],
        "tpl-pb4": [start, item, item, item],
        "tpl-nb": [{"customer": "user-1", "mint": False}],
        "tpl-done": [start, item, Command(resume="done")],
        "tpl-fin": [{**start, "custody": {"verdict": "failed", "reason": "bench: finished without an interrupt"}}],
    }
    manifest = {}
    with PostgresSaver.from_conn_string(args.postgres) as saver:
        saver.setup()
        graph = build_graph(saver, args.server)
        for thread, steps in plans.items():
            config = thread_config(thread, "user-1")
            if saver.get_tuple(config) is not None:
                raise SystemExit(f"{thread} already exists; use a fresh database")
            for payload in steps:
                graph.invoke(payload, config)
            snap = graph.get_state(config)
            basket = snap.values.get("basket")
            manifest[thread] = {
                "handle": basket["value"] if basket else None,
                "parked": bool(snap.next),
                "interrupts": len(snap.interrupts),
            }
        with saver.conn.cursor() as cur:
            for thread in plans:
                counts = {}
                for table in ("checkpoints", "checkpoint_blobs", "checkpoint_writes"):
                    cur.execute(f"SELECT count(*) AS n FROM {table} WHERE thread_id = %s", (thread,))
                    counts[table] = cur.fetchone()["n"]
                manifest[thread]["rows"] = counts
    json.dump(manifest, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
