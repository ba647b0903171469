//! The tests' own (admin) view of the test control plane through kube-rs: a client, a namespace
//! per test, custody objects, their conditions and Events, and waits on them.
//!
//! Needs `tests/support/cluster.rs` as the crate's `cluster` module. Include with
//! `#[path = "support/cluster.rs"] mod cluster;` and
//! `#[path = "support/apiserver.rs"] mod apiserver;`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::{Value, json};

/// Every wait's deadline (the machine may be busy).
pub const DEADLINE: Duration = Duration::from_secs(60);
/// Poll interval of every wait.
pub const POLL: Duration = Duration::from_millis(200);

/// The custody kinds, as `kubectl` and the API name them.
pub const CUSTODY_KINDS: [&str; 4] = [
    "MCPServer",
    "AgentAssignment",
    "HandleClass",
    "CheckpointStore",
];

/// An admin client (the tests' own view of the cluster).
pub async fn client() -> Client {
    let kc = kube::config::Kubeconfig::read_from(crate::cluster::var("CUSTODY_TEST_KUBECONFIG"))
        .unwrap();
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// A test's namespace `TAG-PID`, deleted (with everything in it) when dropped.
pub struct TestNs(String);

impl TestNs {
    /// Creates it (an existing one, left by an earlier run of this pid, is reused).
    pub async fn new(client: &Client, tag: &str) -> Self {
        let name = format!("{tag}-{}", std::process::id());
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        match Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create namespace {name}: {e}"),
        }
        // As the chart creates it in each namespace of `sweep.namespaces`: the ServiceAccount a
        // CheckpointStore's sweep Jobs run as (without it, the store is not Scheduled).
        let account: ServiceAccount =
            serde_json::from_value(json!({"metadata": {"name": "custody-sweep"}})).unwrap();
        match Api::<ServiceAccount>::namespaced(client.clone(), &name)
            .create(&PostParams::default(), &account)
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create ServiceAccount custody-sweep in {name}: {e}"),
        }
        Self(name)
    }
}

impl Drop for TestNs {
    fn drop(&mut self) {
        let _ = crate::cluster::cluster()
            .kubectl(&["delete", "namespace", &self.0, "--wait=false"], None);
    }
}

impl std::ops::Deref for TestNs {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// The API resource of a kind the tests write (`apiVersion` as in a manifest).
pub fn resource(api_version: &str, kind: &str) -> ApiResource {
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let plural = match kind {
        "MCPServer" => "mcpservers",
        "AgentAssignment" => "agentassignments",
        "HandleClass" => "handleclasses",
        "CheckpointStore" => "checkpointstores",
        "Secret" => "secrets",
        "ServiceAccount" => "serviceaccounts",
        "RoleBinding" => "rolebindings",
        other => panic!("no plural for {other}"),
    };
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// A custody kind's API in `ns`.
pub fn kind_api(client: &Client, ns: &str, kind: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &resource("custody.dev/v1alpha1", kind))
}

/// Server-side apply of one object (the tests' field manager); returns it as stored.
pub async fn apply(client: &Client, ns: &str, obj: &Value) -> Value {
    let ar = resource(
        obj["apiVersion"].as_str().unwrap(),
        obj["kind"].as_str().unwrap(),
    );
    let name = obj["metadata"]["name"].as_str().unwrap();
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let out = api
        .patch(
            name,
            &PatchParams::apply("custody-tests").force(),
            &Patch::Apply(obj),
        )
        .await
        .unwrap_or_else(|e| panic!("apply {} {ns}/{name}: {e}", obj["kind"]));
    serde_json::to_value(out).unwrap()
}

/// A custody object, or `None` when it does not exist.
pub async fn get(client: &Client, ns: &str, kind: &str, name: &str) -> Option<Value> {
    kind_api(client, ns, kind)
        .get_opt(name)
        .await
        .unwrap()
        .map(|o| serde_json::to_value(o).unwrap())
}

/// The object's status condition of this type.
pub fn condition<'a>(obj: &'a Value, type_: &str) -> Option<&'a Value> {
    obj["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Retries `check` every [`POLL`] until it returns `Ok`; panics with its last error after
/// [`DEADLINE`].
pub async fn eventually<T>(what: &str, check: impl AsyncFnMut() -> Result<T, String>) -> T {
    eventually_within(DEADLINE, what, check).await
}

/// [`eventually`] with a deadline of its own, for what takes longer than [`DEADLINE`] by design
/// (a CronJob's schedule, a Lease's renewal period).
pub async fn eventually_within<T>(
    within: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(e) if Instant::now() >= deadline => {
                panic!("{what}: not so after {within:?}; last: {e}")
            }
            Err(_) => tokio::time::sleep(POLL).await,
        }
    }
}

