//! The one `custody controller` a cluster test file shares, as in a cluster: it watches every
//! namespace, so two controllers on different Leases would both reconcile every object. Tests
//! hold [`ISOLATION`] shared; a test that replaces the serving replica holds it alone and leaves
//! the replica that took over in [`Suite::current`].
//!
//! Needs `tests/support/cluster.rs` as the crate's `cluster` module. Include with
//! `#[path = "support/suite.rs"] mod suite;`.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::path::{Path, PathBuf};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;

use crate::cluster::{self, ControllerProcess, metric};

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
