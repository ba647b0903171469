#!/usr/bin/env bash
# The quickstart (README's first command): real LangGraph writes SQLite checkpoints for an order
# graph against the example MCP basket server on 127.0.0.1:18931, then custody sweeps them with
# the resources in deploy/examples/local and prints a verdict per parked thread.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export CUSTODY_CACHE="${CUSTODY_CACHE:-$HOME/.cache/custody}"
for extra in "$HOME/.pyenv/shims" "$HOME/.cargo/bin"; do
    if [[ -d "$extra" && ":$PATH:" != *":$extra:"* ]]; then PATH="$extra:$PATH"; fi
done
export PATH
if [[ -z "${CUSTODY_PYTHON:-}" ]] && command -v python3.11 >/dev/null 2>&1; then
    export CUSTODY_PYTHON=python3.11
fi

port=18931
mkdir -p target/quickstart
echo "==> python venv (LangGraph and the MCP SDK, pinned)" >&2
python="$(tests/harness/venv.sh)/bin/python"
# Not --quiet: on a cold machine the build takes minutes, and cargo's progress shows them. The
# binary is the one README's next section ("local mode") runs.
echo "==> cargo build (target/debug/custody)" >&2
cargo build
custody="${CARGO_TARGET_DIR:-target}/debug/custody"

if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "quickstart: port $port is in use; stop whatever listens there and retry" >&2
    exit 1
fi
echo "==> basket MCP server on http://127.0.0.1:$port/mcp" >&2
BASKET_PORT=$port "$python" tests/py/basket_server.py 2>target/quickstart/server.log &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
done
if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "quickstart: the basket server did not start; its log:" >&2
    cat target/quickstart/server.log >&2
    exit 1
fi

echo "==> LangGraph writes threads into target/quickstart/checkpoints.sqlite" >&2
rm -f target/quickstart/checkpoints.sqlite*
"$python" tests/py/order_graph.py write --server "http://127.0.0.1:$port/mcp" \
    --sqlite target/quickstart/checkpoints.sqlite --expire-wait >/dev/null

echo "==> custody sweep --dry-run -f deploy/examples/local" >&2
"$custody" sweep --dry-run -f deploy/examples/local "$@"
