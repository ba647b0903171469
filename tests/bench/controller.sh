#!/usr/bin/env bash
# The controller at scale (issue 20; results and method: BENCHMARKS.md, "Controller at scale").
#
#   bash tests/bench/controller.sh 100          # N = 100 MCPServers
#   bash tests/bench/controller.sh 1000         # N = 1 000
#
# Options (after N): --window S (steady-state window, default 300: one CheckpointStore recheck
# each), --health-interval S (default 60, the controller's default), --lease-seconds S (default
# 15, the controller's default), --concurrency C (reconciles at once per kind; default: the
# controller's own, 16), --secrets M (default 5000), --out FILE (default
# target/bench/controller-N.json).
#
# What runs, every part real and on loopback, all stopped on exit:
#  - a fresh control plane (tests/cluster/up.sh in target/bench/controller-cluster): etcd,
#    kube-apiserver with its audit log, kube-controller-manager;
#  - a PostgreSQL (tests/harness/pg.sh) with LangGraph's checkpoint tables, written by
#    LangGraph's own PostgresSaver.setup() in the tests' venv, for the 50 CheckpointStores;
#  - N/100 basket MCP servers (tests/py/basket_server.py, at least 2), each serving N/K of the
#    MCPServer names;
#  - `custody controller` from a release build (cargo build --release), out of cluster, as a
#    ServiceAccount bound to cluster-admin (so its requests are its own user in the audit log);
#  - tests/bench/controller.py, which applies the objects and measures (see its docstring).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
cd "$repo"
[[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]] || { echo "usage: $0 N [--window S] [--health-interval S] [--lease-seconds S] [--concurrency C] [--secrets M] [--out FILE]" >&2; exit 2; }
n=$1
shift
window=300
interval=60
lease=15
secrets=5000
concurrency=()
out=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --window) window=$2; shift 2 ;;
    --health-interval) interval=$2; shift 2 ;;
    --lease-seconds) lease=$2; shift 2 ;;
    --concurrency) concurrency=(--concurrency "$2"); shift 2 ;;
    --secrets) secrets=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
work="${CUSTODY_BENCH_DIR:-$repo/target/bench}"
mkdir -p "$work"
out="${out:-$work/controller-$n.json}"
# The controller's log beside its figures (controller-N.log by default).
controller_log="${out%.json}.log"
cluster_dir="$work/controller-cluster"
pg_dir="$work/controller-pg"
log() { printf 'controller.sh: %s\n' "$*" >&2; }

export CARGO_INCREMENTAL=0
# CUSTODY_BENCH_BIN: another custody binary (a quick check of this script; figures are from the
# release build).
custody="${CUSTODY_BENCH_BIN:-}"
if [[ -z "$custody" ]]; then
  log "building the controller (release)"
  cargo build --release --bin custody >&2
  custody="$repo/target/release/custody"
fi
venv="$(tests/harness/venv.sh)"
python="$venv/bin/python"

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  tests/cluster/down.sh "$cluster_dir" >&2 || true
  tests/harness/pg.sh stop "$pg_dir" >&2 || true
}
trap cleanup EXIT

kubeconfig="$(tests/cluster/up.sh "$cluster_dir")"
# shellcheck disable=SC1091
source "$cluster_dir/cluster.env"
export KUBECONFIG="$kubeconfig"
export PATH="$CUSTODY_K8S_BIN:$PATH"
mkdir -p "$pg_dir"
pg_url="$(tests/harness/pg.sh start "$pg_dir")"
dsn="${pg_url%/postgres}/bench"
"$python" -c 'import sys, psycopg
from langgraph.checkpoint.postgres import PostgresSaver
with psycopg.connect(sys.argv[1], autocommit=True) as c:
    c.execute("DROP DATABASE IF EXISTS bench")
    c.execute("CREATE DATABASE bench")
with PostgresSaver.from_conn_string(sys.argv[2]) as s:
    s.setup()' "$pg_url" "$dsn"

kubectl apply -f crds/crds.yaml >&2
kubectl create namespace bench >&2
# The sweep Jobs' ServiceAccount (the chart's sweep.namespaces makes it): without it every store
# is Scheduled=False SweepServiceAccountMissing and never Ready.
kubectl create serviceaccount custody-sweep -n bench >&2
kubectl create serviceaccount custody-bench -n default >&2
kubectl create clusterrolebinding custody-bench --clusterrole=cluster-admin \
  --serviceaccount=default:custody-bench >&2
token="$(kubectl create token custody-bench -n default --duration=4h)"
controller_kubeconfig="$cluster_dir/controller-kubeconfig"
cp "$kubeconfig" "$controller_kubeconfig"
kubectl --kubeconfig "$controller_kubeconfig" config set-credentials custody-admin --token="$token" >/dev/null

free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
k=$(( n / 100 ))
(( k < 2 )) && k=2
urls=()
server_pids=()
for ((i = 0; i < k; i++)); do
  port=$(free_port)
  BASKET_PORT=$port "$python" tests/py/basket_server.py >"$work/basket-$i.log" 2>&1 &
  pids+=($!)
  server_pids+=($!)
  urls+=("http://127.0.0.1:$port/mcp")
done
for u in "${urls[@]}"; do
  port=${u#http://127.0.0.1:}; port=${port%/mcp}
  for _ in $(seq 120); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.5
  done
done

metrics_port=$(free_port)
KUBECONFIG="$controller_kubeconfig" RUST_LOG=warn "$custody" controller \
  --metrics-addr "127.0.0.1:$metrics_port" --identity bench --lease-namespace default \
  --health-interval-seconds "$interval" --lease-seconds "$lease" ${concurrency[@]+"${concurrency[@]}"} \
  >"$controller_log" 2>&1 &
controller_pid=$!
pids+=("$controller_pid")
for _ in $(seq 120); do
  curl -fsS "http://127.0.0.1:$metrics_port/readyz" >/dev/null 2>&1 && break
  sleep 0.5
done

log "N=$n: $k basket servers, controller pid $controller_pid, lease $lease s ${concurrency[*]:-}; load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$python" "$here/controller.py" --servers "$n" \
  --urls "$(IFS=,; echo "${urls[*]}")" --server-pids "$(IFS=,; echo "${server_pids[*]}")" \
  --dsn "$dsn" --controller-pid "$controller_pid" --metrics-port "$metrics_port" \
  --controller-log "$controller_log" \
  --audit-log "$CUSTODY_AUDIT_LOG" --user system:serviceaccount:default:custody-bench \
  --health-interval "$interval" --window "$window" --secrets "$secrets" | tee "$out"
log "figures in $out"
