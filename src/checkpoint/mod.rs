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
pub use postgres::{PARKED_INDEXES, ScanPlan};
pub mod serde;
mod shard;
mod sqlite;

pub use sqlite::{Access, close_open_pools};
mod typed;
pub mod writer;

use std::collections::BTreeMap;
use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use serde_json::Value;

pub use doc::CheckpointDoc;
pub use serde::{DecodeError, DecodeKind, MAX_VALUE_BYTES};
pub use shard::{MAX_SHARDS, Shard};

use crate::domain::handle::Slot;

/// LangGraph checkpoint saver backends custody reads (LangGraph 1.2: langgraph-checkpoint-postgres
/// 3.x, langgraph-checkpoint-sqlite 3.x).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    ::serde::Serialize,
    ::serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// `PostgresSaver`: tables `checkpoints`, `checkpoint_blobs`, `checkpoint_writes`.
    Postgres,
    /// `SqliteSaver`: tables `checkpoints`, `writes`.
    Sqlite,
}

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
    /// The value exists but could not be decoded; the error names the problem. The scan turns a
    /// thread with such a channel into a [`SkippedThread`] (see [`Store::parked_threads`]).
    Undecodable(DecodeError),
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
    /// Requested channels that exist in this checkpoint (have a version).
    pub channels: BTreeMap<String, Channel>,
}

impl ParkedThread {
    /// A requested channel as the core reads it (`None`: this checkpoint has no such channel).
    /// The scan never yields a thread with an [`Channel::Undecodable`] channel (it becomes a
    /// [`SkippedThread`]); were one here, it would read as missing.
    pub fn slot(&self, channel: &str) -> Option<Slot<'_>> {
        match self.channels.get(channel)? {
            Channel::Value(v) => Some(Slot::Value(v)),
            Channel::Empty => Some(Slot::Empty),
            Channel::Undecodable(_) => None,
        }
    }
}

/// A thread whose rows could not be read; reported and skipped, never rewritten.
#[derive(Clone, Debug, PartialEq, Eq, ::serde::Serialize)]
pub struct SkippedThread {
    /// LangGraph `thread_id`.
    pub thread_id: String,
    /// The checkpoint that failed to decode.
    pub checkpoint_id: String,
    /// The state channel whose value failed, when the failure is in one channel's value rather
    /// than in the checkpoint document or its metadata.
    pub channel: Option<String>,
    /// The bounded category (`decode`, `too_large`, `unsupported_format`).
    pub kind: DecodeKind,
    /// What was wrong, without the row's contents.
    pub reason: String,
}

impl SkippedThread {
    /// A thread skipped because of `error`, in `channel` when the error is about one value.
    pub fn new(
        thread_id: String,
        checkpoint_id: String,
        channel: Option<String>,
        error: DecodeError,
    ) -> Self {
        Self {
            thread_id,
            checkpoint_id,
            channel,
            kind: error.kind,
            reason: error.message,
        }
    }
}

impl std::fmt::Display for SkippedThread {
    /// `thread T, checkpoint C, channel basket: <kind>: <reason>`: everything needed to find the
    /// row, and the cause.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "thread {}, checkpoint {}",
            self.thread_id, self.checkpoint_id
        )?;
        if let Some(channel) = &self.channel {
            write!(f, ", channel {channel}")?;
        }
        write!(f, ": {}: {}", self.kind.as_str(), self.reason)
    }
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
    /// The DSN is empty (a `spec.dsn: ""`, or a Secret key holding nothing).
    #[error("the DSN is empty")]
    EmptyDsn,
    /// Connecting failed.
    #[error("cannot connect to {dsn}{}: {}", address.as_deref().map(|a| format!(" at {a}")).unwrap_or_default(), db_text(source))]
    Connect {
        /// The DSN with any password replaced by `***`.
        dsn: String,
        /// Where the driver connected, when the DSN does not spell it (PostgreSQL: a DSN without
        /// a host or port, whose defaults the driver filled in).
        address: Option<String>,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// custody may not write a SQLite database or the directory it is in (an acting sweep);
    /// the text names the path and the operating system's cause.
    #[error("{0}")]
    NotWritable(String),
    /// A SQLite DSN names no SQLite database file (nothing there, a directory, another kind of
    /// file); the text names the absolute path and what is there.
    #[error("{0}")]
    File(String),
    /// The database does not hold LangGraph checkpoint tables custody understands.
    #[error("{0}")]
    Schema(String),
    /// A SQLite store's act lock file (beside the database file) cannot be opened: a
    /// filesystem failure, not a schema custody does not read.
    #[error("cannot open the act lock {}: {}", path.display(), io_text(source))]
    Lock {
        /// The lock file.
        path: std::path::PathBuf,
        /// Why it cannot be opened.
        #[source]
        source: std::io::Error,
    },
    /// A query failed part-way.
    #[error("query failed: {}", db_text(.0))]
    Query(#[from] sqlx::Error),
    /// A SQLite file read without locks changed during the read (see `sqlite::Quiescent`).
    #[error("{0}")]
    Changed(String),
}

/// A database driver's error for a person. For an error PostgreSQL answered, its message and
/// SQLSTATE (`database "orders" does not exist (SQLSTATE 3D000)`): sqlx appends the `line` field
/// of PostgreSQL's error (`at line 948`), which is the line of PostgreSQL's own source that
/// raised it, not of anything the user wrote. For SQLite's, its message and result code by name
/// (`file is not a database (SQLITE_NOTADB)`): SQLite has result codes, not SQLSTATEs, and its
/// documentation and forums know them by name. A reply that breaks PostgreSQL's protocol is said
/// as such ([`protocol_text`]), an I/O error without Rust's errno ([`io_text`]). Any other
/// error keeps sqlx's text.
pub fn db_text(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) if db.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() => {
                let name = code.parse().ok().and_then(sqlite_code_name);
                match name {
                    Some(name) => format!("{} ({name})", db.message()),
                    None => format!("{} (SQLite result code {code})", db.message()),
                }
            }
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        sqlx::Error::Protocol(text) => protocol_text(text),
        // The SSL request answered `S`, then bytes that are not TLS: what an SSH server's
        // greeting (`SSH-2.0-…`) gives a client that asked PostgreSQL for TLS. rustls says only
        // `received corrupt message of type InvalidContentType`.
        sqlx::Error::Io(e)
            if e.get_ref()
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                .is_some_and(|tls| matches!(tls, rustls::Error::InvalidMessage(_))) =>
        {
            "the server there does not speak PostgreSQL's protocol: it answered the SSL request \
             with 'S' (0x53), then with bytes that are not TLS, as an SSH server does"
                .to_owned()
        }
        sqlx::Error::Io(e) => format!("error communicating with database: {}", io_text(e)),
        other => other.to_string(),
    }
}

