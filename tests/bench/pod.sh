#!/usr/bin/env bash
# The sweep as a Pod (issue 20, item 3; results and method: BENCHMARKS.md, "The sweep as a Pod").
#
#   bash tests/bench/pod.sh                       # 5 rounds against lg_100000
#   bash tests/bench/pod.sh --runs 3 --image-archive ~/.cache/custody/image/custody.tar
#   bash tests/bench/run.sh --drop                # afterwards: stop the benchmark's PostgreSQL
#                                                 # and delete its data
#
# Options:
#   --runs R              rounds, default 5; each round runs every variant once (pod.py)
#   --image-archive PATH  the image as a docker-archive tar (deploy/build-image.sh --archive);
#                         default: build it with deploy/build-image.sh into
#                         $CUSTODY_BENCH_DIR/custody.tar (honours CARGO_TARGET_DIR)
#   --glibc PATH          custody built for the host (glibc, release profile) from the same
#                         commit as the image; default: cargo build --release --locked --bin custody
#   --variants V,V,...    a subset of pod.py's variants (default all five); without a glibc_*
#                         variant no glibc build is made
#   --out DIR             default $CUSTODY_BENCH_DIR/pod-<UTC time>
#
# What it does ($CUSTODY_BENCH_DIR, default target/bench, as tests/bench/run.sh):
#  1. builds lg_100000 if it is missing (tests/bench/run.sh --sizes 100000 --build-only: real
#     LangGraph threads multiplied, 90 000 parked, 80 000 holding a basket handle) and starts
#     the benchmark PostgreSQL (shared_buffers=1GB, jit=off: run.sh's settings);
#  2. starts a fresh control plane and node of the tests (tests/cluster/up.sh, node.sh) in
#     $CUSTODY_BENCH_DIR/cluster, imports the image, exposes PostgreSQL's port to Pods;
#  3. `helm install` of charts/custody (one controller replica, the image with pullPolicy Never,
#     sweep RBAC for namespace `bench`) and, in `bench`: MCPServer `closed` on
#     http://127.0.0.1:9/mcp (a closed port: every probe is refused at once, so the figure is
#     the sweep's own, as run.sh's full sweep), HandleClass `basket` on it, and two
#     CheckpointStores on lg_100000 by Secret: `pod` at the address Pods reach
#     (node.sh expose) and `direct` at 127.0.0.1; both on a schedule that does not fire during
#     the run (1 January), observe mode, minParkedSeconds 0;
#  4. waits for the controller to render CronJob pod-sweep, then runs pod.py: per round the
#     Pod (`kubectl create job --from=cronjob/pod-sweep`, the controller's Job as is) and the
#     same `custody sweep --store` run here with the image's own binary (musl) and the glibc
#     build, in the node's network namespace (the Pod's path to PostgreSQL and the API server)
#     and in the host's, interleaved; medians, memory from the cgroups (pod.py's docstring);
#  5. stops the node and the control plane (node.sh down checks that nothing is left) and
#     PostgreSQL; keeps the databases (run.sh --drop deletes them).
#
# Needs: root (cgroups, namespaces), what tests/cluster/node.sh and deploy/build-image.sh need,
# the venv of tests/harness/venv.sh (run.sh), python3.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
runs=5
archive=""
glibc=""
variants=pod,musl_node,glibc_node,musl_host,glibc_host
out=""
bench_dir="${CUSTODY_BENCH_DIR:-$repo/target/bench}"
ns=bench

while [[ $# -gt 0 ]]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --image-archive) archive="$2"; shift 2 ;;
        --glibc) glibc="$2"; shift 2 ;;
        --variants) variants="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        *) echo "pod.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

