//! Controller rows of issue 9's fault matrix and bad-input matrix, against a real kube-apiserver
//! (v1.37, with etcd and kube-controller-manager, started by tests/run.sh). The real `custody
//! controller` runs out of cluster as the chart's controller ServiceAccount; its peers are real
//! MCP servers (tests/py/basket_server.py, the `slow_list` case of
//! tests/py/misbehaving_server.py) and a real PostgreSQL holding LangGraph's tables.
//!
//! | row | test | fault or bad input | what must hold |
//! |---|---|---|---|
//! | F1 | [`leader_lease_taken_mid_discovery`] | the Lease passes to another replica while the leader's discovery against a slow server is in flight | the old leader writes no status after the takeover; it reports the loss (log, `custody_leader` 0, `/readyz` body `ready: standby`) and stops reconciling; the new leader completes the discovery |
//! | F1b | [`paused_leader_replaced_mid_discovery`] | the leader is paused (SIGSTOP) while its discovery is in flight; a standby takes the expired Lease; the old leader resumes | the same, with the standby completing the discovery |
//! | F2 | [`secret_deleted_while_referenced`] | the `headersFrom` Secret of an MCPServer and the `dsnFrom` Secret of a CheckpointStore are deleted | conditions name the Secret and key, never the value; Warning Events; not ready; counted in `custody_reconcile_failures_total`; other objects stay ready; recreating the Secrets recovers both without a restart, within seconds (a watch, not the 5-minute recheck) |
//! | F3 | [`watches_refused_by_rbac_make_the_controller_not_ready`] | the controller's ServiceAccount may read the CRDs but not list or watch what it reconciles | the leader is not ready: `/readyz` answers 503 naming each controller whose watch fails and the 403; `custody_reconcile_failures_total{reason="watch_forbidden"}` counts them |
//! | F4 | [`crds_of_another_release_are_named_and_their_refusals_reach_the_objects`] | an installed CRD of another release (its `custody.dev/schema-sha256` differs; its schema refuses a status field) | at startup: an ERROR log and `/readyz` 503 naming the CRD and what to apply, ready once applied without a restart; a refused status write: a Warning Event `StatusRefused` on the object naming the field, and a count |
//! | F5 | [`a_config_map_refused_by_rbac_shows_on_the_assignment`] | RBAC refuses the controller's ConfigMap write | the AgentAssignment is `ConfigRendered=False`, `Ready=False`, reason `ConfigMapRefused` naming the ConfigMap and the 403; a Warning Event; a count; rendered within seconds once RBAC allows it |
//! | F6 | [`a_cron_job_refused_by_rbac_shows_on_the_store`] | RBAC refuses the controller's sweep CronJob write | the CheckpointStore is `Scheduled=False`, `Ready=False`, reason `CronJobRefused` naming the CronJob, the 403 and what the ClusterRole must grant; `Reachable` and `SchemaCompatible` still written; a Warning Event; a count; scheduled at the next recheck once RBAC allows it |
//! | F7 | [`a_reconcile_refused_by_rbac_is_an_event_on_the_object`] | RBAC refuses an API call a reconcile makes (the ClusterRole loses `list` on Jobs) | a Warning Event `ReconcileForbidden` on the CheckpointStore naming the 403 and the resource, and `Ready=False ReconcileForbidden` with the same message; counted as `reason="forbidden"`; Ready once RBAC allows it |
//! | F8 | [`a_refused_status_write_backs_off`] | an installed CRD older than the controller refuses every status write of an object (HTTP 422) | the object's status writes back off (15 s, 30 s, 60 s, … 5 min) instead of retrying at each reconcile; one WARN line per back-off step; every refusal counted; written at the next step once the CRD is right |
//! | F9 | [`a_sweep_pod_no_scheduler_looks_at_shows_on_the_store`] | a sweep Job's Pod names a `schedulerName` no scheduler serves (the test cluster runs none), so it stays Pending with no node and no `PodScheduled` condition | after the grace period the store is `LastSweepSucceeded=False`, `Ready=False`, reason `SweepPodPending` naming the Pod and the schedulerName, long before `sweepTimeoutSeconds` |
//! | F11 | [`a_silent_database_holds_back_no_store_condition`] | a store's DSN allows 300 s to connect (`connect_timeout=300`) to a port that never answers | the controller's check gives up after its own 15 s: `Reachable=False ConnectFailed` saying so, and `Scheduled`, within a minute |
//! | F10 | [`a_watch_whose_rbac_is_revoked_makes_the_controller_not_ready`] | the controller's ClusterRole loses `watch` on Jobs while its watch of them streams | within a minute `/readyz` answers 503 naming the verb and `jobs.batch`, counted as `watch_forbidden`; 200 again once the verb is restored |
//! | B1–B52 | [`bad_resources_are_rejected_or_named_in_conditions`] ([`bad_input_rows`]) | every kind with missing, wrong-typed, out-of-range, contradictory or dangling fields | the API server rejects it with a message naming the field, or (cross-object references, Secrets, tools) the controller sets a condition whose message names the field path; the good objects of the namespace still reconcile; each failure is counted |
//!
//! One controller serves the whole file, as in a cluster: it watches every namespace, so two
//! controllers would both reconcile every object. Tests hold a shared lock; F1 and F1b hold it
//! alone, replace the serving controller and leave the replica that took over serving the rest.

#[path = "support/apiserver.rs"]
mod apiserver;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/suite.rs"]
mod suite;
mod support;

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use apiserver::{
    TestNs, apply, assert_one_event, client, condition, eventually, eventually_within, get,
    kind_api, visible_text, wait_conditions, wait_event,
};
use cluster::{ControllerProcess, metric, metric_sum};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::{Value, json};
use suite::{ISOLATION, LEASE, Suite};
use support::fixtures::{
    basket_assignment, basket_class, merged, object, secret, server_spec, store_from,
};
use support::{BasketServer, Db, Peer};

/// `--lease-seconds` of the controllers: long, so the lease manager's own renewal (every
/// 40 s) cannot be what notices a takeover in F1; the check before each write must.
const LEASE_SECONDS: i32 = 60;
/// `--unscheduled-grace-seconds` of the controllers: F9 need not wait the 2 minutes.
const UNSCHEDULED_GRACE_SECONDS: u64 = 5;
/// How long the slow server takes to answer `tools/list` in F1.
const LIST_DELAY_MS: u64 = 6000;

/// Starts a replica with [`LEASE_SECONDS`].
fn start(infra: &Suite, identity: &str) -> ControllerProcess {
    start_with(infra, identity, LEASE_SECONDS)
}

fn start_with(infra: &Suite, identity: &str, lease_seconds: i32) -> ControllerProcess {
    infra.replica(
        identity,
        &[
            "--lease-seconds",
            &lease_seconds.to_string(),
            "--unscheduled-grace-seconds",
            &UNSCHEDULED_GRACE_SECONDS.to_string(),
        ],
    )
}

/// The chart's RBAC and the controller every test shares.
fn infra() -> &'static Suite {
    static INFRA: OnceLock<Suite> = OnceLock::new();
    INFRA.get_or_init(|| {
        Suite::install("faults", |suite| {
            start(suite, &format!("faults-first-{}", std::process::id()))
        })
    })
}

/// Waits for a Warning Event of this reason about `kind/name`; returns its note.
async fn wait_warning(client: &Client, ns: &str, kind: &str, name: &str, reason: &str) -> String {
    wait_event(client, ns, kind, name, reason, "Warning")
        .await
        .note
        .unwrap_or_default()
}

