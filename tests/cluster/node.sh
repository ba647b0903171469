#!/usr/bin/env bash
# One real Kubernetes node (kube-scheduler + kubelet + containerd + runc + CNI) for the control
# plane that tests/cluster/up.sh DIR started, isolated in namespaces made here.
#
#   tests/cluster/node.sh up DIR          start it (idempotent); prints DIR/node.env
#   tests/cluster/node.sh import DIR TAR  load an image archive (docker-archive or OCI) into it
#   tests/cluster/node.sh expose DIR PORT make host 127.0.0.1:PORT reachable from Pods; prints
#                                         the HOST:PORT Pods use (idempotent)
#   tests/cluster/node.sh down DIR        stop it and check nothing is left (exit 1 if something is)
#   tests/cluster/node.sh check DIR       exit 1, naming them, if processes, mounts or cgroups of
#                                         the node remain
#
# What runs where:
#   host          kube-scheduler (client certificate CN=system:kube-scheduler), and the host ends
#                 of the socat relays below
#   namespaces    `unshare -m -n -p -f` (mount, network, pid): containerd (CRI, runc, overlayfs),
#                 kubelet (node `localhost`, client certificate CN=system:node:localhost), Pods.
#                 tmpfs on /run, /var/lib, /var/log: containerd, runc, libcni and kubelet use
#                 fixed paths there; everything they write vanishes with the namespace.
#   addresses     (only inside the namespace) 10.99.0.1 node IP and relay address, 10.0.0.1 the
#                 `kubernetes` Service, 10.88.0.0/24 Pods on bridge cni0 (host-local IPAM)
#   relays        (socat over Unix sockets in DIR/node, no iptables, no kube-proxy)
#                   kubelet, Pods -> API server: 127.0.0.1:API and 10.0.0.1:443 -> api.sock -> host
#                   API server -> kubelet (logs, exec, port-forward): host 127.0.0.1:KUBELET ->
#                     kubelet.sock -> 10.99.0.1:KUBELET (the node's Hostname `localhost` is what
#                     the API server dials)
#                   Pods -> host loopback services (`expose`): 10.99.0.1:PORT -> host 127.0.0.1:PORT
#   cgroups       kubelet's cgroupRoot is /custody-node-<DIR's name> in every v1 hierarchy, so
#                 `down` removes exactly the node's cgroups (deepest first)
#
# Settings this kind of host needs (../../shared research, measured): cgroup v1 (hybrid) ->
# kubelet failCgroupV1: false + cgroupDriver: cgroupfs; no CAP_SYS_RESOURCE -> containerd
# restrict_oom_score_adj; no registry -> a pause image built here from pause.c; kubelet's
# global sysctls (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops, ...) -> files holding
# the values it wants are bind-mounted over them in the node's mount namespace, so the host's
# values never change. The kubelet's API (port KUBELET) allows anonymous requests: it is
# reachable only in the namespace and through the loopback relay, and the API server (which
# presents no client certificate) is its only client.
#
# Needs: root, unshare, nsenter, ip, socat, containerd, ctr, runc, /usr/lib/cni/{bridge,host-local,
# loopback}, gcc (static libc), buildah, openssl (Debian: containerd runc containernetworking-plugins
# socat buildah). Cache: ${CUSTODY_CACHE:-$HOME/.cache/custody}/node/ (the pause image archive).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { printf 'node.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

node_ip=10.99.0.1
service_ip=10.0.0.1
pod_subnet=10.88.0.0/24
pause_ref=localhost/custody-pause:1
hierarchies=(cpu cpuacct cpuset memory devices freezer blkio pids systemd unified)