/// The name of a SQLite result code, primary or extended (sqlite.org/rescode.html, as
/// `sqlite3.h` of SQLite 3.51, the one sqlx builds, defines them); an extended code SQLite may add later is named by
/// its primary code (the low byte) and its number. `None` for a code SQLite does not define.
pub(crate) fn sqlite_code_name(code: i32) -> Option<String> {
    const PRIMARY: [&str; 29] = [
        "SQLITE_OK",
        "SQLITE_ERROR",
        "SQLITE_INTERNAL",
        "SQLITE_PERM",
        "SQLITE_ABORT",
        "SQLITE_BUSY",
        "SQLITE_LOCKED",
        "SQLITE_NOMEM",
        "SQLITE_READONLY",
        "SQLITE_INTERRUPT",
        "SQLITE_IOERR",
        "SQLITE_CORRUPT",
        "SQLITE_NOTFOUND",
        "SQLITE_FULL",
        "SQLITE_CANTOPEN",
        "SQLITE_PROTOCOL",
        "SQLITE_EMPTY",
        "SQLITE_SCHEMA",
        "SQLITE_TOOBIG",
        "SQLITE_CONSTRAINT",
        "SQLITE_MISMATCH",
        "SQLITE_MISUSE",
        "SQLITE_NOLFS",
        "SQLITE_AUTH",
        "SQLITE_FORMAT",
        "SQLITE_RANGE",
        "SQLITE_NOTADB",
        "SQLITE_NOTICE",
        "SQLITE_WARNING",
    ];
    // Extended codes: primary | (n << 8), listed per primary code by n from 1.
    const EXTENDED: [(i32, &[&str]); 12] = [
        (
            1,
            &[
                "MISSING_COLLSEQ",
                "RETRY",
                "SNAPSHOT",
                "RESERVESIZE",
                "KEY",
                "UNABLE",
            ],
        ),
        (4, &["", "ROLLBACK"]),
        (5, &["RECOVERY", "SNAPSHOT", "TIMEOUT"]),
        (6, &["SHAREDCACHE", "VTAB"]),
        (
            8,
            &[
                "RECOVERY",
                "CANTLOCK",
                "ROLLBACK",
                "DBMOVED",
                "CANTINIT",
                "DIRECTORY",
            ],
        ),
        (
            10,
            &[
                "READ",
                "SHORT_READ",
                "WRITE",
                "FSYNC",
                "DIR_FSYNC",
                "TRUNCATE",
                "FSTAT",
                "UNLOCK",
                "RDLOCK",
                "DELETE",
                "BLOCKED",
                "NOMEM",
                "ACCESS",
                "CHECKRESERVEDLOCK",
                "LOCK",
                "CLOSE",
                "DIR_CLOSE",
                "SHMOPEN",
                "SHMSIZE",
                "SHMLOCK",
                "SHMMAP",
                "SEEK",
                "DELETE_NOENT",
                "MMAP",
                "GETTEMPPATH",
                "CONVPATH",
                "VNODE",
                "AUTH",
                "BEGIN_ATOMIC",
                "COMMIT_ATOMIC",
                "ROLLBACK_ATOMIC",
                "DATA",
                "CORRUPTFS",
                "IN_PAGE",
                "BADKEY",
                "CODEC",
            ],
        ),
        (11, &["VTAB", "SEQUENCE", "INDEX"]),
        (
            14,
            &[
                "NOTEMPDIR",
                "ISDIR",
                "FULLPATH",
                "CONVPATH",
                "DIRTYWAL",
                "SYMLINK",
            ],
        ),
        (
            19,
            &[
                "CHECK",
                "COMMITHOOK",
                "FOREIGNKEY",
                "FUNCTION",
                "NOTNULL",
                "PRIMARYKEY",
                "TRIGGER",
                "UNIQUE",
                "VTAB",
                "ROWID",
                "PINNED",
                "DATATYPE",
            ],
        ),
        (23, &["USER"]),
        (27, &["RECOVER_WAL", "RECOVER_ROLLBACK", "RBU"]),
        (28, &["AUTOINDEX"]),
    ];
    let primary = *PRIMARY.get(usize::try_from(code & 0xff).ok()?)?;
    let n = code >> 8;
    if n == 0 {
        return Some(primary.to_owned());
    }
    let known = EXTENDED
        .iter()
        .find(|(p, _)| *p == code & 0xff)
        .and_then(|(_, names)| names.get(usize::try_from(n - 1).ok()?))
        .filter(|name| !name.is_empty());
    Some(match known {
        Some(name) => format!("{primary}_{name}"),
        None => format!("{primary}, extended result code {code}"),
    })
}

