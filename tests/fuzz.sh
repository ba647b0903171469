#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a while from the committed seeds and regressions.
#
#   bash tests/fuzz.sh                 # 30 s per target, optimized build
#   bash tests/fuzz.sh --dev --seconds 20   # what tests/run.sh does in CI: an unoptimized build
#                                           # compiles in a third of the time; fewer runs/s
#   bash tests/fuzz.sh --seconds 600   # the 10-minute runs recorded in issue 9's closing note
#   bash tests/fuzz.sh --seconds 60 msgpack_decode template_render
#
# cargo fuzz needs a nightly compiler (libFuzzer and sanitizer flags); the toolchain is pinned so
# CI and a laptop fuzz the same way, and installed with rustup when missing. cargo-fuzz itself is
# installed once into ${CUSTODY_CACHE}/cargo-fuzz. A crash stops the run with libFuzzer's report
# and the input under fuzz/artifacts/<target>/; copy it to fuzz/regressions/<target>/ and add a
# test next to the code it broke.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

toolchain=nightly-2026-10-30
cargo_fuzz_version=0.13.2
seconds=30
profile=()
targets=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --seconds) seconds="$2"; shift 2 ;;
        --dev) profile=(--dev); shift ;;
        -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
        *) targets+=("$1"); shift ;;
    esac
done
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(msgpack_decode handle_extract resource_parse template_render mcp_reply)
fi

cache="${CUSTODY_CACHE:-$HOME/.cache/custody}"
if ! rustup run "$toolchain" rustc --version >/dev/null 2>&1; then
    rustup toolchain install "$toolchain" --profile minimal
fi
fuzz_root="$cache/cargo-fuzz-$cargo_fuzz_version"
if [[ ! -x "$fuzz_root/bin/cargo-fuzz" ]]; then
    cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked --root "$fuzz_root"
fi
export PATH="$fuzz_root/bin:$PATH"
# The sanitizer flags differ from a normal build's: never share the main build's target dir.
export CARGO_TARGET_DIR="${CUSTODY_FUZZ_TARGET_DIR:-$PWD/fuzz/target}"
# Line tables are all a crash report needs (file:line in libFuzzer's stack); full debug info made
# each of the five sanitizer binaries ~400 MB, and the incremental cache 0.8 GB more, which filled
# CI's disk. Neither changes what is fuzzed.
export CARGO_PROFILE_DEV_DEBUG=line-tables-only CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
export CARGO_INCREMENTAL=0

cargo "+$toolchain" fuzz build "${profile[@]}"
for target in "${targets[@]}"; do
    corpus="fuzz/corpus/$target"
    mkdir -p "$corpus" "fuzz/regressions/$target"
    echo "==> fuzz $target for ${seconds}s"
    # The working corpus (gitignored) grows across runs; seeds and regressions are read-only
    # inputs, each replayed at start. -timeout makes a hang a crash; -rss_limit_mb a blow-up.
    log="$(mktemp -t "custody-fuzz-$target.XXXXXX")"
    status=0
    cargo "+$toolchain" fuzz run "${profile[@]}" "$target" "$corpus" "fuzz/seeds/$target" "fuzz/regressions/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        >"$log" 2>&1 || status=$?
    grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
    if [[ $status -ne 0 ]]; then
        tail -n 60 "$log" >&2
        echo "fuzz.sh: $target failed (exit $status); the input is under fuzz/artifacts/$target/" >&2
        exit "$status"
    fi
    rm -f "$log"
done
echo "fuzz.sh: ${#targets[@]} targets, ${seconds}s each, no crash"
