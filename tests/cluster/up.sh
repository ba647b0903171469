#!/usr/bin/env bash
# Start a real, single-member Kubernetes control plane on 127.0.0.1 for the e2e tests.
#
#   tests/cluster/up.sh DIR     -> prints DIR/kubeconfig on stdout (progress on stderr)
#   tests/cluster/down.sh DIR   -> stops it
#
# What runs (binaries from tests/cluster/build.sh, built once from Go modules and cached):
#   etcd                     plain http on 127.0.0.1 (loopback only), data in DIR/etcd
#   kube-apiserver           https on 127.0.0.1, certs from a CA made here, static token auth,
#                            RBAC, a minimal admission set (below)
#   kube-controller-manager  the controllers an operator's e2e tests lean on (below)
#   audit log                DIR/audit.log: every request but the controller-manager's, at
#                            Metadata level (below)
# Ports are picked free each time; DIR/cluster.env records them (shell-sourceable).
#
# Controller-manager: it is what makes "deleting a resource cleans up what it owns" true.
# Without it the API server alone still stores and serves everything (CRDs, CRs, RBAC, SSA,
# watches, finalizers, admission), but nothing acts on it: no garbage collection of objects
# whose ownerReferences point at a deleted owner, namespaces stuck in Terminating forever,
# no "default" ServiceAccount per namespace (so the ServiceAccount admission plugin rejects
# Pods), no Job/Deployment/ReplicaSet controllers, admin/edit/view ClusterRoles left empty
# (no aggregation). It builds from the same module as kube-apiserver (366 packages and a ~10 s
# link on top of kube-apiserver + kubectl, about a minute of a first build; cached after), adds
# about a second to up.sh and idles at ~100 MB, so it is started. Set
# CUSTODY_NO_CONTROLLER_MANAGER=1 to run without it.
#
# What there is not: no scheduler, no kubelet, no nodes, so Pods stay Pending and never run,
# Deployments never become available, Jobs never complete, Services get no endpoints.
#
# Every up.sh is a fresh cluster: DIR's previous etcd data, certificates and logs are removed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { printf 'up.sh: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $# -eq 1 && -n "$1" ]] || die "usage: $0 DIR"
mkdir -p "$1"
dir=$(cd "$1" && pwd)

alive() { # alive NAME: DIR/NAME.pid names a running NAME process
  local pid
  pid=$(cat "$dir/$1.pid" 2>/dev/null) || return 1
  local exe
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  [[ "$exe" == */"$1" || "$exe" == */"$1 (deleted)" ]]
}
for c in etcd kube-apiserver kube-controller-manager; do
  alive "$c" && die "$c is already running for $dir (tests/cluster/down.sh $dir first)"
done

command -v openssl >/dev/null || die "openssl not found"
command -v curl >/dev/null || die "curl not found"

bin=$("$here/build.sh")

