//! PostgresSaver's rows for the append recipe: the checkpoint document as JSON, non-primitive
//! channel values as blobs (pg-A, pg-E).

use rmpv::Value as Mp;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};

use super::msgpack::{encode, json_to_mp, primitive_json, set_json};
use super::{INTERRUPT, INTERRUPT_IDX, InterruptWrite, PendingWrite, Saver, WriteError, raw_typed};

/// One thread's PostgresSaver rows in a write transaction.
pub(super) struct Pg<'t> {
    pub(super) tx: &'t mut Transaction<'static, Postgres>,
    pub(super) thread_id: &'t str,
}

/// The JSON document and the blobs its patched channels moved out of it.
pub(super) struct PgDoc {
    json: Value,
    /// `(channel, version, msgpack)`.
    blobs: Vec<(String, String, Vec<u8>)>,
}

impl Saver for Pg<'_> {
    type Row = PgRow;
    type Stored = Value;
    type Doc = PgDoc;

    async fn latest(&mut self) -> Result<Option<(String, PgRow)>, WriteError> {
        let row = sqlx::query(
            "SELECT checkpoint_id, checkpoint, metadata FROM checkpoints
             WHERE thread_id = $1 AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
        )
        .bind(self.thread_id)
        .fetch_optional(&mut **self.tx)
        .await?;
        match row {
            Some(row) => Ok(Some((row.try_get("checkpoint_id")?, row))),
            None => Ok(None),
        }
    }

    fn decode(row: PgRow) -> Result<(Value, Value), WriteError> {
        Ok((row.try_get("checkpoint")?, row.try_get("metadata")?))
    }

    async fn writes(&mut self, checkpoint_id: &str) -> Result<Vec<PendingWrite>, WriteError> {
        sqlx::query_as::<_, PendingWrite>(
            "SELECT task_id, task_path, channel, type, blob FROM checkpoint_writes
             WHERE thread_id = $1 AND checkpoint_ns = '' AND checkpoint_id = $2
             ORDER BY task_path, task_id, idx",
        )
        .bind(self.thread_id)
        .bind(checkpoint_id)
        .fetch_all(&mut **self.tx)
        .await
        .map_err(Into::into)
    }

    fn open(json: Value) -> Result<PgDoc, WriteError> {
        Ok(PgDoc {
            json,
            blobs: Vec::new(),
        })
    }

    fn versions(doc: &PgDoc) -> Result<Vec<Value>, WriteError> {
        Ok(doc
            .json
            .get("channel_versions")
            .and_then(Value::as_object)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default())
    }

    async fn value(&mut self, doc: &PgDoc, channel: &str) -> Result<Option<Mp>, WriteError> {
        let Some(version) = doc
            .json
            .get("channel_versions")
            .and_then(|m| m.get(channel))
            .and_then(Value::as_str)
        else {
            return Ok(None);
        };
        let blob = sqlx::query(
            "SELECT type, blob FROM checkpoint_blobs
             WHERE thread_id = $1 AND checkpoint_ns = '' AND channel = $2 AND version = $3",
        )
        .bind(self.thread_id)
        .bind(channel)
        .bind(version)
        .fetch_optional(&mut **self.tx)
        .await?;
        match blob {
            Some(row) => raw_typed(
                channel,
                row.try_get::<String, _>("type")?.as_str(),
                row.try_get::<Option<Vec<u8>>, _>("blob")?,
            ),
            // A primitive stays inline in `channel_values` (pg-E).
            None => Ok(doc
                .json
                .get("channel_values")
                .and_then(|m| m.get(channel))
                .map(json_to_mp)),
        }
    }

    fn set(doc: &mut PgDoc, channel: &str, value: Mp, version: &str) -> Result<(), WriteError> {
        let values = doc
            .json
            .get_mut("channel_values")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| WriteError::Unsupported("checkpoint has no channel_values".into()))?;
        // Inline only what LangGraph's next `put` keeps inline (pg-E); a blob otherwise (pg-A).
        if let Some(inline) = primitive_json(&value) {
            values.insert(channel.to_owned(), inline);
        } else {
            values.remove(channel);
            doc.blobs
                .push((channel.to_owned(), version.to_owned(), encode(&value)));
        }
        set_json(
            &mut doc.json,
            "channel_versions",
            channel,
            Value::String(version.to_owned()),
        )
    }

    fn stamp(doc: &mut PgDoc, id: &str, ts: &str) -> Result<(), WriteError> {
        let obj = doc
            .json
            .as_object_mut()
            .ok_or_else(|| WriteError::Unsupported("checkpoint is not an object".into()))?;
        obj.insert("id".into(), Value::String(id.to_owned()));
        obj.insert("ts".into(), Value::String(ts.to_owned()));
        obj.insert("updated_channels".into(), Value::Null);
        Ok(())
    }

    async fn insert(
        &mut self,
        id: &str,
        parent_id: &str,
        doc: PgDoc,
        metadata: &Value,
    ) -> Result<(), WriteError> {
        for (channel, version, blob) in &doc.blobs {
            sqlx::query(
                "INSERT INTO checkpoint_blobs (thread_id, checkpoint_ns, channel, version, type, blob)
                 VALUES ($1, '', $2, $3, 'msgpack', $4)",
            )
            .bind(self.thread_id)
            .bind(channel)
            .bind(version)
            .bind(blob)
            .execute(&mut **self.tx)
            .await?;
        }
        sqlx::query(
            "INSERT INTO checkpoints (thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, checkpoint, metadata)
             VALUES ($1, '', $2, $3, $4, $5)",
        )
        .bind(self.thread_id)
        .bind(id)
        .bind(parent_id)
        .bind(&doc.json)
        .bind(metadata)
        .execute(&mut **self.tx)
        .await?;
        Ok(())
    }

    async fn insert_interrupt(
        &mut self,
        id: &str,
        write: &InterruptWrite,
    ) -> Result<(), WriteError> {
        sqlx::query(
            "INSERT INTO checkpoint_writes (thread_id, checkpoint_ns, checkpoint_id, task_id, task_path, idx, channel, type, blob)
             VALUES ($1, '', $2, $3, $4, $5, $6, 'msgpack', $7)",
        )
        .bind(self.thread_id)
        .bind(id)
        .bind(&write.task_id)
        .bind(&write.task_path)
        .bind(INTERRUPT_IDX)
        .bind(INTERRUPT)
        .bind(&write.blob)
        .execute(&mut **self.tx)
        .await?;
        Ok(())
    }

    async fn latest_id(&mut self) -> Result<Option<String>, WriteError> {
        Ok(sqlx::query_scalar(
            "SELECT checkpoint_id FROM checkpoints
             WHERE thread_id = $1 AND checkpoint_ns = '' ORDER BY checkpoint_id DESC LIMIT 1",
        )
        .bind(self.thread_id)
        .fetch_optional(&mut **self.tx)
        .await?)
    }

    async fn write_channels(
        &mut self,
        checkpoint_id: &str,
    ) -> Result<Vec<(String, String)>, WriteError> {
        Ok(sqlx::query_as(
            "SELECT task_id, channel FROM checkpoint_writes
             WHERE thread_id = $1 AND checkpoint_ns = '' AND checkpoint_id = $2",
        )
        .bind(self.thread_id)
        .bind(checkpoint_id)
        .fetch_all(&mut **self.tx)
        .await?)
    }
}
