#!/usr/bin/env bash
# The sweep benchmark of issue 8, in one command (results and method: BENCHMARKS.md).
#
#   bash tests/bench/run.sh                         # everything: 10k, 100k, 1M threads + probe cost
#   bash tests/bench/run.sh --sizes 10000 --runs 3  # a quick look
#   bash tests/bench/run.sh --drop                  # stop the benchmark's PostgreSQL, delete its data
#   bash tests/bench/run.sh --sizes 1000000 --parked-pct 1 --no-probe   # issue 20's 1%-parked row
#   bash tests/bench/run.sh --sizes 100000 --build-only   # only the databases (tests/bench/pod.sh)
#
# Options:
#   --sizes N,N,...   default 10000,100000,1000000
#   --runs R          rounds of the fast sweepers (a, c, d), default 5; --runs-big R at 1M, default 3
#   --slow-runs R     rounds of the LangGraph API sweepers (b) below 100k, default 3 (1 at 100k)
#   --slow-max N      largest N for the b_ids sweeper, default 100000 (at 1M one run takes ~8 min);
#                     b_api stops at 100000 whatever: list(None) holds every checkpoint in memory
#                     (3.7 GB at 100k, tens of GB at 1M)
#   --parked-pct P    build lg_<N>_p<P> instead: P% of the threads parked, the rest finished
#                     (multiply.sql), and time the sweepers twice, without and then with the
#                     optional partial indexes (PARKED_INDEXES in src/checkpoint/postgres.rs):
#                     their build time and size, EXPLAIN (ANALYZE, BUFFERS) of both custody
#                     statements, LangGraph's write cost without and with them (write_cost.py);
#                     only a, c and d (custody's statement) are timed, and no shards
#   --build-only      steps 2-4 only: start PostgreSQL, build the databases that are missing,
#                     stop; no benchmark binary, no timings, no probe-cost run
#   --bin PATH        time this benchmark binary (e.g. `cargo build --release --bench scan`'s)
#                     instead of building one with `cargo bench --no-run`
#   --no-probe, --probe-only, --out DIR
#
# What it does, reusing whatever a previous run left in $CUSTODY_BENCH_DIR (default
# target/bench; about 15 GB with the 1M database):
#  1. builds the benchmark binary (`cargo bench --bench scan --no-run`, release profile);
#  2. starts a private PostgreSQL 15 (tests/harness/pg.sh) with shared_buffers=1GB and jit=off
#     (as in the perf baseline, so figures compare; see BENCHMARKS.md) and max_wal_size=1GB;
#  3. writes the template threads with real LangGraph and a real basket MCP server
#     (templates.py), multiplies them into a 20-thread database and checks the copies with
#     LangGraph's own API, resuming three of them to the end (verify.py);
#  4. builds lg_<N> for each size (multiply.sql, then VACUUM ANALYZE);
#  5. saves EXPLAIN (ANALYZE, BUFFERS) of custody's statement (`scan sql`) and of c's two queries;
#  6. times (a) custody, (b) LangGraph's API, (c) careful Python, (d) psql \copy to /dev/null,
#     interleaved, median of several runs, digests compared (driver.py scan);
#  7. probe cost: M threads holding D distinct handles across K basket servers (driver.py probe).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
sizes=10000,100000,1000000
runs=5
runs_big=3
slow_runs=3
slow_max=100000
probe=1
scan=1
drop=0
build_only=0
bin=""
bench_dir="${CUSTODY_BENCH_DIR:-$repo/target/bench}"
out=""
parked_pct=""
# Probe-cost shape: M threads, D distinct handles, K servers.
probe_m="${BENCH_PROBE_M:-20000}"
probe_d="${BENCH_PROBE_D:-2000}"
probe_k="${BENCH_PROBE_K:-4}"

while [[ $# -gt 0 ]]; do
    case "$1" in
        --sizes) sizes="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        --runs-big) runs_big="$2"; shift 2 ;;
        --slow-runs) slow_runs="$2"; shift 2 ;;
        --slow-max) slow_max="$2"; shift 2 ;;
        --no-probe) probe=0; shift ;;
        --probe-only) scan=0; shift ;;
        --out) out="$2"; shift 2 ;;
        --parked-pct) parked_pct="$2"; shift 2 ;;
        --drop) drop=1; shift ;;
        --build-only) build_only=1; probe=0; shift ;;
        --bin) bin="$2"; shift 2 ;;
        *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