usage() { die "usage: $0 up|down|check DIR | import DIR TAR | expose DIR PORT"; }
(($# >= 2)) || usage
cmd=$1
[[ -d "$2" ]] || die "$2: no such directory (tests/cluster/up.sh $2 first)"
dir=$(cd "$2" && pwd)
nd=$dir/node
cgroot=custody-node-$(basename "$dir")

# --- process bookkeeping ------------------------------------------------------------------
# pid files hold "PID START" (start time from /proc/PID/stat), so a recycled pid is never ours.
# (a zombie counts as gone: the host's init may be slow to reap what setsid left it)
start_time() { awk '{ sub(/^.*\) /, ""); if ($1 != "Z") print $20 }' "/proc/$1/stat" 2>/dev/null; }
record() { printf '%s %s\n' "$2" "$(start_time "$2")" >"$nd/$1.pid"; }
recorded() { # recorded NAME: prints the pid when DIR/node/NAME.pid names a live process
  local pid st
  read -r pid st 2>/dev/null <"$nd/$1.pid" || return 1
  [[ -n "$pid" && "$(start_time "$pid")" == "$st" ]] || return 1
  printf '%s' "$pid"
}
stop_recorded() { # stop_recorded NAME SIGNAL
  local pid
  if pid=$(recorded "$1"); then
    kill "-$2" "$pid" 2>/dev/null || true
    for _ in $(seq 100); do recorded "$1" >/dev/null || break; sleep 0.1; done
    recorded "$1" >/dev/null && { kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; }
  fi
  rm -f "$nd/$1.pid"
}
# The namespace's PID 1 (its pid seen from the host).
init_pid() { recorded init; }
in_node() { # in_node CMD...: run CMD inside the node's namespaces
  local pid
  pid=$(init_pid) || die "the node of $dir is not running"
  nsenter -t "$pid" -m -n -p -- "$@"
}

free_port() {
  local p listening
  listening=$(ss -Htln 2>/dev/null | awk '{ n = split($4, a, ":"); print a[n] }' | tr '\n' ' ')
  for _ in $(seq 200); do
    p=$((20000 + RANDOM % 12000))
    [[ " $listening " == *" $p "* ]] && continue
    printf '%s' "$p"
    return 0
  done
  die "no free port found"
}

kubectl() { "$CUSTODY_K8S_BIN/kubectl" --kubeconfig "$dir/kubeconfig" --request-timeout=10s "$@"; }

node_ready() {
  [[ "$(kubectl get node localhost -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

# --- the pause image (cached) -------------------------------------------------------------
pause_archive() {
  local cache="${CUSTODY_CACHE:-$HOME/.cache/custody}/node"
  local hash out
  hash=$( (cat "$here/pause.c"; gcc --version | head -n1; buildah --version) | sha256sum | cut -c1-12)
  out=$cache/pause-$hash.tar
  if [[ ! -s "$out" ]]; then
    mkdir -p "$cache"
    local tmp
    tmp=$(mktemp -d)
    log "building the pause image ($pause_ref) ..."
    gcc -Os -static -o "$tmp/pause" "$here/pause.c"
    strip "$tmp/pause"
    # A private, throwaway buildah store: nothing is written to the host's containers-storage.
    local b=(buildah --root "$tmp/root" --runroot "$tmp/runroot" --storage-driver vfs)
    local c
    c=$("${b[@]}" from scratch)
    "${b[@]}" copy "$c" "$tmp/pause" /pause >/dev/null
    "${b[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$c"
    "${b[@]}" commit -q "$c" "$pause_ref" >/dev/null
    "${b[@]}" push -q "$pause_ref" "docker-archive:$tmp/pause.tar:$pause_ref"
    mv "$tmp/pause.tar" "$out"
    # vfs layers are plain directories; an unmounted store is removed like any other.
    "${b[@]}" rm -a >/dev/null 2>&1 || true
    rm -rf "$tmp"
  fi
  printf '%s' "$out"
}

# --- certificates -------------------------------------------------------------------------
client_cert() { # client_cert NAME SUBJECT: DIR/node/NAME.{key,crt} signed by the cluster CA
  local pki=$dir/pki
  openssl ecparam -name prime256v1 -genkey -noout -out "$nd/$1.key" 2>/dev/null
  openssl req -new -key "$nd/$1.key" -subj "$2" -out "$nd/$1.csr" 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' >"$nd/$1.ext"
  openssl x509 -req -in "$nd/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -sha256 -days 10 -extfile "$nd/$1.ext" -out "$nd/$1.crt" 2>/dev/null
  rm -f "$nd/$1.csr" "$nd/$1.ext"
  chmod 600 "$nd/$1.key"
}
kubeconfig_for() { # kubeconfig_for NAME SERVER
  cat >"$nd/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: custody-test
  cluster: {server: "$2", certificate-authority: "$dir/pki/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$nd/$1.crt", client-key: "$nd/$1.key"}
contexts:
- name: custody-test
  context: {cluster: custody-test, user: $1}
current-context: custody-test
EOF
  chmod 600 "$nd/$1.kubeconfig"
}

# --- inside the namespaces (PID 1) --------------------------------------------------------
init() {
  # shellcheck disable=SC1091
  source "$nd/node.env"
  mount -t tmpfs -o mode=755 tmpfs /run
  mount -t tmpfs -o mode=755 tmpfs /var/lib
  mount -t tmpfs -o mode=755 tmpfs /var/log
  # The values kubelet's setupKernelTunables wants, over the global sysctls it would write.
  mkdir -p /run/custody-sysctl
  local entry want
  for entry in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
    kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
    want=${entry#*=}; entry=${entry%=*}
    [[ "$(cat "/proc/sys/$entry")" == "$want" ]] && continue
    echo "$want" >"/run/custody-sysctl/${entry//\//.}"
    mount --bind "/run/custody-sysctl/${entry//\//.}" "/proc/sys/$entry"
  done
  ip link set lo up
  ip addr add "$service_ip/32" dev lo
  ip addr add "$node_ip/32" dev lo

  # relays to the host ends (api.sock) and from the host (kubelet.sock)
  socat "TCP-LISTEN:$API_PORT,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$nd/api.sock" &
  socat "TCP-LISTEN:443,bind=$service_ip,fork,reuseaddr" "UNIX-CONNECT:$nd/api.sock" &
  socat "UNIX-LISTEN:$nd/kubelet.sock,fork,unlink-early" "TCP:$node_ip:$KUBELET_PORT" &

  containerd --config "$nd/containerd.toml" >>"$nd/containerd.log" 2>&1 &
  for _ in $(seq 300); do
    ctr --address /run/containerd/containerd.sock version >/dev/null 2>&1 && break
    sleep 0.1
  done
  ctr --address /run/containerd/containerd.sock -n k8s.io images import --no-unpack "$PAUSE_ARCHIVE" >>"$nd/containerd.log" 2>&1
  : >"$nd/containerd.ready"

  kubelet --config="$nd/kubelet.yaml" --kubeconfig="$nd/kubelet.kubeconfig" \
    --hostname-override=localhost --node-ip="$node_ip" --v=1 >>"$nd/kubelet.log" 2>&1 &
  # PID 1 of the namespace: stays, reaping orphans, until `down` kills it (and with it
  # everything in the namespace).
  while :; do wait || sleep 1; done
}

# --- up -----------------------------------------------------------------------------------
up() {
  [[ -f "$dir/cluster.env" ]] || die "$dir/cluster.env missing (tests/cluster/up.sh $dir first)"
  # shellcheck disable=SC1091
  source "$dir/cluster.env"
  if init_pid >/dev/null && recorded kube-scheduler >/dev/null && node_ready; then
    log "already running"
    printf '%s\n' "$dir/node.env"
    return 0
  fi
  [[ -e "$nd" ]] && down >/dev/null
  local t0=$SECONDS
  for tool in unshare nsenter ip socat containerd ctr runc gcc buildah openssl; do
    command -v "$tool" >/dev/null || die "$tool not found"
  done
  for plugin in bridge host-local loopback; do
    [[ -x /usr/lib/cni/$plugin ]] || die "/usr/lib/cni/$plugin not found (Debian: containernetworking-plugins)"
  done
  [[ -x "$CUSTODY_K8S_BIN/kubelet" && -x "$CUSTODY_K8S_BIN/kube-scheduler" ]] \
    || die "no kubelet/kube-scheduler in $CUSTODY_K8S_BIN (tests/cluster/build.sh)"
  mkdir -p "$nd" "$nd/cni"
  local pause api_port kubelet_port sched_port
  pause=$(pause_archive)
  api_port=${CUSTODY_APISERVER##*:}
  kubelet_port=$(free_port)
  sched_port=$(free_port)
  [[ "$sched_port" == "$kubelet_port" ]] && sched_port=$(free_port)

  client_cert kube-scheduler "/CN=system:kube-scheduler"
  client_cert kubelet "/O=system:nodes/CN=system:node:localhost"
  kubeconfig_for kube-scheduler "$CUSTODY_APISERVER"
  kubeconfig_for kubelet "https://127.0.0.1:$api_port"
  # kubelet serving certificate (the API server does not verify it; kept real anyway)
  openssl ecparam -name prime256v1 -genkey -noout -out "$nd/kubelet-serving.key" 2>/dev/null
  openssl req -new -key "$nd/kubelet-serving.key" -subj "/CN=localhost" -out "$nd/s.csr" 2>/dev/null
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1,IP:%s\n' "$node_ip" >"$nd/s.ext"
  openssl x509 -req -in "$nd/s.csr" -CA "$dir/pki/ca.crt" -CAkey "$dir/pki/ca.key" -CAcreateserial \
    -sha256 -days 10 -extfile "$nd/s.ext" -out "$nd/kubelet-serving.crt" 2>/dev/null
  rm -f "$nd/s.csr" "$nd/s.ext"

  # Without an authorizer for nodes (the API server runs RBAC only), the node's group gets the
  # system:node ClusterRole, which the Node authorizer would otherwise narrow to its own Pods.
  kubectl apply -f - >/dev/null <<'EOF'
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: custody-test-nodes}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node"}
subjects: [{apiGroup: rbac.authorization.k8s.io, kind: Group, name: "system:nodes"}]
EOF

  cat >"$nd/containerd.toml" <<EOF
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
# the opt plugin would create /opt/containerd on the host's filesystem
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_ref"
  restrict_oom_score_adj = true
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$nd/cni"
EOF
  cat >"$nd/cni/10-custody.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "custody-test",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$pod_subnet"}]], "routes": [{"dst": "0.0.0.0/0"}]}}
  ]
}
EOF
  cat >"$nd/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$cgroot
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
address: 0.0.0.0
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
tlsCertFile: $nd/kubelet-serving.crt
tlsPrivateKeyFile: $nd/kubelet-serving.key
rotateCertificates: false
serverTLSBootstrap: false
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
failSwapOn: false
protectKernelDefaults: false
# imported images cannot be pulled again: never collect them; a small disk evicts nothing
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", nodefs.inodesFree: "1%", imagefs.available: "1%"}
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
nodeStatusUpdateFrequency: 4s
syncFrequency: 10s
fileCheckFrequency: 10s
EOF
  cat >"$nd/node.env" <<EOF
