//! `custody controller` end to end against a real kube-apiserver (v1.37, with etcd and
//! kube-controller-manager, started by tests/run.sh): the real binary runs out of cluster with
//! the chart's controller ServiceAccount token (so the chart's RBAC is what it may do), real
//! basket MCP servers on loopback, real LangGraph checkpoints in PostgreSQL.
//!
//! One controller serves the whole suite, as in a cluster: it watches every namespace, so two
//! controllers on different Leases would both reconcile every object. Each test works in its own
//! namespace and runs in parallel with the others under a shared lock; the leader-election test
//! takes that lock exclusively, joins a second replica to the Lease, stops the leader and leaves
//! the replica that took over serving the rest of the suite.
//!
//! The controller runs with `--health-interval-seconds 10`: health checks come often enough to
//! see a server go down, and a health check that observes nothing new writes nothing.

#[path = "support/apiserver.rs"]
mod apiserver;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/suite.rs"]
mod suite;
mod support;

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use apiserver::{
    TestNs, apply, assert_one_event, client, condition, events, eventually, eventually_within, get,
    kind_api, visible_text, wait_conditions, wait_event,
};
use chrono::{DateTime, Utc};
use cluster::{ControllerProcess, metric, metric_sum, token_kubeconfig};
use futures::StreamExt;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::Client;
use kube::api::{
    Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::{Value, json};
use suite::{ISOLATION, Suite};
use support::fixtures::{basket_assignment, basket_class, merged, object, server_spec, store_from};
use support::{BasketServer, Db};

/// `--health-interval-seconds` of the controllers.
const HEALTH_INTERVAL: i64 = 10;

/// Starts a replica with the controller ServiceAccount's kubeconfig and waits for `/readyz`.
fn start_replica(infra: &Suite) -> ControllerProcess {
    static N: AtomicUsize = AtomicUsize::new(0);
    let identity = format!("replica-{}", N.fetch_add(1, Ordering::SeqCst));
    infra.replica(
        &identity,
        &["--health-interval-seconds", &HEALTH_INTERVAL.to_string()],
    )
}

/// The chart's RBAC and the controller every test shares.
fn infra() -> &'static Suite {
    static INFRA: OnceLock<Suite> = OnceLock::new();
    INFRA.get_or_init(|| Suite::install("e2e", start_replica))
}

fn time(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .unwrap_or_else(|| panic!("not a time: {v}"))
        .parse()
        .unwrap()
}

/// The object's modifications (status or spec writes) seen by a watch from `rv` for `window`.
async fn modifications(
    api: &Api<DynamicObject>,
    name: &str,
    rv: &str,
    window: Duration,
) -> Vec<Value> {
    let wp = WatchParams::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(window.as_secs() as u32 + 30);
    let stream = api.watch(&wp, rv).await.unwrap();
    let mut stream = std::pin::pin!(stream);
    let deadline = tokio::time::Instant::now() + window;
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => return seen,
            Ok(Some(Ok(WatchEvent::Modified(o)))) => {
                seen.push(serde_json::to_value(o).unwrap());
            }
            Ok(Some(Ok(WatchEvent::Bookmark(_)))) => {}
            Ok(other) => panic!("watch of {name}: {other:?}"),
        }
    }
}

/// What a sweep of `ns` needs besides its CheckpointStore: the sweep ServiceAccount and
/// RoleBinding, a basket server and its MCPServer `basket`, the example HandleClass, and a
/// fresh database (named after `db`) holding every fixture thread with its DSN in Secret
/// `orders-checkpoints`. Returns the server (it serves while held) and the fixtures' manifest.
async fn sweep_fixture(
    infra: &Suite,
    client: &Client,
    ns: &str,
    db: &str,
) -> (BasketServer, Value) {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database(db).await;
    let manifest = support::write_fixtures(&server.url(), Db::Postgres(&dsn));
    let class =
        std::fs::read_to_string(cluster::repo().join("deploy/examples/basket/handleclass.yaml"))
            .unwrap();
    let class = &cluster::yaml_docs(&class)[0];
    infra
        .sweep_namespace(client, ns, &server.url(), &dsn, class)
        .await;
    (server, manifest)
}

/// Waits for the sweep CronJob of CheckpointStore `store` and runs its container's command here,
/// as its Pod would: the same arguments, as the CronJob's ServiceAccount (a token kubeconfig).
/// Returns the arguments and the process's output.
async fn run_cron_job_command(
    infra: &Suite,
    client: &Client,
    ns: &str,
    store: &str,
) -> (Vec<String>, std::process::Output) {
    let name = format!("{store}-sweep");
    let cron = eventually(&format!("the CronJob {name}"), async || {
        Api::<CronJob>::namespaced(client.clone(), ns)
            .get_opt(&name)
            .await
            .unwrap()
            .ok_or("absent".to_owned())
    })
    .await;
    let cron = serde_json::to_value(cron).unwrap();
    let pod = &cron["spec"]["jobTemplate"]["spec"]["template"]["spec"];
    let args: Vec<String> = serde_json::from_value(pod["containers"][0]["args"].clone()).unwrap();
    let sa = pod["serviceAccountName"].as_str().unwrap();
    let kubeconfig = token_kubeconfig(&infra.dir.join(format!("{ns}.kubeconfig")), ns, sa);
    let out = Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(&args)
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    (args, out)
}

const BASKET_TOOLS: [&str; 5] = [
    "add_item",
    "count_baskets",
    "create_basket",
    "delete_basket",
    "get_basket",
];

// ---------------------------------------------------------------------------------------------
// The tests.

/// The basket example (deploy/examples/basket, pointed at a basket server on loopback and a
/// PostgreSQL database holding LangGraph's tables): every kind reconciles, and no Secret value
/// appears in anything the namespace shows.
#[tokio::test]
async fn basket_example_reconciles_end_to_end() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-basket").await;

    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("e2e_basket").await;
    support::write_some_fixtures(&server.url(), Db::Postgres(&dsn), Some("t-live"), "");
    let token = format!("e2e-token-{}", uuid::Uuid::new_v4().simple());
    let password = format!("e2e-pw-{}", uuid::Uuid::new_v4().simple());
    assert!(dsn.contains("://postgres@"), "{dsn}");
    let secret_dsn = dsn.replacen("://postgres@", &format!("://postgres:{password}@"), 1);

    // The example as `kubectl apply -k` would apply it, with this test's namespace, server,
    // database, credentials and release.
    let rendered = cluster::cluster()
        .kubectl(&["kustomize", "deploy/examples/basket"], None)
        .ok();
    let docs: Vec<Value> = cluster::yaml_docs(&rendered)
        .into_iter()
        .map(|mut d| {
            d["metadata"]["namespace"] = json!(&*ns);
            match (
                d["kind"].as_str().unwrap(),
                d["metadata"]["name"].as_str().unwrap(),
            ) {
                ("Secret", "basket-mcp") => {
                    d["stringData"]["authorization"] = json!(format!("Bearer {token}"));
                }
                ("Secret", "orders-checkpoints") => d["stringData"]["dsn"] = json!(secret_dsn),
                ("MCPServer", _) => d["spec"]["url"] = json!(server.url()),
                ("RoleBinding", _) => {
                    d["roleRef"]["name"] = json!(format!("{}-sweep", infra.release));
                    d["subjects"][0]["namespace"] = json!(&*ns);
                }
                _ => {}
            }
            d
        })
        .collect();
    assert_eq!(docs.len(), 8, "{docs:?}");
    cluster::cluster()
        .kubectl(
            &["apply", "-f", "-"],
            Some(&json!({"apiVersion": "v1", "kind": "List", "items": docs}).to_string()),
        )
        .ok();

    // MCPServer: discovered and healthy, catalog in status.
    let mcps = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "basket",
        &[
            ("Ready", "True"),
            ("Discovered", "True"),
            ("Healthy", "True"),
        ],
    )
    .await;
    let status = &mcps["status"];
    assert_eq!(status["observedGeneration"], 1, "{status}");
    assert_eq!(status["protocolVersion"], "2026-07-28", "{status}");
    assert_eq!(status["serverInfo"]["name"], "basket-server", "{status}");
    assert_eq!(status["toolCount"], 5, "{status}");
    assert_eq!(status["cacheScope"], "public", "{status}");
    assert_eq!(status["consecutiveFailures"], 0, "{status}");
    assert!(
        status["catalogDigest"]
            .as_str()
            .is_some_and(|d| d.len() >= 16),
        "{status}"
    );
    let tools: BTreeSet<&str> = status["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["exposedName"].as_str().unwrap())
        .collect();
    let want: BTreeSet<String> = BASKET_TOOLS.iter().map(|t| format!("basket_{t}")).collect();
    assert_eq!(
        tools,
        want.iter().map(String::as_str).collect::<BTreeSet<_>>()
    );
    let get_basket = status["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["exposedName"] == "basket_get_basket")
        .unwrap();
    assert_eq!(get_basket["annotations"]["readOnlyHint"], true);
    let discovered = wait_event(
        &client,
        &ns,
        "MCPServer",
        "basket",
        "CatalogDiscovered",
        "Normal",
    )
    .await;
    assert_eq!(
        discovered.reporting_controller.as_deref(),
        Some("custody-controller")
    );
    assert!(
        discovered
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with("5 tools via 2026-07-28")),
        "{discovered:?}"
    );

    // AgentAssignment: valid, every writing tool needs approval, the ConfigMap rendered.
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "create-agent",
        &[
            ("Valid", "True"),
            ("PolicyCompliant", "True"),
            ("Ready", "True"),
        ],
    )
    .await;
    assert_eq!(aa["status"]["configMapName"], "create-agent-mcp-config");
    assert_eq!(aa["status"]["toolCount"], 5);
    assert_eq!(
        aa["status"]["secretEnv"],
        json!([{"name": "BASKET_MCP_AUTHORIZATION", "secretKeyRef": {"name": "basket-mcp", "key": "authorization"}}])
    );
    let cm = Api::<ConfigMap>::namespaced(client.clone(), &ns)
        .get("create-agent-mcp-config")
        .await
        .unwrap();
    let owner = &cm.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("AgentAssignment", "create-agent", Some(true))
    );
    assert_eq!(
        Some(&owner.uid),
        aa["metadata"]["uid"].as_str().map(String::from).as_ref()
    );
    let data = cm.data.unwrap();
    let servers: Value = serde_json::from_str(&data["MCP_SERVERS"]).unwrap();
    let basket = &servers["basket"];
    assert_eq!(servers.as_object().unwrap().len(), 1, "{servers}");
    assert_eq!(basket["transport"], "http");
    assert_eq!(basket["url"], server.url());
    assert_eq!(basket["mode"], "auto");
    assert_eq!(basket["timeout"], 10);
    assert_eq!(
        basket["headers_env"],
        json!({"Authorization": "BASKET_MCP_AUTHORIZATION"})
    );
    let allowlist: BTreeSet<&str> = basket["tool_allowlist"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(allowlist, BTreeSet::from(BASKET_TOOLS));
    assert_eq!(
        serde_json::from_str::<Value>(&data["MCP_AGENT_SERVERS"]).unwrap(),
        json!({"create-agent": ["basket"]})
    );

    // HandleClass: its tools are in the catalog and the probe is read-only.
    wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "basket",
        &[("Valid", "True"), ("ProbeReadOnly", "True")],
    )
    .await;

    // CheckpointStore: the database answers with LangGraph's tables; the sweep CronJob.
    let store = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Reachable", "True"), ("SchemaCompatible", "True")],
    )
    .await;
    let cron = eventually("the CronJob orders-sweep", async || {
        Api::<CronJob>::namespaced(client.clone(), &ns)
            .get_opt("orders-sweep")
            .await
            .unwrap()
            .ok_or("absent".to_owned())
    })
    .await;
    let cron = serde_json::to_value(cron).unwrap();
    assert_eq!(cron["spec"]["schedule"], "*/5 * * * *");
    assert_eq!(cron["spec"]["concurrencyPolicy"], "Forbid");
    assert_eq!(
        cron["metadata"]["ownerReferences"][0]["uid"],
        store["metadata"]["uid"]
    );
    assert_eq!(cron["metadata"]["ownerReferences"][0]["controller"], true);
    let pod = &cron["spec"]["jobTemplate"]["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "custody-sweep");
    assert_eq!(pod["restartPolicy"], "Never");
    assert_eq!(
        pod["securityContext"],
        json!({"runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": {"type": "RuntimeDefault"}})
    );
    let container = &pod["containers"][0];
    assert_eq!(
        container["args"],
        json!(["sweep", "--store", format!("{}/orders", &*ns)])
    );
    assert_eq!(
        container["securityContext"],
        json!({"allowPrivilegeEscalation": false, "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}})
    );

    // No Secret value anywhere the namespace shows, nor in the controller's logs.
    let shown = visible_text(&client, &ns).await;
    for secret in [&token, &password] {
        assert!(
            !shown.contains(secret.as_str()),
            "a Secret value is visible in {}",
            &*ns
        );
    }
    let logs = infra.logs();
    assert!(!logs.contains(&token) && !logs.contains(&password));
}

/// A private catalog (2026-07-28 `cacheScope: private`) is counted and digested, never named.
#[tokio::test]
async fn private_catalog_names_no_tools() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-private").await;
    let server = BasketServer::start(&[("BASKET_LIST_CACHE_SCOPE", "private")]);
    apply(
        &client,
        &ns,
        &object("MCPServer", "private", json!({"url": server.url()})),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "agent",
            json!({"agent": "agent", "servers": [{"serverRef": "private"}], "interruptOn": []}),
        ),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "private",
        &[("Ready", "True"), ("Discovered", "True")],
    )
    .await;
    let status = &obj["status"];
    assert_eq!(status["toolCount"], 5, "{status}");
    assert_eq!(status["cacheScope"], "private", "{status}");
    assert!(status["catalogDigest"].is_string(), "{status}");
    assert!(status.get("tools").is_none(), "{status}");
    let text = status.to_string();
    for tool in BASKET_TOOLS {
        assert!(!text.contains(tool), "{tool} in {text}");
    }
    // The policy check counts the writing tools missing from interruptOn without naming them.
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("Valid", "True"), ("PolicyCompliant", "False")],
    )
    .await;
    let message = condition(&aa, "PolicyCompliant").unwrap()["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("names withheld"), "{message}");
    for tool in BASKET_TOOLS {
        assert!(!message.contains(tool), "{message}");
    }
    for e in events(&client, &ns, "MCPServer", "private").await {
        let note = e.note.unwrap_or_default();
        for tool in BASKET_TOOLS {
            assert!(!note.contains(tool), "{note}");
        }
    }
}

