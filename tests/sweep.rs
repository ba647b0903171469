//! `custody sweep` end to end: real LangGraph checkpoints (SQLite and PostgreSQL), a real MCP
//! server in both protocol eras, the real binary.

mod support;

use std::collections::BTreeMap;

use serde_json::{Value, json};
use support::{BasketServer, Db};

/// The verdicts every fixture thread must get (t-done is finished, so it is not reported).
fn expected(manifest: &Value) -> BTreeMap<String, String> {
    manifest["threads"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, t)| t["parked"] == Value::Bool(true))
        .map(|(id, t)| (id.clone(), t["expected"].as_str().unwrap().to_owned()))
        .collect()
}

fn assert_verdicts(report: &Value, manifest: &Value) {
    let got = support::verdicts(report);
    let want = expected(manifest);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "parked threads"
    );
    for (thread, verdict) in &want {
        assert_eq!(&got[thread].0, verdict, "{thread}: {:?}", got[thread]);
    }
    assert_eq!(
        got["t-other-principal"].1,
        "minted for principal user-1, thread now runs as user-2"
    );
    assert!(
        got["t-expired"].1.contains("BASKET_EXPIRED"),
        "{:?}",
        got["t-expired"]
    );
    // t-updated was edited by update_state: the verdict is about its new handle, not the old one.
    let updated = &report["stores"][0]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["thread_id"] == "t-updated")
        .unwrap();
    assert_eq!(
        updated["handle"],
        manifest["threads"]["t-updated"]["handle"]
    );
    assert_eq!(updated["parked_by"], "edited");
    // Probed: t-live, t-expired, t-updated, and t-ttl as the sample of handles within their
    // declared lifetime (spec.probesWithinTtl, default 10). Not probed: principal mismatch,
    // absent.
    assert_eq!(report["stores"][0]["summary"]["probes"], 4);
}

fn protocol(report: &Value) -> String {
    report["stores"][0]["servers"][0]["protocol_version"]
        .as_str()
        .unwrap_or("-")
        .to_owned()
}

