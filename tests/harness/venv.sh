#!/usr/bin/env bash
# Ensure the Python venv that custody's tests use, and print its path on stdout.
#
#   tests/harness/venv.sh            -> e.g. /root/.cache/custody/venv-0123456789ab
#
# The venv lives at ${CUSTODY_CACHE:-$HOME/.cache/custody}/venv-<first 12 hex of the sha256 of
# tests/py/requirements.txt>: editing the requirements makes a new venv, an unchanged file
# reuses the old one. A venv hard-codes its own path, so it is built in place under a lock
# and marked complete (.custody-ok) only after `pip install` and `pip check` pass; a
# half-built one is removed and rebuilt on the next call.
# Progress goes to stderr. Env: CUSTODY_CACHE, CUSTODY_PYTHON (interpreter, default python3).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
requirements="$here/../py/requirements.txt"
cache="${CUSTODY_CACHE:-$HOME/.cache/custody}"
python="${CUSTODY_PYTHON:-python3}"

hash="$(sha256sum "$requirements" | cut -c1-12)"
venv="$cache/venv-$hash"

ready() { [[ -x "$venv/bin/python" && -f "$venv/.custody-ok" ]]; }

if ! ready; then
    mkdir -p "$cache"
    exec 9>"$cache/.venv-$hash.lock"
    flock 9
    if ! ready; then  # another caller may have built it while we waited
        echo "venv.sh: creating $venv ($("$python" --version 2>&1))" >&2
        rm -rf "$venv"
        "$python" -m venv "$venv" >&2
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2
        "$venv/bin/python" -m pip check >&2
        touch "$venv/.custody-ok"
        echo "venv.sh: ready" >&2
    fi
    exec 9>&-
fi
echo "$venv"
