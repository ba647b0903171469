//! `--shard I/N`: shards of a store cover every parked thread exactly once (real LangGraph threads
//! in PostgreSQL and SQLite), PostgreSQL's SQL split equals custody's, and acting shards run side
//! by side without acting on a thread twice.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use custody::checkpoint::{Scanned, Shard, Store};
use custody::crd::Backend;
use futures::TryStreamExt;
use serde_json::Value;
use support::{BasketServer, Db, sweep_report};

/// Prefixes of the fixture sets written per database: 3 × 6 parked threads.
const PREFIXES: [&str; 3] = ["a-", "b-", "c-"];

fn write_threads(server: &BasketServer, db: &Db<'_>) -> BTreeSet<String> {
    let mut parked = BTreeSet::new();
    for prefix in PREFIXES {
        let db = match db {
            Db::Sqlite(p) => Db::Sqlite(p),
            Db::Postgres(u) => Db::Postgres(u),
        };
        let manifest = support::write_some_fixtures(&server.url(), db, None, prefix);
        for (id, t) in manifest["threads"].as_object().unwrap() {
            if t["parked"] == Value::Bool(true) {
                parked.insert(id.clone());
            }
        }
    }
    parked
}

async fn scan(store: &Store, shard: Shard) -> Vec<String> {
    let channels = vec!["basket".to_owned()];
    store
        .parked_threads_in(&channels, shard)
        .map_ok(|s| match s {
            Scanned::Parked(t) => t.thread_id,
            Scanned::Skipped(s) => panic!("fixture thread skipped: {s:?}"),
        })
        .try_collect()
        .await
        .unwrap()
}

/// For 1 to 4 shards: no thread in two shards, every parked thread in one, each shard's threads
/// the ones [`Shard::contains`] assigns to it.
async fn assert_cover(store: &Store, parked: &BTreeSet<String>) {
    let all = scan(store, Shard::ALL).await;
    assert_eq!(all.iter().cloned().collect::<BTreeSet<_>>(), *parked);
    for n in 1..=4 {
        let mut seen = BTreeSet::new();
        let mut sizes = Vec::new();
        for i in 0..n {
            let shard = Shard::new(i, n).unwrap();
            let ids = scan(store, shard).await;
            sizes.push(ids.len());
            for id in ids {
                assert!(shard.contains(&id), "{id} is not in shard {shard}");
                assert!(seen.insert(id.clone()), "{id} is in two of {n} shards");
            }
        }
        assert_eq!(
            seen, *parked,
            "{n} shards ({sizes:?}) cover the parked threads"
        );
    }
}

#[tokio::test]
async fn postgres_shards_cover_every_parked_thread_once() {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("custody_shards").await;
    let parked = write_threads(&server, &Db::Postgres(&dsn));
    assert_eq!(parked.len(), 18);
    let store = Store::connect(Backend::Postgres, &dsn).await.unwrap();
    assert_cover(&store, &parked).await;

    // The SQL expression PARKED_SQL filters with gives Shard::contains's split for any id.
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&dsn).await.unwrap();
    let ids: Vec<String> = (0..500)
        .map(|i| format!("{i:x}-thread-é-{}", "x".repeat(i % 7)))
        .collect();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT id, ('x' || encode(substr(sha256(convert_to(id, 'UTF8')), 1, 4), 'hex'))::bit(32)::bigint % 7
         FROM unnest($1::text[]) id",
    )
    .bind(&ids)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    for (id, index) in rows {
        let index = u32::try_from(index).unwrap();
        assert!(Shard::new(index, 7).unwrap().contains(&id), "{id}");
    }
}

#[tokio::test]
async fn sqlite_shards_cover_every_parked_thread_once() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    let parked = write_threads(&server, &Db::Sqlite(&db));
    assert_eq!(parked.len(), 18);
    let store = Store::connect(Backend::Sqlite, &format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    assert_cover(&store, &parked).await;
}

fn sweep(res: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_custody"));
    cmd.args(["sweep", "-o", "json", "-f"]).arg(res).args(extra);
    cmd
}

fn rows(report: &Value) -> Vec<Value> {
    report["stores"][0]["rows"].as_array().unwrap().clone()
}

#[tokio::test]
async fn acting_shards_side_by_side_act_once_per_thread() {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("custody_shards_act").await;
    let parked = write_threads(&server, &Db::Postgres(&dsn));
    let res = tempfile::tempdir().unwrap();
    support::act_resources(res.path(), &server.url(), "postgres", &dsn, "remint");

    // The CLI's shards together give the unsharded dry run's rows.
    let whole = rows(&sweep_report(
        &sweep(res.path(), &["--dry-run"]).output().unwrap(),
    ));
    let mut planned: Vec<Value> = Vec::new();
    for i in 0..2 {
        let shard = format!("{i}/2");
        planned.extend(rows(&sweep_report(
            &sweep(res.path(), &["--dry-run", "--shard", &shard])
                .output()
                .unwrap(),
        )));
    }
    let key = |r: &Value| r["thread_id"].as_str().unwrap().to_owned();
    let by_thread = |rs: &[Value]| {
        let mut v: Vec<(String, Value)> =
            rs.iter().map(|r| (key(r), r["verdict"].clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(by_thread(&planned), by_thread(&whole));
    assert_eq!(
        whole.iter().map(key).collect::<BTreeSet<_>>(),
        parked,
        "one row per parked thread"
    );

    // Both shards act at the same time: each takes its own shard's lock, neither is refused.
    let children: Vec<_> = (0..2)
        .map(|i| {
            sweep(res.path(), &["--apply", "--shard", &format!("{i}/2")])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let acted: Vec<Value> = children
        .into_iter()
        .flat_map(|c| rows(&sweep_report(&c.wait_with_output().unwrap())))
        .collect();
    let mut threads = BTreeSet::new();
    let mut reminted = 0;
    for r in &acted {
        assert!(threads.insert(key(r)), "{} acted on twice", key(r));
        let outcome = &r["action"]["outcome"];
        if r["verdict"] == "gone" || r["verdict"] == "absent" {
            assert_ne!(outcome, "planned", "{r}");
            let reason = r["action"]["reason"].as_str().unwrap_or_default();
            assert!(!reason.contains("another custody process"), "{r}");
        }
        reminted += usize::from(outcome == "reminted");
    }
    assert!(
        reminted >= 3,
        "one expired basket per fixture set: {acted:?}"
    );

    // A whole-store sweep afterwards finds the re-minted handles live and re-mints nothing.
    let after = sweep_report(&sweep(res.path(), &["--apply"]).output().unwrap());
    for r in rows(&after) {
        assert_ne!(r["action"]["outcome"], "reminted", "{r}");
    }
}