#[test]
fn sqlite_checkpoints_in_both_protocol_eras() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    let manifest = support::write_fixtures(&server.url(), Db::Sqlite(&db));
    let dsn = format!("sqlite://{}", db.display());

    for (mode, era) in [("auto", "2026-07-28"), ("legacy", "2025-11-25")] {
        let res = tempfile::tempdir().unwrap();
        support::basket_resources(res.path(), &server.url(), mode, "sqlite", &dsn);
        let report = support::sweep_json(res.path());
        assert_eq!(protocol(&report), era, "mode {mode}");
        assert_verdicts(&report, &manifest);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_checkpoints_in_both_protocol_eras() {
    let server = BasketServer::start(&[("BASKET_JSON_RESPONSE", "1")]);
    let dsn = support::fresh_pg_database("sweep_eras").await;
    let manifest = support::write_fixtures(&server.url(), Db::Postgres(&dsn));

    for (mode, era) in [("auto", "2026-07-28"), ("legacy", "2025-11-25")] {
        let res = tempfile::tempdir().unwrap();
        support::basket_resources(res.path(), &server.url(), mode, "postgres", &dsn);
        let report = support::sweep_json(res.path());
        assert_eq!(protocol(&report), era, "mode {mode}");
        assert_verdicts(&report, &manifest);
    }
}

/// A CheckpointStore whose DSN is libpq's keyword/value form (as LangGraph's PostgresSaver
/// takes it) sweeps the same real checkpoints to the same verdicts as its URL.
#[tokio::test(flavor = "multi_thread")]
async fn a_keyword_value_dsn_sweeps_as_its_url() {
    let server = BasketServer::start(&[]);
    let url = support::fresh_pg_database("sweep_keyword_value").await;
    let manifest = support::write_fixtures(&server.url(), Db::Postgres(&url));
    let mut verdicts = Vec::new();
    for dsn in [url.clone(), support::keyword_value_dsn(&url)] {
        let res = tempfile::tempdir().unwrap();
        support::basket_resources(res.path(), &server.url(), "auto", "postgres", &dsn);
        let report = support::sweep_json(res.path());
        assert_verdicts(&report, &manifest);
        verdicts.push(support::verdicts(&report));
    }
    assert_eq!(verdicts[0], verdicts[1]);
}

/// A probe that could not be completed is `unknown`, never `gone`: stop the server after the
/// checkpoints are written and sweep again.
#[test]
fn server_down_is_unknown_never_gone() {
    let mut server = BasketServer::start(&[]);
    let (dir, manifest) = support::sqlite_basket_dir(&server.url());
    server.stop();

    let out = support::custody(&[
        "sweep",
        "--dry-run",
        "-f",
        dir.path().to_str().unwrap(),
        "-o",
        "json",
    ]);
    // Not logged besides: the report's warning is the one place that says it whole.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("connection refused"), "{stderr}");
    let report = support::sweep_report(&out);
    let got = support::verdicts(&report);
    // Each row says it in brief; the cause with its address is said once, in the warnings.
    for probed in ["t-live", "t-expired", "t-updated"] {
        assert_eq!(got[probed].0, "unknown", "{probed}: {:?}", got[probed]);
        assert_eq!(
            got[probed].1, "probe failed: server basket refused the connection",
            "{probed}"
        );
    }
    let warnings = report["stores"][0]["warnings"].as_array().unwrap();
    let said: Vec<&str> = warnings
        .iter()
        .filter_map(|w| w.as_str())
        .filter(|w| w.contains("connection refused to 127.0.0.1:"))
        .collect();
    assert_eq!(said.len(), 1, "{warnings:?}");
    assert!(
        said[0].starts_with("server basket: connection refused to 127.0.0.1:")
            && said[0].ends_with(
                "; every probe and call to it this sweep failed (its handles are unknown)"
            ),
        "{said:?}"
    );
    // What needs no round trip is still decided (README, "Running it on your own checkpoints").
    assert_eq!(got["t-other-principal"].0, "gone");
    assert_eq!(got["t-ttl"].0, "ok");
    assert!(
        got["t-ttl"].1.starts_with("within its declared lifetime (")
            && got["t-ttl"]
                .1
                .contains("); a sample probe did not decide ("),
        "{:?}",
        got["t-ttl"]
    );
    assert_eq!(got["t-absent"].0, "absent");
    assert_eq!(expected(&manifest).len(), got.len());
    assert!(report["stores"][0]["servers"][0]["error"].is_string());
}

/// The store's warnings that name a HandleClass.
fn class_warnings(report: &Value) -> Vec<String> {
    report["stores"][0]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w.as_str())
        .filter(|w| w.starts_with("HandleClass "))
        .map(str::to_owned)
        .collect()
}

