//! Reading LangGraph 1.2 checkpoints: the latest root checkpoint of every parked thread.
//!
//! Storage facts (LangGraph `langgraph-checkpoint-postgres` 3.2 `base.py`, `-sqlite` 3.1):
//! checkpoint ids are UUIDv6 strings that sort by time, so a thread's latest checkpoint is its
//! greatest `checkpoint_id` in namespace `''` (the root graph); pending writes hang off the
//! checkpoint a superstep started from. A thread is **parked** when that latest checkpoint has an
//! `__interrupt__` write from a task with no output write (`langgraph/pregel/_task_status.py`), or
//! when it was edited by `update_state` (metadata `source: update`) while a node is still due.
//!
//! The reader never writes and never migrates: PostgreSQL sessions are opened with
//! `default_transaction_read_only`, SQLite files in read-only mode.
//! Acting sweeps append checkpoints through [`writer`], on a separate writable pool.

mod doc;
mod postgres;
pub mod serde;
mod shard;
mod sqlite;
mod typed;
pub mod writer;

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use futures::stream::BoxStream;
use serde_json::Value;

pub use doc::CheckpointDoc;
pub use shard::{MAX_SHARDS, Shard};

use crate::crd::Backend;

/// Channels LangGraph itself writes as control channels; an interrupt is pending only while its
/// task has no write outside this set (`_task_status.py`).
pub const CONTROL_CHANNELS: [&str; 4] = [
    "__interrupt__",
    "__resume__",
    "__error__",
    "__error_source_node__",
];

/// Why a thread counts as parked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ::serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkedBy {
    /// An unanswered `interrupt()`.
    Interrupt,
    /// `update_state` wrote the latest checkpoint while a node is still due; LangGraph does not
    /// carry the interrupt write over to such a checkpoint.
    Edited,
}

/// One state channel of a checkpoint, as read.
#[derive(Clone, Debug, PartialEq)]
pub enum Channel {
    /// The channel has a value (possibly JSON null).
    Value(Value),
    /// The channel has a version but no value (consumed, or a legacy `empty` blob).
    Empty,
    /// The value exists but could not be decoded; the reason names the problem.
    Undecodable(String),
}

/// The latest root checkpoint of a parked thread, with the channels the sweep asked for.
#[derive(Clone, Debug)]
pub struct ParkedThread {
    /// LangGraph `thread_id`.
    pub thread_id: String,
    /// Always `""` (the root graph) for now; subgraph namespaces are not swept.
    pub checkpoint_ns: String,
    /// The checkpoint the verdict is about; a later write must re-check it is still the latest.
    pub checkpoint_id: String,
    /// Why it counts as parked.
    pub parked_by: ParkedBy,
    /// When the checkpoint was written (its `ts`).
    pub checkpoint_ts: Option<DateTime<Utc>>,
    /// Checkpoint metadata (source, step, and scalar `configurable` entries such as a principal).
    pub metadata: serde_json::Map<String, Value>,
    /// Nodes due next (`branch:to:<node>` triggers newer than the node has seen).
    pub next_nodes: Vec<String>,
    /// Requested channels that exist in this checkpoint (have a version).
    pub channels: BTreeMap<String, Channel>,
}

/// A thread whose rows could not be read; reported and skipped, never rewritten.
#[derive(Clone, Debug, PartialEq, Eq, ::serde::Serialize)]
pub struct SkippedThread {
    /// LangGraph `thread_id`.
    pub thread_id: String,
    /// The checkpoint that failed to decode.
    pub checkpoint_id: String,
    /// What was wrong, without the row's contents.
    pub reason: String,
}

/// What the scan yields per thread.
#[derive(Clone, Debug)]
pub enum Scanned {
    /// A parked thread with its requested channels.
    Parked(ParkedThread),
    /// A thread whose latest checkpoint does not decode.
    Skipped(SkippedThread),
}

/// Errors that stop a scan (as opposed to a single thread being skipped).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The connection string is not usable; the text never contains the password.
    #[error("invalid {backend} DSN {dsn}: {reason}")]
    Dsn {
        /// Backend named by the resource.
        backend: &'static str,
        /// The DSN with any password replaced by `***`.
        dsn: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Connecting failed.
    #[error("cannot connect to {dsn}: {source}")]
    Connect {
        /// The DSN with any password replaced by `***`.
        dsn: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The database does not hold LangGraph checkpoint tables custody understands.
    #[error("{0}")]
    Schema(String),
    /// A query failed part-way.
    #[error("query failed: {0}")]
    Query(#[from] sqlx::Error),
}

/// A connected, read-only checkpoint database.
pub enum Store {
    /// PostgresSaver tables.
    Postgres(postgres::Reader),
    /// SqliteSaver tables.
    Sqlite(sqlite::Reader),
}

impl Store {
    /// Connects read-only and checks that LangGraph's tables are there.
    ///
    /// `dsn` is `postgres://…` or `sqlite://path` (a bare path works for SQLite too).
    ///
    /// # Errors
    /// [`StoreError::Dsn`], [`StoreError::Connect`] or [`StoreError::Schema`].
    pub async fn connect(backend: Backend, dsn: &str) -> Result<Self, StoreError> {
        check_scheme(backend, dsn)?;
        Ok(match backend {
            Backend::Postgres => Self::Postgres(postgres::Reader::connect(dsn).await?),
            Backend::Sqlite => Self::Sqlite(sqlite::Reader::connect(dsn).await?),
        })
    }

    /// Streams the parked threads, one item per thread, ordered by `thread_id`.
    ///
    /// `channels` names the state channels to read (the first segment of each handle class's
    /// `statePath`). Memory stays flat in the number of threads: rows are decoded as they arrive.
    pub fn parked_threads<'a>(
        &'a self,
        channels: &'a [String],
    ) -> BoxStream<'a, Result<Scanned, StoreError>> {
        self.parked_threads_in(channels, Shard::ALL)
    }

    /// As [`Store::parked_threads`], for the threads of one [`Shard`] only. PostgreSQL filters
    /// in SQL (the other shards' rows are never fetched); SQLite, which has no sha256, filters
    /// on the thread id before a row is decoded.
    pub fn parked_threads_in<'a>(
        &'a self,
        channels: &'a [String],
        shard: Shard,
    ) -> BoxStream<'a, Result<Scanned, StoreError>> {
        match self {
            Self::Postgres(r) => r.parked_threads(channels, shard),
            Self::Sqlite(r) => r.parked_threads(channels, shard),
        }
    }
}

