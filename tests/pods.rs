//! custody as real Pods of the image built in this test run (tests/run.sh: deploy/build-image.sh,
//! imported into the test cluster's real node, tests/cluster/node.sh): `helm install --wait` of
//! the chart, the controller's readiness, Lease and failover, `/metrics` scraped from a Pod, the
//! sweep CronJob's Job Pods writing `status.lastSweep` for real LangGraph threads (scheduled,
//! sharded, acting, failing and recovering), and `helm uninstall`.
//!
//! One release (`custody` in its own namespace) serves the file, as in a cluster: its controller
//! watches every namespace. Each test works in its own namespace, in parallel, under a shared
//! lock; the uninstall test takes it alone, installing and removing a second release. PostgreSQL
//! and the basket MCP servers run on the host's loopback; Pods reach them through
//! `node.sh expose` relays ([`node::from_pods`]).

#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/node.rs"]
mod node;
mod support;

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::{OnceLock, RwLock};
use std::time::{Duration, Instant};

use cluster::{Cluster, http_get, metric, yaml_docs};
use serde_json::{Value, json};
use support::{BasketServer, Db};

/// Every wait's deadline (Pods start in seconds; the machine may be busy).
const DEADLINE: Duration = Duration::from_secs(120);
/// The release's name (so its sweep ClusterRole is `custody-sweep`, as
/// deploy/examples/basket/sweep-access.yaml expects).
const RELEASE: &str = "custody";
/// The Lease of the chart's controller.
const LEASE: &str = "custody-controller";

/// Tests hold it shared; the uninstall test holds it alone.
static ISOLATION: RwLock<()> = RwLock::new(());

fn c() -> &'static Cluster {
    cluster::cluster()
}

/// The shared release's namespace, installed once per test process.
#[expect(
    unsafe_code,
    reason = "atexit is the only teardown hook of a test binary"
)]
fn release_ns() -> &'static str {
    RELEASE_NS.get_or_init(|| {
        let ns = format!("custody-pods-{}", std::process::id());
        // A release of an earlier run of this file against the same cluster (its cluster-scoped
        // RBAC would collide with this one's) goes first.
        let listed = c()
            .helm(
                &["list", "-A", "-f", &format!("^{RELEASE}$"), "-o", "json"],
                None,
            )
            .ok();
        for old in serde_json::from_str::<Value>(&listed)
            .unwrap()
            .as_array()
            .unwrap()
        {
            let old_ns = old["namespace"].as_str().unwrap();
            c().helm(&["uninstall", RELEASE, "-n", old_ns, "--wait"], None)
                .ok();
        }
        let started = Instant::now();
        install(RELEASE, &ns, &[]);
        eprintln!(
            "helm install --wait: both replicas Ready after {:?}",
            started.elapsed()
        );
        // The chart's controller reconciles every namespace: left running, it would fight the
        // controllers that later test binaries start over the same objects. The test harness
        // has no teardown hook, so the release goes when this process exits.
        // SAFETY: `uninstall_release` is an `extern "C" fn()` with no arguments, as atexit needs.
        unsafe { libc::atexit(uninstall_release) };
        ns
    })
}

/// Removes the shared release at process exit (registered by [`release_ns`]).
extern "C" fn uninstall_release() {
    // No panic here (it would abort the process): a failure is printed, and the next run of
    // this file removes a release left behind before it installs its own.
    if let Some(ns) = RELEASE_NS.get() {
        let run = c().helm(
            &["uninstall", RELEASE, "-n", ns, "--wait", "--timeout=120s"],
            None,
        );
        if !run.success {
            eprintln!("`{}` failed at exit: {}", run.what, run.stderr);
        }
        c().kubectl(&["delete", "namespace", ns, "--wait=false"], None);
    }
}

static RELEASE_NS: OnceLock<String> = OnceLock::new();

/// `helm install --wait` of charts/custody with its defaults and this run's image.
fn install(release: &str, ns: &str, extra: &[&str]) {
    let (repo, tag) = node::image();
    let mut args = vec![
        "install",
        release,
        "charts/custody",
        "-n",
        ns,
        "--create-namespace",
        "--wait",
        "--timeout=180s",
    ];
    let repo = format!("image.repository={repo}");
    let tag = format!("image.tag={tag}");
    // The image exists only on the node (imported, no registry).
    args.extend([
        "--set",
        &repo,
        "--set",
        &tag,
        "--set",
        "image.pullPolicy=Never",
    ]);
    args.extend_from_slice(extra);
    // Earlier test binaries applied crds/crds.yaml with kubectl; the chart's copy is the same.
    c().ensure_crds();
    c().helm(&args, None).ok();
}

/// A test's namespace with the sweep ServiceAccount and RoleBinding, deleted when dropped.
struct TestNs(String);