/// A spec change reaches status and every condition's observedGeneration; a settled status is
/// not rewritten; a server that is down is retried with backoff, not in a storm.
#[tokio::test]
async fn spec_changes_update_status_and_unchanged_status_is_not_rewritten() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-generation").await;
    let api = kind_api(&client, &ns, "MCPServer");
    let server = BasketServer::start(&[]);
    apply(
        &client,
        &ns,
        &object("MCPServer", "basket", server_spec(&server.url())),
    )
    .await;
    let all_true = [
        ("Ready", "True"),
        ("Discovered", "True"),
        ("Healthy", "True"),
    ];
    let obj = wait_conditions(&client, &ns, "MCPServer", "basket", &all_true).await;
    assert_eq!(obj["status"]["toolCount"], 5);

    // Settled: no write for 5 s (unchanged_observations_write_nothing… watches longer).
    let obj = get(&client, &ns, "MCPServer", "basket").await.unwrap();
    let rv = obj["metadata"]["resourceVersion"].as_str().unwrap();
    let writes = modifications(&api, "basket", rv, Duration::from_secs(5)).await;
    assert!(
        writes.is_empty(),
        "a settled status was rewritten {} times in 5 s; before: {}\nafter: {}",
        writes.len(),
        obj["status"],
        writes[0]["status"]
    );

    // A spec change: status and every condition follow the new generation.
    let ready_since = condition(&obj, "Ready").unwrap()["lastTransitionTime"].clone();
    api.patch(
        "basket",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"toolAllowlist": ["get_basket", "create_basket"]}})),
    )
    .await
    .unwrap();
    let obj = wait_conditions(&client, &ns, "MCPServer", "basket", &all_true).await;
    assert_eq!(obj["metadata"]["generation"], 2);
    let status = &obj["status"];
    assert_eq!(status["observedGeneration"], 2, "{status}");
    for c in status["conditions"].as_array().unwrap() {
        assert_eq!(c["observedGeneration"], 2, "{c}");
    }
    assert_eq!(status["toolCount"], 2, "{status}");
    let tools: Vec<&str> = status["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["exposedName"].as_str().unwrap())
        .collect();
    assert_eq!(
        tools.iter().collect::<BTreeSet<_>>(),
        ["basket_create_basket", "basket_get_basket"]
            .iter()
            .collect()
    );
    // Ready was Unknown (Pending) for the new generation until it was checked, then True again.
    assert_ne!(
        condition(&obj, "Ready").unwrap()["lastTransitionTime"],
        ready_since,
        "Ready went Unknown for the new generation"
    );
    wait_event(
        &client,
        &ns,
        "MCPServer",
        "basket",
        "CatalogChanged",
        "Normal",
    )
    .await;

    // A server that is down: failures are reported, and retried with backoff.
    let closed = support::free_port();
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "down",
            json!({"url": format!("http://127.0.0.1:{closed}/mcp"), "timeoutSeconds": 2}),
        ),
    )
    .await;
    let down = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "down",
        &[
            ("Ready", "False"),
            ("Discovered", "False"),
            ("Healthy", "False"),
        ],
    )
    .await;
    assert_eq!(
        condition(&down, "Discovered").unwrap()["reason"],
        "ConnectionRefused"
    );
    let rv = down["metadata"]["resourceVersion"].as_str().unwrap();
    let writes = modifications(&api, "down", rv, Duration::from_secs(10)).await;
    let failures: Vec<&Value> = writes
        .iter()
        .map(|w| &w["status"]["consecutiveFailures"])
        .collect();
    eprintln!(
        "server down: {} status writes in 10 s (consecutiveFailures {failures:?})",
        writes.len()
    );
    assert!(
        writes.len() <= 3,
        "{} status writes in 10 s for a server that is down (consecutiveFailures: {failures:?})",
        writes.len()
    );
    wait_event(
        &client,
        &ns,
        "MCPServer",
        "down",
        "ConnectionRefused",
        "Warning",
    )
    .await;
}

/// Nothing changes for 65 s (six health intervals and the minute after which an AgentAssignment
/// and a HandleClass are rechecked): the MCPServer, the AgentAssignment, its ConfigMap, the
/// HandleClass and the namespace's Events keep their resourceVersions while the health checks go
/// on. Then the server goes down, and its status says so within one health interval plus 5 s.
#[tokio::test]
async fn unchanged_observations_write_nothing_and_an_outage_is_written_within_an_interval() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-steady").await;
    let mut server = BasketServer::start(&[]);
    apply_assignment(
        &client,
        &ns,
        &server,
        basket_assignment("agent", &["get_basket"]),
    )
    .await;
    apply(
        &client,
        &ns,
        &object("HandleClass", "basket", basket_class()),
    )
    .await;
    let objects = [
        ("MCPServer", "basket"),
        ("AgentAssignment", "agent"),
        ("HandleClass", "basket"),
    ];
    for (kind, name) in objects {
        wait_conditions(&client, &ns, kind, name, &[("Ready", "True")]).await;
    }
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let snapshot = async || {
        let mut all = Vec::new();
        for (kind, name) in objects {
            let obj = get(&client, &ns, kind, name).await.unwrap();
            all.push((format!("{kind} {name}"), obj));
        }
        let cm = cms.get("agent-mcp-config").await.unwrap();
        all.push(("ConfigMap".into(), serde_json::to_value(cm).unwrap()));
        let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), &ns)
            .list(&Default::default())
            .await
            .unwrap();
        for e in events.items {
            all.push((
                format!("Event {:?}", e.reason),
                serde_json::to_value(e).unwrap(),
            ));
        }
        all
    };
    // Whatever the first reconciles still had to say has been said.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = snapshot().await;
    let started = Utc::now().timestamp() as f64;
    tokio::time::sleep(Duration::from_secs(65)).await;
    let after = snapshot().await;
    let rv = |o: &Value| o["metadata"]["resourceVersion"].clone();
    let names = |s: &[(String, Value)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&after),
        names(&before),
        "objects or Events came or went"
    );
    for ((what, was), (_, now)) in before.iter().zip(&after) {
        assert_eq!(
            rv(now),
            rv(was),
            "{what} was written with nothing changed:\nbefore: {was}\nafter: {now}"
        );
    }
    let checked = health_checked(&ns, "basket").await.unwrap();
    assert!(
        checked >= started + 50.0,
        "health checks went on meanwhile: last at {checked}, the window began at {started}"
    );
    // Each reconcile of the window was timed.
    let text = infra().metrics().await;
    for (kind, _) in objects {
        let series = format!("custody_reconcile_duration_seconds_count{{kind=\"{kind}\"}}");
        assert!(
            metric(&text, &series).is_some_and(|n| n >= 1.0),
            "{series} in:\n{text}"
        );
    }

    server.stop();
    let down = Instant::now();
    wait_conditions(&client, &ns, "MCPServer", "basket", &[("Healthy", "False")]).await;
    let took = down.elapsed();
    assert!(
        took <= Duration::from_secs(HEALTH_INTERVAL as u64 + 5),
        "the outage reached status after {took:?}"
    );
}

/// A server that stops answering turns Healthy False with a Warning Event, and back; the
/// condition's lastTransitionTime moves only at those flips.
#[tokio::test]
async fn health_flips_with_events_and_transition_times() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-health").await;
    let mut server = BasketServer::start(&[]);
    let port = server.port;
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "flip",
            json!({"url": server.url(), "timeoutSeconds": 3}),
        ),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "flip",
        &[("Ready", "True"), ("Healthy", "True")],
    )
    .await;
    let healthy_since = condition(&obj, "Healthy").unwrap()["lastTransitionTime"].clone();

    // The next health check of a healthy server keeps the transition time.
    let obj = next_health_check(&client, &ns, "flip").await;
    let healthy = condition(&obj, "Healthy").unwrap();
    assert_eq!(healthy["status"], "True");
    assert_eq!(healthy["lastTransitionTime"], healthy_since);

    // Down.
    server.stop();
    let obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "flip",
        &[("Healthy", "False"), ("Ready", "False")],
    )
    .await;
    let unhealthy = condition(&obj, "Healthy").unwrap();
    assert_eq!(unhealthy["reason"], "ConnectionRefused");
    let down_since = unhealthy["lastTransitionTime"].clone();
    assert!(time(&down_since) > time(&healthy_since), "{unhealthy}");
    let event = wait_event(
        &client,
        &ns,
        "MCPServer",
        "flip",
        "ConnectionRefused",
        "Warning",
    )
    .await;
    assert_eq!(
        event.reporting_controller.as_deref(),
        Some("custody-controller")
    );
    let obj = next_health_check(&client, &ns, "flip").await;
    let still = condition(&obj, "Healthy").unwrap();
    assert_eq!(still["status"], "False");
    assert_eq!(still["lastTransitionTime"], down_since);
    // Down long enough that the discovery backoff (5 s doubling per failure) is past the
    // health interval. The check's metric is set just before its status write, so the object
    // read after it may still hold the previous count: the count is read until it grows.
    let mut failures = obj["status"]["consecutiveFailures"].as_u64().unwrap();
    for _ in 0..10 {
        if failures >= 4 {
            break;
        }
        let obj = next_health_check(&client, &ns, "flip").await;
        failures = obj["status"]["consecutiveFailures"].as_u64().unwrap();
    }
    assert!(
        failures >= 4,
        "consecutiveFailures {failures} after 10 checks"
    );

    // Back on the same port: the first health check it answers rediscovers it, so the status
    // that says Healthy says Ready too, with the failures reset; before, Ready waited out the
    // backoff of the failed discoveries while every healthy check still counted a failure.
    let _back = BasketServer::on(port, &[]);
    let obj = wait_conditions(&client, &ns, "MCPServer", "flip", &[("Healthy", "True")]).await;
    assert!(time(&condition(&obj, "Healthy").unwrap()["lastTransitionTime"]) > time(&down_since));
    let ready = condition(&obj, "Ready").unwrap();
    assert_eq!(ready["status"], "True", "{}", obj["status"]);
    assert_eq!(obj["status"]["consecutiveFailures"], 0, "{}", obj["status"]);
    wait_event(&client, &ns, "MCPServer", "flip", "Healthy", "Normal").await;
}