/// Waits until the object's conditions have these statuses, each observed at the current
/// generation; returns the object.
pub async fn wait_conditions(
    client: &Client,
    ns: &str,
    kind: &str,
    name: &str,
    want: &[(&str, &str)],
) -> Value {
    eventually(
        &format!("{kind} {ns}/{name} has conditions {want:?}"),
        async || {
            let obj = get(client, ns, kind, name).await.ok_or("does not exist")?;
            let generation = &obj["metadata"]["generation"];
            for (type_, status) in want {
                let c = condition(&obj, type_)
                    .ok_or_else(|| format!("no {type_}; status: {}", obj["status"]))?;
                if c["status"] != *status || &c["observedGeneration"] != generation {
                    return Err(format!("{c} at generation {generation}"));
                }
            }
            Ok(obj)
        },
    )
    .await
}

/// The events.k8s.io Events about the object `kind/name` in `ns`.
pub async fn events(client: &Client, ns: &str, kind: &str, name: &str) -> Vec<Event> {
    Api::<Event>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding
                .as_ref()
                .is_some_and(|r| r.kind.as_deref() == Some(kind) && r.name.as_deref() == Some(name))
        })
        .collect()
}

/// Asserts that exactly one Event of `reason` is about `kind/name`, and not a series (kube's
/// Recorder folds a repeat into one): published once, not once per reconcile or recheck.
pub async fn assert_one_event(client: &Client, ns: &str, kind: &str, name: &str, reason: &str) {
    let found: Vec<Event> = events(client, ns, kind, name)
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect();
    assert!(
        found.len() == 1 && found[0].series.is_none(),
        "one {reason} Event about {kind} {ns}/{name}, not one per reconcile or recheck: {found:?}"
    );
}

/// Waits for an Event of this reason and type (`Normal`, `Warning`) about `kind/name`.
pub async fn wait_event(
    client: &Client,
    ns: &str,
    kind: &str,
    name: &str,
    reason: &str,
    type_: &str,
) -> Event {
    eventually(
        &format!("{type_} Event {reason} about {kind} {ns}/{name}"),
        async || {
            let all = events(client, ns, kind, name).await;
            all.iter()
                .find(|e| e.reason.as_deref() == Some(reason) && e.type_.as_deref() == Some(type_))
                .cloned()
                .ok_or_else(|| {
                    let seen: Vec<_> = all.iter().map(|e| (&e.reason, &e.type_)).collect();
                    format!("Events: {seen:?}")
                })
        },
    )
    .await
}

/// Everything a namespace shows to someone without Secret access: ConfigMaps, custody objects
/// (spec and status) and Events, as JSON text.
pub async fn visible_text(client: &Client, ns: &str) -> String {
    let mut all = Vec::new();
    for cm in Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .unwrap()
    {
        all.push(serde_json::to_string(&cm).unwrap());
    }
    for kind in CUSTODY_KINDS {
        for o in kind_api(client, ns, kind)
            .list(&Default::default())
            .await
            .unwrap()
        {
            all.push(serde_json::to_string(&o).unwrap());
        }
    }
    for e in Api::<Event>::namespaced(client.clone(), ns)
        .list(&Default::default())
        .await
        .unwrap()
    {
        all.push(serde_json::to_string(&e).unwrap());
    }
    all.join("\n")
}
