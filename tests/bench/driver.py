"""Timing driver for tests/bench/run.sh (issue 8). Standard library only.

  driver.py scan  --out DIR --bin SCAN_BIN --python VENV_PY --url BASE_URL --sizes 10000,100000
                  [--runs 5] [--slow-runs 3] [--slow-runs-big 1] [--api-max 100000]
                  [--slow-max 100000] [--shards 1,2,4] [--db-suffix _p1] [--plan full|indexed]
                  [--only a_custody,c_careful,d_best]
  driver.py probe --out DIR --bin SCAN_BIN --resources DIR --server-pids P,P,...
                  --expect-probes K --runs 3
  driver.py compare --out DIR --url BASE_URL --sizes 10000,100000 --runs 7
                  --build NAME=SCAN_BIN,CUSTODY_BIN --build NAME=SCAN_BIN,CUSTODY_BIN [--db-suffix _p1]

`compare` times two (or more) builds of custody against the same databases, interleaved round by
round: each build's bench `scan --dsn` (scan + decode), its bench `probe` (the library's full
sweep, probes refused by a closed port) and its CLI `custody sweep -f DIR --dry-run -o json`
(the same resources, output to /dev/null), beside d (the first build's statement over psql). The
first --build is the baseline; the summary gives each figure's median and its ratio to the
baseline's, and checks that the scans' digests agree.

Every measured run is its own process under /usr/bin/time (wall seconds, peak RSS of that
process). Runs are interleaved round by round (d, a, c, then the slow b sweepers), after one
untimed warm-up of d and a per size, so drift and cache state hit every sweeper alike. The 1-minute
load average is read before and after each run; a run whose load average was above
--noisy-load (default 3.0 on this 2-core box) is flagged, and when a size's median sits on
flagged runs its rounds are repeated once more (--retries).
Results: DIR/raw.jsonl (one line per run), DIR/summary.md and DIR/summary.json.
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
SQL = HERE / "sql"


def load1() -> float:
    return os.getloadavg()[0]


def timed(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """Run cmd under /usr/bin/time; returns wall, rss_kb, stdout (last JSON line if any)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        full = ["/usr/bin/time", "-f", "%e %M %U %S", "-o", tf.name, *cmd]
        before = load1()
        t0 = time.perf_counter()
        proc = subprocess.run(full, capture_output=True, text=True, env=env, timeout=timeout)
        wall_py = time.perf_counter() - t0
        after = load1()
        if proc.returncode != 0:
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        fields = tf.read().split()
    wall, rss, user, sys_ = float(fields[-4]), int(fields[-3]), float(fields[-2]), float(fields[-1])
    out = {}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            out = json.loads(line)
            break
    return {"wall_s": wall, "wall_py_s": wall_py, "rss_kb": rss, "user_s": user, "sys_s": sys_,
            "load_before": before, "load_after": after, "out": out}


def one_line(sql: str) -> str:
    """\\copy must be on one line for psql: drop whole-line comments, join the rest."""
    lines = [line for line in sql.splitlines() if not line.strip().startswith("--")]
    return " ".join(" ".join(lines).split()).rstrip(";")


def psql_copy(url: str, sql_file: Path) -> list[str]:
    """The rows into /dev/null in COPY's binary format: what a client on the binary protocol
    (custody's sqlx, c's psycopg) receives, without text output functions (bytea as hex)."""
    one = one_line(sql_file.read_text())
    return ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", url, "-c",
            f"\\copy ({one}) to '/dev/null' with (format binary)"]