/// Each way of failing to reach an MCP server is its own reason in `Discovered`/`Healthy`/`Ready`,
/// its own Warning Event and its own `custody_reconcile_failures_total` reason: a 401 (the
/// basket server requiring a bearer token), a closed port, a server that never answers, an
/// `https` URL to a plain HTTP server, a reply that is not JSON. When the cause at one URL
/// changes (the closed port starts answering 401), a new Event says so with the current message.
#[tokio::test]
async fn mcp_failures_have_distinct_causes_and_current_event_messages() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-causes").await;
    let locked = BasketServer::start(&[("BASKET_REQUIRE_BEARER", "s3cret")]);
    let hang = support::Peer::misbehaving("hang");
    let plain = BasketServer::start(&[]);
    let not_json = support::Peer::misbehaving("invalid_json");
    let closed = support::free_port();
    let servers = [
        ("auth", locked.url(), "AuthFailed", "AuthFailed"),
        (
            "refused",
            format!("http://127.0.0.1:{closed}/mcp"),
            "ConnectionRefused",
            "ConnectionRefused",
        ),
        ("hang", hang.url(), "Timeout", "Timeout"),
        (
            "tls",
            format!("https://127.0.0.1:{}/mcp", plain.port),
            "TlsFailed",
            "TlsFailed",
        ),
        // The handshake works; tools/list's reply is truncated JSON.
        ("protocol", not_json.url(), "ProtocolError", "Answered"),
    ];
    for (name, url, _, _) in &servers {
        apply(
            &client,
            &ns,
            &object("MCPServer", name, json!({"url": url, "timeoutSeconds": 2})),
        )
        .await;
    }
    for (name, _, discovered, healthy) in &servers {
        let obj = eventually(&format!("MCPServer {name}: {discovered}"), async || {
            let o = get(&client, &ns, "MCPServer", name).await.unwrap();
            let reason = |t| condition(&o, t).map(|c| c["reason"].clone());
            if reason("Discovered") == Some(json!(discovered))
                && reason("Healthy") == Some(json!(healthy))
            {
                Ok(o)
            } else {
                Err(o["status"]["conditions"].to_string())
            }
        })
        .await;
        let ready = condition(&obj, "Ready").unwrap();
        assert_eq!(
            (&ready["status"], &ready["reason"]),
            (&json!("False"), &json!(discovered)),
            "{ready}"
        );
        let event = wait_event(&client, &ns, "MCPServer", name, discovered, "Warning").await;
        let note = event.note.unwrap_or_default();
        assert!(note.starts_with("discovery failed: "), "{name}: {note}");
    }
    let auth = get(&client, &ns, "MCPServer", "auth").await.unwrap();
    let message = condition(&auth, "Discovered").unwrap()["message"].clone();
    assert!(message.as_str().unwrap().contains("401"), "{message}");
    assert!(!message.to_string().contains("s3cret"), "{message}");
    let text = infra.metrics().await;
    for reason in ["auth", "refused", "timeout", "tls", "protocol"] {
        let series =
            format!("custody_reconcile_failures_total{{kind=\"MCPServer\",reason=\"{reason}\"}}");
        assert!(
            metric(&text, &series).is_some_and(|n| n >= 1.0),
            "{series} in:\n{text}"
        );
    }

    // The closed port starts answering 401: the cause, the condition and a new Event follow.
    let _now_locked = BasketServer::on(closed, &[("BASKET_REQUIRE_BEARER", "s3cret")]);
    let obj = eventually("MCPServer refused: AuthFailed", async || {
        let o = get(&client, &ns, "MCPServer", "refused").await.unwrap();
        let reason = |t| condition(&o, t).map(|c| c["reason"].clone());
        if reason("Discovered") == Some(json!("AuthFailed"))
            && reason("Healthy") == Some(json!("AuthFailed"))
        {
            Ok(o)
        } else {
            Err(o["status"]["conditions"].to_string())
        }
    })
    .await;
    let message = condition(&obj, "Healthy").unwrap()["message"].clone();
    assert!(message.as_str().unwrap().contains("401"), "{message}");
    // Ready names the current cause, not the refusal it was discovered with.
    assert_eq!(condition(&obj, "Ready").unwrap()["reason"], "AuthFailed");
    let event = wait_event(
        &client,
        &ns,
        "MCPServer",
        "refused",
        "AuthFailed",
        "Warning",
    )
    .await;
    let note = event.note.unwrap_or_default();
    assert!(note.contains("401"), "{note}");
    assert!(!note.contains("connection refused"), "{note}");
}

/// When the serving controller last checked the health of MCPServer `ns/name`
/// (`custody_server_last_health_check_timestamp_seconds`; the status carries no such time).
async fn health_checked(ns: &str, name: &str) -> Option<f64> {
    let series = format!(
        "custody_server_last_health_check_timestamp_seconds{{namespace=\"{ns}\",name=\"{name}\"}}"
    );
    metric(&infra().metrics().await, &series)
}

/// Waits for a health check of MCPServer `ns/name` that starts after this call; returns the
/// object then.
async fn next_health_check(client: &Client, ns: &str, name: &str) -> Value {
    // The metric has a one-second resolution: a check in the current second does not count.
    let after = Utc::now().timestamp() as f64 + 1.0;
    eventually(
        &format!("a health check of {ns}/{name} after {after}"),
        async || match health_checked(ns, name).await {
            Some(t) if t >= after => Ok(get(client, ns, "MCPServer", name).await.unwrap()),
            other => Err(format!("last checked at {other:?}")),
        },
    )
    .await
}

/// Applies MCPServer `basket` at `server` and AgentAssignment `agent` with this spec.
async fn apply_assignment(client: &Client, ns: &str, server: &BasketServer, spec: Value) {
    let basket = object("MCPServer", "basket", server_spec(&server.url()));
    apply(client, ns, &basket).await;
    apply(client, ns, &object("AgentAssignment", "agent", spec)).await;
}

/// Waits for a Warning Event of this reason about `kind/name` whose note contains `cause`: the
/// one that says the current cause, not an earlier one of the same reason.
async fn wait_warning_saying(
    client: &Client,
    ns: &str,
    kind: &str,
    name: &str,
    reason: &str,
    cause: &str,
) -> k8s_openapi::api::events::v1::Event {
    eventually(
        &format!("Warning Event {reason} about {kind} {ns}/{name} saying {cause:?}"),
        async || {
            let all = events(client, ns, kind, name).await;
            all.iter()
                .find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.type_.as_deref() == Some("Warning")
                        && e.note.as_deref().is_some_and(|n| n.contains(cause))
                })
                .cloned()
                .ok_or_else(|| {
                    let seen: Vec<_> = all.iter().map(|e| (&e.reason, &e.note)).collect();
                    format!("Events: {seen:?}")
                })
        },
    )
    .await
}

/// Deleting an AgentAssignment and a CheckpointStore removes their ConfigMap and CronJob
/// (kube-controller-manager's garbage collector, through the controller's owner references).
#[tokio::test]
async fn deleting_owners_removes_what_they_own() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-gc").await;
    let server = BasketServer::start(&[]);
    apply_assignment(
        &client,
        &ns,
        &server,
        basket_assignment("agent", &["get_basket"]),
    )
    .await;
    apply(
        &client,
        &ns,
        &json!({"apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
                "metadata": {"name": "orders"},
                "spec": {"backend": "postgres", "dsn": "postgres://custody@127.0.0.1:1/nonexistent"}}),
    )
    .await;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let crons = Api::<CronJob>::namespaced(client.clone(), &ns);
    wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("Ready", "True")],
    )
    .await;
    eventually("the ConfigMap and the CronJob", async || {
        match (
            cms.get_opt("agent-mcp-config").await.unwrap(),
            crons.get_opt("orders-sweep").await.unwrap(),
        ) {
            (Some(_), Some(_)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    for kind in ["AgentAssignment", "CheckpointStore"] {
        let name = if kind == "AgentAssignment" {
            "agent"
        } else {
            "orders"
        };
        kind_api(&client, &ns, kind)
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    eventually("the ConfigMap and the CronJob are gone", async || {
        match (
            cms.get_opt("agent-mcp-config").await.unwrap(),
            crons.get_opt("orders-sweep").await.unwrap(),
        ) {
            (None, None) => Ok(()),
            (cm, cron) => Err(format!(
                "ConfigMap present: {}, CronJob present: {}",
                cm.is_some(),
                cron.is_some()
            )),
        }
    })
    .await;
    // The MCPServer it used is untouched.
    assert!(get(&client, &ns, "MCPServer", "basket").await.is_some());

    // Deleting the MCPServer removes its per-object series from /metrics (metrics.rs: "removed
    // when an object is deleted"), so a deleted server does not stay `custody_server_healthy 1`
    // (or 0, alerting) forever.
    let labels = format!("{{namespace=\"{}\",name=\"basket\"}}", &*ns);
    let series = [
        format!("custody_server_healthy{labels}"),
        format!("custody_server_tools{labels}"),
        format!("custody_server_last_health_check_timestamp_seconds{labels}"),
        format!("custody_server_last_discovery_timestamp_seconds{labels}"),
        format!(
            "custody_server_conformance_warnings{{namespace=\"{}\",name=\"basket\",kind=\"output_schema\"}}",
            &*ns
        ),
        format!(
            "custody_server_conformance_warnings{{namespace=\"{}\",name=\"basket\",kind=\"notification_status\"}}",
            &*ns
        ),
    ];
    let infra = infra();
    let text = infra.metrics().await;
    for s in &series {
        assert!(metric(&text, s).is_some(), "{s} missing before the delete");
    }
    kind_api(&client, &ns, "MCPServer")
        .delete("basket", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "the deleted MCPServer's series leave /metrics",
        async || {
            let text = infra.metrics().await;
            let left: Vec<&String> = series
                .iter()
                .filter(|s| metric(&text, s).is_some())
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("still exposed: {left:?}"))
            }
        },
    )
    .await;
}

/// Two replicas on one Lease: only the holder reconciles; after SIGTERM it releases the Lease
/// and the other takes over and reconciles new objects.
#[tokio::test]
async fn only_the_leader_reconciles_and_a_standby_takes_over() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-leader").await;
    let holder = async || infra.lease_holder(&client).await;
    let mut current = infra.current.lock().await;
    let mut leader = current.take().expect("the suite's controller");
    let standby = start_replica(infra);

    eventually("one leader, one standby", async || {
        let (l, s) = (leader.metrics(), standby.metrics());
        let h = holder().await;
        match (metric(&l, "custody_leader"), metric(&s, "custody_leader")) {
            (Some(1.0), Some(0.0)) if h.as_deref() == Some(&leader.identity) => Ok(()),
            other => Err(format!(
                "custody_leader (leader, standby): {other:?}; holder {h:?}"
            )),
        }
    })
    .await;
    let hc = |name: &str| {
        let spec = merged(basket_class(), json!({"serverRef": "nowhere"}));
        object("HandleClass", name, spec)
    };
    let series = "custody_reconciles_total{kind=\"HandleClass\"}";
    let before = metric(&leader.metrics(), series).unwrap_or(0.0);
    apply(&client, &ns, &hc("first")).await;
    let first = wait_conditions(&client, &ns, "HandleClass", "first", &[("Valid", "False")]).await;
    assert_eq!(
        condition(&first, "Valid").unwrap()["reason"],
        "UnknownServer"
    );
    assert!(metric(&leader.metrics(), series).unwrap_or(0.0) > before);
    let idle = standby.metrics();
    assert_eq!(
        metric_sum(&idle, "custody_reconciles_total"),
        0.0,
        "the standby reconciled:\n{idle}"
    );

    // SIGTERM the leader: it exits cleanly and releases the Lease; the standby takes it.
    let stopped = Instant::now();
    let exit = leader.terminate();
    assert!(exit.success(), "{exit}:\n{}", leader.log_tail());
    eventually("the standby leads", async || {
        let m = standby.metrics();
        let h = holder().await;
        match metric(&m, "custody_leader") {
            Some(1.0) if h.as_deref() == Some(&standby.identity) => Ok(()),
            other => Err(format!("custody_leader {other:?}; holder {h:?}")),
        }
    })
    .await;
    eprintln!("takeover after {:?}", stopped.elapsed());
    apply(&client, &ns, &hc("second")).await;
    wait_conditions(&client, &ns, "HandleClass", "second", &[("Valid", "False")]).await;
    assert!(metric(&standby.metrics(), series).unwrap_or(0.0) >= 1.0);
    *current = Some(standby);
}

/// The CronJob's command, run here with its arguments and the sweep ServiceAccount's token,
/// sweeps the store and writes `status.lastSweep` next to the controller's conditions.
#[tokio::test]
async fn sweep_command_of_the_cron_job_writes_last_sweep() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-sweep").await;
    let (_server, manifest) = sweep_fixture(infra, &client, &ns, "e2e_sweep").await;
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            store_from("orders-checkpoints"),
        ),
    )
    .await;
    wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Reachable", "True"), ("SchemaCompatible", "True")],
    )
    .await;
    let (args, out) = run_cron_job_command(infra, &client, &ns, "orders").await;
    assert_eq!(args, ["sweep", "--store", &format!("{}/orders", &*ns)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "custody {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The table: every column, every parked thread, the summary.
    let parked: Vec<(&String, &str)> = manifest["threads"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, t)| t["parked"] == true)
        .map(|(id, t)| (id, t["expected"].as_str().unwrap()))
        .collect();
    let count = |v: &str| parked.iter().filter(|(_, e)| *e == v).count();
    assert!(
        stdout.contains("THREAD") && stdout.contains("VERDICT"),
        "{stdout}"
    );
    for (thread, _) in &parked {
        assert!(stdout.contains(thread.as_str()), "{thread}:\n{stdout}");
    }
    let summary = format!(
        "{} parked threads, {} handles: {} ok, {} gone, {} absent, {} unknown; 4 probes",
        parked.len(),
        parked.len(),
        count("ok"),
        count("gone"),
        count("absent"),
        count("unknown")
    );
    assert!(stdout.contains(&summary), "want {summary:?} in:\n{stdout}");

    let store = eventually("status.lastSweep", async || {
        let o = get(&client, &ns, "CheckpointStore", "orders")
            .await
            .unwrap();
        if o["status"]["lastSweep"].is_object() {
            Ok(o)
        } else {
            Err(o["status"].to_string())
        }
    })
    .await;
    let last = &store["status"]["lastSweep"];
    assert_eq!(last["parkedThreads"], parked.len(), "{last}");
    for verdict in ["ok", "gone", "absent", "unknown"] {
        assert_eq!(last[verdict], count(verdict), "{verdict}: {last}");
    }
    assert_eq!(last["probes"], 4, "{last}");
    assert!(last["finishedAt"].is_string(), "{last}");
    // Written under the sweep's field manager; the controller's conditions stay.
    assert!(
        store["metadata"]["managedFields"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["manager"] == "custody-sweep" && m["subresource"] == "status"),
        "{}",
        store["metadata"]["managedFields"]
    );
    assert_eq!(condition(&store, "Reachable").unwrap()["status"], "True");
    // The controller reads it back into its gauges (and does not drop it from status).
    let gone = format!(
        "custody_sweep_handles{{namespace=\"{}\",name=\"orders\",verdict=\"gone\"}}",
        &*ns
    );
    eventually(
        "the sweep's counts in the controller's metrics",
        async || {
            let text = infra.metrics().await;
            match metric(&text, &gone) {
                Some(n) if n == count("gone") as f64 => Ok(()),
                other => Err(format!("{gone} = {other:?}")),
            }
        },
    )
    .await;
    // ... and the sweep's wall time and end, for the dashboard and the overdue alert
    let series = |m: &str| format!("{m}{{namespace=\"{}\",name=\"orders\"}}", &*ns);
    let finished = DateTime::parse_from_rfc3339(last["finishedAt"].as_str().unwrap()).unwrap();
    let text = infra.metrics().await;
    assert_eq!(
        metric(
            &text,
            &series("custody_sweep_last_success_timestamp_seconds")
        ),
        Some(finished.timestamp_millis() as f64 / 1000.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, &series("custody_sweep_duration_seconds")),
        Some(last["durationMs"].as_f64().unwrap() / 1000.0),
        "{text}"
    );
    let again = get(&client, &ns, "CheckpointStore", "orders")
        .await
        .unwrap();
    assert_eq!(&again["status"]["lastSweep"], last);
}

