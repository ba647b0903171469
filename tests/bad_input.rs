//! The bad-input matrix (issue 9, part 3): checkpoint rows and MCP replies custody cannot use.
//! Each gets a clear error naming the cause, is skipped without harm to the rest, and is counted.
//!
//! Bad checkpoint rows are real LangGraph rows (tests/py/order_graph.py writes `t-live`,
//! `t-expired`, `t-absent`), copied to new threads and corrupted in the database. One sweep over
//! the mixed store per backend, then an acting sweep over the same store:
//!
//! | row (thread) | corruption | SQLite | PostgreSQL |
//! |---|---|---|---|
//! | `bad-ext` | `basket` holds msgpack ext code 42 | skipped `decode`, channel `basket` | same |
//! | `bad-trunc` | truncated to half | skipped `decode` (the checkpoint document) | same, channel `basket` (the blob) |
//! | `bad-huge` | 64 MiB more: in the `basket` record (PostgreSQL), in the document (SQLite) | skipped `too_large`, not fetched | same, channel `basket` |
//! | `bad-huge-inline` | `basket` inline in the document as a string of 64 MiB (issue 17, item 6) | — (the document is bounded whole: `bad-huge`) | skipped `too_large` (the document; no part of it fetched) |
//! | `bad-huge-meta` | metadata of 64 MiB (valid JSON; issue 17, item 6) | skipped `too_large`, not fetched | same (its size as text measured only past 32 KiB stored) |
//! | `bad-types` | `channel_versions` is a string | skipped `decode` | same |
//! | `bad-version`, `bad-ts` | `channel_versions.basket` is `[1]`, `ts` a number (read from projected columns on PostgreSQL) | — | skipped `decode` |
//! | `bad-pickle` | serializer type `pickle` | skipped `unsupported_format` | same, channel `basket` |
//! | `bad-aes` | serializer type `msgpack+aes` (encrypted) | — (no per-value types) | skipped `unsupported_format`, channel `basket` |
//! | `bad-future` | checkpoint format `v: 5` | skipped `unsupported_format` | same |
//! | `bad-metadata` | metadata is a JSON array | skipped `decode` | same |
//! | `bad-utf8` | the handle string in `basket` is `bsk\xff…` (invalid UTF-8) | skipped `decode`, channel `basket` (never probed as `bsk\u{fffd}…`) | same |
//! | `bad-utf8-key` | the `channel_values` key `basket` is `b\xffsket` | skipped `decode` (not read as a missing channel) | — (JSONB is UTF-8) |
//! | `null-values` | LangGraph's `SqliteSaver.put` wrote the latest checkpoint with `channel_values` None (issue 17, item 3) | skipped `decode` (not an absent handle) | — (`PostgresSaver.put` refuses it) |
//! | `null-versions` | the saver's `put` wrote it with `channel_versions` None | skipped `decode` | skipped `decode` (was dropped: no row, no skip) |
//! | `old-v1` | format `v: 1` with `pending_sends` (and, PostgreSQL, a legacy `json` blob) | verdict `ok` | verdict `ok` |
//! | `old-json` | the latest document stored with serializer type `json` (legacy; SqliteSaver reads it) | verdict `ok` | — (the `json` blob of `old-v1`) |
//! | `other-ext` | ext code 42 in a channel no HandleClass reads | verdict `ok` | — (unread blobs are never fetched) |
//! | `t-live`, `t-expired`, `t-absent` | none | `ok`, `gone`, `absent` | same |
//!
//! Tests: [`sqlite_bad_rows_are_skipped_and_named`], [`postgres_bad_rows_are_skipped_and_named`]
//! (both also assert: the counts by reason in JSON and in the table, peak memory of the sweep
//! below the huge value's size, and that an acting sweep writes nothing to a bad thread while it
//! escalates the good ones).
//!
//! A SQLite file in WAL mode (SqliteSaver's), read by an observing sweep in
//! [`an_observing_sweep_writes_nothing_next_to_a_wal_database`] (issue 17, item 5):
//!
//! | file | writable directory | read-only mount |
//! |---|---|---|
//! | closed by its writer (no `-wal`, no `-shm`) | right verdicts, no file created (read immutable, checked unchanged after the scan) | same (was: SQLite code 14) |
//! | held open by a live SqliteSaver (`-wal`, `-shm`) | right verdicts through them, no file created | same |
//! | a copy with its `-wal` but no `-shm` | — | refused: why, and what to do (open and close it once, or sweep a copy in a writable directory) |
//!
//! Bad MCP replies come from tests/py/bad_reply_server.py, one process per case, next to the
//! real basket server; probes in [`bad_probe_replies_are_unknown_never_gone`] (one sweep, two
//! threads, every bad server a HandleClass of its own on the same `basket` channel), discovery
//! in [`bad_discovery_replies_are_named_errors`] (the library's category and `custody discover`):
//!
//! | case | probe (tools/call): verdict, `probeErrors` reason | discovery (tools/list): category |
//! |---|---|---|
//! | `wrong_id` (the result carries another request's id) | `unknown`, `protocol` | `protocol` |
//! | `unknown_content` (a block of a type the spec does not define) | `unknown`, `protocol` | — |
//! | `extra_content` (image, audio, resource_link, resource blocks; `_meta` and unknown fields) | `ok` | — |
//! | `huge_event` (one SSE event over 1 MiB) | `unknown`, `transport` | `transport` |
//! | `huge_body` (a JSON body over 1 MiB) | `unknown`, `too_large` | `too_large` |
//! | `invalid_utf8` (in a JSON body) | `unknown`, `protocol` | `protocol` |
//! | `invalid_utf8_sse` (in an SSE event) | `unknown`, `transport` | `transport` |
//! | `not_json` (an HTML page as application/json) | `unknown`, `protocol` | `protocol` |
//! | `not_json_sse` (SSE event data that is not JSON) | `unknown`, `protocol` | `protocol` |
//! | `string_id`, `error_event`, `unterminated_event` (tests/py/misbehaving_server.py; tests/strict_replies.rs, tests/discovery.rs) | `unknown`, `protocol` / `rpc_error` / `transport` | same |
//!
//! Lenient where the spec is extensible (extra fields, `_meta`, every defined block type: rmcp
//! accepts them and the probe succeeds), strict where the reply is broken. custody's HTTP client
//! under rmcp (src/mcp/strict.rs) sees each POST's reply first: an answer whose id is not exactly
//! the request's (type and value) and SSE event data that is not a JSON-RPC message are
//! `protocol` errors naming what was wrong; an SSE event over the size limit or with invalid
//! UTF-8 is still reported by rmcp only as a closed stream (`transport`, with a reason that says
//! what can cause it); a broken JSON body is parsed by rmcp, and its error names the cause and
//! position (custody drops the reply body rmcp quotes). In every probe case the basket server's
//! handles on the same threads keep their verdicts (`ok`, `gone`).

mod support;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use rmpv::Value as Mp;
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, Connection};
use support::{BasketServer, Db};

/// Size of the huge state: tens of MB, over custody's 16 MiB decode limit.
const HUGE: usize = 64 << 20;

/// Threads copied from `t-live` and corrupted, with what the report must say about each:
/// (thread, kind, channel named, fragment of the reason).
type Expect = (
    &'static str,
    &'static str,
    Option<&'static str>,
    &'static str,
);

fn mp_encode(v: &Mp) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn mp_map_get<'a>(map: &'a mut [(Mp, Mp)], key: &str) -> &'a mut Mp {
    &mut map
        .iter_mut()
        .find(|(k, _)| k.as_str() == Some(key))
        .unwrap_or_else(|| panic!("no key {key}"))
        .1
}

fn mp_map_set(map: &mut Vec<(Mp, Mp)>, key: &str, value: Mp) {
    match map.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
        Some((_, v)) => *v = value,
        None => map.push((Mp::from(key), value)),
    }
}

/// `bytes` with `from` replaced by `to` (same length) wherever it occurs; at least once. rmpv
/// cannot write invalid UTF-8 as a msgpack string (it writes such a value as binary), so the
/// corruption of issue 17, item 1 is made on the encoded bytes.
fn patch_bytes(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut hits = 0;
    let mut i = 0;
    while i + from.len() <= bytes.len() {
        if &bytes[i..i + from.len()] == from {
            bytes[i..i + from.len()].copy_from_slice(to);
            hits += 1;
            i += from.len();
        } else {
            i += 1;
        }
    }
    assert!(hits > 0, "{from:?} not found");
}

