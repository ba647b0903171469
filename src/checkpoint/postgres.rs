//! PostgresSaver tables (`langgraph-checkpoint-postgres` 3.2, migrations v0–v9).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow, PgValueFormat};
use sqlx::{Row, ValueRef};

use super::doc::parse_ts;
use super::{
    Channel, DecodeError, Head, MAX_VALUE_BYTES, Scanned, Shard, SkippedThread, StoreError,
    classify_head, redact_dsn, typed,
};

/// Highest `checkpoint_migrations.v` this reader was verified against; newer is read with a
/// warning since every migration so far only added tables, indexes and columns.
pub const KNOWN_MIGRATION: i32 = 9;
/// Lowest version whose tables (checkpoints, checkpoint_blobs, checkpoint_writes) we query.
const REQUIRED_MIGRATION: i32 = 3;

/// One statement finds the latest root checkpoint per thread (an index-only scan of the primary
/// key grouped by thread), keeps those with a pending interrupt or an `update_state` edit, and
/// fetches the requested channels' blobs by primary key. Why this shape and not `DISTINCT ON`:
/// the anti-join form degrades quadratically (see BENCHMARKS.md / the perf baseline notes).
const PARKED_SQL: &str = r#"
WITH latest AS (
    SELECT thread_id, max(checkpoint_id) AS checkpoint_id
    FROM checkpoints
    WHERE checkpoint_ns = ''
      -- The shard ($2 = count, $3 = index): sha256(thread_id)[0..4] as an unsigned big-endian
      -- integer, modulo the count (`Shard::contains`). Applied in the index-only scan, so a
      -- shard looks up only its own threads' rows; with one shard the OR short-circuits.
      AND ($2::int = 1
           OR ('x' || encode(substr(sha256(convert_to(thread_id, 'UTF8')), 1, 4), 'hex'))::bit(32)::bigint % $2 = $3)
    GROUP BY thread_id
)
SELECT l.thread_id, l.checkpoint_id, c.checkpoint, c.metadata,
       (p.task_id IS NOT NULL) AS pending_interrupt,
       bl.channels, bl.types, bl.blobs, bl.sizes
FROM latest l
CROSS JOIN LATERAL (
    SELECT x.checkpoint, x.metadata FROM checkpoints x
    WHERE x.thread_id = l.thread_id AND x.checkpoint_ns = '' AND x.checkpoint_id = l.checkpoint_id
    -- OFFSET 0 keeps this a primary-key lookup per thread, in thread order. Without it the
    -- planner underestimates `latest` ~50x, turns this into a hash join over a scan of all of
    -- checkpoints and sorts the wide rows on disk (no first row for 28 s at 1M threads;
    -- BENCHMARKS.md, "The query").
    OFFSET 0
) c
LEFT JOIN LATERAL (
    SELECT w.task_id FROM checkpoint_writes w
    WHERE w.thread_id = l.thread_id AND w.checkpoint_ns = '' AND w.checkpoint_id = l.checkpoint_id
    GROUP BY w.task_id
    HAVING bool_or(w.channel = '__interrupt__')
       AND NOT bool_or(w.channel NOT IN ('__interrupt__', '__resume__', '__error__', '__error_source_node__'))
    LIMIT 1
) p ON true
LEFT JOIN LATERAL (
    -- A blob over $4 bytes is not fetched, only its size (octet_length reads the TOAST header).
    SELECT array_agg(b.channel) AS channels, array_agg(b.type) AS types,
           array_agg(CASE WHEN octet_length(b.blob) <= $4 THEN b.blob END) AS blobs,
           array_agg(octet_length(b.blob)) AS sizes
    FROM unnest($1::text[]) AS ch(name)
    JOIN checkpoint_blobs b
      ON b.thread_id = l.thread_id AND b.checkpoint_ns = '' AND b.channel = ch.name
     AND b.version = c.checkpoint -> 'channel_versions' ->> ch.name
) bl ON true
WHERE p.task_id IS NOT NULL OR c.metadata ->> 'source' = 'update'
ORDER BY l.thread_id
"#;

/// A read-only pool on a PostgresSaver database.
pub struct Reader {
    pool: PgPool,
}

