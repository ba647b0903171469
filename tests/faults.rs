//! The sweep's fault matrix (issue 9): what happens to a sweep when its database or an MCP
//! server misbehaves, or when the sweeper itself is killed. Every row asserts the same outcome:
//! no thread lost, no handle minted twice, no verdict written to a thread that moved on, a clear
//! error or condition naming the cause, and the next run completes the work.
//!
//! Real parts throughout: LangGraph (tests/py/order_graph.py) writes the threads, PostgreSQL and
//! SQLite hold them, the Python basket and ticket servers, and tests/py/misbehaving_server.py (a
//! real HTTP peer with one misbehaviour per process) answer, and the real `custody` binary
//! sweeps. Stops at a named step use failpoints, so the file builds only with
//! `--features failpoints`, as tests/run.sh runs it.
//!
//! | # | fault | expected outcome | test |
//! |---|---|---|---|
//! | 1a | PostgreSQL restarted while the sweep scans | the sweep exits 1 naming the store and the lost connection, writes nothing; the next run acts | `postgres_restarted_mid_scan_fails_clearly_and_the_next_run_acts` |
//! | 1b | PostgreSQL restarted while the sweep acts (between mint and replay) | the act lock went with the connection: the action stops with an error saying so, the ledger keeps the minted handle; the next run replays and appends, one basket | `postgres_restarted_mid_act_stops_acting_and_the_next_run_finishes_once` |
//! | 2 | checkpoint database read-only (`default_transaction_read_only`), or a role with SELECT only (PostgreSQL) | observing works; acting exits 1 with "the checkpoint database refuses writes (<the database's reason>)", writes nothing, not even custody's tables; writable again, the next run acts | `a_read_only_database_is_observed_refused_for_acting_then_acted_on` |
//! | 2b | checkpoint database a hot standby (a streaming replica) | the plan warns that acting would be refused, naming the standby; acting exits 1 with "the checkpoint database refuses writes (… a hot standby …)", writes nothing | `a_hot_standby_is_observed_and_refused_for_acting` |
//! | 3a | probe: server hangs, answers 5xx, drops the SSE stream (on each resume too), or is slower than its timeout | `unknown` (never `gone`) with the cause (a dropped stream: `stream dropped`, not a timeout); one bad server costs only its own timeout | `probes_of_misbehaving_servers_are_unknown_and_cost_their_own_timeout` |
//! | 3b | probe: server slow byte by byte, within the timeout | the right verdict | same test (`slow-ok`) |
//! | 3c | mint hangs (after creating), answers 5xx, or drops the stream (after creating) | the action fails cleanly and is retried next run; the idempotency key returns the same basket: one basket | `a_mint_that_hangs_5xx_or_drops_is_retried_next_run_and_mints_once` |
//! | 3d | mint slow byte by byte, within the timeout | re-minted at once | `a_slow_mint_within_the_timeout_remints` |
//! | 3e | replay call hangs / 5xx / drops | its effect is unknown: escalated with the cause, never replayed twice, one basket | `a_replay_call_that_fails_escalates_and_never_replays_twice` |
//! | 3f | replay cannot connect (the server refuses connections right after the mint, then while the next run starts) | nothing was sent: the entry stays minted and the run reports "replay not sent, retried next sweep: … connection refused to …"; listening again, the next run replays each item once, one basket | `a_replay_that_cannot_connect_is_retried_next_run` |
//! | 3g | replay cannot connect, still refused a day after the mint (the class declares no TTL) | retried within the day; then escalated ("replay not sent for …s since the mint, past 86400s …: the new handle may have expired"), the entry settled, the old handle kept | `a_replay_not_sent_past_the_handles_lifetime_escalates` |
//! | 4 | sweeper SIGKILLed at each step of an audit settlement (`audit::after-claim`, `after-lookup`, `before-commit`, `after-commit`), both backends | the next run settles each record exactly once (lookups counted on the ticket server) | `kill_9_at_every_step_of_an_audit_settlement_settles_once_{sqlite,postgres}` |
//! | 5 | two acting sweeps of one store at once, both backends | one acts; the other skips every action saying another custody process is acting; one basket | `two_acting_sweeps_one_acts_the_other_says_why_{sqlite,postgres}` |
//!
//! Rows covered elsewhere:
//!
//! | fault | expected outcome | test |
//! |---|---|---|
//! | sweeper SIGKILLed at every step of a re-mint (`act::after-intent` … `after-append`), both backends | one basket, items replayed once or the thread escalated (`mid-replay`) | tests/actions.rs `kill_9_at_every_step_of_a_remint_mints_once_{sqlite,postgres}` |
//! | the thread resumed between custody's read and its write | nothing appended, `skipped: thread moved` | tests/actions.rs `a_thread_resumed_between_read_and_write_is_left_untouched_{sqlite,postgres}` |
//! | two sweepers settling audit records at once | each record looked up and settled once | tests/audit.rs `two_concurrent_sweeps_settle_each_record_once_{sqlite,postgres}` |
//! | audit lookup slower than the timeout, or its server down | the record stays pending, counted as an error | tests/audit.rs `a_lookup_that_times_out_leaves_the_record_pending`, `settles_landed_lost_down_and_old_records_{sqlite,postgres}` |
//! | discovery against a hanging, 5xx, dropping, slow, looping or malformed server | an error naming the server and step, within the timeout | tests/discovery.rs |
//! | a stale session refused with 400 and no id (TypeScript SDK) | re-initialized once, as for 404: the catalog, no timeout | tests/discovery.rs (`stale_session_400`) |
//! | an answer with a look-alike id (`"1"` for 1), `event: error`, a last SSE event without its blank line, both eras refused in `mode: auto` | `protocol`, `rpc_error` with the server's message, `transport` saying the stream ended without an answer, `connect` with both causes; probes `unknown` | tests/discovery.rs, tests/strict_replies.rs |
//! | probe server refusing connections | `unknown` | tests/sweep.rs |
//! | controller: lease lost, Secret deleted | (the controller's rows) | tests/cluster_controller.rs |