/// msgpack for one more map entry `"padding": <HUGE-byte str32 of x>`, without its data: the
/// data is made by the database (`repeat`, `zeroblob`), so this test process never holds it
/// and its own memory does not leak into the child's peak RSS (a spawned child inherits its
/// parent's high-water mark until exec).
fn padding_entry_header(str_marker: u8) -> Vec<u8> {
    let mut out = vec![0xa7];
    out.extend_from_slice(b"padding");
    out.push(str_marker);
    out.extend_from_slice(&u32::try_from(HUGE).unwrap().to_be_bytes());
    out
}

/// Runs the custody binary and returns (exit success, stdout, stderr, peak RSS in bytes),
/// measuring the child alone with wait4 (the test process's own memory is not counted).
#[expect(
    unsafe_code,
    reason = "wait4 is the only way to read a child's peak RSS"
)]
fn custody_measured(args: &[&str]) -> (bool, String, String, u64) {
    #[expect(
        clippy::zombie_processes,
        reason = "reaped by wait4 below, which also returns its resource usage"
    )]
    let mut child = Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run custody");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).unwrap();
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        stderr.read_to_string(&mut s).unwrap();
        s
    });
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    let mut status = 0;
    // SAFETY: rusage is plain data that wait4 fills in; the pid is our own unreaped child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals of the types wait4 writes.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid, "wait4");
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    // ru_maxrss is in KiB on Linux.
    let rss = u64::try_from(usage.ru_maxrss).unwrap() * 1024;
    (ok, out.join().unwrap(), err.join().unwrap(), rss)
}

fn sweep_args<'a>(dir: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["sweep", "-f", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    args
}

/// The checks shared by both backends: verdicts of the good threads, one skipped entry per bad
/// thread naming thread, checkpoint, channel and cause, the counts by reason, bounded memory.
fn check_report(dir: &Path, expect: &[Expect], good: &[(&str, &str)]) {
    let (ok, stdout, stderr, rss) =
        custody_measured(&sweep_args(dir, &["--dry-run", "-o", "json"]));
    assert!(ok, "sweep failed:\n{stdout}\n{stderr}");
    // The huge value is never fetched: the sweep's peak memory stays below its size.
    eprintln!("peak RSS of the sweep: {} MiB", rss >> 20);
    assert!(
        (rss as usize) < HUGE,
        "peak RSS {} MiB with a {} MiB value in the store",
        rss >> 20,
        HUGE >> 20
    );
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let store = &report["stores"][0];
    let verdicts = support::verdicts(&report);
    for (thread, verdict) in good {
        assert_eq!(
            verdicts[*thread].0, *verdict,
            "{thread}: {:?}",
            verdicts[*thread]
        );
    }
    assert_eq!(
        verdicts.len(),
        good.len(),
        "only good threads get rows: {verdicts:?}"
    );

    let skipped: BTreeMap<&str, &Value> = store["skipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["thread_id"].as_str().unwrap(), s))
        .collect();
    assert_eq!(
        skipped.keys().copied().collect::<Vec<_>>(),
        expect.iter().map(|e| e.0).collect::<Vec<_>>(),
        "{skipped:#?}"
    );
    let mut by_reason = BTreeMap::new();
    for (thread, kind, channel, fragment) in expect {
        let s = skipped[thread];
        assert_eq!(s["kind"], *kind, "{thread}: {s}");
        assert_eq!(s["channel"].as_str(), *channel, "{thread}: {s}");
        assert!(
            s["checkpoint_id"].as_str().is_some_and(|c| c.len() == 36),
            "{thread}: {s}"
        );
        let reason = s["reason"].as_str().unwrap();
        assert!(reason.contains(fragment), "{thread}: {reason}");
        assert!(
            reason.len() < 300,
            "{thread}: the reason is one line, not the row: {reason}"
        );
        // Said once, in the report: no log line at the default level says it again.
        assert!(
            !stderr.contains(thread),
            "{thread} logged besides:\n{stderr}"
        );
        *by_reason.entry(kind.to_string()).or_insert(0u64) += 1;
    }
    assert_eq!(store["summary"]["skippedThreads"], expect.len());
    assert_eq!(store["summary"]["skippedByReason"], json!(by_reason));

    // The table names the same, and counts by reason.
    let out = support::custody(&sweep_args(dir, &["--dry-run"]));
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for (thread, kind, channel, _) in expect {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("skipped thread {thread},")))
            .unwrap_or_else(|| panic!("no skipped line for {thread}:\n{text}"));
        assert!(line.contains(&format!(": {kind}: ")), "{line}");
        if let Some(channel) = channel {
            assert!(line.contains(&format!(", channel {channel}:")), "{line}");
        }
    }
    let counts = by_reason
        .iter()
        .map(|(k, n)| format!("{n} {k}"))
        .collect::<Vec<_>>()
        .join(", ");
    assert!(
        text.contains(&format!("{} skipped ({counts})", expect.len())),
        "{text}"
    );
}

/// After the acting sweep: the good threads that needed it got a new checkpoint, the bad ones
/// kept exactly the rows they had.
fn check_acting(
    dir: &Path,
    before: &BTreeMap<String, i64>,
    after: impl Fn() -> BTreeMap<String, i64>,
    expect: &[Expect],
) {
    let out = support::custody(&sweep_args(dir, &["--apply", "-o", "json"]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let store = &report["stores"][0];
    assert_eq!(store["skipped"].as_array().unwrap().len(), expect.len());
    assert_eq!(store["summary"]["actions"]["escalated"], 2, "{store}");
    let after = after();
    for (thread, ..) in expect {
        assert_eq!(before[*thread], after[*thread], "{thread} was written to");
    }
    for thread in ["t-expired", "t-absent"] {
        assert_eq!(after[thread], before[thread] + 1, "{thread} was escalated");
    }
}

// ------------------------------------------------------------------------------------ SQLite

async fn sqlite_copy_thread(conn: &mut sqlx::SqliteConnection, from: &str, to: &str) {
    for table in ["checkpoints", "writes"] {
        let columns: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT name FROM pragma_table_info('{table}')"
        )))
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        let select: Vec<&str> = columns
            .iter()
            .map(|c| if c == "thread_id" { "?" } else { c.as_str() })
            .collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} ({}) SELECT {} FROM {table} WHERE thread_id = ?",
            columns.join(", "),
            select.join(", ")
        )))
        .bind(to)
        .bind(from)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
}

/// Rewrites every checkpoint document of `thread` (the latest included) with `edit`.
async fn sqlite_edit_docs(
    conn: &mut sqlx::SqliteConnection,
    thread: &str,
    edit: impl Fn(&mut Vec<(Mp, Mp)>),
) {
    let rows: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT checkpoint_id, checkpoint FROM checkpoints WHERE thread_id = ?")
            .bind(thread)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    for (id, bytes) in rows {
        let Mp::Map(mut doc) = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap() else {
            panic!("checkpoint is not a map")
        };
        edit(&mut doc);
        sqlx::query(
            "UPDATE checkpoints SET checkpoint = ? WHERE thread_id = ? AND checkpoint_id = ?",
        )
        .bind(mp_encode(&Mp::Map(doc)))
        .bind(thread)
        .bind(id)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
}

/// Rewrites the bytes of the latest checkpoint document of `thread` with `patch`.
async fn sqlite_patch_latest(
    conn: &mut sqlx::SqliteConnection,
    thread: &str,
    patch: impl Fn(&mut Vec<u8>),
) {
    let (id, mut bytes): (String, Vec<u8>) = sqlx::query_as(
        "SELECT checkpoint_id, checkpoint FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = '' \
         ORDER BY checkpoint_id DESC LIMIT 1",
    )
    .bind(thread)
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    patch(&mut bytes);
    sqlx::query("UPDATE checkpoints SET checkpoint = ? WHERE thread_id = ? AND checkpoint_id = ?")
        .bind(bytes)
        .bind(thread)
        .bind(id)
        .execute(&mut *conn)
        .await
        .unwrap();
}

/// Adds a top-level `padding` entry of [`HUGE`] bytes (a bin32 of zeros) to every checkpoint
/// document of `thread`: the document is absurdly large, still valid msgpack. SQLite runs in
/// the process that opens the file, so the venv's Python does it (see [`padding_entry_header`]).
fn sqlite_make_huge(db: &Path, thread: &str) {
    let script = r#"
import sqlite3, sys
db, thread, entry, size = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4])
conn = sqlite3.connect(db)
for cid, head in conn.execute(
        "SELECT checkpoint_id, substr(checkpoint, 1, 1) FROM checkpoints WHERE thread_id = ?", (thread,)).fetchall():
    assert 0x80 <= head[0] < 0x8f, "a fixmap document"
    conn.execute(
        "UPDATE checkpoints SET checkpoint = CAST(? || substr(checkpoint, 2) || ? || zeroblob(?) AS BLOB)"
        " WHERE thread_id = ? AND checkpoint_id = ?", (bytes([head[0] + 1]), entry, size, thread, cid))