/// One HandleClass the API server accepts but custody's validation refuses (a template typo),
/// one whose MCPServer does not exist, and one whose probe tool the server does not offer (the
/// controller's `Valid=False ToolNotOffered`; before, the sweep probed it and judged each of
/// its threads `unknown` while the store stayed green), next to the example class: the sweep
/// leaves all three out
/// and sweeps the example class (exit 0, every parked thread judged), and says so in its
/// warnings, `status.lastSweep.skippedClasses` and a `HandleClassSkipped` Event naming the
/// field; the bad class's own `Valid` condition names it too.
#[tokio::test]
async fn a_bad_handle_class_is_left_out_and_the_others_are_swept() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-badclass").await;
    let (_server, manifest) = sweep_fixture(infra, &client, &ns, "e2e_badclass").await;
    let typo = merged(
        basket_class(),
        json!({"statePath": "other", "probe": {"arguments": {"basket_id": "{{handel}}"}}}),
    );
    apply(&client, &ns, &object("HandleClass", "typo", typo)).await;
    let orphan = merged(
        basket_class(),
        json!({"serverRef": "nowhere", "statePath": "other"}),
    );
    apply(&client, &ns, &object("HandleClass", "orphan", orphan)).await;
    let misnamed = merged(
        basket_class(),
        json!({"statePath": "other", "probe": {"tool": "get_baskett"}}),
    );
    apply(&client, &ns, &object("HandleClass", "misnamed", misnamed)).await;
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            store_from("orders-checkpoints"),
        ),
    )
    .await;
    let class = wait_conditions(&client, &ns, "HandleClass", "typo", &[("Valid", "False")]).await;
    let message = condition(&class, "Valid").unwrap()["message"].clone();
    assert!(
        message
            .as_str()
            .unwrap()
            .starts_with("spec.probe.arguments.basket_id: "),
        "{message}"
    );
    let misnamed = wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "misnamed",
        &[("Valid", "False")],
    )
    .await;
    assert_eq!(
        condition(&misnamed, "Valid").unwrap()["reason"],
        "ToolNotOffered"
    );
    let (args, out) = run_cron_job_command(infra, &client, &ns, "orders").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "custody {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let misnamed_warning = "HandleClass misnamed left out: spec.probe.tool: ";
    assert!(
        stdout.contains(misnamed_warning) && stdout.contains("(Valid=False ToolNotOffered)"),
        "want {misnamed_warning:?} in:\n{stdout}"
    );
    let typo_warning = "HandleClass typo left out: spec.probe.arguments.basket_id: ";
    assert!(
        stdout.contains(typo_warning),
        "want {typo_warning:?} in:\n{stdout}"
    );
    let orphan_warning = "HandleClass orphan left out: spec.serverRef: no MCPServer \"nowhere\"";
    assert!(
        stdout.contains(orphan_warning),
        "want {orphan_warning:?} in:\n{stdout}"
    );

    let parked: Vec<&str> = manifest["threads"]
        .as_object()
        .unwrap()
        .values()
        .filter(|t| t["parked"] == true)
        .map(|t| t["expected"].as_str().unwrap())
        .collect();
    let store = eventually("status.lastSweep", async || {
        let o = get(&client, &ns, "CheckpointStore", "orders")
            .await
            .unwrap();
        if o["status"]["lastSweep"].is_object() {
            Ok(o)
        } else {
            Err(o["status"].to_string())
        }
    })
    .await;
    let last = &store["status"]["lastSweep"];
    assert_eq!(last["parkedThreads"], parked.len(), "{last}");
    for verdict in ["ok", "gone", "absent", "unknown"] {
        let n = parked.iter().filter(|e| **e == verdict).count();
        assert_eq!(last[verdict], n, "{verdict}: {last}");
    }
    assert_eq!(
        last["skippedClasses"],
        json!(["misnamed", "orphan", "typo"]),
        "{last}"
    );
    // The store is not shown healthy while classes are left out.
    let store = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("ClassesSwept", "False"), ("Ready", "False")],
    )
    .await;
    let swept = condition(&store, "ClassesSwept").unwrap();
    assert_eq!(swept["reason"], "HandleClassesLeftOut", "{swept}");
    assert!(
        swept["message"]
            .as_str()
            .unwrap()
            .contains("left out HandleClass misnamed, orphan, typo ("),
        "{swept}"
    );
    assert_eq!(
        condition(&store, "Ready").unwrap()["reason"],
        "HandleClassesLeftOut"
    );
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "HandleClassSkipped",
        "Warning",
    )
    .await;
    let notes: Vec<String> = events(&client, &ns, "CheckpointStore", "orders")
        .await
        .into_iter()
        .filter(|e| e.reason == event.reason)
        .filter_map(|e| e.note)
        .collect();
    assert!(
        notes.iter().any(|n| n.starts_with(
            "HandleClass typo left out of this sweep: spec.probe.arguments.basket_id: "
        )),
        "{notes:?}"
    );
    assert!(
        notes.iter().any(|n| n.contains("spec.serverRef")),
        "{notes:?}"
    );
    // The store observes: its gone handles are not acted on, and `kubectl describe` says so.
    let gone = parked.iter().filter(|e| **e == "gone").count();
    assert!(gone > 0, "{parked:?}");
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "HandlesGone",
        "Warning",
    )
    .await;
    assert_eq!(
        event.note.as_deref(),
        Some(
            format!(
                "{gone} handle(s) held by parked threads are gone and were not acted on \
                 (spec.mode is observe); `custody sweep --store` lists them"
            )
            .as_str()
        ),
        "{event:?}"
    );

    // Issue 15, item 9: the next run says the same, and is counted in the same Events' series
    // instead of publishing them again.
    let (args, out) = run_cron_job_command(infra, &client, &ns, "orders").await;
    assert!(out.status.success(), "custody {args:?} failed");
    let all = events(&client, &ns, "CheckpointStore", "orders").await;
    for reason in ["HandlesGone", "HandleClassSkipped"] {
        let of: Vec<_> = all
            .iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .collect();
        assert_eq!(
            of.len(),
            if reason == "HandlesGone" { 1 } else { 3 },
            "{of:?}"
        );
        for e in of {
            assert_eq!(e.series.as_ref().map(|s| s.count), Some(2), "{e:?}");
        }
    }
}

/// When the only HandleClass of the namespace is left out, the sweep says so and why, not that
/// no class applies (which pointed at `spec.handleClassSelector`, a selector that was fine).
#[tokio::test]
async fn a_sweep_whose_only_class_is_left_out_says_so() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-onlybad").await;
    let (_server, _manifest) = sweep_fixture(infra, &client, &ns, "e2e_onlybad").await;
    let typo = merged(
        basket_class(),
        json!({"probe": {"arguments": {"basket_id": "{{handel}}"}}}),
    );
    apply(&client, &ns, &object("HandleClass", "basket", typo)).await;
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            store_from("orders-checkpoints"),
        ),
    )
    .await;
    let (_, out) = run_cron_job_command(infra, &client, &ns, "orders").await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let warnings: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("warning: "))
        .collect();
    assert!(
        warnings.first().is_some_and(|w| w
            .starts_with("warning: HandleClass basket left out: spec.probe.arguments.basket_id: ")),
        "{stdout}"
    );
    assert!(
        warnings.contains(
            &"warning: no HandleClass left to sweep: every one this store selects was left out \
              (basket; why above), so no handle was probed"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains("handleClassSelector"), "{stdout}");
    // Said once, in the report: no log line repeats it on stderr.
    assert_eq!(
        stdout.matches("HandleClass basket left out").count(),
        1,
        "{stdout}"
    );
    assert!(!stderr.contains("left out"), "{stderr}");
}

/// Objects the CRD accepts but custody's validation rejects: the condition names the field.
#[tokio::test]
async fn invalid_objects_name_the_field_in_conditions() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-invalid").await;
    let mut class = object(
        "HandleClass",
        "typo",
        merged(
            basket_class(),
            json!({"serverRef": "nowhere",
                   "probe": {"arguments": {"basket_id": "{{handel}}"}}}),
        ),
    );
    apply(&client, &ns, &class).await;
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "bad-header",
            json!({"url": "http://127.0.0.1:1/mcp", "headers": {"Bad Header": "x"}}),
        ),
    )
    .await;

    let obj = wait_conditions(&client, &ns, "HandleClass", "typo", &[("Valid", "False")]).await;
    let valid = condition(&obj, "Valid").unwrap();
    assert_eq!(valid["reason"], "InvalidSpec", "{valid}");
    assert!(
        valid["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.probe.arguments.basket_id: "),
        "{valid}"
    );
    assert_eq!(obj["status"]["observedGeneration"], 1);

    let obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "bad-header",
        &[
            ("Ready", "False"),
            ("Discovered", "False"),
            ("Healthy", "Unknown"),
        ],
    )
    .await;
    let ready = condition(&obj, "Ready").unwrap();
    assert_eq!(ready["reason"], "InvalidSpec", "{ready}");
    assert!(
        ready["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.headers.Bad Header: "),
        "{ready}"
    );

    // Fixed: the template is accepted; what remains is the missing server.
    class["spec"]["probe"]["arguments"]["basket_id"] = json!("{{handle}}");
    apply(&client, &ns, &class).await;
    let obj = wait_conditions(&client, &ns, "HandleClass", "typo", &[("Valid", "False")]).await;
    assert_eq!(obj["metadata"]["generation"], 2);
    assert_eq!(condition(&obj, "Valid").unwrap()["reason"], "UnknownServer");
}

