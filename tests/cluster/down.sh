#!/usr/bin/env bash
# Stop the control plane that tests/cluster/up.sh DIR started (kube-controller-manager,
# kube-apiserver, etcd, in that order). Only the processes recorded in DIR/*.pid are
# signalled, and only while that pid still runs the binary of that name. DIR keeps the logs
# (and etcd data) for inspection; the next up.sh DIR clears them. Safe to run twice.
set -euo pipefail

log() { printf 'down.sh: %s\n' "$*" >&2; }
[[ $# -eq 1 && -n "$1" ]] || { log "usage: $0 DIR"; exit 2; }
dir=$1
[[ -d "$dir" ]] || { log "$dir: no such directory"; exit 0; }

ours() { # ours NAME PID: PID runs bin/NAME
  local exe
  exe=$(readlink "/proc/$2/exe" 2>/dev/null) || return 1
  [[ "$exe" == */"$1" || "$exe" == */"$1 (deleted)" ]]
}

for name in kube-controller-manager kube-apiserver etcd; do
  pidfile="$dir/$name.pid"
  [[ -f "$pidfile" ]] || continue
  pid=$(cat "$pidfile")
  if [[ "$pid" =~ ^[0-9]+$ ]] && ours "$name" "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do ours "$name" "$pid" || break; sleep 0.1; done
    if ours "$name" "$pid"; then
      log "$name ($pid) did not stop in 10s; killing"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    log "stopped $name ($pid)"
  fi
  rm -f "$pidfile"
done