conn.commit()
"#;
    let out = Command::new(support::var("CUSTODY_TEST_PYTHON"))
        .args(["-c", script])
        .arg(db)
        .args([
            thread,
            &hex::encode(padding_entry_header(0xc6)),
            &HUGE.to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Has LangGraph's own saver (`SqliteSaver.put`, `PostgresSaver.put` of LangGraph 1.2.24) write
/// the latest checkpoint of `thread` again, same id, with `field` set to None (issue 17, item 3).
/// The savers store that as a null; LangGraph itself then cannot load the checkpoint.
fn langgraph_put_null(db: Db<'_>, thread: &str, field: &str) {
    let script = r#"
import sys
kind, target, thread, field = sys.argv[1:5]
if kind == "sqlite":
    from langgraph.checkpoint.sqlite import SqliteSaver as Saver
else:
    from langgraph.checkpoint.postgres import PostgresSaver as Saver
with Saver.from_conn_string(target) as saver:
    latest = saver.get_tuple({"configurable": {"thread_id": thread, "checkpoint_ns": ""}})
    checkpoint = dict(latest.checkpoint)
    checkpoint[field] = None
    saver.put(latest.parent_config, checkpoint, latest.metadata, {})
"#;
    let (kind, target) = match db {
        Db::Sqlite(p) => ("sqlite", p.to_str().unwrap().to_owned()),
        Db::Postgres(url) => ("postgres", url.to_owned()),
    };
    let out = Command::new(support::var("CUSTODY_TEST_PYTHON"))
        .args(["-c", script, kind, &target, thread, field])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Metadata of [`HUGE`] bytes, valid JSON text, for every checkpoint of `thread` (issue 17,
/// item 6); made by the venv's Python so the huge value never enters the test process (whose
/// size a spawned sweep's peak RSS could otherwise inherit), as in [`sqlite_make_huge`].
fn sqlite_make_huge_metadata(db: &Path, thread: &str) {
    let script = r#"
import sqlite3, sys
db, thread, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = sqlite3.connect(db)
conn.execute(
    "UPDATE checkpoints SET metadata = CAST('{\"source\": \"loop\", \"pad\": \"' || hex(zeroblob(?)) || '\"}' AS BLOB)"
    " WHERE thread_id = ?", (size // 2, thread))
conn.commit()
"#;
    let out = Command::new(support::var("CUSTODY_TEST_PYTHON"))
        .args(["-c", script])
        .arg(db)
        .args([thread, &HUGE.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn sqlite_exec(conn: &mut sqlx::SqliteConnection, sql: &str, thread: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .bind(thread)
        .execute(&mut *conn)
        .await
        .unwrap();
}

async fn sqlite_counts(db: &Path) -> BTreeMap<String, i64> {
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT thread_id, count(*) FROM checkpoints GROUP BY thread_id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    conn.close().await.unwrap();
    rows.into_iter().collect()
}

/// `-o json` spools skipped threads to a temporary file; a `TMPDIR` where none can be made
/// keeps them in memory (with a warning naming the directory) instead of cutting the report off.
#[tokio::test(flavor = "multi_thread")]
async fn skipped_threads_survive_a_tmpdir_that_does_not_exist() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_some_fixtures(&server.url(), Db::Sqlite(&db), Some("t-live,t-expired"), "");
    support::basket_resources(
        dir.path(),
        &server.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    sqlite_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = X'c1c1c1' WHERE thread_id = ?",
        "t-expired",
    )
    .await;
    conn.close().await.unwrap();
    let missing = dir.path().join("no-such-dir");
    let out = Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(sweep_args(dir.path(), &["--dry-run", "-o", "json"]))
        .env("TMPDIR", &missing)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&missing.display().to_string()) && stderr.contains("kept in memory"),
        "{stderr}"
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("a whole JSON document");
    let store = &report["stores"][0];
    assert_eq!(store["skipped"][0]["thread_id"], "t-expired", "{store:#}");
    assert_eq!(support::verdicts(&report)["t-live"].0, "ok");
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_bad_rows_are_skipped_and_named() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_some_fixtures(
        &server.url(),
        Db::Sqlite(&db),
        Some("t-live,t-expired,t-absent"),
        "",
    );
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    for copy in [
        "bad-ext",
        "bad-trunc",
        "bad-huge",
        "bad-huge-meta",
        "bad-types",
        "bad-pickle",
        "bad-future",
        "bad-metadata",
        "old-v1",
        "other-ext",
        "bad-utf8",
        "bad-utf8-key",
        "old-json",
        "null-values",
        "null-versions",
    ] {
        sqlite_copy_thread(&mut conn, "t-live", copy).await;
    }
    let values = |doc: &mut Vec<(Mp, Mp)>| -> Vec<(Mp, Mp)> {
        match mp_map_get(doc, "channel_values") {
            Mp::Map(m) => m.clone(),
            _ => panic!("channel_values"),
        }
    };
    sqlite_edit_docs(&mut conn, "bad-ext", |doc| {
        let mut v = values(doc);
        mp_map_set(&mut v, "basket", Mp::Ext(42, vec![0xc0]));
        mp_map_set(doc, "channel_values", Mp::Map(v));
    })
    .await;
    sqlite_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = substr(checkpoint, 1, length(checkpoint) / 2) WHERE thread_id = ?",
        "bad-trunc",
    )
    .await;
    sqlite_edit_docs(&mut conn, "bad-types", |doc| {
        mp_map_set(doc, "channel_versions", Mp::from("x"));
    })
    .await;
    sqlite_exec(
        &mut conn,
        "UPDATE checkpoints SET type = 'pickle' WHERE thread_id = ?",
        "bad-pickle",
    )
    .await;
    sqlite_edit_docs(&mut conn, "bad-future", |doc| {
        mp_map_set(doc, "v", Mp::from(5));
    })
    .await;
    sqlite_exec(
        &mut conn,
        "UPDATE checkpoints SET metadata = CAST('[1]' AS BLOB) WHERE thread_id = ?",
        "bad-metadata",
    )
    .await;
    sqlite_edit_docs(&mut conn, "old-v1", |doc| {
        mp_map_set(doc, "v", Mp::from(1));
        mp_map_set(doc, "pending_sends", Mp::Array(Vec::new()));
    })
    .await;
    // The `_` of every handle in the latest document replaced by 0xff (only the
    // `basket` channel is read, so copies elsewhere in the state do not matter).
    sqlite_patch_latest(&mut conn, "bad-utf8", |doc| {
        patch_bytes(doc, b"bsk_", b"bsk\xff");
    })
    .await;
    // The channel_values key `basket` itself corrupted (b\xffsket): looked up by name, the
    // channel would read as missing. Renamed first so channel_versions keeps its key.
    sqlite_edit_docs(&mut conn, "bad-utf8-key", |doc| {
        let mut v = values(doc);
        if let Some((key, _)) = v.iter_mut().find(|(k, _)| k.as_str() == Some("basket")) {
            *key = Mp::from("bASKET");
        }
        mp_map_set(doc, "channel_values", Mp::Map(v));
    })
    .await;
    sqlite_patch_latest(&mut conn, "bad-utf8-key", |doc| {
        patch_bytes(doc, b"\xa6bASKET", b"\xa6b\xffsket");
    })
    .await;
    // A legacy row: the latest document stored as serializer type `json` (SqliteSaver of
    // LangGraph 1.2.24 reads it through `loads_typed`).
    let (latest, bytes): (String, Vec<u8>) = sqlx::query_as(
        "SELECT checkpoint_id, checkpoint FROM checkpoints WHERE thread_id = 'old-json' \
         ORDER BY checkpoint_id DESC LIMIT 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let as_json = custody::checkpoint::serde::decode_typed("msgpack", Some(&bytes))
        .unwrap()
        .unwrap();
    sqlx::query("UPDATE checkpoints SET type = 'json', checkpoint = ? WHERE thread_id = 'old-json' AND checkpoint_id = ?")
        .bind(serde_json::to_vec(&as_json).unwrap())
        .bind(latest)
        .execute(&mut conn)
        .await
        .unwrap();
    sqlite_edit_docs(&mut conn, "other-ext", |doc| {
        let mut v = values(doc);
        mp_map_set(&mut v, "notes", Mp::Ext(42, vec![0xc0]));
        mp_map_set(doc, "channel_values", Mp::Map(v));
    })
    .await;
    conn.close().await.unwrap();
    sqlite_make_huge(&db, "bad-huge");
    sqlite_make_huge_metadata(&db, "bad-huge-meta");
    langgraph_put_null(Db::Sqlite(&db), "null-values", "channel_values");
    langgraph_put_null(Db::Sqlite(&db), "null-versions", "channel_versions");

    let dsn = format!("sqlite://{}", db.display());
    let res = tempfile::tempdir().unwrap();
    support::act_resources(res.path(), &server.url(), "sqlite", &dsn, "escalate");
    let expect: [Expect; 12] = [
        (
            "bad-ext",
            "decode",
            Some("basket"),
            "unknown msgpack ext code 42",
        ),
        (
            "bad-future",
            "unsupported_format",
            None,
            "format v5 is newer than v4",
        ),
        (
            "bad-huge",
            "too_large",
            None,
            "over custody's limit of 16777216 bytes",
        ),
        (
            "bad-huge-meta",
            "too_large",
            None,
            "the checkpoint metadata is 67108893 bytes, over custody's limit",
        ),
        (
            "bad-metadata",
            "decode",
            None,
            "metadata is not a JSON object",
        ),
        (
            "bad-pickle",
            "unsupported_format",
            None,
            "checkpoint serialized as pickle; custody reads msgpack and json",
        ),
        ("bad-trunc", "decode", None, "malformed msgpack"),
        (
            "bad-types",
            "decode",
            None,
            "channel_versions is not a map of versions",
        ),
        (
            "bad-utf8",
            "decode",
            Some("basket"),
            "a msgpack string is not valid UTF-8 (invalid byte at offset 3 of",
        ),
        (
            "bad-utf8-key",
            "decode",
            None,
            "a msgpack string is not valid UTF-8 (invalid byte at offset 1 of 6)",
        ),
        (
            "null-values",
            "decode",
            None,
            "channel_values is null (LangGraph cannot load such a checkpoint)",
        ),
        (
            "null-versions",
            "decode",
            None,
            "channel_versions is null (LangGraph cannot load such a checkpoint)",
        ),
    ];
    let good = [
        ("old-json", "ok"),
        ("old-v1", "ok"),
        ("other-ext", "ok"),
        ("t-absent", "absent"),
        ("t-expired", "gone"),
        ("t-live", "ok"),
    ];
    check_report(res.path(), &expect, &good);
    let before = sqlite_counts(&db).await;
    let after = || {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(sqlite_counts(&db))
        })
    };
    check_acting(res.path(), &before, after, &expect);
}

// -------------------------------------------------------------------------------- PostgreSQL

async fn pg_copy_thread(conn: &mut sqlx::PgConnection, from: &str, to: &str) {
    for table in ["checkpoints", "checkpoint_blobs", "checkpoint_writes"] {
        let columns: Vec<String> = sqlx::query_scalar(
            "SELECT column_name::text FROM information_schema.columns WHERE table_name = $1 ORDER BY ordinal_position",
        )
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        let select: Vec<&str> = columns
            .iter()
            .map(|c| if c == "thread_id" { "$1" } else { c.as_str() })
            .collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} ({}) SELECT {} FROM {table} WHERE thread_id = $2",
            columns.join(", "),
            select.join(", ")
        )))
        .bind(to)
        .bind(from)
        .execute(&mut *conn)
        .await
        .unwrap();
    }
}

async fn pg_exec(conn: &mut sqlx::PgConnection, sql: &str, thread: &str) {
    let done = sqlx::query(AssertSqlSafe(sql.to_owned()))
        .bind(thread)
        .execute(&mut *conn)
        .await
        .unwrap();
    assert!(done.rows_affected() > 0, "{sql} changed nothing");
}

async fn pg_counts(dsn: &str) -> BTreeMap<String, i64> {
    let mut conn = sqlx::PgConnection::connect(dsn).await.unwrap();
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT thread_id, count(*) FROM checkpoints GROUP BY thread_id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    conn.close().await.unwrap();
    rows.into_iter().collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_bad_rows_are_skipped_and_named() {
    let server = BasketServer::start(&[]);
    let dsn = support::fresh_pg_database("bad_input").await;
    support::write_some_fixtures(
        &server.url(),
        Db::Postgres(&dsn),
        Some("t-live,t-expired,t-absent"),
        "",
    );
    let mut conn = sqlx::PgConnection::connect(&dsn).await.unwrap();
    for copy in [
        "bad-ext",
        "bad-trunc",
        "bad-huge",
        "bad-huge-inline",
        "bad-huge-meta",
        "bad-types",
        "bad-pickle",
        "bad-aes",
        "bad-future",
        "bad-metadata",
        "bad-version",
        "bad-ts",
        "bad-utf8",
        "old-v1",
        "null-versions",
    ] {
        pg_copy_thread(&mut conn, "t-live", copy).await;
    }
    let basket = "UPDATE checkpoint_blobs SET {} WHERE thread_id = $1 AND channel = 'basket'";
    let blobs = |set: &str| basket.replace("{}", set);
    pg_exec(&mut conn, &blobs("blob = '\\xd42a00'::bytea"), "bad-ext").await;
    pg_exec(
        &mut conn,
        &blobs("blob = substring(blob from 1 for length(blob) / 2)"),
        "bad-trunc",
    )
    .await;
    // The record map gets one more entry, `padding`, a str32 of HUGE x's made by the server.
    sqlx::query(
        "UPDATE checkpoint_blobs
         SET blob = set_byte(blob, 0, get_byte(blob, 0) + 1) || $2 || convert_to(repeat('x', $3), 'UTF8')
         WHERE thread_id = $1 AND channel = 'basket'",
    )
    .bind("bad-huge")
    .bind(padding_entry_header(0xdb))
    .bind(i32::try_from(HUGE).unwrap())
    .execute(&mut conn)
    .await
    .unwrap();
    pg_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{channel_versions}', '\"x\"') WHERE thread_id = $1",
        "bad-types",
    )
    .await;
    // The handle channel's value inline in the document, HUGE bytes (issue 17, item 6).
    sqlx::query(
        "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{channel_values,basket}', to_jsonb(repeat('x', $2))) \
         WHERE thread_id = $1",
    )
    .bind("bad-huge-inline")
    .bind(i32::try_from(HUGE).unwrap())
    .execute(&mut conn)
    .await
    .unwrap();
    // Metadata of HUGE bytes (issue 17, item 6); TOAST compresses it to far less on disk.
    sqlx::query(
        "UPDATE checkpoints SET metadata = jsonb_build_object('source', 'loop', 'pad', repeat('x', $2)) \
         WHERE thread_id = $1",
    )
    .bind("bad-huge-meta")
    .bind(i32::try_from(HUGE).unwrap())
    .execute(&mut conn)
    .await
    .unwrap();
    // Well-shaped documents with one bad field the sweep reads: the reader takes these from
    // projected columns, not from the document, and must still refuse them.
    pg_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{channel_versions,basket}', '[1]') WHERE thread_id = $1",
        "bad-version",
    )
    .await;
    pg_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{ts}', '1700000000') WHERE thread_id = $1",
        "bad-ts",
    )
    .await;
    // The handle's `_` replaced by 0xff (`bsk\xff…`): the blob is msgpack, not UTF-8 text, so
    // PostgreSQL does not refuse it.
    pg_exec(
        &mut conn,
        &blobs(
            "blob = overlay(blob placing '\\xff'::bytea from position('bsk_'::bytea in blob) + 3 for 1)",
        ),
        "bad-utf8",
    )
    .await;
    pg_exec(&mut conn, &blobs("type = 'pickle'"), "bad-pickle").await;
    pg_exec(&mut conn, &blobs("type = 'msgpack+aes'"), "bad-aes").await;
    pg_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = jsonb_set(checkpoint, '{v}', '5') WHERE thread_id = $1",
        "bad-future",
    )
    .await;
    pg_exec(
        &mut conn,
        "UPDATE checkpoints SET metadata = '[1]'::jsonb WHERE thread_id = $1",
        "bad-metadata",
    )
    .await;
    // An older row: format v1 with pending_sends, the record as a legacy `json` blob.
    pg_exec(
        &mut conn,
        "UPDATE checkpoints SET checkpoint = checkpoint || '{\"v\": 1, \"pending_sends\": []}'::jsonb WHERE thread_id = $1",
        "old-v1",
    )
    .await;
    let record: Vec<u8> = sqlx::query_scalar(
        "SELECT blob FROM checkpoint_blobs WHERE thread_id = 'old-v1' AND channel = 'basket' LIMIT 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let as_json = custody::checkpoint::serde::decode_typed("msgpack", Some(&record))
        .unwrap()
        .unwrap();
    sqlx::query(
        "UPDATE checkpoint_blobs SET type = 'json', blob = $2 WHERE thread_id = $1 AND channel = 'basket'",
    )
    .bind("old-v1")
    .bind(serde_json::to_vec(&as_json).unwrap())
    .execute(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    // PostgresSaver.put refuses a null channel_values (it copies the map), so only this one.
    langgraph_put_null(Db::Postgres(&dsn), "null-versions", "channel_versions");

    let res = tempfile::tempdir().unwrap();
    support::act_resources(res.path(), &server.url(), "postgres", &dsn, "escalate");
    let expect: [Expect; 14] = [
        (
            "bad-aes",
            "unsupported_format",
            Some("basket"),
            "value is encrypted (msgpack+aes)",
        ),
        (
            "bad-ext",
            "decode",
            Some("basket"),
            "unknown msgpack ext code 42",
        ),
        (
            "bad-future",
            "unsupported_format",
            None,
            "format v5 is newer than v4",
        ),
        (
            "bad-huge",
            "too_large",
            Some("basket"),
            "over custody's limit of 16777216 bytes",
        ),
        (
            "bad-huge-inline",
            "too_large",
            None,
            "the checkpoint document is 671",
        ),
        (
            "bad-huge-meta",
            "too_large",
            None,
            "the checkpoint metadata is 67108893 bytes, over custody's limit",
        ),
        (
            "bad-metadata",
            "decode",
            None,
            "metadata is not a JSON object",
        ),
        (
            "bad-pickle",
            "unsupported_format",
            Some("basket"),
            "unsupported serializer type \"pickle\"",
        ),
        ("bad-trunc", "decode", Some("basket"), "malformed msgpack"),
        ("bad-ts", "decode", None, "ts is not a string"),
        (
            "bad-types",
            "decode",
            None,
            "channel_versions is not a map of versions",
        ),
        (
            "bad-utf8",
            "decode",
            Some("basket"),
            "a msgpack string is not valid UTF-8 (invalid byte at offset 3 of",
        ),
        (
            "bad-version",
            "decode",
            None,
            "channel_versions is not a map of versions",
        ),
        (
            "null-versions",
            "decode",
            None,
            "channel_versions is null (LangGraph cannot load such a checkpoint)",
        ),
    ];
    let good = [
        ("old-v1", "ok"),
        ("t-absent", "absent"),
        ("t-expired", "gone"),
        ("t-live", "ok"),
    ];
    check_report(res.path(), &expect, &good);
    let before = pg_counts(&dsn).await;
    let after = || {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(pg_counts(&dsn)))
    };
    check_acting(res.path(), &before, after, &expect);
}

