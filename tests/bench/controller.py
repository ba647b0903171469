"""The controller at scale (issue 20): one run of `custody controller` (a release build) against
the real kube-apiserver of the tests, real basket MCP servers on loopback and a real PostgreSQL
with LangGraph's tables. Started by tests/bench/controller.sh, which brings the peers up and
passes their addresses; prints one JSON document of figures (BENCHMARKS.md, "Controller at
scale").

Phases, all in one run of one controller process:
  apply    N MCPServers (names spread over a few server processes, credentials from 10
           Secrets), 200 AgentAssignments,
           100 HandleClasses, 50 CheckpointStores; time until every object is Ready
  steady   after a settling minute, a window of --window seconds (default 300: the
           CheckpointStore recheck, whose CronJob apply and Job list a shorter window can miss
           entirely, comes once per store in it): API requests by verb and
           resource (the API server's audit log, the controller's own user only), objects whose
           resourceVersion moved, controller CPU seconds per minute, RSS, reconcile latency
           (custody_reconcile_duration_seconds, the window's increase)
  outage   one server process stops: time until each of its MCPServers says Healthy=False
  secrets  5 000 unrelated Secrets in another namespace: the controller's RSS before and after

Throughout: the 1-minute load average at each phase (the box is shared), and the controller's
lost leader leases (its log's "lost the leader lease" lines) in each phase.

Only the standard library: it runs with the tests' venv python but needs none of its packages
(the LangGraph schema is written by that venv in controller.sh).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import datetime

NS = "bench"
NOISE_NS = "bench-noise"
ASSIGNMENTS = 200
CLASSES = 100
STORES = 50


def log(*a):
    print("controller.py:", *a, file=sys.stderr, flush=True)


def kubectl(*args, stdin=None, check=True):
    r = subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, check=False
    )
    if check and r.returncode != 0:
        raise SystemExit(f"kubectl {' '.join(args)}: {r.stderr}")
    return r.stdout


def apply_list(items, chunk=250):
    """Server-side applies `items` in chunks (kubectl sends one request per object)."""
    for i in range(0, len(items), chunk):
        doc = {"apiVersion": "v1", "kind": "List", "items": items[i : i + chunk]}
        kubectl("apply", "--server-side", "--field-manager=bench", "-f", "-", stdin=json.dumps(doc))


def custody(kind, name, spec):
    return {
        "apiVersion": "custody.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


TOKENS = 10


def objects(n, urls, dsn):
    # Credentials from Secrets, as in deploy/examples (the basket server ignores the header): each
    # health check reads its server's Secret.
    tokens = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"mcp-token-{k}", "namespace": NS},
            "stringData": {"authorization": f"Bearer bench-{k}"},
        }
        for k in range(TOKENS)
    ]
    servers = [
        custody(
            "MCPServer",
            f"s{i:04d}",
            {
                "url": urls[i % len(urls)],
                "timeoutSeconds": 5,
                "headersFrom": [
                    {
                        "name": "Authorization",
                        "secretKeyRef": {"name": f"mcp-token-{i % TOKENS}", "key": "authorization"},
                    }
                ],
            },
        )
        for i in range(n)
    ]
    # Each assignment names two servers (a required one and an optional one), read-only tools.
    assignments = [
        custody(
            "AgentAssignment",
            f"a{i:03d}",
            {
                "agent": f"agent-{i:03d}",
                "servers": [
                    {"serverRef": f"s{i % n:04d}", "toolAllowlist": ["get_basket"]},
                    {
                        "serverRef": f"s{(i + n // 2) % n:04d}",
                        "alias": "second",
                        "toolAllowlist": ["get_basket"],
                    },
                ],
            },
        )
        for i in range(ASSIGNMENTS)
    ]
    classes = [
        custody(
            "HandleClass",
            f"c{i:03d}",
            {
                "serverRef": f"s{i % n:04d}",
                "statePath": "basket",
                "probe": {"tool": "get_basket", "arguments": {"basket_id": "{{handle}}"}},
            },
        )
        for i in range(CLASSES)
    ]
    # A yearly schedule: the CronJob controller starts no Job during the run (no node runs it).
    stores = [
        custody(
            "CheckpointStore",
            f"p{i:02d}",
            {"backend": "postgres", "dsn": dsn, "schedule": "0 0 1 1 *"},
        )
        for i in range(STORES)
    ]
    return tokens, servers, assignments, classes, stores


KINDS = ["MCPServer", "AgentAssignment", "HandleClass", "CheckpointStore"]
PLURAL = {
    "MCPServer": "mcpservers",
    "AgentAssignment": "agentassignments",
    "HandleClass": "handleclasses",
    "CheckpointStore": "checkpointstores",
}


def listed(kind):
    return json.loads(kubectl("get", PLURAL[kind] + ".custody.dev", "-n", NS, "-o", "json"))[
        "items"
    ]


def cond(obj, type_):
    for c in (obj.get("status") or {}).get("conditions", []):
        if c["type"] == type_:
            return c["status"]
    return None


def proc_stat(pid):
    """(cpu seconds, rss MiB, peak rss MiB) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    mem = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                mem[k] = int(v.split()[0]) / 1024
    return cpu, mem["VmRSS"], mem["VmHWM"]