/// Issue 15 (fresh review, item 3): a server a sweep cannot use is one warning, `server NAME:
/// <its cause, with the endpoint>; …`, and each row that needed it a brief and true cause. A
/// server that refused custody's credentials was reached (not "unreachable", not "connect
/// failed"), one that accepted the connection and never answered did not time out connecting,
/// a reply that is not JSON-RPC is not rmcp's text quoting the body, a 404 carries no JSON-RPC
/// code the server never sent. `discover` of the same servers says each cause once in the
/// server's block, without the server's name again.
#[test]
fn each_unusable_server_is_said_once_with_its_own_cause() {
    use support::Peer;
    let basket = BasketServer::start(&[]);
    let locked = BasketServer::start(&[("BASKET_REQUIRE_BEARER", "s3cret")]);
    let not_json_rpc = Peer::misbehaving("not_json_rpc");
    let answering = Peer::misbehaving("ok");
    let hang = Peer::misbehaving("hang");
    let closed = support::free_port();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_some_fixtures(&basket.url(), Db::Sqlite(&db), Some("t-live"), "");
    support::basket_resources(
        dir.path(),
        &basket.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let at = |port: u16| format!("127.0.0.1:{port}");
    // (server, URL, what a row says after `server NAME `, the cause the warning says)
    let cases: [(&str, String, &str, String); 7] = [
        (
            "locked",
            locked.url(),
            "refused custody's credentials (HTTP 401)",
            format!(
                "{} refused custody's credentials: HTTP 401 Unauthorized with a WWW-Authenticate \
                 challenge (check spec.headers and spec.headersFrom)",
                at(locked.port)
            ),
        ),
        (
            "not-found",
            format!("http://127.0.0.1:{}/not-mcp", answering.port),
            "answered HTTP 404 Not Found",
            format!(
                "{} answered HTTP 404 Not Found (reply body not shown; check that spec.url is the \
                 MCP endpoint)",
                at(answering.port)
            ),
        ),
        (
            "not-json-rpc",
            not_json_rpc.url(),
            "answered with a reply that is not JSON-RPC",
            format!(
                "{} answered with JSON that is not a JSON-RPC message (reply body not shown)",
                at(not_json_rpc.port)
            ),
        ),
        (
            "hang",
            hang.url(),
            "did not answer within 5s",
            format!(
                "{} accepted the connection but did not answer within 5s",
                at(hang.port)
            ),
        ),
        (
            "plain",
            format!("https://127.0.0.1:{}/mcp", basket.port),
            "failed the TLS handshake",
            format!(
                "TLS handshake with {} failed: the server did not answer as a TLS server (an \
                 https URL to a plain HTTP server?)",
                at(basket.port)
            ),
        ),
        (
            "closed",
            format!("http://127.0.0.1:{closed}/mcp"),
            "refused the connection",
            format!(
                "connection refused to {} (nothing listens there)",
                at(closed)
            ),
        ),
        (
            "metadata",
            "http://169.254.169.254/mcp".to_owned(),
            "cannot be used: url refused",
            "url refused: 169.254.169.254 is link-local (169.254.0.0/16, where clouds serve \
             instance metadata) (--deny-metadata-addresses)"
                .to_owned(),
        ),
    ];
    for (name, url, ..) in &cases {
        support::basket_class_on(dir.path(), name, url);
    }

    let report = support::sweep_json(dir.path());
    let rows = report["stores"][0]["rows"].as_array().unwrap();
    let warnings: Vec<&str> = report["stores"][0]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|w| w.as_str())
        .collect();
    for (name, _, brief, cause) in &cases {
        let row = rows
            .iter()
            .find(|r| r["thread_id"] == "t-live" && r["handle_class"] == *name)
            .unwrap_or_else(|| panic!("no row of {name}"));
        assert_eq!(row["verdict"], "unknown", "{name}");
        assert_eq!(
            row["reason"],
            format!("probe failed: server {name} {brief}"),
            "{name}"
        );
        let said: Vec<&&str> = warnings
            .iter()
            .filter(|w| w.contains(&format!("server {name}")))
            .collect();
        assert_eq!(
            said,
            [&format!(
                "server {name}: {cause}; every probe and call to it this sweep failed (its \
                 handles are unknown)"
            )
            .as_str()],
            "{name}"
        );
    }
    let text = report.to_string();
    for wrong in [
        "unreachable",
        "connect failed",
        "could not be reached",
        "ServerJsonRpcMessage",
        "hello",
        "InvalidContentType",
        "-32600",
        "Not Found</",
    ] {
        assert!(!text.contains(wrong), "{wrong:?} in {text}");
    }

    let out = support::custody(&["discover", "-f", dir.path().to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for (name, url, _, cause) in &cases {
        let block = format!(
            "server {name} ({url})\n  discovery failed: {cause}\n  health: unhealthy (as \
             discovery failed, "
        );
        assert!(
            stdout.contains(&block),
            "{name}: wants\n{block}\nin:\n{stdout}"
        );
    }
}

/// A probe tool the server does not list (a typo in `spec.probe.tool`) answers `isError`
/// "Unknown tool" for every handle, and arguments the tool cannot take a validation error; with
/// no `goneWhen` narrowing that text would read as gone and live threads would be acted on. The
/// sweep checks `tools/list` and the tool's `inputSchema` first: `unknown`.
#[test]
fn a_probe_tool_the_server_does_not_offer_is_unknown_never_gone() {
    use support::fixtures::{basket_class, merged, object, write_resources};
    let server = BasketServer::start(&[]);
    let (dir, _) = support::sqlite_basket_dir(&server.url());
    let typo = merged(basket_class(), json!({"probe": {"tool": "get_baskett"}}));
    write_resources(
        dir.path(),
        "class.yaml",
        &[object("HandleClass", "basket", typo)],
    );

    let report = support::sweep_json(dir.path());
    let got = support::verdicts(&report);
    for probed in ["t-live", "t-expired", "t-updated"] {
        assert_eq!(got[probed].0, "unknown", "{probed}: {:?}", got[probed]);
        assert_eq!(
            got[probed].1, "probe failed: server basket does not list tool get_baskett",
            "{probed}"
        );
    }
    // Issue 15 (fresh review, item 4): the class's problem is one warning naming the class and
    // the field, not only each row's.
    assert_eq!(
        class_warnings(&report),
        [
            "HandleClass default/basket: spec.probe.tool: server basket does not list tool \
          get_baskett in tools/list; its probes were not sent, so their handles are unknown"
        ]
    );

    // Arguments the tool cannot take (a misnamed key, a number for a string): the server's
    // validation error would read as gone just the same; custody checks the tool's inputSchema.
    for (arguments, why) in [
        (
            json!({"id": "{{handle}}"}),
            "missing required property basket_id; id is not a property the tool declares (it \
             declares basket_id)",
        ),
        (
            json!({"basket_id": 5}),
            "property basket_id is not of type string",
        ),
    ] {
        let mut misnamed = basket_class();
        misnamed["probe"]["arguments"] = arguments.clone();
        let misnamed = object("HandleClass", "basket", misnamed);
        write_resources(dir.path(), "class.yaml", &[misnamed]);
        let report = support::sweep_json(dir.path());
        let got = support::verdicts(&report);
        for probed in ["t-live", "t-expired", "t-updated"] {
            assert_eq!(
                got[probed].0, "unknown",
                "{arguments} {probed}: {:?}",
                got[probed]
            );
            assert_eq!(
                got[probed].1,
                "probe failed: spec.probe.arguments do not match tool get_basket's inputSchema",
                "{arguments} {probed}"
            );
        }
        assert_eq!(
            class_warnings(&report),
            [format!(
                "HandleClass default/basket: spec.probe.arguments do not match the inputSchema \
                 of tool get_basket of server basket: {why}; its probes were not sent, so their \
                 handles are unknown"
            )],
            "{arguments}"
        );
    }

    // A probe tool that declares itself destructive is never called, not even by a plan-only
    // sweep: were delete_basket called, the live basket would be gone in the sweep below.
    let destructive = merged(basket_class(), json!({"probe": {"tool": "delete_basket"}}));
    write_resources(
        dir.path(),
        "class.yaml",
        &[object("HandleClass", "basket", destructive)],
    );
    let report = support::sweep_json(dir.path());
    assert!(
        class_warnings(&report)[0].starts_with(
            "HandleClass default/basket: spec.probe.tool: tool delete_basket of server basket \
             declares destructiveHint; custody never calls a destructive tool as a probe"
        ),
        "{report}"
    );
    let got = support::verdicts(&report);
    for probed in ["t-live", "t-expired", "t-updated"] {
        assert_eq!(got[probed].0, "unknown", "{probed}: {:?}", got[probed]);
        assert_eq!(
            got[probed].1,
            "probe failed: tool delete_basket declares destructiveHint; never called as a probe",
            "{probed}"
        );
    }

    // The same class with the tool spelt right and still no goneWhen: the live basket is ok.
    write_resources(
        dir.path(),
        "class.yaml",
        &[object("HandleClass", "basket", basket_class())],
    );
    let got = support::verdicts(&support::sweep_json(dir.path()));
    assert_eq!(got["t-live"].0, "ok", "{:?}", got["t-live"]);
    assert_eq!(got["t-expired"].0, "gone", "{:?}", got["t-expired"]);
}

/// One handle held by many threads is probed once.
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_handle_is_probed_once() {
    use sqlx::Connection;
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_fixtures(&server.url(), Db::Sqlite(&db));
    // Fork t-live three times, as a graph copying a thread would: same state, same handle.
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    for copy in ["t-live-a", "t-live-b", "t-live-c"] {
        for table in ["checkpoints", "writes"] {
            let columns: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT name FROM pragma_table_info('{table}')"
            )))
            .fetch_all(&mut conn)
            .await
            .unwrap();
            let select = columns
                .iter()
                .map(|c| {
                    if c == "thread_id" {
                        "?".to_owned()
                    } else {
                        c.clone()
                    }
                })
                .collect::<Vec<_>>();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} ({}) SELECT {} FROM {table} WHERE thread_id = 't-live'",
                columns.join(", "),
                select.join(", ")
            )))
            .bind(copy)
            .execute(&mut conn)
            .await
            .unwrap();
        }
    }
    conn.close().await.unwrap();
    support::basket_resources(
        dir.path(),
        &server.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let report = support::sweep_json(dir.path());
    let got = support::verdicts(&report);
    for t in ["t-live", "t-live-a", "t-live-b", "t-live-c"] {
        assert_eq!(got[t].0, "ok", "{t}");
    }
    assert_eq!(
        report["stores"][0]["summary"]["probes"], 4,
        "four holders of one handle, one probe (and t-expired, t-updated, t-ttl's sample)"
    );
}