/// `custody_reconcile_failures_total{kind,reason}` of the serving controller.
fn failures(metrics: &str, kind: &str, reason: &str) -> f64 {
    metric(
        metrics,
        &format!("custody_reconcile_failures_total{{kind=\"{kind}\",reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

/// A PostgreSQL database holding LangGraph's checkpoint tables (written by the real graph).
async fn langgraph_database(tag: &str) -> String {
    let dsn = support::fresh_pg_database(tag).await;
    let server = BasketServer::start(&[]);
    support::write_some_fixtures(&server.url(), Db::Postgres(&dsn), Some("t-live"), "");
    dsn
}

/// Applies CheckpointStore `orders` on `dsn`, swept once a year: its CronJob exists and starts
/// nothing during a test.
async fn apply_yearly_store(client: &Client, ns: &str, dsn: &str) {
    apply(
        client,
        ns,
        &object(
            "CheckpointStore",
            "orders",
            json!({"backend": "postgres", "dsn": dsn, "schedule": "0 0 1 1 *"}),
        ),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// F1: the leader lease taken over in the middle of a reconcile.

/// tests/py/misbehaving_server.py in its `slow_list` case, its request log in a file.
struct SlowServer {
    peer: Peer,
    log: PathBuf,
}

impl SlowServer {
    fn start(dir: &std::path::Path) -> Self {
        let log = dir.join(format!("slow-server-{}.txt", uuid::Uuid::new_v4().simple()));
        let peer = Peer::misbehaving_logged(
            "slow_list",
            &[("MISBEHAVE_LIST_DELAY_MS", &LIST_DELAY_MS.to_string())],
            &log,
        );
        Self { peer, log }
    }

    fn url(&self) -> String {
        self.peer.url()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Applies MCPServer `slow` for this server and waits until the serving leader's
    /// `tools/list` (the first listing) is in flight.
    async fn discovery_in_flight(&self, client: &Client, ns: &str) {
        let spec = json!({"url": self.url(), "mode": "legacy", "timeoutSeconds": 30});
        apply(client, ns, &object("MCPServer", "slow", spec)).await;
        eventually("the leader's tools/list in flight", async || {
            let log = self.log();
            if log.contains("listing 1 started") {
                Ok(())
            } else {
                Err(log)
            }
        })
        .await;
    }
}

/// Asserts that the replica's reconcile counter stays put for 5 s.
async fn reconciles_no_more(replica: &ControllerProcess, who: &str) {
    let before = metric_sum(&replica.metrics(), "custody_reconciles_total");
    // A fixed window on purpose: what is under test is that nothing happens in it.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        metric_sum(&replica.metrics(), "custody_reconciles_total"),
        before,
        "{who} still reconciles:\n{}",
        replica.log_tail()
    );
}

/// Waits until MCPServer `slow` is Ready with the second listing's catalog (the discovery of
/// the replica that took over); returns it.
async fn second_listing_ready(client: &Client, ns: &str, what: &str) -> Value {
    eventually(what, async || {
        let obj = get(client, ns, "MCPServer", "slow").await.unwrap();
        let names = tools(&obj);
        match condition(&obj, "Ready") {
            Some(c) if c["status"] == "True" && names.contains(&"slow_listing_2".to_owned()) => {
                Ok(obj)
            }
            other => Err(format!("Ready {other:?}, tools {names:?}")),
        }
    })
    .await
}

/// Collects every modification of one object from a resourceVersion on, until dropped.
struct Recorder {
    seen: Arc<Mutex<Vec<Value>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Recorder {
    /// Starts at the object's current resourceVersion.
    async fn start(api: &Api<DynamicObject>, name: &str) -> Self {
        let rv = api
            .get(name)
            .await
            .unwrap()
            .metadata
            .resource_version
            .unwrap();
        let wp = WatchParams::default()
            .fields(&format!("metadata.name={name}"))
            .timeout(290);
        let stream = api.watch(&wp, &rv).await.unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(WatchEvent::Modified(o)) => {
                        sink.lock().unwrap().push(serde_json::to_value(o).unwrap());
                    }
                    Ok(WatchEvent::Bookmark(_)) => {}
                    other => panic!("watch: {other:?}"),
                }
            }
        });
        Self { seen, task }
    }

    fn seen(&self) -> Vec<Value> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The exposed tool names in an MCPServer's status.
fn tools(obj: &Value) -> Vec<String> {
    obj["status"]["tools"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|t| t["exposedName"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// F1. The leader's discovery is in flight (the server answers `tools/list` after 6 s) when the
/// Lease is written for another replica, as a replica that won an election writes it. The old
/// leader's lease manager would notice only at its renewal, 40 s later; its discovery finishes
/// long before. It must write nothing after the takeover (the server's listing number tells
/// whose result a status carries), report the loss, and stop reconciling; the new replica
/// takes over at once and completes the discovery.
#[tokio::test]
async fn leader_lease_taken_mid_discovery() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-lease").await;
    let slow = SlowServer::start(&infra.dir);
    let mut current = infra.current.lock().await;
    let mut old = current.take().expect("the serving controller");
    assert_eq!(metric(&old.metrics(), "custody_leader"), Some(1.0));

    // The lease manager renews 2/3 into the lease (40 s here); a renewal inside the discovery
    // window would notice the takeover before the check before the write does, which is this
    // test's subject. So the takeover follows a fresh renewal.
    let leases = infra.leases(&client);
    let renewed = |l: Lease| l.spec.and_then(|s| s.renew_time).map(|t| t.0);
    let before = renewed(leases.get(LEASE).await.unwrap());
    eventually_within(
        Duration::from_secs(2 * LEASE_SECONDS as u64),
        "the serving controller renews its Lease",
        async || match renewed(leases.get(LEASE).await.unwrap()) {
            now if now == before => Err(format!("renewed at {now:?} still")),
            _ => Ok(()),
        },
    )
    .await;

    slow.discovery_in_flight(&client, &ns).await;

    // The takeover: the Lease now names a replica that is not running yet.
    let new_identity = format!("faults-takeover-{}", std::process::id());
    let transitions = leases.get(LEASE).await.unwrap().spec.unwrap_or_default();
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    );
    leases
        .patch(
            LEASE,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {
                "holderIdentity": new_identity, "acquireTime": now, "renewTime": now,
                "leaseDurationSeconds": LEASE_SECONDS,
                "leaseTransitions": transitions.lease_transitions.unwrap_or(0) + 1}})),
        )
        .await
        .unwrap();
    let taken = Instant::now();
    let writes = Recorder::start(&kind_api(&client, &ns, "MCPServer"), "slow").await;
    let new = start(infra, &new_identity);

    // The new leader completes the work.
    let obj = second_listing_ready(&client, &ns, "the new leader's catalog in status").await;
    assert_eq!(obj["status"]["observedGeneration"], 1);
    assert_eq!(metric(&new.metrics(), "custody_leader"), Some(1.0));
    assert!(metric_sum(&new.metrics(), "custody_reconciles_total") >= 1.0);

    // No write after the takeover carries the old leader's listing.
    let seen = writes.seen();
    assert!(!seen.is_empty(), "the new leader's status write was seen");
    for w in &seen {
        let names = tools(w);
        assert!(
            !names.contains(&"slow_listing_1".to_owned()),
            "a write after the takeover carries the old leader's listing: {}",
            w["status"]
        );
    }
    // The old leader: its discovery completed, the check before the write found the Lease
    // gone, and it says so ...
    eventually("the old leader reports the loss", async || {
        let m = old.metrics();
        let ready = old.get("/readyz");
        let log = old.log_text();
        match (metric(&m, "custody_leader"), &ready) {
            (Some(0.0), Some((200, body)))
                if body == "ready: standby"
                    && log.contains("lost the leader lease")
                    && log.contains("seen before a write") =>
            {
                Ok(())
            }
            other => Err(format!("custody_leader, /readyz: {other:?}")),
        }
    })
    .await;
    eprintln!("loss reported {:?} after the takeover", taken.elapsed());
    assert!(
        taken.elapsed() < Duration::from_secs(30),
        "the old leader noticed only at its lease renewal"
    );
    assert!(
        slow.log().contains("listing 1\n") || slow.log().contains("-> 200 SSE, listing 1"),
        "the old leader's listing was answered (its write was refused, not cancelled):\n{}",
        slow.log()
    );

    // ... and reconciles no more.
    reconciles_no_more(&old, "the old leader").await;
    assert_eq!(
        infra.lease_holder(&client).await.as_deref(),
        Some(new_identity.as_str())
    );
    let exit = old.terminate();
    assert!(exit.success(), "{exit}:\n{}", old.log_tail());
    *current = Some(new);
}

/// F1b. The realistic takeover: the leader is paused (SIGSTOP) while its discovery is in
/// flight, a standby takes the expired Lease and completes the discovery, then the old leader
/// runs again with its discovery's answer waiting. It must write nothing, report the loss and
/// stop. Both replicas run with 10 s leases here, so the takeover takes seconds.
#[tokio::test]
async fn paused_leader_replaced_mid_discovery() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-paused").await;
    let slow = SlowServer::start(&infra.dir);
    let mut current = infra.current.lock().await;
    let mut serving = current.take().expect("the serving controller");
    let exit = serving.terminate();
    assert!(
        exit.success(),
        "{exit}:
{}",
        serving.log_tail()
    );
    let pid = std::process::id();
    let mut paused = start_with(infra, &format!("faults-paused-{pid}"), 10);
    eventually("the first replica leads", async || {
        match metric(&paused.metrics(), "custody_leader") {
            Some(1.0) => Ok(()),
            other => Err(format!("custody_leader {other:?}")),
        }
    })
    .await;
    let standby = start_with(infra, &format!("faults-standby-{pid}"), 10);
    assert_eq!(metric(&standby.metrics(), "custody_leader"), Some(0.0));

    slow.discovery_in_flight(&client, &ns).await;
    paused.signal("STOP");
    let writes = Recorder::start(&kind_api(&client, &ns, "MCPServer"), "slow").await;

    // The standby takes the expired Lease and completes the discovery.
    let obj = second_listing_ready(&client, &ns, "the standby's catalog in status").await;
    assert_eq!(obj["status"]["observedGeneration"], 1);
    assert_eq!(metric(&standby.metrics(), "custody_leader"), Some(1.0));

    // The old leader runs again: it reports the loss, writes nothing and stops reconciling.
    paused.signal("CONT");
    eventually("the resumed replica reports the loss", async || {
        let m = paused.metrics();
        let ready = paused.get("/readyz");
        match (metric(&m, "custody_leader"), &ready) {
            (Some(0.0), Some((200, body)))
                if body == "ready: standby"
                    && paused.log_text().contains("lost the leader lease") =>
            {
                Ok(())
            }
            other => Err(format!("custody_leader, /readyz: {other:?}")),
        }
    })
    .await;
    reconciles_no_more(&paused, "the resumed replica").await;
    for w in writes.seen() {
        assert!(
            !tools(&w).contains(&"slow_listing_1".to_owned()),
            "a write after the pause carries the paused leader's listing: {}",
            w["status"]
        );
    }
    assert_eq!(
        infra.lease_holder(&client).await.as_deref(),
        Some(standby.identity.as_str())
    );
    let exit = paused.terminate();
    assert!(exit.success(), "{exit}:\n{}", paused.log_tail());
    *current = Some(standby);
}

