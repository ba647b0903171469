//! Observed handle lifetimes in a cluster (issue 19), against a real kube-apiserver: the real
//! `custody sweep --store` command, as the sweep CronJob's ServiceAccount, writes the
//! HandleClass's `status.observedLifetime` under its own field manager; the real controller
//! (as the chart's ServiceAccount) derives `DeclaredTtlPlausible`, its Warning Event and the
//! lifetime metrics from it, and leaves the sweep's field alone. The sweeps run on a clock the
//! test controls (the hidden `--now`), shared with a real basket server whose baskets live
//! exactly 1800 s; real LangGraph threads in PostgreSQL.
//!
//! The same for a sweep's conformance evidence (issue 17, item 13): a real basket server whose
//! `get_basket` result is off its `outputSchema`, found only by the sweep, reaches the
//! MCPServer's `status.sweepConformance`, the `Conformant` condition, a Warning Event and the
//! conformance metric, and a later sweep's conforming result clears it.

#[path = "support/apiserver.rs"]
mod apiserver;
#[path = "support/cluster.rs"]
mod cluster;
#[path = "support/suite.rs"]
mod suite;
mod support;

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use apiserver::{
    TestNs, apply, client, condition, events, eventually, get, wait_conditions, wait_event,
};
use cluster::{metric, token_kubeconfig};
use serde_json::json;
use suite::{ISOLATION, Suite};
use support::BasketServer;
use support::fixtures::{merged, object, observing_basket_class, store_from};

fn infra() -> &'static Suite {
    static INFRA: OnceLock<Suite> = OnceLock::new();
    INFRA.get_or_init(|| Suite::install("lifetime", |s| s.replica("replica-0", &[])))
}

const THREADS: usize = 25;
const LIFETIME: f64 = 1800.0;

fn set_clock(path: &Path, unix: f64) {
    std::fs::write(path, format!("{unix:.3}")).unwrap();
}