def loadavg():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def histogram(text, name):
    """{kind: {le: cumulative count}} of a histogram family."""
    out = collections.defaultdict(dict)
    for line in text.splitlines():
        if not line.startswith(name + "_bucket{"):
            continue
        labels, value = line.rsplit(" ", 1)
        parts = dict(
            p.split("=", 1) for p in labels[len(name) + 8 : -1].split(",") if "=" in p
        )
        le = parts["le"].strip('"')
        out[parts["kind"].strip('"')][float("inf") if le == "+Inf" else float(le)] = float(value)
    return out


def quantiles(before, after, qs=(0.5, 0.99)):
    """Per kind, the bucket upper bounds holding each quantile of the observations between two
    scrapes (a histogram's resolution: the bound, not an interpolation)."""
    res = {}
    for kind, buckets in after.items():
        diff = {le: c - before.get(kind, {}).get(le, 0.0) for le, c in buckets.items()}
        total = diff.get(float("inf"), 0.0)
        if total <= 0:
            continue
        res[kind] = {"count": int(total)}
        for q in qs:
            for le in sorted(diff):
                if diff[le] >= q * total:
                    res[kind][f"p{int(q * 100)}_le_s"] = le
                    break
    return res


def counters(text, name):
    """{label set: value} of a counter family (the label text as printed)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name) :]] = float(value)
    return out


def lease_losses(path):
    """Lines of the controller's log that say it lost the leader lease."""
    with open(path, errors="replace") as f:
        return sum("lost the leader lease" in line for line in f)


def audit(path, user, since, until):
    """Requests of `user` received in [since, until): {verb resource: count}; watches counted
    once when they start."""
    counts = collections.Counter()
    with open(path) as f:
        for line in f:
            if user not in line:
                continue
            e = json.loads(line)
            if e["user"].get("username") != user:
                continue
            verb = e["verb"]
            stage = e["stage"]
            if verb == "watch" and stage != "ResponseStarted":
                continue
            if verb != "watch" and stage != "ResponseComplete":
                continue
            t = datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00"))
            if not since <= t.timestamp() < until:
                continue
            o = e.get("objectRef") or {}
            res = o.get("resource", e["requestURI"].split("?")[0])
            if o.get("subresource"):
                res += "/" + o["subresource"]
            counts[f"{verb} {res}"] += 1
    return counts


def versions():
    out = {}
    for kind in KINDS:
        for o in listed(kind):
            out[(kind, o["metadata"]["name"])] = o["metadata"]["resourceVersion"]
    for kind in ("configmaps", "cronjobs"):
        for o in json.loads(kubectl("get", kind, "-n", NS, "-o", "json"))["items"]:
            out[(kind, o["metadata"]["name"])] = o["metadata"]["resourceVersion"]
    return out