/// Why sqlx could not parse a DSN, for a person. sqlx prefixes `error with configuration: `
/// (twice for `sslmode`, whose parse error it wraps again) and names a parameter with an unknown
/// value by its own field (`ssl_mode`) without the values it takes; this says the parameter as
/// the DSN spells it, with the values PostgreSQL's libpq or sqlx's SQLite driver accepts. Any
/// other cause (an unparsable port, say) keeps its text, without the prefixes.
pub(crate) fn config_text(e: &sqlx::Error) -> String {
    static UNKNOWN_VALUE: LazyLock<regex::Regex> = LazyLock::new(|| {
        regex::Regex::new(r#"^unknown value (".*") for `(\w+)`$"#).expect("a valid regex")
    });
    static UNKNOWN_PARAMETER: LazyLock<regex::Regex> = LazyLock::new(|| {
        regex::Regex::new(r"^unknown query parameter `(.*)` while parsing connection URL$")
            .expect("a valid regex")
    });
    let mut cause: &(dyn std::error::Error + 'static) = e;
    while let Some(sqlx::Error::Configuration(inner)) = cause.downcast_ref::<sqlx::Error>() {
        cause = inner.as_ref();
    }
    let text = cause.to_string();
    if let Some(c) = UNKNOWN_VALUE.captures(&text) {
        let values = match &c[2] {
            "ssl_mode" => Some((
                "sslmode",
                "disable, allow, prefer, require, verify-ca, verify-full",
            )),
            "mode" => Some(("mode", "ro, rw, rwc, memory")),
            "cache" => Some(("cache", "private, shared")),
            "immutable" => Some(("immutable", "1, 0, true, false")),
            _ => None,
        };
        if let Some((name, values)) = values {
            return format!("{name} is {}, not one of {values}", &c[1]);
        }
    }
    if let Some(c) = UNKNOWN_PARAMETER.captures(&text) {
        return format!(
            "unknown parameter {:?} (a SQLite DSN takes mode, cache, immutable and vfs)",
            &c[1]
        );
    }
    text
}

/// An I/O error for a person: its text without Rust's ` (os error 111)`, the errno the text
/// already says in words (`Connection refused`).
pub(crate) fn io_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    match e.raw_os_error() {
        Some(code) => text
            .strip_suffix(&format!(" (os error {code})"))
            .map_or_else(|| text.clone(), str::to_owned),
        None => text,
    }
}

/// sqlx's protocol error `text` without the source location sqlx appends to it
/// (`(sqlx_postgres::connection::tls:95)`, sqlx's own code, nothing the user wrote). The first
/// thing a PostgreSQL client reads is the one-byte answer to its SSL request (`S` or `N`); any
/// other byte means another kind of server listens there, which is what a DSN with the wrong
/// port meets, so that answer is said with the byte as a character: `H`, the start of
/// `HTTP/1.1 400`, is an HTTP server's.
fn protocol_text(text: &str) -> String {
    let text = match text.rsplit_once(" (") {
        Some((message, place))
            if place.strip_suffix(')').is_some_and(|p| {
                p.contains("::")
                    && p.rsplit_once(':').is_some_and(|(_, line)| {
                        !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit())
                    })
            }) =>
        {
            message
        }
        _ => text,
    };
    let answered = text
        .strip_prefix("unexpected response from SSLRequest: 0x")
        .and_then(|hex| u8::from_str_radix(hex, 16).ok());
    match answered {
        Some(byte) => {
            let shown = if byte.is_ascii_graphic() {
                format!("'{}' (0x{byte:02x})", char::from(byte))
            } else {
                format!("the byte 0x{byte:02x}")
            };
            let http = if byte == b'H' {
                ", as an HTTP server does"
            } else {
                ""
            };
            format!(
                "the server there does not speak PostgreSQL's protocol: it answered the SSL \
                 request with {shown}{http}"
            )
        }
        None => format!("the server's reply breaks PostgreSQL's protocol: {text}"),
    }
}

/// A connected, read-only checkpoint database.
pub enum Store {
    /// PostgresSaver tables.
    Postgres(postgres::Reader),
    /// SqliteSaver tables.
    Sqlite(sqlite::Reader),
}