#![cfg(feature = "failpoints")]

mod support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use custody::domain::audit::idempotency_key;
use serde_json::{Value, json};
use support::checkpoints::{Checkpoints, Kind};
use support::failpoint::Stopped;
use support::{BasketServer, OwnPostgres, Peer, TicketServer, baskets, call, items};

/// `custody sweep -o json -f DIR` plus `extra` arguments.
fn sweep_args(dir: &Path, extra: &[&str]) -> Vec<String> {
    ["sweep", "-o", "json", "-f"]
        .into_iter()
        .map(str::to_owned)
        .chain([dir.display().to_string()])
        .chain(extra.iter().map(|s| (*s).to_owned()))
        .collect()
}

/// Runs custody and returns its output, whatever the exit status.
fn run(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(args)
        .output()
        .expect("run custody")
}

/// The first store's report of a successful run.
fn report(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "custody failed:\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("sweep JSON");
    doc["stores"][0].clone()
}

/// `custody sweep --apply` of `dir`, asserting success: the first store's report.
fn act(dir: &Path) -> Value {
    report(&run(&sweep_args(dir, &["--apply"])))
}

/// The `error: …` line of a run's stderr (empty when there is none).
fn error_line(stderr: &str) -> &str {
    stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or("")
}

/// `custody sweep --apply` of `dir`, asserting that it fails: its stderr.
fn failed_apply(dir: &Path) -> String {
    let out = run(&sweep_args(dir, &["--apply"]));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    stderr
}

/// The rows of one thread in a store report.
fn rows<'a>(report: &'a Value, thread: &str) -> Vec<&'a Value> {
    report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["thread_id"] == thread)
        .collect()
}

/// The one row of (thread, class).
fn row<'a>(report: &'a Value, thread: &str, class: &str) -> &'a Value {
    rows(report, thread)
        .into_iter()
        .find(|r| r["handle_class"] == class)
        .unwrap_or_else(|| panic!("no row for {thread}/{class} in {report:#}"))
}

// ------------------------------------------------------------------ 1: PostgreSQL restarts

/// A PostgreSQL of this test's own, with database `checkpoints`.
struct OwnPg {
    server: OwnPostgres,
    /// The `checkpoints` database.
    url: String,
}

impl OwnPg {
    /// Starts it and creates database `checkpoints`; `url` points at that database.
    async fn start() -> Self {
        use sqlx::Connection as _;
        let server = OwnPostgres::start();
        let mut c = sqlx::PgConnection::connect(&server.admin).await.unwrap();
        sqlx::query("CREATE DATABASE checkpoints")
            .execute(&mut c)
            .await
            .unwrap();
        let (base, _) = server.admin.rsplit_once('/').unwrap();
        let url = format!("{base}/checkpoints");
        Self { server, url }
    }

    /// A fast restart on the same port: every open session is terminated.
    fn restart(&self) {
        self.server.restart();
    }

    /// Copies thread `from` (all its checkpoints, blobs and writes) `n` times as `bulk-<i>`,
    /// so a scan's result is larger than the socket buffers and is still streaming when the
    /// server goes away. The copies are LangGraph's own rows under other thread ids.
    async fn bulk_copy(&self, from: &str, n: u32) {
        use sqlx::Connection as _;
        let mut c = sqlx::PgConnection::connect(&self.url).await.unwrap();
        for table in ["checkpoints", "checkpoint_blobs", "checkpoint_writes"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table}
                 SELECT (jsonb_populate_record(NULL::{table},
                     to_jsonb(c) || jsonb_build_object('thread_id', 'bulk-' || g))).*
                 FROM {table} c, generate_series(1, $2) g WHERE c.thread_id = $1"
            )))
            .bind(from)
            .bind(i32::try_from(n).unwrap())
            .execute(&mut c)
            .await
            .unwrap();
        }
    }
}