// ---------------------------------------------------------------------------------------------
// F2: Secrets deleted while referenced.

/// F2. An MCPServer's `headersFrom` Secret and a CheckpointStore's `dsnFrom` Secret are deleted
/// while both objects are ready, next to a server and a store that use no Secret.
#[tokio::test]
async fn secret_deleted_while_referenced() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-secret").await;
    let server = BasketServer::start(&[]);
    let dsn = langgraph_database("faults_secret").await;
    let token = format!("faults-token-{}", uuid::Uuid::new_v4().simple());
    let password = format!("faults-pw-{}", uuid::Uuid::new_v4().simple());
    assert!(dsn.contains("://postgres@"), "{dsn}");
    let secret_dsn = dsn.replacen("://postgres@", &format!("://postgres:{password}@"), 1);
    let token_secret = secret(
        "mcp-token",
        json!({"authorization": format!("Bearer {token}")}),
    );
    let dsn_secret = secret("orders-dsn", json!({"dsn": secret_dsn}));
    apply(&client, &ns, &token_secret).await;
    apply(&client, &ns, &dsn_secret).await;
    apply(&client, &ns, &object("MCPServer", "basket", json!({"url": server.url(),
        "headersFrom": [{"name": "Authorization", "secretKeyRef": {"name": "mcp-token", "key": "authorization"}}]})))
    .await;
    apply(
        &client,
        &ns,
        &object("MCPServer", "plain", json!({"url": server.url()})),
    )
    .await;
    apply(
        &client,
        &ns,
        &object("CheckpointStore", "orders", store_from("orders-dsn")),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "plain",
            json!({"backend": "postgres", "dsn": dsn}),
        ),
    )
    .await;
    let ready = [("Ready", "True")];
    let reachable = [("Reachable", "True")];
    for (server, store) in [("basket", "orders"), ("plain", "plain")] {
        wait_conditions(&client, &ns, "MCPServer", server, &ready).await;
        wait_conditions(&client, &ns, "CheckpointStore", store, &reachable).await;
    }
    let pid = infra.current.lock().await.as_ref().unwrap().pid;

    // Delete both Secrets.
    let secrets = Api::<Secret>::namespaced(client.clone(), &ns);
    let deleted = Instant::now();
    for name in ["mcp-token", "orders-dsn"] {
        secrets
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    let obj = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "basket",
        &[("Ready", "False"), ("Discovered", "False")],
    )
    .await;
    let c = condition(&obj, "Ready").unwrap();
    assert_eq!(c["reason"], "SecretNotResolved", "{c}");
    let message = c["message"].as_str().unwrap();
    assert!(
        message.contains("spec.headersFrom[0].secretKeyRef: no Secret \"mcp-token\"")
            && message.contains("\"authorization\""),
        "{message}"
    );
    let note = wait_warning(&client, &ns, "MCPServer", "basket", "SecretNotResolved").await;
    assert!(note.contains("mcp-token"), "{note}");

    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Reachable", "False"), ("SchemaCompatible", "Unknown")],
    )
    .await;
    let c = condition(&obj, "Reachable").unwrap();
    assert_eq!(c["reason"], "SecretNotResolved", "{c}");
    let message = c["message"].as_str().unwrap();
    assert!(
        message.contains("spec.dsnFrom: no Secret \"orders-dsn\"") && message.contains("\"dsn\""),
        "{message}"
    );
    let note = wait_warning(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "SecretNotResolved",
    )
    .await;
    assert!(note.contains("orders-dsn"), "{note}");
    eprintln!("both reported {:?} after the deletion", deleted.elapsed());

    // Nothing else broken; the failures are counted; no value anywhere.
    wait_conditions(&client, &ns, "MCPServer", "plain", &ready).await;
    wait_conditions(&client, &ns, "CheckpointStore", "plain", &reachable).await;
    let m = infra.metrics().await;
    for kind in ["MCPServer", "CheckpointStore"] {
        assert!(
            failures(&m, kind, "SecretNotResolved") >= 1.0,
            "{kind}:\n{m}"
        );
    }
    let shown = visible_text(&client, &ns).await + &infra.logs();
    for value in [&token, &password] {
        assert!(!shown.contains(value.as_str()), "a Secret value is shown");
    }

    // Recreated: both recover, without a restart, long before the store's 5-minute recheck.
    let recreated = Instant::now();
    apply(&client, &ns, &token_secret).await;
    apply(&client, &ns, &dsn_secret).await;
    wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "basket",
        &[("Ready", "True"), ("Discovered", "True")],
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
    eprintln!(
        "recovered {:?} after the Secrets came back",
        recreated.elapsed()
    );
    let current = infra.current.lock().await;
    let serving = current.as_ref().unwrap();
    assert_eq!(serving.pid, pid, "the controller was restarted");
    assert!(serving.alive());
}

// ---------------------------------------------------------------------------------------------
// B: the bad-input matrix.