/// What would refuse an acting sweep's writes to a store ([`Store::write_refusals`]).
#[derive(Debug, Default)]
pub struct WriteRefusals {
    /// The server is a hot standby (`pg_is_in_recovery()`), which refuses every write.
    pub hot_standby: bool,
    /// The grants of README "Database privileges" the role lacks, as `INSERT ON checkpoints`.
    pub missing_grants: Vec<String>,
}

impl Store {
    /// Connects read-only and checks that LangGraph's tables are there.
    ///
    /// `dsn` is `postgres://…` (or libpq's keyword/value form, `host=db dbname=lg …`) or
    /// `sqlite://path` (a bare path works for SQLite too).
    ///
    /// # Errors
    /// [`StoreError::Dsn`], [`StoreError::Connect`] or [`StoreError::Schema`].
    pub async fn connect(backend: Backend, dsn: &str) -> Result<Self, StoreError> {
        Self::connect_for(backend, dsn, Access::Observe).await
    }

    /// [`Store::connect`] for an observing or an acting sweep. Observing writes nothing next to
    /// a SQLite file, even in WAL mode with no connection open (read immutable then, and checked
    /// unchanged at the end of the scan); acting opens it as SQLite does by default (the acting
    /// sweep's writable pool writes there anyway). PostgreSQL is read alike.
    ///
    /// # Errors
    /// As [`Store::connect`]; [`StoreError::Schema`] also for a SQLite file that cannot be read
    /// without writing next to it, saying why and what to do.
    pub async fn connect_for(
        backend: Backend,
        dsn: &str,
        access: Access,
    ) -> Result<Self, StoreError> {
        let dsn = check_dsn(backend, dsn)?;
        Ok(match backend {
            Backend::Postgres => Self::Postgres(postgres::Reader::connect(&dsn).await?),
            Backend::Sqlite => Self::Sqlite(sqlite::Reader::connect(&dsn.driver, access).await?),
        })
    }

    /// Closes the connections and waits until they are closed: a SQLite connection left to close
    /// on its own thread when the process exits never closes, and an acting sweep's writable
    /// pool can fold the `-wal` back into the file only as the database's last connection
    /// ([`writer::WritePool::close`]).
    pub async fn close(self) {
        match self {
            Self::Postgres(r) => r.close().await,
            Self::Sqlite(r) => r.close().await,
        }
    }

    /// For a sweep that plans actions on a `mode: act` store: what would refuse the acting
    /// sweep's writes on PostgreSQL, so the plan does not promise actions that `--apply` then
    /// refuses for the whole store. None for SQLite, whose acting sweep checks the file and its
    /// directory before it opens them.
    ///
    /// # Errors
    /// [`StoreError::Query`] when the privilege functions cannot be asked.
    pub async fn write_refusals(&self) -> Result<WriteRefusals, StoreError> {
        match self {
            Self::Postgres(r) => Ok(r.write_refusals().await?),
            Self::Sqlite(_) => Ok(WriteRefusals::default()),
        }
    }

    /// The statement a PostgreSQL scan runs, detected when connecting: [`ScanPlan::Indexed`]
    /// when the DBA added both [`PARKED_INDEXES`], else [`ScanPlan::Full`]. `None` for SQLite.
    pub fn scan_plan(&self) -> Option<ScanPlan> {
        match self {
            Self::Postgres(r) => Some(r.plan()),
            Self::Sqlite(_) => None,
        }
    }

    /// Streams the parked threads, one item per thread, ordered by `thread_id`.
    ///
    /// `channels` names the state channels to read (the first segment of each handle class's
    /// `statePath`). Memory stays flat in the number of threads: rows are decoded as they arrive,
    /// and no value over [`MAX_VALUE_BYTES`] is fetched. A thread whose checkpoint, metadata or
    /// requested channel does not decode comes out as [`Scanned::Skipped`], naming the channel:
    /// acting on a thread whose state custody could only partly read could overwrite what it did
    /// not understand. Channels that were not requested are never decoded, so a broken value in
    /// one of them (say an unknown ext code in a message list) costs nothing.
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
        let scan = match self {
            Self::Postgres(r) => r.parked_threads(channels, shard),
            Self::Sqlite(r) => r.parked_threads(channels, shard),
        };
        scan.map_ok(skip_undecodable).boxed()
    }
}

/// A DSN that passed [`check_dsn`]: what the driver reads, and how messages show the DSN.
pub(crate) struct CheckedDsn<'a> {
    /// What sqlx parses: the DSN as written, or for PostgreSQL's keyword/value form the URL of
    /// the same parameters ([`postgres::keyword_value_url`]).
    pub(crate) driver: std::borrow::Cow<'a, str>,
    /// The DSN as the user wrote it, password masked ([`redact_dsn`]): a message about a
    /// keyword/value DSN quotes it, not the URL custody made of it.
    pub(crate) shown: String,
}