# written by tests/cluster/node.sh up; source it
export CUSTODY_NODE_DIR='$nd'
export CUSTODY_NODE_IP='$node_ip'
export API_PORT='$api_port'
export KUBELET_PORT='$kubelet_port'
export PAUSE_ARCHIVE='$pause'
EOF
  # kubelet checks that its cgroupRoot exists; a new cpuset cgroup needs its cpus and mems
  local h
  for h in "${hierarchies[@]}"; do
    [[ -d /sys/fs/cgroup/$h ]] || continue
    mkdir -p "/sys/fs/cgroup/$h/$cgroot"
  done
  if [[ -d /sys/fs/cgroup/cpuset/$cgroot ]]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$cgroot/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$cgroot/cpuset.mems"
  fi

  # host ends of the relays
  setsid socat "UNIX-LISTEN:$nd/api.sock,fork,unlink-early" "TCP:127.0.0.1:$api_port" </dev/null >>"$nd/relay.log" 2>&1 &
  record relay-api $!
  setsid socat "TCP-LISTEN:$kubelet_port,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$nd/kubelet.sock" </dev/null >>"$nd/relay.log" 2>&1 &
  record relay-kubelet $!

  log "starting kube-scheduler"
  setsid "$CUSTODY_K8S_BIN/kube-scheduler" --kubeconfig="$nd/kube-scheduler.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port="$sched_port" --v=1 \
    </dev/null >>"$nd/kube-scheduler.log" 2>&1 &
  record kube-scheduler $!

  log "starting containerd and kubelet in new namespaces"
  PATH="$CUSTODY_K8S_BIN:$PATH" setsid unshare -m -n -p -f --mount-proc --propagation private \
    "$here/node.sh" _init "$dir" </dev/null >>"$nd/init.log" 2>&1 &
  local unshare_pid=$! child=""
  record unshare "$unshare_pid"
  for _ in $(seq 100); do
    child=$(cat "/proc/$unshare_pid/task/$unshare_pid/children" 2>/dev/null | awk '{ print $1 }')
    [[ -n "$child" ]] && break
    sleep 0.05
  done
  [[ -n "$child" ]] || die "unshare did not start (see $nd/init.log)"
  record init "$child"

  local deadline=$((SECONDS + 120))
  until node_ready; do
    init_pid >/dev/null || die "the node's namespace exited (see $nd/init.log, $nd/containerd.log)"
    recorded kube-scheduler >/dev/null || die "kube-scheduler exited (see $nd/kube-scheduler.log)"
    if ((SECONDS > deadline)); then
      tail -n 20 "$nd/kubelet.log" >&2 || true
      die "node not Ready after 120s (see $nd/kubelet.log)"
    fi
    sleep 0.3
  done
  # Pods need their namespace's ServiceAccount token volume; `default` in default exists
  # already (up.sh waited for it).
  log "node localhost Ready in $((SECONDS - t0))s"
  printf '%s\n' "$dir/node.env"
}