/// `spec.parallelism: 2`: the CronJob runs an Indexed Job whose pods sweep one shard each; run
/// here with each pod's index and Job name expanded, the shards write their own entries of
/// `status.shards` and, once both of the same run have reported, the merged `status.lastSweep`.
#[tokio::test]
async fn sharded_sweeps_of_an_indexed_job_merge_into_last_sweep() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-shards").await;
    let (_server, manifest) = sweep_fixture(infra, &client, &ns, "e2e_shards").await;
    let store = |parallelism: Value| {
        object(
            "CheckpointStore",
            "orders",
            merged(
                store_from("orders-checkpoints"),
                json!({"parallelism": parallelism}),
            ),
        )
    };
    // The API server refuses a parallelism out of range.
    for bad in [json!(0), json!(65)] {
        let err = kind_api(&client, &ns, "CheckpointStore")
            .patch(
                "orders",
                &PatchParams::apply("custody-e2e").force(),
                &Patch::Apply(&store(bad.clone())),
            )
            .await
            .expect_err("parallelism out of range");
        assert!(err.to_string().contains("parallelism"), "{bad}: {err}");
    }
    apply(&client, &ns, &store(json!(2))).await;

    let cron = eventually("the Indexed Job template of orders-sweep", async || {
        let cron = Api::<CronJob>::namespaced(client.clone(), &ns)
            .get_opt("orders-sweep")
            .await
            .unwrap()
            .ok_or("absent".to_owned())?;
        let cron = serde_json::to_value(cron).unwrap();
        if cron["spec"]["jobTemplate"]["spec"]["completionMode"] == "Indexed" {
            Ok(cron)
        } else {
            Err(cron["spec"]["jobTemplate"]["spec"].to_string())
        }
    })
    .await;
    let job = &cron["spec"]["jobTemplate"]["spec"];
    assert_eq!(job["completions"], 2, "{job}");
    assert_eq!(job["parallelism"], 2, "{job}");
    let container = &job["template"]["spec"]["containers"][0];
    let args: Vec<String> = serde_json::from_value(container["args"].clone()).unwrap();
    assert_eq!(
        args,
        [
            "sweep",
            "--store",
            &format!("{}/orders", &*ns),
            "--shard",
            "$(JOB_COMPLETION_INDEX)/2",
            "--run",
            "$(CUSTODY_SWEEP_RUN)"
        ]
    );
    assert_eq!(
        container["env"][0],
        json!({"name": "CUSTODY_SWEEP_RUN", "valueFrom": {"fieldRef": {"apiVersion": "v1",
               "fieldPath": "metadata.labels['batch.kubernetes.io/job-name']"}}})
    );
    let sa = job["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap();
    let kubeconfig = token_kubeconfig(&infra.dir.join(format!("{}.kubeconfig", &*ns)), &ns, sa);
    // What the kubelet does with $(VAR) references, for pod `index` of Job `run`.
    let pod = |index: u32, run: &str| {
        let args: Vec<String> = args
            .iter()
            .map(|a| {
                a.replace("$(JOB_COMPLETION_INDEX)", &index.to_string())
                    .replace("$(CUSTODY_SWEEP_RUN)", run)
            })
            .collect();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_custody"));
        cmd.args(&args)
            .env("KUBECONFIG", &kubeconfig)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd.spawn().unwrap()
    };
    let finish = |child: std::process::Child| {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "shard sweep failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };

    // One shard of a run alone: its entry, and no merged totals yet.
    finish(pod(0, "orders-sweep-1"));
    let o = get(&client, &ns, "CheckpointStore", "orders")
        .await
        .unwrap();
    assert_eq!(
        o["status"]["shards"].as_array().map(Vec::len),
        Some(1),
        "{}",
        o["status"]
    );
    assert!(o["status"]["lastSweep"].is_null(), "{}", o["status"]);

    // Both shards of the next run at once: neither entry is lost and the totals merge.
    let children = [pod(0, "orders-sweep-2"), pod(1, "orders-sweep-2")];
    for c in children {
        finish(c);
    }
    let store = eventually("status.lastSweep", async || {
        let o = get(&client, &ns, "CheckpointStore", "orders")
            .await
            .unwrap();
        if o["status"]["lastSweep"].is_object() {
            Ok(o)
        } else {
            Err(o["status"].to_string())
        }
    })
    .await;
    let parked: Vec<&str> = manifest["threads"]
        .as_object()
        .unwrap()
        .values()
        .filter(|t| t["parked"] == true)
        .map(|t| t["expected"].as_str().unwrap())
        .collect();
    let count = |v: &str| parked.iter().filter(|e| **e == v).count();
    let status = &store["status"];
    let shards = status["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2, "{status}");
    let mut shard_parked = 0;
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(s["index"], i, "{status}");
        assert_eq!(s["count"], 2, "{status}");
        assert_eq!(s["run"], "orders-sweep-2", "{status}");
        shard_parked += s["summary"]["parkedThreads"].as_u64().unwrap();
    }
    let last = &status["lastSweep"];
    assert_eq!(last["parkedThreads"], parked.len(), "{status}");
    assert_eq!(shard_parked as usize, parked.len(), "{status}");
    for verdict in ["ok", "gone", "absent", "unknown"] {
        assert_eq!(last[verdict], count(verdict), "{verdict}: {status}");
    }
    assert_eq!(last["probes"], 4, "{status}");
    let managers: Vec<&str> = store["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["subresource"] == "status")
        .filter_map(|m| m["manager"].as_str())
        .collect();
    for m in [
        "custody-sweep-shard-0",
        "custody-sweep-shard-1",
        "custody-sweep",
    ] {
        assert!(managers.contains(&m), "{m} not in {managers:?}");
    }
    assert_eq!(condition(&store, "Reachable").unwrap()["status"], "True");
}

/// The rendered ConfigMap of assignment `name`: its data and its config-digest annotation.
async fn rendered(client: &Client, ns: &str, name: &str) -> (Value, Value, String) {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), ns)
        .get(&format!("{name}-mcp-config"))
        .await
        .unwrap();
    let digest = cm
        .metadata
        .annotations
        .unwrap_or_default()
        .get("custody.dev/config-digest")
        .cloned()
        .unwrap_or_default();
    let data = cm.data.unwrap_or_default();
    (
        serde_json::from_str(&data["MCP_SERVERS"]).unwrap(),
        serde_json::from_str(&data["MCP_AGENT_SERVERS"]).unwrap(),
        digest,
    )
}

/// `MCPServer.spec.required`: an optional server that goes down is left out of the rendered
/// configuration (the agent toolkit would refuse to start with it) and put back when it
/// answers again, with the assignment `Ready` but `Degraded`; a required server whose Secret is
/// deleted makes the assignment not `Ready`, naming it, and stays in the configuration.
#[tokio::test]
async fn optional_servers_that_are_down_are_left_out_and_required_ones_block_ready() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "required").await;
    let mut main = BasketServer::start(&[]);
    let mut extra = BasketServer::start(&[]);
    let extra_port = extra.port;
    apply(
        &client,
        &ns,
        &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "main-token"},
                "stringData": {"token": "Bearer e2e"}}),
    )
    .await;
    apply(
        &client,
        &ns,
        &object("MCPServer", 
            "main",
            json!({"url": main.url(), "required": true, "timeoutSeconds": 3,
                   "headersFrom": [{"name": "Authorization", "secretKeyRef": {"name": "main-token", "key": "token"}}]}),
        ),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "extra",
            json!({"url": extra.url(), "timeoutSeconds": 3}),
        ),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "agent",
            json!({"agent": "create-agent", "servers": [
                    {"serverRef": "main", "toolAllowlist": ["get_basket"]},
                    {"serverRef": "extra", "toolAllowlist": ["get_basket"]}]}),
        ),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "HandleClass",
            "main-baskets",
            merged(basket_class(), json!({"serverRef": "main"})),
        ),
    )
    .await;
    wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("Ready", "True"), ("Degraded", "False")],
    )
    .await;
    wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "main-baskets",
        &[("Valid", "True")],
    )
    .await;
    let (servers, agents, first_digest) = rendered(&client, &ns, "agent").await;
    assert!(servers["extra"].is_object(), "{servers}");
    assert_eq!(agents, json!({"create-agent": ["main", "extra"]}));
    assert_eq!(first_digest.len(), 64, "{first_digest}");

    // The optional server goes down: left out, the assignment still Ready, reported Degraded.
    extra.stop();
    wait_conditions(&client, &ns, "MCPServer", "extra", &[("Ready", "False")]).await;
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("Ready", "True"), ("Degraded", "True")],
    )
    .await;
    let degraded = condition(&aa, "Degraded").unwrap();
    assert_eq!(
        degraded["reason"], "OptionalServerUnavailable",
        "{degraded}"
    );
    assert!(
        degraded["message"]
            .as_str()
            .unwrap()
            .contains("optional MCPServer extra is not ready"),
        "{degraded}"
    );
    assert_eq!(aa["status"]["toolCount"], 1, "{}", aa["status"]);
    let (servers, agents, digest) = rendered(&client, &ns, "agent").await;
    assert!(servers.get("extra").is_none(), "{servers}");
    assert!(servers["main"].is_object(), "{servers}");
    assert_eq!(agents, json!({"create-agent": ["main"]}));
    assert_ne!(digest, first_digest);
    assert_eq!(aa["status"]["configDigest"], digest.as_str());
    wait_event(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "OptionalServerUnavailable",
        "Warning",
    )
    .await;
    wait_event(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "ConfigurationChanged",
        "Normal",
    )
    .await;

    // Back: put back into the configuration.
    let _back = BasketServer::on(extra_port, &[]);
    wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("Ready", "True"), ("Degraded", "False")],
    )
    .await;
    let (servers, agents, digest) = rendered(&client, &ns, "agent").await;
    assert!(servers["extra"].is_object(), "{servers}");
    assert_eq!(agents, json!({"create-agent": ["main", "extra"]}));
    assert_eq!(
        digest, first_digest,
        "the same configuration, the same digest"
    );
    wait_event(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "AllServersAvailable",
        "Normal",
    )
    .await;

    // The required server stops: not Ready, naming the server and the cause, with an Event.
    main.stop();
    let ready = wait_ready_saying(
        &client,
        &ns,
        "required MCPServer main is not ready (ConnectionRefused",
    )
    .await;
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("RequiredServerUnavailable")),
        "{ready}"
    );
    wait_warning_saying(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "RequiredServerUnavailable",
        "(ConnectionRefused",
    )
    .await;

    // Then its Secret is deleted: not Ready for the new cause, which a new Event says (issue
    // 15, item 8: an Event's message is the current one); still rendered.
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), &ns)
        .delete("main-token", &DeleteParams::default())
        .await
        .unwrap();
    let ready = wait_ready_saying(
        &client,
        &ns,
        "required MCPServer main is not ready (SecretNotResolved",
    )
    .await;
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("RequiredServerUnavailable")),
        "{ready}"
    );
    let (servers, _, _) = rendered(&client, &ns, "agent").await;
    assert!(servers["main"].is_object(), "{servers}");
    wait_warning_saying(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "RequiredServerUnavailable",
        "required MCPServer main is not ready (SecretNotResolved",
    )
    .await;
    // A HandleClass on that server is not valid either: sweeps leave it out (its catalog from
    // before the deletion is not evidence that the class can be used).
    let hc = wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "main-baskets",
        &[("Valid", "False"), ("Ready", "False")],
    )
    .await;
    let valid = condition(&hc, "Valid").unwrap();
    assert_eq!(valid["reason"], "ServerNotUsable", "{valid}");
    assert!(
        valid["message"]
            .as_str()
            .unwrap()
            .starts_with("spec.serverRef: MCPServer main cannot be used: ")
            && valid["message"].as_str().unwrap().contains("main-token"),
        "{valid}"
    );

    // The optional server's MCPServer is deleted: an agent configured with it could not start,
    // so it leaves the configuration, and the assignment says which reference is dangling.
    Api::<custody::crd::MCPServer>::namespaced(client.clone(), &ns)
        .delete("extra", &DeleteParams::default())
        .await
        .unwrap();
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("Valid", "False"), ("Ready", "False")],
    )
    .await;
    let valid = condition(&aa, "Valid").unwrap();
    assert_eq!(valid["reason"], "UnknownServer", "{valid}");
    assert_eq!(
        valid["message"],
        format!(
            "spec.servers[1].serverRef: no MCPServer extra in namespace {}; left out of the configuration",
            &*ns
        )
    );
    let (servers, agents, _) = rendered(&client, &ns, "agent").await;
    assert!(servers.get("extra").is_none(), "{servers}");
    assert_eq!(agents, json!({"create-agent": ["main"]}));
}

/// The `Ready` condition of AgentAssignment `agent` once its message contains `text`.
async fn wait_ready_saying(client: &Client, ns: &str, text: &str) -> Value {
    eventually(
        &format!("AgentAssignment {ns}/agent: Ready saying {text:?}"),
        async || {
            let o = get(client, ns, "AgentAssignment", "agent").await.unwrap();
            let ready = condition(&o, "Ready").cloned().unwrap_or_default();
            if ready["message"].as_str().is_some_and(|m| m.contains(text)) {
                Ok(ready)
            } else {
                Err(ready.to_string())
            }
        },
    )
    .await
}

/// Fail closed: tools that may write (no `readOnlyHint`) and are not in `interruptOn` are not
/// in the rendered `tool_allowlist`; `PolicyCompliant=False` and a Warning Event name them.
#[tokio::test]
async fn write_tools_missing_from_interrupt_on_are_never_published() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "failclosed").await;
    let server = BasketServer::start(&[]);
    apply_assignment(
        &client,
        &ns,
        &server,
        json!({"agent": "create-agent", "servers": [{"serverRef": "basket"}],
               "interruptOn": ["basket_create_basket"]}),
    )
    .await;
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[
            ("Valid", "True"),
            ("PolicyCompliant", "False"),
            ("Ready", "False"),
        ],
    )
    .await;
    let policy = condition(&aa, "PolicyCompliant").unwrap();
    assert_eq!(
        policy["message"],
        "tools that may write are missing from interruptOn and withheld from the configuration: basket_add_item, basket_delete_basket"
    );
    assert_eq!(aa["status"]["toolCount"], 3, "{}", aa["status"]);
    // Valid counts what validates, and says the withheld ones are PolicyCompliant's to name.
    assert_eq!(
        condition(&aa, "Valid").unwrap()["message"],
        "5 tools validate for agent create-agent (before interruptOn: PolicyCompliant names any withheld)"
    );
    let (servers, _, _) = rendered(&client, &ns, "agent").await;
    let published: BTreeSet<&str> = servers["basket"]["tool_allowlist"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(
        published,
        BTreeSet::from(["count_baskets", "create_basket", "get_basket"])
    );
    let event = wait_event(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "WriteToolsWithheld",
        "Warning",
    )
    .await;
    let note = event.note.unwrap_or_default();
    assert!(
        note.contains("basket_add_item") && note.contains("basket_delete_basket"),
        "{note}"
    );

    // Approved: published, compliant, Ready.
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "agent",
            json!({"agent": "create-agent", "servers": [{"serverRef": "basket"}],
                   "interruptOn": ["basket_create_basket", "basket_add_item",
                                   "basket_delete_basket"]}),
        ),
    )
    .await;
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("PolicyCompliant", "True"), ("Ready", "True")],
    )
    .await;
    assert_eq!(aa["status"]["toolCount"], 5, "{}", aa["status"]);
    let (servers, _, _) = rendered(&client, &ns, "agent").await;
    assert_eq!(
        servers["basket"]["tool_allowlist"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
}

/// A name in `interruptOn` that no assigned server lists (a typo) is not silent:
/// `InterruptOnKnown=False` names it and the servers checked, with one Warning Event; what is
/// published is unchanged (the write tool the typo meant is still withheld). Fixing the typo
/// makes the condition `True`.
#[tokio::test]
async fn interrupt_on_names_no_server_lists_are_reported() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "interrupt-typo").await;
    let server = BasketServer::start(&[]);
    let spec = |interrupt_on: &[&str]| {
        json!({"agent": "create-agent", "servers": [{"serverRef": "basket"}],
               "interruptOn": interrupt_on})
    };
    apply_assignment(
        &client,
        &ns,
        &server,
        spec(&[
            "basket_create_baskett",
            "basket_add_item",
            "basket_delete_basket",
        ]),
    )
    .await;
    let aa = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("InterruptOnKnown", "False"), ("PolicyCompliant", "False")],
    )
    .await;
    let known = condition(&aa, "InterruptOnKnown").unwrap();
    assert_eq!(known["reason"], "UnknownInterruptTools", "{known}");
    assert_eq!(
        known["message"],
        "spec.interruptOn names tools no assigned server lists: basket_create_baskett \
         (servers checked: basket (basket_*); a final name is alias_tool)"
    );
    let policy = condition(&aa, "PolicyCompliant").unwrap();
    assert!(
        policy["message"]
            .as_str()
            .unwrap()
            .ends_with("withheld from the configuration: basket_create_basket"),
        "fail closed as before: {policy}"
    );
    wait_event(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        "UnknownInterruptTools",
        "Warning",
    )
    .await;
    // Another reconcile (a label change) publishes no second Event.
    c_label(&ns, "AgentAssignment", "agent");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let warned = events(&client, &ns, "AgentAssignment", "agent")
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("UnknownInterruptTools"))
        .count();
    assert_eq!(warned, 1);

    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "agent",
            spec(&[
                "basket_create_basket",
                "basket_add_item",
                "basket_delete_basket",
            ]),
        ),
    )
    .await;
    wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("InterruptOnKnown", "True"), ("Ready", "True")],
    )
    .await;
}