/// What custody checks of a DSN before a driver reads it: that it is not empty (an empty SQLite
/// path is the directory custody runs in, an empty PostgreSQL DSN has no scheme), its
/// characters ([`check_characters`]), for PostgreSQL libpq's keyword/value form
/// ([`postgres::keyword_value_url`]), and its scheme ([`check_scheme`]).
///
/// # Errors
/// [`StoreError::EmptyDsn`]; [`StoreError::Dsn`], saying what is wrong.
pub(crate) fn check_dsn(backend: Backend, dsn: &str) -> Result<CheckedDsn<'_>, StoreError> {
    if dsn.is_empty() {
        return Err(StoreError::EmptyDsn);
    }
    check_characters(backend, dsn)?;
    let shown = redact_dsn(dsn);
    let driver = match backend {
        Backend::Postgres => match postgres::keyword_value_url(dsn) {
            Ok(Some(url)) => std::borrow::Cow::Owned(url),
            Ok(None) => std::borrow::Cow::Borrowed(dsn),
            Err(reason) => {
                return Err(StoreError::Dsn {
                    backend: "postgres",
                    dsn: shown,
                    reason,
                });
            }
        },
        Backend::Sqlite => std::borrow::Cow::Borrowed(dsn),
    };
    check_scheme(backend, &driver)?;
    Ok(CheckedDsn { driver, shown })
}

/// A DSN with whitespace at either end or a control character anywhere is refused, saying which.
/// libpq, through which LangGraph's PostgresSaver connects, keeps such a character: a final
/// newline (what a Secret written with `echo` holds) becomes part of the DSN's last field
/// (`database "lg\n" does not exist`, `invalid sslmode value: "disable\n"`), so the agent cannot
/// connect with that DSN as it is. sqlx instead parses it as a WHATWG URL, which trims both ends
/// and drops every tab and newline, also from inside a password; a SQLite path keeps it (another
/// file name). Dropping it would make custody read another database than the agent, or log in
/// with a password that is not the one stored, so nothing is dropped.
fn check_characters(backend: Backend, dsn: &str) -> Result<(), StoreError> {
    let end = dsn.chars().next_back().filter(|c| c.is_whitespace());
    let control = dsn.char_indices().find(|(_, c)| c.is_control());
    let found = if let Some(c) = end {
        let what = match c {
            '\n' => "a newline",
            '\r' => "a carriage return",
            ' ' => "a space",
            '\t' => "a tab",
            _ => "whitespace",
        };
        format!("it ends with {what}")
    } else if dsn.starts_with(char::is_whitespace) {
        "it starts with whitespace".to_owned()
    } else if let Some((at, c)) = control {
        let hidden = if redact_password(dsn).contains(c) {
            ""
        } else {
            ", in the password (shown as ***)"
        };
        format!(
            "it holds the control character {} at byte {at}{hidden}",
            c.escape_default()
        )
    } else {
        return Ok(());
    };
    let (name, keeps) = match backend {
        Backend::Postgres => (
            "postgres",
            "libpq (LangGraph's PostgresSaver connects through it) would read it as part of the \
             DSN and fail, so custody does not drop it either",
        ),
        Backend::Sqlite => ("sqlite", "it would be part of the file name"),
    };
    let fix = match (end, control) {
        (Some('\n'), _) => {
            "store the DSN without it (echo writes one; echo -n and printf '%s' do not)".to_owned()
        }
        (None, Some((_, c))) if backend == Backend::Postgres && c.is_ascii() => format!(
            "remove it, or percent-encode it (%{:02X}) where a value holds it",
            u32::from(c)
        ),
        _ => "remove it".to_owned(),
    };
    Err(StoreError::Dsn {
        backend: name,
        dsn: redact_dsn(dsn),
        reason: format!("{found}: {keeps}; {fix}"),
    })
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
        Backend::Postgres => (
            "postgres",
            "postgres://user@host/db or, in libpq's keyword/value form, host=HOST dbname=DB user=USER",
        ),
        Backend::Sqlite => ("sqlite", "sqlite://path or a file path"),
    };
    Err(StoreError::Dsn {
        backend: name,
        dsn: redact_dsn(dsn),
        reason: format!("backend {name} needs a DSN like {want}"),
    })
}

/// The statement a scan of a PostgresSaver database runs for `channels` requested channels, for
/// a DBA's `EXPLAIN` and for the benchmark. Parameters: `$1` the channel names (`text[]`), `$2`
/// and `$3` the shard count and index (`1`, `0` for the whole store), `$4` the largest blob,
/// checkpoint document or metadata fetched, in bytes ([`MAX_VALUE_BYTES`]). `plan` picks the
/// statement ([`ScanPlan`]); a reader picks it itself ([`Store::scan_plan`]).
pub fn postgres_scan_statement(channels: usize, plan: ScanPlan) -> String {
    postgres::parked_sql(channels, plan)
}

