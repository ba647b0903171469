#!/usr/bin/env bash
# custody's test command (CI runs it through .ci/run, as root, on a fresh machine, CI=true).
#
# 1. the Python venv for the test servers and fixture writers   (tests/harness/venv.sh)
# 2. the npm MCP peer @modelcontextprotocol/server-everything    (${CUSTODY_CACHE}/npm, npm ci)
# 3. a throwaway PostgreSQL 15, stopped on exit                  (tests/harness/pg.sh)
# 3b. a real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) and
#    kubectl + helm + promtool, built once from Go modules (tests/cluster/build.sh, ~27 min on 2 cores, cached), on
#    127.0.0.1, stopped on exit                                  (tests/cluster/up.sh, down.sh)
# 3c. one real node (kube-scheduler, kubelet, containerd, runc, CNI) in namespaces of its own,
#    and custody's image built from this tree and imported into it, stopped on exit with a
#    check that no process, mount or cgroup is left  (tests/cluster/node.sh; deploy/build-image.sh)
#    Missing Debian packages it needs are installed (as root, apt-get).
#    The image is a static musl release build, then buildah (deploy/build-image.sh; the first
#    build takes long on 2 cores, later ones seconds), kept as a docker-archive for tests/image.rs.
# 4. cargo fmt --check, cargo clippy -D warnings, cargo test --all-targets --features failpoints
#    --no-fail-fast (every suite runs; the failures are listed at the end)
# 5. every cargo-fuzz target for 20 s (tests/fuzz.sh: a pinned nightly and cargo-fuzz, installed
#    once into rustup and ${CUSTODY_CACHE})
#
# The tests find their peers through these variables:
#   CUSTODY_TEST_PYTHON        the venv's python (runs tests/py/*.py)
#   CUSTODY_TEST_PG_URL        postgres://postgres@127.0.0.1:PORT/postgres (trust auth; tests
#                              create their own databases in it)
#   CUSTODY_TEST_EVERYTHING    server-everything's dist/index.js; it binds every interface, so run
#                              PORT=N node -r "$CUSTODY_TEST_NODE_LOOPBACK" "$CUSTODY_TEST_EVERYTHING" streamableHttp
#   CUSTODY_TEST_NODE_LOOPBACK tests/harness/loopback.cjs (absolute): makes listen() bind 127.0.0.1
#   CUSTODY_TEST_BASKET_SERVER tests/py/basket_server.py (absolute)
#   CUSTODY_TEST_ORDER_GRAPH   tests/py/order_graph.py (absolute)
#   CUSTODY_TEST_HITL_AGENT    tests/py/hitl_agent.py (absolute): the create_agent HITL agent
#   CUSTODY_TEST_KUBECONFIG    admin kubeconfig of the test control plane
#   CUSTODY_TEST_K8S_BIN       directory with kubectl and helm (and the control plane's binaries)
#   CUSTODY_TEST_PROMTOOL      promtool (same directory; tests/monitoring.rs checks the chart's
#                              alert rules and dashboard queries with it)
#   CUSTODY_TEST_NODE          1: the cluster has a node (tests/pods.rs runs real Pods)
#   CUSTODY_TEST_NODE_SH       tests/cluster/node.sh (absolute): `expose DIR PORT` makes a host
#                              loopback port reachable from Pods
#   CUSTODY_TEST_CLUSTER_DIR   the DIR of tests/cluster/up.sh and node.sh
#   CUSTODY_TEST_IMAGE         custody's image, built in this run and imported into the node
#   CUSTODY_TEST_IMAGE_ARCHIVE that image as a docker-archive tar (ctr -n k8s.io images import)
# Caches live in ${CUSTODY_CACHE:-$HOME/.cache/custody}.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$(pwd)"

export CUSTODY_CACHE="${CUSTODY_CACHE:-$HOME/.cache/custody}"
# A non-interactive shell may lack the login PATH additions for rustup and pyenv; put
# them first so the venv is built by pyenv's Python (3.11.7), not Debian's.
for extra in "$HOME/.pyenv/shims" "$HOME/.cargo/bin"; do
    if [[ -d "$extra" && ":$PATH:" != *":$extra:"* ]]; then
        PATH="$extra:$PATH"
    fi
done
export PATH
if [[ -z "${CUSTODY_PYTHON:-}" ]] && command -v python3.11 >/dev/null 2>&1; then
    export CUSTODY_PYTHON=python3.11
fi

step() { printf '\n==> %s\n' "$*"; }
started=$SECONDS
# Incremental compilation pays off in an edit-compile loop, not in one build of every target:
# it would keep a second copy of custody's objects (2.5 GB here) on CI's disk.
export CARGO_INCREMENTAL=0
# Free space on the build disk, printed at the start and before the fuzz build (the largest
# writer), so a full disk is visible in the log before it fails a step.
disk() { df -h --output=avail,size,target "$root" "$CUSTODY_CACHE" 2>/dev/null | sed 's/^/disk: /' || true; }
mkdir -p "$CUSTODY_CACHE"
disk

step "python venv"
venv="$(tests/harness/venv.sh)"
echo "$venv"

