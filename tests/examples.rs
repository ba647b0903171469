//! The shipped local-mode PostgreSQL example (deploy/examples/local-postgres) sweeps real
//! LangGraph PostgresSaver checkpoints, with only its server URL and DSN pointed at this test's
//! basket server and database. Its dry run predicts what `--apply` does on a `mode: act` copy,
//! and that copy acts. The cluster example's HandleClass (deploy/examples/basket) acts too.

mod support;

use std::collections::BTreeMap;

use serde_json::Value;
use support::fixtures::{merged, object, store_spec};
use support::{BasketServer, Db};

#[tokio::test]
async fn local_postgres_example_sweeps_postgres_checkpoints() {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("example_local_pg").await;
    let manifest = support::write_fixtures(&server.url(), Db::Postgres(&dsn));
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/examples/local-postgres");
    let dir = tempfile::tempdir().unwrap();
    let mut files = 0;
    for entry in std::fs::read_dir(&example).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text
            .replace("http://127.0.0.1:18931/mcp", &server.url())
            .replace("postgres://postgres@127.0.0.1:5432/langgraph", &dsn);
        std::fs::write(dir.path().join(path.file_name().unwrap()), text).unwrap();
        files += 1;
    }
    assert_eq!(files, 4, "mcpserver, handleclass, secret, checkpointstore");
    let report = support::sweep_json(dir.path());
    assert_eq!(report["stores"][0]["summary"]["probes"], 4, "{report}");
    let got: BTreeMap<String, String> = support::verdicts(&report)
        .into_iter()
        .map(|(thread, (verdict, _))| (thread, verdict))
        .collect();
    let want: BTreeMap<String, String> = manifest["threads"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, t)| t["parked"] == true)
        .map(|(id, t)| (id.clone(), t["expected"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(got, want);
    assert!(
        !report.to_string().contains(&dsn),
        "the DSN is not in the report"
    );
    let acted_on = |report: &Value| -> BTreeMap<String, String> {
        report["stores"][0]["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["verdict"] == "gone" || r["verdict"] == "absent")
            .map(|r| {
                let a = &r["action"];
                (
                    r["thread_id"].as_str().unwrap().to_owned(),
                    format!("{} {}", a["plan"], a["outcome"]),
                )
            })
            .collect()
    };
    let planned = acted_on(&report);
    assert!(!planned.is_empty(), "{report}");
    for (thread, action) in &planned {
        assert_eq!(action, "\"escalate\" \"planned\"", "{thread}: {report}");
    }

    let store = dir.path().join("checkpointstore.yaml");
    let text = std::fs::read_to_string(&store).unwrap();
    std::fs::write(&store, format!("{text}  mode: act\n")).unwrap();
    let out = support::custody(&[
        "sweep",
        "--apply",
        "-f",
        dir.path().to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let applied: Value = serde_json::from_slice(&out.stdout).unwrap();
    let acted = acted_on(&applied);
    assert_eq!(
        acted.keys().collect::<Vec<_>>(),
        planned.keys().collect::<Vec<_>>()
    );
    for (thread, action) in &acted {
        assert_eq!(action, "\"escalate\" \"escalated\"", "{thread}: {applied}");
    }
}

/// The cluster example's HandleClass (deploy/examples/basket/handleclass.yaml, copied as it
/// ships) on an acting store: `--apply` escalates every gone or absent handle, none is left
/// with "no verdictPath" (the example once had none, and `mode: act` skipped every row).
#[test]
fn cluster_example_handle_class_acts() {
    let server = BasketServer::start(&[]);
    let (dir, _manifest) = support::sqlite_basket_dir(&server.url());
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/examples/basket/handleclass.yaml");
    std::fs::copy(&example, dir.path().join("class.yaml")).unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::fixtures::write_resources(
        dir.path(),
        "store.yaml",
        &[object(
            "CheckpointStore",
            "orders",
            merged(
                store_spec("sqlite", &format!("sqlite://{}", db.display())),
                serde_json::json!({"mode": "act"}),
            ),
        )],
    );
    let out = support::custody(&[
        "sweep",
        "--apply",
        "-f",
        dir.path().to_str().unwrap(),
        "-o",
        "json",
    ]);
    let report = support::sweep_report(&out);
    assert!(!report.to_string().contains("no verdictPath"), "{report}");
    let acted: Vec<(String, String)> = report["stores"][0]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["verdict"] == "gone" || r["verdict"] == "absent")
        .map(|r| {
            (
                r["thread_id"].as_str().unwrap().to_owned(),
                r["action"]["outcome"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect();
    assert!(!acted.is_empty(), "{report}");
    for (thread, outcome) in &acted {
        assert_eq!(outcome, "escalated", "{thread}: {report}");
    }
}
