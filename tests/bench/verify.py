"""Check multiplied threads with LangGraph's own API (run on a small throwaway copy: it resumes
some threads to the end).

  verify.py --postgres DSN --n N

For every copy g in 1..N: get_state gives the template's `next` and interrupts, the basket is
bsk_<g as 16 hex> (and the interrupt value carries it), and the finished copies are not parked.
Then the first pb1, pb2 and pb4 copies are resumed with "done": finalize must see their own
basket and item count. Prints one line per check; exits 1 on the first mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "py"))

from langgraph.checkpoint.postgres import PostgresSaver  # noqa: E402
from langgraph.types import Command  # noqa: E402
from order_graph import build_graph, thread_config  # noqa: E402

KINDS = {0: ("pb", 0), 1: ("pb", 0), 2: ("pb", 0), 3: ("pb", 1), 4: ("pb", 1), 5: ("pb", 1),
         6: ("pb", 3), 7: ("pb", 3), 8: ("nb", 0), 9: ("done", 1)}


def thread_of(g: int) -> str:
    return str(uuid.UUID(hashlib.md5(f"t{g}".encode()).hexdigest()))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--postgres", required=True)
    p.add_argument("--n", type=int, required=True)
    args = p.parse_args()
    with PostgresSaver.from_conn_string(args.postgres) as saver:
        graph = build_graph(saver, None)
        for g in range(1, args.n + 1):
            kind, items = KINDS[g % 10]
            cfg = thread_config(thread_of(g), "user-1")
            snap = graph.get_state(cfg)
            basket = snap.values.get("basket")
            want = f"bsk_{g:016x}"
            ok = len(snap.values.get("items", [])) == items
            if kind == "pb":
                ok &= snap.next == ("add_item",) and len(snap.interrupts) == 1
                ok &= basket is not None and basket["value"] == want
                ok &= snap.interrupts[0].value.get("basket") == want
            elif kind == "nb":
                ok &= snap.next == ("add_item",) and len(snap.interrupts) == 1 and basket is None
            else:
                ok &= snap.next == () and not snap.interrupts
                ok &= snap.values.get("verdict") == f"ok basket={want} items={items}"
            print(f"g={g} {kind} next={snap.next} basket={basket and basket['value']} "
                  f"items={len(snap.values.get('items', []))} {'OK' if ok else 'MISMATCH'}")
            if not ok:
                return 1
        for g in (1, 3, 6):
            _, items = KINDS[g % 10]
            cfg = thread_config(thread_of(g), "user-1")
            graph.invoke(Command(resume="done"), cfg)
            snap = graph.get_state(cfg)
            want = f"ok basket=bsk_{g:016x} items={items}"
            ok = snap.next == () and snap.values.get("verdict") == want
            print(f"resume g={g}: verdict={snap.values.get('verdict')!r} {'OK' if ok else 'MISMATCH'}")
            if not ok:
                return 1
    print("verify: all copies read and resume correctly with LangGraph")
    return 0


if __name__ == "__main__":
    sys.exit(main())