def custody_sql(bin_: str, out: Path, count: int = 1, index: int = 0, plan: str = "full") -> Path:
    """The statement custody's scan runs (`scan sql --plan PLAN`, from the library itself),
    parameters inlined: the one channel `basket`, shard `index` of `count`, custody's blob size
    limit."""
    sql = subprocess.run([bin_, "sql", "--plan", plan], capture_output=True, text=True, check=True).stdout
    sql = (sql.replace("$1::text[]", "'{basket}'::text[]").replace("$2", str(count))
           .replace("$3", str(index)).replace("$4", str(16 << 20)))
    sql = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    path = out / (f"custody_shard_{index}_of_{count}.sql" if count > 1 else "custody.sql")
    path.write_text(sql)
    return path


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def scan(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cur_sql = custody_sql(args.bin, out, plan=args.plan)
    raw = (out / "raw.jsonl").open("a")
    sizes = [int(s) for s in args.sizes.split(",")]
    shards = [int(s) for s in args.shards.split(",")] if args.shards else []
    summary = {}
    for n in sizes:
        url = f"{args.url}/lg_{n}{args.db_suffix}"
        sweepers = {
            "d_best": psql_copy(url, cur_sql),
            "d_min": psql_copy(url, SQL / "careful.sql"),
            "a_custody": [args.bin, "scan", "--dsn", url],
            "c_careful": [args.python, str(HERE / "sweepers.py"), "careful", url],
            "c_same_rule": [args.python, str(HERE / "sweepers.py"), "careful", url, str(SQL / "careful_same_rule.sql")],
        }
        if args.only:
            sweepers = {k: v for k, v in sweepers.items() if k in args.only.split(",")}
        slow = {}
        if n <= args.slow_max and not args.only:
            slow["b_ids"] = [args.python, str(HERE / "sweepers.py"), "ids", url]
        if n <= args.api_max and not args.only:
            slow["b_api"] = [args.python, str(HERE / "sweepers.py"), "api", url]
        for name in [k for k in ("d_best", "a_custody", "c_careful", "c_same_rule") if k in sweepers]:  # warm-up, untimed
            warm = timed(sweepers[name])
            if name == "a_custody" and warm["out"].get("plan") != args.plan:
                raise SystemExit(f"custody chose plan {warm['out'].get('plan')} on {url}, expected {args.plan}")
        runs: dict[str, list[dict]] = {k: [] for k in [*sweepers, *slow]}

        def one_round(r: int, with_slow: bool) -> None:
            todo = list(sweepers.items()) + (list(slow.items()) if with_slow else [])
            for name, cmd in todo:
                res = timed(cmd)
                res.update(n=n, sweeper=name, round=r)
                runs[name].append(res)
                raw.write(json.dumps(res) + "\n")
                raw.flush()
                print(f"  N={n} round {r} {name}: {res['wall_s']:.2f} s, {res['rss_kb'] / 1024:.0f} MiB, "
                      f"load {res['load_before']:.1f}->{res['load_after']:.1f}", file=sys.stderr, flush=True)

        slow_runs = args.slow_runs if n < 100000 else args.slow_runs_big
        n_runs = args.runs if n < 1000000 else args.runs_big
        for r in range(1, n_runs + 1):
            one_round(r, r <= slow_runs)
        # Noisy box: if most fast runs saw a high load, take more rounds and keep the quietest.
        for extra in range(args.retries if n < 1000000 else 0):
            noisy = sum(1 for x in runs["a_custody"] if max(x["load_before"], x["load_after"]) > args.noisy_load)
            if noisy <= len(runs["a_custody"]) // 2:
                break
            print(f"  N={n}: {noisy} of {len(runs['a_custody'])} runs noisy; another {args.runs} rounds",
                  file=sys.stderr, flush=True)
            for r in range(1, n_runs + 1):
                one_round(100 * (extra + 1) + r, False)

        shard_res = {}
        if n == sizes[0]:
            for k in shards:
                summary.setdefault("shard_cover", {})[k] = check_shards(args.bin, url, out, k)
        whole = runs["a_custody"][-1]["out"]
        custody_cover = {}
        for k in shards:
            if k == 1:
                continue
            # k custody processes at once, each `scan --shard i/k` (the shard filtered in SQL).
            walls = []
            for r in range(1, min(args.runs, 3) + 1):
                t0 = time.perf_counter()
                procs = [subprocess.Popen([args.bin, "scan", "--dsn", url, "--shard", f"{i}/{k}"],
                                          stdout=subprocess.PIPE, text=True) for i in range(k)]
                outs = [p.communicate()[0] for p in procs]
                walls.append(time.perf_counter() - t0)
                if any(p.returncode != 0 for p in procs):
                    raise SystemExit(f"custody scan --shard ?/{k} failed")
                parts = [json.loads(o.strip().splitlines()[-1]) for o in outs]
            # The digest is a wrapping sum over threads: the shards' digests add up to the whole's.
            digest = sum(int(x["digest"], 16) for x in parts) % 2**64
            custody_cover[k] = {
                "per_shard": [x["parked"] for x in parts],
                "threads": whole["parked"],
                "exactly_once": sum(x["parked"] for x in parts) == whole["parked"] and f"{digest:016x}" == whole["digest"],
            }
            shard_res[k] = median(walls)
            print(f"  N={n} custody shards={k}: {shard_res[k]:.2f} s (wall of the slowest), {custody_cover[k]}",
                  file=sys.stderr, flush=True)
        full = full_sweep(args, out, url, n)

        summary[n] = summarize(n, runs, shard_res, args.noisy_load)
        summary[n]["custody_shard_cover"] = custody_cover
        summary[n]["full_sweep"] = full
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(render(summary))
    print(render(summary))
    ok = all(s["digests_agree"] for k, s in summary.items() if k != "shard_cover")
    ok &= all(c["exactly_once"] for c in summary.get("shard_cover", {}).values())
    ok &= all(c["exactly_once"] for k, s in summary.items() if k != "shard_cover"
              for c in s.get("custody_shard_cover", {}).values())
    return 0 if ok else 1


def full_sweep(args: argparse.Namespace, out: Path, url: str, n: int) -> dict:
    """custody::sweep::run over the whole store (dry run), its probes refused at once by a closed
    port so that the figure is the sweep's own: scan, extract, rows, dedup map, report."""
    res_dir = out / f"full-sweep-{n}"
    res_dir.mkdir(parents=True, exist_ok=True)
    (res_dir / "bench.yaml").write_text(f"""apiVersion: custody.dev/v1alpha1
kind: MCPServer
metadata: {{name: closed, namespace: default}}
spec: {{url: "http://127.0.0.1:9/mcp", mode: auto, timeoutSeconds: 5}}
---
apiVersion: custody.dev/v1alpha1
kind: HandleClass
metadata: {{name: basket, namespace: default}}
spec:
  serverRef: closed
  statePath: basket
  probe:
    tool: get_basket
    arguments: {{basket_id: "{{{{handle}}}}"}}
---
apiVersion: custody.dev/v1alpha1
kind: CheckpointStore
metadata: {{name: full-sweep, namespace: default}}
spec: {{backend: postgres, dsn: "{url}", principalKey: principal, minParkedSeconds: 0}}
""")
    res = timed([args.bin, "probe", "--resources", str(res_dir)])
    st = res["out"]["stores"][0]
    full = {"wall_s": res["wall_s"], "peak_rss_mib": res["rss_kb"] / 1024, "rows": st["rows"],
            "parked_threads": st["parked_threads"], "unknown": st["unknown"], "load": round(res["load_before"], 2)}
    print(f"  N={n} full sweep: {full}", file=sys.stderr, flush=True)
    return full


def thread_ids(url: str, sql: str) -> list[str]:
    res = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", url, "-c",
                          f"\\copy (SELECT thread_id FROM ({one_line(sql)}) q) to stdout"],
                         capture_output=True, text=True, check=True)
    return res.stdout.split()