#[test]
fn human_table_has_every_column_and_a_summary() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_fixtures(&server.url(), Db::Sqlite(&db));
    support::basket_resources(
        dir.path(),
        &server.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let out = support::custody(&["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("THREAD") && text.contains("VERDICT") && text.contains("REASON"),
        "{text}"
    );
    assert!(
        text.contains("6 parked threads, 6 handles: 3 ok, 2 gone, 1 absent, 0 unknown; 4 probes"),
        "{text}"
    );
}

/// A sweep without rows (parked threads, none holding the class's `statePath`) prints the
/// table's header once: a batch without rows used to write it, and the store's end again.
#[test]
fn an_empty_sweep_prints_the_header_once() {
    use support::fixtures::{basket_class, merged, object, write_resources};
    let server = BasketServer::start(&[]);
    let (dir, _) = support::sqlite_basket_dir(&server.url());
    write_resources(
        dir.path(),
        "class.yaml",
        &[object(
            "HandleClass",
            "basket",
            merged(basket_class(), json!({"statePath": "nowhere"})),
        )],
    );
    let out = support::custody(&["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.starts_with("THREAD")).count(),
        1,
        "{text}"
    );
    assert!(text.contains(" 0 handles: "), "{text}");
    // A sweep's warning is said once, in the report, not in a log line as well.
    let warning = "no parked thread holds statePath \"nowhere\" of HandleClass basket";
    assert_eq!(text.matches(warning).count(), 1, "{text}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!stderr.contains(warning), "{stderr}");
}

/// Both readers agree on the same graph runs: the PostgreSQL reader takes most of what it needs
/// from projected columns (the document only for edited or oddly shaped checkpoints), the
/// SQLite reader decodes every document. Same threads, same parked reason, same channels with
/// the same values (handles and timestamps differ between the two runs, so they are masked),
/// inline primitives (`customer`, `mint`) and blobs (`basket`, `items`) alike.
#[tokio::test(flavor = "multi_thread")]
async fn both_readers_agree_on_the_same_threads() {
    use custody::checkpoint::{Channel, Scanned, Store};
    use custody::crd::Backend;
    use futures::TryStreamExt;

    fn mask(v: &Value) -> Value {
        match v {
            Value::String(s) if s.starts_with("bsk_") => "bsk_*".into(),
            Value::String(s) if s.len() >= 19 && s.as_bytes()[10] == b'T' => "<time>".into(),
            Value::Array(a) => a.iter().map(mask).collect(),
            Value::Object(o) => o.iter().map(|(k, v)| (k.clone(), mask(v))).collect(),
            other => other.clone(),
        }
    }
    async fn scan(backend: Backend, dsn: &str) -> BTreeMap<String, Value> {
        let channels: Vec<String> = ["basket", "customer", "items", "mint", "verdict", "nope"]
            .map(str::to_owned)
            .into();
        let store = Store::connect(backend, dsn).await.unwrap();
        let mut out = BTreeMap::new();
        let mut scan = store.parked_threads(&channels);
        while let Some(item) = scan.try_next().await.unwrap() {
            let Scanned::Parked(t) = item else {
                panic!("{backend:?}: skipped {item:?}");
            };
            let channels: BTreeMap<&String, Value> = t
                .channels
                .iter()
                .map(|(name, c)| {
                    let shown = match c {
                        Channel::Value(v) => mask(v),
                        Channel::Empty => "<empty>".into(),
                        Channel::Undecodable(e) => panic!("{name}: {e}"),
                    };
                    (name, shown)
                })
                .collect();
            assert!(t.checkpoint_ts.is_some(), "{backend:?} {}", t.thread_id);
            out.insert(
                t.thread_id.clone(),
                serde_json::json!({
                    "parked_by": t.parked_by,
                    "principal": t.metadata.get("principal"),
                    "channels": channels,
                }),
            );
        }
        out
    }

    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_fixtures(&server.url(), Db::Sqlite(&db));
    let dsn = support::fresh_pg_database("sweep_readers_agree").await;
    support::write_fixtures(&server.url(), Db::Postgres(&dsn));

    let sqlite = scan(Backend::Sqlite, &format!("sqlite://{}", db.display())).await;
    let postgres = scan(Backend::Postgres, &dsn).await;
    assert_eq!(postgres, sqlite);
    assert_eq!(sqlite["t-updated"]["parked_by"], "edited", "{sqlite:#?}");
    assert_eq!(sqlite["t-live"]["channels"]["mint"], true, "{sqlite:#?}");
    assert!(sqlite["t-live"]["channels"]["basket"].is_object());
}

/// Every scanned thread of a PostgreSQL store, as text (everything the sweep reads of it), and
/// the plan the store detected.
async fn pg_scan(
    dsn: &str,
    shard: custody::checkpoint::Shard,
) -> (Option<custody::checkpoint::ScanPlan>, Vec<String>) {
    use custody::checkpoint::{Backend, Store};
    use futures::TryStreamExt;
    let channels: Vec<String> = ["basket", "customer", "items", "mint", "verdict", "nope"]
        .map(str::to_owned)
        .into();
    let store = Store::connect(Backend::Postgres, dsn).await.unwrap();
    let rows = store
        .parked_threads_in(&channels, shard)
        .map_ok(|t| format!("{t:?}"))
        .try_collect()
        .await
        .unwrap();
    (store.scan_plan(), rows)
}

async fn pg_exec(dsn: &str, statements: &[&str]) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(dsn).await.unwrap();
    for s in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(*s))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{s}: {e}"));
    }
}

