#!/usr/bin/env bash
# Build the test control plane's binaries from their Go modules, once, and cache them.
#
#   tests/cluster/build.sh            -> prints the bin dir on stdout (progress on stderr)
#
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl (k8s.io/kubernetes), etcd
# (go.etcd.io/etcd/server/v3), helm (helm.sh/helm/v4) and promtool (github.com/prometheus/prometheus,
# for tests/monitoring.rs; tag remove_all_sd leaves out the cloud service discoveries, which
# promtool's rule checks and tests do not use) through the Go module proxy;
# nothing is downloaded prebuilt. The versions are the ones pinned by the wrapper modules
# under tests/cluster/modules/*/go.mod (+ go.sum); this script reads them from there.
#
# Cache layout (${CUSTODY_CACHE:-$HOME/.cache/custody}):
#   k8s-<kube version>/bin/   the binaries, each with a .<name>.stamp naming what it was built from
#   .go-tmp.XXXXXX/           GOPATH (module downloads) and GOCACHE (compiler cache) of one run,
#                             removed when it ends: 6.4 GB that no later run reads, since a
#                             binary whose stamp matches is skipped (a second run takes a second)
# Delete the bin dir to start over.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
modules="$here/modules"
cache="${CUSTODY_CACHE:-$HOME/.cache/custody}"

log() { printf 'build.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

GO="${GO:-$(command -v go || true)}"
[[ -n "$GO" ]] || { [[ -x /usr/local/go/bin/go ]] && GO=/usr/local/go/bin/go; }
[[ -n "$GO" && -x "$GO" ]] || die "no go toolchain found (set GO=/path/to/go)"

# version of module $2 required by wrapper module $1
req_version() {
  local v
  v=$(awk -v m="$2" '($1 == "require" && $2 == m) || ($1 == m && $2 ~ /^v/) { print ($1 == "require" ? $3 : $2); exit }' \
    "$modules/$1/go.mod")
  [[ -n "$v" ]] || die "$2 not required in $modules/$1/go.mod"
  printf '%s' "$v"
}

kube_version=$(req_version kubernetes k8s.io/kubernetes)   # v1.Y.Z
etcd_version=$(req_version etcd go.etcd.io/etcd/server/v3)
helm_version=$(req_version helm helm.sh/helm/v4)
prometheus_version=$(req_version prometheus github.com/prometheus/prometheus)

bin="$cache/k8s-${kube_version#v}/bin"
mkdir -p "$bin"

# -mod=mod: resolve from go.mod/go.sum (no vendor dir); the committed go.sum pins every hash.
# -buildvcs=false: the wrapper modules sit inside this repo; its git state is not the binaries'.
export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
export GOWORK=off
# Keep the module proxy and checksum database the user/CI configured (default: the public ones).

go_version=$("$GO" env GOVERSION)

# One build at a time per cache (parallel test runs wait here rather than building twice).
exec 9>"$cache/.build.lock"
flock 9

# Go caches of this run only. The module cache is read-only on disk (go's own choice): make it
# writable so rm can remove it. Holding the lock, any other .go-tmp dir is a killed run's.
for stale in "$cache"/.go-tmp.*; do
  if [[ -d $stale ]]; then chmod -R u+w "$stale"; rm -rf "$stale"; fi
done
gotmp=$(mktemp -d "$cache/.go-tmp.XXXXXX")
trap 'chmod -R u+w "$gotmp" 2>/dev/null; rm -rf "$gotmp"' EXIT
export GOPATH="$gotmp/go"
export GOMODCACHE="$GOPATH/pkg/mod"
export GOCACHE="$gotmp/go-build"

kube_major=${kube_version#v}; kube_major=${kube_major%%.*}
kube_minor=${kube_version#v*.}; kube_minor=${kube_minor%%.*}
build_date=1970-01-01T00:00:00Z   # fixed, so rebuilds are reproducible
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$kube_major -X $pkg.gitMinor=$kube_minor"
  kube_ldflags+=" -X $pkg.gitCommit=module-$kube_version -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done
etcd_ldflags="-s -w"
# (helm v4 takes its default .Capabilities.KubeVersion from the client-go version in its build info)
helm_ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.metadata="

# [tags=TAGS] build MODULE_DIR LDFLAGS NAME=PACKAGE@VERSION...
# Builds, in one `go build` (so the packages they share compile once), the binaries that are
# missing or whose stamp differs, into a temp dir, then moves them into place.
tags=""
build() {
  local mod=$1 ldflags=$2; shift 2
  local todo=() names=() spec name pkg ver stamp
  for spec in "$@"; do
    name=${spec%%=*}; pkg=${spec#*=}; ver=${pkg#*@}; pkg=${pkg%@*}
    # (the Go version is left out: a newer toolchain is no reason to spend minutes rebuilding)
    stamp="$pkg@$ver $(printf '%s' "$ldflags" | sha256sum | cut -c1-12)${tags:+ tags=$tags}"
    if [[ -x "$bin/$name" && "$(cat "$bin/.$name.stamp" 2>/dev/null)" == "$stamp" ]]; then
      log "$name: cached ($pkg@$ver)"
      continue
    fi
    todo+=("$pkg"); names+=("$name")
    printf '%s' "$stamp" >"$bin/.$name.stamp.new"
  done
  ((${#todo[@]})) || return 0
  log "building ${names[*]} from $mod with $go_version (first time: several minutes) ..."
  local tmp start=$SECONDS
  tmp=$(mktemp -d "$bin/.tmp.XXXXXX")
  (cd "$modules/$mod" && "$GO" build -trimpath ${tags:+-tags "$tags"} -ldflags "$ldflags" -o "$tmp/" "${todo[@]}") >&2 \
    || { rm -rf "$tmp"; die "go build in $modules/$mod failed"; }
  local i out
  for i in "${!names[@]}"; do
    name=${names[$i]}
    # go names a binary after its package path's last element, less a /vN suffix
    out=${todo[$i]}; [[ $out =~ /v[0-9]+$ ]] && out=${out%/*}; out=${out##*/}
    mv -f "$tmp/$out" "$bin/$name"
    mv -f "$bin/.$name.stamp.new" "$bin/.$name.stamp"
  done
  rm -rf "$tmp"
  log "built ${names[*]} in $((SECONDS - start))s"
}

build etcd "$etcd_ldflags" "etcd=go.etcd.io/etcd/server/v3@$etcd_version"
build kubernetes "$kube_ldflags" \
  "kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver@$kube_version" \
  "kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager@$kube_version" \
  "kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler@$kube_version" \
  "kubelet=k8s.io/kubernetes/cmd/kubelet@$kube_version" \
  "kubectl=k8s.io/kubernetes/cmd/kubectl@$kube_version"
build helm "$helm_ldflags" "helm=helm.sh/helm/v4/cmd/helm@$helm_version"
tags=remove_all_sd build prometheus "-s -w" "promtool=github.com/prometheus/prometheus/cmd/promtool@$prometheus_version"

printf '%s\n' "$bin"