/// What must happen to a bad object.
enum Want {
    /// The API server refuses it; its message holds the field path and this text.
    Rejected(&'static str, &'static str),
    /// Accepted; the controller sets condition `type_` False with `reason`, and the message
    /// holds `<field path>: `.
    Condition(&'static str, &'static str, &'static str),
}

/// One row of the matrix: a bad object of `kind` and what must happen to it.
struct Row {
    id: &'static str,
    kind: &'static str,
    what: &'static str,
    spec: Value,
    want: Want,
}

fn assignment_spec() -> Value {
    json!({"agent": "bad-agent", "servers": [{"serverRef": "basket"}]})
}

fn store_spec() -> Value {
    store_from("good-dsn")
}

/// Every row of the bad-input matrix, by kind. `url` is the good basket server's endpoint.
fn bad_input_rows(url: &str) -> Vec<Row> {
    use Want::{Condition, Rejected};
    let s = || server_spec(url);
    vec![
        // MCPServer: the schema and CEL rules.
        Row {
            id: "B1",
            kind: "MCPServer",
            what: "missing url",
            spec: json!({}),
            want: Rejected("spec.url", "Required value"),
        },
        Row {
            id: "B2",
            kind: "MCPServer",
            what: "url of the wrong type",
            spec: json!({"url": 42}),
            want: Rejected("spec.url", "must be of type string"),
        },
        Row {
            id: "B3",
            kind: "MCPServer",
            what: "url with another scheme",
            spec: server_spec("ftp://basket/mcp"),
            want: Rejected("spec.url", "url must start with http:// or https://"),
        },
        Row {
            id: "B4",
            kind: "MCPServer",
            what: "timeoutSeconds of the wrong type",
            spec: merged(s(), json!({"timeoutSeconds": "ten"})),
            want: Rejected("spec.timeoutSeconds", "must be of type integer"),
        },
        Row {
            id: "B5",
            kind: "MCPServer",
            what: "timeoutSeconds below range",
            spec: merged(s(), json!({"timeoutSeconds": 0})),
            want: Rejected(
                "spec.timeoutSeconds",
                "should be greater than or equal to 1",
            ),
        },
        Row {
            id: "B6",
            kind: "MCPServer",
            what: "timeoutSeconds above range",
            spec: merged(s(), json!({"timeoutSeconds": 301})),
            want: Rejected("spec.timeoutSeconds", "should be less than or equal to 300"),
        },
        Row {
            id: "B7",
            kind: "MCPServer",
            what: "unknown mode",
            spec: merged(s(), json!({"mode": "modern"})),
            want: Rejected("spec.mode", "Unsupported value: \"modern\""),
        },
        Row {
            id: "B8",
            kind: "MCPServer",
            what: "headersFrom without secretKeyRef",
            spec: merged(s(), json!({"headersFrom": [{"name": "Authorization"}]})),
            want: Rejected("spec.headersFrom[0].secretKeyRef", "Required value"),
        },
        Row {
            id: "B9",
            kind: "MCPServer",
            what: "reconciliation whose found can never say not found",
            spec: merged(
                s(),
                json!({"reconciliation": [{"tool": "create_ticket", "lookup": {"tool": "find_ticket", "arguments": {}, "found": {}, "idField": "id"}}]}),
            ),
            want: Rejected(
                "spec.reconciliation[0].lookup.found",
                "found needs path or notFoundErrorPrefixes",
            ),
        },
        Row {
            id: "B10",
            kind: "MCPServer",
            what: "unknown field (strict field validation)",
            spec: merged(s(), json!({"uri": url})),
            want: Rejected("spec.uri", "unknown field"),
        },
        // MCPServer: what only custody can check.
        Row {
            id: "B11",
            kind: "MCPServer",
            what: "invalid header name",
            spec: merged(s(), json!({"headers": {"Bad Header": "x"}})),
            want: Condition("Ready", "InvalidSpec", "spec.headers.Bad Header"),
        },
        Row {
            id: "B12",
            kind: "MCPServer",
            what: "url without a host",
            spec: server_spec("http://"),
            want: Condition("Ready", "InvalidSpec", "spec.url"),
        },
        Row {
            id: "B13",
            kind: "MCPServer",
            what: "lookup that is the write tool itself",
            spec: merged(
                s(),
                json!({"reconciliation": [{"tool": "create_ticket", "lookup": {"tool": "create_ticket", "arguments": {}, "found": {"path": "ticket"}, "idField": "id"}}]}),
            ),
            want: Condition("Ready", "InvalidSpec", "spec.reconciliation[0].lookup.tool"),
        },
        Row {
            id: "B14",
            kind: "MCPServer",
            what: "lookup placeholder that does not exist",
            spec: merged(
                s(),
                json!({"reconciliation": [{"tool": "create_ticket", "lookup": {"tool": "find_ticket", "arguments": {"key": "{{handle}}"}, "found": {"path": "ticket"}, "idField": "id"}}]}),
            ),
            want: Condition(
                "Ready",
                "InvalidSpec",
                "spec.reconciliation[0].lookup.arguments.key",
            ),
        },
        Row {
            id: "B15",
            kind: "MCPServer",
            what: "headersFrom Secret that does not exist",
            spec: merged(
                s(),
                json!({"headersFrom": [{"name": "Authorization", "secretKeyRef": {"name": "no-such-secret", "key": "token"}}]}),
            ),
            want: Condition(
                "Ready",
                "SecretNotResolved",
                "spec.headersFrom[0].secretKeyRef",
            ),
        },
        // AgentAssignment: the schema and CEL rules.
        Row {
            id: "B16",
            kind: "AgentAssignment",
            what: "missing agent",
            spec: json!({"servers": []}),
            want: Rejected("spec.agent", "Required value"),
        },
        Row {
            id: "B17",
            kind: "AgentAssignment",
            what: "empty agent",
            spec: merged(assignment_spec(), json!({"agent": ""})),
            want: Rejected("spec.agent", "agent must not be empty"),
        },
        Row {
            id: "B18",
            kind: "AgentAssignment",
            what: "servers of the wrong type",
            spec: merged(assignment_spec(), json!({"servers": "basket"})),
            want: Rejected("spec.servers", "must be of type array"),
        },
        Row {
            id: "B19",
            kind: "AgentAssignment",
            what: "server without serverRef",
            spec: merged(assignment_spec(), json!({"servers": [{"alias": "shop"}]})),
            want: Rejected("spec.servers[0].serverRef", "Required value"),
        },
        Row {
            id: "B20",
            kind: "AgentAssignment",
            what: "serverRef into another namespace",
            spec: merged(
                assignment_spec(),
                json!({"servers": [{"serverRef": "elsewhere/basket"}]}),
            ),
            want: Rejected(
                "spec.servers[0].serverRef",
                "serverRef must be the name of an MCPServer in the same namespace",
            ),
        },
        // AgentAssignment: references and the agent toolkit's rules.
        Row {
            id: "B21",
            kind: "AgentAssignment",
            what: "server that does not exist",
            spec: merged(
                assignment_spec(),
                json!({"servers": [{"serverRef": "nowhere"}]}),
            ),
            want: Condition("Valid", "UnknownServer", "spec.servers[0].serverRef"),
        },
        Row {
            id: "B22",
            kind: "AgentAssignment",
            what: "server that exists only in another namespace",
            spec: merged(
                assignment_spec(),
                json!({"servers": [{"serverRef": "elsewhere"}]}),
            ),
            want: Condition("Valid", "UnknownServer", "spec.servers[0].serverRef"),
        },
        Row {
            id: "B23",
            kind: "AgentAssignment",
            what: "allowlisted tool the server does not offer",
            spec: merged(
                assignment_spec(),
                json!({"servers": [{"serverRef": "basket", "toolAllowlist": ["no_such_tool"]}]}),
            ),
            want: Condition("Valid", "ToolNotOffered", "spec.servers[0].toolAllowlist"),
        },
        Row {
            id: "B24",
            kind: "AgentAssignment",
            what: "one server assigned twice",
            spec: merged(
                assignment_spec(),
                json!({"servers": [{"serverRef": "basket"}, {"serverRef": "basket", "alias": "again"}]}),
            ),
            want: Condition("Valid", "InvalidSpec", "spec.servers[1].serverRef"),
        },
        Row {
            id: "B25",
            kind: "AgentAssignment",
            what: "alias not starting with a letter",
            spec: merged(
                assignment_spec(),
                json!({"servers": [{"serverRef": "basket", "alias": "1shop"}]}),
            ),
            want: Condition("Valid", "InvalidSpec", "spec.servers[0].alias"),
        },
        Row {
            id: "B26",
            kind: "AgentAssignment",
            what: "second assignment for an assigned agent",
            spec: merged(assignment_spec(), json!({"agent": "good-agent"})),
            want: Condition("Valid", "DuplicateAssignment", "spec.agent"),
        },
        // HandleClass: the schema and CEL rules.
        Row {
            id: "B27",
            kind: "HandleClass",
            what: "missing probe",
            spec: merged(basket_class(), json!({"probe": null})),
            want: Rejected("spec.probe", "Required value"),
        },
        Row {
            id: "B28",
            kind: "HandleClass",
            what: "missing statePath",
            spec: merged(basket_class(), json!({"statePath": null})),
            want: Rejected("spec.statePath", "Required value"),
        },
        Row {
            id: "B29",
            kind: "HandleClass",
            what: "probe arguments of the wrong type",
            spec: merged(basket_class(), json!({"probe": {"arguments": "basket_id"}})),
            want: Rejected("spec.probe.arguments", "must be of type object"),
        },
        Row {
            id: "B30",
            kind: "HandleClass",
            what: "unknown onGone",
            spec: merged(basket_class(), json!({"onGone": "retry"})),
            want: Rejected("spec.onGone", "Unsupported value: \"retry\""),
        },
        Row {
            id: "B31",
            kind: "HandleClass",
            what: "onGone remint without mint",
            spec: merged(
                basket_class(),
                json!({"onGone": "remint", "mintInputsPath": "mint_inputs"}),
            ),
            want: Rejected("spec", "onGone: remint requires mint"),
        },
        Row {
            id: "B32",
            kind: "HandleClass",
            what: "statePath with an empty key",
            spec: merged(basket_class(), json!({"statePath": "order..basket"})),
            want: Rejected(
                "spec.statePath",
                "statePath must be dot-separated non-empty keys",
            ),
        },
        Row {
            id: "B33",
            kind: "HandleClass",
            what: "negative declaredTtlSeconds",
            spec: merged(basket_class(), json!({"declaredTtlSeconds": -1})),
            want: Rejected("spec.declaredTtlSeconds", "greater than or equal to 0"),
        },
        Row {
            id: "B34",
            kind: "HandleClass",
            what: "serverRef that is no object name",
            spec: merged(basket_class(), json!({"serverRef": "Basket"})),
            want: Rejected(
                "spec.serverRef",
                "serverRef must be the name of an MCPServer in the same namespace",
            ),
        },
        // HandleClass: references, the catalog, templates.
        Row {
            id: "B35",
            kind: "HandleClass",
            what: "server that does not exist",
            spec: merged(basket_class(), json!({"serverRef": "nowhere"})),
            want: Condition("Valid", "UnknownServer", "spec.serverRef"),
        },
        Row {
            id: "B36",
            kind: "HandleClass",
            what: "server that exists only in another namespace",
            spec: merged(basket_class(), json!({"serverRef": "elsewhere"})),
            want: Condition("Valid", "UnknownServer", "spec.serverRef"),
        },
        Row {
            id: "B37",
            kind: "HandleClass",
            what: "probe tool the server does not list",
            spec: merged(basket_class(), json!({"probe": {"tool": "no_such_tool"}})),
            want: Condition("Valid", "ToolNotOffered", "spec.probe.tool"),
        },
        Row {
            id: "B38",
            kind: "HandleClass",
            what: "mint tool the server does not list",
            spec: merged(
                basket_class(),
                json!({"mint": {"tool": "no_such_tool", "handleField": "basket_id"}}),
            ),
            want: Condition("Valid", "ToolNotOffered", "spec.mint.tool"),
        },
        Row {
            id: "B39",
            kind: "HandleClass",
            what: "misspelt placeholder",
            spec: merged(
                basket_class(),
                json!({"probe": {"arguments": {"basket_id": "{{handel}}"}}}),
            ),
            want: Condition("Valid", "InvalidSpec", "spec.probe.arguments.basket_id"),
        },
        Row {
            id: "B40",
            kind: "HandleClass",
            what: "gone regex that does not compile",
            spec: merged(
                basket_class(),
                json!({"probe": {"goneWhen": {"errorTextRegex": "("}}}),
            ),
            want: Condition("Valid", "InvalidSpec", "spec.probe.goneWhen.errorTextRegex"),
        },
        // CheckpointStore: the schema and CEL rules.
        Row {
            id: "B41",
            kind: "CheckpointStore",
            what: "missing backend",
            spec: merged(store_spec(), json!({"backend": null})),
            want: Rejected("spec.backend", "Required value"),
        },
        Row {
            id: "B42",
            kind: "CheckpointStore",
            what: "unknown backend",
            spec: merged(store_spec(), json!({"backend": "mysql"})),
            want: Rejected("spec.backend", "Unsupported value: \"mysql\""),
        },
        Row {
            id: "B43",
            kind: "CheckpointStore",
            what: "both dsn and dsnFrom",
            spec: merged(store_spec(), json!({"dsn": "postgres://x"})),
            want: Rejected("spec", "set exactly one of dsn and dsnFrom"),
        },
        Row {
            id: "B44",
            kind: "CheckpointStore",
            what: "neither dsn nor dsnFrom",
            spec: merged(store_spec(), json!({"dsnFrom": null})),
            want: Rejected("spec", "set exactly one of dsn and dsnFrom"),
        },
        Row {
            id: "B45",
            kind: "CheckpointStore",
            what: "dsnFrom without key",
            spec: merged(store_spec(), json!({"dsnFrom": {"key": null}})),
            want: Rejected("spec.dsnFrom.key", "Required value"),
        },
        Row {
            id: "B46",
            kind: "CheckpointStore",
            what: "audit maxAgeSeconds not above graceSeconds",
            spec: merged(
                store_spec(),
                json!({"audit": {"graceSeconds": 600, "maxAgeSeconds": 60}}),
            ),
            want: Rejected(
                "spec.audit",
                "maxAgeSeconds must be greater than graceSeconds",
            ),
        },
        Row {
            id: "B47",
            kind: "CheckpointStore",
            what: "minParkedSeconds of the wrong type",
            spec: merged(store_spec(), json!({"minParkedSeconds": "soon"})),
            want: Rejected("spec.minParkedSeconds", "must be of type integer"),
        },
        Row {
            id: "B48",
            kind: "CheckpointStore",
            what: "schedule that is not cron",
            spec: merged(store_spec(), json!({"schedule": "every five minutes"})),
            want: Rejected("spec.schedule", "schedule must be five cron fields"),
        },
        // CheckpointStore: references.
        Row {
            id: "B49",
            kind: "CheckpointStore",
            what: "dsnFrom Secret that does not exist",
            spec: merged(store_spec(), json!({"dsnFrom": {"name": "no-such-secret"}})),
            want: Condition("Reachable", "SecretNotResolved", "spec.dsnFrom"),
        },
        Row {
            id: "B50",
            kind: "CheckpointStore",
            what: "dsnFrom key the Secret lacks",
            spec: merged(store_spec(), json!({"dsnFrom": {"key": "no-such-key"}})),
            want: Condition("Reachable", "SecretNotResolved", "spec.dsnFrom"),
        },
        Row {
            id: "B51",
            kind: "CheckpointStore",
            what: "schedule of cron form with a field out of range",
            spec: merged(store_spec(), json!({"schedule": "61 * * * *"})),
            // Named by the controller, once: no CronJob is sent for the API server to refuse.
            want: Condition("Scheduled", "InvalidSpec", "spec.schedule"),
        },
        Row {
            id: "B52",
            kind: "CheckpointStore",
            what: "empty principalKey",
            spec: merged(store_spec(), json!({"principalKey": ""})),
            // What the sweeps read is named under Scheduled: the database is reachable.
            want: Condition("Scheduled", "InvalidSpec", "spec.principalKey"),
        },
    ]
}

/// B1–B52. Every row of [`bad_input_rows`] in one namespace, next to one good object of each
/// kind (created first, so the good assignment is the older one for B26). Rejected rows must
/// name the field in the API server's answer; accepted ones in a condition; the good objects
/// (and one created after all the bad ones) still reconcile; failures are counted per kind and
/// reason.
#[tokio::test]
async fn bad_resources_are_rejected_or_named_in_conditions() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-badinput").await;
    let other = TestNs::new(&client, "faults-badinput-other").await;
    let server = BasketServer::start(&[]);
    let dsn = langgraph_database("faults_badinput").await;

