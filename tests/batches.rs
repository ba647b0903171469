//! A sweep in batches (`RunOptions::batch_threads`): real LangGraph threads in PostgreSQL and
//! SQLite, the real basket server. Batches of 1, 2 and 3 threads give exactly the rows, summary
//! and probe count of one batch; a handle held by threads in different batches is probed once;
//! an acting sweep in batches (its scan open while it writes) acts once per thread.

mod support;

use std::collections::BTreeSet;
use std::path::Path;

use custody::sweep::{Report, RunOptions};
use serde_json::Value;
use support::{BasketServer, Db};

fn target(res: &Path) -> custody::plan::Target {
    let targets = custody::local::Resources::load(res)
        .unwrap()
        .targets()
        .unwrap();
    assert_eq!(targets.len(), 1);
    targets.into_iter().next().unwrap()
}

async fn sweep(
    target: &custody::plan::Target,
    now: chrono::DateTime<chrono::Utc>,
    apply: bool,
    batch_threads: usize,
) -> Report {
    custody::sweep::collect(
        target,
        now,
        RunOptions {
            apply,
            batch_threads,
            ..RunOptions::default()
        },
        &custody::sweep::act::LogSink,
    )
    .await
    .unwrap_or_else(|e| panic!("sweep in batches of {batch_threads}: {e}"))
}

/// The summary without the fields that differ between any two runs.
fn counts(r: &Report) -> Value {
    let mut s = serde_json::to_value(&r.summary).unwrap();
    let s = s.as_object_mut().unwrap();
    s.remove("durationMs");
    s.remove("finishedAt");
    Value::Object(s.clone())
}

/// Copies thread `from` (its checkpoints, blobs and pending writes, as LangGraph wrote them)
/// to threads `{prefix}1`..`{prefix}n`: they hold the same handle.
async fn copy_thread(dsn: &str, from: &str, prefix: &str, n: i32) {
    use sqlx::Connection as _;
    let mut c = sqlx::PgConnection::connect(dsn).await.unwrap();
    for table in ["checkpoints", "checkpoint_blobs", "checkpoint_writes"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table}
             SELECT (jsonb_populate_record(NULL::{table},
                 to_jsonb(c) || jsonb_build_object('thread_id', $2 || g))).*
             FROM {table} c, generate_series(1, $3) g WHERE c.thread_id = $1"
        )))
        .bind(from)
        .bind(prefix)
        .bind(n)
        .execute(&mut c)
        .await
        .unwrap();
    }
}

fn row<'a>(r: &'a Report, thread: &str) -> &'a custody::sweep::Row {
    r.rows
        .iter()
        .find(|x| x.thread_id == thread)
        .unwrap_or_else(|| panic!("no row for {thread}"))
}