def event_versions():
    items = json.loads(kubectl("get", "events.events.k8s.io", "-n", NS, "-o", "json"))["items"]
    return {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in items}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--servers", type=int, required=True, help="N MCPServers")
    p.add_argument("--urls", required=True, help="comma-separated basket server URLs")
    p.add_argument("--server-pids", required=True, help="their process ids, in the same order")
    p.add_argument("--dsn", required=True)
    p.add_argument("--controller-pid", type=int, required=True)
    p.add_argument("--metrics-port", type=int, required=True)
    p.add_argument("--audit-log", required=True)
    p.add_argument("--user", required=True, help="the controller's user in the audit log")
    p.add_argument("--controller-log", required=True, help="the controller's log file")
    p.add_argument("--health-interval", type=int, default=60)
    p.add_argument("--window", type=int, default=300)
    p.add_argument("--secrets", type=int, default=5000)
    a = p.parse_args()
    urls = a.urls.split(",")
    pids = [int(x) for x in a.server_pids.split(",")]
    n = a.servers
    out = {"servers": n, "server_processes": len(urls), "health_interval_s": a.health_interval}
    loads = {"start": loadavg()}
    losses = {}

    # --- apply, then wait for Ready ------------------------------------------------------
    tokens, servers, assignments, classes, stores = objects(n, urls, a.dsn)
    apply_list(tokens)
    t0 = time.time()
    apply_list(servers + assignments + classes + stores)
    out["apply_s"] = round(time.time() - t0, 1)
    ready_at = {}
    shown = t0
    while len(ready_at) < len(KINDS):
        counts = {}
        for kind in KINDS:
            if kind in ready_at:
                continue
            items = listed(kind)
            counts[kind] = sum(cond(o, "Ready") == "True" for o in items)
            if items and counts[kind] == len(items):
                ready_at[kind] = round(time.time() - t0, 1)
                log(f"{kind}: all {len(items)} Ready after {ready_at[kind]} s")
        if time.time() - shown > 60:
            shown = time.time()
            log(f"{round(shown - t0)} s: Ready so far {counts}, load {loadavg()}")
        if time.time() - t0 > 1800:
            raise SystemExit(f"not all Ready after 30 min: {ready_at}, not yet: {counts}")
        time.sleep(2)
    out["ready_s"] = ready_at
    out["all_ready_s"] = max(ready_at.values())
    loads["ready"] = loadavg()
    losses["apply"] = lease_losses(a.controller_log)
    _, _, peak = proc_stat(a.controller_pid)
    out["rss_peak_after_ready_mib"] = round(peak, 1)

    # --- steady state ----------------------------------------------------------------------
    # A first health interval after Ready lets the last Events and discoveries land.
    time.sleep(a.health_interval + 5)
    loads["window_start"] = loadavg()
    losses_w0 = lease_losses(a.controller_log)
    rv0, ev0 = versions(), event_versions()
    m0 = scrape(a.metrics_port)
    cpu0, _, _ = proc_stat(a.controller_pid)
    w0 = time.time()
    rss = []
    while time.time() - w0 < a.window:
        time.sleep(5)
        rss.append(proc_stat(a.controller_pid)[1])
    w1 = time.time()
    cpu1, rss1, peak = proc_stat(a.controller_pid)
    m1 = scrape(a.metrics_port)
    rv1, ev1 = versions(), event_versions()
    loads["window_end"] = loadavg()
    losses["window"] = lease_losses(a.controller_log) - losses_w0
    f0 = counters(m0, "custody_reconcile_failures_total")
    f1 = counters(m1, "custody_reconcile_failures_total")
    minutes = (w1 - w0) / 60
    time.sleep(3)  # the audit log is written after the response
    reqs = audit(a.audit_log, a.user, w0, w1)
    writes = {"create", "update", "patch", "delete"}
    out["steady"] = {
        "window_s": round(w1 - w0),
        # For reading the audit log again afterwards (DIR/audit.log of the benchmark cluster).
        "window_unix_s": [round(w0, 1), round(w1, 1)],
        "cpu_s_per_min": round((cpu1 - cpu0) / minutes, 2),
        "rss_mib": round(rss1, 1),
        "rss_max_in_window_mib": round(max(rss), 1),
        "rss_peak_mib": round(peak, 1),
        "requests_per_min": {k: round(v / minutes, 1) for k, v in sorted(reqs.items())},
        "requests_per_min_total": round(sum(reqs.values()) / minutes, 1),
        "writes_per_min": round(
            sum(v for k, v in reqs.items() if k.split()[0] in writes) / minutes, 1
        ),
        "objects": len(rv0),
        "objects_written": sorted(
            f"{k[0]}/{k[1]}" for k in rv1 if rv0.get(k) != rv1[k]
        ),
        "events_new_or_changed": sorted(k for k in ev1 if ev0.get(k) != ev1[k]),
        "reconcile_failures": {k: v - f0.get(k, 0.0) for k, v in f1.items() if v > f0.get(k, 0.0)},
        "reconcile_latency": quantiles(
            histogram(m0, "custody_reconcile_duration_seconds"),
            histogram(m1, "custody_reconcile_duration_seconds"),
        ),
    }
    out["reconcile_latency_since_start"] = quantiles(
        {}, histogram(m1, "custody_reconcile_duration_seconds")
    )
    log("steady:", json.dumps(out["steady"]))

    # --- outage: one server process stops ------------------------------------------------------
    losses_o0 = lease_losses(a.controller_log)
    victim = urls[0]
    names = {o["metadata"]["name"] for o in servers if o["spec"]["url"] == victim}
    os.kill(pids[0], signal.SIGKILL)
    t_down = time.time()
    seen = {}
    while len(seen) < len(names) and time.time() - t_down < 10 * a.health_interval:
        for o in listed("MCPServer"):
            nm = o["metadata"]["name"]
            if nm in names and nm not in seen and cond(o, "Healthy") == "False":
                seen[nm] = time.time() - t_down
        time.sleep(1)
    lat = sorted(seen.values())
    out["outage"] = {
        "servers_down": len(names),
        "reported": len(seen),
        "median_s": round(lat[len(lat) // 2], 1) if lat else None,
        "max_s": round(lat[-1], 1) if lat else None,
        "target_s": a.health_interval + 5,
        "polled_every_s": "1 (plus one list of every MCPServer)",
    }
    loads["outage_end"] = loadavg()
    losses["outage"] = lease_losses(a.controller_log) - losses_o0
    log("outage:", json.dumps(out["outage"]))

    # --- 5 000 unrelated Secrets -----------------------------------------------------------------
    _, rss_before, peak_before = proc_stat(a.controller_pid)
    kubectl("create", "namespace", NOISE_NS, check=False)
    payload = "x" * 1024
    secrets = [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": f"noise-{i:05d}", "namespace": NOISE_NS},
            "stringData": {"blob": payload},
        }
        for i in range(a.secrets)
    ]
    s0 = time.time()
    cpu_s0 = proc_stat(a.controller_pid)[0]
    apply_list(secrets, chunk=500)
    time.sleep(20)
    _, rss_after, peak_after = proc_stat(a.controller_pid)
    cpu_s1 = proc_stat(a.controller_pid)[0]
    loads["secrets_end"] = loadavg()
    out["secrets"] = {
        "count": a.secrets,
        "bytes_each": len(payload),
        "rss_before_mib": round(rss_before, 1),
        "rss_after_mib": round(rss_after, 1),
        "rss_peak_before_mib": round(peak_before, 1),
        "rss_peak_after_mib": round(peak_after, 1),
        "controller_cpu_s_while_created": round(cpu_s1 - cpu_s0, 2),
        "created_in_s": round(time.time() - s0 - 20, 1),
    }
    log("secrets:", json.dumps(out["secrets"]))
    out["loadavg_1m_5m_15m"] = loads
    out["lease_losses"] = losses
    out["lease_losses_total"] = lease_losses(a.controller_log)
    out["rss_peak_mib"] = round(proc_stat(a.controller_pid)[2], 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