/// LangGraph-written threads of every shape the parked rule tells apart: parked on an
/// interrupt, resumed and parked again, finished after interrupts (t-done), parked by an
/// `update_state` edit (t-updated), and two threads that were interrupted (r-t-live) or edited
/// (r-t-updated) and then resumed to the end, whose old `__interrupt__` writes and `update`
/// checkpoints the optional indexes still hold.
async fn parked_index_fixtures(name: &str) -> (BasketServer, String) {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database(name).await;
    support::write_fixtures(&server.url(), Db::Postgres(&dsn));
    support::write_some_fixtures(
        &server.url(),
        Db::Postgres(&dsn),
        Some("t-live,t-updated"),
        "r-",
    );
    for thread in ["r-t-live", "r-t-updated"] {
        let state = support::order_graph(
            Db::Postgres(&dsn),
            &[
                "resume",
                "--thread",
                thread,
                "--server",
                &server.url(),
                "--principal",
                "user-1",
                "--value",
                "\"done\"",
            ],
        );
        assert_eq!(state["next"], serde_json::json!([]), "{thread}: {state}");
    }
    (server, dsn)
}

/// The scan through the optional partial indexes (README, "A sweep that reads only what is
/// parked") returns exactly what the plain scan returns, for the whole store and per shard: the
/// old interrupt of a resumed thread and the old edit of a finished one do not make them parked.
#[tokio::test(flavor = "multi_thread")]
async fn the_parked_indexes_change_no_row() {
    use custody::checkpoint::{PARKED_INDEXES, ScanPlan, Shard};
    let (_server, dsn) = parked_index_fixtures("sweep_parked_indexes").await;
    let shards = [Shard::ALL, "0/2".parse().unwrap(), "1/2".parse().unwrap()];
    let mut plain = Vec::new();
    for shard in shards {
        let (plan, rows) = pg_scan(&dsn, shard).await;
        assert_eq!(plan, Some(ScanPlan::Full));
        plain.push(rows);
    }
    let all = plain[0].join("\n");
    for thread in ["\"t-live\"", "\"t-updated\"", "\"t-other-principal\""] {
        assert!(all.contains(thread), "{thread} not parked:\n{all}");
    }
    for thread in ["\"t-done\"", "\"r-t-live\"", "\"r-t-updated\""] {
        assert!(!all.contains(thread), "{thread} parked:\n{all}");
    }
    assert_eq!(plain[1].len() + plain[2].len(), plain[0].len());

    pg_exec(&dsn, &PARKED_INDEXES.map(|(_, _, create)| create)).await;
    for (shard, plain) in shards.into_iter().zip(plain) {
        let (plan, rows) = pg_scan(&dsn, shard).await;
        assert_eq!(plan, Some(ScanPlan::Indexed));
        assert_eq!(rows, plain, "shard {shard:?}");
    }
}