log() { echo "run.sh: $*" >&2; }

if [[ $drop -eq 1 ]]; then
    "$repo/tests/harness/pg.sh" stop "$bench_dir/pg" || true
    rm -rf "$bench_dir/pg"
    log "removed $bench_dir/pg"
    exit 0
fi

out="${out:-$bench_dir/results-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1

# 1. the benchmark binary
if [[ $build_only -eq 0 && -z "$bin" ]]; then
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
    log "building the benchmark binary (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
    bin="$(cd "$repo" && cargo bench --bench scan --no-run --message-format=json 2>"$out/build.log" \
        | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "scan" and m.get("executable"):
        print(m["executable"])')"
    [[ -x "$bin" ]] || { tail -20 "$out/build.log"; log "no benchmark binary"; exit 1; }
fi
[[ -z "$bin" ]] || log "binary: $bin"
log "custody at $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD -- src || echo ' + uncommitted src changes'); src/checkpoint/postgres.rs sha256 $(sha256sum "$repo/src/checkpoint/postgres.rs" | cut -c1-12)"
log "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB RAM; load average $(cut -d' ' -f1-3 /proc/loadavg)"

venv="$(CUSTODY_CACHE="${CUSTODY_CACHE:-$HOME/.cache/custody}" "$repo/tests/harness/venv.sh")"
py="$venv/bin/python"

# 2. PostgreSQL
servers=()
cleanup() {
    local pid
    for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null || true; done
    "$repo/tests/harness/pg.sh" stop "$bench_dir/pg" >/dev/null 2>&1 || true
}
trap cleanup EXIT
url="$("$repo/tests/harness/pg.sh" start "$bench_dir/pg")"
base="${url%/postgres}"
if [[ "$(psql -X -Atq "$url" -c 'SHOW shared_buffers')" != "1GB" ]]; then
    log "configuring shared_buffers=1GB jit=off max_wal_size=1GB, restarting"
    psql -X -q "$url" -c "ALTER SYSTEM SET shared_buffers = '1GB'" -c "ALTER SYSTEM SET jit = off" \
        -c "ALTER SYSTEM SET max_wal_size = '1GB'" -c "ALTER SYSTEM SET checkpoint_timeout = '30min'"
    "$repo/tests/harness/pg.sh" stop "$bench_dir/pg"
    url="$("$repo/tests/harness/pg.sh" start "$bench_dir/pg")"
    base="${url%/postgres}"
fi
psql -X -Atq "$url" -c "SELECT 'settings: ' || string_agg(name || '=' || current_setting(name), ' ' ORDER BY name) FROM pg_settings WHERE name IN ('shared_buffers', 'jit', 'max_wal_size', 'work_mem', 'fsync', 'max_parallel_workers_per_gather', 'random_page_cost', 'effective_cache_size')"
psql -X -Atq "$url" -c "SELECT version()"

db_exists() { [[ "$(psql -X -Atq "$url" -c "SELECT count(*) FROM pg_database WHERE datname = '$1'")" == 1 ]]; }
db_complete() { [[ "$(psql -X -Atq "$url" -c "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = '$1'")" == "bench complete" ]]; }

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
start_basket() {  # sets basket_url; appends the pid to servers
    local port
    port="$(free_port)"
    BASKET_PORT="$port" BASKET_TTL_SECONDS=86400 "$py" "$repo/tests/py/basket_server.py" \
        >>"$out/basket_$port.log" 2>&1 &
    servers+=("$!")
    local i
    for i in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            basket_url="http://127.0.0.1:$port/mcp"
            return 0
        fi
        sleep 0.1
    done
    log "basket server on $port did not start"; exit 1
}