/// Labels `kind/name` in `ns` with kubectl, which makes the controller reconcile it again.
fn c_label(ns: &str, kind: &str, name: &str) {
    cluster::cluster()
        .kubectl(
            &[
                "label",
                "--overwrite",
                "-n",
                ns,
                &format!("{}/{name}", kind.to_lowercase()),
                "custody.dev/poke=1",
            ],
            None,
        )
        .ok();
}

/// The sweep CronJob bounds its runs (`startingDeadlineSeconds`, the Job's
/// `activeDeadlineSeconds` from `spec.sweepTimeoutSeconds`, `backoffLimit: 0`), and a sweep Job
/// that fails shows in the store's `LastSweepSucceeded` and `Ready` with the Job's reason and in
/// a Warning Event. The Job is a real one: created here from the CronJob's job template (what
/// the CronJob controller does at the scheduled time) with `sweepTimeoutSeconds: 1`; this
/// cluster has no node, so its pod never starts, and kube-controller-manager's Job controller
/// fails it with `DeadlineExceeded` after a second, as it would fail a stuck sweep.
#[tokio::test]
async fn a_sweep_job_past_its_deadline_shows_in_last_sweep_succeeded() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "deadline").await;
    let dsn = support::fresh_pg_database("e2e_deadline").await;
    support::write_some_fixtures(
        &BasketServer::start(&[]).url(),
        Db::Postgres(&dsn),
        None,
        "",
    );
    infra.apply_sweep_access(&client, &ns).await;
    let store = |timeout: Option<u32>| {
        let mut spec = json!({"backend": "postgres", "dsn": dsn});
        if let Some(t) = timeout {
            spec["sweepTimeoutSeconds"] = json!(t);
        }
        json!({"apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
               "metadata": {"name": "orders"}, "spec": spec})
    };
    apply(&client, &ns, &store(None)).await;
    let crons = Api::<CronJob>::namespaced(client.clone(), &ns);
    let job_spec = async |want: u64| {
        eventually("the CronJob's bounds", async || {
            let cron = crons
                .get_opt("orders-sweep")
                .await
                .unwrap()
                .ok_or("absent".to_owned())?;
            let cron = serde_json::to_value(cron).unwrap();
            let job = &cron["spec"]["jobTemplate"];
            if job["spec"]["activeDeadlineSeconds"] == want {
                Ok(cron)
            } else {
                Err(job.to_string())
            }
        })
        .await
    };
    let cron = job_spec(600).await;
    assert_eq!(cron["spec"]["startingDeadlineSeconds"], 300, "{cron}");
    assert_eq!(cron["spec"]["concurrencyPolicy"], "Forbid", "{cron}");
    assert_eq!(cron["spec"]["jobTemplate"]["spec"]["backoffLimit"], 0);
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Ready", "True"), ("LastSweepSucceeded", "Unknown")],
    )
    .await;
    assert_eq!(
        condition(&obj, "LastSweepSucceeded").unwrap()["reason"],
        "NoSweepFinished"
    );
    // the gauges of the sweep alerts: the default schedule's interval, no failure yet
    let series = |m: &str| format!("{m}{{namespace=\"{}\",name=\"orders\"}}", &*ns);
    let text = infra.metrics().await;
    assert_eq!(
        metric(&text, &series("custody_sweep_schedule_interval_seconds")),
        Some(900.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, &series("custody_sweep_last_failed")),
        Some(0.0),
        "{text}"
    );

    apply(&client, &ns, &store(Some(1))).await;
    let cron = job_spec(1).await;
    let template = &cron["spec"]["jobTemplate"];
    assert_eq!(
        template["metadata"]["labels"]["custody.dev/checkpoint-store"],
        "orders"
    );
    let job: k8s_openapi::api::batch::v1::Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "orders-sweep-manual", "labels": template["metadata"]["labels"],
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "CronJob",
                                          "name": "orders-sweep", "uid": cron["metadata"]["uid"],
                                          "controller": true}]},
        "spec": template["spec"],
    }))
    .unwrap();
    Api::<k8s_openapi::api::batch::v1::Job>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &job)
        .await
        .unwrap();
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("LastSweepSucceeded", "False"), ("Ready", "False")],
    )
    .await;
    let last = condition(&obj, "LastSweepSucceeded").unwrap();
    assert_eq!(last["reason"], "DeadlineExceeded", "{last}");
    assert!(
        last["message"]
            .as_str()
            .unwrap()
            .starts_with("Job orders-sweep-manual failed: DeadlineExceeded: it was still running after spec.sweepTimeoutSeconds (1 s), so Kubernetes stopped it"),
        "{last}"
    );
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "DeadlineExceeded"
    );
    eventually("custody_sweep_last_failed 1", async || {
        let text = infra.metrics().await;
        match metric(&text, &series("custody_sweep_last_failed")) {
            Some(1.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "DeadlineExceeded",
        "Warning",
    )
    .await;
    assert!(
        event
            .note
            .as_deref()
            .is_some_and(|n| n.contains("orders-sweep-manual")),
        "{event:?}"
    );
}

/// A sweep the CronJob controller skipped shows in the store: every minute, with
/// `startingDeadlineSeconds: 10` and a sweep that never ends (its namespace has no sweep
/// ServiceAccount, so the Job controller cannot create its pod and the Job stays active for its
/// `sweepTimeoutSeconds`), the next minute's run cannot start under `concurrencyPolicy:
/// Forbid` and kube-controller-manager skips it. The store turns `Scheduled=False` and
/// `Ready=False` with reason `MissedSchedule`, naming the run's time and the Job still running,
/// with a Warning Event.
#[tokio::test]
async fn a_sweep_the_cron_job_skipped_shows_in_the_store() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "missed").await;
    // Without the sweep ServiceAccount no run's Pod can be created (with the test node, a Pod
    // would run and end at once), so the first Job stays active and the next run is skipped.
    // The store says `SweepServiceAccountMissing` until then: `MissedSchedule` comes first.
    Api::<ServiceAccount>::namespaced(client.clone(), &ns)
        .delete("custody-sweep", &Default::default())
        .await
        .unwrap();
    let dsn = support::fresh_pg_database("e2e_missed").await;
    // LangGraph's tables, so that the missed run is what keeps the store from being Ready.
    support::write_some_fixtures(
        &BasketServer::start(&[]).url(),
        Db::Postgres(&dsn),
        None,
        "",
    );
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            json!({"backend": "postgres", "dsn": dsn, "schedule": "* * * * *",
                   "sweepTimeoutSeconds": 3600, "startingDeadlineSeconds": 10}),
        ),
    )
    .await;
    let crons = Api::<CronJob>::namespaced(client.clone(), &ns);
    let cron = eventually("the CronJob", async || {
        crons
            .get_opt("orders-sweep")
            .await
            .unwrap()
            .ok_or("absent".to_owned())
    })
    .await;
    let spec = cron.spec;
    assert_eq!(spec.starting_deadline_seconds, Some(10));
    assert_eq!(spec.time_zone.as_deref(), Some("UTC"));
    // Up to a minute for the first run, one more for the run it blocks, and its deadline.
    // (Longer than `eventually`'s deadline.)
    let obj = eventually_within(
        Duration::from_secs(200),
        "a skipped run in Scheduled",
        async || {
            let obj = get(&client, &ns, "CheckpointStore", "orders")
                .await
                .unwrap();
            match condition(&obj, "Scheduled") {
                Some(c) if c["status"] == "False" && c["reason"] == "MissedSchedule" => Ok(obj),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let scheduled = condition(&obj, "Scheduled").unwrap();
    let message = scheduled["message"].as_str().unwrap();
    let active = crons
        .get("orders-sweep")
        .await
        .unwrap()
        .status
        .unwrap()
        .active
        .unwrap();
    assert!(
        message.starts_with("the sweep due at ")
            && message
                .contains("did not start within startingDeadlineSeconds (10 s): Job orders-sweep-")
            && message.ends_with(
                " was still running and concurrencyPolicy is Forbid; the CronJob skipped it"
            )
            && active
                .iter()
                .any(|j| message.contains(j.name.as_deref().unwrap())),
        "{message}, active {active:?}"
    );
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "MissedSchedule"
    );
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "MissedSchedule",
        "Warning",
    )
    .await;
    assert!(
        event
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with("the sweep due at ")),
        "{event:?}"
    );
}

/// `(verb, resource)` of every request the serving controller made in `ns`, from the API
/// server's audit log (tests/cluster/up.sh writes it), in order.
fn controller_requests(infra: &Suite, ns: &str) -> Vec<(String, String)> {
    let user = format!(
        "system:serviceaccount:{}:{}-controller",
        infra.system_ns, infra.release
    );
    cluster::audit_events()
        .into_iter()
        .filter(|e| e["user"]["username"] == user.as_str() && e["objectRef"]["namespace"] == ns)
        .map(|e| {
            (
                e["verb"].as_str().unwrap_or_default().to_owned(),
                e["objectRef"]["resource"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect()
}

/// A recheck of a store whose CronJob already holds what custody sets writes nothing: over
/// several reconciles (each lists the store's Jobs) the CronJob's resourceVersion and
/// managedFields stay put and the audit log shows no patch of it; a spec change of the store
/// is still applied, and so is a field custody stops setting (the container's env of a
/// sharded sweep once `parallelism` is back to 1).
#[tokio::test]
async fn an_unchanged_store_does_not_rewrite_its_cron_job() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "steady-cron").await;
    let dsn = support::fresh_pg_database("e2e_steady_cron").await;
    support::write_some_fixtures(
        &BasketServer::start(&[]).url(),
        Db::Postgres(&dsn),
        None,
        "",
    );
    let store = |extra: Value| {
        object(
            "CheckpointStore",
            "orders",
            merged(json!({"backend": "postgres", "dsn": dsn}), extra),
        )
    };
    apply(&client, &ns, &store(json!({}))).await;
    wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Ready", "True")],
    )
    .await;
    // Whatever the first reconciles still had to write has been written.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let crons = Api::<CronJob>::namespaced(client.clone(), &ns);
    let before = crons.get("orders-sweep").await.unwrap();
    let count = |verb: &str, resource: &str| {
        controller_requests(infra, &ns)
            .iter()
            .filter(|(v, r)| v == verb && r == resource)
            .count()
    };
    let patches = count("patch", "cronjobs");
    // Each touch of the store's metadata is a watch event and so a reconcile.
    for poke in 0..4 {
        let reconciles = count("list", "jobs");
        let mut touched = store(json!({}));
        touched["metadata"]["annotations"] = json!({"custody.dev/test-poke": poke.to_string()});
        apply(&client, &ns, &touched).await;
        eventually("a reconcile of the touched store", async || {
            match count("list", "jobs") {
                n if n > reconciles => Ok(()),
                n => Err(format!("{n} Job lists")),
            }
        })
        .await;
    }
    let after = crons.get("orders-sweep").await.unwrap();
    assert_eq!(
        after.metadata.resource_version, before.metadata.resource_version,
        "the CronJob was written with nothing changed"
    );
    assert_eq!(
        after.metadata.managed_fields,
        before.metadata.managed_fields
    );
    assert_eq!(
        count("patch", "cronjobs"),
        patches,
        "{:?}",
        controller_requests(infra, &ns)
    );

    // What custody sets still reaches the CronJob.
    let cron_of = async |what: &str, check: &dyn Fn(&Value) -> bool| {
        eventually(what, async || {
            let cron = serde_json::to_value(crons.get("orders-sweep").await.unwrap()).unwrap();
            if check(&cron) {
                Ok(cron)
            } else {
                Err(cron.to_string())
            }
        })
        .await
    };
    apply(&client, &ns, &store(json!({"schedule": "*/7 * * * *"}))).await;
    cron_of("the new schedule", &|c| {
        c["spec"]["schedule"] == "*/7 * * * *"
    })
    .await;
    let container =
        |c: &Value| c["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0].clone();
    apply(
        &client,
        &ns,
        &store(json!({"schedule": "*/7 * * * *", "parallelism": 2})),
    )
    .await;
    cron_of("a sharded sweep", &|c| {
        container(c)["env"][0]["name"] == "CUSTODY_SWEEP_RUN"
    })
    .await;
    apply(
        &client,
        &ns,
        &store(json!({"schedule": "*/7 * * * *", "parallelism": 1})),
    )
    .await;
    cron_of("an unsharded sweep again", &|c| {
        container(c).get("env").is_none()
    })
    .await;
}

/// A store's first reconciles publish its `ConnectFailed` Event once: the reconcile the
/// CronJob's creation queues runs before the watch brings the first status write, and used to
/// decide its Events against the store as it was before that write. Several stores, since the
/// race is lost only sometimes.
#[tokio::test]
async fn a_first_reconcile_publishes_its_warning_once() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "warn-once").await;
    // A database that answers but holds no LangGraph tables.
    let empty = support::fresh_pg_database("e2e_no_tables").await;
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "no-tables",
            json!({"backend": "postgres", "dsn": empty}),
        ),
    )
    .await;
    let names: Vec<String> = (0..6).map(|i| format!("down-{i}")).collect();
    for name in &names {
        // Port 1 on loopback: refused at once.
        apply(
            &client,
            &ns,
            &object(
                "CheckpointStore",
                name,
                json!({"backend": "postgres", "dsn": "postgres://custody@127.0.0.1:1/checkpoints"}),
            ),
        )
        .await;
    }
    for name in &names {
        let obj = wait_conditions(
            &client,
            &ns,
            "CheckpointStore",
            name,
            &[("Reachable", "False")],
        )
        .await;
        assert_eq!(
            condition(&obj, "Reachable").unwrap()["reason"],
            "ConnectFailed"
        );
        wait_event(
            &client,
            &ns,
            "CheckpointStore",
            name,
            "ConnectFailed",
            "Warning",
        )
        .await;
    }
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "no-tables",
        &[
            ("SchemaCompatible", "False"),
            ("Reachable", "True"),
            ("Ready", "False"),
        ],
    )
    .await;
    let schema = condition(&obj, "SchemaCompatible").unwrap().clone();
    assert_eq!(schema["reason"], "UnsupportedSchema", "{schema}");
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "no-tables",
        "UnsupportedSchema",
        "Warning",
    )
    .await;
    assert_eq!(
        event.note.as_ref(),
        schema["message"].as_str().map(str::to_owned).as_ref()
    );
    // The reconciles the first one's writes queue have run.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_one_event(
        &client,
        &ns,
        "CheckpointStore",
        "no-tables",
        "UnsupportedSchema",
    )
    .await;
    for name in &names {
        let notes: Vec<_> = events(&client, &ns, "CheckpointStore", name)
            .await
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("ConnectFailed"))
            .map(|e| e.note)
            .collect();
        assert_eq!(notes.len(), 1, "{name}: {notes:?}");
    }
}

