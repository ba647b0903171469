//! PostgresSaver tables (`langgraph-checkpoint-postgres` 3.2, migrations v0–v9).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::LazyLock;
use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow, PgValueFormat};
use sqlx::{ConnectOptions, Connection, Row, ValueRef};

use super::doc::{LATEST_FORMAT, parse_ts};
use super::{
    Channel, CheckedDsn, DecodeError, Head, MAX_VALUE_BYTES, Scanned, Shard, SkippedThread,
    StoreError, classify_head, config_text, parse_metadata, typed,
};

/// Highest `checkpoint_migrations.v` this reader was verified against; newer is read with a
/// warning since every migration so far only added tables, indexes and columns.
pub const KNOWN_MIGRATION: i32 = 9;
/// Lowest version whose tables (checkpoints, checkpoint_blobs, checkpoint_writes) we query.
const REQUIRED_MIGRATION: i32 = 3;

/// The statement of a scan for `channels` requested channels. One statement finds the latest
/// root checkpoint per thread (an index-only scan of the primary key grouped by thread), keeps
/// those with a pending interrupt or an `update_state` edit, and fetches each requested channel's
/// blob by primary key. Why this shape and not `DISTINCT ON`: the anti-join form degrades
/// quadratically (BENCHMARKS.md, "The query").
///
/// Parameters: `$1` the requested channel names (`text[]`; channel k reads `$1[k+1]`), `$2`/`$3`
/// the shard count and index, `$4` the largest blob, document or metadata fetched (bytes; over
/// it, only the size as JSON text, and a thread whose document is over it is skipped whole, as
/// on SQLite). Columns: [`Col`] in order,
/// then five per requested channel ([`ChannelCols`]).
///
/// The checkpoint document itself is returned only when the sweep needs more of it than the
/// columns carry: for a thread without a pending interrupt (its next nodes decide whether an
/// edit left it parked) and for a document that is not of the current format with
/// `channel_versions` and `channel_values` objects (the typed decoder then reads older formats
/// and names what is wrong). Converting the ~1 KB JSONB document to text for every thread was a
/// third of the database's work (BENCHMARKS.md, run 3). `@>` walks the document in place. A
/// channel's version and inline value are read with `->` twice, not `#>` with a path array:
/// the array is taken apart on every call, which costs more than copying the small
/// `channel_versions`/`channel_values` object the first `->` returns (BENCHMARKS.md, run 6).
/// The two differ only on an array (`#>` takes an index there), and neither result is used
/// then: the columns only for a document of the plain shape, where both are objects; the blob
/// only for a document the typed decoder accepts, which refuses a `channel_versions` that is
/// not an object.
///
/// With [`ScanPlan::Indexed`] only the `latest` step differs: the candidate threads are read
/// from the two partial indexes of [`PARKED_INDEXES`] instead of from every thread's
/// checkpoints (see [`latest_sql`]); the rest, and so the rule and the rows, are the same.
pub(super) fn parked_sql(channels: usize, plan: ScanPlan) -> String {
    use std::fmt::Write as _;
    let mut columns = String::new();
    let mut blobs = String::new();
    for k in 1..=channels {
        let name = format!("($1::text[])[{k}]");
        let _ = write!(
            columns,
            ",\n       CASE WHEN c.fits THEN c.checkpoint -> 'channel_versions' -> {name} END,\n       CASE WHEN c.fits THEN c.checkpoint -> 'channel_values' -> {name} END,\n       b{k}.type, b{k}.blob, b{k}.size"
        );
        let _ = write!(
            blobs,
            r#"
LEFT JOIN LATERAL (
    -- A blob over $4 bytes is not fetched, only its size (octet_length reads the TOAST header).
    SELECT b.type, CASE WHEN octet_length(b.blob) <= $4 THEN b.blob END AS blob, octet_length(b.blob) AS size
    FROM checkpoint_blobs b
    WHERE b.thread_id = l.thread_id AND b.checkpoint_ns = '' AND b.channel = {name}
      AND b.version = c.checkpoint -> 'channel_versions' ->> {name}
    OFFSET 0
) b{k} ON true"#
        );
    }
    let plain =
        format!(r#"{{"v": {LATEST_FORMAT}, "channel_versions": {{}}, "channel_values": {{}}}}"#);
    let latest = latest_sql(plan);
    format!(
        r#"
WITH {latest}
SELECT l.thread_id, l.checkpoint_id,
       CASE WHEN c.fits AND (p.task_id IS NULL OR NOT coalesce(c.checkpoint @> '{plain}', false))
            THEN coalesce(c.checkpoint, 'null') END,
       CASE WHEN c.fits THEN c.checkpoint -> 'ts' END,
       CASE WHEN coalesce(c.metadata_size, 0) <= $4 THEN c.metadata END,
       (p.task_id IS NOT NULL),
       CASE WHEN c.metadata_size > $4 THEN c.metadata_size END,
       CASE WHEN NOT c.fits THEN c.size END{columns}
FROM latest l
CROSS JOIN LATERAL (
    -- A document or metadata over $4 bytes of JSON text is not fetched, nor is any part of
    -- the document (an inline value can be most of it), only the size. The text length is
    -- computed only past 32 KiB stored (compression shrinks JSON at most ~255x, so anything
    -- smaller is under $4 as text).
    SELECT y.*, coalesce(y.size, 0) <= $4 AS fits FROM (
        SELECT x.checkpoint, x.metadata,
               CASE WHEN pg_column_size(x.checkpoint) > 32768 THEN octet_length(x.checkpoint::text) END AS size,
               CASE WHEN pg_column_size(x.metadata) > 32768 THEN octet_length(x.metadata::text) END AS metadata_size
        FROM checkpoints x
        WHERE x.thread_id = l.thread_id AND x.checkpoint_ns = '' AND x.checkpoint_id = l.checkpoint_id
    -- OFFSET 0 keeps this a primary-key lookup per thread, in thread order. Without it the
    -- planner underestimates `latest` ~50x, turns this into a hash join over a scan of all of
    -- checkpoints and sorts the wide rows on disk (no first row for 28 s at 1M threads;
    -- BENCHMARKS.md, "The query").
        OFFSET 0
    ) y
) c
LEFT JOIN LATERAL (
    SELECT w.task_id FROM checkpoint_writes w
    WHERE w.thread_id = l.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = l.checkpoint_id
    GROUP BY w.task_id
    HAVING bool_or(w.channel = '__interrupt__')
       AND NOT bool_or(w.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
    LIMIT 1
) p ON true{blobs}
WHERE p.task_id IS NOT NULL OR c.metadata ->> 'source' = 'update'
ORDER BY l.thread_id
"#
    )
}

/// The shard filter on `col` ($2 = count, $3 = index): sha256(thread_id)[0..4] as an unsigned
/// big-endian integer, modulo the count (`Shard::contains`). Applied in the index scans, so a
/// shard looks up only its own threads' rows; with one shard the OR short-circuits.
fn shard_sql(col: &str) -> String {
    format!(
        "($2::int = 1\n           OR ('x' || encode(substr(sha256(convert_to({col}, 'UTF8')), 1, 4), 'hex'))::bit(32)::bigint % $2 = $3)"
    )
}

/// The `latest` step of [`parked_sql`]: (thread_id, checkpoint_id) of the latest root
/// checkpoint of each thread that may be parked (the final `ORDER BY` sorts them by thread).
///
/// [`ScanPlan::Full`]: every thread (an index-only scan of the primary key grouped by thread).
///
/// [`ScanPlan::Indexed`]: the threads in the partial indexes of [`PARKED_INDEXES`] (every root
/// `__interrupt__` write, every root checkpoint whose metadata `source` is `update`), kept
/// when their latest checkpoint (one primary-key probe per thread and index) is one of their
/// rows there. That keeps exactly the threads the final `WHERE` of
/// [`parked_sql`] can keep: a pending interrupt needs an `__interrupt__` write on the latest
/// checkpoint, an edit needs `source = 'update'` on it. An interrupt answered long ago (the
/// thread resumed since) costs its index entry and the probe, never a row, so the cost grows
/// with the threads ever interrupted or edited, not with the threads stored. The predicates
/// repeat the indexes' `WHERE` clauses so that the planner can match them.
fn latest_sql(plan: ScanPlan) -> String {
    match plan {
        ScanPlan::Full => format!(
            r#"latest AS (
    SELECT thread_id, max(checkpoint_id) AS checkpoint_id
    FROM checkpoints
    WHERE checkpoint_ns = ''
      AND {}
    GROUP BY thread_id
)"#,
            shard_sql("thread_id")
        ),
        ScanPlan::Indexed => format!(
            r#"candidates AS (
    -- Grouped per index, in its (thread_id, checkpoint_id) order: one probe per thread below,
    -- not per answered interrupt.
    SELECT w.thread_id, array_agg(w.checkpoint_id) AS ids FROM checkpoint_writes w
    WHERE w.checkpoint_ns = '' AND w.channel = '__interrupt__'
      AND {}
    GROUP BY w.thread_id
    UNION ALL
    SELECT u.thread_id, array_agg(u.checkpoint_id) FROM checkpoints u
    WHERE u.checkpoint_ns = '' AND (u.metadata ->> 'source') = 'update'
      AND {}
    GROUP BY u.thread_id
),
latest AS (
    -- A thread in both indexes whose latest checkpoint is in both (an interrupted edit) comes
    -- out once.
    SELECT DISTINCT e.thread_id, m.checkpoint_id
    FROM candidates e
    CROSS JOIN LATERAL (
        SELECT max(k.checkpoint_id) AS checkpoint_id FROM checkpoints k
        WHERE k.thread_id = e.thread_id AND k.checkpoint_ns = ''
    ) m
    WHERE m.checkpoint_id = ANY (e.ids)
    -- Sorted here, on these narrow rows, so that the lookups below come out in thread order and
    -- the final ORDER BY sorts nothing (sorting the wide rows spilled to disk at 10k parked).
    ORDER BY e.thread_id
)"#,
            shard_sql("w.thread_id"),
            shard_sql("u.thread_id")
        ),
    }
}

