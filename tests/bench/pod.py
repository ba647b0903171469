"""The sweep as a Pod against the same sweep run locally (issue 20, item 3), driven by pod.sh.

    python3 pod.py run --out DIR --kubeconfig FILE --ns NS --cgroot NAME --node-pid PID \
        --musl BIN --glibc BIN --runs R

Each round runs five variants, in an order rotated by one each round so that none always runs
first or last on the shared machine:

  pod          `kubectl create job --from=cronjob/pod-sweep`: the Job the controller rendered
               for CheckpointStore `pod` (the image, its args `sweep --store NS/pod`, its
               securityContext and memory limit), run by the kubelet of tests/cluster/node.sh
  musl_node    the image's own /custody, run by this script in the node's network namespace
               against the same store: the same relays to PostgreSQL and the API server as the
               Pod, no container
  glibc_node   the same with the glibc release build of the same commit
  musl_host    the image's /custody in the host's namespaces against CheckpointStore `direct`
               (the same database on 127.0.0.1, no relay)
  glibc_host   the same with the glibc build

Figures of every run (raw.jsonl) and their medians (summary.json, summary.md):

  sweep_ms     the sweep's own wall time (`durationMs`, the `; N ms` of its report's last line)
  process_s    the custody process from start to exit. Local: from fork to wait. Pod: from the
               process's start time (/proc/PID/stat, 10 ms ticks) to the first poll (every
               20 ms) that no longer finds it
  job_s        (pod only) from `kubectl create job` to the Job's Complete condition, polled
               every 100 ms: scheduling, sandbox, container start and the sweep
  cpu_s        user + system CPU of the process (local: rusage; pod: the container's
               cpuacct.usage)
  peak_mib     memory.max_usage_in_bytes of the process's memory cgroup (cgroup v1: this host
               has no cgroup v2 memory controller, so no memory.peak): the container's cgroup
               for the Pod, one made here for each local run. Page cache the process itself
               brings in counts; the binary's pages are read beforehand (local) or were
               imported by containerd (Pod), so neither is charged with them
  rss_mib      the largest total_rss of that cgroup's memory.stat seen by the 20 ms polls
               (anonymous memory only)
  hwm_mib      the custody process's peak resident set (VmHWM of /proc/PID/status, which
               includes the binary's mapped pages), the last value the 20 ms polls saw. Not
               ru_maxrss: a child that Python starts inherits the parent's high-water mark
  cpu_shares   (pod only) the container's cpu.shares: its 50m CPU request. Each local run gets a
               cpu cgroup of its own (1024 shares, at the top like the node's cgroup), so that it
               is not scheduled in this script's session autogroup while the Pod is not
  load         /proc/loadavg (1, 5, 15 min) just before the run
"""

import argparse
import base64
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

MEM = Path("/sys/fs/cgroup/memory")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CPU = Path("/sys/fs/cgroup/cpu")
HZ = os.sysconf("SC_CLK_TCK")
POLL = 0.02
VARIANTS = ["pod", "musl_node", "glibc_node", "musl_host", "glibc_host"]
SUMMARY_LINE = re.compile(r"^(\d+ parked threads, .*); (\d+) ms$")


def log(msg: str) -> None:
    print(f"pod.py: {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


class Api:
    """The test API server, as the admin kubeconfig of tests/cluster/up.sh names it (a static
    bearer token and the cluster CA; the token never leaves this object)."""

    def __init__(self, kubeconfig: str):
        text = Path(kubeconfig).read_text()
        self.server = re.search(r"server: (\S+)", text).group(1)
        self._token = re.search(r"token: (\S+)", text).group(1)
        ca = re.search(r"certificate-authority-data: (\S+)", text).group(1)
        self.ctx = ssl.create_default_context(cadata=base64.b64decode(ca).decode())

    def get(self, path: str, raw: bool = False):
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(req, context=self.ctx, timeout=10) as r:
            body = r.read()
        return body.decode() if raw else json.loads(body)


def read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def total_rss(cg: Path) -> int | None:
    try:
        for line in (cg / "memory.stat").read_text().splitlines():
            k, v = line.split()
            if k == "total_rss":
                return int(v)
    except (OSError, ValueError):
        return None
    return None


def hwm(cg: Path) -> int:
    """The largest VmHWM (peak resident set, bytes) of the custody processes in cgroup CG."""
    best = 0
    try:
        pids = (cg / "cgroup.procs").read_text().split()
    except OSError:
        return 0
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "custody":
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]) * 1024)
        except OSError:
            continue
    return best


def parse_report(text: str) -> tuple[str, int]:
    """The report's last line: (its counts, the sweep's own milliseconds)."""
    for line in reversed(text.splitlines()):
        m = SUMMARY_LINE.match(line.strip())
        if m:
            return m.group(1), int(m.group(2))
    raise RuntimeError(f"no summary line in the sweep's output: {text[-500:]!r}")