multiply() {  # multiply N DB [PARKED_PCT]
    psql -X -q "$url" -c "DROP DATABASE IF EXISTS $2" -c "CREATE DATABASE $2 TEMPLATE lg_tpl"
    local t0=$SECONDS
    psql -X -q -v ON_ERROR_STOP=1 -v n="$1" ${3:+-v parked_pct="$3"} -d "$base/$2" -f "$here/multiply.sql"
    psql -X -q "$base/$2" -c "VACUUM (ANALYZE)" -c "COMMENT ON DATABASE $2 IS 'bench complete'"
    log "$2: $1 threads built in $((SECONDS - t0)) s"
}

# 3. templates, checked with LangGraph
# A template database from before tpl-fin lacks what --parked-pct copies.
if db_complete lg_tpl && [[ "$(psql -X -Atq "$base/lg_tpl" -c "SELECT count(*) > 0 FROM checkpoints WHERE thread_id = 'tpl-fin'")" != t ]]; then
    psql -X -q "$url" -c "COMMENT ON DATABASE lg_tpl IS NULL"
fi
if ! db_complete lg_tpl; then
    psql -X -q "$url" -c "DROP DATABASE IF EXISTS lg_tpl" -c "CREATE DATABASE lg_tpl"
    start_basket
    log "writing templates with LangGraph against $basket_url"
    "$py" "$here/templates.py" --postgres "$base/lg_tpl" --server "$basket_url" | tee "$out/templates.json"
    psql -X -q "$url" -c "COMMENT ON DATABASE lg_tpl IS 'bench complete'"
    multiply 20 lg_verify
    "$py" "$here/verify.py" --postgres "$base/lg_verify" --n 20 | tee "$out/verify.log"
    psql -X -q "$url" -c "DROP DATABASE lg_verify"
fi

# The optional partial indexes (PARKED_INDEXES in src/checkpoint/postgres.rs; README).
drop_indexes() {  # drop_indexes DB_URL
    psql -X -q "$1" -c "DROP INDEX IF EXISTS custody_interrupts" -c "DROP INDEX IF EXISTS custody_updates"
}
create_indexes() {  # create_indexes DB_URL N: the build time and size of each
    local stmt t0
    while IFS= read -r stmt; do
        t0=$(date +%s.%N)
        psql -X -q -v ON_ERROR_STOP=1 "$1" -c "$stmt"
        log "lg_$2$suffix: $(python3 -c 'import sys,time; print(f"{time.time() - float(sys.argv[1]):.1f}")' "$t0") s: $stmt"
    done < <("$bin" sql-indexes)
    psql -X -Atq -F $'\t' "$1" -c "
        SELECT $2, c.relname, c.reltuples::bigint, pg_relation_size(c.oid), pg_size_pretty(pg_relation_size(c.oid))
        FROM pg_class c WHERE c.relname IN ('custody_interrupts', 'custody_updates')" | tee -a "$out/index_sizes.tsv"
}

# 5. plans (warm: run each once first) and 6. the timings, into $out/PHASE; PLAN is custody's
# statement (full or indexed: `scan sql --plan`).
plans_and_timings() {  # plans_and_timings PHASE PLAN
    local dir="$out${1:+/$1}" n q name file same_rule=()
    [[ -n "$parked_pct" ]] || same_rule=(careful_same_rule:"$here/sql/careful_same_rule.sql")
    mkdir -p "$dir"
    python3 - "$here" "$bin" "$dir" "$2" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import driver
driver.custody_sql(sys.argv[2], Path(sys.argv[3]), plan=sys.argv[4])
EOF
    for n in "${size_list[@]}"; do
        (( n >= 100000 )) || [[ -n "$parked_pct" ]] || continue
        for q in custody:"$dir/custody.sql" careful:"$here/sql/careful.sql" "${same_rule[@]}"; do
            name="${q%%:*}"; file="${q#*:}"
            psql -X -q "$base/lg_$n$suffix" -c "\\copy ($(grep -v '^ *--' "$file" | tr '\n' ' ')) to '/dev/null'"
            { echo "-- load average: $(cut -d' ' -f1-3 /proc/loadavg)"; psql -X "$base/lg_$n$suffix" -c "EXPLAIN (ANALYZE, BUFFERS) $(cat "$file")"; } \
                >"$dir/explain_${name}_$n.txt"
            log "${1:+$1: }plan $name at $n: $(grep 'Execution Time' "$dir/explain_${name}_$n.txt")"
        done
    done
    log "${1:+$1: }timing sizes $sizes, $runs runs ($slow_runs for the LangGraph API sweepers)"
    "$py" "$here/driver.py" scan --out "$dir" --bin "$bin" --python "$py" --url "$base" \
        --sizes "$sizes" --runs "$runs" --runs-big "$runs_big" --slow-runs "$slow_runs" --slow-max "$slow_max" \
        ${parked_pct:+--db-suffix "$suffix" --plan "$2" --shards "" --only a_custody,c_careful,d_best}
}

