//! The acting tests' world: a basket server, a checkpoint database and local-mode resources
//! acting on it, and the real binary sweeping them (tests/actions.rs, tests/agent.rs).

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use super::BasketServer;
use super::checkpoints::{Checkpoints, Kind};

/// A basket server, a checkpoint database and a resource directory acting on it.
pub struct World {
    pub server: BasketServer,
    pub res: tempfile::TempDir,
    pub checkpoints: Checkpoints,
}

impl World {
    /// A fresh world whose HandleClass has `onGone: on_gone`; `server_env` are `BASKET_*`
    /// settings of its server.
    pub async fn new(kind: Kind, name: &str, on_gone: &str, server_env: &[(&str, &str)]) -> Self {
        let server = BasketServer::start(server_env);
        let res = tempfile::tempdir().unwrap();
        let checkpoints = Checkpoints::new(kind, res.path(), name).await;
        let (backend, dsn) = checkpoints.backend_dsn();
        super::act_resources(res.path(), &server.url(), backend, &dsn, on_gone);
        Self {
            server,
            res,
            checkpoints,
        }
    }

    /// The server's MCP endpoint.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// [`sweep`] of its resources.
    pub fn sweep(&self, apply: bool) -> Value {
        sweep(self.res.path(), apply)
    }
}

/// `custody sweep (--apply | --dry-run) -f RES -o json`, asserting success.
pub fn sweep(res: &Path, apply: bool) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", if apply { "--apply" } else { "--dry-run" }])
        .args(["-o", "json", "-f"])
        .arg(res)
        .output()
        .expect("run custody");
    super::sweep_report(&out)
}

/// The report's row of `thread` in its first store.
pub fn row<'a>(report: &'a Value, thread: &str) -> &'a Value {
    report["stores"][0]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["thread_id"] == thread)
        .unwrap_or_else(|| panic!("no row for {thread} in {report}"))
}