impl OwnPg {
    /// Copies thread `from` to thread `to`, as [`OwnPg::bulk_copy`] does.
    async fn copy_thread(&self, from: &str, to: &str) {
        use sqlx::Connection as _;
        let mut c = sqlx::PgConnection::connect(&self.url).await.unwrap();
        for table in ["checkpoints", "checkpoint_blobs", "checkpoint_writes"] {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table}
                 SELECT (jsonb_populate_record(NULL::{table},
                     to_jsonb(c) || jsonb_build_object('thread_id', $2::text))).*
                 FROM {table} c WHERE c.thread_id = $1"
            )))
            .bind(from)
            .bind(to)
            .execute(&mut c)
            .await
            .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_restarted_mid_scan_fails_clearly_and_the_next_run_acts() {
    let pg = OwnPg::start().await;
    let db = Checkpoints::on_postgres(pg.url.clone());
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    support::write_some_fixtures(&basket.url(), db.db(), Some("t-expired,t-live"), "");
    // More rows than the socket buffers hold, so the server is still sending when it restarts:
    // with 4 000 the kernel's buffers (autotuned, ~2 500 rows at the least) took every row on
    // a loaded machine, and the scan finished unharmed (seen in CI).
    pg.bulk_copy("t-live", 10_000).await;
    let (backend, dsn) = db.backend_dsn();
    support::act_resources(res.path(), &basket.url(), backend, &dsn, "escalate");
    let checkpoints_before = db.count("SELECT count(*) FROM checkpoints").await;

    let args = sweep_args(res.path(), &["--apply"]);
    let stopped = Stopped::at(&args, "sweep::mid-scan", "return(wait)");
    pg.restart();
    let (status, stdout, stderr) = stopped.go();
    assert!(
        !status.success(),
        "a scan cut off by the restart must fail the sweep:\n{stdout}\n{stderr}"
    );
    let error = error_line(&stderr);
    // The cause's text depends on timing: the server's "terminating connection due to
    // administrator command" when it reaches the client, otherwise the cut-off read.
    assert!(
        error.starts_with("error: store default/orders: the scan stopped after ")
            && (error.contains("terminating connection due to administrator command")
                || error.contains("error communicating with database")),
        "the error names the store, the step and the cause: {error:?}\n{stderr}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM checkpoints").await,
        checkpoints_before,
        "nothing written"
    );

    let again = act(res.path());
    assert_eq!(
        row(&again, "t-expired", "basket")["action"]["outcome"],
        "escalated",
        "{again:#}"
    );
    assert_eq!(again["summary"]["parkedThreads"], 10_002);
    assert_eq!(db.unsettled().await, 0);
}

/// An acting sweep acts on each batch before it reads the next: a scan cut off after batch 1
/// leaves batch 1's actions done and in the ledger, prints valid JSON with them, and the next
/// sweep acts on the rest without acting on batch 1 again.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_restarted_after_a_batch_keeps_its_actions_and_the_next_run_goes_on() {
    let pg = OwnPg::start().await;
    let db = Checkpoints::on_postgres(pg.url.clone());
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    support::write_some_fixtures(&basket.url(), db.db(), Some("t-expired,t-live"), "");
    // Scan order: a-expired, 10000 bulk- copies of t-live, t-expired, t-live: more than the
    // socket buffers hold (~2500 of them), so the restart cuts the scan before t-expired.
    pg.copy_thread("t-expired", "a-expired").await;
    pg.bulk_copy("t-live", 10_000).await;
    let (backend, dsn) = db.backend_dsn();
    support::act_resources(res.path(), &basket.url(), backend, &dsn, "escalate");
    let checkpoints = async || db.count("SELECT count(*) FROM checkpoints").await.unwrap();
    let before = checkpoints().await;

    let args = sweep_args(res.path(), &["--apply", "--batch-threads", "1"]);
    let stopped = Stopped::at(&args, "sweep::after-batch", "return(wait)");
    pg.restart();
    let (status, stdout, stderr) = stopped.go();
    assert!(!status.success(), "{stdout}\n{stderr}");
    let error = error_line(&stderr);
    assert!(
        error.starts_with("error: store default/orders: the scan stopped after ")
            && error.contains(
                " parked threads of the batches finished before were judged (and acted on when acting), the rest were not"
            ),
        "{error:?}\n{stderr}"
    );
    let doc: Value = serde_json::from_str(&stdout).expect("valid JSON though the scan failed");
    let store = &doc["stores"][0];
    assert_eq!(
        row(store, "a-expired", "basket")["action"]["outcome"],
        "escalated",
        "{store:#}"
    );
    assert!(
        store["error"]
            .as_str()
            .unwrap()
            .contains("the scan stopped after"),
        "{store:#}"
    );
    assert_eq!(doc["errors"].as_array().unwrap().len(), 1);
    assert_eq!(checkpoints().await - before, 1, "batch 1's action is done");
    assert_eq!(db.unsettled().await, 0, "and recorded as done");

    let again = act(res.path());
    assert_eq!(
        row(&again, "a-expired", "basket")["action"]["reason"],
        "already escalated",
        "{again:#}"
    );
    assert_eq!(
        row(&again, "t-expired", "basket")["action"]["outcome"],
        "escalated"
    );
    assert_eq!(again["summary"]["parkedThreads"], 10_003);
    assert_eq!(checkpoints().await - before, 2, "one action per thread");
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_restarted_mid_act_stops_acting_and_the_next_run_finishes_once() {
    let pg = OwnPg::start().await;
    let db = Checkpoints::on_postgres(pg.url.clone());
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    let old = db.filled(&basket.url(), "");
    call(&basket.url(), "delete_basket", json!({"basket_id": old})).await;
    let (backend, dsn) = db.backend_dsn();
    support::act_resources(res.path(), &basket.url(), backend, &dsn, "remint");
    let before = baskets(&basket.url()).await;

    let args = sweep_args(res.path(), &["--apply"]);
    let stopped = Stopped::at(&args, "act::after-mint", "return(wait)");
    pg.restart();
    let (status, stdout, stderr) = stopped.go();
    assert!(status.success(), "{stdout}\n{stderr}");
    let first: Value = serde_json::from_str(&stdout).unwrap();
    let r = row(&first["stores"][0], "t-live", "basket");
    assert_eq!(r["action"]["outcome"], "error", "{r:#}");
    assert!(
        r["action"]["reason"].as_str().unwrap().contains("act lock"),
        "the error says why acting stopped: {r:#}"
    );
    assert_eq!(
        db.unsettled().await,
        1,
        "the minted handle stays in the ledger"
    );
    assert_eq!(
        db.state("t-live")["values"]["basket"]["value"],
        old.as_str(),
        "nothing appended"
    );

    let again = act(res.path());
    assert_eq!(again["settled"].as_array().unwrap().len(), 1, "{again:#}");
    assert_eq!(again["settled"][0]["outcome"], "reminted", "{again:#}");
    assert_eq!(baskets(&basket.url()).await, before + 1, "one basket");
    let state = db.state("t-live");
    let new = state["values"]["basket"]["value"].as_str().unwrap();
    assert_ne!(new, old);
    assert_eq!(
        items(&basket.url(), new).await,
        vec![("gadget".to_owned(), 1), ("widget".to_owned(), 2)],
        "replayed once"
    );
    assert_eq!(db.unsettled().await, 0);
}