impl TestNs {
    fn new(tag: &str) -> Self {
        let name = format!("pods-{tag}-{}", std::process::id());
        c().ensure_namespace(&name);
        let access = std::fs::read_to_string(
            cluster::repo().join("deploy/examples/basket/sweep-access.yaml"),
        )
        .unwrap();
        c().kubectl(&["apply", "-n", &name, "-f", "-"], Some(&access))
            .ok();
        Self(name)
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        c().kubectl(&["delete", "namespace", &self.0, "--wait=false"], None);
    }
}

impl std::ops::Deref for TestNs {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// Applies one object (JSON) in `ns`.
fn apply(ns: &str, obj: &Value) {
    c().kubectl(&["apply", "-n", ns, "-f", "-"], Some(&obj.to_string()))
        .ok();
}

fn get(ns: &str, what: &str) -> Value {
    c().get_json(&["-n", ns, what])
}

fn condition<'a>(obj: &'a Value, type_: &str) -> Option<&'a Value> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Waits until `check` returns `Ok`.
#[track_caller]
fn eventually<T>(check: impl FnMut() -> Result<T, String>) -> T {
    c().eventually(DEADLINE, check)
}

/// The controller Pods of the release in `ns`.
fn controller_pods(ns: &str) -> Vec<Value> {
    get(ns, "pods")["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "controller")
        .cloned()
        .collect()
}

fn ready(pod: &Value) -> bool {
    condition(pod, "Ready").is_some_and(|c| c["status"] == "True")
        && pod["metadata"]["deletionTimestamp"].is_null()
}

fn lease_holder(ns: &str) -> String {
    c().get_json(&["-n", ns, "lease", LEASE])["spec"]["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// `kubectl port-forward` to a Pod's port (API server -> kubelet -> the Pod's network
/// namespace), killed when dropped.
struct PortForward {
    child: Child,
    /// The local port on 127.0.0.1.
    port: u16,
}

impl PortForward {
    fn new(ns: &str, pod: &str, port: u16) -> Self {
        let bin = cluster::var("CUSTODY_TEST_K8S_BIN");
        let mut child = Command::new(format!("{bin}/kubectl"))
            .arg(format!(
                "--kubeconfig={}",
                cluster::var("CUSTODY_TEST_KUBECONFIG")
            ))
            .args([
                "port-forward",
                "-n",
                ns,
                &format!("pod/{pod}"),
                &format!(":{port}"),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut line).unwrap();
        // kubectl prints a second line (the [::1] listener): keep its stdout open and drained,
        // or it dies of a broken pipe.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        // "Forwarding from 127.0.0.1:PORT -> 8080"
        let local = line
            .split_whitespace()
            .nth(2)
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(_, p)| p.parse().ok())
            .unwrap_or_else(|| panic!("kubectl port-forward said {line:?}"));
        Self { child, port: local }
    }

    fn get(&self, path: &str) -> (u16, String) {
        // The tunnel (API server, kubelet, the Pod's netns) is set up at the first connection.
        eventually(|| http_get(self.port, path).ok_or(format!("nothing answered {path}")))
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store's world: a basket server on the host, a fresh PostgreSQL database with LangGraph's
/// threads, and the Secret, MCPServer and HandleClass that point Pods at them.
struct World {
    server: BasketServer,
    dsn: String,
    manifest: Value,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

impl World {
    /// The fixture threads (all, or `only` these) and the resources in `ns`; `class` is the
    /// HandleClass to apply.
    fn new(ns: &str, db: &str, only: Option<&str>, class: Value) -> Self {
        Self::on(
            ns,
            runtime().block_on(support::fresh_pg_database(db)),
            only,
            class,
        )
    }

    /// [`Self::new`] on the database at `dsn`.
    fn on(ns: &str, dsn: String, only: Option<&str>, class: Value) -> Self {
        let server = BasketServer::start(&[node::BASKET_FOR_PODS]);
        let manifest = support::write_some_fixtures(&server.url(), Db::Postgres(&dsn), only, "");
        apply(
            ns,
            &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "orders-checkpoints"},
                    "stringData": {"dsn": node::from_pods(&dsn)}}),
        );
        apply(
            ns,
            &json!({"apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
                    "metadata": {"name": "basket"},
                    "spec": {"url": node::from_pods(&server.url()), "timeoutSeconds": 5}}),
        );
        apply(ns, &class);
        Self {
            server,
            dsn,
            manifest,
        }
    }

    /// (count of parked threads, count of parked threads expected to get `verdict`).
    fn expected(&self, verdict: &str) -> (usize, usize) {
        let parked: Vec<&str> = self.manifest["threads"]
            .as_object()
            .unwrap()
            .values()
            .filter(|t| t["parked"] == true)
            .map(|t| t["expected"].as_str().unwrap())
            .collect();
        (
            parked.len(),
            parked.iter().filter(|e| **e == verdict).count(),
        )
    }
}

/// deploy/examples/basket/handleclass.yaml.
fn example_class() -> Value {
    let text =
        std::fs::read_to_string(cluster::repo().join("deploy/examples/basket/handleclass.yaml"))
            .unwrap();
    yaml_docs(&text).remove(0)
}

/// A CheckpointStore `orders` on the Secret's DSN.
fn store(ns: &str, spec: Value) {
    let mut spec_all =
        json!({"backend": "postgres", "dsnFrom": {"name": "orders-checkpoints", "key": "dsn"}});
    spec_all
        .as_object_mut()
        .unwrap()
        .extend(spec.as_object().unwrap().clone());
    apply(
        ns,
        &json!({"apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
                "metadata": {"name": "orders"}, "spec": spec_all}),
    );
}

/// The CronJob `orders-sweep` in `ns`, or why it cannot be read (for [`eventually`]).
fn cron_job(ns: &str) -> Result<Value, String> {
    let cron = c().kubectl(
        &["get", "-n", ns, "cronjob/orders-sweep", "-o", "json"],
        None,
    );
    if cron.success {
        Ok(serde_json::from_str(&cron.stdout).unwrap())
    } else {
        Err(cron.stderr)
    }
}

/// Waits for `status.lastSweep` of store `orders`; returns the store.
fn wait_last_sweep(ns: &str) -> Value {
    eventually(|| {
        let o = get(ns, "checkpointstore/orders");
        if o["status"]["lastSweep"].is_object() {
            Ok(o)
        } else {
            Err(format!(
                "no lastSweep: {}\npods: {}",
                o["status"],
                pods_summary(ns)
            ))
        }
    })
}

/// `name phase` of every Pod in `ns`, for failure messages.
fn pods_summary(ns: &str) -> String {
    get(ns, "pods")["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            format!(
                "{} {} {}",
                p["metadata"]["name"].as_str().unwrap_or_default(),
                p["status"]["phase"].as_str().unwrap_or_default(),
                p["status"]["containerStatuses"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The sweep Pods in `ns` that ran to completion.
fn succeeded_sweep_pods(ns: &str) -> Vec<Value> {
    get(ns, "pods")["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "sweep")
        .filter(|p| p["status"]["phase"] == "Succeeded")
        .cloned()
        .collect()
}

/// The restricted settings the controller puts in every sweep Pod, as the Pod ran them.
fn assert_restricted(pod: &Value) {
    let spec = &pod["spec"];
    let (repo, tag) = node::image();
    let container = &spec["containers"][0];
    assert_eq!(container["image"], format!("{repo}:{tag}"), "{spec}");
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{spec}");
    assert_eq!(spec["securityContext"]["runAsUser"], 65532, "{spec}");
    let sc = &container["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{sc}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{sc}");
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{sc}");
    assert_eq!(spec["serviceAccountName"], "custody-sweep", "{spec}");
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// `helm install --wait` with the chart's defaults and the image: both replicas Ready through
/// their readiness probe, one holds the Lease, `/metrics` answers from each Pod (through
/// `kubectl port-forward`: API server, kubelet, the Pod's network namespace).
#[test]
fn controller_pods_are_ready_hold_the_lease_and_serve_metrics() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    let ns = release_ns();
    let pods = controller_pods(ns);
    assert_eq!(pods.len(), 2, "{pods:?}");
    let (repo, tag) = node::image();
    for p in &pods {
        assert!(ready(p), "{}", p["status"]);
        let container = &p["spec"]["containers"][0];
        assert_eq!(container["image"], format!("{repo}:{tag}"));
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(p["spec"]["nodeName"], "localhost");
    }
    let names: Vec<String> = pods
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap().to_owned())
        .collect();
    let leader = eventually(|| {
        let h = lease_holder(ns);
        if names.contains(&h) {
            Ok(h)
        } else {
            Err(format!("Lease holder {h:?}, pods {names:?}"))
        }
    });
    let follower = names.iter().find(|n| **n != leader).unwrap().clone();

    // /metrics from each Pod, through the API server and the kubelet.
    for (pod, is_leader) in [(&leader, 1.0), (&follower, 0.0)] {
        let pf = PortForward::new(ns, pod, 8080);
        let (status, body) = pf.get("/metrics");
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            metric(&body, "custody_leader"),
            Some(is_leader),
            "{pod}:\n{body}"
        );
        assert_eq!(pf.get("/readyz").0, 200);
    }
}

/// Deleting the leader's Pod: on SIGTERM it releases the Lease, the other replica (watching the
/// Lease) takes it before the Deployment's replacement Pod has started, and reconciles: an
/// MCPServer applied after the deletion is discovered. Alone: the release's leader changes.
#[test]
fn deleting_the_leader_pod_hands_the_lease_to_the_other_replica() {
    let _alone = ISOLATION.write().unwrap_or_else(|e| e.into_inner());
    let ns = release_ns();
    let (leader, follower) = eventually(|| {
        let pods = controller_pods(ns);
        let names: Vec<String> = pods
            .iter()
            .filter(|p| ready(p))
            .map(|p| p["metadata"]["name"].as_str().unwrap().to_owned())
            .collect();
        let h = lease_holder(ns);
        match names.iter().find(|n| **n != h) {
            Some(f) if names.len() == 2 && names.contains(&h) => Ok((h, f.clone())),
            _ => Err(format!("Lease holder {h:?}, Ready pods {names:?}")),
        }
    });
    let test_ns = TestNs::new("failover");
    let server = BasketServer::start(&[node::BASKET_FOR_PODS]);
    let started = Instant::now();
    c().kubectl(&["delete", "pod", "-n", ns, &leader, "--wait=false"], None)
        .ok();
    let holder = eventually(|| {
        let h = lease_holder(ns);
        if h.is_empty() || h == leader {
            Err(format!("Lease holder {h:?}\n{}", pods_summary(ns)))
        } else {
            Ok(h)
        }
    });
    let takeover = started.elapsed();
    assert_eq!(
        holder, follower,
        "the replacement Pod, not the standby, took the Lease"
    );
    apply(
        &test_ns,
        &json!({"apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
                "metadata": {"name": "basket"},
                "spec": {"url": node::from_pods(&server.url()), "timeoutSeconds": 5}}),
    );
    eventually(|| {
        let o = get(&test_ns, "mcpserver/basket");
        match condition(&o, "Discovered") {
            Some(c) if c["status"] == "True" => Ok(()),
            _ => Err(o["status"].to_string()),
        }
    });
    eprintln!(
        "failover: {follower} held the Lease {takeover:?} after the leader's Pod was deleted, \
         reconciled a new MCPServer {:?} after",
        started.elapsed()
    );
    assert_eq!(lease_holder(ns), follower);
    // The Deployment is whole again for the other tests: two Ready replicas, none terminating.
    eventually(|| {
        let pods = controller_pods(ns);
        if pods.len() == 2 && pods.iter().all(ready) {
            Ok(())
        } else {
            Err(pods_summary(ns))
        }
    });
}

/// The basket example (deploy/examples/basket, as `kubectl apply -k` renders it, pointed at a
/// basket server and a PostgreSQL database on the host): the controller Pod discovers the
/// MCPServer, reaches the database and renders the AgentAssignment's ConfigMap.
#[test]
fn basket_example_reconciles_from_the_controller_pod() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    release_ns();
    let ns = TestNs::new("basket");
    let server = BasketServer::start(&[node::BASKET_FOR_PODS]);
    let dsn = runtime().block_on(support::fresh_pg_database("pods_basket"));
    support::write_some_fixtures(&server.url(), Db::Postgres(&dsn), Some("t-live"), "");
    let rendered = c()
        .kubectl(&["kustomize", "deploy/examples/basket"], None)
        .ok();
    let docs: Vec<Value> = yaml_docs(&rendered)
        .into_iter()
        .map(|mut d| {
            d["metadata"]["namespace"] = json!(&*ns);
            match (
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap(),
            ) {
                ("Secret", "basket-mcp") => {
                    d["stringData"]["authorization"] = json!("Bearer pods-test-token");
                }
                ("Secret", "orders-checkpoints") => {
                    d["stringData"]["dsn"] = json!(node::from_pods(&dsn));
                }
                ("MCPServer", _) => d["spec"]["url"] = json!(node::from_pods(&server.url())),
                ("RoleBinding", _) => d["subjects"][0]["namespace"] = json!(&*ns),
                _ => {}
            }
            d
        })
        .collect();
    assert_eq!(docs.len(), 8, "{docs:?}");
    c().kubectl(
        &["apply", "-f", "-"],
        Some(&json!({"apiVersion": "v1", "kind": "List", "items": docs}).to_string()),
    )
    .ok();
    let all_true = |what: &str, types: &[&str]| {
        eventually(|| {
            let o = get(&ns, what);
            if types
                .iter()
                .all(|t| condition(&o, t).is_some_and(|c| c["status"] == "True"))
            {
                Ok(o)
            } else {
                Err(format!("{what}: {}", o["status"]))
            }
        })
    };
    all_true("mcpserver/basket", &["Ready", "Discovered", "Healthy"]);
    all_true(
        "checkpointstore/orders",
        &["Reachable", "SchemaCompatible", "Scheduled"],
    );
    let aa = all_true(
        "agentassignment/create-agent",
        &["Valid", "PolicyCompliant", "Ready"],
    );
    assert_eq!(aa["status"]["configMapName"], "create-agent-mcp-config");
    assert_eq!(aa["status"]["toolCount"], 5);
    let cm = get(&ns, "configmap/create-agent-mcp-config");
    let servers: Value = serde_json::from_str(cm["data"]["MCP_SERVERS"].as_str().unwrap()).unwrap();
    assert_eq!(
        servers["basket"]["url"],
        node::from_pods(&server.url()),
        "{servers}"
    );
}

/// A CheckpointStore on a short schedule: the CronJob fires on it and its Job's Pod, the image
/// with the restricted securityContext, writes `status.lastSweep` with the verdicts of real
/// LangGraph threads.
#[test]
fn scheduled_sweep_pod_writes_last_sweep() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    release_ns();
    let ns = TestNs::new("scheduled");
    let world = World::new(&ns, "pods_scheduled", None, example_class());
    let started = Instant::now();
    store(&ns, json!({"schedule": "@every 10s"}));
    let cron = eventually(|| {
        let o = get(&ns, "checkpointstore/orders");
        match condition(&o, "Reachable") {
            Some(c) if c["status"] == "True" => {}
            _ => return Err(o["status"].to_string()),
        }
        cron_job(&ns)
    });
    assert_eq!(cron["spec"]["schedule"], "@every 10s");
    let o = wait_last_sweep(&ns);
    eprintln!(
        "scheduled sweep: lastSweep written {:?} after the store was applied",
        started.elapsed()
    );
    let last = &o["status"]["lastSweep"];
    for verdict in ["ok", "gone", "absent", "unknown"] {
        let (parked, n) = world.expected(verdict);
        assert_eq!(last["parkedThreads"], parked, "{last}");
        assert_eq!(last[verdict], n, "{verdict}: {last}");
    }
    let pods = eventually(|| {
        let pods = succeeded_sweep_pods(&ns);
        if pods.is_empty() {
            Err(pods_summary(&ns))
        } else {
            Ok(pods)
        }
    });
    let pod = &pods[0];
    assert_restricted(pod);
    // Its Job was made by the CronJob on its schedule.
    let job = pod["metadata"]["labels"]["batch.kubernetes.io/job-name"]
        .as_str()
        .unwrap();
    let job = get(&ns, &format!("job/{job}"));
    assert_eq!(
        job["metadata"]["ownerReferences"][0]["kind"], "CronJob",
        "{job}"
    );
    assert_eq!(
        job["metadata"]["ownerReferences"][0]["name"],
        "orders-sweep"
    );
    // The Pod's output, read back through the kubelet.
    let logs = c()
        .kubectl(
            &["logs", "-n", &ns, pod["metadata"]["name"].as_str().unwrap()],
            None,
        )
        .ok();
    let (parked, _) = world.expected("ok");
    assert!(logs.contains(&format!("{parked} parked threads")), "{logs}");
}

/// `parallelism: 2`: the Indexed Job's two Pods each write their shard and the status merges.
/// The Job is made from the CronJob at once (`kubectl create job --from`): the schedule is not
/// what this test is about.
#[test]
fn sharded_sweep_pods_merge_their_shards() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    release_ns();
    let ns = TestNs::new("shards");
    let world = World::new(&ns, "pods_shards", None, example_class());
    store(&ns, json!({"schedule": "0 0 1 1 *", "parallelism": 2}));
    eventually(|| {
        let cron = c().kubectl(
            &["get", "-n", &ns, "cronjob/orders-sweep", "-o", "json"],
            None,
        );
        match serde_json::from_str::<Value>(&cron.stdout) {
            Ok(v) if v["spec"]["jobTemplate"]["spec"]["completionMode"] == "Indexed" => Ok(()),
            _ => Err(cron.stderr),
        }
    });
    let started = Instant::now();
    c().kubectl(
        &[
            "create",
            "job",
            "-n",
            &ns,
            "--from=cronjob/orders-sweep",
            "orders-sweep-now",
        ],
        None,
    )
    .ok();
    let o = eventually(|| {
        let o = get(&ns, "checkpointstore/orders");
        let shards = o["status"]["shards"].as_array().map_or(0, Vec::len);
        if shards == 2 && o["status"]["lastSweep"].is_object() {
            Ok(o)
        } else {
            Err(format!("{}\n{}", o["status"], pods_summary(&ns)))
        }
    });
    eprintln!(
        "sharded sweep: both shards merged {:?} after the Job was created",
        started.elapsed()
    );
    let status = &o["status"];
    let mut shard_parked = 0;
    let mut shards = status["shards"].as_array().unwrap().clone();
    shards.sort_by_key(|s| s["index"].as_u64());
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(s["index"], i, "{status}");
        assert_eq!(s["count"], 2, "{status}");
        assert_eq!(s["run"], "orders-sweep-now", "{status}");
        shard_parked += s["summary"]["parkedThreads"].as_u64().unwrap();
    }
    let last = &status["lastSweep"];
    for verdict in ["ok", "gone", "absent", "unknown"] {
        let (parked, n) = world.expected(verdict);
        assert_eq!(last["parkedThreads"], parked, "{status}");
        assert_eq!(shard_parked as usize, parked, "{status}");
        assert_eq!(last[verdict], n, "{verdict}: {status}");
    }
    let pods = eventually(|| {
        let pods = succeeded_sweep_pods(&ns);
        if pods.len() == 2 {
            Ok(pods)
        } else {
            Err(pods_summary(&ns))
        }
    });
    let mut indexes: Vec<String> = pods
        .iter()
        .map(|p| {
            assert_restricted(p);
            p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    indexes.sort();
    assert_eq!(indexes, ["0", "1"]);
}

/// `mode: act`: the Job's Pod re-mints a dead handle and replays its items; the LangGraph graph,
/// resumed afterwards on the host, continues with the new handle and the replayed items.
#[test]
fn acting_sweep_pod_remints_and_the_graph_continues() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    release_ns();
    let ns = TestNs::new("act");
    let class: Value = serde_yaml::from_str(
        r#"apiVersion: custody.dev/v1alpha1
kind: HandleClass
metadata: {name: basket}
spec:
  serverRef: basket
  statePath: basket
  mintInputsPath: mint_inputs
  mint: {tool: create_basket, handleField: basket_id, idempotencyKeyArgument: idempotency_key}
  replay:
    tool: add_item
    itemsPath: items
    arguments: {basket_id: "{{handle}}", sku: "{{item.sku}}", qty: "{{item.qty}}"}
  verdictPath: custody
  probe:
    tool: get_basket
    arguments: {basket_id: "{{handle}}"}
    goneWhen: {errorTextPrefixes: [BASKET_EXPIRED, BASKET_NOT_FOUND]}
  onGone: remint
"#,
    )
    .unwrap();
    let world = World::new(&ns, "pods_act", Some("t-live"), class);
    let db = Db::Postgres(&world.dsn);
    let resume = |value: Value| {
        support::order_graph(
            Db::Postgres(&world.dsn),
            &[
                "resume",
                "--thread",
                "t-live",
                "--server",
                &world.server.url(),
                "--principal",
                "user-1",
                "--value",
                &value.to_string(),
            ],
        )
    };
    resume(json!({"sku": "widget", "qty": 2}));
    let state = resume(json!({"sku": "gadget", "qty": 1}));
    let old = state["values"]["basket"]["value"]
        .as_str()
        .unwrap()
        .to_owned();
    delete_basket(&world.server.url(), &old);

    store(&ns, json!({"schedule": "0 0 1 1 *", "mode": "act"}));
    eventually(|| {
        let cron = c().kubectl(&["get", "-n", &ns, "cronjob/orders-sweep"], None);
        if cron.success {
            Ok(())
        } else {
            Err(cron.stderr)
        }
    });
    let started = Instant::now();
    c().kubectl(
        &[
            "create",
            "job",
            "-n",
            &ns,
            "--from=cronjob/orders-sweep",
            "orders-sweep-act",
        ],
        None,
    )
    .ok();
    let o = wait_last_sweep(&ns);
    eprintln!(
        "acting sweep: lastSweep written {:?} after the Job was created",
        started.elapsed()
    );
    let last = &o["status"]["lastSweep"];
    assert_eq!(last["gone"], 1, "{last}");
    assert_eq!(last["actions"]["reminted"], 1, "{last}");
    let pods = eventually(|| {
        let pods = succeeded_sweep_pods(&ns);
        if pods.is_empty() {
            Err(pods_summary(&ns))
        } else {
            Ok(pods)
        }
    });
    assert_restricted(&pods[0]);

    // LangGraph sees the new handle, waiting in add_item; it continues with it.
    let state = support::order_graph(db, &["state", "--thread", "t-live"]);
    let new = state["values"]["basket"]["value"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(new, old, "{state}");
    assert_eq!(state["values"]["custody"]["verdict"], "reminted", "{state}");
    assert_eq!(state["next"], json!(["add_item"]), "{state}");
    resume(json!({"sku": "extra", "qty": 1}));
    let done = resume(json!("done"));
    assert_eq!(
        done["values"]["verdict"],
        format!("ok basket={new} items=3"),
        "the graph goes on with the new basket and the two replayed items: {done}"
    );
    // A Normal Event of the re-mint on the store.
    let events = c()
        .kubectl(
            &["get", "events.events.k8s.io", "-n", &ns, "-o", "json"],
            None,
        )
        .ok();
    assert!(events.contains("HandleReminted"), "{events}");
}

/// A store whose database is stopped: the scheduled sweep Job's Pod fails (`backoffLimit: 0`),
/// the store shows `LastSweepSucceeded=False` with the Job's reason and a Warning Event; once
/// the database is back, the next scheduled run succeeds (`LastSweepSucceeded=True`, a new
/// `lastSweep`). The CronJob names each Job by its scheduled minute, so `@every 10s` runs at
/// most once a minute: each wait is up to a minute.
#[test]
fn failing_sweep_pod_shows_and_the_next_run_recovers() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    release_ns();
    let ns = TestNs::new("failing");
    let pg = support::OwnPostgres::start();
    let world = World::on(&ns, pg.admin.clone(), Some("t-live"), example_class());
    store(&ns, json!({"schedule": "@every 10s"}));
    eventually(|| {
        let o = get(&ns, "checkpointstore/orders");
        let cron = c().kubectl(&["get", "-n", &ns, "cronjob/orders-sweep"], None);
        match condition(&o, "Reachable") {
            Some(r) if r["status"] == "True" && cron.success => Ok(()),
            _ => Err(format!("{}\n{}", o["status"], cron.stderr)),
        }
    });
    pg.stop();
    let stopped = Instant::now();
    let failed = eventually(|| {
        let o = get(&ns, "checkpointstore/orders");
        match condition(&o, "LastSweepSucceeded") {
            Some(l) if l["status"] == "False" => Ok(o),
            _ => Err(format!("{}\n{}", o["status"], pods_summary(&ns))),
        }
    });
    eprintln!(
        "failing sweep: LastSweepSucceeded=False {:?} after the database stopped",
        stopped.elapsed()
    );
    let cond = condition(&failed, "LastSweepSucceeded").unwrap();
    assert_eq!(cond["reason"], "BackoffLimitExceeded", "{cond}");
    assert!(
        cond["message"].as_str().unwrap().contains("orders-sweep-"),
        "{cond}"
    );
    assert_eq!(
        condition(&failed, "Ready").unwrap()["status"],
        "False",
        "{}",
        failed["status"]
    );
    let failed_pods = get(&ns, "pods")["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["status"]["phase"] == "Failed")
        .count();
    assert!(failed_pods > 0, "{}", pods_summary(&ns));
    eventually(|| {
        let events = c().get_json(&["-n", &ns, "events.events.k8s.io"]);
        let warned = events["items"].as_array().unwrap().iter().any(|e| {
            e["type"] == "Warning"
                && e["reason"] == "BackoffLimitExceeded"
                && e["regarding"]["kind"] == "CheckpointStore"
                && e["regarding"]["name"] == "orders"
        });
        if warned {
            Ok(())
        } else {
            Err(format!("no Warning BackoffLimitExceeded: {events}"))
        }
    });
    let before = failed["status"]["lastSweep"]["finishedAt"].clone();

    pg.restart();
    let back = Instant::now();
    let recovered = eventually(|| {
        let o = get(&ns, "checkpointstore/orders");
        let fresh = o["status"]["lastSweep"]["finishedAt"] != before;
        match condition(&o, "LastSweepSucceeded") {
            Some(l) if l["status"] == "True" && fresh => Ok(o),
            _ => Err(format!("{}\n{}", o["status"], pods_summary(&ns))),
        }
    });
    eprintln!(
        "failing sweep: recovered (LastSweepSucceeded=True, new lastSweep) {:?} after the database \
         came back",
        back.elapsed()
    );
    assert_eq!(
        condition(&recovered, "LastSweepSucceeded").unwrap()["reason"],
        "JobComplete"
    );
    let last = &recovered["status"]["lastSweep"];
    let (parked, ok) = world.expected("ok");
    assert_eq!(last["parkedThreads"], parked, "{last}");
    assert_eq!(last["ok"], ok, "{last}");
}

/// A sweep Job whose image is not on the node and cannot be pulled: its Pod waits on the real
/// kubelet (here `ErrImageNeverPull`: the test's release sets `image.pullPolicy=Never`, which the
/// sweep Pods now inherit, as there is no registry; with one it would be `ErrImagePull`, then
/// `ImagePullBackOff`), and the store says so (`LastSweepSucceeded=False SweepPodPending` naming the Pod
/// and the image, not Ready, one Warning Event) long before the Job's ten-minute deadline; once the
/// Job is gone the store no longer says it. The Job is the CronJob's own template with the image
/// changed, as a mistyped `image.repository` in the chart would make it.
#[test]
fn a_sweep_pod_that_cannot_pull_its_image_shows_before_the_deadline() {
    let _shared = ISOLATION.read().unwrap_or_else(|e| e.into_inner());
    release_ns();
    let ns = TestNs::new("pending");
    let _world = World::new(&ns, "pods_pending", Some("t-live"), example_class());
    // Once a year: the CronJob exists and starts nothing during the test.
    store(&ns, json!({"schedule": "0 0 1 1 *"}));
    let cron = eventually(|| cron_job(&ns));
    let image = "registry.invalid/custody:missing";
    let template = &cron["spec"]["jobTemplate"];
    let mut spec = template["spec"].clone();
    spec["template"]["spec"]["containers"][0]["image"] = json!(image);
    let started = Instant::now();
    apply(
        &ns,
        &json!({"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": "orders-sweep-badimage", "labels": template["metadata"]["labels"]},
                "spec": spec}),
    );
    // The controller looks at a running Job's Pods every 30 s.
    let pending = c().eventually(Duration::from_secs(240), || {
        let o = get(&ns, "checkpointstore/orders");
        match condition(&o, "LastSweepSucceeded") {
            Some(l) if l["reason"] == "SweepPodPending" => Ok(o),
            _ => Err(format!("{}\n{}", o["status"], pods_summary(&ns))),
        }
    });
    eprintln!(
        "pending sweep pod: LastSweepSucceeded=False SweepPodPending {:?} after the Job was created",
        started.elapsed()
    );
    let cond = condition(&pending, "LastSweepSucceeded").unwrap();
    assert_eq!(cond["status"], "False", "{cond}");
    let message = cond["message"].as_str().unwrap();
    for part in [
        "sweep Job orders-sweep-badimage is running but its Pod orders-sweep-badimage-",
        &format!("cannot start container sweep (image {image})"),
        "spec.sweepTimeoutSeconds (600 s)",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    assert!(
        ["ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff"]
            .iter()
            .any(|reason| message.contains(&format!("): {reason}: "))),
        "{message}"
    );
    let ready = condition(&pending, "Ready").unwrap();
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("SweepPodPending")),
        "{ready}"
    );
    eventually(|| {
        let events = c().get_json(&["-n", &ns, "events.events.k8s.io"]);
        let warned: Vec<&Value> = events["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| {
                e["type"] == "Warning"
                    && e["reason"] == "SweepPodPending"
                    && e["regarding"]["kind"] == "CheckpointStore"
            })
            .collect();
        match warned.as_slice() {
            [one] if one["note"].as_str().unwrap().contains(image) => Ok(()),
            _ => Err(format!("not one Warning SweepPodPending: {events}")),
        }
    });
    c().kubectl(
        &[
            "delete",
            "-n",
            &ns,
            "job/orders-sweep-badimage",
            "--cascade=foreground",
            "--wait",
        ],
        None,
    )
    .ok();
    eventually(|| {
        let o = get(&ns, "checkpointstore/orders");
        match condition(&o, "LastSweepSucceeded") {
            Some(l) if l["reason"] == "NoSweepFinished" => Ok(()),
            _ => Err(o["status"].to_string()),
        }
    });
}