def check_shards(bin_: str, url: str, out: Path, k: int) -> dict:
    """The k shards of custody's statement together return every parked thread of the whole
    statement exactly once."""
    full = thread_ids(url, custody_sql(bin_, out).read_text())
    parts = []
    for i in range(k):
        parts.append(thread_ids(url, custody_sql(bin_, out, k, i).read_text()))
    union = [t for p in parts for t in p]
    res = {"threads": len(full), "per_shard": [len(p) for p in parts],
           "exactly_once": sorted(union) == sorted(full) and len(set(union)) == len(union)}
    print(f"  shards {k}: {res}", file=sys.stderr, flush=True)
    return res


def summarize(n: int, runs: dict[str, list[dict]], shard_res: dict, noisy_load: float) -> dict:
    rows = {}
    for name, rs in runs.items():
        if not rs:
            continue
        # Prefer quiet runs when there are at least 3 of them.
        quiet = [x for x in rs if max(x["load_before"], x["load_after"]) <= noisy_load]
        use = quiet if len(quiet) >= 3 else rs
        walls = [x["wall_s"] for x in use]
        w = median(walls)
        rows[name] = {
            "runs": len(rs),
            "used": len(use),
            "quiet_only": use is quiet,
            "median_wall_s": w,
            "min_wall_s": min(walls),
            "max_wall_s": max(walls),
            "threads_per_s": n / w if w else None,
            "median_inproc_s": median([x["out"]["inproc_s"] for x in use if "inproc_s" in x["out"]]),
            "median_cpu_s": median([x["user_s"] + x["sys_s"] for x in use]),
            "peak_rss_mib": max(x["rss_kb"] for x in rs) / 1024,
            "load": [round(x["load_before"], 2) for x in use],
            "parked": rs[-1]["out"].get("parked"),
            "with_handle": rs[-1]["out"].get("with_handle"),
            "digest": rs[-1]["out"].get("digest"),
        }
    digests = {k: v["digest"] for k, v in rows.items() if v["digest"]}
    all_digests = {x["out"].get("digest") for k in digests for x in runs[k]}
    ratio = lambda a, b: rows[a]["median_wall_s"] / rows[b]["median_wall_s"] if a in rows and b in rows else None  # noqa: E731
    return {
        "n": n,
        "rows": rows,
        "digests": digests,
        "digests_agree": len(all_digests) == 1,
        "ratios": {
            "a/b_ids": ratio("a_custody", "b_ids"),
            "a/b_api": ratio("a_custody", "b_api"),
            "a/c": ratio("a_custody", "c_careful"),
            "a/c_same_rule": ratio("a_custody", "c_same_rule"),
            "a/d": ratio("a_custody", "d_best"),
        },
        "shards": shard_res,
    }


