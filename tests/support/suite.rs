//! The one `custody controller` a cluster test file shares, as in a cluster: it watches every
//! namespace, so two controllers on different Leases would both reconcile every object. Tests
//! hold [`ISOLATION`] shared; a test that replaces the serving replica holds it alone and leaves
//! the replica that took over in [`Suite::current`].
//!
//! Needs `tests/support/cluster.rs` and `tests/support/apiserver.rs` as the crate's `cluster` and
//! `apiserver` modules, and `tests/support` as `support`. Include with
//! `#[path = "support/suite.rs"] mod suite;`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::path::{Path, PathBuf};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;
use serde_json::{Value, json};

use crate::apiserver::apply;
use crate::cluster::{self, ControllerProcess, metric};
use crate::support::fixtures::{object, secret, server_spec};

/// The Lease name (the chart's Role allows only this one).
pub const LEASE: &str = "custody-controller";

/// Tests hold it shared; a test that replaces the serving replica holds it alone.
pub static ISOLATION: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The chart's RBAC for one release and the controller replica serving a test file.
pub struct Suite {
    /// The chart's release (and fullname), `custody-TAG-PID`.
    pub release: String,
    /// Its namespace, `custody-TAG-system-PID`: the controller ServiceAccount and the Lease.
    pub system_ns: String,
    /// A kubeconfig that authenticates as the chart's controller ServiceAccount.
    pub kubeconfig: PathBuf,
    /// Logs and kubeconfigs.
    pub dir: PathBuf,
    /// The replica serving the file.
    pub current: tokio::sync::Mutex<Option<ControllerProcess>>,
}

impl Suite {
    /// Installs the chart's ServiceAccounts and RBAC for release `custody-TAG-PID`
    /// ([`cluster::controller_kubeconfig`]), starts the first replica with `first` and waits
    /// until it holds the Lease.
    pub fn install(tag: &str, first: impl FnOnce(&Suite) -> ControllerProcess) -> Self {
        let c = cluster::cluster();
        c.ensure_crds();
        let pid = std::process::id();
        let release = format!("custody-{tag}-{pid}");
        let system_ns = format!("custody-{tag}-system-{pid}");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{tag}-{pid}"));
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = cluster::controller_kubeconfig(
            &release,
            &system_ns,
            &dir.join("controller.kubeconfig"),
        );
        let mut suite = Self {
            release,
            system_ns,
            kubeconfig,
            dir,
            current: tokio::sync::Mutex::new(None),
        };
        let replica = first(&suite);
        c.eventually(crate::apiserver::DEADLINE, || {
            match metric(&replica.metrics(), "custody_leader") {
                Some(1.0) => Ok(()),
                other => Err(format!(
                    "the only replica did not take the Lease (custody_leader {other:?}):\n{}",
                    replica.log_tail()
                )),
            }
        });
        *suite.current.get_mut() = Some(replica);
        suite
    }

    /// Starts `custody controller --identity IDENTITY --lease-namespace SYSTEM_NS ARGS…` as the
    /// chart's controller ServiceAccount, logging to `DIR/IDENTITY.log`; waits for `/readyz`.
    pub fn replica(&self, identity: &str, args: &[&str]) -> ControllerProcess {
        let mut all = vec!["--lease-namespace", &self.system_ns];
        all.extend_from_slice(args);
        ControllerProcess::start(
            Path::new(env!("CARGO_BIN_EXE_custody")),
            &self.kubeconfig,
            identity,
            &self.dir.join(format!("{identity}.log")),
            &all,
        )
    }

    /// Every controller log of the file.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "log") {
                text += &std::fs::read_to_string(path).unwrap_or_default();
            }
        }
        text
    }

    /// `/metrics` of the serving replica.
    pub async fn metrics(&self) -> String {
        self.current.lock().await.as_ref().unwrap().metrics()
    }

    /// The Leases of the system namespace (the controller's is [`LEASE`]).
    pub fn leases(&self, client: &Client) -> Api<Lease> {
        Api::namespaced(client.clone(), &self.system_ns)
    }

    /// The ServiceAccount and RoleBinding the sweeps of `ns` run as
    /// (deploy/examples/basket/sweep-access.yaml, bound to this release's sweep ClusterRole).
    pub fn sweep_access(&self, ns: &str) -> Vec<Value> {
        let path = cluster::repo().join("deploy/examples/basket/sweep-access.yaml");
        cluster::yaml_docs(&std::fs::read_to_string(path).unwrap())
            .into_iter()
            .map(|mut d| {
                d["metadata"]["namespace"] = json!(ns);
                if d["kind"] == "RoleBinding" {
                    d["roleRef"]["name"] = json!(format!("{}-sweep", self.release));
                    d["subjects"][0]["namespace"] = json!(ns);
                }
                d
            })
            .collect()
    }

    /// Applies [`Suite::sweep_access`] in `ns`; returns the ServiceAccount's name.
    pub async fn apply_sweep_access(&self, client: &Client, ns: &str) -> String {
        let mut account = String::new();
        for d in self.sweep_access(ns) {
            if d["kind"] == "ServiceAccount" {
                account = d["metadata"]["name"].as_str().unwrap().to_owned();
            }
            apply(client, ns, &d).await;
        }
        account
    }

    /// What a sweep of `ns` reads besides its CheckpointStore: [`Suite::apply_sweep_access`],
    /// Secret `orders-checkpoints` with key `dsn`, MCPServer `basket` at `server_url` and the
    /// HandleClass `class`. Returns the sweep ServiceAccount's name.
    pub async fn sweep_namespace(
        &self,
        client: &Client,
        ns: &str,
        server_url: &str,
        dsn: &str,
        class: &Value,
    ) -> String {
        let account = self.apply_sweep_access(client, ns).await;
        apply(
            client,
            ns,
            &secret("orders-checkpoints", json!({"dsn": dsn})),
        )
        .await;
        apply(
            client,
            ns,
            &object("MCPServer", "basket", server_spec(server_url)),
        )
        .await;
        apply(client, ns, class).await;
        account
    }

    /// Who holds the controller's Lease now.
    pub async fn lease_holder(&self, client: &Client) -> Option<String> {
        self.leases(client)
            .get(LEASE)
            .await
            .unwrap()
            .spec
            .and_then(|s| s.holder_identity)
    }
}