// ------------------------------------------------------------------ 2: read-only database

#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_database_is_observed_refused_for_acting_then_acted_on() {
    use sqlx::Connection as _;
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    let db = Checkpoints::new(Kind::Postgres, res.path(), "faults_read_only").await;
    support::write_some_fixtures(&basket.url(), db.db(), Some("t-expired,t-live"), "");
    let (backend, dsn) = db.backend_dsn();
    support::act_resources(res.path(), &basket.url(), backend, &dsn, "escalate");
    let name = db.pg.rsplit_once('/').unwrap().1.to_owned();
    let mut admin = sqlx::PgConnection::connect(&support::var("CUSTODY_TEST_PG_URL"))
        .await
        .unwrap();
    let checkpoints = db.count("SELECT count(*) FROM checkpoints").await;

    // A role that may only read: observed, refused for acting with the database's reason.
    let reader = format!("faults_reader_{}", std::process::id());
    {
        let mut owner = sqlx::PgConnection::connect(&db.pg).await.unwrap();
        for sql in [
            format!("DROP ROLE IF EXISTS {reader}"),
            format!("CREATE ROLE {reader} LOGIN"),
            format!("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {reader}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&mut owner)
                .await
                .unwrap();
        }
    }
    let as_reader = db.pg.replacen("postgres@", &format!("{reader}@"), 1);
    support::act_resources(res.path(), &basket.url(), backend, &as_reader, "escalate");
    let observed = report(&run(&sweep_args(res.path(), &[])));
    assert_eq!(row(&observed, "t-expired", "basket")["verdict"], "gone");
    let stderr = failed_apply(res.path());
    assert!(
        stderr.contains(
            "store default/orders: the checkpoint database refuses writes (permission denied"
        ) && stderr.contains(
            ": the role of spec.dsn lacks a grant an acting sweep needs, README \"Database \
             privileges\"): custody cannot act on it"
        ),
        "{stderr}"
    );
    {
        let mut owner = sqlx::PgConnection::connect(&db.pg).await.unwrap();
        for sql in [
            format!("DROP OWNED BY {reader}"),
            format!("DROP ROLE {reader}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .execute(&mut owner)
                .await
                .unwrap();
        }
    }
    support::act_resources(res.path(), &basket.url(), backend, &dsn, "escalate");

    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {name} SET default_transaction_read_only = on"
    )))
    .execute(&mut admin)
    .await
    .unwrap();

    // The whole database read-only. Observing needs no writes.
    let observed = report(&run(&sweep_args(res.path(), &[])));
    assert_eq!(row(&observed, "t-expired", "basket")["verdict"], "gone");
    assert_eq!(
        row(&observed, "t-expired", "basket")["action"]["outcome"],
        "planned"
    );
    assert_eq!(row(&observed, "t-live", "basket")["verdict"], "ok");

    // Acting is refused with the cause, and nothing is written.
    let stderr = failed_apply(res.path());
    let error = error_line(&stderr);
    assert!(
        error.contains("store default/orders: the checkpoint database refuses writes")
            && error.contains("read-only transaction"),
        "the error names the store and the read-only database: {error:?}\n{stderr}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM checkpoints").await,
        checkpoints
    );
    assert_eq!(
        db.count("SELECT count(*) FROM custody_actions").await,
        None,
        "not even custody's tables"
    );

    // Writable again: the next run acts.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {name} RESET default_transaction_read_only"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    let acted = act(res.path());
    assert_eq!(
        row(&acted, "t-expired", "basket")["action"]["outcome"],
        "escalated",
        "{acted:#}"
    );
    assert_eq!(db.unsettled().await, 0);
}

/// A hot standby (a streaming replica, `pg_is_in_recovery()`) refuses every write whatever the
/// role's grants: the plan of a `mode: act` store on it says acting would be refused and why,
/// and `--apply` is refused with that cause and writes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_hot_standby_is_observed_and_refused_for_acting() {
    use sqlx::Connection as _;
    let pg = OwnPg::start().await;
    let basket = BasketServer::start(&[]);
    support::write_some_fixtures(
        &basket.url(),
        support::Db::Postgres(&pg.url),
        Some("t-expired,t-live"),
        "",
    );
    let standby = pg.server.standby();
    let (base, _) = standby.admin.rsplit_once('/').unwrap();
    let res = tempfile::tempdir().unwrap();
    support::act_resources(
        res.path(),
        &basket.url(),
        "postgres",
        &format!("{base}/checkpoints"),
        "escalate",
    );

    let planned = report(&run(&sweep_args(res.path(), &[])));
    assert_eq!(row(&planned, "t-expired", "basket")["verdict"], "gone");
    assert_eq!(
        row(&planned, "t-expired", "basket")["action"]["outcome"],
        "planned"
    );
    assert!(
        planned["warnings"].as_array().unwrap().iter().any(|w| w
            == "an acting sweep of this store would be refused and take none of the planned \
                actions: the database is a hot standby (pg_is_in_recovery)"),
        "{planned:#}"
    );

    let stderr = failed_apply(res.path());
    let error = error_line(&stderr);
    assert!(
        error.contains("store default/orders: the checkpoint database refuses writes (")
            && error.contains("hot standby"),
        "the error names the store and the standby: {error:?}\n{stderr}"
    );
    let mut primary = sqlx::PgConnection::connect(&pg.url).await.unwrap();
    let custody_tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'custody_%'")
            .fetch_one(&mut primary)
            .await
            .unwrap();
    assert_eq!(
        custody_tables, 0,
        "nothing written, not even custody's tables"
    );
}