def render(summary: dict) -> str:
    lines = ["| N | sweeper | runs (used) | median wall s (min-max) | threads/s | in-process s | CPU s | peak RSS MiB | parked / with handle | digest | load avg (1 min) of used runs |",
             "|---:|---|---:|---|---:|---:|---:|---:|---|---|---|"]
    for n, s in summary.items():
        if n == "shard_cover":
            continue
        for name, r in s["rows"].items():
            inproc = f"{r['median_inproc_s']:.2f}" if r["median_inproc_s"] is not None else "-"
            parked = f"{r['parked']} / {r['with_handle']}" if r["parked"] is not None else "-"
            lines.append(
                f"| {int(n):,} | {name} | {r['runs']} ({r['used']}) | {r['median_wall_s']:.2f} ({r['min_wall_s']:.2f}-{r['max_wall_s']:.2f}) "
                f"| {r['threads_per_s']:,.0f} | {inproc} | {r['median_cpu_s']:.2f} | {r['peak_rss_mib']:.0f} | {parked} "
                f"| {r['digest'] or '-'} | {' '.join(f'{x:.1f}' for x in r['load'])} |")
    lines += ["", "| N | a/b_api | a/b_ids | a/c | a/c_same_rule | a/d | digests agree | shards (wall s) |",
              "|---:|---:|---:|---:|---:|---:|---|---|"]
    fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
    for n, s in summary.items():
        if n == "shard_cover":
            continue
        r = s["ratios"]
        sh = ", ".join(f"{k}: {v:.2f}" for k, v in s["shards"].items()) or "-"
        lines.append(f"| {int(n):,} | {fmt(r['a/b_api'])} | {fmt(r['a/b_ids'])} | {fmt(r['a/c'])} | {fmt(r['a/c_same_rule'])} | {fmt(r['a/d'])} | {s['digests_agree']} | {sh} |")
    lines += ["", "| N | custody shards: threads per shard, all exactly once | full sweep (probes refused): wall s, peak RSS MiB, rows |",
              "|---:|---|---|"]
    for n, s in summary.items():
        if n == "shard_cover":
            continue
        cc = "; ".join(f"{k}: {c['per_shard']} {c['exactly_once']}" for k, c in s.get("custody_shard_cover", {}).items()) or "-"
        f = s.get("full_sweep")
        fs = f"{f['wall_s']:.2f} s, {f['peak_rss_mib']:.0f} MiB, {f['rows']} rows" if f else "-"
        lines.append(f"| {int(n):,} | {cc} | {fs} |")
    cover = summary.get("shard_cover", {})
    if cover:
        lines += ["", "Shards cover every parked thread exactly once: " + ", ".join(
            f"{k} shards {c['per_shard']} of {c['threads']}: {c['exactly_once']}" for k, c in cover.items())]
    return "\n".join(lines) + "\n"


def compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    builds = {}
    for spec in args.build:
        name, bins = spec.split("=", 1)
        scan_bin, cli_bin = bins.split(",")
        builds[name] = (scan_bin, cli_bin)
    base = next(iter(builds))
    stmt = custody_sql(builds[base][0], out, plan=args.plan)
    raw = (out / "compare_raw.jsonl").open("a")
    summary = {}
    for n in [int(x) for x in args.sizes.split(",")]:
        url = f"{args.url}/lg_{n}{args.db_suffix}"
        full_sweep(argparse.Namespace(bin=builds[base][0]), out, url, n)  # writes the resources
        res_dir = out / f"full-sweep-{n}"
        cmds = {"d": psql_copy(url, stmt)}
        for name, (scan_bin, cli_bin) in builds.items():
            cmds[f"{name}/scan"] = [scan_bin, "scan", "--dsn", url]
            cmds[f"{name}/probe"] = [scan_bin, "probe", "--resources", str(res_dir)]
            cmds[f"{name}/cli"] = ["sh", "-c", f'exec "$0" sweep -f "$1" --dry-run -o json >/dev/null', cli_bin, str(res_dir)]
        for cmd in cmds.values():  # warm-up, untimed
            timed(cmd)
        # What each build's CLI reports on this store (its JSON, kept out of the timed runs):
        # the same rows and counts from every build.
        cli_counts = {}
        for name, (_, cli_bin) in builds.items():
            doc = json.loads(subprocess.run([cli_bin, "sweep", "-f", str(res_dir), "--dry-run", "-o", "json"],
                                            capture_output=True, text=True, check=True).stdout)
            st = doc["stores"][0]
            cli_counts[name] = {"rows": len(st["rows"]), "skipped": len(st["skipped"]),
                                **{k: v for k, v in st["summary"].items() if isinstance(v, int) and k != "durationMs"}}
            print(f"  N={n} {name}/cli reports {cli_counts[name]}", file=sys.stderr, flush=True)
        runs: dict[str, list[dict]] = {k: [] for k in cmds}
        for r in range(1, args.runs + 1):
            # Rotate the order each round so that no build always runs right after d.
            names = list(cmds)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                res = timed(cmds[name])
                res.update(n=n, sweeper=name, round=r)
                runs[name].append(res)
                raw.write(json.dumps(res) + "\n")
                raw.flush()
                print(f"  N={n} round {r} {name}: {res['wall_s']:.2f} s, CPU {res['user_s'] + res['sys_s']:.2f} s, "
                      f"{res['rss_kb'] / 1024:.0f} MiB, load {res['load_before']:.1f}->{res['load_after']:.1f}",
                      file=sys.stderr, flush=True)
        rows = {}
        for name, rs in runs.items():
            rows[name] = {
                "runs": len(rs),
                "median_wall_s": median([x["wall_s"] for x in rs]),
                "min_wall_s": min(x["wall_s"] for x in rs),
                "max_wall_s": max(x["wall_s"] for x in rs),
                "median_cpu_s": median([x["user_s"] + x["sys_s"] for x in rs]),
                "median_rss_mib": median([x["rss_kb"] / 1024 for x in rs]),
                "peak_rss_mib": max(x["rss_kb"] for x in rs) / 1024,
                "load_median": median([x["load_before"] for x in rs]),
                "load_range": [min(x["load_before"] for x in rs), max(x["load_before"] for x in rs)],
                "digests": sorted({x["out"].get("digest") for x in rs if x["out"].get("digest")}),
                "parked": rs[-1]["out"].get("parked"),
                "sweep_rows": sorted({x["out"]["stores"][0]["rows"] for x in rs if x["out"].get("stores")}),
            }
        digests = {d for k, v in rows.items() if k.endswith("/scan") for d in v["digests"]}
        sweep_rows = {tuple(v["sweep_rows"]) for k, v in rows.items() if k.endswith("/probe")}
        summary[n] = {"rows": rows, "scan_digests_agree": len(digests) == 1 and all(
                          len(v["digests"]) == 1 for k, v in rows.items() if k.endswith("/scan")),
                      "sweep_rows_agree": len(sweep_rows) == 1 and all(len(r) == 1 for r in sweep_rows),
                      "cli_reports_agree": len({json.dumps(c, sort_keys=True) for c in cli_counts.values()}) == 1,
                      "cli": cli_counts}
        (out / "compare_summary.json").write_text(json.dumps(summary, indent=2))
    lines = ["| N | run | runs | median wall s (min-max) | ratio to " + base + " | median CPU s | ratio | peak RSS MiB | load avg (1 min) median (min-max) |",
             "|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for n, s in summary.items():
        for name, r in s["rows"].items():
            kind = name.split("/")[-1]
            b = s["rows"].get(f"{base}/{kind}") if "/" in name else None
            rw = f"{r['median_wall_s'] / b['median_wall_s']:.3f}" if b else "-"
            rc = f"{r['median_cpu_s'] / b['median_cpu_s']:.3f}" if b and b["median_cpu_s"] else "-"
            lines.append(f"| {n:,} | {name} | {r['runs']} | {r['median_wall_s']:.2f} ({r['min_wall_s']:.2f}-{r['max_wall_s']:.2f}) "
                         f"| {rw} | {r['median_cpu_s']:.2f} | {rc} | {r['peak_rss_mib']:.0f} "
                         f"| {r['load_median']:.1f} ({r['load_range'][0]:.1f}-{r['load_range'][1]:.1f}) |")
        lines.append(f"| {n:,} | scan digests agree: {s['scan_digests_agree']}; full sweeps' rows agree: "
                     f"{s['sweep_rows_agree']}; CLI reports agree: {s['cli_reports_agree']} | | | | | | | |")
    (out / "compare_summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(s["scan_digests_agree"] and s["sweep_rows_agree"] and s["cli_reports_agree"]
                    for s in summary.values()) else 1


def proc_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def probe(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pids = [int(p) for p in args.server_pids.split(",")]
    results = []
    for r in range(1, args.runs + 1):
        before = sum(proc_cpu(p) for p in pids)
        res = timed([args.bin, "probe", "--resources", args.resources])
        server_cpu = sum(proc_cpu(p) for p in pids) - before
        st = res["out"]["stores"][0]
        res.update(round=r, server_cpu_s=server_cpu)
        results.append(res)
        print(f"  probe round {r}: probes={st['probes']} distinct={st['distinct_probed_handles']} rows={st['rows']} "
              f"sweep {st['wall_s']:.2f} s, custody CPU {st['cpu_s']:.2f} s, servers CPU {server_cpu:.2f} s, "
              f"load {res['load_before']:.1f}", file=sys.stderr, flush=True)
    with (out / "probe_raw.jsonl").open("a") as f:
        for x in results:
            f.write(json.dumps(x) + "\n")
    st = [x["out"]["stores"][0] for x in results]
    summary = {
        "expect_probes": args.expect_probes,
        "probes": [s["probes"] for s in st],
        "distinct_probed_handles": [s["distinct_probed_handles"] for s in st],
        "probes_equal_distinct": all(s["probes"] == s["distinct_probed_handles"] == args.expect_probes for s in st),
        "rows": st[0]["rows"],
        "parked_threads": st[0]["parked_threads"],
        "verdicts": {k: st[0][k] for k in ("ok", "gone", "absent", "unknown")},
        "median_sweep_wall_s": median([s["wall_s"] for s in st]),
        "median_custody_cpu_s": median([s["cpu_s"] for s in st]),
        "median_server_cpu_s": median([x["server_cpu_s"] for x in results]),
        "peak_rss_mib": max(x["rss_kb"] for x in results) / 1024,
        "load": [round(x["load_before"], 2) for x in results],
    }
    summary["custody_cpu_per_server_cpu"] = summary["median_custody_cpu_s"] / summary["median_server_cpu_s"]
    (out / "probe_summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if summary["probes_equal_distinct"] else 1


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scan")
    s.add_argument("--out", required=True)
    s.add_argument("--bin", required=True)
    s.add_argument("--python", required=True)
    s.add_argument("--url", required=True, help="postgres://user@host:port (no database)")
    s.add_argument("--sizes", required=True)
    s.add_argument("--runs", type=int, default=5)
    s.add_argument("--runs-big", type=int, default=3, help="rounds at N >= 1000000")
    s.add_argument("--slow-runs", type=int, default=3)
    s.add_argument("--slow-runs-big", type=int, default=1, help="runs of the b sweepers at N >= 100000")
    s.add_argument("--api-max", type=int, default=100000, help="largest N for b_api (list(None) holds every checkpoint in memory)")
    s.add_argument("--slow-max", type=int, default=100000, help="largest N for b_ids (about 0.5-2 ms per thread)")
    s.add_argument("--shards", default="1,2,4")
    s.add_argument("--db-suffix", default="", help="databases lg_<N><suffix> (run.sh --parked-pct)")
    s.add_argument("--plan", default="full", choices=["full", "indexed"],
                   help="custody's statement for d_best; a_custody must have detected the same plan")
    s.add_argument("--only", default="", help="time only these fast sweepers (no b sweepers then)")
    s.add_argument("--noisy-load", type=float, default=3.0)
    s.add_argument("--retries", type=int, default=1)
    q = sub.add_parser("probe")
    q.add_argument("--out", required=True)
    q.add_argument("--bin", required=True)
    q.add_argument("--resources", required=True)
    q.add_argument("--server-pids", required=True)
    q.add_argument("--expect-probes", type=int, required=True)
    q.add_argument("--runs", type=int, default=3)
    c = sub.add_parser("compare")
    c.add_argument("--out", required=True)
    c.add_argument("--url", required=True, help="postgres://user@host:port (no database)")
    c.add_argument("--sizes", required=True)
    c.add_argument("--runs", type=int, default=7)
    c.add_argument("--build", action="append", required=True,
                   help="NAME=SCAN_BIN,CUSTODY_BIN; the first is the baseline (repeat for each build)")
    c.add_argument("--db-suffix", default="")
    c.add_argument("--plan", default="full", choices=["full", "indexed"], help="the baseline's statement for d")
    args = p.parse_args()
    return {"scan": scan, "probe": probe, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