# --- import / expose ----------------------------------------------------------------------
import() {
  local tar=$1
  [[ -f "$tar" ]] || die "$tar: no such file"
  tar=$(cd "$(dirname "$tar")" && pwd)/$(basename "$tar")
  in_node ctr --address /run/containerd/containerd.sock -n k8s.io images import "$tar" >&2
}

expose() {
  local port=$1
  [[ "$port" =~ ^[0-9]+$ ]] || die "expose: $port is not a port"
  mkdir -p "$nd/expose"
  # Test processes expose ports concurrently (cargo runs tests in threads): one relay per port.
  # The relays started below must not inherit fd 8, or they would hold the lock for good.
  exec 8>"$nd/expose/$port.lock"
  flock 8
  if recorded "expose/$port-host" >/dev/null && recorded "expose/$port-node" >/dev/null; then
    printf '%s:%s\n' "$node_ip" "$port"
    return 0
  fi
  local sock=$nd/expose/$port.sock
  setsid socat "UNIX-LISTEN:$sock,fork,unlink-early" "TCP:127.0.0.1:$port" </dev/null >>"$nd/relay.log" 2>&1 8>&- &
  record "expose/$port-host" $!
  for _ in $(seq 100); do [[ -S "$sock" ]] && break; sleep 0.05; done
  [[ -S "$sock" ]] || die "expose: the host relay for port $port did not start (see $nd/relay.log)"
  # inside the namespace (nsenter -p forks, so socat is a member of the pid namespace and dies
  # with it); the pid recorded is the host's view of nsenter's child
  local pid
  pid=$(init_pid) || die "the node of $dir is not running"
  setsid nsenter -t "$pid" -m -n -p -- socat "TCP-LISTEN:$port,bind=$node_ip,fork,reuseaddr" \
    "UNIX-CONNECT:$sock" </dev/null >>"$nd/relay.log" 2>&1 8>&- &
  record "expose/$port-node" $!
  local listening=0
  for _ in $(seq 100); do
    in_node ss -Htln "sport = :$port" 2>/dev/null | grep -q "$node_ip:$port" && { listening=1; break; }
    sleep 0.05
  done
  ((listening)) || die "expose: nothing listens on $node_ip:$port in the node (see $nd/relay.log)"
  printf '%s:%s\n' "$node_ip" "$port"
}