/// A schedule the API server takes but that never fires (the 30th of February) is
/// `Scheduled=False ScheduleNeverFires` naming `spec.schedule`, `Ready=False` for it, with a
/// Warning Event; a schedule that fires is `Scheduled=True` again.
#[tokio::test]
async fn a_schedule_that_never_fires_is_not_scheduled() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "never-fires").await;
    let dsn = support::fresh_pg_database("e2e_never_fires").await;
    support::write_some_fixtures(
        &BasketServer::start(&[]).url(),
        Db::Postgres(&dsn),
        None,
        "",
    );
    let store = |schedule: &str| {
        object(
            "CheckpointStore",
            "orders",
            json!({"backend": "postgres", "dsn": dsn, "schedule": schedule}),
        )
    };
    apply(&client, &ns, &store("0 0 30 2 *")).await;
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[
            ("Scheduled", "False"),
            ("Reachable", "True"),
            ("Ready", "False"),
        ],
    )
    .await;
    let scheduled = condition(&obj, "Scheduled").unwrap();
    assert_eq!(scheduled["reason"], "ScheduleNeverFires", "{scheduled}");
    assert_eq!(
        scheduled["message"],
        "spec.schedule: \"0 0 30 2 *\" has no run in the next 5 years (in UTC), so CronJob orders-sweep never starts a sweep; is the day of the month one that exists?"
    );
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "ScheduleNeverFires"
    );
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "ScheduleNeverFires",
        "Warning",
    )
    .await;
    assert!(
        event
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with("spec.schedule: ")),
        "{event:?}"
    );
    apply(&client, &ns, &store("0 0 29 2 *")).await;
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Scheduled", "True"), ("Ready", "True")],
    )
    .await;
    assert_eq!(
        condition(&obj, "Scheduled").unwrap()["reason"],
        "CronJobApplied"
    );
}

/// A store in a namespace without the sweep ServiceAccount is not `Scheduled` and says why
/// (its Jobs could not create their Pods, which the Job controller says only in the Job's own
/// Events), with one Warning Event; creating the ServiceAccount makes it `Scheduled` again.
#[tokio::test]
async fn a_store_without_the_sweep_service_account_is_not_scheduled() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "no-sweep-sa").await;
    let accounts = Api::<ServiceAccount>::namespaced(client.clone(), &ns);
    accounts
        .delete("custody-sweep", &Default::default())
        .await
        .unwrap();
    let dsn = support::fresh_pg_database("e2e_no_sweep_sa").await;
    support::write_some_fixtures(
        &BasketServer::start(&[]).url(),
        Db::Postgres(&dsn),
        None,
        "",
    );
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            json!({"backend": "postgres", "dsn": dsn}),
        ),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[
            ("Scheduled", "False"),
            ("Reachable", "True"),
            ("Ready", "False"),
        ],
    )
    .await;
    let scheduled = condition(&obj, "Scheduled").unwrap();
    assert_eq!(
        scheduled["reason"], "SweepServiceAccountMissing",
        "{scheduled}"
    );
    assert_eq!(
        scheduled["message"],
        format!(
            "ServiceAccount custody-sweep does not exist in namespace {}, so the Jobs of CronJob orders-sweep cannot create their Pods: add {} to the chart's sweep.namespaces (which creates it and its RoleBinding), or create them",
            &*ns, &*ns
        )
    );
    wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "SweepServiceAccountMissing",
        "Warning",
    )
    .await;
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "custody-sweep"}})).unwrap();
    accounts
        .create(&Default::default(), &account)
        .await
        .unwrap();
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Scheduled", "True"), ("Ready", "True")],
    )
    .await;
    assert_eq!(
        condition(&obj, "Scheduled").unwrap()["reason"],
        "CronJobApplied"
    );
    assert_one_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "SweepServiceAccountMissing",
    )
    .await;
}

/// `backend: sqlite` in a cluster is refused: no CronJob, `Ready`, `Reachable` and `Scheduled`
/// say why (a sweep Job has no volume with the database file).
#[tokio::test]
async fn a_sqlite_store_is_refused_in_a_cluster() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "sqlite").await;
    apply(
        &client,
        &ns,
        &json!({"apiVersion": "custody.dev/v1alpha1", "kind": "CheckpointStore",
                "metadata": {"name": "local"},
                "spec": {"backend": "sqlite", "dsn": "sqlite:///data/checkpoints.sqlite"}}),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "local",
        &[
            ("Ready", "False"),
            ("Scheduled", "False"),
            ("Reachable", "False"),
        ],
    )
    .await;
    for type_ in ["Ready", "Scheduled", "Reachable"] {
        let c = condition(&obj, type_).unwrap();
        assert_eq!(c["reason"], "SqliteNotSupportedInCluster", "{c}");
        assert!(
            c["message"]
                .as_str()
                .unwrap()
                .contains("spec.backend: sqlite is for local mode"),
            "{c}"
        );
    }
    assert!(
        Api::<CronJob>::namespaced(client.clone(), &ns)
            .get_opt("local-sweep")
            .await
            .unwrap()
            .is_none()
    );
    wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "local",
        "SqliteNotSupportedInCluster",
        "Warning",
    )
    .await;
}

/// Touches `kind/name`'s metadata (a watch event, so a reconcile) and waits until the serving
/// controller has made more `verb resource` requests in `ns` than before: the reconcile ran.
async fn poke_and_wait(
    client: &Client,
    ns: &str,
    object: &Value,
    poke: usize,
    request: (&str, &str),
) {
    let infra = infra();
    let count = || {
        controller_requests(infra, ns)
            .iter()
            .filter(|(v, r)| v == request.0 && r == request.1)
            .count()
    };
    let before = count();
    let mut touched = object.clone();
    touched["metadata"]["annotations"] = json!({"custody.dev/test-poke": poke.to_string()});
    apply(client, ns, &touched).await;
    eventually("a reconcile of the touched object", async || {
        match count() {
            n if n > before => Ok(()),
            n => Err(format!("{n} {request:?} requests")),
        }
    })
    .await;
}

/// A ConfigMap someone else created under the name an AgentAssignment renders
/// (`<assignment>-mcp-config`) is never written or adopted: the assignment is
/// `ConfigRendered=False ConfigMapNotOwned` naming it, not Ready, with one Warning Event and a
/// count; the ConfigMap stays exactly as it was, also after the assignment is deleted (no owner
/// reference for the garbage collector to follow). Once it is deleted, the assignment renders
/// its own.
#[tokio::test]
async fn a_config_map_custody_does_not_own_is_never_written() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "cm-not-owned").await;
    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let theirs: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "five-mcp-config"}, "data": {"mine": "yes"}}))
    .unwrap();
    let theirs = cms.create(&PostParams::default(), &theirs).await.unwrap();
    let server = BasketServer::start(&[]);
    apply(
        &client,
        &ns,
        &object("MCPServer", "basket", server_spec(&server.url())),
    )
    .await;
    let five = object(
        "AgentAssignment",
        "five",
        basket_assignment("five", &["get_basket"]),
    );
    apply(&client, &ns, &five).await;
    // One the same ConfigMap rules let through, to see the garbage collector at work below.
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "other",
            basket_assignment("other", &["get_basket"]),
        ),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "five",
        &[("ConfigRendered", "False"), ("Ready", "False")],
    )
    .await;
    let rendered = condition(&obj, "ConfigRendered").unwrap();
    assert_eq!(rendered["reason"], "ConfigMapNotOwned", "{rendered}");
    let message = "ConfigMap five-mcp-config exists and is not custody's (it has no controller owner reference): custody does not write or adopt it; delete or rename that ConfigMap, or give this AgentAssignment another name";
    assert_eq!(rendered["message"], message);
    let ready = condition(&obj, "Ready").unwrap();
    assert_eq!(
        (&ready["reason"], &ready["message"]),
        (&json!("ConfigMapNotOwned"), &json!(message))
    );
    for field in ["configMapName", "configDigest"] {
        assert!(obj["status"].get(field).is_none(), "{}", obj["status"]);
    }
    let event = wait_event(
        &client,
        &ns,
        "AgentAssignment",
        "five",
        "ConfigMapNotOwned",
        "Warning",
    )
    .await;
    assert_eq!(event.note.as_deref(), Some(message));
    let failures = metric(
        &infra.metrics().await,
        "custody_reconcile_failures_total{kind=\"AgentAssignment\",reason=\"ConfigMapNotOwned\"}",
    );
    assert!(failures.is_some_and(|n| n >= 1.0), "{failures:?}");
    // Later reconciles read the ConfigMap again, write nothing and publish nothing new.
    for poke in 0..2 {
        poke_and_wait(&client, &ns, &five, poke, ("get", "configmaps")).await;
    }
    assert_one_event(&client, &ns, "AgentAssignment", "five", "ConfigMapNotOwned").await;
    assert_eq!(
        serde_json::to_value(cms.get("five-mcp-config").await.unwrap()).unwrap(),
        serde_json::to_value(&theirs).unwrap(),
        "the ConfigMap was written"
    );
    wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "other",
        &[("Ready", "True")],
    )
    .await;
    for name in ["five", "other"] {
        kind_api(&client, &ns, "AgentAssignment")
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    eventually(
        "the garbage collector removed other's ConfigMap",
        async || match cms.get_opt("other-mcp-config").await.unwrap() {
            None => Ok(()),
            Some(_) => Err("still there".to_owned()),
        },
    )
    .await;
    assert_eq!(
        serde_json::to_value(cms.get("five-mcp-config").await.unwrap()).unwrap(),
        serde_json::to_value(&theirs).unwrap(),
        "the ConfigMap changed when the assignment was deleted"
    );

    // Once the ConfigMap is gone (nothing custody watches), the next recheck renders its own.
    apply(&client, &ns, &five).await;
    wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "five",
        &[("ConfigRendered", "False")],
    )
    .await;
    cms.delete("five-mcp-config", &DeleteParams::default())
        .await
        .unwrap();
    let obj = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "five",
        &[("ConfigRendered", "True"), ("Ready", "True")],
    )
    .await;
    let ours = cms.get("five-mcp-config").await.unwrap();
    let uid = obj["metadata"]["uid"].as_str().unwrap();
    assert!(
        ours.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|r| r.controller == Some(true) && r.uid == uid),
        "{:?}",
        ours.metadata
    );
}

