"""Where custody's statement spends PostgreSQL's CPU beyond c_same_rule's (issue 20, item 2).

  select_list.py --bin SCAN_BIN --url DB_URL [--rounds 3] [--threads-below PREFIX]

Turns custody's own statement (`SCAN_BIN sql`, as driver.py inlines it) step by step into
tests/bench/sql/careful_same_rule.sql (c's query with custody's whole parked rule), then into
tests/bench/sql/careful.sql (c's own query): each step takes one more part out, each is a valid
statement returning the same 900 000 threads at 1M, and the two steps named after them are their
texts exactly (checked). Every statement is copied to /dev/null in
COPY's binary format through psql as driver.py's d runs, the steps interleaved round by round
(each round starting one step further along, so no step always runs first). The figure is the
**backend's** CPU seconds (utime + stime of the server process, from /proc/PID/stat: server and
script share the host), which is steadier than wall time on a loaded box; the client's CPU is not
counted. Its user part is given apart: the system part is mostly the kernel copying the pages
every step reads alike from the page cache, and it swings with what other processes on the box
evicted from that cache. Besides each step's min and median, the summary gives the median over rounds of the
CPU a step saves against the step before it **in the same round**: neighbours run one after the
other, so that difference shares their load. The steps, cumulatively (STEPS below names the rule
each removed part serves):

  no_metadata    the metadata column
  no_sizes       the size checks of the document and the metadata
  no_ts          the checkpoint's `ts` and the channel's version
  no_fits        the subquery and the `fits` tests that carry the size checks
  no_shape       the document column: the `@>` shape test and the document it lets through
  no_blob_limit  the blob's size check
  no_ids         the checkpoint id, the pending flag and the columns left NULL above
  c_literals     the channel's name as a literal instead of the bound parameter's element
  c_same_rule    c's join order, without the shard filter: c_same_rule's text
  c_careful      the edit rule: careful.sql's text

With --threads-below, every step reads only the threads whose id sorts below PREFIX (a condition
added to the `latest` step of each, after the last step is checked): thread ids are random
UUIDs, so `--threads-below 1` keeps about 1/16 of them, and a round takes seconds instead of
minutes, for many more rounds of the same per-thread work.

A step without a part is not a statement custody could run: the rules need every one. The
output is one line per run, then a table (Markdown) and the medians (JSON on the last line).
Standard library and psql only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import driver  # noqa: E402

SHAPE = """'{"v": 4, "channel_versions": {}, "channel_values": {}}'"""
CHANNEL = "('{basket}'::text[])[1]"
LOOKUP = ("x.thread_id = l.thread_id AND x.checkpoint_ns = '' AND x.checkpoint_id = l.checkpoint_id "
          "OFFSET 0")
WRITES = ("LEFT JOIN LATERAL ( SELECT w.task_id FROM checkpoint_writes w WHERE w.thread_id = l.thread_id "
          "AND w.checkpoint_ns = '' AND w.checkpoint_id = l.checkpoint_id GROUP BY w.task_id "
          "HAVING bool_or(w.channel = '__interrupt__') AND NOT bool_or(w.channel NOT IN ('__interrupt__', "
          "'__resume__', '__error__', '__error_source_node__')) LIMIT 1 ) p ON true")
DOC = f"CROSS JOIN LATERAL ( SELECT x.checkpoint, x.metadata FROM checkpoints x WHERE {LOOKUP} ) c"

# (step, the rule of custody's the removed part serves, [(text in the statement so far, its
# replacement)]), each applied on top of the last, on the statement as one line (driver.one_line).
STEPS = [
    ("no_metadata", "the principal (handle ownership) and appliesTo.metadata read the metadata; so does "
     "the edit rule (source 'update') for a thread without a pending interrupt", [
        ("CASE WHEN coalesce(c.metadata_size, 0) <= 16777216 THEN c.metadata END", "NULL::jsonb"),
    ]),
    ("no_sizes", "the 16 MiB limit: a document or metadata over it is not fetched, the thread is "
     "skipped as too_large", [
        ("CASE WHEN c.metadata_size > 16777216 THEN c.metadata_size END", "NULL::int"),
        ("CASE WHEN NOT c.fits THEN c.size END", "NULL::int"),
        ("CASE WHEN pg_column_size(x.checkpoint) > 32768 THEN octet_length(x.checkpoint::text) END AS size",
         "NULL::int AS size"),
        ("CASE WHEN pg_column_size(x.metadata) > 32768 THEN octet_length(x.metadata::text) END AS metadata_size",
         "NULL::int AS metadata_size"),
    ]),
    ("no_ts", "minParkedSeconds reads `ts`; the version tells a channel the checkpoint has (empty, "
     "`absent`) from one it never had", [
        ("CASE WHEN c.fits THEN c.checkpoint -> 'ts' END", "NULL::jsonb"),
        (f"CASE WHEN c.fits THEN c.checkpoint -> 'channel_versions' -> {CHANNEL} END", "NULL::jsonb"),
    ]),
    ("no_fits", "the 16 MiB limit: no part of an over-limit document is fetched", [
        ("SELECT y.*, coalesce(y.size, 0) <= 16777216 AS fits FROM ( SELECT x.checkpoint, x.metadata, "
         f"NULL::int AS size, NULL::int AS metadata_size FROM checkpoints x WHERE {LOOKUP} ) y",
         f"SELECT x.checkpoint, x.metadata FROM checkpoints x WHERE {LOOKUP}"),
        ("CASE WHEN c.fits AND (p.task_id IS NULL OR NOT", "CASE WHEN (p.task_id IS NULL OR NOT"),
        (f"CASE WHEN c.fits THEN c.checkpoint -> 'channel_values' -> {CHANNEL} END",
         f"c.checkpoint -> 'channel_values' -> {CHANNEL}"),
    ]),
    ("no_shape", "a document not of the current plain shape is read by the typed decoder or refused, "
     "never read as empty; a thread without a pending interrupt needs its document (next nodes) for "
     "the edit rule", [
        (f"CASE WHEN (p.task_id IS NULL OR NOT coalesce(c.checkpoint @> {SHAPE}, false)) "
         "THEN coalesce(c.checkpoint, 'null') END", "NULL::jsonb"),
    ]),
    ("no_blob_limit", "the 16 MiB limit on a blob: over it, only its size", [
        ("SELECT b.type, CASE WHEN octet_length(b.blob) <= 16777216 THEN b.blob END AS blob, "
         "octet_length(b.blob) AS size FROM", "SELECT b.type, b.blob FROM"),
        ("b1.type, b1.blob, b1.size", "b1.type, b1.blob"),
    ]),
    ("no_ids", "the checkpoint a verdict and an act name (an act re-checks it is still the latest); "
     "interrupt or edit (parked_by)", [
        ("SELECT l.thread_id, l.checkpoint_id, NULL::jsonb, NULL::jsonb, NULL::jsonb, (p.task_id IS NOT NULL), "
         "NULL::int, NULL::int, NULL::jsonb, ", "SELECT l.thread_id, "),
    ]),
    ("c_literals", "none: custody binds the channel names ($1); the planner folds the element to "
     "the same constant", [
        (f"c.checkpoint -> 'channel_values' -> {CHANNEL}, b1.type, b1.blob",
         "b1.type, b1.blob, c.checkpoint -> 'channel_values' -> 'basket' AS inline"),
        (f"b.channel = {CHANNEL} AND b.version = c.checkpoint -> 'channel_versions' ->> {CHANNEL}",
         "b.channel = 'basket' AND b.version = c.checkpoint -> 'channel_versions' ->> 'basket'"),
    ]),
    ("c_same_rule", "sharding (with one shard the filter is a constant true); the join order", [
        (" AND (1::int = 1 OR ('x' || encode(substr(sha256(convert_to(thread_id, 'UTF8')), 1, 4), 'hex'))"
         "::bit(32)::bigint % 1 = 0)", ""),
        (f"{DOC} {WRITES}", f"{WRITES} {DOC}"),
        ("b1", "bl"),
    ]),
    ("c_careful", "threads parked by an update_state edit: c_same_rule looks up the latest checkpoint "
     "of every thread, finished ones included, for its metadata source", [
        (WRITES, WRITES.replace("LEFT JOIN", "CROSS JOIN").replace(" ON true", "")),
        ("SELECT x.checkpoint, x.metadata FROM", "SELECT x.checkpoint FROM"),
        (" WHERE p.task_id IS NOT NULL OR c.metadata ->> 'source' = 'update'", ""),
    ]),
]


def steps(custody: str) -> dict[str, str]:
    sql = driver.one_line(custody)
    out = {"custody": sql}
    for name, _, cuts in STEPS:
        for old, new in cuts:
            if old not in sql:
                raise SystemExit(f"step {name}: the statement no longer has {old!r}: update STEPS")
            sql = sql.replace(old, new)
        out[name] = sql
    for name, file in (("c_same_rule", "careful_same_rule.sql"), ("c_careful", "careful.sql")):
        want = driver.one_line((HERE / "sql" / file).read_text())
        if out[name] != want:
            raise SystemExit(f"step {name} is not {file}:\n{out[name]}\n{want}")
    return out


def run(url: str, sql: str) -> dict:
    """One COPY through psql, as driver.py's d runs: psql reads faster than a Python client, so
    the backend is not held back. psql itself reads the backend's /proc/PID/stat before and after
    (`\\!`), in the same session."""
    stat = "\\! awk '{print \"ticks\", $14, $15}' /proc/$CUSTODY_BACKEND/stat"
    script = "\n".join([
        "SELECT pg_backend_pid() AS pid \\gset",
        "\\setenv CUSTODY_BACKEND :pid",
        stat,
        f"\\copy ({sql}) to '/dev/null' with (format binary)",
        stat,
    ])
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = subprocess.run(["psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", url], input=script,
                         capture_output=True, text=True, check=True).stdout.split()
    wall = time.perf_counter() - t0
    # (utime, stime) before and after, in clock ticks
    (u0, s0), (u1, s1) = [(int(out[i + 1]), int(out[i + 2])) for i, word in enumerate(out) if word == "ticks"]
    hz = os.sysconf("SC_CLK_TCK")
    return {"backend_cpu_s": round((u1 + s1 - u0 - s0) / hz, 2), "backend_user_s": round((u1 - u0) / hz, 2),
            "wall_s": round(wall, 2), "rows": int(out[out.index("COPY") + 1]), "load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads-below", help="only the threads whose id sorts below this text")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        custody = driver.custody_sql(args.bin, Path(tmp)).read_text()
    sqls = steps(custody)
    if args.threads_below:
        latest = "FROM checkpoints WHERE checkpoint_ns = ''"
        below = f"{latest} AND thread_id < '{args.threads_below}'"
        sqls = {name: sql.replace(latest, below, 1) for name, sql in sqls.items()}
    names = list(sqls)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            result = run(args.url, sqls[name])
            result["round"] = r + 1
            runs[name].append(result)
            print(r + 1, name, json.dumps(result), flush=True)
    summary = {}
    for k, name in enumerate(names):
        s = {"rows": sorted({x["rows"] for x in runs[name]}),
             "wall_median": statistics.median(x["wall_s"] for x in runs[name]),
             "load": [min(x["load"] for x in runs[name]), max(x["load"] for x in runs[name])]}
        for key in ("backend_cpu_s", "backend_user_s"):
            cpu = [x[key] for x in runs[name]]
            s[key] = {"min": min(cpu), "median": statistics.median(cpu), "saved_vs_previous_median": None}
            if k > 0:
                before = {x["round"]: x[key] for x in runs[names[k - 1]]}
                s[key]["saved_vs_previous_median"] = round(
                    statistics.median(before[x["round"]] - x[key] for x in runs[name]), 2)
        summary[name] = s
    rules = {name: rule for name, rule, _ in STEPS}
    print("| step | backend CPU s, min | median | saved vs the step before (median of rounds) | "
          "user CPU s, min | median | saved | median wall s | rows | rule of the removed part |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, s in summary.items():
        cells = []
        for key in ("backend_cpu_s", "backend_user_s"):
            c = s[key]
            saved = c["saved_vs_previous_median"]
            cells += [f"{c['min']:.2f}", f"{c['median']:.2f}", "" if saved is None else f"{saved:.2f}"]
        print(f"| {name} | {' | '.join(cells)} | {s['wall_median']:.2f} | {'/'.join(map(str, s['rows']))} | "
              f"{rules.get(name, '')} |")
    loads = [x["load"] for rs in runs.values() for x in rs]
    print(f"1-minute load average before the runs: min {min(loads):.2f}, median {statistics.median(loads):.2f}, "
          f"max {max(loads):.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