/// A DSN of the wrong kind for the backend fails with a misleading driver error (a SQLite file
/// named `postgres:`, a DNS lookup of `sqlite`); say what is wrong instead.
fn check_scheme(backend: Backend, dsn: &str) -> Result<(), StoreError> {
    let scheme = dsn.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    let ok = match backend {
        Backend::Postgres => matches!(scheme.as_deref(), Some("postgres" | "postgresql")),
        Backend::Sqlite => scheme.is_none() || scheme.as_deref() == Some("sqlite"),
    };
    if ok {
        return Ok(());
    }
    let (name, want) = match backend {
        Backend::Postgres => ("postgres", "postgres://user@host/db"),
        Backend::Sqlite => ("sqlite", "sqlite://path or a file path"),
    };
    Err(StoreError::Dsn {
        backend: name,
        dsn: redact_dsn(dsn),
        reason: format!("backend {name} needs a DSN like {want}"),
    })
}

/// Replaces the password of a URL-shaped DSN with `***`, for messages.
pub fn redact_dsn(dsn: &str) -> String {
    let Some((scheme, rest)) = dsn.split_once("://") else {
        // libpq's `key=value` form: hide the value of every password key.
        return dsn
            .split(' ')
            .map(|kv| match kv.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => kv.to_owned(),
            })
            .collect::<Vec<_>>()
            .join(" ");
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let tail = redact_query_password(tail);
    let Some((userinfo, host)) = authority.rsplit_once('@') else {
        return format!("{scheme}://{authority}{tail}");
    };
    let user = userinfo.split(':').next().unwrap_or("");
    let redacted = if userinfo.contains(':') {
        format!("{user}:***")
    } else {
        user.to_owned()
    };
    format!("{scheme}://{redacted}@{host}{tail}")
}

fn redact_query_password(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_owned();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => kv.to_owned(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

/// Builds a [`ParkedThread`] from a decoded checkpoint, or `None` when the thread is not parked.
fn classify(
    thread_id: String,
    doc: CheckpointDoc,
    metadata: serde_json::Map<String, Value>,
    pending_interrupt: bool,
    channels: BTreeMap<String, Channel>,
) -> Option<ParkedThread> {
    let next_nodes = doc.next_nodes();
    let head = Head {
        checkpoint_id: doc.id,
        checkpoint_ts: doc.ts,
        next_nodes,
    };
    classify_head(thread_id, head, metadata, pending_interrupt, channels)
}

/// What [`classify`] needs of a checkpoint document, however it was decoded.
struct Head {
    checkpoint_id: String,
    checkpoint_ts: Option<DateTime<Utc>>,
    next_nodes: Vec<String>,
}

fn classify_head(
    thread_id: String,
    head: Head,
    metadata: serde_json::Map<String, Value>,
    pending_interrupt: bool,
    channels: BTreeMap<String, Channel>,
) -> Option<ParkedThread> {
    let edited = metadata.get("source").and_then(Value::as_str) == Some("update");
    let parked_by = if pending_interrupt {
        ParkedBy::Interrupt
    } else if edited && !head.next_nodes.is_empty() {
        ParkedBy::Edited
    } else {
        return None;
    };
    Some(ParkedThread {
        thread_id,
        checkpoint_ns: String::new(),
        checkpoint_id: head.checkpoint_id,
        parked_by,
        checkpoint_ts: head.checkpoint_ts,
        metadata,
        next_nodes: head.next_nodes,
        channels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_dsn("postgres://app:s3cret@db:5432/lg?sslmode=require"),
            "postgres://app:***@db:5432/lg?sslmode=require"
        );
        assert_eq!(
            redact_dsn("postgres://db/lg?user=a&password=x"),
            "postgres://db/lg?user=a&password=***"
        );
        assert_eq!(redact_dsn("postgres://app@db/lg"), "postgres://app@db/lg");
        assert_eq!(redact_dsn("sqlite://./c.sqlite"), "sqlite://./c.sqlite");
        assert_eq!(
            redact_dsn("postgres://u:p@ss@db/x"),
            "postgres://u:***@db/x"
        );
    }
}