/// Which statement a scan of a PostgresSaver database runs, chosen when the reader connects
/// from the indexes present ([`PARKED_INDEXES`]). Both return the same rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScanPlan {
    /// Reads the latest checkpoint of every thread: the cost grows with the threads stored.
    Full,
    /// Starts from the optional partial indexes: the cost grows with the threads ever
    /// interrupted or edited, and documents, writes and blobs are read for the parked only.
    Indexed,
}

/// The optional partial indexes a DBA may add for [`ScanPlan::Indexed`], as (name, table,
/// statement). custody never creates them (it never writes to LangGraph's tables); it uses
/// them when both exist under these names, on these tables, and are valid (a failed
/// `CREATE INDEX CONCURRENTLY` leaves an invalid one). README, "A sweep that reads only what is
/// parked", gives their size and their write cost.
pub const PARKED_INDEXES: [(&str, &str, &str); 2] = [
    (
        "custody_interrupts",
        "checkpoint_writes",
        "CREATE INDEX CONCURRENTLY custody_interrupts ON checkpoint_writes (thread_id, checkpoint_id) WHERE checkpoint_ns = '' AND channel = '__interrupt__'",
    ),
    (
        "custody_updates",
        "checkpoints",
        "CREATE INDEX CONCURRENTLY custody_updates ON checkpoints (thread_id, checkpoint_id) WHERE checkpoint_ns = '' AND (metadata ->> 'source') = 'update'",
    ),
];

/// Whether every index of [`PARKED_INDEXES`] is there: looked up by name on the connection's
/// `search_path` (where the statement's unqualified table names resolve), on the right table,
/// valid and ready.
async fn detect_plan(pool: &PgPool) -> Result<ScanPlan, sqlx::Error> {
    for (name, table, _) in PARKED_INDEXES {
        let ok: Option<bool> = sqlx::query_scalar(
            "SELECT x.indisvalid AND x.indisready AND x.indrelid = to_regclass($2)
             FROM pg_index x WHERE x.indexrelid = to_regclass($1)",
        )
        .bind(name)
        .bind(table)
        .fetch_optional(pool)
        .await?;
        if ok != Some(true) {
            return Ok(ScanPlan::Full);
        }
    }
    Ok(ScanPlan::Indexed)
}

