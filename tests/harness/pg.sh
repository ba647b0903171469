#!/usr/bin/env bash
# A throwaway PostgreSQL 15 for custody's tests.
#
#   tests/harness/pg.sh start DIR   initdb into DIR/data (if new), start on 127.0.0.1 on a free
#                                   port, wait until it accepts connections, then print
#                                   postgres://postgres@127.0.0.1:PORT/postgres on stdout
#   tests/harness/pg.sh stop DIR    stop it (a no-op when it is not running)
#   tests/harness/pg.sh restart DIR stop it (fast: open sessions are terminated) and start it
#                                   again on the same port, printing the same URL (for tests
#                                   of a database that restarts under a running client)
#   tests/harness/pg.sh standby DIR URL
#                                   a streaming replica of the server at URL (a base backup
#                                   with pg_basebackup -R into DIR/data, if new), started and
#                                   printed as start does: a hot standby, which refuses writes
#
# Trust auth, no Unix socket, fsync/synchronous_commit/full_page_writes off: test data only.
# PostgreSQL refuses to run as root, so as root the server runs as the OS user
# ${CUSTODY_PG_USER:-custody-pg} (created when missing) and DIR is chowned to it; as any other
# user it runs as that user. Binaries from ${PG_BIN:-/usr/lib/postgresql/15/bin}.
# The server log is DIR/postgres.log; progress goes to stderr.
set -euo pipefail

PG_BIN="${PG_BIN:-/usr/lib/postgresql/15/bin}"
PG_OS_USER="${CUSTODY_PG_USER:-custody-pg}"

die() { echo "pg.sh: $*" >&2; exit 1; }

usage() { die "usage: pg.sh start DIR | pg.sh stop DIR | pg.sh restart DIR | pg.sh standby DIR URL"; }

[[ $# -eq 2 || ( $# -eq 3 && "$1" == standby ) ]] || usage
command="$1"
[[ -n "$2" ]] || usage
mkdir -p "$2"
dir="$(cd "$2" && pwd)"
data="$dir/data"

# Run a command as the database's OS user.
as_pg() {
    if [[ $EUID -eq 0 ]]; then
        runuser -u "$PG_OS_USER" -- "$@"
    else
        "$@"
    fi
}

ensure_os_user() {
    [[ $EUID -eq 0 ]] || return 0
    if ! id -u "$PG_OS_USER" >/dev/null 2>&1; then
        echo "pg.sh: creating OS user $PG_OS_USER" >&2
        useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
            --user-group "$PG_OS_USER"
    fi
    chown -R "$PG_OS_USER:" "$dir"
    chmod 700 "$dir"
    as_pg test -w "$dir" || die "$PG_OS_USER cannot write $dir (is a parent folder closed to other users?)"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start [PORT]: on PORT (one attempt) or on a free port (up to five).
start() {
    local fixed="${1:-}"
    [[ -x "$PG_BIN/postgres" ]] || die "no PostgreSQL at $PG_BIN (apt-get install postgresql-15)"
    ensure_os_user
    if [[ -f "$data/postmaster.pid" ]] && as_pg "$PG_BIN/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        die "a server is already running in $data (pg.sh stop $dir first)"
    fi
    if [[ ! -f "$data/PG_VERSION" ]]; then
        echo "pg.sh: initdb $data" >&2
        as_pg "$PG_BIN/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --locale=C \
            --no-sync >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
    fi
    local attempt port
    for attempt in 1 2 3 4 5; do
        port="${fixed:-$(free_port)}"
        echo "pg.sh: starting on 127.0.0.1:$port" >&2
        if as_pg "$PG_BIN/pg_ctl" -D "$data" -l "$dir/postgres.log" -w -t 60 -o "\
-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories='' \
-c fsync=off -c synchronous_commit=off -c full_page_writes=off \
-c max_connections=200 -c log_min_messages=warning" start >/dev/null; then
            echo "$port" >"$dir/port"
            # pg_ctl -w watches postmaster.pid; confirm a real TCP connection too.
            local i
            for i in $(seq 1 100); do
                if "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$port" -U postgres; then
                    echo "postgres://postgres@127.0.0.1:$port/postgres"
                    return 0
                fi
                sleep 0.1
            done
            tail -n 20 "$dir/postgres.log" >&2
            die "server started but does not accept connections on 127.0.0.1:$port"
        fi
        tail -n 5 "$dir/postgres.log" >&2 || true
        echo "pg.sh: start attempt $attempt failed" >&2
        [[ -z "$fixed" ]] || break
    done
    die "could not start PostgreSQL (see $dir/postgres.log)"
}

stop() {
    if [[ ! -f "$data/postmaster.pid" ]]; then
        echo "pg.sh: nothing running in $data" >&2
        return 0
    fi
    echo "pg.sh: stopping $data" >&2
    as_pg "$PG_BIN/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null
}

restart() {
    local port
    port="$(cat "$dir/port" 2>/dev/null)" || die "no port recorded in $dir (pg.sh start $dir first)"
    stop
    start "$port"
}

# standby URL: a base backup of the primary at URL (its initdb's pg_hba.conf trusts replication
# connections from 127.0.0.1), written with the standby.signal and primary_conninfo of -R;
# `-c fast` checkpoints at once (the default spreads it over checkpoint_timeout: ~100 s here).
standby() {
    local primary="$1"
    ensure_os_user
    if [[ ! -f "$data/PG_VERSION" ]]; then
        echo "pg.sh: base backup of $primary into $data" >&2
        as_pg "$PG_BIN/pg_basebackup" -d "$primary" -D "$data" -R -X stream -c fast --no-sync \
            >"$dir/basebackup.log" 2>&1 || { cat "$dir/basebackup.log" >&2; die "pg_basebackup failed"; }
    fi
    start
}

case "$command" in
    start) start ;;
    standby) standby "$3" ;;
    stop) stop ;;
    restart) restart ;;
    *) usage ;;
esac