    // The good neighbours, and the server of another namespace that B22 and B36 name.
    apply(
        &client,
        &other,
        &object("MCPServer", "elsewhere", server_spec(&server.url())),
    )
    .await;
    apply(&client, &ns, &secret("good-dsn", json!({"dsn": dsn}))).await;
    apply(
        &client,
        &ns,
        &object("MCPServer", "basket", server_spec(&server.url())),
    )
    .await;
    apply(&client, &ns, &object("HandleClass", "good", basket_class())).await;
    apply(
        &client,
        &ns,
        &object("CheckpointStore", "good", store_spec()),
    )
    .await;
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "good",
            basket_assignment("good-agent", &["get_basket"]),
        ),
    )
    .await;
    let goods: [(&str, &[(&str, &str)]); 4] = [
        ("MCPServer", &[("Ready", "True")]),
        ("HandleClass", &[("Valid", "True")]),
        (
            "CheckpointStore",
            &[("Reachable", "True"), ("SchemaCompatible", "True")],
        ),
        ("AgentAssignment", &[("Ready", "True")]),
    ];
    for (kind, want) in goods {
        let name = if kind == "MCPServer" {
            "basket"
        } else {
            "good"
        };
        wait_conditions(&client, &ns, kind, name, want).await;
    }

    let rows = bad_input_rows(&server.url());
    let mut accepted = Vec::new();
    for row in &rows {
        let name = format!("bad-{}", row.id.to_lowercase());
        let mut spec = row.spec.clone();
        if spec["agent"] == "bad-agent" {
            // One agent per assignment, so only B26 is a duplicate.
            spec["agent"] = json!(name);
        }
        let manifest = object(row.kind, &name, spec).to_string();
        let created =
            cluster::cluster().kubectl(&["create", "-n", &ns, "-f", "-"], Some(&manifest));
        match row.want {
            Want::Rejected(field, text) => {
                let err = created.fails();
                assert!(
                    err.contains(&format!("{field}: ")) || err.contains(&format!("\"{field}\"")),
                    "{} {} ({}): the refusal does not name {field}:\n{err}",
                    row.id,
                    row.kind,
                    row.what
                );
                assert!(
                    err.contains(text),
                    "{} ({}): want {text:?} in:\n{err}",
                    row.id,
                    row.what
                );
            }
            Want::Condition(..) => {
                created.ok();
                accepted.push((row, name));
            }
        }
    }
    for (row, name) in &accepted {
        let Want::Condition(type_, reason, field) = row.want else {
            unreachable!()
        };
        let obj = wait_conditions(&client, &ns, row.kind, name, &[(type_, "False")]).await;
        let c = condition(&obj, type_).unwrap();
        let message = c["message"].as_str().unwrap();
        assert!(
            c["reason"] == reason && message.contains(&format!("{field}: ")),
            "{} {} ({}): want {reason} naming {field}, got {c}",
            row.id,
            row.kind,
            row.what
        );
    }

    // The good ones are still fine, and an object created after all the bad ones reconciles.
    for (kind, want) in goods {
        let name = if kind == "MCPServer" {
            "basket"
        } else {
            "good"
        };
        wait_conditions(&client, &ns, kind, name, want).await;
    }
    apply(&client, &ns, &object("HandleClass", "late", basket_class())).await;
    wait_conditions(&client, &ns, "HandleClass", "late", &[("Valid", "True")]).await;

    // Counted, by kind and the condition's reason.
    let m = infra.metrics().await;
    for (row, _) in &accepted {
        let Want::Condition(_, reason, _) = row.want else {
            unreachable!()
        };
        assert!(
            failures(&m, row.kind, reason) >= 1.0,
            "{} {}: no custody_reconcile_failures_total{{kind={:?},reason={reason:?}}}",
            row.id,
            row.what,
            row.kind
        );
    }
    eprintln!(
        "{} rows: {} rejected by the API server, {} named in conditions",
        rows.len(),
        rows.len() - accepted.len(),
        accepted.len()
    );
}

// ---------------------------------------------------------------------------------------------
// F3–F6: what the API server refuses reaches `/readyz`, the objects and the metrics.

/// The `custody` binary under test.
fn custody_bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_custody"))
}

/// Applies `crds/crds.yaml` again (server-side, taking back fields a test changed).
fn reapply_crds() {
    cluster::cluster()
        .kubectl(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                "crds/crds.yaml",
            ],
            None,
        )
        .ok();
}

/// Puts `crds/crds.yaml` back when dropped, however the test ends.
struct RestoreCrds;

impl Drop for RestoreCrds {
    fn drop(&mut self) {
        reapply_crds();
    }
}

