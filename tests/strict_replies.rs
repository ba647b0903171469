//! Probes against servers whose answers are not exactly what JSON-RPC and SSE require (issue 17,
//! items 2, 7 and 9; an id of the right type and another value: tests/bad_input.rs
//! `wrong_id`): each is `unknown` with the true cause, never judged from an answer custody
//! did not get exactly. Discovery against the same servers: tests/discovery.rs
//! `misbehaving_servers_fail_cleanly`.
//!
//! The servers misbehave on `tools/call` only (`MISBEHAVE_ON`): a sweep lists each server's
//! tools before probing it, and a listing that fails the same way makes the probes `unknown`
//! at that step instead (tests/sweep.rs, the probe tool check).
//!
//! The misbehaving server (tests/py/misbehaving_server.py) knows none of the real basket
//! server's handles, so an answer it gives would read `BASKET_NOT_FOUND`, a `gone`, if custody
//! took it.

mod support;

use std::collections::BTreeMap;

use serde_json::{Value, json};
use support::{BasketServer, Db, Peer};

/// (case, `probeErrors` category, fragment of the reason)
const CASES: [(&str, &str, &str); 3] = [
    (
        "string_id",
        "protocol",
        "tools/call failed: the reply carried JSON-RPC id \"",
    ),
    (
        "error_event",
        "rpc_error",
        "tools/call failed: Mcp error: -32603: database unavailable",
    ),
    (
        "unterminated_event",
        "transport",
        "tools/call failed: the SSE reply ended after 0 events without a response to this request",
    ),
];

#[test]
fn inexact_probe_answers_are_unknown_with_their_cause() {
    let basket = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_some_fixtures(&basket.url(), Db::Sqlite(&db), Some("t-live,t-expired"), "");
    support::basket_resources(
        dir.path(),
        &basket.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let peers: Vec<Peer> = CASES
        .iter()
        .map(|(case, ..)| Peer::misbehaving_with(case, &[("MISBEHAVE_ON", "tools/call")]))
        .collect();
    for ((case, ..), peer) in CASES.iter().zip(&peers) {
        support::basket_class_on(dir.path(), &case.replace('_', "-"), &peer.url());
    }
    let started = std::time::Instant::now();
    let report = support::sweep_json(dir.path());
    let elapsed = started.elapsed();
    let rows = report["stores"][0]["rows"].as_array().unwrap();
    let row = |thread: &str, class: &str| -> &Value {
        rows.iter()
            .find(|r| r["thread_id"] == thread && r["handle_class"] == class)
            .unwrap_or_else(|| panic!("no row {thread}/{class}"))
    };
    assert_eq!(row("t-live", "basket")["verdict"], "ok");
    assert_eq!(row("t-expired", "basket")["verdict"], "gone");
    let mut lines = Vec::new();
    let mut failures = BTreeMap::new();
    for (case, category, fragment) in CASES {
        let class = case.replace('_', "-");
        for thread in ["t-live", "t-expired"] {
            let r = row(thread, &class);
            let reason = r["reason"].as_str().unwrap();
            let fine = r["verdict"] == "unknown"
                && reason.starts_with(&format!("probe failed: server {class}: "))
                && reason.contains(fragment)
                && r["action"].is_null();
            lines.push(format!(
                "{} {case} {thread}: {} {reason}",
                if fine { "PASS" } else { "FAIL" },
                r["verdict"]
            ));
        }
        *failures.entry(category.to_owned()).or_insert(0u64) += 2;
    }
    let text = lines.join("\n");
    assert!(!text.contains("FAIL"), "\n{text}");
    assert_eq!(
        report["stores"][0]["summary"]["probeErrors"],
        json!(failures),
        "\n{text}"
    );
    assert!(
        elapsed < std::time::Duration::from_secs(20),
        "an answer that arrived is never waited for: {elapsed:?}"
    );
}