/// Deletes a basket on the host's basket server (its handle then reads as gone).
fn delete_basket(url: &str, basket: &str) {
    runtime().block_on(async {
        let cfg = custody::mcp::ServerConfig {
            name: "basket".into(),
            url: url.to_owned(),
            headers: vec![],
            timeout: Duration::from_secs(10),
            mode: custody::crd::ProtocolMode::Auto,
            max_response_bytes: custody::mcp::DEFAULT_MAX_RESPONSE_BYTES,
        };
        let conn = custody::mcp::Connection::connect(&cfg).await.unwrap();
        let args = json!({"basket_id": basket}).as_object().cloned().unwrap();
        let r = conn.call_tool("delete_basket", args).await.unwrap();
        conn.close().await;
        assert!(!r.is_error, "{}", r.text);
    });
}

/// `helm uninstall` removes the controller (Deployment, Pods, ServiceAccounts, RBAC, Service)
/// and leaves the CRDs and custody resources in place (README: CRDs ship in `crds/`, which Helm
/// never deletes).
#[test]
fn helm_uninstall_removes_the_controller_and_keeps_crds_and_resources() {
    // Alone: a second release's controller would reconcile the other tests' objects too.
    let _alone = ISOLATION.write().unwrap_or_else(|e| e.into_inner());
    let release = "custody-uninstall";
    let ns = format!("custody-uninstall-{}", std::process::id());
    install(release, &ns, &["--set", "controller.replicas=1"]);
    let pods = controller_pods(&ns);
    assert_eq!(pods.len(), 1);
    assert!(ready(&pods[0]));
    apply(
        &ns,
        &json!({"apiVersion": "custody.dev/v1alpha1", "kind": "MCPServer",
                "metadata": {"name": "kept"}, "spec": {"url": "http://127.0.0.1:1/mcp"}}),
    );
    c().helm(
        &["uninstall", release, "-n", &ns, "--wait", "--timeout=120s"],
        None,
    )
    .ok();
    eventually(|| {
        let left = controller_pods(&ns);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{} Pods left", left.len()))
        }
    });
    for gone in [
        format!("deployment/{release}-controller"),
        format!("serviceaccount/{release}-controller"),
        "serviceaccount/custody-sweep".to_owned(),
        format!("service/{release}-metrics"),
    ] {
        let r = c().kubectl(&["get", "-n", &ns, &gone], None);
        assert!(
            !r.success && r.stderr.contains("NotFound"),
            "{gone}: {}",
            r.stdout
        );
    }
    for gone in [
        format!("clusterrole/{release}-controller"),
        format!("clusterrole/{release}-sweep"),
    ] {
        let r = c().kubectl(&["get", &gone], None);
        assert!(
            !r.success && r.stderr.contains("NotFound"),
            "{gone}: {}",
            r.stdout
        );
    }
    for crd in cluster::crd_names() {
        c().kubectl(&["get", "crd", &crd], None).ok();
    }
    c().kubectl(&["get", "-n", &ns, "mcpserver/kept"], None)
        .ok();
    c().kubectl(&["delete", "namespace", &ns, "--wait=false"], None);
}
