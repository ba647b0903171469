#!/usr/bin/env bash
# Builds custody's container image without a daemon: a static musl binary, then
# deploy/Containerfile with buildah.
#
#   bash deploy/build-image.sh [--archive PATH] [--tag REPO:TAG]
#
#   --tag REPO:TAG   the image's name; default: the chart's default image, image.repository of
#                    charts/custody/values.yaml and the chart's appVersion (custody:0.1.0).
#                    A name without a registry is stored as docker.io/library/NAME, the name a
#                    kubelet asks its runtime for when a Pod says `image: NAME`.
#   --archive PATH   also write the image as a docker-archive tar to PATH, which
#                    `ctr -n k8s.io images import PATH`, `kind load image-archive PATH`,
#                    `docker load -i PATH` and `podman load -i PATH` accept.
#
# Prints the image reference (as given, e.g. custody:0.1.0) on stdout and its progress on stderr;
# exits 1 with a message on the first thing that fails. Run again after a change: cargo builds
# incrementally, and the image is built with a fixed timestamp (the HEAD commit's time), so
# unchanged inputs give the same image ID and an unchanged binary takes seconds.
#
# Needs: rustup and cargo (the toolchain of rust-toolchain/Cargo.toml), the rustup target
# x86_64-unknown-linux-musl (added when missing), Debian's musl-tools (musl-gcc, for the C code of
# aws-lc-sys and libsqlite3-sys), buildah, a CA bundle at /etc/ssl/certs/ca-certificates.crt
# (Debian's ca-certificates) and readelf (binutils). On Debian/Ubuntu as root the missing packages
# are installed with apt-get (so it runs on a fresh Debian 12 CI machine); otherwise it stops and
# names them. buildah uses its configured storage (root: /var/lib/containers/storage, driver
# overlay); where overlay mounts are not allowed (some containers), run with STORAGE_DRIVER=vfs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
target=x86_64-unknown-linux-musl
ca_bundle=/etc/ssl/certs/ca-certificates.crt