impl Reader {
    pub(super) async fn connect(dsn: &str) -> Result<Self, StoreError> {
        let shown = redact_dsn(dsn);
        let options = PgConnectOptions::from_str(dsn)
            .map_err(|e| StoreError::Dsn {
                backend: "postgres",
                dsn: shown.clone(),
                reason: strip_dsn(&e.to_string(), dsn),
            })?
            .application_name("custody")
            // The reader must never write: the server enforces it for every statement.
            .options([("default_transaction_read_only", "on")]);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(|source| StoreError::Connect {
                dsn: shown.clone(),
                source,
            })?;
        let version: Result<Option<i32>, sqlx::Error> =
            sqlx::query_scalar("SELECT max(v) FROM checkpoint_migrations")
                .fetch_one(&pool)
                .await;
        match version {
            Ok(Some(v)) if v >= REQUIRED_MIGRATION => {
                if v > KNOWN_MIGRATION {
                    tracing::warn!(
                        migration = v,
                        known = KNOWN_MIGRATION,
                        "checkpoint schema is newer than custody knows; reading anyway"
                    );
                }
                Ok(Self { pool })
            }
            Ok(v) => Err(StoreError::Schema(format!(
                "{shown}: LangGraph checkpoint migration {v:?} is older than {REQUIRED_MIGRATION}; run PostgresSaver.setup() with langgraph-checkpoint-postgres 3.x"
            ))),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => {
                Err(StoreError::Schema(format!(
                    "{shown}: no LangGraph checkpoint tables (checkpoint_migrations is missing); is this the PostgresSaver database?"
                )))
            }
            Err(e) => Err(StoreError::Query(e)),
        }
    }

    pub(super) fn parked_threads<'a>(
        &'a self,
        channels: &'a [String],
        shard: Shard,
    ) -> BoxStream<'a, Result<Scanned, StoreError>> {
        sqlx::query(PARKED_SQL)
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

/// sqlx echoes the offending DSN in some parse errors; never let the password through.
fn strip_dsn(message: &str, dsn: &str) -> String {
    message.replace(dsn, &redact_dsn(dsn))
}

/// The text of a `json`/`jsonb` column, borrowed from the row: binary `jsonb` is a version byte
/// (1) and the JSON text. `None` for SQL NULL.
fn json_bytes<'r>(row: &'r PgRow, column: &str) -> Result<Option<&'r [u8]>, StoreError> {
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

fn decode_row(row: &PgRow, requested: &[String]) -> Result<Option<Scanned>, StoreError> {
    let thread_id: String = row.try_get("thread_id")?;
    let checkpoint_id: String = row.try_get("checkpoint_id")?;
    let checkpoint = json_bytes(row, "checkpoint")?;
    let metadata = json_bytes(row, "metadata")?;
    let pending: bool = row.try_get("pending_interrupt")?;
    let names: Option<Vec<String>> = row.try_get("channels")?;
    let types: Option<Vec<String>> = row.try_get("types")?;
    let blobs: Option<Vec<Option<Vec<u8>>>> = row.try_get("blobs")?;
    let sizes: Option<Vec<Option<i32>>> = row.try_get("sizes")?;

    let skip = |error: DecodeError| {
        Ok(Some(Scanned::Skipped(SkippedThread::new(
            thread_id.clone(),
            checkpoint_id.clone(),
            None,
            error,
        ))))
    };
    let Some(checkpoint) = checkpoint else {
        return skip(DecodeError::malformed("checkpoint column is NULL"));
    };
    // Typed straight from the row's bytes: no `Value` tree of the whole document (typed.rs).
    let doc = match typed::decode(checkpoint, requested) {
        Ok(doc) => doc,
        Err(e) => return skip(e),
    };
    let metadata = match serde_json::from_slice::<Value>(metadata.unwrap_or(b"{}")) {
        Ok(Value::Object(m)) => m,
        Ok(_) => {
            return skip(DecodeError::malformed(
                "checkpoint metadata is not a JSON object",
            ));
        }
        Err(e) => {
            return skip(DecodeError::malformed(format!(
                "checkpoint metadata is not JSON: {e}"
            )));
        }
    };

    let mut channels = BTreeMap::new();
    for (((name, type_), blob), size) in names
        .unwrap_or_default()
        .into_iter()
        .zip(types.unwrap_or_default())
        .zip(blobs.unwrap_or_default())
        .zip(sizes.unwrap_or_default())
    {
        let decoded = match (blob, size) {
            (None, Some(size)) => Err(DecodeError::too_large(
                &format!("the {type_} blob"),
                usize::try_from(size).unwrap_or(usize::MAX),
            )),
            (blob, _) => super::serde::decode_typed(&type_, blob.as_deref()),
        };
        let state = match decoded {
            Ok(Some(v)) => Channel::Value(v),
            Ok(None) => Channel::Empty,
            Err(e) => Channel::Undecodable(e),
        };
        channels.insert(name, state);
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