/// The leading columns of [`parked_sql`], by position.
#[derive(Clone, Copy)]
enum Col {
    ThreadId,
    CheckpointId,
    /// The whole document, or NULL when the columns carry what the sweep needs.
    Checkpoint,
    /// `checkpoint.ts` (JSON).
    Ts,
    /// NULL when SQL NULL or over the limit (then [`Col::MetadataSize`] is set).
    Metadata,
    PendingInterrupt,
    /// The metadata's size as JSON text when over the limit, else NULL.
    MetadataSize,
    /// The document's size as JSON text when over the limit, else NULL; then no part of the
    /// document is fetched.
    DocSize,
}

/// Number of [`Col`] columns; requested channels' columns follow.
const COLS: usize = Col::DocSize as usize + 1;

/// The five columns of requested channel `k` (0-based) in [`parked_sql`]'s output.
struct ChannelCols(usize);

impl ChannelCols {
    /// `channel_versions[name]` (JSON), NULL when absent.
    fn version(&self) -> usize {
        COLS + 5 * self.0
    }
    /// `channel_values[name]` (JSON): the inline value of a primitive, NULL when not inline.
    fn inline(&self) -> usize {
        self.version() + 1
    }
    /// The blob's serializer type, NULL without a blob.
    fn blob_type(&self) -> usize {
        self.version() + 2
    }
    /// The blob, NULL when over the limit.
    fn blob(&self) -> usize {
        self.version() + 3
    }
    /// The blob's size in bytes.
    fn size(&self) -> usize {
        self.version() + 4
    }
}

/// How long connecting to the database may take, the first connection and the pool's alike,
/// when the DSN sets no positive `connect_timeout`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long connecting may take for `dsn`: its `connect_timeout` in seconds when positive, as
/// libpq reads it (whitespace and a sign allowed; 1 is taken as 2, libpq's minimum), else
/// [`CONNECT_TIMEOUT`]. sqlx does not read the parameter, so custody applies it. libpq waits
/// forever for 0 or a negative value; custody keeps its bound, so that a database that never
/// answers costs its own timeout, not a sweep Job's whole deadline.
pub(crate) fn connect_timeout(dsn: &str) -> Duration {
    url::Url::parse(dsn)
        .ok()
        .and_then(|url| {
            url.query_pairs()
                .find(|(key, _)| key == "connect_timeout")
                .and_then(|(_, value)| value.trim().parse::<i64>().ok())
        })
        .filter(|seconds| *seconds > 0)
        .map_or(CONNECT_TIMEOUT, |seconds| {
            Duration::from_secs(seconds.max(2).unsigned_abs())
        })
}

/// libpq's connection parameter keywords (libpq docs, "Parameter Key Words", §34.1.2 in
/// PostgreSQL 16; PostgreSQL 18's included, those it removed not): libpq refuses any other
/// keyword in a keyword/value DSN (`invalid connection option`), so custody does too, where sqlx
/// would ignore it.
const LIBPQ_KEYWORDS: [&str; 51] = [
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "passfile",
    "require_auth",
    "channel_binding",
    "connect_timeout",
    "client_encoding",
    "options",
    "application_name",
    "fallback_application_name",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
    "replication",
    "gssencmode",
    "sslmode",
    "sslnegotiation",
    "sslcompression",
    "sslcert",
    "sslkey",
    "sslkeylogfile",
    "sslpassword",
    "sslcertmode",
    "sslrootcert",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "requirepeer",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "min_protocol_version",
    "max_protocol_version",
    "krbsrvname",
    "gsslib",
    "gssdelegation",
    "scram_client_key",
    "scram_server_key",
    "service",
    "servicefile",
    "target_session_attrs",
    "load_balance_hosts",
    "oauth_issuer",
    "oauth_client_id",
    "oauth_client_secret",
    "oauth_scope",
];

/// Whether `dsn` is in libpq's keyword/value form rather than a URL: it starts with a word and
/// `=` (`host=db …`, `dbname = lg`). libpq takes everything but a `postgresql://` or
/// `postgres://` URL for this form; custody asks for the word first, so that a mistyped URL
/// (`postgres//u:pw@db/lg?sslmode=require`, `mysql://…`) is refused as a URL of the wrong
/// kind, without its text quoted in the reason as a keyword.
pub(crate) fn is_keyword_value(dsn: &str) -> bool {
    static FORM: LazyLock<regex::Regex> =
        LazyLock::new(|| regex::Regex::new(r"^\s*[A-Za-z_]+\s*=").expect("a valid regex"));
    FORM.is_match(dsn)
}

/// libpq's keyword/value connection string (`host=db port=5432 dbname=lg user=app
/// password='a b'`; libpq docs, "Keyword/Value Connection Strings", §34.1.1.1 in PostgreSQL
/// 16), which LangGraph's PostgresSaver (psycopg, so libpq) takes as readily as a URL,
/// rewritten once as the URL sqlx reads: every keyword a query parameter of `postgres://?…`, percent-encoded
/// (sqlx reads `host`, `port`, `dbname`, `user`, `password`, `sslmode`, `sslrootcert`,
/// `sslcert`, `sslkey`, `application_name` and `options` there as from the URL's own parts;
/// custody reads `connect_timeout` and checks libpq's integers, [`check_parameters`]). As in
/// libpq, `keyword = value` pairs are separated by whitespace, a value may be single-quoted
/// (`''` is empty), `\'` and `\\` escape inside quotes and out, and a keyword given twice
/// takes its last value. `Ok(None)` for a DSN that is not in this form ([`is_keyword_value`]).
///
/// Our own parser: sqlx parses URLs only, and tokio-postgres, whose `Config` reads this form,
/// would be a second PostgreSQL driver kept for one parse; no small crate parses it as libpq
/// does.
///
/// # Errors
/// What is wrong, naming the keyword, never a value: a keyword without `=` after it, a quoted
/// value not closed, a keyword libpq does not know ([`LIBPQ_KEYWORDS`]); and what custody
/// cannot do as libpq would, so it would connect elsewhere or as another role than the agent:
/// `service`/`servicefile` (a `pg_service.conf` entry), `passfile`, `hostaddr`, and more than
/// one host or port (`host=a,b`).
pub(crate) fn keyword_value_url(dsn: &str) -> Result<Option<String>, String> {
    if !is_keyword_value(dsn) {
        return Ok(None);
    }
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (keyword, value) in keyword_values(dsn)? {
        refuse_unsupported(&keyword, &value)?;
        // libpq keeps a keyword's last value; sqlx would join two `options`.
        pairs.retain(|(k, _)| *k != keyword);
        pairs.push((keyword, value));
    }
    let mut url = url::Url::parse("postgres://").expect("a valid URL");
    url.query_pairs_mut().extend_pairs(&pairs);
    Ok(Some(url.to_string()))
}