/// A CronJob someone else created under the name of a store's sweep (`<store>-sweep`) is never
/// written or adopted: the store is `Scheduled=False CronJobNotOwned` naming it, not Ready
/// (`Reachable` and `SchemaCompatible` still checked), with one Warning Event and a count; the
/// CronJob stays exactly as it was, also after the store is deleted.
#[tokio::test]
async fn a_cron_job_custody_does_not_own_is_never_written() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "cron-not-owned").await;
    let crons = Api::<CronJob>::namespaced(client.clone(), &ns);
    let theirs: CronJob = serde_json::from_value(json!({
        "metadata": {"name": "adopt-sweep"},
        "spec": {"schedule": "0 3 * * *", "jobTemplate": {"spec": {"template": {"spec": {
            "restartPolicy": "OnFailure",
            "containers": [{"name": "adopt-sweep", "image": "busybox", "command": ["echo", "backup"]}],
        }}}}},
    }))
    .unwrap();
    let theirs = crons.create(&PostParams::default(), &theirs).await.unwrap();
    // What custody would merge into or take over; the CronJob controller writes the status.
    let shape = |c: &CronJob| {
        json!([
            c.spec,
            c.metadata.labels,
            c.metadata.annotations,
            c.metadata.owner_references
        ])
    };
    assert!(theirs.metadata.owner_references.is_none());
    let dsn = support::fresh_pg_database("e2e_cron_not_owned").await;
    support::write_some_fixtures(
        &BasketServer::start(&[]).url(),
        Db::Postgres(&dsn),
        None,
        "",
    );
    let store = |name: &str| {
        object(
            "CheckpointStore",
            name,
            json!({"backend": "postgres", "dsn": dsn}),
        )
    };
    apply(&client, &ns, &store("adopt")).await;
    // One whose CronJob custody creates, to see the garbage collector at work below.
    apply(&client, &ns, &store("other")).await;
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "adopt",
        &[
            ("Scheduled", "False"),
            ("Reachable", "True"),
            ("SchemaCompatible", "True"),
            ("Ready", "False"),
        ],
    )
    .await;
    let scheduled = condition(&obj, "Scheduled").unwrap();
    assert_eq!(scheduled["reason"], "CronJobNotOwned", "{scheduled}");
    let message = "CronJob adopt-sweep exists and is not custody's (it has no controller owner reference): custody does not write or adopt it; delete or rename that CronJob, or give this CheckpointStore another name";
    assert_eq!(scheduled["message"], message);
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "CronJobNotOwned"
    );
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "adopt",
        "CronJobNotOwned",
        "Warning",
    )
    .await;
    assert_eq!(event.note.as_deref(), Some(message));
    let failures = metric(
        &infra.metrics().await,
        "custody_reconcile_failures_total{kind=\"CheckpointStore\",reason=\"CronJobNotOwned\"}",
    );
    assert!(failures.is_some_and(|n| n >= 1.0), "{failures:?}");
    // Later reconciles look the CronJob up again, write nothing and publish nothing new.
    for poke in 0..2 {
        poke_and_wait(&client, &ns, &store("adopt"), poke, ("list", "jobs")).await;
    }
    assert_one_event(&client, &ns, "CheckpointStore", "adopt", "CronJobNotOwned").await;
    assert_eq!(
        shape(&crons.get("adopt-sweep").await.unwrap()),
        shape(&theirs),
        "the CronJob was written"
    );

    wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "other",
        &[("Scheduled", "True")],
    )
    .await;
    for name in ["adopt", "other"] {
        kind_api(&client, &ns, "CheckpointStore")
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    eventually(
        "the garbage collector removed other's CronJob",
        async || match crons.get_opt("other-sweep").await.unwrap() {
            None => Ok(()),
            Some(_) => Err("still there".to_owned()),
        },
    )
    .await;
    assert_eq!(
        shape(&crons.get("adopt-sweep").await.unwrap()),
        shape(&theirs),
        "the CronJob changed when the store was deleted"
    );
}

/// HandleClass has a `Ready` condition (`kubectl wait --for=condition=Ready` works), a Warning
/// Event when it is not valid, and the `Ready` reason in `kubectl get` (message with `-o wide`).
#[tokio::test]
async fn handle_class_ready_condition_events_and_columns() {
    let _shared = ISOLATION.read().await;
    infra();
    let client = client().await;
    let ns = TestNs::new(&client, "hcready").await;
    let class =
        std::fs::read_to_string(cluster::repo().join("deploy/examples/basket/handleclass.yaml"))
            .unwrap();
    let class = cluster::yaml_docs(&class).remove(0);
    let name = class["metadata"]["name"].as_str().unwrap().to_owned();
    let server_ref = class["spec"]["serverRef"].as_str().unwrap().to_owned();
    apply(&client, &ns, &class).await;
    let obj = wait_conditions(&client, &ns, "HandleClass", &name, &[("Ready", "False")]).await;
    assert_eq!(condition(&obj, "Ready").unwrap()["reason"], "UnknownServer");
    let event = wait_event(
        &client,
        &ns,
        "HandleClass",
        &name,
        "UnknownServer",
        "Warning",
    )
    .await;
    assert!(
        event
            .note
            .as_deref()
            .is_some_and(|n| n.starts_with("spec.serverRef: no MCPServer")),
        "{event:?}"
    );
    let c = cluster::cluster();
    let table = c
        .kubectl(&["get", "handleclasses", "-n", &ns, &name], None)
        .ok();
    assert!(
        table.contains("READY") && table.contains("UnknownServer"),
        "{table}"
    );
    let wide = c
        .kubectl(
            &["get", "handleclasses", "-n", &ns, &name, "-o", "wide"],
            None,
        )
        .ok();
    assert!(wide.contains("spec.serverRef: no MCPServer"), "{wide}");

    let server = BasketServer::start(&[]);
    apply(
        &client,
        &ns,
        &object("MCPServer", &server_ref, json!({"url": server.url()})),
    )
    .await;
    c.kubectl(
        &[
            "wait",
            "-n",
            &ns,
            &format!("handleclass/{name}"),
            "--for=condition=Ready",
            "--timeout=60s",
        ],
        None,
    )
    .ok();

    // A probe that may write: Ready (a warning, not a failure), ProbeReadOnly False, an Event.
    let mut writing = class.clone();
    writing["metadata"]["name"] = json!("writing-probe");
    writing["spec"]["probe"]["tool"] = json!("create_basket");
    apply(&client, &ns, &writing).await;
    wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "writing-probe",
        &[("Ready", "True"), ("ProbeReadOnly", "False")],
    )
    .await;
    wait_event(
        &client,
        &ns,
        "HandleClass",
        "writing-probe",
        "ProbeMayWrite",
        "Warning",
    )
    .await;

    // A probe tool that declares itself destructive (`delete_basket`: destructiveHint, no
    // readOnlyHint) is never called, so the class could decide nothing: not valid, not Ready,
    // one Warning Event naming the field, the tool and the server.
    let mut destructive = class.clone();
    destructive["metadata"]["name"] = json!("destructive-probe");
    destructive["spec"]["probe"]["tool"] = json!("delete_basket");
    apply(&client, &ns, &destructive).await;
    let obj = wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "destructive-probe",
        &[("Valid", "False"), ("Ready", "False")],
    )
    .await;
    let valid = condition(&obj, "Valid").unwrap();
    assert_eq!(valid["reason"], "ProbeToolDestructive", "{valid}");
    assert_eq!(
        valid["message"],
        format!(
            "spec.probe.tool: tool delete_basket of MCPServer {server_ref} declares destructiveHint (and not readOnlyHint); custody never calls a destructive tool as a probe, so this class could decide nothing: name a read-only tool"
        )
    );
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "ProbeToolDestructive"
    );
    wait_event(
        &client,
        &ns,
        "HandleClass",
        "destructive-probe",
        "ProbeToolDestructive",
        "Warning",
    )
    .await;

    // A server that never answered: ServerNotDiscovered with its cause, and a new Event when
    // the cause changes (refused, then a server that wants a bearer token: issue 15, item 8).
    let closed = support::free_port();
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "never-up",
            json!({"url": format!("http://127.0.0.1:{closed}/mcp"), "timeoutSeconds": 2}),
        ),
    )
    .await;
    let mut undiscovered = class.clone();
    undiscovered["metadata"]["name"] = json!("undiscovered");
    undiscovered["spec"]["serverRef"] = json!("never-up");
    apply(&client, &ns, &undiscovered).await;
    wait_warning_saying(
        &client,
        &ns,
        "HandleClass",
        "undiscovered",
        "ServerNotDiscovered",
        "its checks fail (ConnectionRefused",
    )
    .await;
    let _locked = BasketServer::on(closed, &[("BASKET_REQUIRE_BEARER", "s3cret")]);
    wait_warning_saying(
        &client,
        &ns,
        "HandleClass",
        "undiscovered",
        "ServerNotDiscovered",
        "its checks fail (AuthFailed",
    )
    .await;
    let obj = get(&client, &ns, "HandleClass", "undiscovered")
        .await
        .unwrap();
    let valid = condition(&obj, "Valid").unwrap();
    assert_eq!(
        (&valid["status"], &valid["reason"]),
        (&json!("Unknown"), &json!("ServerNotDiscovered")),
        "{valid}"
    );

    // Once each: a recheck with the same cause publishes nothing more.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let count = |all: &[k8s_openapi::api::events::v1::Event], reason: &str| {
        all.iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .count()
    };
    let all = events(&client, &ns, "HandleClass", "destructive-probe").await;
    assert_eq!(count(&all, "ProbeToolDestructive"), 1, "{all:?}");
    let all = events(&client, &ns, "HandleClass", "undiscovered").await;
    assert!(
        all.iter().all(|e| e.series.is_none()) && count(&all, "ServerNotDiscovered") == 2,
        "one Event per cause: {all:?}"
    );
}

/// Issue 17, items 11 and 13, against the real API server: a server with tools whose names
/// cannot be exposed keeps its other tools and gets one `ToolsLeftOut` Warning Event naming
/// them; a Python SDK server answering notifications with 200 instead of 202 is Ready, with
/// `status.conformanceWarnings`, `Conformant=False NonConformant`, a `NonConformant` Warning
/// Event and `custody_server_conformance_warnings`; the same server answering 202 is
/// `Conformant=True` with no such Event.
#[tokio::test(flavor = "multi_thread")]
async fn left_out_tools_and_conformance_warnings_reach_events_status_and_metrics() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "e2e-conformance").await;
    let names = support::Peer::misbehaving("bad_tool_names");
    let quirky = BasketServer::start(&[("BASKET_NOTIFICATION_STATUS", "200")]);
    let plain = BasketServer::start(&[]);
    for (name, url) in [
        ("names", names.url()),
        ("quirky", quirky.url()),
        ("plain", plain.url()),
    ] {
        apply(
            &client,
            &ns,
            &object(
                "MCPServer",
                name,
                json!({"url": url, "mode": "legacy", "timeoutSeconds": 5}),
            ),
        )
        .await;
    }

    let event = wait_event(
        &client,
        &ns,
        "MCPServer",
        "names",
        "ToolsLeftOut",
        "Warning",
    )
    .await;
    let note = event.note.unwrap_or_default();
    assert!(
        note.starts_with("3 tools left out: \"basket.peek\": exposed as \"names_basket.peek\""),
        "{note}"
    );
    assert!(note.contains("\"baskets/list\""), "{note}");
    let obj = wait_conditions(&client, &ns, "MCPServer", "names", &[("Ready", "True")]).await;
    assert_eq!(obj["status"]["toolCount"], 2, "{}", obj["status"]);

    let quirky_obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "quirky",
        &[("Ready", "True"), ("Conformant", "False")],
    )
    .await;
    let conformant = condition(&quirky_obj, "Conformant").unwrap();
    assert_eq!(conformant["reason"], "NonConformant", "{conformant}");
    assert_eq!(
        quirky_obj["status"]["conformanceWarnings"],
        json!([{
            "kind": "notification_status",
            "message": "notifications/initialized was answered with HTTP 200 OK; the Streamable \
                        HTTP transport requires 202 Accepted for a notification"
        }])
    );
    let event = wait_event(
        &client,
        &ns,
        "MCPServer",
        "quirky",
        "NonConformant",
        "Warning",
    )
    .await;
    assert!(
        event
            .note
            .unwrap_or_default()
            .starts_with("1 deviations from the MCP specification custody tolerated: notification_status: notifications/initialized was answered with HTTP 200 OK"),
    );

    let plain_obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "plain",
        &[("Ready", "True"), ("Conformant", "True")],
    )
    .await;
    assert_eq!(
        condition(&plain_obj, "Conformant").unwrap()["reason"],
        "NoDeviations"
    );
    assert!(
        plain_obj["status"].get("conformanceWarnings").is_none(),
        "{}",
        plain_obj["status"]
    );

    let series = |name: &str| {
        format!(
            "custody_server_conformance_warnings{{namespace=\"{}\",name=\"{name}\",kind=\"notification_status\"}}",
            &*ns
        )
    };
    let text = infra.metrics().await;
    assert_eq!(metric(&text, &series("quirky")), Some(1.0), "{text}");
    assert_eq!(metric(&text, &series("plain")), Some(0.0), "{text}");
    // Said once: the health checks and rediscoveries that follow repeat neither Event.
    tokio::time::sleep(Duration::from_secs(HEALTH_INTERVAL as u64 + 2)).await;
    for (name, reason) in [("names", "ToolsLeftOut"), ("quirky", "NonConformant")] {
        let n = events(&client, &ns, "MCPServer", name)
            .await
            .iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .count();
        assert_eq!(n, 1, "{name}: {reason}");
    }
    assert!(
        !events(&client, &ns, "MCPServer", "plain")
            .await
            .iter()
            .any(|e| e.reason.as_deref() == Some("NonConformant"))
    );
}