// ------------------------------------------------------------------ 3: misbehaving MCP servers

/// An MCPServer and a HandleClass probing the thread's `basket` through it.
fn probe_class(dir: &Path, name: &str, url: &str, timeout_s: u32) {
    support::write_file(
        dir,
        &format!("{name}.yaml"),
        &format!(
            r#"apiVersion: custody.dev/v1alpha1
kind: MCPServer
metadata: {{name: {name}}}
spec: {{url: "{url}", timeoutSeconds: {timeout_s}}}
---
apiVersion: custody.dev/v1alpha1
kind: HandleClass
metadata: {{name: {name}}}
spec:
  serverRef: {name}
  statePath: basket
  probe:
    tool: get_basket
    arguments: {{basket_id: "{{{{handle}}}}"}}
    goneWhen: {{errorTextPrefixes: [BASKET_EXPIRED, BASKET_NOT_FOUND]}}
"#
        ),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn probes_of_misbehaving_servers_are_unknown_and_cost_their_own_timeout() {
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    let db = Checkpoints::new(Kind::Sqlite, res.path(), "").await;
    support::write_some_fixtures(&basket.url(), db.db(), Some("t-live"), "");
    let (backend, dsn) = db.backend_dsn();
    support::basket_resources(res.path(), &basket.url(), "auto", backend, &dsn);
    let probe = [("MISBEHAVE_TOOLS", "get_basket")];
    // Each bad server costs its 3 s timeout at most; in sequence they would cost 12 s.
    let servers = [
        ("hang", Peer::misbehaving_with("call_hang", &probe), 3),
        (
            "http-500",
            Peer::misbehaving_with("call_http_500", &probe),
            3,
        ),
        (
            "drop",
            Peer::misbehaving_with("call_drop_mid_stream", &probe),
            3,
        ),
        (
            "slow-late",
            Peer::misbehaving_with(
                "call_slow_bytes",
                &[
                    ("MISBEHAVE_TOOLS", "get_basket"),
                    ("MISBEHAVE_BYTE_DELAY_MS", "50"),
                ],
            ),
            3,
        ),
        (
            "slow-ok",
            Peer::misbehaving_with(
                "call_slow_bytes",
                &[
                    ("MISBEHAVE_TOOLS", "get_basket"),
                    ("MISBEHAVE_BYTE_DELAY_MS", "5"),
                ],
            ),
            20,
        ),
    ];
    for (name, server, timeout) in &servers {
        probe_class(res.path(), name, &server.url(), *timeout);
    }

    let started = Instant::now();
    let r = report(&run(&sweep_args(res.path(), &["--dry-run"])));
    let took = started.elapsed();
    assert_eq!(row(&r, "t-live", "basket")["verdict"], "ok", "{r:#}");
    // A dropped stream is resumed (GET with Last-Event-ID) and dropped again: after the bounded
    // resumes it is its own cause, not a timeout (issue 17, item 14; tests/discovery.rs too).
    for (name, want) in [
        ("hang", "tools/call get_basket timed out after 3s"),
        ("http-500", "500"),
        (
            "drop",
            "tools/call failed: stream dropped: the server closed the connection in the middle",
        ),
        ("slow-late", "tools/call get_basket timed out after 3s"),
    ] {
        let bad = row(&r, "t-live", name);
        assert_eq!(bad["verdict"], "unknown", "{name}: never gone: {bad:#}");
        assert!(
            bad["reason"].as_str().unwrap().contains(want),
            "{name}: the reason names the cause ({want}): {bad:#}"
        );
        assert!(bad["action"].is_null(), "unknown is never acted on");
    }
    let slow = row(&r, "t-live", "slow-ok");
    assert_eq!(
        slow["verdict"], "gone",
        "a slow answer within the timeout is judged on its content: {slow:#}"
    );
    assert!(
        slow["reason"]
            .as_str()
            .unwrap()
            .contains("BASKET_NOT_FOUND"),
        "{slow:#}"
    );
    assert!(
        took < Duration::from_secs(12),
        "servers are probed in parallel, each bounded by its own timeout: {took:?}"
    );
}

/// Resources re-minting the thread's basket on `url`, with 3 s timeouts.
fn remint_on(dir: &Path, url: &str, db: &Checkpoints) {
    let (backend, dsn) = db.backend_dsn();
    support::act_resources(dir, url, backend, &dsn, "remint");
    support::write_file(
        dir,
        "server.yaml",
        &format!(
            "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: basket}}\n\
             spec: {{url: \"{url}\", timeoutSeconds: 3}}\n"
        ),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mint_that_hangs_5xx_or_drops_is_retried_next_run_and_mints_once() {
    let basket = BasketServer::start(&[]);
    for case in ["call_hang", "call_http_500", "call_drop_mid_stream"] {
        // The thread's basket lives on the real server; the misbehaving one does not know it,
        // so its probe answers BASKET_NOT_FOUND and the sweep re-mints there.
        let bad = Peer::misbehaving_with(
            case,
            &[
                ("MISBEHAVE_TOOLS", "create_basket"),
                ("MISBEHAVE_TIMES", "1"),
            ],
        );
        let res = tempfile::tempdir().unwrap();
        let db = Checkpoints::new(Kind::Sqlite, res.path(), "").await;
        let old = db.filled(&basket.url(), "");
        remint_on(res.path(), &bad.url(), &db);

        let first = act(res.path());
        let r = row(&first, "t-live", "basket");
        assert_eq!(r["verdict"], "gone", "{case}: {r:#}");
        assert_eq!(r["action"]["outcome"], "error", "{case}: {r:#}");
        assert!(
            r["action"]["reason"]
                .as_str()
                .unwrap()
                .starts_with("mint failed, retried next sweep: server basket: tools/call"),
            "{case}: {r:#}"
        );
        assert_eq!(db.unsettled().await, 1, "{case}: the intent stays");
        assert_eq!(
            db.state("t-live")["values"]["basket"]["value"],
            old.as_str(),
            "{case}: nothing appended"
        );

        let second = act(res.path());
        assert_eq!(
            second["settled"][0]["outcome"], "reminted",
            "{case}: {second:#}"
        );
        let new = db.state("t-live")["values"]["basket"]["value"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(
            baskets(&bad.url()).await,
            1,
            "{case}: one basket, whatever the first call did"
        );
        assert_eq!(
            items(&bad.url(), &new).await,
            vec![("gadget".to_owned(), 1), ("widget".to_owned(), 2)],
            "{case}"
        );
        assert_eq!(db.unsettled().await, 0, "{case}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_mint_within_the_timeout_remints() {
    let basket = BasketServer::start(&[]);
    let bad = Peer::misbehaving_with(
        "call_slow_bytes",
        &[
            ("MISBEHAVE_TOOLS", "create_basket"),
            ("MISBEHAVE_BYTE_DELAY_MS", "5"),
        ],
    );
    let res = tempfile::tempdir().unwrap();
    let db = Checkpoints::new(Kind::Sqlite, res.path(), "").await;
    db.filled(&basket.url(), "");
    remint_on(res.path(), &bad.url(), &db);
    // At 5 ms a byte the answer takes 1–2 s: slow, but within the 3 s per-request timeout.
    let r = act(res.path());
    assert_eq!(
        row(&r, "t-live", "basket")["action"]["outcome"],
        "reminted",
        "{r:#}"
    );
    assert_eq!(baskets(&bad.url()).await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_call_that_fails_escalates_and_never_replays_twice() {
    let basket = BasketServer::start(&[]);
    for (case, cause) in [
        ("call_hang", "timed out"),
        ("call_http_500", "500"),
        ("call_drop_mid_stream", "failed"),
    ] {
        let bad = Peer::misbehaving_with(
            case,
            &[("MISBEHAVE_TOOLS", "add_item"), ("MISBEHAVE_TIMES", "1")],
        );
        let res = tempfile::tempdir().unwrap();
        let db = Checkpoints::new(Kind::Sqlite, res.path(), "").await;
        let old = db.filled(&basket.url(), "");
        remint_on(res.path(), &bad.url(), &db);

        let first = act(res.path());
        let r = row(&first, "t-live", "basket");
        assert_eq!(r["action"]["outcome"], "escalated", "{case}: {r:#}");
        let state = db.state("t-live");
        let custody = &state["values"]["custody"];
        let reason = custody["reason"].as_str().unwrap();
        assert!(
            reason.contains("replay add_item of item 1 failed") && reason.contains(cause),
            "{case}: the verdict names the failed call and its cause: {custody:#}"
        );
        assert_eq!(state["values"]["basket"]["value"], old.as_str(), "{case}");
        assert_eq!(state["next"], json!(["add_item"]), "{case}");
        assert_eq!(baskets(&bad.url()).await, 1, "{case}: minted once");
        assert_eq!(db.unsettled().await, 0, "{case}");

        let again = act(res.path());
        let r = row(&again, "t-live", "basket");
        assert_eq!(r["action"]["reason"], "already escalated", "{case}: {r:#}");
        assert_eq!(baskets(&bad.url()).await, 1, "{case}: not minted again");
    }
}

/// Issue 17, item 14: a replay whose connection fails (the server refuses connections right
/// after the mint: the call was never sent) is retried at the next run, not escalated: the
/// entry stays minted with nothing replayed; a run while the server still refuses (no session at
/// all) retries again; once the server listens again, the next run replays every item exactly
/// once onto the one minted basket.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_that_cannot_connect_is_retried_next_run() {
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    let reopen = res.path().join("reopen");
    let bad = Peer::misbehaving_with(
        "call_close_listener",
        &[
            ("MISBEHAVE_TOOLS", "create_basket"),
            ("MISBEHAVE_TIMES", "1"),
            ("MISBEHAVE_REOPEN_FILE", reopen.to_str().unwrap()),
        ],
    );
    let db = Checkpoints::new(Kind::Sqlite, res.path(), "").await;
    let old = db.filled(&basket.url(), "");
    remint_on(res.path(), &bad.url(), &db);

    for attempt in ["the call refused", "no session"] {
        let out = run(&sweep_args(res.path(), &["--apply"]));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("replay not sent, retried next sweep")
                && text.contains("connection refused to 127.0.0.1"),
            "{attempt}: reported as retried: {text}"
        );
        assert!(!text.contains("escalated"), "{attempt}: {text}");
        let state = db.state("t-live");
        assert_eq!(
            state["values"]["basket"]["value"],
            old.as_str(),
            "{attempt}"
        );
        assert!(state["values"]["custody"].is_null(), "{attempt}: {state}");
        assert_eq!(
            db.unsettled().await,
            1,
            "{attempt}: the entry stays pending"
        );
    }

    std::fs::write(&reopen, b"").unwrap();
    support::wait_for_port(bad.port, Duration::from_secs(10));
    let done = act(res.path());
    let state = db.state("t-live");
    assert_eq!(
        state["values"]["custody"]["verdict"], "reminted",
        "{done:#}"
    );
    let new = state["values"]["basket"]["value"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(new, old);
    assert_eq!(baskets(&bad.url()).await, 1, "minted once");
    assert_eq!(
        items(&bad.url(), &new).await,
        vec![("gadget".to_owned(), 1), ("widget".to_owned(), 2)],
        "each item replayed exactly once"
    );
    assert_eq!(db.unsettled().await, 0);
}

// ------------------------------------------------------------------ 4: audit settlement killed

/// Lookups the ticket server has served.
async fn lookups(tickets: &TicketServer) -> u64 {
    tickets.stats().await["finds"].as_u64().unwrap()
}

/// The audit steps at which the sweeper is killed.
const AUDIT_STEPS: [&str; 4] = [
    "after-claim",
    "after-lookup",
    "before-commit",
    "after-commit",
];

async fn audit_kill_case(kind: Kind) {
    let basket = BasketServer::start(&[]);
    let tickets = TicketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    let db = Checkpoints::new(kind, res.path(), "faults_audit_kill").await;
    support::write_some_fixtures(&basket.url(), db.db(), Some("t-live"), "");
    let (backend, dsn) = db.backend_dsn();
    support::write_file(
        res.path(),
        "servers.yaml",
        &format!(
            r#"apiVersion: custody.dev/v1alpha1
kind: MCPServer
metadata: {{name: tickets}}
spec:
  url: "{}"
  timeoutSeconds: 10
  reconciliation:
  - tool: create_ticket
    lookup:
      tool: find_ticket
      arguments: {{idempotency_key: "{{{{idempotency_key}}}}"}}
      found: {{path: ticket, notFoundErrorPrefixes: [TICKET_NOT_FOUND]}}
      idField: ticket.id
"#,
            tickets.url()
        ),
    );
    support::write_file(
        res.path(),
        "store.yaml",
        &format!(
            "apiVersion: custody.dev/v1alpha1\nkind: CheckpointStore\nmetadata: {{name: orders}}\n\
             spec:\n  backend: {backend}\n  dsn: \"{dsn}\"\n  mode: act\n\
             \x20 audit: {{graceSeconds: 60, maxAgeSeconds: 3600, verdictPath: custody}}\n"
        ),
    );
    act(res.path()); // creates custody's tables
    let args = sweep_args(res.path(), &["--apply"]);

    for step in AUDIT_STEPS {
        // Two writes that landed on the server, two that did not, all left pending.
        let calls: Vec<String> = (0..4).map(|i| format!("{step}-{i}")).collect();
        for (i, c) in calls.iter().enumerate() {
            let key = idempotency_key("t-live", c);
            if i % 2 == 0 {
                call(
                    &tickets.url(),
                    "create_ticket",
                    json!({"idempotency_key": key, "title": c}),
                )
                .await;
            }
            insert_pending(&db, c, &key).await;
        }
        let finds = lookups(&tickets).await;

        Stopped::at(&args, &format!("audit::{step}"), "return").kill();
        let next = act(res.path());
        let handled: Vec<&str> = next["audit"]["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["tool_call_id"].as_str().unwrap())
            .collect();
        if step == "after-commit" {
            assert!(
                handled.is_empty(),
                "{step}: settled before the kill: {next:#}"
            );
        } else {
            assert_eq!(handled, calls, "{step}: the next run settles each record");
        }
        // Lookups are read-only, so a batch looked up but not committed is looked up again.
        let looked_up_twice = matches!(step, "after-lookup" | "before-commit");
        assert_eq!(
            lookups(&tickets).await - finds,
            if looked_up_twice { 8 } else { 4 },
            "{step}: lookups"
        );
        for (i, c) in calls.iter().enumerate() {
            let want = if i % 2 == 0 {
                "committed"
            } else {
                "not_committed"
            };
            let got = db
                .count(&format!(
                    "SELECT count(*) FROM custody_audit WHERE tool_call_id = '{c}' AND status = '{want}'"
                ))
                .await;
            assert_eq!(got, Some(1), "{step}: {c} is {want}");
        }
        // A further run finds nothing left to settle.
        let idle = act(res.path());
        assert!(
            idle["audit"]["records"].as_array().unwrap().is_empty(),
            "{step}: {idle:#}"
        );
    }
}

/// Writes a pending audit record for `call` on t-live, five minutes old, as an agent does.
async fn insert_pending(db: &Checkpoints, call: &str, key: &str) {
    use sqlx::Connection as _;
    match db.kind {
        Kind::Postgres => {
            let mut c = sqlx::PgConnection::connect(&db.pg).await.unwrap();
            sqlx::query(
                "INSERT INTO custody_audit (thread_id, tool_call_id, idempotency_key, server, tool,
                    principal, created_at, updated_at)
                 VALUES ('t-live', $1, $2, 'tickets', 'create_ticket', 'user-1',
                    now() - interval '300 seconds', now() - interval '300 seconds')",
            )
            .bind(call)
            .bind(key)
            .execute(&mut c)
            .await
            .unwrap();
        }
        Kind::Sqlite => {
            let url = format!("sqlite://{}", db.sqlite.display());
            let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
            sqlx::query(
                "INSERT INTO custody_audit (thread_id, tool_call_id, idempotency_key, server, tool,
                    principal, created_at, updated_at)
                 VALUES ('t-live', ?1, ?2, 'tickets', 'create_ticket', 'user-1',
                    strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-300 seconds'),
                    strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-300 seconds'))",
            )
            .bind(call)
            .bind(key)
            .execute(&mut c)
            .await
            .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_at_every_step_of_an_audit_settlement_settles_once_sqlite() {
    audit_kill_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_at_every_step_of_an_audit_settlement_settles_once_postgres() {
    audit_kill_case(Kind::Postgres).await;
}

// ------------------------------------------------------------------ 5: two acting sweeps

async fn two_sweeps_case(kind: Kind) {
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    let db = Checkpoints::new(kind, res.path(), "faults_two_sweeps").await;
    let old = db.filled(&basket.url(), "");
    call(&basket.url(), "delete_basket", json!({"basket_id": old})).await;
    let (backend, dsn) = db.backend_dsn();
    support::act_resources(res.path(), &basket.url(), backend, &dsn, "remint");
    let before = baskets(&basket.url()).await;

    let args = sweep_args(res.path(), &["--apply"]);
    let first = Stopped::at(&args, "act::after-intent", "return(wait)");
    let out = run(&args);
    let second = report(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let r = row(&second, "t-live", "basket");
    assert_eq!(r["verdict"], "gone", "{r:#}");
    assert_eq!(r["action"]["outcome"], "skipped", "{r:#}");
    assert_eq!(
        r["action"]["reason"], "another custody process is acting on this store",
        "{r:#}"
    );
    // Said once, in the report, which does not claim the sweep acted; nothing on stderr.
    assert_eq!(second["acting"], "lock_held_elsewhere", "{second:#}");
    let warnings = second["warnings"].to_string();
    assert_eq!(
        warnings
            .matches("another custody process holds the act lock of this store: this sweep took no action")
            .count(),
        1,
        "{warnings}"
    );
    // Its probes are observations, not actions: their lifetimes are recorded, and it says so.
    assert!(
        warnings.contains(
            "this sweep took no action (each row's action says skipped), but recorded its observed \
             handle lifetimes, observations every acting sweep adds to; that process acts on it"
        ),
        "{warnings}"
    );
    assert!(
        db.count("SELECT count(*) FROM custody_handle_lifetimes")
            .await
            .is_some_and(|n| n > 0)
    );
    assert!(stderr.trim().is_empty(), "{stderr}");
    assert!(second["settled"].as_array().unwrap().is_empty());
    assert_eq!(
        baskets(&basket.url()).await,
        before,
        "the second sweep minted nothing"
    );

    let (status, stdout, stderr) = first.go();
    assert!(status.success(), "{stderr}");
    let first: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        row(&first["stores"][0], "t-live", "basket")["action"]["outcome"],
        "reminted"
    );
    assert_eq!(baskets(&basket.url()).await, before + 1, "one basket");
    assert_eq!(db.unsettled().await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn two_acting_sweeps_one_acts_the_other_says_why_sqlite() {
    two_sweeps_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_acting_sweeps_one_acts_the_other_says_why_postgres() {
    two_sweeps_case(Kind::Postgres).await;
}

/// Issue 17, the follow-up to item 14: a replay that cannot be sent is retried only while the
/// new handle may still be alive. The class declares no TTL, so custody's limit is one day from
/// the mint: a run within it retries; a run a day later (the sweep's clock set with `--now`),
/// the server still refusing, escalates the thread saying why, and the entry is settled.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_not_sent_past_the_handles_lifetime_escalates() {
    let basket = BasketServer::start(&[]);
    let res = tempfile::tempdir().unwrap();
    // Never created: the server keeps refusing connections after the mint.
    let reopen = res.path().join("reopen");
    let bad = Peer::misbehaving_with(
        "call_close_listener",
        &[
            ("MISBEHAVE_TOOLS", "create_basket"),
            ("MISBEHAVE_TIMES", "1"),
            ("MISBEHAVE_REOPEN_FILE", reopen.to_str().unwrap()),
        ],
    );
    let db = Checkpoints::new(Kind::Sqlite, res.path(), "").await;
    let old = db.filled(&basket.url(), "");
    remint_on(res.path(), &bad.url(), &db);

    let text = |out: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let first = text(&run(&sweep_args(res.path(), &["--apply"])));
    assert!(
        first.contains("replay not sent, retried next sweep"),
        "within the limit: retried: {first}"
    );
    assert_eq!(db.unsettled().await, 1);

    let later = (chrono::Utc::now() + chrono::Duration::hours(25)).to_rfc3339();
    let out = run(&sweep_args(res.path(), &["--apply", "--now", &later]));
    let state = db.state("t-live");
    let custody = &state["values"]["custody"];
    assert_eq!(custody["verdict"], "escalated", "{}\n{state:#}", text(&out));
    let reason = custody["reason"].as_str().unwrap();
    assert!(
        reason.contains("re-mint not possible: replay not sent for ")
            && reason.contains("past 86400s (custody's limit without a declared TTL): the new handle may have expired; last attempt: ")
            && reason.contains("connection refused to 127.0.0.1"),
        "{reason}"
    );
    assert_eq!(state["values"]["basket"]["value"], old.as_str());
    assert_eq!(db.unsettled().await, 0, "the entry is settled");
}