rm -rf "$dir/etcd" "$dir/pki" "$dir/kcm-certs" "$dir"/*.log "$dir/audit-policy.yaml" "$dir"/*.pid "$dir"/*kubeconfig "$dir/cluster.env"
mkdir -p "$dir/pki" "$dir/etcd" "$dir/kcm-certs"
chmod 700 "$dir/pki" "$dir/etcd"

# On any failure from here on: stop what was started and show the logs' tails.
started=0
on_exit() {
  local rc=$?
  if ((rc != 0 && started)); then
    for c in etcd kube-apiserver kube-controller-manager; do
      [[ -s "$dir/$c.log" ]] && { log "--- last lines of $dir/$c.log"; tail -n 25 "$dir/$c.log" >&2; }
    done
    "$here/down.sh" "$dir" >&2 || true
  fi
}
trap on_exit EXIT

# --- certificates, keys and tokens -------------------------------------------------------
pki=$dir/pki
ossl() { openssl "$@" 2>>"$pki/openssl.log"; }
# CA (EC P-256, 10 days: these clusters live for one test run)
ossl ecparam -name prime256v1 -genkey -noout -out "$pki/ca.key"
ossl req -x509 -new -key "$pki/ca.key" -sha256 -days 10 -subj "/CN=custody-test-ca" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -out "$pki/ca.crt"
# kube-apiserver serving certificate
ossl ecparam -name prime256v1 -genkey -noout -out "$pki/apiserver.key"
ossl req -new -key "$pki/apiserver.key" -subj "/CN=kube-apiserver" -out "$pki/apiserver.csr"
cat >"$pki/apiserver.ext" <<'EOF'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
ossl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
  -sha256 -days 10 -extfile "$pki/apiserver.ext" -out "$pki/apiserver.crt"
# service-account token signing key pair (RSA: RS256 tokens)
ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key"
ossl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
# static bearer tokens: token,user,uid,"groups"
admin_token=$(openssl rand -hex 32)
kcm_token=$(openssl rand -hex 32)
cat >"$pki/tokens.csv" <<EOF
$admin_token,custody-admin,custody-admin,"system:masters"
$kcm_token,system:kube-controller-manager,system:kube-controller-manager,"system:masters"
EOF
chmod 600 "$pki"/*.key "$pki/tokens.csv"

# --- ports -------------------------------------------------------------------------------
# Random ports below the kernel's ephemeral range, not listening now and not picked already.
picked=" "
free_port() {
  local p listening
  listening=$(ss -Htln 2>/dev/null | awk '{ n = split($4, a, ":"); print a[n] }' | tr '\n' ' ')
  for _ in $(seq 200); do
    p=$((20000 + RANDOM % 12000))
    [[ " $listening " == *" $p "* || "$picked" == *" $p "* ]] && continue
    printf '%s' "$p"
    return 0
  done
  die "no free port found"
}
etcd_port=$(free_port); picked+="$etcd_port "
etcd_peer_port=$(free_port); picked+="$etcd_peer_port "
api_port=$(free_port); picked+="$api_port "
kcm_port=$(free_port); picked+="$kcm_port "
server=https://127.0.0.1:$api_port

start() { # start NAME ARGS...: run bin/NAME in its own session, log and pid in DIR
  local name=$1; shift
  setsid "$bin/$name" "$@" </dev/null >"$dir/$name.log" 2>&1 &
  echo $! >"$dir/$name.pid"
  started=1
}
wait_for() { # wait_for NAME SECONDS CMD...: until CMD succeeds, while NAME is alive
  local name=$1 secs=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    alive "$name" || die "$name exited (see $dir/$name.log)"
    ((SECONDS < deadline)) || die "$name not ready after ${secs}s (see $dir/$name.log)"
    sleep 0.3
  done
}

# --- etcd --------------------------------------------------------------------------------
# --unsafe-no-fsync: throwaway test data; skipping fsync makes every write much cheaper.
log "starting etcd on 127.0.0.1:$etcd_port"
start etcd \
  --name=custody-test --data-dir="$dir/etcd" \
  --listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
  --listen-peer-urls="http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer_port" \
  --initial-cluster="custody-test=http://127.0.0.1:$etcd_peer_port" --initial-cluster-state=new \
  --unsafe-no-fsync --log-level=warn
etcd_healthy() { curl -fsS "http://127.0.0.1:$etcd_port/health" | grep -q '"health":"true"'; }
wait_for etcd 60 etcd_healthy

# --- kube-apiserver ----------------------------------------------------------------------
# Admission: --enable-admission-plugins only adds to the built-in default set, so the default
# plugins not wanted here are disabled by name (the list is for the pinned version; an
# unknown name makes the apiserver refuse to start, which is how a bump shows it is stale).
# Kept: NamespaceLifecycle, ServiceAccount, Mutating/ValidatingAdmissionPolicy,
# Mutating/ValidatingAdmissionWebhook, ResourceQuota - what an operator's objects meet.
admission_on=NamespaceLifecycle,ServiceAccount,MutatingAdmissionPolicy,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,ValidatingAdmissionWebhook,ResourceQuota
admission_off=LimitRanger,DefaultStorageClass,PersistentVolumeClaimResize,DefaultTolerationSeconds,StorageObjectInUseProtection,PodGroupProtection,Priority,TaintNodesByCondition,RuntimeClass,CertificateApproval,CertificateSigning,ClusterTrustBundleAttest,CertificateSubjectRestriction,DefaultIngressClass,PodSecurity,PodTopologyLabels,NodeDeclaredFeatureValidator,PodResizeValidator
# Audit: every request at Metadata level (who, verb, resource, namespace, response code; no
# bodies, so no Secret values) as JSON lines in DIR/audit.log, for tests that compare what an
# identity did with what its RBAC grants (tests/security.rs). The kube-controller-manager's own
# requests are left out (they are most of the traffic and no test asks about them).
cat >"$dir/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    users: [system:kube-controller-manager]
  - level: Metadata
EOF
# --endpoint-reconciler-type=none: the reconciler refuses a loopback --advertise-address (it
# would publish it as the "kubernetes" Service's endpoint); with no Pods running, nothing
# needs that endpoint.
log "starting kube-apiserver on $server"
start kube-apiserver \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api_port" \
  --cert-dir="$dir/pki" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
  --client-ca-file="$pki/ca.crt" \
  --etcd-servers="http://127.0.0.1:$etcd_port" \
  --token-auth-file="$pki/tokens.csv" \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
  --service-cluster-ip-range=10.0.0.0/24 \
  --endpoint-reconciler-type=none \
  --authorization-mode=RBAC \
  --enable-admission-plugins="$admission_on" --disable-admission-plugins="$admission_off" \
  --profiling=false \
  --audit-policy-file="$dir/audit-policy.yaml" --audit-log-path="$dir/audit.log" \
  --audit-log-format=json --audit-log-maxsize=0
api_ready() {
  curl -fsS --cacert "$pki/ca.crt" -H "Authorization: Bearer $admin_token" "$server/readyz" | grep -qx ok
}
wait_for kube-apiserver 180 api_ready

# --- kubeconfigs -------------------------------------------------------------------------
write_kubeconfig() { # write_kubeconfig FILE USER TOKEN
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: custody-test
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$pki/ca.crt")
users:
- name: $2
  user:
    token: $3
contexts:
- name: custody-test
  context:
    cluster: custody-test
    user: $2
    namespace: default
current-context: custody-test
EOF
  chmod 600 "$1"
}
write_kubeconfig "$dir/kubeconfig" custody-admin "$admin_token"
write_kubeconfig "$dir/kube-controller-manager.kubeconfig" system:kube-controller-manager "$kcm_token"

# --- kube-controller-manager -------------------------------------------------------------
kcm_started=
if [[ "${CUSTODY_NO_CONTROLLER_MANAGER:-0}" != 1 ]]; then
  kcm_started=$kcm_port
  controllers=garbage-collector-controller,namespace-controller,serviceaccount-controller
  controllers+=,serviceaccount-token-controller,root-ca-certificate-publisher-controller
  controllers+=,clusterrole-aggregation-controller,deployment-controller,replicaset-controller
  controllers+=,statefulset-controller,job-controller,cronjob-controller,ttl-after-finished-controller
  # --authentication-skip-lookup: its own /healthz, /metrics server need no front-proxy CA
  # (the apiserver has no aggregation-layer request-header CA; looking it up only logs errors).
  log "starting kube-controller-manager ($controllers)"
  start kube-controller-manager \
    --kubeconfig="$dir/kube-controller-manager.kubeconfig" \
    --authentication-kubeconfig="$dir/kube-controller-manager.kubeconfig" \
    --authorization-kubeconfig="$dir/kube-controller-manager.kubeconfig" \
    --authentication-skip-lookup \
    --bind-address=127.0.0.1 --secure-port="$kcm_port" --cert-dir="$dir/kcm-certs" \
    --leader-elect=false \
    --controllers="$controllers" \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --use-service-account-credentials=false
  kcm_healthy() { curl -fsSk "https://127.0.0.1:$kcm_port/healthz" | grep -qx ok; }
  wait_for kube-controller-manager 120 kcm_healthy
  # the serviceaccount controller has synced once "default" has its ServiceAccount
  default_sa() {
    curl -fsS --cacert "$pki/ca.crt" -H "Authorization: Bearer $admin_token" \
      "$server/api/v1/namespaces/default/serviceaccounts/default"
  }
  wait_for kube-controller-manager 120 default_sa
fi

cat >"$dir/cluster.env" <<EOF
# written by tests/cluster/up.sh; source it
export KUBECONFIG='$dir/kubeconfig'
export CUSTODY_K8S_BIN='$bin'
export CUSTODY_APISERVER='$server'
export CUSTODY_ETCD='http://127.0.0.1:$etcd_port'
export CUSTODY_KCM_PORT='$kcm_started'   # empty: no kube-controller-manager
export CUSTODY_AUDIT_LOG='$dir/audit.log'   # JSON lines, Metadata level
EOF

log "ready: $server (kubectl: $bin/kubectl --kubeconfig $dir/kubeconfig)"
printf '%s\n' "$dir/kubeconfig"