/// custody uses the indexed statement only when both indexes are there, valid and on their
/// tables, and falls back to the plain scan otherwise; the planner answers the indexed
/// statement from the two indexes (scans of the whole tables disabled, as the fixture tables
/// are too small for the planner to prefer an index on its own; at 1M threads it does:
/// BENCHMARKS.md, run 4), while the plain statement never touches them.
#[tokio::test(flavor = "multi_thread")]
async fn the_parked_indexes_are_detected_and_used() {
    use custody::checkpoint::{PARKED_INDEXES, ScanPlan, Shard, postgres_scan_statement};
    use sqlx::Connection;
    let (_server, dsn) = parked_index_fixtures("sweep_parked_detect").await;
    let plan = async || pg_scan(&dsn, Shard::ALL).await.0.unwrap();
    let [
        (interrupts, _, create_interrupts),
        (updates, _, create_updates),
    ] = PARKED_INDEXES;

    assert_eq!(plan().await, ScanPlan::Full, "no index");
    pg_exec(&dsn, &[create_interrupts]).await;
    assert_eq!(plan().await, ScanPlan::Full, "only {interrupts}");
    // The right name on the wrong table.
    pg_exec(
        &dsn,
        &[format!("CREATE INDEX {updates} ON checkpoint_blobs (thread_id)").as_str()],
    )
    .await;
    assert_eq!(
        plan().await,
        ScanPlan::Full,
        "{updates} on checkpoint_blobs"
    );
    // A failed CREATE INDEX CONCURRENTLY leaves an invalid index behind.
    pg_exec(&dsn, &[format!("DROP INDEX {updates}").as_str()]).await;
    let mut conn = sqlx::PgConnection::connect(&dsn).await.unwrap();
    let failed = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE UNIQUE INDEX CONCURRENTLY {updates} ON checkpoints (checkpoint_ns)"
    )))
    .execute(&mut conn)
    .await;
    assert!(failed.is_err(), "duplicate keys must fail the unique index");
    assert_eq!(plan().await, ScanPlan::Full, "{updates} invalid");
    pg_exec(
        &dsn,
        &[format!("DROP INDEX {updates}").as_str(), create_updates],
    )
    .await;
    assert_eq!(plan().await, ScanPlan::Indexed, "both indexes");

    sqlx::raw_sql("SET enable_seqscan = off; SET enable_bitmapscan = off")
        .execute(&mut conn)
        .await
        .unwrap();
    for (statement_plan, uses) in [(ScanPlan::Indexed, true), (ScanPlan::Full, false)] {
        let explain = format!(
            "EXPLAIN (FORMAT JSON) {}",
            postgres_scan_statement(1, statement_plan)
        );
        let shown: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(explain))
            .bind(vec!["basket".to_owned()])
            .bind(1i32)
            .bind(0i64)
            .bind(1i32 << 24)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        let shown = shown.to_string();
        for index in [interrupts, updates] {
            assert_eq!(
                shown.contains(&format!("\"Index Name\":\"{index}\"")),
                uses,
                "{statement_plan:?} statement and {index}: {shown}"
            );
        }
    }
}