log() { echo "build-image.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

archive=""
tag=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --archive) [[ $# -ge 2 && -n "$2" ]] || die "--archive needs a PATH"; archive="$2"; shift 2 ;;
        --tag) [[ $# -ge 2 && -n "$2" ]] || die "--tag needs REPO:TAG"; tag="$2"; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 0 ;;
        *) die "unknown argument '$1' (usage: build-image.sh [--archive PATH] [--tag REPO:TAG])" ;;
    esac
done

# A non-interactive shell may lack rustup's PATH addition.
if [[ -d "$HOME/.cargo/bin" && ":$PATH:" != *":$HOME/.cargo/bin:"* ]]; then
    PATH="$HOME/.cargo/bin:$PATH"
fi

# The chart's default image: `repository:` under `image:` in values.yaml, and `tag:` there or,
# when empty, the chart's appVersion (templates/_helpers.tpl "custody.image").
chart_image() {
    local values="$root/charts/custody/values.yaml" chart="$root/charts/custody/Chart.yaml"
    local repo tag
    repo="$(awk '/^image:/ {in_image = 1; next} /^[^ #]/ {in_image = 0}
        in_image && $1 == "repository:" {print $2; exit}' "$values")"
    tag="$(awk '/^image:/ {in_image = 1; next} /^[^ #]/ {in_image = 0}
        in_image && $1 == "tag:" {print $2; exit}' "$values")"
    tag="${tag//\"/}"
    if [[ -z "$tag" ]]; then
        tag="$(awk '$1 == "appVersion:" {print $2; exit}' "$chart")"
        tag="${tag//\"/}"
    fi
    [[ -n "$repo" && -n "$tag" ]] || die "cannot read image.repository/appVersion from $values, $chart"
    echo "$repo:$tag"
}
[[ -n "$tag" ]] || tag="$(chart_image)"

# Docker's normalization (distribution/reference): a first component with '.' or ':' or equal to
# `localhost` is a registry; otherwise the registry is docker.io, and a one-component name is
# under library/. buildah would otherwise store a short name as localhost/NAME, which no kubelet
# asks for.
name="${tag%:*}"
[[ "$tag" == *:* && "$name" != "$tag" && "${tag##*:}" != */* && "$tag" != *@* ]] \
    || die "--tag must be REPO:TAG (got '$tag')"
first="${name%%/*}"
if [[ "$name" == */* && ( "$first" == *.* || "$first" == *:* || "$first" == localhost ) ]]; then
    full="$tag"
elif [[ "$name" == */* ]]; then
    full="docker.io/$tag"
else
    full="docker.io/library/$tag"
fi

apt_updated=0
need_package() {  # need_package COMMAND-OR-FILE PACKAGE
    if [[ "$1" == /* ]]; then [[ -e "$1" ]] && return 0; else command -v "$1" >/dev/null && return 0; fi
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null; then
        log "installing Debian package $2 (for $1)"
        if [[ $apt_updated -eq 0 ]]; then
            DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 || die "apt-get update failed"
            apt_updated=1
        fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2" >&2 \
            || die "apt-get install $2 failed"
        if [[ "$1" == /* ]]; then [[ -e "$1" ]] && return 0; else command -v "$1" >/dev/null && return 0; fi
    fi
    die "$1 is missing: install the package $2 (Debian/Ubuntu: apt-get install $2; run as root to have this script do it)"
}
command -v cargo >/dev/null && command -v rustup >/dev/null \
    || die "cargo and rustup are needed (https://rustup.rs)"
need_package musl-gcc musl-tools
need_package readelf binutils
need_package strip binutils
need_package buildah buildah
need_package "$ca_bundle" ca-certificates

# 1. the static binary
if ! rustup target list --installed | grep -qx "$target"; then
    log "adding the rustup target $target"
    rustup target add "$target" >&2 || die "rustup target add $target failed"
fi
# The commit goes into the binary (custody --version, custody_build_info) and the image's labels.
revision=unknown
stamp=0
if git -C "$root" rev-parse --verify -q HEAD >/dev/null 2>&1; then
    revision="$(git -C "$root" rev-parse HEAD)"
    [[ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ]] || revision="$revision-dirty"
    stamp="$(git -C "$root" log -1 --format=%ct HEAD)"
fi
log "cargo build --release --locked --target $target (revision $revision)"
(cd "$root" && CUSTODY_REVISION="$revision" cargo build --release --locked --target "$target" >&2) \
    || die "cargo build failed"
bin="${CARGO_TARGET_DIR:-$root/target}/$target/release/custody"
[[ -x "$bin" ]] || die "no binary at $bin after cargo build"
# Static means no program interpreter (PT_INTERP) and no shared library (DT_NEEDED): a FROM
# scratch image has no ld.so and no libc to give it.
if readelf -lW "$bin" | grep -q 'Requesting program interpreter' || readelf -dW "$bin" | grep -q '(NEEDED)'; then
    die "$bin is not static: $(readelf -dW "$bin" | grep '(NEEDED)' | tr -s ' ' | tr '\n' ' ')"
fi

# 2. the build context: exactly the two files deploy/Containerfile copies
context="${CARGO_TARGET_DIR:-$root/target}/image-context"
mkdir -p "$context"
rm -rf "${context:?}"/*
# Without its symbol table (41 -> 33 MB): a panic still prints its message and location, only a
# RUST_BACKTRACE loses the function names.
strip --strip-all -o "$context/custody" "$bin" || die "strip $bin failed"
cp -L "$ca_bundle" "$context/ca-certificates.crt"

# 3. the image
version="$(awk -F'"' '/^version = / {print $2; exit}' "$root/Cargo.toml")"
# Where the source is: $CUSTODY_IMAGE_SOURCE, else the remote `origin` with any user:password@
# removed (a label is public).
source="${CUSTODY_IMAGE_SOURCE:-$(git -C "$root" remote get-url origin 2>/dev/null || true)}"
source="$(printf '%s' "$source" | sed -E 's#^([a-z+]+://)[^/@]*@#\1#')"
[[ -n "$source" ]] || log "no git remote origin and no CUSTODY_IMAGE_SOURCE: the label org.opencontainers.image.source stays empty"
previous="$(buildah images --noheading --format '{{.ID}}' "$full" 2>/dev/null || true)"
log "buildah bud -t $full (context $context)"
buildah bud --quiet --identity-label=false --timestamp "$stamp" \
    -f "$here/Containerfile" \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" --build-arg SOURCE="$source" \
    -t "$full" "$context" >&2 \
    || die "buildah bud failed (where overlay mounts are refused, try STORAGE_DRIVER=vfs)"
current="$(buildah images --noheading --format '{{.ID}}' "$full")"
# The image this tag named before: remove it, so rebuilds do not pile up (buildah refuses, and
# it stays, when another name or a container still uses it).
if [[ -n "$previous" && "$previous" != "$current" ]]; then
    buildah rmi "$previous" >/dev/null 2>&1 || true
fi
log "image $full, ID ${current:0:12}, $(du -k "$context/custody" | cut -f1) KiB binary"

# 4. the archive
if [[ -n "$archive" ]]; then
    mkdir -p "$(dirname "$archive")"
    tmp="$archive.tmp.$$"
    rm -f "$tmp"
    buildah push --quiet "$full" "docker-archive:$tmp:$full" >&2 || { rm -f "$tmp"; die "buildah push to $archive failed"; }
    mv -f "$tmp" "$archive"
    log "archive $archive ($(du -k "$archive" | cut -f1) KiB)"
fi

echo "$tag"
