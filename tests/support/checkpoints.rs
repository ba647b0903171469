//! A checkpoint database for the acting tests: a SQLite file or a fresh PostgreSQL database,
//! LangGraph's threads in it (tests/py/order_graph.py), and custody's ledger read back.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::Db;

/// The backend of a checkpoint database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sqlite,
    Postgres,
}

/// A checkpoint database: a SQLite file in a temporary directory, or a PostgreSQL database.
pub struct Checkpoints {
    pub kind: Kind,
    /// The SQLite file (`DIR/checkpoints.sqlite`; unused on PostgreSQL).
    pub sqlite: PathBuf,
    /// The PostgreSQL URL (empty on SQLite).
    pub pg: String,
}

impl Checkpoints {
    /// `DIR/checkpoints.sqlite`, or a fresh PostgreSQL database named after `name`.
    pub async fn new(kind: Kind, dir: &Path, name: &str) -> Self {
        let pg = match kind {
            Kind::Postgres => super::fresh_pg_database(name).await,
            Kind::Sqlite => String::new(),
        };
        Self {
            kind,
            sqlite: dir.join("checkpoints.sqlite"),
            pg,
        }
    }

    /// An existing PostgreSQL database.
    pub fn on_postgres(url: String) -> Self {
        Self {
            kind: Kind::Postgres,
            sqlite: PathBuf::new(),
            pg: url,
        }
    }

    /// Where LangGraph writes.
    pub fn db(&self) -> Db<'_> {
        match self.kind {
            Kind::Sqlite => Db::Sqlite(&self.sqlite),
            Kind::Postgres => Db::Postgres(&self.pg),
        }
    }

    /// `(backend, dsn)` of a CheckpointStore on it.
    pub fn backend_dsn(&self) -> (&'static str, String) {
        match self.kind {
            Kind::Sqlite => ("sqlite", format!("sqlite://{}", self.sqlite.display())),
            Kind::Postgres => ("postgres", self.pg.clone()),
        }
    }

    /// One integer from a query (`count(*)`), or `None` when the query fails (no such table).
    pub async fn count(&self, sql: &str) -> Option<i64> {
        use sqlx::Connection as _;
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        match self.kind {
            Kind::Sqlite => {
                let url = format!("sqlite://{}", self.sqlite.display());
                let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
                sqlx::query_scalar(sql).fetch_one(&mut c).await.ok()
            }
            Kind::Postgres => {
                let mut c = sqlx::PgConnection::connect(&self.pg).await.unwrap();
                sqlx::query_scalar(sql).fetch_one(&mut c).await.ok()
            }
        }
    }

    /// Ledger entries that are not done.
    pub async fn unsettled(&self) -> i64 {
        self.count("SELECT count(*) FROM custody_actions WHERE state <> 'done'")
            .await
            .unwrap()
    }

    /// Ledger outcomes (or states, while unsettled) of one thread.
    pub async fn outcomes(&self, thread: &str) -> Vec<String> {
        use sqlx::Connection as _;
        match self.kind {
            Kind::Sqlite => {
                let url = format!("sqlite://{}", self.sqlite.display());
                let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
                sqlx::query_scalar(
                    "SELECT coalesce(outcome, state) FROM custody_actions WHERE thread_id = ?",
                )
                .bind(thread)
                .fetch_all(&mut c)
                .await
                .unwrap()
            }
            Kind::Postgres => {
                let mut c = sqlx::PgConnection::connect(&self.pg).await.unwrap();
                sqlx::query_scalar(
                    "SELECT coalesce(outcome, state) FROM custody_actions WHERE thread_id = $1",
                )
                .bind(thread)
                .fetch_all(&mut c)
                .await
                .unwrap()
            }
        }
    }

    /// Resumes a parked thread with `value` as principal `user-1`, the basket server at
    /// `server`; returns its state.
    pub fn resume(&self, server: &str, thread: &str, value: &Value) -> Value {
        super::order_graph(
            self.db(),
            &[
                "resume",
                "--thread",
                thread,
                "--server",
                server,
                "--principal",
                "user-1",
                "--value",
                &value.to_string(),
            ],
        )
    }

    /// A thread's state.
    pub fn state(&self, thread: &str) -> Value {
        super::order_graph(self.db(), &["state", "--thread", thread])
    }

    /// A parked thread `PREFIXt-live` with two recorded items (widget ×2, gadget ×1), written
    /// through the real basket server at `server`; returns its basket.
    pub fn filled(&self, server: &str, prefix: &str) -> String {
        let thread = format!("{prefix}t-live");
        super::write_some_fixtures(server, self.db(), Some("t-live"), prefix);
        self.resume(server, &thread, &json!({"sku": "widget", "qty": 2}));
        let state = self.resume(server, &thread, &json!({"sku": "gadget", "qty": 1}));
        assert_eq!(state["next"], json!(["add_item"]), "{state}");
        state["values"]["basket"]["value"]
            .as_str()
            .unwrap()
            .to_owned()
    }
}