/// libpq's `isspace`, which separates keyword/value pairs (ASCII only: a no-break space is part
/// of a value).
fn libpq_space(c: &char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0B' | '\x0C' | '\r')
}

/// The keyword/value pairs of `dsn`, unquoted and unescaped, as libpq's `conninfo_parse` reads
/// them, each keyword one libpq knows.
///
/// # Errors
/// As [`keyword_value_url`]'s first three.
fn keyword_values(dsn: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut rest = dsn.char_indices().peekable();
    loop {
        while rest.next_if(|(_, c)| libpq_space(c)).is_some() {}
        let Some(&(at, _)) = rest.peek() else {
            return Ok(pairs);
        };
        let mut keyword = String::new();
        while let Some((_, c)) = rest.next_if(|(_, c)| !libpq_space(c) && *c != '=') {
            keyword.push(c);
        }
        // Only a word is quoted back: other text (a URL pasted after a keyword) may hold the
        // password.
        let word =
            !keyword.is_empty() && keyword.chars().all(|c| c.is_ascii_alphabetic() || c == '_');
        let named = if word {
            format!("\"{keyword}\"")
        } else {
            format!("the text at byte {at}")
        };
        while rest.next_if(|(_, c)| libpq_space(c)).is_some() {}
        if rest.next().map(|(_, c)| c) != Some('=') {
            return Err(format!(
                "missing \"=\" after {named} (libpq's keyword/value form is keyword=value pairs separated by spaces)"
            ));
        }
        if !LIBPQ_KEYWORDS.contains(&keyword.as_str()) {
            let lower = keyword.to_ascii_lowercase();
            let hint = if word && LIBPQ_KEYWORDS.contains(&lower.as_str()) {
                format!(": libpq's keywords are lowercase, {lower}")
            } else {
                String::new()
            };
            return Err(format!(
                "{named} is no libpq connection keyword, which libpq refuses (invalid connection option){hint}"
            ));
        }
        while rest.next_if(|(_, c)| libpq_space(c)).is_some() {}
        let mut value = String::new();
        if rest.next_if(|(_, c)| *c == '\'').is_some() {
            loop {
                match rest.next().map(|(_, c)| c) {
                    Some('\\') => value.extend(rest.next().map(|(_, c)| c)),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => {
                        return Err(format!(
                            "the quoted value of {keyword} is not closed (a final ' is missing)"
                        ));
                    }
                }
            }
        } else {
            while let Some((_, c)) = rest.next_if(|(_, c)| !libpq_space(c)) {
                if c == '\\' {
                    value.extend(rest.next().map(|(_, c)| c));
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((keyword, value));
    }
}

/// A keyword/value entry custody cannot honour as libpq does, said with what to write instead.
fn refuse_unsupported(keyword: &str, value: &str) -> Result<(), String> {
    let reason = match keyword {
        "service" | "servicefile" => format!(
            "{keyword} names a pg_service.conf entry, which custody does not read: write its host, port, dbname and user in the DSN"
        ),
        "passfile" => "passfile names a password file, which custody does not read (it reads PGPASSFILE, else ~/.pgpass): write the password in the DSN".to_owned(),
        "hostaddr" => "hostaddr is not supported: custody's driver would take the address for the host name, also for the server certificate and ~/.pgpass, where libpq uses host; write the address as host".to_owned(),
        "host" | "port" if value.contains(',') => format!(
            "{keyword} lists {} values ({value}): libpq tries several hosts in turn, custody connects to one; write the one the agent's checkpoints are on",
            value.split(',').count()
        ),
        _ => return Ok(()),
    };
    Err(reason)
}

/// A read-only pool on a PostgresSaver database.
pub struct Reader {
    pool: PgPool,
    plan: ScanPlan,
}

/// The connect options of a PostgresSaver DSN, for the reader and for custody's writable pool:
/// its parameters checked first ([`check_parameters`]), `application_name` custody, and sqlx's
/// statement logging off: it logs each statement slower than 1 s at WARN with its whole SQL
/// text, and a scan of a large store takes longer by design (BENCHMARKS.md), as does any
/// statement waiting on a lock another session holds.
///
/// # Errors
/// [`StoreError::Dsn`], saying what is wrong, never with the password.
pub(crate) fn connect_options(dsn: &CheckedDsn<'_>) -> Result<PgConnectOptions, StoreError> {
    let invalid = |reason: String| StoreError::Dsn {
        backend: "postgres",
        dsn: dsn.shown.clone(),
        reason,
    };
    let url = &*dsn.driver;
    check_parameters(url).map_err(invalid)?;
    let options = PgConnectOptions::from_str(url)
        .map_err(|e| invalid(strip_dsn(&config_text(&e), url, &dsn.shown)))?;
    Ok(options
        .application_name("custody")
        .disable_statement_logging())
}

/// libpq's parameters that take a whole number. sqlx does not read them (custody's own timeouts
/// apply), but libpq, through which LangGraph's PostgresSaver connects with the same DSN,
/// refuses any other value (`invalid integer value "abc" for connection option
/// "connect_timeout"`).
const LIBPQ_INTEGERS: [&str; 6] = [
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
];

/// A DSN parameter whose value libpq or sqlx refuses, said as the DSN spells it with what it
/// takes: sqlx's own parse errors for `port`, `hostaddr` and `statement-cache-capacity` do not
/// name the parameter (`invalid digit found in string`), and it ignores [`LIBPQ_INTEGERS`]
/// whatever their value. `sslmode` is sqlx's to check ([`config_text`] names it). A DSN that is
/// no URL is left to sqlx, which says why.
fn check_parameters(dsn: &str) -> Result<(), String> {
    let Ok(url) = url::Url::parse(dsn) else {
        return Ok(());
    };
    for (key, value) in url.query_pairs() {
        let wanted = match &*key {
            // libpq's `parse_int_param`: whitespace around, a sign, digits, within an int.
            k if LIBPQ_INTEGERS.contains(&k) => value
                .trim_matches(|c: char| c.is_ascii_whitespace())
                .parse::<i32>()
                .is_err()
                .then_some("a whole number, as libpq (through which LangGraph's PostgresSaver connects) requires"),
            "port" => (value.parse::<u16>().unwrap_or(0) == 0).then_some("a port number, 1 to 65535"),
            "hostaddr" => value
                .parse::<std::net::IpAddr>()
                .is_err()
                .then_some("an IP address"),
            "statement-cache-capacity" => value
                .parse::<usize>()
                .is_err()
                .then_some("a whole number, at least 0"),
            _ => None,
        };
        if let Some(wanted) = wanted {
            return Err(format!("{key} is {value:?}, not {wanted}"));
        }
    }
    Ok(())
}

/// Where sqlx connects with `options` (`host:port`, or the Unix socket), for a failed connect
/// whose DSN does not spell it: sqlx, as libpq, fills in what the DSN leaves out from `PGHOST`
/// and `PGPORT`, else a local socket directory that exists or `localhost`, and port 5432.
/// `None` when the DSN's own text shows it.
fn address(dsn: &str, options: &PgConnectOptions) -> Option<String> {
    let (port, host) = (options.get_port(), options.get_host());
    // A socket is always named: a DSN spells its directory, never the file in it.
    let (at, shown) = match options.get_socket() {
        Some(dir) => {
            let path = format!("{}/.s.PGSQL.{port}", dir.display());
            (format!("the socket {path}"), path)
        }
        None if host.starts_with('/') => {
            let path = format!("{host}/.s.PGSQL.{port}");
            (format!("the socket {path}"), path)
        }
        // An IPv6 address from the environment; a URL's keeps its brackets.
        None if host.contains(':') && !host.starts_with('[') => {
            (format!("[{host}]:{port}"), format!("[{host}]:{port}"))
        }
        None => (format!("{host}:{port}"), format!("{host}:{port}")),
    };
    let names_host = url::Url::parse(dsn).is_ok_and(|url| {
        url.host_str().is_some_and(|h| !h.is_empty())
            || url
                .query_pairs()
                .any(|(k, _)| k == "host" || k == "hostaddr")
    });
    if names_host && dsn.contains(&shown) {
        return None;
    }
    Some(if names_host {
        at
    } else {
        format!("{at} (the DSN names no host: PGHOST and PGPORT when set, else libpq's defaults)")
    })
}

/// [`StoreError::Connect`] for a failed connect with `options`, naming where it connected when
/// the DSN does not ([`address`]).
pub(crate) fn connect_error(
    dsn: &CheckedDsn<'_>,
    options: &PgConnectOptions,
    source: sqlx::Error,
) -> StoreError {
    StoreError::Connect {
        dsn: dsn.shown.clone(),
        address: address(&dsn.driver, options),
        source,
    }
}

impl Reader {
    pub(super) async fn connect(dsn: &CheckedDsn<'_>) -> Result<Self, StoreError> {
        let shown = &dsn.shown;
        // The reader must never write: the server enforces it for every statement.
        let options = connect_options(dsn)?.options([("default_transaction_read_only", "on")]);
        // A pool retries a failed connect until its acquire timeout and then says only "pool
        // timed out"; one direct connection first says why (refused at host:port, an unknown
        // host, a rejected password) at once.
        let timeout = connect_timeout(&dsn.driver);
        let first = tokio::time::timeout(timeout, options.connect())
            .await
            .unwrap_or_else(|_| {
                Err(sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {} s", timeout.as_secs()),
                )))
            })
            .map_err(|source| connect_error(dsn, &options, source))?;
        // Only a check: the pool opens its own.
        let _ = first.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(timeout)
            .connect_with(options.clone())
            .await
            .map_err(|source| connect_error(dsn, &options, source))?;
        let version: Result<Option<i32>, sqlx::Error> =
            sqlx::query_scalar("SELECT max(v) FROM checkpoint_migrations")
                .fetch_one(&pool)
                .await;
        match version {
            Ok(Some(v)) if v >= REQUIRED_MIGRATION => {
                if v > KNOWN_MIGRATION {
                    tracing::warn!(
                        "{shown}: LangGraph's checkpoint schema is at migration {v}, newer than \
                         the {KNOWN_MIGRATION} custody knows; reading it anyway"
                    );
                }
                let plan = detect_plan(&pool).await.map_err(StoreError::Query)?;
                // Debug: the controller connects on every store reconcile.
                tracing::debug!(
                    dsn = %shown,
                    plan = ?plan,
                    "PostgreSQL scan plan (Indexed: the optional partial indexes custody_interrupts and custody_updates are there; Full: the plain scan)"
                );
                Ok(Self { pool, plan })
            }
            Ok(v) => Err(StoreError::Schema(format!(
                "{shown}: {}, older than {REQUIRED_MIGRATION}; run PostgresSaver.setup() with langgraph-checkpoint-postgres 3.x",
                match v {
                    Some(v) => format!("the latest LangGraph checkpoint migration recorded is {v}"),
                    None => "checkpoint_migrations records no LangGraph migration".to_owned(),
                }
            ))),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => {
                Err(StoreError::Schema(format!(
                    "{shown}: no LangGraph checkpoint tables (checkpoint_migrations is missing); is this the PostgresSaver database?"
                )))
            }
            Err(e) => Err(StoreError::Query(e)),
        }
    }

    /// What an acting sweep's writes would meet that refuses them: a hot standby, or the grants
    /// of README "Database privileges" the role lacks (`INSERT ON checkpoints`, …, `CREATE ON
    /// SCHEMA public` while custody's tables do not exist yet). Asked of the server's privilege
    /// functions, so nothing is written.
    pub(super) async fn write_refusals(&self) -> Result<super::WriteRefusals, sqlx::Error> {
        let (hot_standby, missing_grants) = sqlx::query_as(
            "SELECT pg_is_in_recovery(), array_remove(ARRAY[
                 CASE WHEN NOT has_table_privilege('checkpoints', 'INSERT')
                      THEN 'INSERT ON checkpoints' END,
                 CASE WHEN NOT has_table_privilege('checkpoint_blobs', 'INSERT')
                      THEN 'INSERT ON checkpoint_blobs' END,
                 CASE WHEN NOT has_table_privilege('checkpoint_writes', 'INSERT')
                      THEN 'INSERT ON checkpoint_writes' END,
                 CASE WHEN to_regclass('custody_migrations') IS NULL
                       AND NOT has_schema_privilege(current_schema(), 'CREATE')
                      THEN 'CREATE ON SCHEMA ' || current_schema() END
             ], NULL)",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok(super::WriteRefusals {
            hot_standby,
            missing_grants,
        })
    }

    /// The statement this reader's scans run.
    pub(super) fn plan(&self) -> ScanPlan {
        self.plan
    }

    pub(super) async fn close(self) {
        self.pool.close().await;
    }

    pub(super) fn parked_threads<'a>(
        &'a self,
        channels: &'a [String],
        shard: Shard,
    ) -> BoxStream<'a, Result<Scanned, StoreError>> {
        // Only the channel count varies the text; the names are bound. The text is built by
        // custody alone (no input reaches it), so it is SQL-safe.
        sqlx::query(sqlx::AssertSqlSafe(parked_sql(channels.len(), self.plan)))
            .bind(channels.to_vec())
            .bind(i32::try_from(shard.count()).expect("shard count <= MAX_SHARDS"))
            .bind(i64::from(shard.index()))
            .bind(i32::try_from(MAX_VALUE_BYTES).unwrap_or(i32::MAX))
            .fetch(&self.pool)
            .filter_map(move |row| async move {
                match row {
                    Ok(row) => decode_row(&row, channels).transpose(),
                    Err(e) => Some(Err(StoreError::Query(e))),
                }
            })
            .boxed()
    }
}