log() { echo "pod.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }
[[ "$(id -u)" -eq 0 ]] || die "needs root (cgroups, the node's namespaces)"

out="${out:-$bench_dir/pod-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
exec > >(tee -a "$out/run.log") 2>&1
log "custody at $(git -C "$repo" rev-parse HEAD)"
log "machine: $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB RAM; uptime: $(uptime)"

# 1. the database (run.sh stops its PostgreSQL when it exits; started again below)
CUSTODY_BENCH_DIR="$bench_dir" bash "$here/run.sh" --sizes 100000 --build-only --out "$out/build"

# the binaries: the image's (musl, static) and the host build (glibc)
if [[ -z "$archive" ]]; then
    archive="$bench_dir/custody.tar"
    bash "$repo/deploy/build-image.sh" --archive "$archive" >/dev/null
fi
[[ -f "$archive" ]] || die "$archive: no such file"
archive="$(cd "$(dirname "$archive")" && pwd)/$(basename "$archive")"
glibc_args=()
if [[ ",$variants," == *,glibc_* ]]; then
    if [[ -z "$glibc" ]]; then
        (cd "$repo" && cargo build --release --locked --bin custody) || die "cargo build failed"
        glibc="${CARGO_TARGET_DIR:-$repo/target}/release/custody"
    fi
    [[ -x "$glibc" ]] || die "$glibc: not executable"
    glibc_args=(--glibc "$glibc")
fi
img="$out/image"
mkdir -p "$img"
tar -xf "$archive" -C "$img"
read -r image_ref config layer < <(python3 -c 'import json,sys
m = json.load(open(sys.argv[1]))[0]
print(m["RepoTags"][0], m["Config"], m["Layers"][0])' "$img/manifest.json")
tar -xf "$img/$layer" -C "$img" custody
musl="$img/custody"
revision="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["config"]["Labels"]["org.opencontainers.image.revision"])' "$img/$config")"
log "image $image_ref from $revision; musl $(sha256sum "$musl" | cut -c1-12) ($(du -k "$musl" | cut -f1) KiB)${glibc:+, glibc $glibc $(sha256sum "$glibc" | cut -c1-12) ($(du -k "$glibc" | cut -f1) KiB)}"
[[ "${revision%-dirty}" == "$(git -C "$repo" rev-parse HEAD)" ]] \
    || log "warning: the image was built from $revision, not HEAD: the two builds may differ in source"
file "$musl" ${glibc:+"$glibc"} | sed 's/, BuildID[^,]*//'

# PostgreSQL
cluster="$bench_dir/cluster"
cleanup() {
    "$repo/tests/cluster/node.sh" down "$cluster" || true
    "$repo/tests/cluster/down.sh" "$cluster" || true
    "$repo/tests/harness/pg.sh" stop "$bench_dir/pg" >/dev/null 2>&1 || true
}
trap cleanup EXIT
url="$("$repo/tests/harness/pg.sh" start "$bench_dir/pg")"
port="${url##*:}"; port="${port%%/*}"
psql -X -Atq "$url" -c "SELECT 'settings: ' || string_agg(name || '=' || current_setting(name), ' ' ORDER BY name) FROM pg_settings WHERE name IN ('shared_buffers', 'jit', 'work_mem', 'fsync')"

# 2. control plane and node
k8s_bin="$("$repo/tests/cluster/build.sh")"
mkdir -p "$cluster"
kubeconfig="$("$repo/tests/cluster/up.sh" "$cluster")"
"$repo/tests/cluster/node.sh" up "$cluster" >/dev/null
"$repo/tests/cluster/node.sh" import "$cluster" "$archive"
from_pods="$("$repo/tests/cluster/node.sh" expose "$cluster" "$port")"
read -r node_pid _ <"$cluster/node/init.pid"
kubectl() { "$k8s_bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }

# 3. the chart and the resources
name="${image_ref#docker.io/library/}"
helm_args=(install custody "$repo/charts/custody" -n custody-system --create-namespace --wait --timeout=180s
    --set "image.repository=${name%:*}" --set "image.tag=${name##*:}" --set image.pullPolicy=Never
    --set controller.replicas=1 --set "sweep.namespaces={$ns}")
kubectl create namespace "$ns"
"$k8s_bin/helm" --kubeconfig "$kubeconfig" "${helm_args[@]}" >/dev/null
kubectl apply -n "$ns" -f - <<EOF
apiVersion: v1
kind: Secret
metadata: {name: bench-dsn}
stringData:
  pod: "postgres://postgres@$from_pods/lg_100000"
  direct: "postgres://postgres@127.0.0.1:$port/lg_100000"
---
apiVersion: custody.dev/v1alpha1
kind: MCPServer
metadata: {name: closed}
spec: {url: "http://127.0.0.1:9/mcp", timeoutSeconds: 5}
---
apiVersion: custody.dev/v1alpha1
kind: HandleClass
metadata: {name: basket}
spec:
  serverRef: closed
  statePath: basket
  probe:
    tool: get_basket
    arguments: {basket_id: "{{handle}}"}
---
apiVersion: custody.dev/v1alpha1
kind: CheckpointStore
metadata: {name: pod}
spec: {backend: postgres, dsnFrom: {name: bench-dsn, key: pod}, minParkedSeconds: 0, schedule: "0 0 1 1 *"}
---
apiVersion: custody.dev/v1alpha1
kind: CheckpointStore
metadata: {name: direct}
spec: {backend: postgres, dsnFrom: {name: bench-dsn, key: direct}, minParkedSeconds: 0, schedule: "0 0 1 1 *"}
EOF
for _ in $(seq 120); do
    kubectl get -n "$ns" cronjob/pod-sweep >/dev/null 2>&1 && break
    sleep 1
done
kubectl get -n "$ns" cronjob/pod-sweep -o json >"$out/cronjob.json" || die "the controller rendered no CronJob pod-sweep"
log "the controller's Job template: $(python3 -c 'import json,sys
c = json.load(open(sys.argv[1]))["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
print(c["image"], c["args"], c["resources"])' "$out/cronjob.json")"

# 4. the rounds
log "load before the rounds: $(uptime)"
python3 "$here/pod.py" run --out "$out" --kubeconfig "$kubeconfig" --kubectl "$k8s_bin/kubectl" \
    --ns "$ns" --cgroot "custody-node-$(basename "$cluster")" --node-pid "$node_pid" \
    --musl "$musl" "${glibc_args[@]}" --variants "$variants" --runs "$runs"
log "load after the rounds: $(uptime)"
log "results in $out"