/// Replaces the password of a DSN with `***`, for messages, in every shape a DSN is written or
/// mistyped in, since a DSN that does not parse is exactly what an error message quotes:
/// `password=`, `sslpassword=`, `oauth_client_secret=` and `scram_*_key=` values in libpq's
/// keyword/value form (quoted or not, to the first unescaped space) and in a URL's query, and a URL's userinfo, taken as everything between the scheme and the **last**
/// `@` (a password may hold `/`, `?` or `@`, unescaped, when a person typed it). A URL whose
/// path or query holds an `@` loses more than its password in the message, never less. A
/// control character is shown escaped (`\n`), so that the message stays one line and shows it.
pub fn redact_dsn(dsn: &str) -> String {
    let redacted = redact_password(dsn);
    if !redacted.contains(char::is_control) {
        return redacted;
    }
    redacted
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// [`redact_dsn`] without the escaping.
fn redact_password(dsn: &str) -> String {
    // The secrets among libpq's keywords, and any keyword that reads like one (`passwd`,
    // `pwd`, `pasword`: a mistyped keyword is quoted back in the error that refuses it); a
    // value ends at whitespace in libpq's keyword/value form (`\ ` escapes a space, `&` is part
    // of it), at whitespace or `&` in a URL's query.
    const SECRET: &str = r"(?i)(\b(?:[a-z_]*(?:pas|pwd|secret|token)[a-z_]*|scram_client_key|scram_server_key)\s*=\s*)('(?:[^'\\]|\\[\s\S])*'?|(?:\\[\s\S]|[^\s";
    static VALUES: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(&format!(r"{SECRET}&\\])*)")).expect("a valid regex"));
    static KEYWORD_VALUES: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(&format!(r"{SECRET}\\])*)")).expect("a valid regex"));
    static SCHEME: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(r"^[A-Za-z][A-Za-z0-9+.-]*:/*").expect("a valid regex"));
    let values = if postgres::is_keyword_value(dsn) {
        &KEYWORD_VALUES
    } else {
        &VALUES
    };
    let out = values.replace_all(dsn, "${1}***");
    // Where the userinfo would start: after `scheme://` (or a mistyped `scheme:/`), else after a
    // `//` (a missing colon), else at the start.
    let start = SCHEME
        .find(&out)
        .map(|m| m.end())
        .or_else(|| out.find("//").map(|i| i + 2))
        .unwrap_or(0);
    if let Some(at) = out.rfind('@').filter(|at| *at >= start)
        && let Some(colon) = out[start..at].find(':')
    {
        return format!("{}:***{}", &out[..start + colon], &out[at..]);
    }
    out.into_owned()
}

/// A parked thread with a requested channel that did not decode becomes a skipped one (the
/// first such channel, in name order, is named).
fn skip_undecodable(scanned: Scanned) -> Scanned {
    let Scanned::Parked(thread) = scanned else {
        return scanned;
    };
    let bad = thread
        .channels
        .iter()
        .find_map(|(name, channel)| match channel {
            Channel::Undecodable(e) => Some((name.clone(), e.clone())),
            _ => None,
        });
    match bad {
        Some((channel, error)) => Scanned::Skipped(SkippedThread::new(
            thread.thread_id,
            thread.checkpoint_id,
            Some(channel),
            error,
        )),
        None => Scanned::Parked(thread),
    }
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

/// A checkpoint's metadata column (JSON text; NULL reads as `{}`), as both readers take it.
///
/// # Errors
/// Not JSON, or JSON that is not an object: the thread is skipped with this reason.
fn parse_metadata(json: Option<&[u8]>) -> Result<serde_json::Map<String, Value>, DecodeError> {
    match serde_json::from_slice::<Value>(json.unwrap_or(b"{}")) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(DecodeError::malformed(
            "checkpoint metadata is not a JSON object",
        )),
        Err(e) => Err(DecodeError::malformed(format!(
            "checkpoint metadata is not JSON: {e}"
        ))),
    }
}

/// What [`classify`] needs of a checkpoint document, however it was decoded.
struct Head {
    checkpoint_id: String,
    checkpoint_ts: Option<DateTime<Utc>>,
    /// Nodes due next; read only for a thread without a pending interrupt, where they decide
    /// whether an `update_state` edit left it parked (the PostgreSQL reader leaves them empty
    /// for interrupted threads, see `postgres::parked_sql`).
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
        channels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parked(channels: BTreeMap<String, Channel>) -> Scanned {
        Scanned::Parked(ParkedThread {
            thread_id: "t-1".into(),
            checkpoint_ns: String::new(),
            checkpoint_id: "1f0-c".into(),
            parked_by: ParkedBy::Interrupt,
            checkpoint_ts: None,
            metadata: serde_json::Map::new(),
            channels,
        })
    }

    /// Texts as sqlx 0.9's `err_protocol!` builds them.
    #[test]
    fn protocol_errors_lose_sqlx_source_locations() {
        let text = |t: &str| db_text(&sqlx::Error::Protocol(t.to_owned()));
        assert_eq!(
            text("unexpected response from SSLRequest: 0x00 (sqlx_postgres::connection::tls:95)"),
            "the server there does not speak PostgreSQL's protocol: it answered the SSL request \
             with the byte 0x00"
        );
        assert_eq!(
            text("unknown message type: 'x' (sqlx_postgres::message:173)"),
            "the server's reply breaks PostgreSQL's protocol: unknown message type: 'x'"
        );
        // a parenthesis that is not a source location stays
        assert_eq!(
            text("expected SASLFinal (got Ok)"),
            "the server's reply breaks PostgreSQL's protocol: expected SASLFinal (got Ok)"
        );
    }

