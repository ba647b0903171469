//! `custody sweep --apply` end to end: real LangGraph threads (SQLite and PostgreSQL), the real
//! basket MCP server, the real binary. Re-mint and replay, escalate, a thread that moves under
//! custody, and `kill -9` of the sweeper at every step of a re-mint (failpoints: run with
//! `--features failpoints`, as tests/run.sh does).

mod support;

use serde_json::{Value, json};
use support::checkpoints::Kind;
#[cfg(feature = "failpoints")]
use support::failpoint::Stopped;
use support::world::{World, row};
use support::{BasketServer, Db};

/// The server of every world here: handles die only when a test deletes them. The kill -9 suite
/// runs for many minutes on a busy machine, and baskets expiring by the default inactivity TTL
/// (600 s) were re-minted by later runs and counted as extra mints.
const SERVER: &[(&str, &str)] = &[("BASKET_TTL_SECONDS", "86400")];

impl World {
    fn db(&self) -> Db<'_> {
        self.checkpoints.db()
    }

    fn write(&self, only: &str, prefix: &str) {
        support::write_some_fixtures(&self.server.url(), self.db(), Some(only), prefix);
    }

    fn resume(&self, thread: &str, value: &Value) -> Value {
        self.checkpoints.resume(&self.server.url(), thread, value)
    }

    fn state(&self, thread: &str) -> Value {
        self.checkpoints.state(thread)
    }

    /// The arguments of [`World::sweep`], for the failpoint runner.
    #[cfg(feature = "failpoints")]
    fn args(&self) -> Vec<String> {
        ["sweep", "--apply", "-o", "json", "-f"]
            .into_iter()
            .map(str::to_owned)
            .chain([self.res.path().display().to_string()])
            .collect()
    }

    async fn call(&self, tool: &str, arguments: Value) -> Value {
        support::call(&self.server.url(), tool, arguments).await
    }

    /// Baskets ever created on the server.
    async fn baskets(&self) -> u64 {
        support::baskets(&self.server.url()).await
    }

    /// MCP sessions opened on the server so far, this reading's own included.
    async fn sessions(&self) -> u64 {
        support::sessions(&self.server.url()).await
    }

    /// (sku, qty) of a live basket.
    async fn items(&self, basket: &str) -> Vec<(String, u64)> {
        support::items(&self.server.url(), basket).await
    }

    /// Ledger entries that are not done.
    async fn unsettled(&self) -> i64 {
        self.checkpoints.unsettled().await
    }

    /// Ledger outcomes of one thread.
    async fn outcomes(&self, thread: &str) -> Vec<String> {
        self.checkpoints.outcomes(thread).await
    }

    /// A parked thread with two recorded items whose basket was then deleted on the server.
    async fn filled_and_gone(&self, prefix: &str) -> (String, String) {
        let old = self.checkpoints.filled(&self.server.url(), prefix);
        self.call("delete_basket", json!({"basket_id": old})).await;
        (format!("{prefix}t-live"), old)
    }
}

