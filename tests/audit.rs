//! Settling pending audit records end to end (issue 6): the real ticket MCP server
//! (tests/py/ticket_server.py, Python `mcp` SDK) with idempotency keys, real LangGraph threads in
//! SQLite and PostgreSQL, the real `custody sweep --apply` binary. The test plays the agent: it
//! writes a pending record, calls create_ticket with a short timeout, and leaves the record
//! pending as a crashed or timed-out agent would.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use custody::domain::audit::idempotency_key;
use serde_json::{Value, json};
use support::checkpoints::{Checkpoints, Kind};
use support::{BasketServer, Db, TicketServer};

/// The agent's call of a ticket tool, with its 1 s timeout: the answer or the error text.
async fn agent_call(tickets: &TicketServer, tool: &str, arguments: Value) -> Result<Value, String> {
    support::try_call(&tickets.url(), tool, arguments, Duration::from_secs(1)).await
}

/// A checkpoint database with LangGraph threads, and local-mode resources acting on it.
struct World {
    basket: BasketServer,
    res: tempfile::TempDir,
    checkpoints: Checkpoints,
}

impl World {
    /// Writes the `t-live` thread (parked at an interrupt) and the resources: MCPServer
    /// `tickets` at `tickets_url` with its timeout, `tickets-down` at a port nobody listens on,
    /// both with the create_ticket rule, and a CheckpointStore in `mode: act` with a 60 s grace
    /// period, a one-hour maximum age and verdicts at `custody`.
    async fn new(kind: Kind, name: &str, tickets_url: &str, timeout_s: u32) -> Self {
        let basket = BasketServer::start(&[]);
        let res = tempfile::tempdir().unwrap();
        let checkpoints = Checkpoints::new(kind, res.path(), name).await;
        let world = Self {
            basket,
            res,
            checkpoints,
        };
        support::write_some_fixtures(&world.basket.url(), world.db(), Some("t-live"), "");
        let rule = r#"  reconciliation:
  - tool: create_ticket
    lookup:
      tool: find_ticket
      arguments: {idempotency_key: "{{idempotency_key}}"}
      found: {path: ticket, notFoundErrorPrefixes: [TICKET_NOT_FOUND]}
      idField: ticket.id
"#;
        let down = format!("http://127.0.0.1:{}/mcp", support::free_port());
        support::write_file(
            world.res.path(),
            "servers.yaml",
            &format!(
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: tickets}}\n\
                 spec:\n  url: \"{tickets_url}\"\n  timeoutSeconds: {timeout_s}\n{rule}---\n\
                 apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: tickets-down}}\n\
                 spec:\n  url: \"{down}\"\n  timeoutSeconds: 2\n{rule}"
            ),
        );
        let (backend, dsn) = world.dsn();
        support::write_file(
            world.res.path(),
            "store.yaml",
            &format!(
                "apiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {{name: orders}}\n\
                 spec:\n  backend: {backend}\n  dsn: \"{dsn}\"\n  mode: act\n\
                 \x20 audit: {{graceSeconds: 60, maxAgeSeconds: 3600, verdictPath: custody}}\n"
            ),
        );
        // The first acting sweep creates custody's tables, custody_audit among them.
        world.sweep();
        world
    }

    fn dsn(&self) -> (&'static str, String) {
        self.checkpoints.backend_dsn()
    }

    fn db(&self) -> Db<'_> {
        self.checkpoints.db()
    }

    fn sweep_command(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_custody"));
        cmd.args(["sweep", "--apply", "-o", "json", "-f"])
            .arg(self.res.path());
        cmd
    }

    /// `custody sweep --apply -o json`: the first store's report and stderr.
    fn sweep(&self) -> (Value, String) {
        parse(self.sweep_command().output().expect("run custody"))
    }

    /// Writes an audit record as the agent does, `age_s` seconds old.
    async fn insert(&self, thread: &str, call: &str, server: &str, status: &str, age_s: i64) {
        let key = idempotency_key(thread, call);
        let summary = json!({"title": "printer on fire", "api_token": "[redacted]"}).to_string();
        match self.checkpoints.kind {
            Kind::Postgres => {
                let pool = sqlx::PgPool::connect(&self.checkpoints.pg).await.unwrap();
                sqlx::query(
                    "INSERT INTO custody_audit (thread_id, tool_call_id, idempotency_key, server, tool,
                        argument_summary, principal, status, created_at, updated_at)
                     VALUES ($1, $2, $3, $4, 'create_ticket', $5::jsonb, 'user-1', $6,
                        now() - make_interval(secs => $7), now() - make_interval(secs => $7))",
                )
                .bind(thread)
                .bind(call)
                .bind(&key)
                .bind(server)
                .bind(&summary)
                .bind(status)
                .bind(age_s as f64)
                .execute(&pool)
                .await
                .unwrap();
                pool.close().await;
            }
            Kind::Sqlite => {
                let pool = sqlx::SqlitePool::connect(&format!(
                    "sqlite://{}",
                    self.checkpoints.sqlite.display()
                ))
                .await
                .unwrap();
                let ago = format!("-{age_s} seconds");
                sqlx::query(
                    "INSERT INTO custody_audit (thread_id, tool_call_id, idempotency_key, server, tool,
                        argument_summary, principal, status, created_at, updated_at)
                     VALUES (?1, ?2, ?3, ?4, 'create_ticket', ?5, 'user-1', ?6,
                        strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?7), strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?7))",
                )
                .bind(thread)
                .bind(call)
                .bind(&key)
                .bind(server)
                .bind(&summary)
                .bind(status)
                .bind(ago)
                .execute(&pool)
                .await
                .unwrap();
                pool.close().await;
            }
        }
    }

    /// tool_call_id → (status, resolution) of every audit record.
    async fn records(&self) -> std::collections::BTreeMap<String, (String, Value)> {
        let sql = "SELECT tool_call_id, status, CAST(resolution AS TEXT) AS resolution FROM custody_audit";
        let rows: Vec<(String, String, Option<String>)> = match self.checkpoints.kind {
            Kind::Postgres => {
                let pool = sqlx::PgPool::connect(&self.checkpoints.pg).await.unwrap();
                let rows = sqlx::query_as(sql).fetch_all(&pool).await.unwrap();
                pool.close().await;
                rows
            }
            Kind::Sqlite => {
                let pool = sqlx::SqlitePool::connect(&format!(
                    "sqlite://{}",
                    self.checkpoints.sqlite.display()
                ))
                .await
                .unwrap();
                let rows = sqlx::query_as(sql).fetch_all(&pool).await.unwrap();
                pool.close().await;
                rows
            }
        };
        rows.into_iter()
            .map(|(call, status, resolution)| {
                let resolution = resolution
                    .map(|r| serde_json::from_str(&r).unwrap())
                    .unwrap_or(Value::Null);
                (call, (status, resolution))
            })
            .collect()
    }
}