/// sqlx echoes the offending DSN, `url`, in some parse errors; never let the password through,
/// and show the DSN as written (`shown`, redacted), not the URL made of a keyword/value DSN.
fn strip_dsn(message: &str, url: &str, shown: &str) -> String {
    message.replace(url, shown)
}

/// The text of a `json`/`jsonb` column at `column`, borrowed from the row: binary `jsonb` is a
/// version byte (1) and the JSON text. `None` for SQL NULL.
fn json_bytes(row: &PgRow, column: usize) -> Result<Option<&[u8]>, StoreError> {
    let raw = row.try_get_raw(column)?;
    if raw.is_null() {
        return Ok(None);
    }
    let bytes = raw
        .as_bytes()
        .map_err(|e| StoreError::Query(sqlx::Error::Decode(e)))?;
    Ok(Some(match bytes.split_first() {
        Some((1, text)) if raw.format() == PgValueFormat::Binary => text,
        _ => bytes,
    }))
}

/// What the sweep needs of a plain document ([`parked_sql`] returned no `checkpoint`), from
/// the projected columns. The fields read (`ts`, the requested channels' versions and inline
/// values) follow the rules of [`typed::decode`]; fields a sweep of an interrupted thread does
/// not use (`id`, where the row's `checkpoint_id` stands in; `versions_seen`; other channels'
/// versions) are not read, so a fault there skips the thread on SQLite and not here. The outer
/// error is the database's, the inner one the thread's (it is skipped).
fn projected_view<'r>(
    row: &'r PgRow,
    requested: &'r [String],
) -> Result<Result<typed::DocView<'r>, DecodeError>, StoreError> {
    let mut view = typed::DocView {
        id: Some(Cow::Borrowed(
            row.try_get::<&str, _>(Col::CheckpointId as usize)?,
        )),
        ..typed::DocView::default()
    };
    if let Some(ts) = json_bytes(row, Col::Ts as usize)? {
        match typed::ts(ts) {
            Ok(ts) => view.ts = ts,
            Err(e) => return Ok(Err(e)),
        }
    }
    for (k, name) in requested.iter().enumerate() {
        let cols = ChannelCols(k);
        if let Some(version) = json_bytes(row, cols.version())? {
            match typed::version(version) {
                Ok(v) => view.versions.push((Cow::Borrowed(name.as_str()), v)),
                Err(e) => return Ok(Err(e)),
            }
        }
        if let Some(text) = json_bytes(row, cols.inline())? {
            match serde_json::from_slice(text) {
                Ok(value) => view.inline.push((k, value)),
                Err(e) => {
                    return Ok(Err(DecodeError::malformed(format!(
                        "checkpoint channel_values is not JSON: {e}"
                    ))));
                }
            }
        }
    }
    Ok(Ok(view))
}