# 4. the databases
IFS=, read -r -a size_list <<<"$sizes"
suffix="${parked_pct:+_p$parked_pct}"
if [[ $scan -eq 1 ]]; then
    for n in "${size_list[@]}"; do
        db_complete "lg_$n$suffix" && continue
        need_kb=$((n * 16))  # about 13 KB per thread measured, plus headroom
        avail_kb="$(df -Pk "$bench_dir" | awk 'NR == 2 {print $4}')"
        if (( avail_kb < need_kb + 4 * 1024 * 1024 )); then
            log "not enough disk for lg_$n$suffix: need about $((need_kb / 1024 / 1024)) GB + 4 GB, have $((avail_kb / 1024 / 1024)) GB"
            exit 1
        fi
        multiply "$n" "lg_$n$suffix" "$parked_pct"
    done
    for n in "${size_list[@]}"; do
        psql -X -Atq -F $'\t' "$base/lg_$n$suffix" -c "
            SELECT $n, relname, reltuples::bigint, pg_total_relation_size(oid), pg_size_pretty(pg_total_relation_size(oid))
            FROM pg_class WHERE relname IN ('checkpoints', 'checkpoint_blobs', 'checkpoint_writes')
            UNION ALL SELECT $n, 'database', NULL, pg_database_size(current_database()), pg_size_pretty(pg_database_size(current_database()))"
    done | tee "$out/sizes.tsv"

    if [[ $build_only -eq 1 ]]; then
        log "databases built (--build-only)"
    elif [[ -z "$parked_pct" ]]; then
        plans_and_timings "" full
    else
        # The same sweepers without, then with, the optional indexes custody detects.
        for n in "${size_list[@]}"; do drop_indexes "$base/lg_$n$suffix"; done
        plans_and_timings noindex full
        for n in "${size_list[@]}"; do
            db="$base/lg_$n$suffix"
            "$py" "$here/write_cost.py" --postgres "$db" --threads 300 --label without >>"$out/write_cost.jsonl"
            create_indexes "$db" "$n"
            "$py" "$here/write_cost.py" --postgres "$db" --threads 300 --label with >>"$out/write_cost.jsonl"
            psql -X -q "$db" -c "VACUUM (ANALYZE)"
        done
        cat "$out/write_cost.jsonl"
        plans_and_timings index indexed
    fi
fi

# 7. probe cost
if [[ $probe -eq 1 ]]; then
    psql -X -q "$url" -c "DROP DATABASE IF EXISTS lg_probe"
    multiply "$probe_m" lg_probe
    urls=()
    for _ in $(seq 1 "$probe_k"); do start_basket; urls+=("$basket_url"); done
    rm -rf "$out/probe-resources"
    expect="$("$py" "$here/probe_setup.py" --postgres "$base/lg_probe" --m "$probe_m" --distinct "$probe_d" \
        --servers "$(IFS=,; echo "${urls[*]}")" --resources "$out/probe-resources" | tee "$out/probe_setup.json")"
    expect_probes="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["expect_probes"])' "$expect")"
    log "probe cost: $probe_m threads, $probe_d handles over $probe_k servers; expecting $expect_probes probes"
    "$bin" scan --dsn "$base/lg_probe" >"$out/probe_scan_only.json"
    "$py" "$here/driver.py" probe --out "$out" --bin "$bin" --resources "$out/probe-resources" \
        --server-pids "$(IFS=,; echo "${servers[*]: -$probe_k}")" --expect-probes "$expect_probes" --runs 3
fi
log "results in $out"