    /// A parameter with a bad value is named as the DSN spells it, with the values it takes,
    /// once: sqlx said "error with configuration: error with configuration: unknown value
    /// \"bogus\" for `ssl_mode`".
    #[test]
    fn dsn_parameters_are_said_as_the_dsn_spells_them() {
        use std::str::FromStr;
        let pg =
            |dsn: &str| config_text(&sqlx::postgres::PgConnectOptions::from_str(dsn).unwrap_err());
        let sqlite = |dsn: &str| {
            config_text(&sqlx::sqlite::SqliteConnectOptions::from_str(dsn).unwrap_err())
        };
        assert_eq!(
            pg("postgres://u:p@db/lg?sslmode=bogus"),
            "sslmode is \"bogus\", not one of disable, allow, prefer, require, verify-ca, verify-full"
        );
        assert_eq!(pg("postgres://u:p@db:99999/lg"), "invalid port number");
        assert_eq!(
            sqlite("sqlite://c.sqlite?mode=rox"),
            "mode is \"rox\", not one of ro, rw, rwc, memory"
        );
        assert_eq!(
            sqlite("sqlite://c.sqlite?immutable=yes"),
            "immutable is \"yes\", not one of 1, 0, true, false"
        );
        assert_eq!(
            sqlite("sqlite://c.sqlite?readonly=1"),
            "unknown parameter \"readonly\" (a SQLite DSN takes mode, cache, immutable and vfs)"
        );
    }

    /// An empty DSN is said to be empty: as a SQLite path it was the directory custody runs in
    /// ("… is a directory, not a SQLite database file"); `sqlite://` names no file.
    #[test]
    fn an_empty_dsn_is_said_to_be_empty() {
        for backend in [Backend::Sqlite, Backend::Postgres] {
            assert!(matches!(check_dsn(backend, ""), Err(StoreError::EmptyDsn)));
        }
        for dsn in ["sqlite://", "sqlite:", "sqlite://?mode=ro"] {
            assert_eq!(
                sqlite::connect_options(dsn).unwrap_err().to_string(),
                format!(
                    "invalid sqlite DSN {dsn}: it names no file; write sqlite://PATH or a file path"
                )
            );
        }
    }