fn decode_row(row: &PgRow, requested: &[String]) -> Result<Option<Scanned>, StoreError> {
    let thread_id: String = row.try_get(Col::ThreadId as usize)?;
    let checkpoint_id: String = row.try_get(Col::CheckpointId as usize)?;
    let metadata = json_bytes(row, Col::Metadata as usize)?;
    let pending: bool = row.try_get(Col::PendingInterrupt as usize)?;

    let skip = |error: DecodeError| {
        Ok(Some(Scanned::Skipped(SkippedThread::new(
            thread_id.clone(),
            checkpoint_id.clone(),
            None,
            error,
        ))))
    };
    if let Some(size) = row.try_get::<Option<i32>, _>(Col::DocSize as usize)? {
        return skip(DecodeError::too_large(
            "the checkpoint document",
            usize::try_from(size).unwrap_or(usize::MAX),
        ));
    }
    let doc = match json_bytes(row, Col::Checkpoint as usize)? {
        // Typed straight from the row's bytes: no `Value` tree of the whole document (typed.rs).
        Some(checkpoint) => match typed::decode(checkpoint, requested) {
            Ok(doc) => doc,
            Err(e) => return skip(e),
        },
        None => match projected_view(row, requested)? {
            Ok(doc) => doc,
            Err(e) => return skip(e),
        },
    };
    let metadata_size: Option<i32> = row.try_get(Col::MetadataSize as usize)?;
    if let (None, Some(size)) = (metadata, metadata_size) {
        return skip(DecodeError::too_large(
            "the checkpoint metadata",
            usize::try_from(size).unwrap_or(usize::MAX),
        ));
    }
    let metadata = match parse_metadata(metadata) {
        Ok(m) => m,
        Err(e) => return skip(e),
    };

    let mut channels = BTreeMap::new();
    for (k, name) in requested.iter().enumerate() {
        let cols = ChannelCols(k);
        let Some(type_) = row.try_get::<Option<String>, _>(cols.blob_type())? else {
            continue;
        };
        let blob: Option<&[u8]> = row.try_get(cols.blob())?;
        let size: Option<i32> = row.try_get(cols.size())?;
        let decoded = match (blob, size) {
            (None, Some(size)) => Err(DecodeError::too_large(
                &format!("the {type_} blob"),
                usize::try_from(size).unwrap_or(usize::MAX),
            )),
            (blob, _) => super::serde::decode_typed(&type_, blob),
        };
        let state = match decoded {
            Ok(Some(v)) => Channel::Value(v),
            Ok(None) => Channel::Empty,
            Err(e) => Channel::Undecodable(e),
        };
        channels.insert(name.clone(), state);
    }
    let next_nodes = doc.next_nodes();
    let mut inline = doc.inline;
    // Primitives (None, str, int, float, bool) stay inline in channel_values and get no blob.
    for (i, name) in requested.iter().enumerate() {
        if channels.contains_key(name) {
            continue;
        }
        if let Some(at) = inline.iter().position(|(j, _)| *j == i) {
            channels.insert(name.clone(), Channel::Value(inline.swap_remove(at).1));
        } else if doc.versions.iter().any(|(c, _)| c == name) {
            channels.insert(name.clone(), Channel::Empty);
        }
    }
    let head = Head {
        checkpoint_id: doc.id.map(Cow::into_owned).unwrap_or_default(),
        checkpoint_ts: doc.ts.as_deref().and_then(parse_ts),
        next_nodes,
    };
    Ok(classify_head(thread_id, head, metadata, pending, channels).map(Scanned::Parked))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{Backend, check_dsn};

    /// `dsn` as [`check_dsn`] passes it on.
    fn checked(dsn: &str) -> CheckedDsn<'_> {
        check_dsn(Backend::Postgres, dsn).unwrap()
    }

    /// A value libpq or sqlx refuses is refused naming the parameter as the DSN spells it:
    /// `connect_timeout=abc` was taken silently (sqlx does not read it), `port=abc` said only
    /// "invalid digit found in string".
    #[test]
    fn parameter_values_libpq_refuses_are_named() {
        let refused = |dsn: &str| connect_options(&checked(dsn)).unwrap_err().to_string();
        assert_eq!(
            refused("postgres://u:secret@db/lg?connect_timeout=abc"),
            "invalid postgres DSN postgres://u:***@db/lg?connect_timeout=abc: connect_timeout is \"abc\", \
             not a whole number, as libpq (through which LangGraph's PostgresSaver connects) requires"
        );
        for (query, said) in [
            (
                "keepalives_idle=1.5",
                "keepalives_idle is \"1.5\", not a whole number",
            ),
            (
                "tcp_user_timeout=",
                "tcp_user_timeout is \"\", not a whole number",
            ),
            ("port=abc", "port is \"abc\", not a port number, 1 to 65535"),
            ("port=0", "port is \"0\", not a port number, 1 to 65535"),
            ("hostaddr=db", "hostaddr is \"db\", not an IP address"),
            (
                "statement-cache-capacity=-1",
                "statement-cache-capacity is \"-1\", not a whole number, at least 0",
            ),
        ] {
            let text = refused(&format!("postgres://u@db/lg?{query}"));
            assert!(text.contains(said), "{query}: {text}");
        }
        // libpq's own reading: whitespace around the number and a sign are taken.
        for query in [
            "connect_timeout=10",
            "connect_timeout=%2010%20",
            "connect_timeout=-1",
            "keepalives=0",
            "port=5433",
            "hostaddr=::1",
            "application_name=x",
        ] {
            assert!(
                connect_options(&checked(&format!("postgres://u@db/lg?{query}"))).is_ok(),
                "{query}"
            );
        }
    }

    /// The pairs libpq's `conninfo_parse` reads from a keyword/value DSN.
    fn pairs(dsn: &str) -> Vec<(String, String)> {
        let url = keyword_value_url(dsn).unwrap().expect("keyword/value");
        url::Url::parse(&url)
            .unwrap()
            .query_pairs()
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect()
    }

    /// libpq's keyword/value grammar: spaces around `=`, single-quoted values with `\'` and
    /// `\\`, an empty `''`, a backslash escape outside quotes, a pair right after a closing
    /// quote, the last value of a keyword given twice.
    #[test]
    fn keyword_value_dsns_are_read_as_libpq_reads_them() {
        let own = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert_eq!(
            pairs(
                r"host=db.example port = 6543 dbname =lg user= app password='s3 cr\'e\\t' application_name=''"
            ),
            own(&[
                ("host", "db.example"),
                ("port", "6543"),
                ("dbname", "lg"),
                ("user", "app"),
                ("password", r"s3 cr'e\t"),
                ("application_name", ""),
            ])
        );
        assert_eq!(
            pairs(r"options=-c\ x=1 password=a\'b&c=d% dbname='my db'user=u"),
            own(&[
                ("options", "-c x=1"),
                ("password", "a'b&c=d%"),
                ("dbname", "my db"),
                ("user", "u"),
            ])
        );
        // libpq keeps the last; sqlx would have joined two `options`.
        assert_eq!(
            pairs("options='-c a=1' dbname=lg options='-c b=2'"),
            own(&[("dbname", "lg"), ("options", "-c b=2")])
        );
        // URLs, and what does not start as keyword=value, are left to the URL checks.
        for dsn in [
            "postgres://u@db/lg?sslmode=disable",
            "POSTGRESQL://db",
            "db",
            "postgres//u:hunter2@db/lg?sslmode=disable",
            "mysql://u@db/lg?x=1",
        ] {
            assert_eq!(keyword_value_url(dsn), Ok(None), "{dsn}");
        }
    }

    /// A keyword/value DSN reaches sqlx's options and custody's bound as its URL would: host
    /// (or a socket directory), port, database, user, password, sslmode, connect_timeout.
    #[test]
    fn keyword_value_dsns_connect_as_their_urls() {
        let dsn = checked(
            "host=db.example port=6543 dbname=lg user=app password='s3 cr\\'et' \
             sslmode=require connect_timeout=3",
        );
        assert_eq!(
            dsn.shown,
            "host=db.example port=6543 dbname=lg user=app password=*** sslmode=require \
             connect_timeout=3"
        );
        let options = connect_options(&dsn).unwrap();
        assert_eq!(options.get_host(), "db.example");
        assert_eq!(options.get_port(), 6543);
        assert_eq!(options.get_database(), Some("lg"));
        assert_eq!(options.get_username(), "app");
        assert!(matches!(
            options.get_ssl_mode(),
            sqlx::postgres::PgSslMode::Require
        ));
        assert_eq!(connect_timeout(&dsn.driver), Duration::from_secs(3));
        let socket = connect_options(&checked("host=/run/postgresql dbname=lg")).unwrap();
        assert_eq!(
            socket.get_socket(),
            Some(&std::path::PathBuf::from("/run/postgresql"))
        );
    }

    /// What libpq refuses in a keyword/value DSN, and what custody cannot do as libpq does, is
    /// refused naming the keyword, with the DSN as written and never the password; a value
    /// libpq or sqlx refuses is said as for the URL of the same parameters.
    #[test]
    fn keyword_value_dsns_are_refused_naming_the_keyword() {
        let refused = |dsn: &str| match check_dsn(Backend::Postgres, dsn) {
            Ok(dsn) => connect_options(&dsn).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        for (dsn, said) in [
            (
                "host=db password=hunter2 dbname",
                "invalid postgres DSN host=db password=*** dbname: missing \"=\" after \"dbname\"",
            ),
            (
                "host=db password='hunter2",
                "invalid postgres DSN host=db password=***: the quoted value of password is not closed",
            ),
            (
                "hots=db password=hunter2",
                "invalid postgres DSN hots=db password=***: \"hots\" is no libpq connection keyword",
            ),
            ("Host=db", ": libpq's keywords are lowercase, host"),
            (
                "service=orders",
                "service names a pg_service.conf entry, which custody does not read",
            ),
            (
                "servicefile=/etc/pg_service.conf",
                "servicefile names a pg_service.conf entry",
            ),
            ("passfile=/secrets/pgpass", "passfile names a password file"),
            ("host=db hostaddr=10.0.0.5", "hostaddr is not supported"),
            ("host=a,b dbname=lg", "host lists 2 values (a,b)"),
            ("host=a port=5432,5433", "port lists 2 values (5432,5433)"),
        ] {
            let text = refused(dsn);
            assert!(text.contains(said), "{dsn}: {text}");
            assert!(!text.contains("hunter2"), "{text}");
        }
        // Text that is no keyword, say a URL pasted after one, is not quoted (it may hold the
        // password); the redacted DSN still shows it.
        let text = refused("user=u postgres//u:hunter2@db/lg");
        assert!(
            text.ends_with("missing \"=\" after the text at byte 7 (libpq's keyword/value form is keyword=value pairs separated by spaces)"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
        // A mistyped URL is not taken for keyword/value: the URL's message, password hidden.
        let text = refused("postgres//u:hunter2@db/lg?sslmode=disable");
        assert!(text.contains("needs a DSN like postgres://"), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
        // Values: the same reason as the URL's.
        for (kv, url) in [
            ("host=db port=abc", "postgres://db?port=abc"),
            ("host=db sslmode=bogus", "postgres://db?sslmode=bogus"),
            (
                "host=db connect_timeout=abc",
                "postgres://db?connect_timeout=abc",
            ),
            (
                "host=db keepalives_idle=1.5",
                "postgres://db?keepalives_idle=1.5",
            ),
        ] {
            let (kv_text, url_text) = (refused(kv), refused(url));
            assert_eq!(
                kv_text.strip_prefix(&format!("invalid postgres DSN {kv}: ")),
                url_text.strip_prefix(&format!("invalid postgres DSN {url}: ")),
                "{kv_text} / {url_text}"
            );
        }
    }

    /// The DSN's `connect_timeout` bounds the connect (sqlx ignores it: a database that never
    /// answered took 10 s whatever the DSN said).
    #[test]
    fn connect_timeout_is_the_dsns_when_positive() {
        let of = |query: &str| connect_timeout(&format!("postgres://u@db/lg{query}"));
        assert_eq!(of("?connect_timeout=3"), Duration::from_secs(3));
        assert_eq!(
            of("?sslmode=disable&connect_timeout=%2030%20"),
            Duration::from_secs(30)
        );
        assert_eq!(of("?connect_timeout=1"), Duration::from_secs(2));
        assert_eq!(of("?connect_timeout=0"), CONNECT_TIMEOUT);
        assert_eq!(of("?connect_timeout=-1"), CONNECT_TIMEOUT);
        assert_eq!(of(""), CONNECT_TIMEOUT);
    }

    /// A server that accepts the connection and never answers costs the DSN's
    /// `connect_timeout`, not custody's default.
    #[tokio::test]
    async fn a_silent_server_costs_the_dsns_connect_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                open.push(socket);
            }
        });
        for dsn in [
            format!("postgres://u@127.0.0.1:{port}/lg?sslmode=disable&connect_timeout=2"),
            format!(
                "host=127.0.0.1 port={port} user=u dbname=lg sslmode=disable connect_timeout=2"
            ),
        ] {
            let started = std::time::Instant::now();
            let Err(error) = Reader::connect(&checked(&dsn)).await else {
                panic!("connected to a server that never answers");
            };
            assert!(
                started.elapsed() < Duration::from_secs(6),
                "{dsn}: {:?}",
                started.elapsed()
            );
            assert!(
                error.to_string().contains("no answer within 2 s"),
                "{error}"
            );
        }
        held.abort();
    }

    /// A failed connect names where it went when the DSN does not say it: `postgres://` said
    /// only "cannot connect to postgres://: … Connection refused".
    #[test]
    fn a_connect_names_the_address_the_dsn_does_not_spell() {
        let at = |dsn: &str| address(dsn, &connect_options(&checked(dsn)).unwrap());
        assert_eq!(at("postgres://u@127.0.0.1:1/lg"), None);
        assert_eq!(at("postgres://u@[::1]:1/lg"), None);
        assert_eq!(at("postgres://u@db/lg").as_deref(), Some("db:5432"));
        assert_eq!(
            at("postgres:///lg?host=/run/pg").as_deref(),
            Some("the socket /run/pg/.s.PGSQL.5432")
        );
        // No host: the environment's or libpq's default, whichever sqlx took.
        let options = connect_options(&checked("postgres://")).unwrap();
        let default = address("postgres://", &options).unwrap();
        assert!(
            default.contains(options.get_host())
                && default.contains(&options.get_port().to_string())
                && default.ends_with(
                    "(the DSN names no host: PGHOST and PGPORT when set, else libpq's defaults)"
                ),
            "{default}"
        );
        let refused = connect_error(
            &checked("postgres://"),
            &options,
            sqlx::Error::Io(std::io::Error::from_raw_os_error(111)),
        );
        assert_eq!(
            refused.to_string(),
            format!(
                "cannot connect to postgres:// at {default}: error communicating with database: Connection refused"
            )
        );
    }
}