step "npm peers (@modelcontextprotocol/server-everything)"
npm_dir="$CUSTODY_CACHE/npm"
lock_hash="$(cat tests/npm/package.json tests/npm/package-lock.json | sha256sum | cut -c1-16)"
everything="$npm_dir/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
if [[ "$(cat "$npm_dir/.custody-stamp" 2>/dev/null || true)" != "$lock_hash" || ! -f "$everything" ]]; then
    mkdir -p "$npm_dir"
    rm -f "$npm_dir/.custody-stamp"
    cp tests/npm/package.json tests/npm/package-lock.json "$npm_dir/"
    (cd "$npm_dir" && npm ci --no-audit --no-fund --loglevel=error)
    echo "$lock_hash" >"$npm_dir/.custody-stamp"
fi
[[ -f "$everything" ]] || { echo "run.sh: $everything is missing after npm ci" >&2; exit 1; }
echo "$everything"

step "postgresql"
pg_dir="$(mktemp -d -t custody-pg.XXXXXX)"
cluster_dir=""
cleanup() {
    tests/harness/pg.sh stop "$pg_dir" || true
    rm -rf "$pg_dir"
    if [[ -n "$cluster_dir" ]]; then
        # node.sh down fails when a process, mount or cgroup of the node is left behind
        tests/cluster/node.sh down "$cluster_dir" || leftover=1
        tests/cluster/down.sh "$cluster_dir" || true
        rm -rf "$cluster_dir"
    fi
    if ((leftover)); then
        echo "run.sh: the test node left something behind (above)" >&2
        exit 1
    fi
}
leftover=0
trap cleanup EXIT
pg_url="$(tests/harness/pg.sh start "$pg_dir")"
echo "$pg_url"

step "kubernetes control plane (tests/cluster: first build ~27 min on 2 cores, then cached)"
k8s_bin="$(tests/cluster/build.sh)"
cluster_dir="$(mktemp -d -t custody-k8s.XXXXXX)"
kubeconfig="$(tests/cluster/up.sh "$cluster_dir")"
echo "$kubeconfig"

step "test node: kube-scheduler, kubelet, containerd (tests/cluster/node.sh) and custody's image"
node_packages=()
for need in containerd:containerd runc:runc /usr/lib/cni/bridge:containernetworking-plugins \
    socat:socat buildah:buildah musl-gcc:musl-tools; do
    tool=${need%%:*}
    if [[ $tool == /* ]]; then [[ -x $tool ]] && continue; else command -v "$tool" >/dev/null && continue; fi
    node_packages+=("${need#*:}")
done
if ((${#node_packages[@]})); then
    [[ $EUID -eq 0 ]] || { echo "run.sh: the test node needs Debian packages ${node_packages[*]} (apt-get install them as root)" >&2; exit 1; }
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${node_packages[@]}"
fi
node_started=$SECONDS
tests/cluster/node.sh up "$cluster_dir"
echo "node Ready after $((SECONDS - node_started))s"
[[ -f deploy/build-image.sh ]] || { echo "run.sh: deploy/build-image.sh is missing (tests/pods.rs runs its image)" >&2; exit 1; }
image_started=$SECONDS
image_archive="$CUSTODY_CACHE/image/custody.tar"
# The image's static release build keeps its own target dir in the cache: a fresh clone (CI) then
# rebuilds only what changed instead of every dependency for the musl target.
image="$(CARGO_TARGET_DIR="$CUSTODY_CACHE/target-image" bash deploy/build-image.sh --archive "$image_archive")"
tests/cluster/node.sh import "$cluster_dir" "$image_archive"
echo "$image built and imported in $((SECONDS - image_started))s"

export CUSTODY_TEST_NODE=1
export CUSTODY_TEST_NODE_SH="$root/tests/cluster/node.sh"
export CUSTODY_TEST_CLUSTER_DIR="$cluster_dir"
export CUSTODY_TEST_IMAGE="$image"
export CUSTODY_TEST_IMAGE_ARCHIVE="$image_archive"
export CUSTODY_TEST_PYTHON="$venv/bin/python"
export CUSTODY_TEST_PG_URL="$pg_url"
export CUSTODY_TEST_EVERYTHING="$everything"
export CUSTODY_TEST_NODE_LOOPBACK="$root/tests/harness/loopback.cjs"
export CUSTODY_TEST_BASKET_SERVER="$root/tests/py/basket_server.py"
export CUSTODY_TEST_ORDER_GRAPH="$root/tests/py/order_graph.py"
export CUSTODY_TEST_HITL_AGENT="$root/tests/py/hitl_agent.py"
export CUSTODY_TEST_KUBECONFIG="$kubeconfig"
export CUSTODY_TEST_K8S_BIN="$k8s_bin"
export CUSTODY_TEST_PROMTOOL="$k8s_bin/promtool"

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings (without and with the failpoints feature)"
cargo clippy --all-targets -- -D warnings
cargo clippy --all-targets --features failpoints -- -D warnings

# The failpoints feature builds the test binary of custody with its kill -9 stops (tests/actions.rs);
# they stay inert unless a test sets FAILPOINTS. --no-fail-fast: one failing suite must not hide
# the results of the suites after it (cargo still exits non-zero at the end).
step "cargo test --all-targets --features failpoints"
cargo test --all-targets --features failpoints --no-fail-fast

step "fuzzing: every target in fuzz/ for 20 s (tests/fuzz.sh --dev)"
disk
bash tests/fuzz.sh --dev --seconds 20

step "all checks passed in $((SECONDS - started))s"