// ------------------------------------------------------------------------------- MCP replies

/// tests/py/bad_reply_server.py with one case on one method; killed when dropped.
struct BadReplyServer {
    child: std::process::Child,
    port: u16,
}

impl BadReplyServer {
    fn start(case: &str, on: &str) -> Self {
        let port = support::free_port();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/bad_reply_server.py");
        let child = Command::new(support::var("CUSTODY_TEST_PYTHON"))
            .arg(script)
            .env("BAD_REPLY_PORT", port.to_string())
            .env("BAD_REPLY_CASE", case)
            .env("BAD_REPLY_ON", on)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start bad_reply_server.py");
        support::wait_for_port(port, std::time::Duration::from_secs(30));
        Self { child, port }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for BadReplyServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (case, verdict of the probe, failure category, fragment of the reason)
const PROBE_CASES: [(&str, &str, Option<&str>, &str); 9] = [
    (
        "wrong_id",
        "unknown",
        Some("protocol"),
        "tools/call failed: the reply carried JSON-RPC id 100",
    ),
    (
        "unknown_content",
        "unknown",
        Some("protocol"),
        "a content block type the protocol does not define",
    ),
    ("extra_content", "ok", None, "probe answered success"),
    (
        "huge_event",
        "unknown",
        Some("transport"),
        "closed without a response",
    ),
    (
        "huge_body",
        "unknown",
        Some("too_large"),
        "exceeded the maximum size of 1048576 bytes",
    ),
    (
        "invalid_utf8",
        "unknown",
        Some("protocol"),
        "invalid unicode code point at line 1 column 281 (reply body not shown)",
    ),
    (
        "invalid_utf8_sse",
        "unknown",
        Some("transport"),
        "closed without a response",
    ),
    (
        "not_json",
        "unknown",
        Some("protocol"),
        "expected value at line 1 column 1 (reply body not shown)",
    ),
    (
        "not_json_sse",
        "unknown",
        Some("protocol"),
        "an SSE event's data is not a JSON-RPC message: expected value at line 1 column 1",
    ),
];

#[test]
fn bad_probe_replies_are_unknown_never_gone() {
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
    let bad: Vec<BadReplyServer> = PROBE_CASES
        .iter()
        .map(|(case, ..)| BadReplyServer::start(case, "tools/call"))
        .collect();
    for ((case, ..), server) in PROBE_CASES.iter().zip(&bad) {
        support::basket_class_on(dir.path(), &case.replace('_', "-"), &server.url());
    }
    let started = std::time::Instant::now();
    let report = support::sweep_json(dir.path());
    let elapsed = started.elapsed();
    let rows = report["stores"][0]["rows"].as_array().unwrap();
    let row = |thread: &str, class: &str| {
        rows.iter()
            .find(|r| r["thread_id"] == thread && r["handle_class"] == class)
            .unwrap_or_else(|| panic!("no row {thread}/{class}"))
    };
    // The real server's handles on the same threads are unaffected.
    assert_eq!(row("t-live", "basket")["verdict"], "ok");
    assert_eq!(row("t-expired", "basket")["verdict"], "gone");
    let mut failures = BTreeMap::new();
    let mut report_lines = Vec::new();
    for (case, verdict, category, fragment) in PROBE_CASES {
        let class = case.replace('_', "-");
        for thread in ["t-live", "t-expired"] {
            let r = row(thread, &class);
            let reason = r["reason"].as_str().unwrap();
            let fine = r["verdict"] == verdict && reason.contains(fragment);
            report_lines.push(format!(
                "{} {case} {thread}: {} {reason}",
                if fine { "PASS" } else { "FAIL" },
                r["verdict"]
            ));
            if verdict == "unknown" {
                assert!(
                    reason.starts_with(&format!(
                        "probe failed: server {class}: tools/call failed: "
                    )),
                    "{case}: the reason names the server and the step: {reason}"
                );
                assert!(!reason.contains("WorkerTransport"), "{reason}");
            }
        }
        if let Some(category) = category {
            *failures.entry(category.to_owned()).or_insert(0u64) += 2;
        }
    }
    let text = report_lines.join("\n");
    assert!(!text.contains("FAIL"), "\n{text}");
    assert_eq!(
        report["stores"][0]["summary"]["probeErrors"],
        json!(failures)
    );
    assert!(
        elapsed < std::time::Duration::from_secs(20),
        "no bad reply costs more than its server's timeout: {elapsed:?}"
    );
}

/// (case, category, fragment of the error) when the bad reply answers `tools/list`.
const DISCOVERY_CASES: [(&str, &str, &str); 7] = [
    (
        "wrong_id",
        "protocol",
        "the reply carried JSON-RPC id 1002, not the request's id 2;",
    ),
    ("huge_event", "transport", "closed without a response"),
    (
        "huge_body",
        "too_large",
        "exceeded the maximum size of 1048576 bytes",
    ),
    (
        "invalid_utf8",
        "protocol",
        "invalid unicode code point at line 1 column 49 (reply body not shown)",
    ),
    ("invalid_utf8_sse", "transport", "closed without a response"),
    (
        "not_json",
        "protocol",
        "expected value at line 1 column 1 (reply body not shown)",
    ),
    (
        "not_json_sse",
        "protocol",
        "an SSE event's data is not a JSON-RPC message",
    ),
];

#[tokio::test(flavor = "multi_thread")]
async fn bad_discovery_replies_are_named_errors() {
    use custody::mcp::discovery::{self, DEFAULT_PAGE_CAP};
    let servers: Vec<BadReplyServer> = DISCOVERY_CASES
        .iter()
        .map(|(case, ..)| BadReplyServer::start(case, "tools/list"))
        .chain([BadReplyServer::start("ok", "tools/list")])
        .collect();
    let dir = tempfile::tempdir().unwrap();
    for ((case, category, fragment), server) in DISCOVERY_CASES.iter().zip(&servers) {
        let name = case.replace('_', "-");
        let cfg = custody::mcp::ServerConfig {
            name: name.clone(),
            url: server.url(),
            headers: vec![],
            timeout: std::time::Duration::from_secs(5),
            mode: custody::crd::ProtocolMode::Auto,
            max_response_bytes: custody::mcp::DEFAULT_MAX_RESPONSE_BYTES,
        };
        let e = discovery::discover(&cfg, &[], DEFAULT_PAGE_CAP)
            .await
            .err()
            .unwrap_or_else(|| panic!("{case}: discovery succeeded"));
        assert_eq!(e.category(), *category, "{case}: {e}");
        let message = e.to_string();
        assert!(
            message.starts_with(&format!("server {name}: tools/list failed: "))
                && message.contains(fragment),
            "{case}: {message}"
        );
        support::write_file(
            dir.path(),
            &format!("{name}.yaml"),
            &format!(
                "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: {name}}}\n\
                 spec: {{url: \"{}\", timeoutSeconds: 5}}\n",
                server.url()
            ),
        );
    }
    // The CLI: every bad server is a named error, the good one is listed, exit status 1.
    support::write_file(
        dir.path(),
        "ok.yaml",
        &format!(
            "apiVersion: custody.dev/v1alpha1\nkind: MCPServer\nmetadata: {{name: good}}\n\
             spec: {{url: \"{}\", timeoutSeconds: 5}}\n",
            servers.last().unwrap().url()
        ),
    );
    let out = support::custody(&["discover", "-f", dir.path().to_str().unwrap(), "-o", "json"]);
    assert_eq!(out.status.code(), Some(1));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let errors: BTreeMap<&str, &Value> = doc["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), &s["error"]))
        .collect();
    assert!(errors["good"].is_null(), "{doc}");
    for (case, _, fragment) in DISCOVERY_CASES {
        let error = errors[case.replace('_', "-").as_str()].as_str().unwrap();
        assert!(error.contains(fragment), "{case}: {error}");
    }
}

// ------------------------------------------------------------------------ threads without the channel

/// Two parked threads of a second real LangGraph graph whose state declares `basket` but never
/// wrote it (the graph parks before minting): `early` run with `graph_id: orders`, `notes`
/// with `graph_id: notes` (LangGraph copies scalar `configurable` entries into the checkpoint
/// metadata).
fn write_threads_without_basket(db: &Path) {
    let script = r#"
import sys
from typing import TypedDict
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, StateGraph
from langgraph.types import interrupt

class State(TypedDict, total=False):
    basket: dict | None
    text: str

def ask(state: State) -> State:
    interrupt("which basket?")
    return {}

with SqliteSaver.from_conn_string(sys.argv[1]) as saver:
    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    graph = builder.compile(checkpointer=saver)
    for thread, graph_id in (("early", "orders"), ("notes", "notes")):
        graph.invoke({"text": "hi"}, {"configurable": {"thread_id": thread, "graph_id": graph_id}})
"#;
    let out = Command::new(support::var("CUSTODY_TEST_PYTHON"))
        .args(["-c", script])
        .arg(db)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 17, item 3: a parked thread whose state never had the HandleClass's channel is never
/// dropped silently. Without `appliesTo` it is counted as `notApplicable: no_channel` (JSON and
/// table); with `appliesTo.everyParkedThread` it is `absent`; with `appliesTo.metadata` it is
/// `absent` when the metadata matches and counted as `metadata` when not.
#[test]
fn threads_without_the_channel_are_counted_or_absent() {
    use support::fixtures::{merged, object, observing_basket_class, write_resources};
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_some_fixtures(&server.url(), Db::Sqlite(&db), Some("t-live"), "");
    write_threads_without_basket(&db);
    let res = tempfile::tempdir().unwrap();
    let dsn = format!("sqlite://{}", db.display());
    support::basket_resources(res.path(), &server.url(), "auto", "sqlite", &dsn);

    let sweep = |applies_to: Option<Value>| {
        let mut class = observing_basket_class();
        if let Some(applies_to) = applies_to {
            class = merged(class, json!({"appliesTo": applies_to}));
        }
        write_resources(
            res.path(),
            "class.yaml",
            &[object("HandleClass", "basket", class)],
        );
        let report = support::sweep_json(res.path());
        let summary = report["stores"][0]["summary"].clone();
        (support::verdicts(&report), summary)
    };
    let verdict = |v: &BTreeMap<String, (String, String)>, t: &str| v.get(t).map(|r| r.0.clone());

    let (v, summary) = sweep(None);
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(verdict(&v, "t-live").as_deref(), Some("ok"));
    assert_eq!(summary["parkedThreads"], 3, "{summary}");
    assert_eq!(
        summary["notApplicable"],
        json!({"no_channel": 2}),
        "{summary}"
    );
    let out = support::custody(&sweep_args(res.path(), &["--dry-run"]));
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("3 parked threads, 1 handles: 1 ok")
            && text.contains(", 2 not applicable (2 no_channel),"),
        "{text}"
    );

    let (v, summary) = sweep(Some(json!({"everyParkedThread": true})));
    assert_eq!(verdict(&v, "t-live").as_deref(), Some("ok"));
    assert_eq!(verdict(&v, "early").as_deref(), Some("absent"));
    assert_eq!(verdict(&v, "notes").as_deref(), Some("absent"));
    assert_eq!(summary["absent"], 2, "{summary}");
    assert!(summary.get("notApplicable").is_none(), "{summary}");

    let (v, summary) = sweep(Some(json!({"metadata": {"graph_id": "orders"}})));
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(verdict(&v, "early").as_deref(), Some("absent"));
    // t-live carries no graph_id, notes another one.
    assert_eq!(
        summary["notApplicable"],
        json!({"metadata": 2}),
        "{summary}"
    );

    // Both fields, or neither, is refused before a sweep, naming the field.
    write_resources(
        res.path(),
        "class.yaml",
        &[object(
            "HandleClass",
            "basket",
            merged(
                observing_basket_class(),
                json!({"appliesTo": {"everyParkedThread": true, "metadata": {"graph_id": "orders"}}}),
            ),
        )],
    );
    let out = support::custody(&sweep_args(res.path(), &["--dry-run"]));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("spec.appliesTo")
            && stderr.contains("exactly one of everyParkedThread: true or a non-empty metadata"),
        "{stderr}"
    );
}

/// SqliteSaver's file `checkpoints.sqlite`, written by real LangGraph (threads `t-live` and
/// `t-expired`, their handles minted by `basket`) and closed, alone in a directory of its own:
/// the directory's guard, its canonical path and the file's.
fn closed_sqlite_checkpoints(
    basket: &BasketServer,
) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().canonicalize().unwrap();
    let db = dir.join("checkpoints.sqlite");
    support::write_some_fixtures(&basket.url(), Db::Sqlite(&db), Some("t-live,t-expired"), "");
    assert_eq!(listing(&dir), ["checkpoints.sqlite"], "the writer closed");
    (data, dir, db)
}

/// The names of the files in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// `custody ARGS…` with `dir` mounted read-only (a private mount namespace: as root or in a
/// user namespace, so the check holds for root too, which a chmod would not stop).
fn custody_with_read_only(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new("unshare")
        .args(["--map-root-user", "--mount", "sh", "-c"])
        .arg(r#"mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && shift && exec "$@""#)
        .arg(dir)
        .arg("-")
        .arg(env!("CARGO_BIN_EXE_custody"))
        .args(args)
        .output()
        .expect("run unshare (util-linux)")
}

/// thread → verdict of a sweep's JSON output, which must have succeeded.
fn sweep_verdicts(out: &std::process::Output) -> BTreeMap<String, String> {
    assert!(
        out.status.success(),
        "custody sweep failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("sweep JSON");
    support::verdicts(&report)
        .into_iter()
        .map(|(thread, (verdict, _))| (thread, verdict))
        .collect()
}

/// Issue 17, item 5: an observing sweep writes nothing next to the user's SQLite file. LangGraph's
/// SqliteSaver keeps its database in WAL mode; SQLite's read-only open of such a file with no
/// connection on it creates `-wal` and `-shm` beside it (and leaves them), and on a read-only
/// directory fails with code 14. Real LangGraph files throughout: closed by their writer, in a
/// writable and in a read-only directory; held open by a live SqliteSaver (its `-wal` and
/// `-shm` present), also read-only; and a copy with the `-wal` but no `-shm`, which SQLite
/// cannot read without writing: an error saying why and what to do.
#[test]
fn an_observing_sweep_writes_nothing_next_to_a_wal_database() {
    let basket = BasketServer::start(&[]);
    let data = tempfile::tempdir().unwrap();
    let db = data.path().join("checkpoints.sqlite");
    support::write_some_fixtures(&basket.url(), Db::Sqlite(&db), Some("t-live,t-expired"), "");
    let header = std::fs::read(&db).unwrap();
    assert_eq!(
        (header[18], header[19]),
        (2, 2),
        "SqliteSaver's file is in WAL mode"
    );
    assert_eq!(
        listing(data.path()),
        ["checkpoints.sqlite"],
        "the writer closed"
    );
    let res = tempfile::tempdir().unwrap();
    support::basket_resources(
        res.path(),
        &basket.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", db.display()),
    );
    let r = res.path().to_str().unwrap();
    let sweep = ["sweep", "--dry-run", "-o", "json", "-f", r];
    let want: BTreeMap<String, String> = [("t-expired", "gone"), ("t-live", "ok")]
        .into_iter()
        .map(|(t, v)| (t.to_owned(), v.to_owned()))
        .collect();

    // Closed by its writer, in a writable directory and mounted read-only.
    assert_eq!(sweep_verdicts(&support::custody(&sweep)), want);
    assert_eq!(
        listing(data.path()),
        ["checkpoints.sqlite"],
        "nothing beside it"
    );
    assert_eq!(
        sweep_verdicts(&custody_with_read_only(data.path(), &sweep)),
        want
    );
    assert_eq!(listing(data.path()), ["checkpoints.sqlite"]);

    // Held open by a live SqliteSaver: its -wal and -shm are there, and are what SQLite reads
    // through (the writer's index); nothing new appears, read-only too.
    let mut writer = Command::new(support::var("CUSTODY_TEST_PYTHON"))
        .args([
            "-c",
            "import sys\n\
             from langgraph.checkpoint.sqlite import SqliteSaver\n\
             with SqliteSaver.from_conn_string(sys.argv[1]) as saver:\n\
             \x20   saver.setup()\n\
             \x20   list(saver.list(None, limit=1))\n\
             \x20   print('open', flush=True)\n\
             \x20   sys.stdin.read()\n",
        ])
        .arg(&db)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = [0u8; 5];
    writer
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut line)
        .unwrap();
    assert_eq!(&line, b"open\n");
    let open = [
        "checkpoints.sqlite",
        "checkpoints.sqlite-shm",
        "checkpoints.sqlite-wal",
    ];
    assert_eq!(listing(data.path()), open);
    assert_eq!(sweep_verdicts(&support::custody(&sweep)), want);
    assert_eq!(
        sweep_verdicts(&custody_with_read_only(data.path(), &sweep)),
        want
    );
    assert_eq!(listing(data.path()), open);

    // A copy of the file and its -wal without the -shm: refused, saying why and what to do.
    let copy = tempfile::tempdir().unwrap();
    for name in ["checkpoints.sqlite", "checkpoints.sqlite-wal"] {
        std::fs::copy(data.path().join(name), copy.path().join(name)).unwrap();
    }
    drop(writer.stdin.take());
    assert!(writer.wait().unwrap().success());
    let copied = copy.path().join("checkpoints.sqlite");
    support::basket_resources(
        res.path(),
        &basket.url(),
        "auto",
        "sqlite",
        &format!("sqlite://{}", copied.display()),
    );
    let out = custody_with_read_only(copy.path(), &sweep);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("is in WAL mode and has a")
            && text.contains("but no")
            && text.contains("-shm: SQLite cannot read it without creating the -shm next to it")
            && text.contains("copy the file and its -wal"),
        "{text}"
    );
    assert_eq!(
        listing(copy.path()),
        ["checkpoints.sqlite", "checkpoints.sqlite-wal"]
    );
}

/// `custody ARGS…` with `dir` mounted read-only but its file `name` writable (a bind mount of
/// `writable`, a hard link to it elsewhere), as [`custody_with_read_only`] does it.
fn custody_with_read_only_dir(
    dir: &Path,
    name: &str,
    writable: &Path,
    args: &[&str],
) -> std::process::Output {
    Command::new("unshare")
        .args(["--map-root-user", "--mount", "sh", "-c"])
        .arg(
            r#"mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && mount --bind "$2" "$0/$1" && shift 3 && exec "$@""#,
        )
        .arg(dir)
        .arg(name)
        .arg(writable)
        .arg("-")
        .arg(env!("CARGO_BIN_EXE_custody"))
        .args(args)
        .output()
        .expect("run unshare (util-linux)")
}

/// Tables custody created in the SQLite file at `db`.
async fn custody_tables(db: &Path) -> i64 {
    let mut conn = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let n = sqlx::query_scalar(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name LIKE 'custody%'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    n
}

/// An acting sweep (`--apply`, `mode: act`) on SqliteSaver's WAL-mode file, closed by its writer:
/// - mounted read-only, or in a read-only directory, or with another process's write
///   transaction open: refused naming the file or directory and the cause, nothing written and
///   nothing left beside it (it was `ledger migration: while executing migrations: error
///   returned from database: (code: 8) attempt to write a readonly database`, or `(code: 14)
///   unable to open database file`, or `(code: 5) database is locked` after sqlx's
///   slow-statement dump, and a read-only file got a `-wal` and `-shm` it kept);
/// - otherwise it acts and closes its connections, so SQLite folds the `-wal` back and removes it
///   and the `-shm` (they stayed, holding custody's writes: the file alone lacked them); the
///   lock file stays (README "Database privileges");
/// - while a live SqliteSaver holds the file open, it acts beside it and leaves the writer's
///   `-wal` and `-shm`, and the writer goes on writing, then folds them back when it closes.
#[tokio::test(flavor = "multi_thread")]
async fn an_acting_sweep_leaves_a_wal_database_as_it_found_it() {
    let basket = BasketServer::start(&[]);
    let (_data, dir, db) = closed_sqlite_checkpoints(&basket);
    let res = tempfile::tempdir().unwrap();
    support::act_resources(
        res.path(),
        &basket.url(),
        "sqlite",
        &format!("sqlite://{}", db.display()),
        "escalate",
    );
    let r = res.path().to_str().unwrap();
    let apply = ["sweep", "--apply", "-o", "json", "-f", r];
    let refused = |out: &std::process::Output, why: &str| {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert_eq!(
            stderr.trim_end(),
            format!(
                "error: store default/orders: the checkpoint database refuses writes ({why}): \
                 custody cannot act on it and wrote nothing; an observing sweep still works"
            )
        );
    };

    refused(
        &custody_with_read_only(&dir, &apply),
        &format!("{} cannot be written: Read-only file system", db.display()),
    );
    assert_eq!(listing(&dir), ["checkpoints.sqlite"]);

    let elsewhere = tempfile::tempdir().unwrap();
    let link = elsewhere.path().join("checkpoints.sqlite");
    std::fs::hard_link(&db, &link).unwrap();
    refused(
        &custody_with_read_only_dir(&dir, "checkpoints.sqlite", &link, &apply),
        &format!(
            "{}, the directory SQLite creates the database's journal or -wal in, cannot be \
             written: Read-only file system",
            dir.display()
        ),
    );
    assert_eq!(listing(&dir), ["checkpoints.sqlite"]);

    // Another process's write transaction, held past custody's 10 s wait.
    let mut holder = sqlx::SqliteConnection::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    sqlx::query("BEGIN EXCLUSIVE")
        .execute(&mut holder)
        .await
        .unwrap();
    let out = support::custody(&apply);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!(
            "error: store default/orders: the checkpoint database {} stayed locked by another \
             process's write transaction for 10 s (SQLITE_BUSY): custody wrote nothing; run the \
             sweep again once that process has committed",
            db.display()
        )
    );
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    holder.close().await.unwrap();
    assert_eq!(listing(&dir), ["checkpoints.sqlite"]);
    assert_eq!(custody_tables(&db).await, 0, "custody wrote nothing");
    assert_eq!(listing(&dir), ["checkpoints.sqlite"]);

    // Acting: the -wal is folded back when custody's connections close.
    let out = support::custody(&apply);
    let report = support::sweep_report(&out);
    let expired = report["stores"][0]["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["thread_id"] == "t-expired")
        .unwrap();
    assert_eq!(
        (&expired["verdict"], &expired["action"]["outcome"]),
        (&json!("gone"), &json!("escalated")),
        "{expired:#}"
    );
    assert_eq!(
        listing(&dir),
        ["checkpoints.sqlite", "checkpoints.sqlite-custody.lock"]
    );
    let copy = tempfile::tempdir().unwrap();
    std::fs::copy(&db, copy.path().join("checkpoints.sqlite")).unwrap();
    assert!(
        custody_tables(&copy.path().join("checkpoints.sqlite")).await >= 3,
        "custody's writes are in the file itself"
    );

    // Beside a live SqliteSaver: its -wal and -shm stay theirs, and it goes on writing.
    let mut writer = Command::new(support::var("CUSTODY_TEST_PYTHON"))
        .args([
            "-c",
            "import sys\n\
             from langgraph.checkpoint.base import empty_checkpoint\n\
             from langgraph.checkpoint.sqlite import SqliteSaver\n\
             with SqliteSaver.from_conn_string(sys.argv[1]) as saver:\n\
             \x20   saver.setup()\n\
             \x20   list(saver.list(None, limit=1))\n\
             \x20   print('open', flush=True)\n\
             \x20   sys.stdin.readline()\n\
             \x20   config = {'configurable': {'thread_id': 'after', 'checkpoint_ns': ''}}\n\
             \x20   saver.put(config, empty_checkpoint(), {}, {})\n\
             \x20   assert saver.get_tuple({'configurable': {'thread_id': 'after'}})\n\
             \x20   print('wrote', flush=True)\n",
        ])
        .arg(&db)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut said = [0u8; 5];
    let stdout = writer.stdout.as_mut().unwrap();
    stdout.read_exact(&mut said).unwrap();
    assert_eq!(&said, b"open\n");
    let open = [
        "checkpoints.sqlite",
        "checkpoints.sqlite-custody.lock",
        "checkpoints.sqlite-shm",
        "checkpoints.sqlite-wal",
    ];
    assert_eq!(listing(&dir), open);
    let out = support::custody(&apply);
    support::sweep_report(&out);
    assert_eq!(listing(&dir), open, "the writer's files stay");
    std::io::Write::write_all(writer.stdin.as_mut().unwrap(), b"go\n").unwrap();
    let mut said = [0u8; 6];
    writer
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut said)
        .unwrap();
    assert_eq!(&said, b"wrote\n");
    drop(writer.stdin.take());
    assert!(writer.wait().unwrap().success());
    assert_eq!(
        listing(&dir),
        ["checkpoints.sqlite", "checkpoints.sqlite-custody.lock"]
    );
}

/// SIGTERM during an acting sweep on SqliteSaver's file, closed by its writer: the sweep stops
/// at once (exit 143, saying so) and still closes its SQLite connections, so SQLite folds the
/// `-wal` back and removes it and the `-shm` (README "Database privileges": an acting sweep
/// leaves no `-wal` or `-shm` where there was none). Before, the signal's `exit` left both beside
/// the file. Here the sweep waits on an MCP server that accepts the connection and never answers,
/// its pools open.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_during_an_acting_sweep_leaves_no_wal() {
    let basket = BasketServer::start(&[]);
    let (_data, dir, db) = closed_sqlite_checkpoints(&basket);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let res = tempfile::tempdir().unwrap();
    support::act_resources(
        res.path(),
        &format!("http://{}/mcp", silent.local_addr().unwrap()),
        "sqlite",
        &format!("sqlite://{}", db.display()),
        "escalate",
    );
    let child = Command::new(env!("CARGO_BIN_EXE_custody"))
        .args(["sweep", "--apply", "-f", res.path().to_str().unwrap()])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let waited = std::time::Instant::now();
    while !listing(&dir).contains(&"checkpoints.sqlite-wal".to_owned()) {
        assert!(
            waited.elapsed() < std::time::Duration::from_secs(20),
            "the acting sweep never opened the database: {:?}",
            listing(&dir)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // The probe is in flight (its server never answers).
    std::thread::sleep(std::time::Duration::from_millis(500));
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(
        stderr.starts_with("error: stopped by SIGTERM after ")
            && stderr.ends_with(
                " s, before the sweep finished; an action it was taking is settled by the next sweep\n"
            ),
        "{stderr}"
    );
    assert_eq!(
        listing(&dir),
        ["checkpoints.sqlite", "checkpoints.sqlite-custody.lock"]
    );
    drop(silent);
}

/// A PostgreSQL database whose LangGraph migrations are missing or old is refused with the
/// migration it holds in words, never Rust's `None`/`Some(1)`.
#[tokio::test(flavor = "multi_thread")]
async fn an_old_checkpoint_schema_is_named_in_words() {
    let dsn = support::fresh_pg_database("oldschema").await;
    let mut conn = sqlx::PgConnection::connect(&dsn).await.unwrap();
    sqlx::query("CREATE TABLE checkpoint_migrations (v INTEGER PRIMARY KEY)")
        .execute(&mut conn)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    support::offline_basket_resources(dir.path(), "postgres", &dsn);
    let args = ["sweep", "--dry-run", "-f", dir.path().to_str().unwrap()];
    for (setup, want) in [
        (
            "",
            "checkpoint_migrations records no LangGraph migration, older than",
        ),
        (
            "INSERT INTO checkpoint_migrations VALUES (0), (1)",
            "the latest LangGraph checkpoint migration recorded is 1, older than",
        ),
    ] {
        if !setup.is_empty() {
            sqlx::query(setup).execute(&mut conn).await.unwrap();
        }
        let out = support::custody(&args);
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(!out.status.success(), "{err}");
        assert!(err.contains(want), "{err}");
        assert!(!err.contains("None") && !err.contains("Some("), "{err}");
    }
}
