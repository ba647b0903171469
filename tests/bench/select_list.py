"""Where custody's statement spends PostgreSQL's CPU beyond c_same_rule's (issue 20, item 2).

  select_list.py --bin SCAN_BIN --url DB_URL [--rounds 3]

Runs custody's own statement (`SCAN_BIN sql`, as driver.py inlines it) and variants of it with
parts of the select list replaced by NULL, beside tests/bench/sql/careful_same_rule.sql (c's
query with custody's whole parked rule), each copied to /dev/null in COPY's binary format through
psql as driver.py's d runs, the variants interleaved round by round. The figure is the **backend's** CPU seconds
(utime + stime of the server process, from /proc/PID/stat: server and script share the host),
which is steadier than wall time on a loaded box; the client's CPU is not counted. Every variant
keeps custody's FROM and WHERE, so they read the same pages; what differs is the work of
computing and sending the columns. The variants drop, cumulatively:

  no_metadata   the metadata column (the principal and appliesTo.metadata keys come from it)
  no_sizes      the size checks that keep an over-limit document or metadata from being fetched
  no_ts         the checkpoint's `ts` (a handle's age) and the channel's version (tells a channel
                the checkpoint never had from a blob that is missing)

A variant without a column is not a statement custody could run: the rules need every one. The
output is one line per run and medians (JSON on the last line). Standard library and psql only.
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

# (variant, [(text in custody's statement, its replacement)]), each applied on top of the last.
CUTS = [
    ("no_metadata", [("CASE WHEN coalesce(c.metadata_size, 0) <= 16777216 THEN c.metadata END", "NULL::jsonb")]),
    ("no_sizes", [
        ("CASE WHEN c.metadata_size > 16777216 THEN c.metadata_size END", "NULL::int"),
        ("CASE WHEN NOT c.fits THEN c.size END", "NULL::int"),
        ("CASE WHEN pg_column_size(x.checkpoint) > 32768 THEN octet_length(x.checkpoint::text) END AS size",
         "NULL::int AS size"),
        ("CASE WHEN pg_column_size(x.metadata) > 32768 THEN octet_length(x.metadata::text) END AS metadata_size",
         "NULL::int AS metadata_size"),
    ]),
    ("no_ts", [
        ("CASE WHEN c.fits THEN c.checkpoint -> 'ts' END", "NULL::jsonb"),
        ("CASE WHEN c.fits THEN c.checkpoint #> ARRAY['channel_versions', ('{basket}'::text[])[1]] END", "NULL::jsonb"),
    ]),
]


def variants(custody: str) -> dict[str, str]:
    out = {"custody": custody}
    sql = custody
    for name, cuts in CUTS:
        for old, new in cuts:
            if old not in sql:
                raise SystemExit(f"custody's statement no longer has {old!r}: update CUTS")
            sql = sql.replace(old, new)
        out[name] = sql
    out["c_same_rule"] = (HERE / "sql" / "careful_same_rule.sql").read_text()
    return out


def run(url: str, sql: str) -> dict:
    """One COPY through psql, as driver.py's d runs: psql reads faster than a Python client, so
    the backend is not held back. psql itself reads the backend's /proc/PID/stat before and after
    (`\\!`), in the same session."""
    stat = "\\! awk '{print $14 + $15}' /proc/$CUSTODY_BACKEND/stat"
    script = "\n".join([
        "SELECT pg_backend_pid() AS pid \\gset",
        "\\setenv CUSTODY_BACKEND :pid",
        stat,
        f"\\copy ({driver.one_line(sql)}) to '/dev/null' with (format binary)",
        stat,
    ])
    t0 = time.perf_counter()
    out = subprocess.run(["psql", "-X", "-At", "-v", "ON_ERROR_STOP=1", url], input=script,
                         capture_output=True, text=True, check=True).stdout.split()
    wall = time.perf_counter() - t0
    ticks = os.sysconf("SC_CLK_TCK")
    return {"backend_cpu_s": round((int(out[-1]) - int(out[0])) / ticks, 2),
            "wall_s": round(wall, 2), "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        custody = driver.custody_sql(args.bin, Path(tmp)).read_text()
    sqls = variants(custody)
    runs: dict[str, list[dict]] = {name: [] for name in sqls}
    for r in range(args.rounds):
        for name, sql in sqls.items():
            result = run(args.url, sql)
            runs[name].append(result)
            print(r + 1, name, json.dumps(result), flush=True)
    medians = {name: {k: statistics.median(x[k] for x in rs) for k in ("backend_cpu_s", "wall_s", "load")}
               for name, rs in runs.items()}
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