/// Issue 17, item 13: a probe result off its tool's outputSchema is still read (the verdict is
/// the same) and the sweep reports the deviation once per server and tool: a line of the table
/// output and `servers[].conformance` in JSON. The server as the SDK ships it gets none.
#[test]
fn a_probe_result_off_its_output_schema_is_reported_and_still_read() {
    for off in ["1", "0"] {
        let server = BasketServer::start(&[("BASKET_OFF_SCHEMA", off)]);
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("checkpoints.sqlite");
        support::write_some_fixtures(&server.url(), Db::Sqlite(&db), Some("t-live"), "");
        let dsn = format!("sqlite://{}", db.display());
        let res = tempfile::tempdir().unwrap();
        support::basket_resources(res.path(), &server.url(), "auto", "sqlite", &dsn);

        let report = support::sweep_json(res.path());
        assert_eq!(support::verdicts(&report)["t-live"].0, "ok", "off={off}");
        let conformance = &report["stores"][0]["servers"][0]["conformance"];
        let table = support::custody(&["sweep", "--dry-run", "-f", res.path().to_str().unwrap()]);
        let stdout = String::from_utf8_lossy(&table.stdout);
        assert!(table.status.success(), "{stdout}");
        if off == "0" {
            assert_eq!(conformance, &serde_json::json!([]));
            assert!(!stdout.contains("conformance warning"), "{stdout}");
            continue;
        }
        assert_eq!(conformance[0]["kind"], "output_schema", "{conformance}");
        assert_eq!(conformance.as_array().unwrap().len(), 1, "{conformance}");
        assert!(
            stdout.contains(
                "conformance warning: server basket (output_schema): tools/call get_basket: \
                 structuredContent does not match the declared outputSchema: at /item_count: \
                 fails `type`"
            ),
            "{stdout}"
        );
    }
}