/// F3: a controller whose ServiceAccount may read the CRDs but not list or watch anything it
/// reconciles leads, and is not ready: `/readyz` answers 503 naming each controller whose watch
/// fails and the API server's 403, and `custody_reconcile_failures_total{reason=
/// "watch_forbidden"}` counts them.
#[tokio::test]
async fn watches_refused_by_rbac_make_the_controller_not_ready() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-nowatch").await;
    let c = cluster::cluster();
    let sa = "custody-no-watch";
    let cluster_role = format!("{sa}-{}", std::process::id());
    let rbac = |kind: &str, name: &str, body: Value| {
        let mut metadata = json!({"name": name});
        if !kind.starts_with("Cluster") {
            metadata["namespace"] = json!(&*ns);
        }
        merged(
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": metadata}),
            body,
        )
    };
    let subjects = json!([{"kind": "ServiceAccount", "name": sa, "namespace": &*ns}]);
    let items = json!([
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": &*ns}},
        rbac("Role", sa, json!({"rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                          "verbs": ["create", "get", "list", "watch", "patch"]}]})),
        rbac("RoleBinding", sa, json!({"subjects": subjects,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa}})),
        rbac("ClusterRole", &cluster_role, json!({"rules": [{"apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"], "resourceNames": cluster::crd_names(), "verbs": ["get"]}]})),
        rbac("ClusterRoleBinding", &cluster_role, json!({"subjects": subjects,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role}})),
    ]);
    c.kubectl(
        &["apply", "-f", "-"],
        Some(&json!({"apiVersion": "v1", "kind": "List", "items": items}).to_string()),
    )
    .ok();
    // Its own directory: Suite::logs (the files of infra.dir) is the serving replicas' logs.
    let dir = infra.dir.join("no-watch");
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = cluster::token_kubeconfig(&dir.join("kubeconfig"), &ns, sa);
    // custody's default log filter: what an operator reads without RUST_LOG.
    let replica = ControllerProcess::spawn_with_filter(
        custody_bin(),
        &kubeconfig,
        sa,
        &dir.join("replica.log"),
        &["--lease-namespace", &ns, "--lease-seconds", "15"],
        None,
    );
    let kinds = [
        "MCPServer",
        "AgentAssignment",
        "HandleClass",
        "CheckpointStore",
    ];
    let body = eventually(
        "/readyz names every controller's refused watch",
        async || {
            // Not replica.metrics(): it panics while the HTTP server is not up yet.
            let m = replica.get("/metrics").map(|(_, m)| m).unwrap_or_default();
            match replica.get("/readyz") {
                Some((503, body))
                    if metric(&m, "custody_leader") == Some(1.0)
                        && kinds.iter().all(|k| {
                            body.contains(&format!("the {k} controller's watch failed"))
                                && failures(&m, k, "watch_forbidden") >= 1.0
                        }) =>
                {
                    Ok(body)
                }
                other => Err(format!("{other:?}\n{}", replica.log_tail())),
            }
        },
    )
    .await;
    assert!(body.starts_with("not ready: the "), "{body}");
    assert!(
        body.contains("watch_forbidden: ") && body.contains("is forbidden"),
        "{body}"
    );
    assert!(
        body.contains(&format!("system:serviceaccount:{}:{sa}", &*ns)),
        "{body}"
    );
    // Its ServiceAccount is deleted (as `helm uninstall` does under a running replica): every
    // request is refused, the Lease can be neither renewed nor read, and within a lease
    // duration the replica stops saying it leads, so an alert on custody_leader sees it.
    c.kubectl(
        &["delete", "serviceaccount", sa, "-n", &ns, "--wait=false"],
        None,
    )
    .ok();
    eventually_within(
        Duration::from_secs(60),
        "custody_leader drops to 0 once the Lease cannot be shown held",
        async || {
            let m = replica.get("/metrics").map(|(_, m)| m).unwrap_or_default();
            match metric(&m, "custody_leader") {
                Some(0.0) => Ok(()),
                other => Err(format!("{other:?}\n{}", replica.log_tail())),
            }
        },
    )
    .await;
    // The loss is said once, in custody's words, with the API server's cause; kube-lease-manager's
    // ERROR per failed renewal (kube's `Debug` dump, every backoff step) stays out.
    let log = replica.log_text();
    let lost: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("lost the leader lease"))
        .collect();
    assert!(
        lost.len() == 1 && lost[0].contains("could not be read") && lost[0].contains("401"),
        "{log}"
    );
    assert!(
        !log.contains("LeaseManager watcher error") && !log.contains("ErrorResponse {"),
        "{log}"
    );
    drop(replica);
    c.kubectl(
        &[
            "delete",
            "clusterrolebinding,clusterrole",
            &cluster_role,
            "--wait=false",
        ],
        None,
    )
    .ok();
}

/// F4: CRDs of another release. At startup a replica names the CRD whose
/// `custody.dev/schema-sha256` differs, logs it at ERROR, says in `/readyz` what to apply and
/// stays not ready (and a standby) until the right CRDs are applied, then becomes ready without
/// a restart. A schema that refuses a status write the serving controller makes (HTTP 500 from
/// server-side apply: the old schema types `status.observedGeneration` as a string) becomes a
/// Warning Event `StatusRefused` on the object, naming the field, and a count.
#[tokio::test]
async fn crds_of_another_release_are_named_and_their_refusals_reach_the_objects() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-oldcrd").await;
    let c = cluster::cluster();
    let crd = "handleclasses.custody.dev";
    let _restore = RestoreCrds;

    c.kubectl(
        &[
            "annotate",
            "--overwrite",
            &format!("crd/{crd}"),
            "custody.dev/schema-sha256=0123456789abcdef",
        ],
        None,
    )
    .ok();
    let dir = infra.dir.join("old-crd");
    std::fs::create_dir_all(&dir).unwrap();
    let replica = ControllerProcess::spawn(
        custody_bin(),
        &infra.kubeconfig,
        "faults-old-crd",
        &dir.join("replica.log"),
        &[
            "--lease-namespace",
            &infra.system_ns,
            "--lease-seconds",
            &LEASE_SECONDS.to_string(),
        ],
    );
    let body = eventually("/readyz names the CRD", async || {
        match replica.get("/readyz") {
            Some((503, body)) if body.contains(crd) => Ok(body),
            other => Err(format!("{other:?}\n{}", replica.log_tail())),
        }
    })
    .await;
    assert!(
        body.starts_with(&format!(
            "not ready: installed CRDs: CRD {crd} has schema custody.dev/schema-sha256 0123456789ab…, this controller serves "
        )),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            "apply the CRDs of this custody ({}): kubectl apply --server-side --force-conflicts -f crds/crds.yaml",
            custody::VERSION
        )),
        "{body}"
    );
    let log = replica.log_text();
    assert!(
        log.lines().any(|l| l.contains("ERROR") && l.contains(crd)),
        "no ERROR line names {crd}:\n{log}"
    );
    assert_eq!(metric(&replica.metrics(), "custody_leader"), Some(0.0));
    reapply_crds();
    eventually("ready once the CRDs are applied", async || {
        match replica.get("/readyz") {
            Some((200, body)) if body == "ready: standby" => Ok(()),
            other => Err(format!("{other:?}\n{}", replica.log_tail())),
        }
    })
    .await;
    // While it runs, CRDs of another release again: it checks every 30 s, says so in
    // /readyz and logs it, and is ready again once they are right.
    let errors_before = replica
        .log_text()
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains(crd))
        .count();
    c.kubectl(
        &[
            "annotate",
            "--overwrite",
            &format!("crd/{crd}"),
            "custody.dev/schema-sha256=fedcba9876543210",
        ],
        None,
    )
    .ok();
    eventually_within(
        Duration::from_secs(90),
        "a running controller notices the CRD",
        async || match replica.get("/readyz") {
            Some((503, body)) if body.contains("fedcba987654") => Ok(()),
            other => Err(format!("{other:?}\n{}", replica.log_tail())),
        },
    )
    .await;
    let errors = replica
        .log_text()
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains(crd))
        .count();
    assert!(errors > errors_before, "{}", replica.log_tail());
    reapply_crds();
    eventually_within(
        Duration::from_secs(90),
        "ready again once the CRDs are applied",
        async || match replica.get("/readyz") {
            Some((200, body)) if body == "ready: standby" => Ok(()),
            other => Err(format!("{other:?}\n{}", replica.log_tail())),
        },
    )
    .await;
    drop(replica);

    // An installed schema that refuses what the serving controller writes.
    c.kubectl(
        &[
            "patch",
            &format!("crd/{crd}"),
            "--type=json",
            "-p",
            r#"[{"op": "replace", "path": "/spec/versions/0/schema/openAPIV3Schema/properties/status/properties/observedGeneration/type", "value": "string"}]"#,
        ],
        None,
    )
    .ok();
    apply(
        &client,
        &ns,
        &object("HandleClass", "basket", basket_class()),
    )
    .await;
    let note = wait_warning(&client, &ns, "HandleClass", "basket", "StatusRefused").await;
    // The annotation is still this release's: the serving controller's recheck compares the
    // schema itself, and says so.
    eventually_within(
        Duration::from_secs(90),
        "the serving controller notices the schema under its own annotation",
        async || {
            let current = infra.current.lock().await;
            let serving = current.as_ref().expect("the serving controller");
            match serving.get("/readyz") {
                Some((503, body))
                    if body.contains(&format!(
                        "CRD {crd} carries this controller's custody.dev/schema-sha256 but its v1alpha1 schema is not this controller's"
                    )) =>
                {
                    Ok(())
                }
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    assert!(
        note.starts_with("the API server refused this HandleClass's status (HTTP "),
        "{note}"
    );
    assert!(note.contains("observedGeneration"), "{note}");
    assert!(
        note.contains("kubectl apply --server-side --force-conflicts -f crds/crds.yaml"),
        "{note}"
    );
    assert!(failures(&infra.metrics().await, "HandleClass", "StatusRefused") >= 1.0);
    reapply_crds();
    eventually("the status is written once the CRD is right", async || {
        let obj = get(&client, &ns, "HandleClass", "basket").await.unwrap();
        match &obj["status"]["observedGeneration"] {
            Value::Number(n) if n.as_i64() == Some(1) => Ok(()),
            other => Err(format!("{other}")),
        }
    })
    .await;
}

/// Puts the chart's ClusterRole back when dropped.
struct RestoreRole(String);

impl Drop for RestoreRole {
    fn drop(&mut self) {
        cluster::cluster()
            .kubectl(&["replace", "-f", "-"], Some(&self.0))
            .ok();
    }
}

/// Replaces the verbs of the controller ClusterRole's rule for `resources` (a rule of that one
/// resource) with `verbs`, until the returned guard is dropped.
fn reduce_role(infra: &Suite, resource: &str, verbs: &[&str]) -> RestoreRole {
    let c = cluster::cluster();
    let role = format!("{}-controller", infra.release);
    let mut original = c.get_json(&["clusterrole", &role]);
    for field in ["resourceVersion", "managedFields"] {
        original["metadata"].as_object_mut().unwrap().remove(field);
    }
    let mut reduced = original.clone();
    for rule in reduced["rules"].as_array_mut().unwrap() {
        if rule["resources"] == json!([resource]) {
            rule["verbs"] = json!(verbs);
        }
    }
    assert_ne!(reduced, original, "the chart's role has a {resource} rule");
    let restore = RestoreRole(original.to_string());
    c.kubectl(&["replace", "-f", "-"], Some(&reduced.to_string()))
        .ok();
    restore
}

/// Namespace `TAG-PID` with CheckpointStore `orders` on a LangGraph database of its own, applied
/// after the controller's ClusterRole was cut to `verbs` on `resource` ([`reduce_role`]); returns
/// the namespace and the guard that puts the role back.
async fn store_under_reduced_role(
    infra: &Suite,
    client: &Client,
    tag: &str,
    resource: &str,
    verbs: &[&str],
) -> (TestNs, RestoreRole) {
    let ns = TestNs::new(client, tag).await;
    let dsn = langgraph_database(&tag.replace('-', "_")).await;
    let restore = reduce_role(infra, resource, verbs);
    apply(
        client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            json!({"backend": "postgres", "dsn": dsn}),
        ),
    )
    .await;
    (ns, restore)
}

/// F5: a ConfigMap write RBAC refuses (the controller's ClusterRole loses `patch` on ConfigMaps)
/// makes the AgentAssignment `ConfigRendered=False` and `Ready=False` with reason
/// `ConfigMapRefused` naming the ConfigMap and the API server's 403, with a Warning Event and a
/// count; the status keeps no digest of a configuration that was never written. Restoring the
/// role renders it within seconds.
#[tokio::test]
async fn a_config_map_refused_by_rbac_shows_on_the_assignment() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-cmrbac").await;
    let server = BasketServer::start(&[]);
    apply(
        &client,
        &ns,
        &object("MCPServer", "basket", server_spec(&server.url())),
    )
    .await;
    wait_conditions(&client, &ns, "MCPServer", "basket", &[("Ready", "True")]).await;

    // Reads stay allowed: the refusal is the write's.
    let restore = reduce_role(infra, "configmaps", &["get", "list", "watch"]);

    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "agent",
            basket_assignment("agent", &["get_basket"]),
        ),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("ConfigRendered", "False"), ("Ready", "False")],
    )
    .await;
    let rendered = condition(&obj, "ConfigRendered").unwrap();
    assert_eq!(rendered["reason"], "ConfigMapRefused", "{rendered}");
    let message = rendered["message"].as_str().unwrap();
    assert!(
        message.starts_with("the API server refused ConfigMap agent-mcp-config (HTTP 403): "),
        "{message}"
    );
    assert!(message.contains("forbidden"), "{message}");
    assert!(
        message.ends_with("must grant get, create and patch on configmaps in the core API group"),
        "{message}"
    );
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "ConfigMapRefused"
    );
    assert!(
        obj["status"].get("configDigest").is_none(),
        "{}",
        obj["status"]
    );
    let note = wait_warning(&client, &ns, "AgentAssignment", "agent", "ConfigMapRefused").await;
    assert_eq!(note, message);
    assert!(
        failures(
            &infra.metrics().await,
            "AgentAssignment",
            "ConfigMapRefused"
        ) >= 1.0
    );

    // A write tool the policy withholds is withheld from a rendering that was never written:
    // the condition says the ConfigMap in the cluster may still publish it.
    apply(
        &client,
        &ns,
        &object(
            "AgentAssignment",
            "writer",
            basket_assignment("writer", &["get_basket", "delete_basket"]),
        ),
    )
    .await;
    let obj = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "writer",
        &[("PolicyCompliant", "False"), ("ConfigRendered", "False")],
    )
    .await;
    let policy = condition(&obj, "PolicyCompliant").unwrap();
    assert!(
        policy["message"].as_str().unwrap().ends_with(
            "; but ConfigMap writer-mcp-config could not be written (see ConfigRendered), so the one in the cluster may still publish them"
        ),
        "{policy}"
    );

    drop(restore);
    let obj = wait_conditions(
        &client,
        &ns,
        "AgentAssignment",
        "agent",
        &[("ConfigRendered", "True"), ("Ready", "True")],
    )
    .await;
    assert_eq!(
        condition(&obj, "ConfigRendered").unwrap()["message"],
        "ConfigMap agent-mcp-config applied"
    );
    assert!(
        obj["status"]["configDigest"].is_string(),
        "{}",
        obj["status"]
    );
}