async fn remint_case(kind: Kind) {
    let w = World::new(kind, "act_remint", "remint", SERVER).await;
    let (thread, old) = w.filled_and_gone("").await;
    let before = w.baskets().await;
    let sessions = w.sessions().await;

    let report = w.sweep(true);
    // One session per server per sweep (mcp::Sessions): the probes, the mint and both replays
    // share the probes' session; the second +1 is the reading's own.
    assert_eq!(
        w.sessions().await,
        sessions + 2,
        "the sweep opened one session on its server"
    );
    let r = row(&report, &thread);
    assert_eq!(r["verdict"], "gone", "{r}");
    assert_eq!(r["action"]["plan"], "remint", "{r}");
    assert_eq!(r["action"]["outcome"], "reminted", "{r}");
    assert_eq!(r["action"]["replayed"], 2, "{r}");
    let new = r["action"]["handle"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    assert_eq!(w.baskets().await, before + 1, "exactly one new basket");
    assert_eq!(
        w.items(&new).await,
        vec![("gadget".to_owned(), 1), ("widget".to_owned(), 2)],
        "the recorded items are replayed onto the new basket"
    );

    // LangGraph sees the new handle, still waiting in add_item with its interrupt.
    let state = w.state(&thread);
    let basket = &state["values"]["basket"];
    assert_eq!(basket["value"], new.as_str(), "{state}");
    assert_eq!(basket["principal"], "user-1");
    assert_eq!(
        basket["server"], "basket",
        "untouched record fields are kept"
    );
    assert_eq!(state["values"]["custody"]["verdict"], "reminted", "{state}");
    assert_eq!(state["values"]["items"].as_array().unwrap().len(), 2);
    assert_eq!(state["next"], json!(["add_item"]));
    assert_eq!(
        state["interrupts"][0]["basket"],
        old.as_str(),
        "the pending interrupt is re-created as LangGraph raised it: {state}"
    );
    assert_eq!(state["metadata"]["source"], "update");
    assert_eq!(w.unsettled().await, 0);
    assert_eq!(w.outcomes(&thread).await, vec!["reminted"]);

    // The next sweep finds the new basket alive and leaves the thread alone.
    let again = w.sweep(true);
    let r = row(&again, &thread);
    assert_eq!(r["verdict"], "ok", "{r}");
    assert!(r["action"].is_null(), "{r}");

    // The graph continues with the new basket.
    w.resume(&thread, &json!({"sku": "extra", "qty": 1}));
    let done = w.resume(&thread, &json!("done"));
    assert_eq!(
        done["values"]["verdict"],
        format!("ok basket={new} items=3"),
        "{done}"
    );
    assert_eq!(
        w.items(&new).await,
        vec![
            ("extra".to_owned(), 1),
            ("gadget".to_owned(), 1),
            ("widget".to_owned(), 2)
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn remint_replays_and_the_graph_continues_sqlite() {
    remint_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn remint_replays_and_the_graph_continues_postgres() {
    remint_case(Kind::Postgres).await;
}

/// An acting sweep through a DSN in libpq's keyword/value form writes as through its URL: the
/// writable pool reads the DSN as the reader does.
#[tokio::test(flavor = "multi_thread")]
async fn an_acting_sweep_through_a_keyword_value_dsn_reminds() {
    let w = World::new(Kind::Postgres, "act_keyword_value", "remint", SERVER).await;
    let (backend, url) = w.checkpoints.backend_dsn();
    let dsn = support::keyword_value_dsn(&url);
    support::act_resources(w.res.path(), &w.server.url(), backend, &dsn, "remint");
    let (thread, old) = w.filled_and_gone("").await;
    let report = w.sweep(true);
    let r = row(&report, &thread);
    assert_eq!(r["action"]["outcome"], "reminted", "{r}");
    let new = r["action"]["handle"].as_str().unwrap();
    assert_ne!(new, old);
    assert_eq!(w.state(&thread)["values"]["basket"]["value"], new);
    assert_eq!(w.outcomes(&thread).await, vec!["reminted"]);
}

async fn escalate_case(kind: Kind) {
    let w = World::new(kind, "act_escalate", "escalate", SERVER).await;
    w.write("t-expired,t-absent,t-other-principal,t-live", "");
    let before = w.baskets().await;

    let report = w.sweep(true);
    for thread in ["t-expired", "t-absent", "t-other-principal"] {
        let r = row(&report, thread);
        assert_eq!(r["action"]["plan"], "escalate", "{r}");
        assert_eq!(r["action"]["outcome"], "escalated", "{r}");
    }
    assert!(row(&report, "t-live")["action"].is_null());
    assert_eq!(w.baskets().await, before, "escalating mints nothing");

    let state = w.state("t-expired");
    let custody = &state["values"]["custody"];
    assert_eq!(custody["verdict"], "escalated", "{state}");
    assert_eq!(custody["handle_class"], "basket");
    assert!(
        custody["reason"]
            .as_str()
            .unwrap()
            .contains("BASKET_EXPIRED"),
        "{custody}"
    );
    assert_eq!(state["next"], json!(["add_item"]));
    assert_eq!(state["interrupts"].as_array().unwrap().len(), 1, "{state}");
    let checkpoint = state["checkpoint_id"].clone();

    // Escalated once: the next sweep leaves it (and writes no checkpoint).
    let again = w.sweep(true);
    let r = row(&again, "t-expired");
    assert_eq!(r["action"]["outcome"], "skipped", "{r}");
    assert_eq!(r["action"]["reason"], "already escalated", "{r}");
    assert_eq!(w.state("t-expired")["checkpoint_id"], checkpoint);
    assert_eq!(w.unsettled().await, 0);
    // A dry run predicts that skip and counts it as no action taken.
    let dry = w.sweep(false);
    let r = row(&dry, "t-expired");
    assert_eq!(r["action"]["outcome"], "planned", "{r}");
    assert_eq!(r["action"]["would_skip"], "already escalated", "{r}");
    assert!(
        dry["stores"][0]["summary"]["actions"]
            .as_object()
            .is_none_or(|a| a.is_empty()),
        "{dry}"
    );

    // Resumed, the graph takes its handle_gone route on custody's verdict.
    let done = w.resume("t-expired", &json!({"sku": "widget", "qty": 1}));
    let verdict = done["values"]["verdict"].as_str().unwrap();
    assert!(
        verdict.starts_with("handle_gone: custody escalated: "),
        "{done}"
    );
    assert_eq!(done["next"], json!([]));
}

#[tokio::test(flavor = "multi_thread")]
async fn escalate_routes_the_graph_to_handle_gone_sqlite() {
    escalate_case(Kind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn escalate_routes_the_graph_to_handle_gone_postgres() {
    escalate_case(Kind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fail_writes_verdict_failed() {
    let w = World::new(Kind::Sqlite, "act_fail", "fail", SERVER).await;
    w.write("t-expired", "");
    let r = w.sweep(true);
    assert_eq!(row(&r, "t-expired")["action"]["outcome"], "failed");
    let done = w.resume("t-expired", &json!({"sku": "widget", "qty": 1}));
    assert!(
        done["values"]["verdict"]
            .as_str()
            .unwrap()
            .starts_with("handle_gone: custody failed: "),
        "{done}"
    );
}

#[test]
fn without_apply_nothing_is_written() {
    let server = BasketServer::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("checkpoints.sqlite");
    support::write_some_fixtures(&server.url(), Db::Sqlite(&db), Some("t-expired"), "");
    let dsn = format!("sqlite://{}", db.display());
    support::act_resources(dir.path(), &server.url(), "sqlite", &dsn, "remint");
    let before = std::fs::read(&db).unwrap();
    for extra in [&[][..], &["--dry-run"][..]] {
        let mut args = vec!["sweep", "-o", "json", "-f", dir.path().to_str().unwrap()];
        args.extend_from_slice(extra);
        let out = support::custody(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        let r = row(&report, "t-expired");
        assert_eq!(r["action"]["outcome"], "planned", "{r}");
        assert_eq!(r["action"]["plan"], "remint", "{r}");
    }
    assert_eq!(
        std::fs::read(&db).unwrap(),
        before,
        "the database is unchanged"
    );
    let state = support::order_graph(Db::Sqlite(&db), &["state", "--thread", "t-expired"]);
    assert_eq!(
        state["metadata"]["source"], "loop",
        "no checkpoint appended"
    );
}

#[cfg(feature = "failpoints")]
async fn moved_case(kind: Kind) {
    let w = World::new(kind, "act_moved", "escalate", SERVER).await;
    w.write("t-expired", "");
    let stopped = Stopped::at(&w.args(), "act::before-append", "return(wait)");
    // custody has read the thread and decided; LangGraph resumes it now.
    let resumed = w.resume("t-expired", &json!({"sku": "widget", "qty": 1}));
    assert!(
        resumed["values"]["verdict"]
            .as_str()
            .unwrap()
            .starts_with("handle_gone: BASKET_EXPIRED"),
        "{resumed}"
    );
    let checkpoint = resumed["checkpoint_id"].clone();
    let (status, stdout, stderr) = stopped.go();
    assert!(status.success(), "{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap();
    let r = row(&report, "t-expired");
    assert_eq!(r["action"]["outcome"], "skipped", "{r}");
    assert!(
        r["action"]["reason"]
            .as_str()
            .unwrap()
            .starts_with("thread moved"),
        "{r}"
    );
    let state = w.state("t-expired");
    assert_eq!(state["checkpoint_id"], checkpoint, "nothing appended");
    assert!(state["values"]["custody"].is_null(), "{state}");
    assert_eq!(w.outcomes("t-expired").await, vec!["moved"]);
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_thread_resumed_between_read_and_write_is_left_untouched_sqlite() {
    moved_case(Kind::Sqlite).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn a_thread_resumed_between_read_and_write_is_left_untouched_postgres() {
    moved_case(Kind::Postgres).await;
}

/// Every step of a re-mint at which the sweeper is killed.
#[cfg(feature = "failpoints")]
const STEPS: [&str; 7] = [
    "after-intent",
    "after-mint",
    "mid-replay",
    "after-replay",
    "before-append",
    "append-uncommitted",
    "after-append",
];

#[cfg(feature = "failpoints")]
async fn kill_case(kind: Kind) {
    let w = World::new(kind, "act_kill", "remint", SERVER).await;
    for (i, step) in STEPS.iter().enumerate() {
        let (thread, old) = w.filled_and_gone(&format!("k{i}-")).await;
        let before = w.baskets().await;

        Stopped::at(&w.args(), &format!("act::{step}"), "return").kill();

        let report = w.sweep(true);
        assert_eq!(
            w.baskets().await,
            before + 1,
            "{step}: exactly one new basket"
        );
        assert_eq!(w.unsettled().await, 0, "{step}: the ledger is settled");
        let state = w.state(&thread);
        let basket = state["values"]["basket"]["value"]
            .as_str()
            .unwrap()
            .to_owned();
        if *step == "mid-replay" {
            // The first replay call's answer was never recorded: escalated, not replayed twice.
            assert_eq!(basket, old, "{step}");
            assert_eq!(
                state["values"]["custody"]["verdict"], "escalated",
                "{step}: {state}"
            );
            assert!(
                state["values"]["custody"]["reason"]
                    .as_str()
                    .unwrap()
                    .contains("replay call 1 of 2 was interrupted"),
                "{state}"
            );
        } else {
            assert_ne!(basket, old, "{step}");
            assert_eq!(state["values"]["custody"]["verdict"], "reminted", "{step}");
            assert_eq!(
                w.items(&basket).await,
                vec![("gadget".to_owned(), 1), ("widget".to_owned(), 2)],
                "{step}: items replayed exactly once"
            );
        }
        assert_eq!(state["next"], json!(["add_item"]), "{step}");
        // Killed after the append committed, the entry was already done; otherwise the second
        // sweep settled it before scanning.
        let settled = report["stores"][0]["settled"].as_array().unwrap().len();
        assert_eq!(
            settled,
            usize::from(*step != "after-append"),
            "{step}: {report}"
        );
    }
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn kill_9_at_every_step_of_a_remint_mints_once_sqlite() {
    kill_case(Kind::Sqlite).await;
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread")]
async fn kill_9_at_every_step_of_a_remint_mints_once_postgres() {
    kill_case(Kind::Postgres).await;
}