fn parse(out: Output) -> (Value, String) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "custody sweep --apply failed:\nstdout:\n{}\nstderr:\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("sweep JSON");
    (doc["stores"][0].clone(), stderr)
}

/// tool_call_id → audit entry of one report.
fn handled(report: &Value) -> std::collections::BTreeMap<String, Value> {
    report["audit"]["records"]
        .as_array()
        .expect("audit records in the report")
        .iter()
        .map(|r| (r["tool_call_id"].as_str().unwrap().to_owned(), r.clone()))
        .collect()
}

/// A write that landed, one that did not, a record for a server that is down, one past the
/// maximum age, one the agent completed, one within the grace period.
async fn outcomes_case(kind: Kind) {
    let tickets = TicketServer::start(&[("TICKET_HANG_SECONDS", "5")]);
    let w = World::new(kind, "audit_outcomes", &tickets.url(), 5).await;
    // The agent's calls: both time out on its side (1 s), one after committing.
    for (call, simulate) in [
        ("call-landed", "hang_after_commit"),
        ("call-lost", "hang_before_commit"),
    ] {
        let key = idempotency_key("t-live", call);
        w.insert("t-live", call, "tickets", "pending", 300).await;
        let answer = agent_call(
            &tickets,
            "create_ticket",
            json!({"idempotency_key": key, "title": "printer on fire", "simulate": simulate}),
        )
        .await;
        assert!(
            answer.is_err(),
            "{call}: the agent's call must time out: {answer:?}"
        );
    }
    w.insert("t-live", "call-down", "tickets-down", "pending", 300)
        .await;
    w.insert("t-live", "call-old", "tickets-down", "pending", 7200)
        .await;
    w.insert("t-live", "call-done", "tickets", "committed", 300)
        .await;
    w.insert("t-live", "call-fresh", "tickets", "pending", 5)
        .await;

    let (report, stderr) = w.sweep();
    let got = handled(&report);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        ["call-down", "call-landed", "call-lost", "call-old"],
        "completed and fresh records are left alone: {report:#}"
    );
    assert_eq!(got["call-landed"]["outcome"], "committed");
    assert_eq!(got["call-landed"]["server_id"], "TCK-000001");
    assert_eq!(
        got["call-lost"]["outcome"], "not_committed",
        "{:#}",
        got["call-lost"]
    );
    assert_eq!(got["call-down"]["outcome"], "error");
    assert!(
        got["call-down"]["detail"]
            .as_str()
            .unwrap()
            .contains("cannot reach tickets-down"),
        "{:#}",
        got["call-down"]
    );
    assert_eq!(got["call-old"]["outcome"], "unknown");
    assert!(
        got["call-old"]["detail"]
            .as_str()
            .unwrap()
            .contains("verdict escalated written at checkpoint"),
        "{:#}",
        got["call-old"]
    );
    assert_eq!(
        report["summary"]["audit"],
        json!({"committed": 1, "not_committed": 1, "unknown": 1, "error": 1})
    );
    // The escalation reaches the action sink, as one warning sentence; the records settled
    // either way are in the report only.
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("audit record"))
        .collect();
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(
        said[0].starts_with("warning: store ") && said[0].contains(") is unknown: "),
        "{stderr}"
    );

    let db = w.records().await;
    assert_eq!(db["call-landed"].0, "committed");
    assert_eq!(db["call-landed"].1["server_id"], "TCK-000001");
    assert_eq!(db["call-lost"].0, "not_committed");
    assert_eq!(db["call-down"].0, "pending");
    assert_eq!(db["call-old"].0, "unknown");
    assert_eq!(db["call-done"].0, "committed");
    assert_eq!(
        db["call-done"].1,
        Value::Null,
        "the agent's own record is untouched"
    );
    assert_eq!(db["call-fresh"].0, "pending");

    // The thread carries the verdict and still waits at its interrupt.
    let state = support::order_graph(w.db(), &["state", "--thread", "t-live"]);
    let verdict = &state["values"]["custody"];
    assert_eq!(verdict["verdict"], "escalated", "{state:#}");
    assert_eq!(verdict["audit"]["tool_call_id"], "call-old");
    assert_eq!(state["next"], json!(["add_item"]), "{state:#}");

    // The next sweep tries only what is still pending.
    let (again, _) = w.sweep();
    let got = handled(&again);
    assert_eq!(got.keys().collect::<Vec<_>>(), ["call-down"]);
    assert_eq!(
        tickets.stats().await["tickets"],
        1,
        "nothing was created twice"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn settles_landed_lost_down_and_old_records_sqlite() {
    outcomes_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn settles_landed_lost_down_and_old_records_postgres() {
    outcomes_case(Kind::Postgres).await;
}

/// A lookup slower than the server's timeout settles nothing: pending, one error.
#[tokio::test(flavor = "multi_thread")]
async fn a_lookup_that_times_out_leaves_the_record_pending() {
    let tickets = TicketServer::start(&[("TICKET_FIND_DELAY_SECONDS", "4")]);
    let w = World::new(Kind::Sqlite, "audit_timeout", &tickets.url(), 1).await;
    w.insert("t-live", "call-slow", "tickets", "pending", 300)
        .await;
    let (report, _) = w.sweep();
    let got = handled(&report);
    assert_eq!(got["call-slow"]["outcome"], "error", "{report:#}");
    assert_eq!(report["summary"]["audit"], json!({"error": 1}));
    assert_eq!(w.records().await["call-slow"].0, "pending");
}

/// Two sweepers at once: every record is looked up and settled exactly once. More records than
/// one batch (16), and lookups slow enough (2 rounds of 1.5 s) that the second sweeper claims
/// while the first still holds its batch: each must take the rows the other does not hold.
async fn concurrent_case(kind: Kind) {
    let tickets = TicketServer::start(&[("TICKET_FIND_DELAY_SECONDS", "1.5")]);
    let w = World::new(kind, "audit_concurrent", &tickets.url(), 10).await;
    let calls: Vec<String> = (0..20).map(|i| format!("call-{i:02}")).collect();
    for (i, call) in calls.iter().enumerate() {
        let key = idempotency_key("t-live", call);
        if i % 2 == 0 {
            agent_call(
                &tickets,
                "create_ticket",
                json!({"idempotency_key": key, "title": call}),
            )
            .await
            .expect("create_ticket");
        }
        w.insert("t-live", call, "tickets", "pending", 300).await;
    }
    let a = w
        .sweep_command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let b = w
        .sweep_command()
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (ra, _) = parse(a.wait_with_output().unwrap());
    let (rb, _) = parse(b.wait_with_output().unwrap());
    let (ga, gb) = (handled(&ra), handled(&rb));
    for call in &calls {
        assert!(
            ga.contains_key(call) != gb.contains_key(call),
            "{call} must be settled by exactly one sweep:\n{ra:#}\n{rb:#}"
        );
    }
    assert_eq!(ga.len() + gb.len(), 20);
    assert!(
        !ga.is_empty() && !gb.is_empty(),
        "both sweepers settled records while the other held its batch: {} + {}",
        ga.len(),
        gb.len()
    );
    assert_eq!(tickets.stats().await["finds"], 20, "one lookup per record");
    let db = w.records().await;
    for (i, call) in calls.iter().enumerate() {
        let want = if i % 2 == 0 {
            "committed"
        } else {
            "not_committed"
        };
        assert_eq!(db[call].0, want, "{call}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_concurrent_sweeps_settle_each_record_once_postgres() {
    concurrent_case(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_concurrent_sweeps_settle_each_record_once_sqlite() {
    concurrent_case(Kind::Sqlite).await;
}