def run_local(args, variant: str, rnd: int, out: Path) -> dict:
    binary = args.musl if variant.startswith("musl") else args.glibc
    store = "pod" if variant.endswith("_node") else "direct"
    # The binary's pages in the page cache before the cgroup exists, so they are not charged to it.
    subprocess.run(["cat", binary], stdout=subprocess.DEVNULL, check=True)
    cg = MEM / f"custody-podbench-{os.getpid()}" / f"{variant}-{rnd}"
    cg.mkdir(parents=True)
    # A cpu cgroup of its own as well, as the Pod's container is in the node's: without one the
    # process is scheduled in the autogroup of this script's session (sched_autogroup), which
    # it would share with whatever else that session runs, and the Pod, in its cgroup, not.
    cpu_cg = CPU / cg.relative_to(MEM)
    cpu_cg.mkdir(parents=True)
    cmd = [binary, "sweep", "--store", f"{args.ns}/{store}"]
    if variant.endswith("_node"):
        cmd = ["nsenter", "-t", str(args.node_pid), "-n", "--"] + cmd
    stdout = out / f"{variant}-{rnd}.out"
    stderr = out / f"{variant}-{rnd}.err"
    env = {"PATH": os.environ["PATH"], "KUBECONFIG": args.kubeconfig, "HOME": os.environ.get("HOME", "/")}
    load = loadavg()
    with open(stdout, "wb") as o, open(stderr, "w") as e:
        t0 = time.monotonic()
        # The shell puts itself into the cgroup, then becomes custody (or nsenter, which execs it).
        # Its output goes through a pipe that this process writes to the file, as the Pod's goes
        # to containerd's shim: the page cache of the written report is charged to neither.
        p = subprocess.Popen(["sh", "-c", 'echo $$ > "$0/cgroup.procs" && echo $$ > "$1/cgroup.procs" && shift && exec "$@"',
                              str(cg), str(cpu_cg)] + cmd,
                             stdout=subprocess.PIPE, stderr=e, env=env)
        drain = threading.Thread(target=shutil.copyfileobj, args=(p.stdout, o))
        drain.start()
        rss = high = 0
        while True:
            # wait4, not Popen.poll: the CPU of this one child
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            rss = max(rss, total_rss(cg) or 0)
            high = max(high, hwm(cg))
            time.sleep(POLL)
        wall = time.monotonic() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        drain.join()
        p.stdout.close()
    peak = read_int(cg / "memory.max_usage_in_bytes")
    rss = max(rss, total_rss(cg) or 0)
    cg.rmdir()
    cpu_cg.rmdir()
    if p.returncode != 0:
        raise RuntimeError(f"{variant} round {rnd} exited {p.returncode}: {stderr.read_text()[-800:]}")
    counts, ms = parse_report(stdout.read_text())
    return {"variant": variant, "round": rnd, "sweep_ms": ms, "process_s": round(wall, 3),
            "peak_mib": round(peak / 2**20, 1), "rss_mib": round(rss / 2**20, 1),
            "hwm_mib": round(high / 2**20, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
            "counts": counts, "load": load}


def pod_dirs(cgroot: str) -> set[Path]:
    return set((MEM / cgroot / "kubepods").glob("*/pod*")) | set((MEM / cgroot / "kubepods").glob("pod*"))


def boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def proc_start(pid: int) -> float | None:
    """When PID started, in seconds on the CLOCK_BOOTTIME clock (/proc/PID/stat's start time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19]) / HZ


def is_custody(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "custody"
    except OSError:
        return False


def run_pod(args, api: Api, rnd: int, out: Path) -> dict:
    job = f"pod-sweep-r{rnd}"
    known = pod_dirs(args.cgroot)
    load = loadavg()
    t0 = time.monotonic()
    subprocess.run([args.kubectl, "--kubeconfig", args.kubeconfig, "create", "job", "-n", args.ns,
                    "--from=cronjob/pod-sweep", job], check=True, capture_output=True)
    pod_cg = None
    container = None  # (cgroup path, pid, start on the monotonic clock)
    shares = None
    rss = peak = cpu = high = 0
    ended = None
    done = None
    last_api = 0.0
    while done is None:
        now = time.monotonic()
        if pod_cg is None:
            new = pod_dirs(args.cgroot) - known
            if new:
                pod_cg = new.pop()
        if pod_cg is not None and container is None:
            for c in pod_cg.iterdir():
                if not c.is_dir():
                    continue
                for pid in (c / "cgroup.procs").read_text().split() if (c / "cgroup.procs").exists() else []:
                    if is_custody(int(pid)):
                        container = (c, int(pid), proc_start(int(pid)))
                        shares = read_int(Path("/sys/fs/cgroup/cpu") / c.relative_to(MEM) / "cpu.shares")
        if container is not None and ended is None:
            c, pid, _ = container
            rss = max(rss, total_rss(c) or 0)
            high = max(high, hwm(c))
            peak = max(peak, read_int(c / "memory.max_usage_in_bytes") or 0)
            rel = c.relative_to(MEM)
            cpu = max(cpu, read_int(CPUACCT / rel / "cpuacct.usage") or 0)
            if not Path(f"/proc/{pid}").exists() or not is_custody(pid):
                ended = boottime()
        if now - last_api >= 0.1:
            last_api = now
            j = api.get(f"/apis/batch/v1/namespaces/{args.ns}/jobs/{job}")
            for cond in j.get("status", {}).get("conditions", []):
                if cond["type"] in ("Complete", "Failed") and cond["status"] == "True":
                    done = (cond["type"], now)
        if now - t0 > args.timeout:
            raise RuntimeError(f"{job}: not finished after {args.timeout} s")
        time.sleep(POLL)
    if done[0] != "Complete":
        raise RuntimeError(f"{job} failed: {json.dumps(j.get('status'))}")
    if container is None:
        raise RuntimeError(f"{job}: the sweep container's process was never seen in {pod_cg}")
    pods = api.get(f"/api/v1/namespaces/{args.ns}/pods?labelSelector=batch.kubernetes.io/job-name={job}")["items"]
    pod = pods[0]
    logs = api.get(f"/api/v1/namespaces/{args.ns}/pods/{pod['metadata']['name']}/log", raw=True)
    (out / f"pod-{rnd}.out").write_text(logs)
    (out / f"pod-{rnd}.json").write_text(json.dumps(pod, indent=1))
    counts, ms = parse_report(logs)
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    store = api.get(f"/apis/custody.dev/v1alpha1/namespaces/{args.ns}/checkpointstores/pod")
    return {"variant": "pod", "round": rnd, "sweep_ms": ms,
            "status_duration_ms": store["status"]["lastSweep"]["durationMs"],
            "process_s": round(ended - container[2], 3), "job_s": round(done[1] - t0, 3),
            "cpu_s": round(cpu / 1e9, 2), "peak_mib": round(peak / 2**20, 1), "rss_mib": round(rss / 2**20, 1),
            "hwm_mib": round(high / 2**20, 1), "cpu_shares": shares,
            "pod_started_finished": [term["startedAt"], term["finishedAt"]],
            "cgroup": str(container[0].relative_to(MEM)), "counts": counts, "load": load}


def median_range(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):g} ({min(xs):g}-{max(xs):g})"


def summarize(rows: list[dict], out: Path) -> None:
    by = {v: [r for r in rows if r["variant"] == v] for v in VARIANTS if any(r["variant"] == v for r in rows)}
    counts = {r["counts"] for r in rows}
    summary = {}
    for v, rs in by.items():
        summary[v] = {k: statistics.median([r[k] for r in rs if r.get(k) is not None])
                      for k in ("sweep_ms", "process_s", "job_s", "cpu_s", "peak_mib", "rss_mib", "hwm_mib")
                      if any(r.get(k) is not None for r in rs)}
        summary[v]["runs"] = len(rs)
    summary["same_counts"] = len(counts) == 1
    summary["counts"] = sorted(counts)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = ["| variant | runs | sweep ms (own) | process s | Job created → Complete s | CPU s | "
             "cgroup peak MiB | total_rss MiB | VmHWM MiB | load (1 min) |",
             "|---|---:|---|---|---|---|---|---|---|---|"]
    for v, rs in by.items():
        col = lambda k: median_range([r.get(k) for r in rs])  # noqa: E731
        loads = [r["load"][0] for r in rs]
        lines.append(f"| {v} | {len(rs)} | {col('sweep_ms')} | {col('process_s')} | {col('job_s')} | "
                     f"{col('cpu_s')} | {col('peak_mib')} | {col('rss_mib')} | {col('hwm_mib')} | "
                     f"{min(loads):g}-{max(loads):g} |")
    lines.append("")
    lines.append(f"every run reported the same counts: {summary['same_counts']} ({'; '.join(sorted(counts))})")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--kubeconfig", required=True)
    r.add_argument("--kubectl", required=True)
    r.add_argument("--ns", required=True)
    r.add_argument("--cgroot", required=True)
    r.add_argument("--node-pid", type=int, required=True)
    r.add_argument("--musl", required=True)
    r.add_argument("--glibc", help="needed by the glibc_* variants")
    r.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset, default all")
    r.add_argument("--runs", type=int, default=5)
    r.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    api = Api(args.kubeconfig)
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if not variants or any(v.startswith("glibc") for v in variants) and not args.glibc:
        ap.error("--variants names none of " + ",".join(VARIANTS) + ", or a glibc variant without --glibc")
    rows = []
    with open(out / "raw.jsonl", "a") as raw:
        for rnd in range(1, args.runs + 1):
            k = (rnd - 1) % len(variants)
            for v in variants[k:] + variants[:k]:
                res = run_pod(args, api, rnd, out) if v == "pod" else run_local(args, v, rnd, out)
                log(json.dumps(res))
                raw.write(json.dumps(res) + "\n")
                raw.flush()
                rows.append(res)
    for h in (MEM, CPU):
        (h / f"custody-podbench-{os.getpid()}").rmdir()
    summarize(rows, out)


if __name__ == "__main__":
    main()