# --- down / check -------------------------------------------------------------------------
leftovers() { # prints what of the node remains on the host, one line each
  local pid f
  for f in "$nd"/*.pid "$nd"/expose/*.pid; do
    [[ -f "$f" ]] || continue
    local name=${f#"$nd/"}; name=${name%.pid}
    pid=$(recorded "$name") && echo "process $name ($pid)"
  done
  # any process whose command line names this node's directory
  for f in /proc/[0-9]*/cmdline; do
    pid=${f#/proc/}; pid=${pid%/cmdline}
    [[ "$pid" == "$$" || "$pid" == "$BASHPID" ]] && continue
    tr '\0' ' ' 2>/dev/null <"$f" | grep -qF "$nd" && echo "process $pid: $(tr '\0' ' ' 2>/dev/null <"$f")"
  done
  grep -F -e "$nd" -e "$cgroot" /proc/self/mountinfo | sed 's/^/mount /' || true
  local h
  for h in "${hierarchies[@]}"; do
    [[ -d "/sys/fs/cgroup/$h/$cgroot" ]] && echo "cgroup /sys/fs/cgroup/$h/$cgroot"
  done
  return 0
}

down() {
  [[ -d "$nd" ]] || return 0
  # PID 1 of the pid namespace: killing it ends every process in the namespace (containerd,
  # shims, containers, kubelet, relays); the mount and network namespaces go with the last one.
  stop_recorded init KILL
  stop_recorded unshare KILL
  local f name
  for f in "$nd"/expose/*.pid; do
    [[ -f "$f" ]] || continue
    name=${f#"$nd/"}; name=${name%.pid}
    stop_recorded "$name" TERM
  done
  stop_recorded kube-scheduler TERM
  stop_recorded relay-api TERM
  stop_recorded relay-kubelet TERM
  # cgroups kubelet and runc made under cgroupRoot, deepest first (a cgroup is removable once
  # its processes are gone; the kernel may take a moment after the namespace's last exit)
  local h left
  for _ in $(seq 50); do
    left=0
    for h in "${hierarchies[@]}"; do
      [[ -d "/sys/fs/cgroup/$h/$cgroot" ]] || continue
      find "/sys/fs/cgroup/$h/$cgroot" -depth -type d -exec rmdir {} + 2>/dev/null || left=1
    done
    ((left)) || break
    sleep 0.1
  done
  rm -rf "$nd/expose" "$nd"/*.sock "$nd"/*.key "$nd"/*.crt "$nd"/*.kubeconfig "$nd/containerd.ready"
  kubectl delete node localhost --ignore-not-found --wait=false >/dev/null 2>&1 || true
  local rest
  rest=$(leftovers)
  if [[ -n "$rest" ]]; then
    log "left behind:"
    printf '%s\n' "$rest" >&2
    return 1
  fi
  log "stopped; nothing left behind"
}

case $cmd in
  up) up ;;
  down) [[ -f "$dir/cluster.env" ]] && source "$dir/cluster.env"; down ;;
  check) rest=$(leftovers); [[ -z "$rest" ]] || { printf '%s\n' "$rest"; exit 1; } ;;
  import) (($# == 3)) || usage; import "$3" ;;
  expose) (($# == 3)) || usage; expose "$3" ;;
  _init) init ;;
  *) usage ;;
esac