#[tokio::test]
async fn sweeps_report_lifetimes_and_the_controller_judges_the_declared_ttl() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "lifetime").await;
    let dir = tempfile::tempdir().unwrap();
    let clock = dir.path().join("clock");
    let start = chrono::Utc::now().timestamp() as f64;
    set_clock(&clock, start);
    let server = BasketServer::start(&[
        ("BASKET_CLOCK_FILE", clock.to_str().unwrap()),
        ("BASKET_TTL_SECONDS", "1800"),
    ]);
    let dsn = support::fresh_pg_database("cluster_lifetimes").await;
    let mut cmd = Command::new(support::var("CUSTODY_TEST_PYTHON"));
    let out = cmd
        .arg(support::var("CUSTODY_TEST_ORDER_GRAPH"))
        .args(["write-many", "--server", &server.url(), "--postgres", &dsn])
        .args(["--count", &THREADS.to_string(), "--thread-prefix", "t-"])
        .args(["--clock-step", "40"])
        .env("ORDER_GRAPH_CLOCK_FILE", &clock)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let class = object("HandleClass", "basket", observing_basket_class());
    let sa = infra
        .sweep_namespace(&client, &ns, &server.url(), &dsn, &class)
        .await;
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "orders",
            merged(store_from("orders-checkpoints"), json!({"mode": "act"})),
        ),
    )
    .await;
    wait_conditions(&client, &ns, "HandleClass", "basket", &[("Ready", "True")]).await;
    let kubeconfig = token_kubeconfig(&infra.dir.join(format!("{}.kubeconfig", &*ns)), &ns, &sa);

    // Sweeps every 300 s of the test's clock from the last mint until every basket expired.
    let written = start + THREADS as f64 * 40.0;
    let mut t = written;
    while t <= written + LIFETIME + 600.0 {
        set_clock(&clock, t);
        let now = chrono::DateTime::from_timestamp(t as i64, 0)
            .unwrap()
            .to_rfc3339();
        let out = Command::new(env!("CARGO_BIN_EXE_custody"))
            .args([
                "sweep",
                "--store",
                &format!("{}/orders", &*ns),
                "--now",
                &now,
            ])
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        t += 300.0;
    }

    let class = eventually("status.observedLifetime of a full history", async || {
        let o = get(&client, &ns, "HandleClass", "basket").await.unwrap();
        match o["status"]["observedLifetime"][0]["handlesGone"].as_u64() {
            Some(n) if n == THREADS as u64 => Ok(o),
            _ => Err(o["status"].to_string()),
        }
    })
    .await;
    let entry = &class["status"]["observedLifetime"][0];
    assert_eq!(entry["store"], "orders", "{entry}");
    assert_eq!(entry["handles"], THREADS, "{entry}");
    assert_eq!(entry["acrossSweeps"], true, "{entry}");
    let p50 = entry["p50Seconds"].as_f64().unwrap();
    assert!((p50 - LIFETIME).abs() <= 60.0, "{entry}");
    let managers = class["metadata"]["managedFields"].as_array().unwrap();
    assert!(
        managers
            .iter()
            .any(|m| m["manager"] == "custody-lifetime-orders" && m["subresource"] == "status"),
        "{managers:?}"
    );
    // No TTL declared: no condition, no plausibility gauge.
    assert!(
        condition(&class, "DeclaredTtlPlausible").is_none(),
        "{class}"
    );
    let p50_series = format!(
        "custody_handle_lifetime_seconds{{namespace=\"{}\",class=\"basket\",quantile=\"0.5\"}}",
        &*ns
    );
    let gone_ages = format!(
        "custody_handle_probe_age_seconds_count{{namespace=\"{}\",class=\"basket\",verdict=\"gone\"}}",
        &*ns
    );
    eventually("the lifetime metrics", async || {
        let text = infra.metrics().await;
        match (metric(&text, &p50_series), metric(&text, &gone_ages)) {
            (Some(p), Some(n)) if p == p50 && n >= THREADS as f64 => Ok(()),
            other => Err(format!("{p50_series}, {gone_ages}: {other:?}")),
        }
    })
    .await;

    // A declared TTL twice the lifetime: False, with the figures, and a Warning Event.
    let declared = |ttl: u64| {
        object(
            "HandleClass",
            "basket",
            merged(observing_basket_class(), json!({"declaredTtlSeconds": ttl})),
        )
    };
    apply(&client, &ns, &declared(3600)).await;
    let class = wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "basket",
        &[("DeclaredTtlPlausible", "False")],
    )
    .await;
    let cond = condition(&class, "DeclaredTtlPlausible").unwrap();
    assert_eq!(cond["reason"], "DeclaredTtlTooLong", "{cond}");
    let p5 = entry["p5Seconds"].as_u64().unwrap();
    let message = cond["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("consider {}s", p5 * 4 / 5)),
        "{message}"
    );
    let event = wait_event(
        &client,
        &ns,
        "HandleClass",
        "basket",
        "DeclaredTtlTooLong",
        "Warning",
    )
    .await;
    assert!(
        event.note.as_deref().is_some_and(|n| n.contains("3600s")),
        "{event:?}"
    );
    assert_eq!(
        class["status"]["observedLifetime"][0], *entry,
        "the controller leaves the sweep's field alone"
    );
    let plausible = format!(
        "custody_handle_declared_ttl_plausible{{namespace=\"{}\",class=\"basket\"}}",
        &*ns
    );
    eventually("plausible 0", async || {
        match metric(&infra.metrics().await, &plausible) {
            Some(0.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let table = cluster::cluster()
        .kubectl(&["get", "hc", "-n", &ns, "basket"], None)
        .ok();
    assert!(
        table.contains("DECLARED TTL") && table.contains("OBSERVED P50") && table.contains("3600"),
        "{table}"
    );
    assert!(table.contains(&format!("{p50}")), "{table}");

    // A declared TTL below the lifetime: True, gauge 1.
    apply(&client, &ns, &declared(900)).await;
    wait_conditions(
        &client,
        &ns,
        "HandleClass",
        "basket",
        &[("DeclaredTtlPlausible", "True")],
    )
    .await;
    eventually("plausible 1", async || {
        match metric(&infra.metrics().await, &plausible) {
            Some(1.0) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // A deleted CheckpointStore's entry is dropped (no sweep of it will ever update it), and
    // another store's entry stays: an observing store on the same database, swept once.
    apply(
        &client,
        &ns,
        &object(
            "CheckpointStore",
            "replica",
            json!({"backend": "postgres",
                   "dsnFrom": {"name": "orders-checkpoints", "key": "dsn"}}),
        ),
    )
    .await;
    // Never swept yet: its creation time stands for the last success, so the overdue alert
    // covers a store whose sweeps never succeed.
    let replica = get(&client, &ns, "CheckpointStore", "replica")
        .await
        .unwrap();
    let created = chrono::DateTime::parse_from_rfc3339(
        replica["metadata"]["creationTimestamp"].as_str().unwrap(),
    )
    .unwrap();
    let last_success = format!(
        "custody_sweep_last_success_timestamp_seconds{{namespace=\"{}\",name=\"replica\"}}",
        &*ns
    );
    eventually(
        "the never-swept store's last success",
        async || match metric(&infra.metrics().await, &last_success) {
            Some(v) if v == created.timestamp() as f64 => Ok(()),
            other => Err(format!("{last_success} = {other:?}, created {created}")),
        },
    )
    .await;
    let now = chrono::DateTime::from_timestamp(t as i64, 0)
        .unwrap()
        .to_rfc3339();
    let out = Command::new(env!("CARGO_BIN_EXE_custody"))
        .args([
            "sweep",
            "--store",
            &format!("{}/replica", &*ns),
            "--now",
            &now,
        ])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stores = |o: &serde_json::Value| -> Vec<String> {
        o["status"]["observedLifetime"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| e["store"].as_str().unwrap().to_owned())
            .collect()
    };
    eventually("both stores' entries", async || {
        let o = get(&client, &ns, "HandleClass", "basket").await.unwrap();
        match stores(&o).as_slice() {
            [a, b] if a == "orders" && b == "replica" => Ok(()),
            _ => Err(o["status"].to_string()),
        }
    })
    .await;
    apiserver::kind_api(&client, &ns, "CheckpointStore")
        .delete("orders", &Default::default())
        .await
        .unwrap();
    let class = eventually("the deleted store's entry dropped", async || {
        let o = get(&client, &ns, "HandleClass", "basket").await.unwrap();
        match stores(&o).as_slice() {
            [only] if only == "replica" => Ok(o),
            _ => Err(o["status"].to_string()),
        }
    })
    .await;
    let managers = class["metadata"]["managedFields"].as_array().unwrap();
    assert!(
        !managers
            .iter()
            .any(|m| m["manager"] == "custody-lifetime-orders"),
        "{managers:?}"
    );
    drop(server);
}

/// Issue 17, item 13: a result off its tool's `outputSchema`, which the controller's discovery
/// cannot see (it calls no tools), reaches `kubectl describe mcpserver` through the sweep:
/// `status.sweepConformance` (written as the sweep ServiceAccount under its own field manager),
/// `Conformant=False ResultOffSchema`, one `ResultOffSchema` Warning Event and
/// `custody_server_conformance_warnings{kind="output_schema"}`. Neither status writer erases the
/// other's fields; a later sweep that gets a conforming result clears the entry.
#[tokio::test]
async fn a_sweeps_result_off_schema_reaches_the_server_status_and_is_cleared_by_a_conforming_one() {
    let _shared = ISOLATION.read().await;
    let infra = infra();
    let client = client().await;
    let ns = TestNs::new(&client, "conformance").await;
    let off = BasketServer::start(&[("BASKET_OFF_SCHEMA", "1")]);
    let plain = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("cluster_conformance").await;
    // One live basket on each server, in threads of the same store.
    for (server, prefix) in [(&off, "off-"), (&plain, "plain-")] {
        support::write_some_fixtures(
            &server.url(),
            support::Db::Postgres(&dsn),
            Some("t-live"),
            prefix,
        );
    }
    let class = object("HandleClass", "basket", observing_basket_class());
    let sa = infra
        .sweep_namespace(&client, &ns, &off.url(), &dsn, &class)
        .await;
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
    wait_conditions(&client, &ns, "HandleClass", "basket", &[("Ready", "True")]).await;
    // Discovery alone sees nothing wrong.
    wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "basket",
        &[("Ready", "True"), ("Conformant", "True")],
    )
    .await;
    let kubeconfig = token_kubeconfig(&infra.dir.join(format!("{}.kubeconfig", &*ns)), &ns, &sa);
    let sweep = || {
        let out = Command::new(env!("CARGO_BIN_EXE_custody"))
            .args(["sweep", "--store", &format!("{}/orders", &*ns)])
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let series = format!(
        "custody_server_conformance_warnings{{namespace=\"{}\",name=\"basket\",kind=\"output_schema\"}}",
        &*ns
    );
    let gauge = async |want: f64| {
        eventually(&format!("{series} = {want}"), async || {
            match metric(&infra.metrics().await, &series) {
                Some(v) if v == want => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    };
    gauge(0.0).await;

    sweep();
    let server = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "basket",
        &[("Ready", "True"), ("Conformant", "False")],
    )
    .await;
    let entries = server["status"]["sweepConformance"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert_eq!(
        (
            &entry["store"],
            &entry["kind"],
            &entry["tool"],
            &entry["count"]
        ),
        (
            &json!("orders"),
            &json!("output_schema"),
            &json!("get_basket"),
            &json!(1)
        ),
        "{entry}"
    );
    let message = entry["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "tools/call get_basket: structuredContent does not match the declared outputSchema: \
             at /item_count: fails `type`"
        ),
        "{message}"
    );
    assert!(chrono::DateTime::parse_from_rfc3339(entry["lastSeen"].as_str().unwrap()).is_ok());
    let cond = condition(&server, "Conformant").unwrap();
    assert_eq!(cond["reason"], "ResultOffSchema", "{cond}");
    let said = format!("seen by sweeps of store orders: {message}");
    assert!(cond["message"].as_str().unwrap().contains(&said), "{cond}");
    assert_eq!(
        server["status"]["conformanceWarnings"],
        json!([{"kind": "output_schema", "message": said}])
    );
    let managers = server["metadata"]["managedFields"].as_array().unwrap();
    assert!(
        managers
            .iter()
            .any(|m| m["manager"] == "custody-conformance-orders" && m["subresource"] == "status"),
        "{managers:?}"
    );
    let event = wait_event(
        &client,
        &ns,
        "MCPServer",
        "basket",
        "ResultOffSchema",
        "Warning",
    )
    .await;
    assert!(
        event.note.as_deref().is_some_and(|n| n.contains(&said)),
        "{event:?}"
    );
    gauge(1.0).await;

    // A controller status write (a new generation) keeps the sweep's entry ...
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "basket",
            json!({"url": off.url(), "timeoutSeconds": 7}),
        ),
    )
    .await;
    // Generation 2 is first written as Ready=Unknown Pending, then as checked.
    let server = eventually(
        "the controller's checked status of generation 2",
        async || {
            let o = get(&client, &ns, "MCPServer", "basket").await.unwrap();
            match o["status"]["observedGeneration"].as_i64() {
                Some(2) if o["status"]["conditions"][0]["reason"] != "Pending" => Ok(o),
                other => Err(format!("{other:?}: {}", o["status"])),
            }
        },
    )
    .await;
    assert_eq!(server["status"]["sweepConformance"][0], *entry);
    // ... and a sweep's write keeps the controller's: the count grows, nothing else moves.
    sweep();
    let after = eventually("the second sweep's count", async || {
        let o = get(&client, &ns, "MCPServer", "basket").await.unwrap();
        match o["status"]["sweepConformance"][0]["count"].as_u64() {
            Some(2) => Ok(o),
            other => Err(format!("{other:?}: {}", o["status"])),
        }
    })
    .await;
    for field in [
        "conditions",
        "observedGeneration",
        "conformanceWarnings",
        "catalogDigest",
    ] {
        assert_eq!(after["status"][field], server["status"][field], "{field}");
    }

    // The server fixed: its conforming result clears the entry (the off server's basket is
    // unknown there, which is no evidence).
    apply(
        &client,
        &ns,
        &object(
            "MCPServer",
            "basket",
            json!({"url": plain.url(), "timeoutSeconds": 7}),
        ),
    )
    .await;
    eventually("the controller's status of generation 3", async || {
        let o = get(&client, &ns, "MCPServer", "basket").await.unwrap();
        match o["status"]["observedGeneration"].as_i64() {
            Some(3) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    sweep();
    let server = wait_conditions(
        &client,
        &ns,
        "MCPServer",
        "basket",
        &[("Ready", "True"), ("Conformant", "True")],
    )
    .await;
    assert!(
        server["status"].get("sweepConformance").is_none(),
        "{}",
        server["status"]
    );
    assert!(
        server["status"].get("conformanceWarnings").is_none(),
        "{}",
        server["status"]
    );
    gauge(0.0).await;
    // Said once: the second sweep's count and the controller's rewrites repeated no Event.
    let n = events(&client, &ns, "MCPServer", "basket")
        .await
        .iter()
        .filter(|e| e.reason.as_deref() == Some("ResultOffSchema"))
        .count();
    assert_eq!(n, 1);
    drop((off, plain));
}