/// F6: a sweep CronJob write RBAC refuses (the controller's ClusterRole loses `create` and
/// `patch` on CronJobs) makes the CheckpointStore `Scheduled=False` and `Ready=False` with reason
/// `CronJobRefused` naming the CronJob, the API server's 403 and the verbs the ClusterRole must
/// grant, with a Warning Event and a count, while `Reachable` and `SchemaCompatible` are still
/// written. Restoring the role schedules it at the next recheck (20 s).
#[tokio::test]
async fn a_cron_job_refused_by_rbac_shows_on_the_store() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let (ns, restore) = store_under_reduced_role(
        infra,
        &client,
        "faults-cronrbac",
        "cronjobs",
        &["list", "watch"],
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
            ("SchemaCompatible", "True"),
            ("Ready", "False"),
        ],
    )
    .await;
    let scheduled = condition(&obj, "Scheduled").unwrap();
    assert_eq!(scheduled["reason"], "CronJobRefused", "{scheduled}");
    let message = scheduled["message"].as_str().unwrap();
    assert!(
        message.starts_with("the API server refused CronJob orders-sweep (HTTP 403): ")
            && message.contains("forbidden")
            && message.ends_with(
                "; the controller's ClusterRole must grant list, create and patch on cronjobs in API group batch"
            ),
        "{message}"
    );
    assert_eq!(
        condition(&obj, "Ready").unwrap()["reason"],
        "CronJobRefused"
    );
    let note = wait_warning(&client, &ns, "CheckpointStore", "orders", "CronJobRefused").await;
    assert_eq!(note, message);
    assert!(failures(&infra.metrics().await, "CheckpointStore", "CronJobRefused") >= 1.0);

    drop(restore);
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
    assert_one_event(&client, &ns, "CheckpointStore", "orders", "CronJobRefused").await;
}

/// F7: an API call a reconcile needs and RBAC refuses (the controller's ClusterRole loses `list`
/// on Jobs, which every CheckpointStore reconcile reads) is a Warning Event `ReconcileForbidden`
/// on the object with the API server's 403, and `Ready=False` with reason `ReconcileForbidden`
/// and the same message (the status write is still allowed);
/// `custody_reconcile_failures_total` counts it as `forbidden`, not as a generic API failure;
/// restoring the role makes the store Ready.
#[tokio::test]
async fn a_reconcile_refused_by_rbac_is_an_event_on_the_object() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let (ns, restore) =
        store_under_reduced_role(infra, &client, "faults-jobsrbac", "jobs", &["watch"]).await;
    let note = wait_warning(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "ReconcileForbidden",
    )
    .await;
    assert!(
        note.starts_with("the API server refused a call reconciling this CheckpointStore (HTTP 403): ")
            && note.contains("jobs")
            && note.contains("forbidden")
            && note.ends_with("the controller's ClusterRole must grant it (helm upgrade custody, or kubectl apply -k deploy/base)"),
        "{note}"
    );
    assert!(failures(&infra.metrics().await, "CheckpointStore", "forbidden") >= 1.0);
    // The status write is still allowed: the store's Ready says it too.
    let obj = wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Ready", "False")],
    )
    .await;
    let ready = condition(&obj, "Ready").unwrap();
    assert_eq!(ready["reason"], "ReconcileForbidden", "{ready}");
    assert_eq!(ready["message"], note.as_str(), "{ready}");
    drop(restore);
    wait_conditions(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        &[("Ready", "True")],
    )
    .await;
    assert_one_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "ReconcileForbidden",
    )
    .await;
}

/// The controller's status writes (PATCH of `status`) of `kind_plural/name` in `ns` in the audit
/// log so far, with their HTTP codes, in order.
fn status_patches(infra: &Suite, ns: &str, plural: &str, name: &str) -> Vec<i64> {
    let user = format!(
        "system:serviceaccount:{}:{}-controller",
        infra.system_ns, infra.release
    );
    cluster::audit_events()
        .into_iter()
        .filter(|e| {
            e["verb"] == "patch"
                && e["user"]["username"] == user.as_str()
                && e["objectRef"]["namespace"] == ns
                && e["objectRef"]["resource"] == plural
                && e["objectRef"]["name"] == name
                && e["objectRef"]["subresource"] == "status"
        })
        .map(|e| e["responseStatus"]["code"].as_i64().unwrap_or(0))
        .collect()
}