    /// sqlx's statement logging (every statement slower than 1 s at WARN, with its whole SQL
    /// text) is off on every pool custody opens: readers and writable pools of both backends
    /// take their options from these two functions.
    #[test]
    fn statement_logging_is_off() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.sqlite");
        std::fs::write(&file, b"").unwrap();
        let pg =
            postgres::connect_options(&check_dsn(Backend::Postgres, "postgres://u@db/lg").unwrap())
                .unwrap();
        let sqlite = sqlite::connect_options(file.to_str().unwrap()).unwrap();
        for settings in [format!("{pg:?}"), format!("{sqlite:?}")] {
            assert!(
                settings.contains("{ statements_level: Off, slow_statements_level: Off,"),
                "{settings}"
            );
        }
    }

    /// `Connection refused`, not `Connection refused (os error 111)`: the number says nothing
    /// more to a person.
    #[test]
    fn io_errors_lose_the_os_error_number() {
        let lock = StoreError::Lock {
            path: "/data/c.sqlite-custody.lock".into(),
            source: std::io::Error::from_raw_os_error(13),
        };
        assert_eq!(
            lock.to_string(),
            "cannot open the act lock /data/c.sqlite-custody.lock: Permission denied"
        );
        let refused = sqlx::Error::Io(std::io::Error::from_raw_os_error(111));
        assert_eq!(
            db_text(&refused),
            "error communicating with database: Connection refused"
        );
        let made = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 10 s");
        assert_eq!(io_text(&made), "no answer within 10 s");
    }

    /// SQLite's errors carry its result code by name; "SQLSTATE" is PostgreSQL's word.
    #[tokio::test]
    async fn sqlite_errors_name_their_result_code() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello, not a database\n").unwrap();
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .connect_with(
                sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(&text)
                    .read_only(true),
            )
            .await
            .unwrap();
        let e = sqlx::query("SELECT 1 FROM sqlite_master")
            .fetch_optional(&pool)
            .await
            .unwrap_err();
        assert_eq!(db_text(&e), "file is not a database (SQLITE_NOTADB)");

        for (code, name) in [
            (26, Some("SQLITE_NOTADB")),
            (266, Some("SQLITE_IOERR_READ")),
            (516, Some("SQLITE_ABORT_ROLLBACK")),
            (526, Some("SQLITE_CANTOPEN_ISDIR")),
            (1544, Some("SQLITE_READONLY_DIRECTORY")),
            (3091, Some("SQLITE_CONSTRAINT_DATATYPE")),
            (
                10 | (99 << 8),
                Some("SQLITE_IOERR, extended result code 25354"),
            ),
            (260, Some("SQLITE_ABORT, extended result code 260")),
            (99, None),
        ] {
            assert_eq!(sqlite_code_name(code).as_deref(), name, "{code}");
        }
    }

    #[test]
    fn an_undecodable_requested_channel_skips_the_thread_and_names_it() {
        let channels = BTreeMap::from([
            (
                "basket".to_owned(),
                Channel::Value(serde_json::json!("bsk_1")),
            ),
            (
                "items".to_owned(),
                Channel::Undecodable(DecodeError::malformed("unknown msgpack ext code 42")),
            ),
        ]);
        let Scanned::Skipped(s) = skip_undecodable(parked(channels)) else {
            panic!("not skipped")
        };
        assert_eq!(
            s.to_string(),
            "thread t-1, checkpoint 1f0-c, channel items: decode: unknown msgpack ext code 42"
        );
        assert_eq!(s.kind, DecodeKind::Decode);

        let fine = BTreeMap::from([("basket".to_owned(), Channel::Empty)]);
        assert!(matches!(skip_undecodable(parked(fine)), Scanned::Parked(_)));
    }

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
        // passwords holding URL delimiters, quoted key=value values, sslpassword
        for (dsn, shown) in [
            (
                "postgres://u:hun/ter2@127.0.0.1/x",
                "postgres://u:***@127.0.0.1/x",
            ),
            (
                "postgres://u:hunter2/@127.0.0.1/x",
                "postgres://u:***@127.0.0.1/x",
            ),
            (
                "postgres://u:hun?ter2@127.0.0.1:1/x",
                "postgres://u:***@127.0.0.1:1/x",
            ),
            (
                "postgres://u:p@ss/w0rd@db.example/x",
                "postgres://u:***@db.example/x",
            ),
            (
                "host=127.0.0.1 password='hunter 2' dbname=x",
                "host=127.0.0.1 password=*** dbname=x",
            ),
            (
                "postgres://db/x?sslpassword=hunter4&a=b",
                "postgres://db/x?sslpassword=***&a=b",
            ),
            ("host=db PassWord=hunter3", "host=db PassWord=***"),
        ] {
            assert_eq!(redact_dsn(dsn), shown, "{dsn}");
        }
        // not a URL (a missing colon) nor key=value: the userinfo is still hidden
        assert_eq!(
            redact_dsn("postgres//postgres:hunter2@127.0.0.1/x"),
            "postgres//postgres:***@127.0.0.1/x"
        );
        assert_eq!(
            redact_dsn("postgres:/u:p@ss@db/x?password=y"),
            "postgres:/u:***@db/x?password=***"
        );
        assert_eq!(
            redact_dsn("host=db password=s3cret dbname=lg"),
            "host=db password=*** dbname=lg"
        );
        // a mistyped password keyword is masked too: the error refusing it quotes the DSN
        assert_eq!(
            redact_dsn("host=db passwd=s3cret pwd=s3cret dbname=lg"),
            "host=db passwd=*** pwd=*** dbname=lg"
        );
        assert_eq!(
            redact_dsn("postgres://u@db/lg?pasword=s3cret&pass=s3cret&sslmode=disable"),
            "postgres://u@db/lg?pasword=***&pass=***&sslmode=disable"
        );
        // libpq's keyword/value form: a value ends at unescaped whitespace only, quoted or not
        for (dsn, shown) in [
            (
                r"host=db password=s3c\ ret&x dbname=lg",
                "host=db password=*** dbname=lg",
            ),
            (
                r"host=db password = 's3 cr\'et' dbname=lg",
                "host=db password = *** dbname=lg",
            ),
            (r"password='s3\\' dbname=lg", "password=*** dbname=lg"),
            (
                "host=db password='' dbname=lg",
                "host=db password=*** dbname=lg",
            ),
            (
                "host=db oauth_client_secret=s3cret scram_client_key=c2VjcmV0",
                "host=db oauth_client_secret=*** scram_client_key=***",
            ),
        ] {
            assert_eq!(redact_dsn(dsn), shown, "{dsn}");
        }
        // control characters are shown escaped, on one line
        assert_eq!(
            redact_dsn("postgres://u:hun\tter2@db/lg\n"),
            "postgres://u:***@db/lg\\n"
        );
    }

    /// A DSN is used as written or refused, saying which character and why: a final newline
    /// (an `echo`-written Secret) is not dropped, since libpq would not drop it.
    #[test]
    fn dsns_with_whitespace_at_an_end_or_control_characters_are_refused() {
        // `err()`: a CheckedDsn has no Debug, which would print the password.
        let refused = |backend, dsn: &str| check_dsn(backend, dsn).err().unwrap().to_string();
        let libpq = "libpq (LangGraph's PostgresSaver connects through it) would read it as part \
                     of the DSN and fail, so custody does not drop it either";
        let echo = "store the DSN without it (echo writes one; echo -n and printf '%s' do not)";
        assert_eq!(
            refused(Backend::Postgres, "postgres://app:hunter2@db/lg\n"),
            format!(
                "invalid postgres DSN postgres://app:***@db/lg\\n: it ends with a newline: \
                 {libpq}; {echo}"
            )
        );
        assert_eq!(
            refused(Backend::Postgres, "postgres://app:hun\tter2@db/lg"),
            format!(
                "invalid postgres DSN postgres://app:***@db/lg: it holds the control character \
                 \\t at byte 18, in the password (shown as ***): {libpq}; remove it, or \
                 percent-encode it (%09) where a value holds it"
            )
        );
        assert!(
            refused(Backend::Postgres, " postgres://db/lg")
                .contains(": it starts with whitespace: ")
        );
        assert!(refused(Backend::Postgres, "postgres://db/l\tg").contains("\\t at byte 15: libpq"));
        assert_eq!(
            refused(Backend::Sqlite, "sqlite://c.sqlite\r\n"),
            format!(
                "invalid sqlite DSN sqlite://c.sqlite\\r\\n: it ends with a newline: it would be \
                 part of the file name; {echo}"
            )
        );
        assert!(refused(Backend::Sqlite, "c.sqlite ").contains(": it ends with a space: "));
        assert!(check_dsn(Backend::Postgres, "postgres://app:p%0A@db/lg").is_ok());
        assert!(check_dsn(Backend::Sqlite, "my checkpoints.sqlite").is_ok());
    }
}