/// Acts in batches of 2 and checks: one row per thread, every gone/absent row acted on, one
/// new checkpoint per action; then a second sweep in batches acts on nothing.
async fn acts_once_per_thread(
    target: &custody::plan::Target,
    checkpoints: impl AsyncFn() -> i64,
) -> Report {
    let before = checkpoints().await;
    let acted = sweep(target, chrono::Utc::now(), true, 2).await;
    let mut threads = BTreeSet::new();
    let mut actions = 0;
    for r in &acted.rows {
        assert!(threads.insert(&r.thread_id), "{} has two rows", r.thread_id);
        let outcome = r.action.as_ref().map(|a| a.outcome.kind());
        match r.verdict {
            custody::domain::verdict::Verdict::Gone | custody::domain::verdict::Verdict::Absent => {
                assert!(
                    matches!(outcome, Some("reminted" | "escalated" | "failed")),
                    "{r:?}"
                );
                actions += 1;
            }
            _ => assert_eq!(outcome, None, "{r:?}"),
        }
    }
    assert!(actions >= 4, "{:?}", acted.rows);
    assert_eq!(
        checkpoints().await - before,
        actions,
        "one checkpoint appended per action"
    );
    let summed: u64 = acted.summary.actions.values().sum();
    assert_eq!(summed, actions as u64, "{:?}", acted.summary);

    let again = sweep(target, chrono::Utc::now(), true, 2).await;
    for r in &again.rows {
        let outcome = r.action.as_ref().map(|a| a.outcome.kind());
        assert!(matches!(outcome, None | Some("skipped")), "{r:?}");
    }
    assert_eq!(
        checkpoints().await - before,
        actions,
        "the second sweep wrote nothing"
    );
    acted
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_plan_probe_and_act_like_one_batch_postgres() {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("custody_batches").await;
    for prefix in ["a-", "b-", "c-"] {
        support::write_some_fixtures(&server.url(), Db::Postgres(&dsn), None, prefix);
    }
    // Threads sorting last that hold set a-'s expired and live baskets: in small batches they
    // come up batches after a-t-expired and a-t-live, whose probes decide them.
    copy_thread(&dsn, "a-t-expired", "z-expired-", 2).await;
    copy_thread(&dsn, "a-t-live", "z-live-", 2).await;
    let res = tempfile::tempdir().unwrap();
    support::act_resources(res.path(), &server.url(), "postgres", &dsn, "remint");
    let target = target(res.path());

    let now = chrono::Utc::now();
    let one = sweep(&target, now, false, 1000).await;
    assert_eq!(one.summary.parked_threads, 22, "{:?}", one.summary);
    let probed: BTreeSet<(&str, &str)> = one
        .rows
        .iter()
        .filter(|r| r.probed)
        .filter_map(|r| Some((r.handle_class.as_str(), r.handle.as_deref()?)))
        .collect();
    assert_eq!(
        one.summary.probes,
        probed.len() as u64,
        "one probe per handle"
    );
    for batch in [1, 2, 3] {
        let r = sweep(&target, now, false, batch).await;
        assert_eq!(
            serde_json::to_value(&r.rows).unwrap(),
            serde_json::to_value(&one.rows).unwrap(),
            "rows in batches of {batch}"
        );
        assert_eq!(counts(&r), counts(&one), "summary in batches of {batch}");
        assert_eq!(r.servers.len(), 1, "one connection per sweep");
        // The copies, in later batches, were decided by the first holder's probe.
        for (copy, first) in [("z-expired-2", "a-t-expired"), ("z-live-2", "a-t-live")] {
            let (c, f) = (row(&r, copy), row(&r, first));
            assert_eq!(c.handle, f.handle);
            assert!(c.probed, "{c:?}");
            assert_eq!((c.verdict, &c.reason), (f.verdict, &f.reason));
        }
    }
    assert_eq!(row(&one, "z-expired-1").verdict.as_str(), "gone");

    let acted = acts_once_per_thread(&target, async || {
        use sqlx::Connection as _;
        let mut c = sqlx::PgConnection::connect(&dsn).await.unwrap();
        sqlx::query_scalar("SELECT count(*) FROM checkpoints")
            .fetch_one(&mut c)
            .await
            .unwrap()
    })
    .await;
    // The copies of the expired thread share its handle but are threads of their own: each is
    // re-minted once, under its own idempotency key, so each gets a basket of its own.
    let minted: BTreeSet<String> = ["a-t-expired", "z-expired-1", "z-expired-2"]
        .iter()
        .map(|t| match &row(&acted, t).action.as_ref().unwrap().outcome {
            custody::sweep::act::Outcome::Reminted { handle, .. } => handle.clone(),
            other => panic!("{t}: {other:?}"),
        })
        .collect();
    assert_eq!(minted.len(), 3, "{minted:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn batches_act_once_per_thread_sqlite() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    for prefix in ["a-", "b-"] {
        support::write_some_fixtures(&server.url(), Db::Sqlite(&db), None, prefix);
    }
    let res = tempfile::tempdir().unwrap();
    let dsn = format!("sqlite://{}", db.display());
    support::act_resources(res.path(), &server.url(), "sqlite", &dsn, "escalate");
    let target = target(res.path());

    let now = chrono::Utc::now();
    let one = sweep(&target, now, false, 1000).await;
    let two = sweep(&target, now, false, 2).await;
    assert_eq!(
        serde_json::to_value(&two.rows).unwrap(),
        serde_json::to_value(&one.rows).unwrap()
    );
    assert_eq!(counts(&two), counts(&one));

    // SqliteSaver keeps its database in WAL mode, so custody's writer commits beside the open
    // scan of the next batches.
    acts_once_per_thread(&target, async || {
        use sqlx::Connection as _;
        let mut c = sqlx::SqliteConnection::connect(&dsn).await.unwrap();
        sqlx::query_scalar("SELECT count(*) FROM checkpoints")
            .fetch_one(&mut c)
            .await
            .unwrap()
    })
    .await;
}