/// F8: a status write the API server keeps refusing (an installed CRD older than the controller:
/// its schema types `status.observedGeneration` as a string; HTTP 422, or 500 for other schema
/// mismatches) backs off per object
/// (15 s, 30 s, 60 s, … up to 5 min) instead of retrying at every reconcile, and is logged at
/// WARN once per back-off step; the metric counts every refusal. Once the CRD is right the
/// status is written at the next step.
#[tokio::test]
async fn a_refused_status_write_backs_off() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-backoff").await;
    let c = cluster::cluster();
    let crd = "handleclasses.custody.dev";
    let _restore = RestoreCrds;
    c.kubectl(
        &[
            "patch",
            &format!("crd/{crd}"),
            "--type=json",
            "-p",
            r#"[{"op": "replace", "path": "/spec/versions/0/schema/openAPIV3Schema/properties/status/properties/observedGeneration/type", "value": "string"}]"#,
        ],
        None,
    )
    .ok();
    let server = BasketServer::start(&[]);
    apply(
        &client,
        &ns,
        &object("MCPServer", "basket", server_spec(&server.url())),
    )
    .await;
    wait_conditions(&client, &ns, "MCPServer", "basket", &[("Ready", "True")]).await;
    let counted_before = failures(&infra.metrics().await, "HandleClass", "StatusRefused");
    let name = "refused-backoff";
    apply(&client, &ns, &object("HandleClass", name, basket_class())).await;
    eventually(
        "the first status write is refused",
        async || match status_patches(infra, &ns, "handleclasses", name).first() {
            Some(500 | 422) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    let warns = || async {
        let current = infra.current.lock().await;
        current
            .as_ref()
            .unwrap()
            .log_text()
            .lines()
            .filter(|l| {
                l.contains("WARN")
                    && l.contains("the API server refused a status write")
                    && l.contains(&*ns)
            })
            .count()
    };
    let window = Duration::from_secs(70);
    tokio::time::sleep(window).await;
    let attempts = status_patches(infra, &ns, "handleclasses", name);
    // At 15 s, 45 s (and 105 s) after the first: at most 3 in the window, the first included.
    assert!(
        (2..=3).contains(&attempts.len()),
        "status writes in {window:?}: {attempts:?}"
    );
    let counted = failures(&infra.metrics().await, "HandleClass", "StatusRefused") - counted_before;
    assert!(
        counted >= attempts.len() as f64,
        "{counted} refusals counted for {attempts:?}"
    );
    let logged = warns().await;
    assert!(
        (1..=attempts.len()).contains(&logged),
        "{logged} WARN lines for {} refused writes",
        attempts.len()
    );
    reapply_crds();
    eventually_within(
        Duration::from_secs(120),
        "the status is written at the next step once the CRD is right",
        async || {
            let obj = get(&client, &ns, "HandleClass", name).await.unwrap();
            match &obj["status"]["observedGeneration"] {
                Value::Number(n) if n.as_i64() == Some(1) => Ok(()),
                other => Err(format!("{other}")),
            }
        },
    )
    .await;
}

/// F9: a sweep Job whose Pod no scheduler ever looks at (its `schedulerName` names none; the
/// test cluster runs no scheduler at all) stays Pending with no node and no `PodScheduled`
/// condition. After the grace period (here `--unscheduled-grace-seconds 5`; 2 minutes by
/// default) the store says so: `LastSweepSucceeded=False` and `Ready=False` with reason
/// `SweepPodPending`, naming the Pod and the schedulerName, long before the Job's deadline.
#[tokio::test]
async fn a_sweep_pod_no_scheduler_looks_at_shows_on_the_store() {
    let _shared = ISOLATION.read().await;
    let _infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-unscheduled").await;
    let dsn = langgraph_database("faults_unscheduled").await;
    apply_yearly_store(&client, &ns, &dsn).await;
    let cron_jobs: Api<k8s_openapi::api::batch::v1::CronJob> = Api::namespaced(client.clone(), &ns);
    let cron = eventually("the sweep CronJob", async || {
        cron_jobs
            .get_opt("orders-sweep")
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "not yet".to_owned())
    })
    .await;
    let cron = serde_json::to_value(cron).unwrap();
    let template = &cron["spec"]["jobTemplate"];
    let mut spec = template["spec"].clone();
    spec["template"]["spec"]["schedulerName"] = json!("custody-test-no-such-scheduler");
    let job = json!({"apiVersion": "batch/v1", "kind": "Job",
                     "metadata": {"name": "orders-sweep-unscheduled",
                                  "labels": template["metadata"]["labels"]},
                     "spec": spec});
    Api::<k8s_openapi::api::batch::v1::Job>::namespaced(client.clone(), &ns)
        .create(&Default::default(), &serde_json::from_value(job).unwrap())
        .await
        .unwrap();
    let started = Instant::now();
    // The grace, then the controller's next look at a running Job's Pods (every 30 s).
    let obj = eventually_within(
        Duration::from_secs(90),
        "the store names the unscheduled Pod",
        async || {
            let obj = get(&client, &ns, "CheckpointStore", "orders")
                .await
                .unwrap();
            match condition(&obj, "LastSweepSucceeded") {
                Some(c) if c["reason"] == "SweepPodPending" => Ok(obj),
                _ => Err(format!("{}", obj["status"])),
            }
        },
    )
    .await;
    assert!(started.elapsed() >= Duration::from_secs(UNSCHEDULED_GRACE_SECONDS));
    let last = condition(&obj, "LastSweepSucceeded").unwrap();
    assert_eq!(last["status"], "False", "{last}");
    let message = last["message"].as_str().unwrap();
    for part in [
        "sweep Job orders-sweep-unscheduled is running but its Pod orders-sweep-unscheduled-",
        " has not been scheduled 5s after its creation and no scheduler has reported on it (is a scheduler running for schedulerName custody-test-no-such-scheduler?)",
        "spec.sweepTimeoutSeconds (600 s)",
    ] {
        assert!(message.contains(part), "{part:?} not in {message}");
    }
    let ready = condition(&obj, "Ready").unwrap();
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("SweepPodPending")),
        "{ready}"
    );
}

/// F11: a store whose DSN allows 300 s to connect (`connect_timeout=300`) to a port where the
/// kernel accepts and nothing ever answers. The controller's check waits its own 15 s, so the
/// store's conditions (`Reachable=False` naming that, `Scheduled`) are written within seconds,
/// not after the DSN's 300 s, and the Warning Event is an events.k8s.io Event with `eventTime`
/// (README, "The controller").
#[tokio::test]
async fn a_silent_database_holds_back_no_store_condition() {
    let _shared = ISOLATION.read().await;
    let _infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "faults-silentdb").await;
    // Never accepted: the kernel completes the handshake and the client's first bytes wait.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let dsn = format!("postgres://custody:hunter2@127.0.0.1:{port}/lg?connect_timeout=300");
    apply_yearly_store(&client, &ns, &dsn).await;
    let obj = eventually_within(
        Duration::from_secs(60),
        "the store's conditions, before the DSN's 300 s",
        async || {
            let obj = get(&client, &ns, "CheckpointStore", "orders")
                .await
                .unwrap();
            match (condition(&obj, "Reachable"), condition(&obj, "Scheduled")) {
                (Some(r), Some(s)) if r["status"] == "False" && s["status"] == "True" => Ok(obj),
                _ => Err(format!("{}", obj["status"])),
            }
        },
    )
    .await;
    let reachable = condition(&obj, "Reachable").unwrap();
    assert_eq!(reachable["reason"], "ConnectFailed", "{reachable}");
    let message = reachable["message"].as_str().unwrap();
    assert_eq!(
        message,
        format!(
            "spec.dsn: no answer from postgres://custody:***@127.0.0.1:{port}/lg?connect_timeout=300 within the controller's 15 s check (the DSN's connect_timeout bounds the sweeps' connects, not this check)"
        ),
        "{message}"
    );
    let event = wait_event(
        &client,
        &ns,
        "CheckpointStore",
        "orders",
        "ConnectFailed",
        "Warning",
    )
    .await;
    assert!(event.event_time.is_some(), "{event:?}");
    assert!(event.deprecated_last_timestamp.is_none(), "{event:?}");
    drop(silent);
}

/// F10: the controller's ClusterRole loses `watch` on Jobs while its watch of them streams (the
/// API server does not end a running watch when RBAC changes). Within a minute (the leader's
/// SelfSubjectAccessReviews every 45 s) `/readyz` answers 503 naming the verb and the resource,
/// counted as `watch_forbidden`; once the verb is restored it answers 200 again.
#[tokio::test]
async fn a_watch_whose_rbac_is_revoked_makes_the_controller_not_ready() {
    let _alone = ISOLATION.write().await;
    let infra = infra();
    let readyz = || async {
        let current = infra.current.lock().await;
        current.as_ref().unwrap().get("/readyz")
    };
    eventually("ready before", async || match readyz().await {
        Some((200, _)) => Ok(()),
        other => Err(format!("{other:?}")),
    })
    .await;
    let counted_before = failures(&infra.metrics().await, "CheckpointStore", "watch_forbidden");
    let restore = reduce_role(infra, "jobs", &["list"]);
    let revoked = Instant::now();
    let body = eventually_within(
        Duration::from_secs(60),
        "/readyz names the revoked watch",
        async || match readyz().await {
            Some((503, body)) if body.contains("watch jobs.batch") => Ok(body),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    eprintln!(
        "not ready {:?} after the revocation: {body}",
        revoked.elapsed()
    );
    assert!(
        body.contains(
            "RBAC does not let the controller watch jobs.batch (watched by the CheckpointStore controllers)"
        ),
        "{body}"
    );
    assert!(!body.contains("list jobs.batch"), "{body}");
    assert!(
        failures(&infra.metrics().await, "CheckpointStore", "watch_forbidden") > counted_before
    );
    drop(restore);
    // The next round, and the watch errors of the meantime aged out (90 s).
    eventually_within(
        Duration::from_secs(150),
        "ready again once the verb is restored",
        async || match readyz().await {
            Some((200, body)) => Ok(body),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
}
