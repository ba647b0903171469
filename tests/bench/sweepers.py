"""The Python sweepers custody is compared with (issue 8). Each finds every thread whose latest
root checkpoint has a pending interrupt (an `__interrupt__` write from a task with no output
write, LangGraph's rule in pregel/_task_status.py) and reads its `basket` handle record.

  sweepers.py api  DSN   (b)  LangGraph's API: thread ids from saver.list(None), then
                               saver.get_tuple per thread
  sweepers.py ids  DSN   (b') the same, but thread ids from one SELECT DISTINCT (list(None) loads
                               every checkpoint of every thread into memory first)
  sweepers.py careful DSN [SQLFILE]
                         (c)  one query (tests/bench/sql/careful.sql unless given), streamed,
                               blobs decoded with LangGraph's JsonPlusSerializer.loads_typed;
                               with sql/careful_same_rule.sql it also finds threads parked by an
                               update_state edit, as custody does

Prints one JSON line: parked threads, with/without handle, the digest (the wrapping sum of the
first 8 bytes of sha256("{thread_id}\\t{value or -}"), as tests/bench/scan.rs computes it),
in-process seconds (connect to done, imports excluded) and peak RSS (ru_maxrss).
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from pathlib import Path

T_IMPORT = time.perf_counter()

import psycopg  # noqa: E402
from langgraph.checkpoint.postgres import PostgresSaver  # noqa: E402
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer  # noqa: E402

CONTROL = {"__interrupt__", "__resume__", "__error__", "__error_source_node__"}
MASK = (1 << 64) - 1


class Tally:
    def __init__(self) -> None:
        self.parked = self.with_handle = self.without = 0
        self.digest = 0

    def add(self, thread_id: str, record: object) -> None:
        self.parked += 1
        value = record.get("value") if isinstance(record, dict) else record if isinstance(record, str) else None
        if value:
            self.with_handle += 1
        else:
            self.without += 1
            value = None
        line = f"{thread_id}\t{value or '-'}".encode()
        self.digest = (self.digest + int.from_bytes(hashlib.sha256(line).digest()[:8], "big")) & MASK


def pending_interrupt(pending_writes: list[tuple[str, str, object]]) -> bool:
    interrupted, finished = set(), set()
    for task_id, channel, _ in pending_writes:
        if channel == "__interrupt__":
            interrupted.add(task_id)
        elif channel not in CONTROL:
            finished.add(task_id)
    return bool(interrupted - finished)


def sweep_api(dsn: str, ids_by_sql: bool) -> Tally:
    tally = Tally()
    with PostgresSaver.from_conn_string(dsn) as saver:
        if ids_by_sql:
            with saver.conn.cursor() as cur:
                cur.execute("SELECT DISTINCT thread_id FROM checkpoints WHERE checkpoint_ns = ''")
                threads = sorted(r["thread_id"] for r in cur.fetchall())
        else:
            threads = sorted({t.config["configurable"]["thread_id"] for t in saver.list(None)})
        for thread_id in threads:
            tup = saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
            if tup is None or not pending_interrupt(tup.pending_writes or []):
                continue
            tally.add(thread_id, tup.checkpoint["channel_values"].get("basket"))
    return tally


def sweep_careful(dsn: str, sql_file: str) -> Tally:
    tally = Tally()
    serde = JsonPlusSerializer()
    sql = Path(sql_file).read_text()
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(binary=True) as cur:
        for thread_id, type_, blob, inline in cur.stream(sql, {"channel": "basket"}, size=2000):
            if blob is not None:
                record = serde.loads_typed((type_, bytes(blob)))
            else:
                record = inline
            tally.add(thread_id, record)
    return tally


def main(argv: list[str]) -> int:
    mode, dsn = argv[0], argv[1]
    t0 = time.perf_counter()
    if mode == "api":
        tally = sweep_api(dsn, ids_by_sql=False)
    elif mode == "ids":
        tally = sweep_api(dsn, ids_by_sql=True)
    elif mode == "careful":
        default = Path(__file__).resolve().parent / "sql" / "careful.sql"
        tally = sweep_careful(dsn, argv[2] if len(argv) > 2 else str(default))
    else:
        raise SystemExit(f"unknown mode {mode}")
    inproc = time.perf_counter() - t0
    print(json.dumps({
        "sweeper": {"api": "b_api", "ids": "b_ids", "careful": "c_careful"}[mode],
        "parked": tally.parked,
        "with_handle": tally.with_handle,
        "without_handle": tally.without,
        "digest": f"{tally.digest:016x}",
        "import_s": t0 - T_IMPORT,
        "inproc_s": inproc,
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
