//! Appending a checkpoint to a parked thread the way LangGraph's `update_state` does.
//!
//! The verified recipe (custody research notes on LangGraph 1.2, sections 5, 8 and 12, variants
//! pg-A/pg-B and sq-A): copy the thread's latest root checkpoint under a new id that sorts after
//! it, give every changed channel one new version (max + 1), store non-primitive PostgreSQL
//! values as blobs, set `updated_channels` to null, write metadata `source: update` and
//! `step + 1`, and re-create the pending `__interrupt__` write on the new checkpoint with the task
//! and interrupt ids LangGraph would compute for it, so the thread still shows as waiting.
//!
//! Pitfalls the recipe avoids, each observed in the research:
//! - `updated_channels` listing only the edited channels makes the resumed run skip the parked
//!   node (pg-D): it is always null here;
//! - a map or list inline in PostgreSQL's `channel_values` is dropped by LangGraph's next `put`
//!   (pg-E): only `None`, `str`, `int`, `float`, `bool` stay inline;
//! - rewriting a checkpoint in place changes history shared by earlier checkpoints (pg-C): the
//!   writer only ever inserts.
//!
//! Every append is a compare-and-append in one transaction: it first re-reads the thread's
//! latest root checkpoint and its pending writes, and writes nothing when the thread moved on
//! since the sweep read it ([`Appended::Moved`]). Values are patched as raw msgpack, so the parts
//! of a channel custody does not touch keep their extension types byte for byte.
//!
//! This is the only module that writes LangGraph's tables; [`super::Store`] stays read-only and
//! the writable pool is opened only when a sweep acts.

use chrono::{DateTime, Utc};
use rmpv::Value as Mp;
use serde_json::{Map, Value};

mod ids;
mod msgpack;
mod pool;
mod postgres;
mod sqlite;

pub use ids::{interrupt_id, new_checkpoint_id, task_id};
use ids::{next_version, python_iso};
pub use msgpack::json_to_mp;
use msgpack::{encode, map_get, map_get_mut, map_set};
pub use pool::{ActLock, SQLITE_BUSY_WAIT, Tx, WritePool};
use postgres::Pg;
use sqlite::Lite;

use super::serde::{DecodeError, read};

/// The PostgresSaver migration whose schema the writer produces rows for (v9 added
/// `checkpoint_writes.task_path`, which interrupt writes need).
pub(super) const PG_WRITE_MIGRATION: i32 = 9;

/// LangGraph's task-path prefix of a node ("PULL") task (`langgraph/_internal/_constants.py`).
pub(super) const PULL: &str = "__pregel_pull";
/// `WRITES_IDX_MAP["__interrupt__"]` (`langgraph/checkpoint/base`).
const INTERRUPT_IDX: i32 = -3;
/// The channel of interrupt writes.
const INTERRUPT: &str = "__interrupt__";
/// Graph-level writes (resume values, `Command(update=…)`) hang off this task id.
const NULL_TASK_ID: &str = "00000000-0000-0000-0000-000000000000";
/// Why an append could not be made. Messages never contain channel values.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A statement failed.
    #[error("database: {}", super::db_text(.0))]
    Query(#[from] sqlx::Error),
    /// The thread's rows are of a shape custody will not write to (encrypted or pickled values,
    /// integer channel versions, a patch through a non-map, writes of other tasks that an
    /// append would drop).
    #[error("{0}")]
    Unsupported(String),
}

impl From<DecodeError> for WriteError {
    fn from(e: DecodeError) -> Self {
        Self::Unsupported(format!("cannot decode the latest checkpoint: {e}"))
    }
}

/// One change to graph state: at `path` (channel, then keys into its value), either replace the
/// value or set fields of the map found there.
#[derive(Clone, Debug, PartialEq)]
pub struct Patch {
    /// Channel name followed by keys, e.g. `["basket"]` or `["order", "basket"]`.
    pub path: Vec<String>,
    /// What to do there.
    pub value: PatchValue,
}

/// What a [`Patch`] does at its path.
#[derive(Clone, Debug, PartialEq)]
pub enum PatchValue {
    /// Put this value there (missing maps on the way are created).
    Replace(Mp),
    /// Set these fields of the map there, keeping its other fields as they are.
    SetFields(Vec<(String, Mp)>),
}

/// An append to make.
#[derive(Clone, Debug)]
pub struct AppendRequest<'a> {
    /// LangGraph thread id.
    pub thread_id: &'a str,
    /// The latest root checkpoint as the sweep read it; the append happens only while it still
    /// is the latest.
    pub expected_checkpoint_id: &'a str,
    /// Whether the sweep saw a pending interrupt on it (otherwise it was parked by an edit).
    pub expected_interrupt: bool,
    /// The changes.
    pub patches: &'a [Patch],
    /// Extra metadata entries (custody's tags); `source` and `step` are always set.
    pub tags: Map<String, Value>,
    /// Write time.
    pub now: DateTime<Utc>,
}

/// What an append did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Appended {
    /// The new checkpoint is written (not yet committed: the caller commits the transaction).
    Written {
        /// Its id.
        checkpoint_id: String,
        /// What happened to the pending interrupt.
        interrupt: InterruptCarry,
    },
    /// The thread moved since the sweep read it; nothing was written.
    Moved(String),
}

/// What became of the parked checkpoint's pending interrupt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InterruptCarry {
    /// Re-created on the new checkpoint with LangGraph's ids: the thread still shows as waiting.
    Recreated,
    /// There was none (the thread was parked by an `update_state` edit).
    NonePending,
    /// It could not be reproduced exactly (the reason says why); the new checkpoint has none, so
    /// the thread reads as "edited". A plain `Command(resume=…)` still resumes it.
    NotReproduced(String),
}

/// One row of the parked checkpoint's pending writes; each backend's query names its columns
/// these names (SQLite's `value` as `blob`).
#[derive(sqlx::FromRow)]
struct PendingWrite {
    task_id: String,
    task_path: String,
    channel: String,
    #[sqlx(rename = "type")]
    type_: Option<String>,
    blob: Option<Vec<u8>>,
}

/// Compares and appends within `tx`. The caller commits (after recording the outcome in the
/// ledger in the same transaction) or drops the transaction.
///
/// # Errors
/// [`WriteError::Query`] for a database error, [`WriteError::Unsupported`] for rows custody
/// will not rewrite; in both cases nothing is written.
pub async fn append(tx: &mut Tx, req: &AppendRequest<'_>) -> Result<Appended, WriteError> {
    let thread_id = req.thread_id;
    match tx {
        Tx::Postgres(tx) => append_to(&mut Pg { tx, thread_id }, req).await,
        Tx::Sqlite(tx) => append_to(&mut Lite { tx, thread_id }, req).await,
    }
}

/// One thread's rows of one LangGraph saver in a write transaction: what PostgresSaver
/// ([`postgres`]) and SqliteSaver ([`sqlite`]) store differently. The recipe over them is
/// written once, in [`append_to`] and [`head_of`].
trait Saver {
    /// The latest root checkpoint's row.
    type Row;
    /// Its document as the row holds it, before decoding.
    type Stored;
    /// The document being patched.
    type Doc;

    /// The id and row of the thread's latest root checkpoint.
    async fn latest(&mut self) -> Result<Option<(String, Self::Row)>, WriteError>;
    /// The row's document and its metadata.
    fn decode(row: Self::Row) -> Result<(Self::Stored, Value), WriteError>;
    /// The pending writes of `checkpoint_id`, in LangGraph's order (task path, task, index).
    async fn writes(&mut self, checkpoint_id: &str) -> Result<Vec<PendingWrite>, WriteError>;
    /// Decodes the stored document for patching.
    fn open(stored: Self::Stored) -> Result<Self::Doc, WriteError>;
    /// Every channel version of the document.
    fn versions(doc: &Self::Doc) -> Result<Vec<Value>, WriteError>;
    /// The raw value of `channel` (`None`: no value, or an `empty` one).
    async fn value(&mut self, doc: &Self::Doc, channel: &str) -> Result<Option<Mp>, WriteError>;
    /// Makes `value` the value of `channel`, at `version`.
    fn set(doc: &mut Self::Doc, channel: &str, value: Mp, version: &str) -> Result<(), WriteError>;
    /// Gives the document its new id and timestamp, and a null `updated_channels` (pg-D).
    fn stamp(doc: &mut Self::Doc, id: &str, ts: &str) -> Result<(), WriteError>;
    /// Inserts the new checkpoint `id` (with what the saver stores beside it).
    async fn insert(
        &mut self,
        id: &str,
        parent_id: &str,
        doc: Self::Doc,
        metadata: &Value,
    ) -> Result<(), WriteError>;
    /// Inserts the carried interrupt as a pending write of checkpoint `id`.
    async fn insert_interrupt(
        &mut self,
        id: &str,
        write: &InterruptWrite,
    ) -> Result<(), WriteError>;
    /// The id of the thread's latest root checkpoint.
    async fn latest_id(&mut self) -> Result<Option<String>, WriteError>;
    /// `(task_id, channel)` of every write of `checkpoint_id`.
    async fn write_channels(
        &mut self,
        checkpoint_id: &str,
    ) -> Result<Vec<(String, String)>, WriteError>;
}

/// The append recipe (module documentation) over one saver's rows.
async fn append_to<S: Saver>(
    rows: &mut S,
    req: &AppendRequest<'_>,
) -> Result<Appended, WriteError> {
    let Some((latest_id, latest)) = rows.latest().await? else {
        return Ok(Appended::Moved(
            "the thread has no checkpoints any more".into(),
        ));
    };
    if latest_id != req.expected_checkpoint_id {
        return Ok(moved_to(&latest_id));
    }
    let (stored, metadata) = S::decode(latest)?;
    let writes = rows.writes(&latest_id).await?;
    if let Some(reason) = moved_by_writes(&writes, req.expected_interrupt) {
        return Ok(Appended::Moved(reason));
    }

    let mut doc = S::open(stored)?;
    let version = next_version(S::versions(&doc)?.iter())?;
    let step = metadata.get("step").and_then(Value::as_i64).unwrap_or(-1);
    let new_id = new_checkpoint_id(&latest_id, req.now, step + 1)?;
    for (channel, patches) in by_channel(req.patches) {
        let current = rows.value(&doc, &channel).await?;
        let value = patch_channel(&channel, current, &patches)?;
        S::set(&mut doc, &channel, value, &version)?;
    }
    S::stamp(&mut doc, &new_id, &python_iso(req.now))?;

    let interrupt = carry_interrupt(&writes, &latest_id, step, &new_id)?;
    rows.insert(
        &new_id,
        &latest_id,
        doc,
        &new_metadata(&metadata, step, &req.tags),
    )
    .await?;
    let carried = match interrupt {
        Ok(write) => {
            rows.insert_interrupt(&new_id, &write).await?;
            InterruptCarry::Recreated
        }
        Err(carry) => carry,
    };
    Ok(Appended::Written {
        checkpoint_id: new_id,
        interrupt: carried,
    })
}

/// Whether a checkpoint's writes hold an interrupt of a task that has no output.
fn interrupt_pending(writes: &[PendingWrite]) -> bool {
    let output = |task: &str| {
        writes.iter().any(|w| {
            w.task_id == task && !crate::checkpoint::CONTROL_CHANNELS.contains(&w.channel.as_str())
        })
    };
    writes
        .iter()
        .any(|w| w.channel == INTERRUPT && !output(&w.task_id))
}

/// A thread's latest root checkpoint as [`head`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Head {
    /// Its id.
    pub checkpoint_id: String,
    /// Whether it has a pending interrupt.
    pub interrupt_pending: bool,
}

/// Reads the thread's latest root checkpoint in `tx`: the expectations of an
/// [`AppendRequest`] that writes to whatever the thread holds now (audit escalation, which has
/// no scanned checkpoint to compare with). `None` when the thread has no checkpoints.
///
/// # Errors
/// [`WriteError::Query`].
pub async fn head(tx: &mut Tx, thread_id: &str) -> Result<Option<Head>, WriteError> {
    match tx {
        Tx::Postgres(tx) => head_of(&mut Pg { tx, thread_id }).await,
        Tx::Sqlite(tx) => head_of(&mut Lite { tx, thread_id }).await,
    }
}

async fn head_of<S: Saver>(rows: &mut S) -> Result<Option<Head>, WriteError> {
    let Some(checkpoint_id) = rows.latest_id().await? else {
        return Ok(None);
    };
    let writes: Vec<PendingWrite> = rows
        .write_channels(&checkpoint_id)
        .await?
        .into_iter()
        .map(|(task_id, channel)| PendingWrite {
            task_id,
            task_path: String::new(),
            channel,
            type_: None,
            blob: None,
        })
        .collect();
    Ok(Some(Head {
        checkpoint_id,
        interrupt_pending: interrupt_pending(&writes),
    }))
}

fn moved_to(latest: &str) -> Appended {
    Appended::Moved(format!("its latest checkpoint is now {latest}"))
}

/// The thread moved on if its parked checkpoint gained writes a resume leaves (a resume value on
/// NULL_TASK_ID, a task's output), or lost or gained its pending interrupt.
fn moved_by_writes(writes: &[PendingWrite], expected_interrupt: bool) -> Option<String> {
    if writes.iter().any(|w| w.task_id == NULL_TASK_ID) {
        return Some("a resume value was written to its checkpoint".into());
    }
    let output = |task: &str| {
        writes.iter().any(|w| {
            w.task_id == task && !crate::checkpoint::CONTROL_CHANNELS.contains(&w.channel.as_str())
        })
    };
    match (expected_interrupt, interrupt_pending(writes)) {
        (true, false) => Some("its interrupt was answered".into()),
        (false, true) => Some("it was interrupted again".into()),
        _ if writes.iter().any(|w| output(&w.task_id)) => {
            // Parked, but tasks of the same superstep finished: an append would drop their
            // writes and make them run again, side effects included (research §12 caveat).
            Some("tasks of its current step have finished writes an append would drop".into())
        }
        _ => None,
    }
}

/// The interrupt write to add to the new checkpoint, or why there is none.
struct InterruptWrite {
    task_id: String,
    task_path: String,
    blob: Vec<u8>,
}

fn carry_interrupt(
    writes: &[PendingWrite],
    parent_id: &str,
    parent_step: i64,
    new_id: &str,
) -> Result<Result<InterruptWrite, InterruptCarry>, WriteError> {
    let interrupts: Vec<&PendingWrite> = writes.iter().filter(|w| w.channel == INTERRUPT).collect();
    let not = |why: &str| Ok(Err(InterruptCarry::NotReproduced(why.to_owned())));
    let write = match interrupts.as_slice() {
        [] => return Ok(Err(InterruptCarry::NonePending)),
        [one] => *one,
        _ => return not("more than one task is interrupted"),
    };
    let Some(node) = write
        .task_path
        .strip_prefix("~")
        .and_then(|p| p.strip_prefix(PULL))
        .and_then(|p| p.strip_prefix(", "))
    else {
        return not("the interrupted task is not a node (PULL) task");
    };
    // A StateGraph node is triggered by its `branch:to:<node>` channel alone; reproducing the
    // parked task's id proves that (and the id formula) for this thread.
    let triggers = [format!("branch:to:{node}")];
    if task_id(parent_id, node, parent_step + 1, &triggers)? != write.task_id {
        return not("its task id does not follow LangGraph's formula for a node task");
    }
    if write.type_.as_deref() != Some("msgpack") {
        return not("the interrupt value is not plain msgpack");
    }
    let mut value = read(write.blob.as_deref().unwrap_or_default())?;
    let old_ns = format!("{node}:{}", write.task_id);
    let new_task = task_id(new_id, node, parent_step + 2, &triggers)?;
    let new_ns = format!("{node}:{new_task}");
    // `[Interrupt{value, id, response_schema}]`, Interrupt as ext 2 `[module, class, kwargs]`.
    let Mp::Array(items) = &mut value else {
        return not("the interrupt write is not a list");
    };
    let [Mp::Ext(2, payload)] = items.as_mut_slice() else {
        return not("the interrupt write is not exactly one Interrupt");
    };
    let mut inner = read(payload)?;
    let Mp::Array(parts) = &mut inner else {
        return not("the Interrupt payload is not [module, class, kwargs]");
    };
    let Some(kwargs) = parts.get_mut(2) else {
        return not("the Interrupt payload has no kwargs");
    };
    // The first interrupt of a task has id xxh3(task namespace); later ones add `|n`, and a
    // re-run node raises its first interrupt again, so only a first interrupt carries over.
    if map_get(kwargs, "id").and_then(Mp::as_str) != Some(interrupt_id(&old_ns).as_str()) {
        return not("it is not the first interrupt of its task");
    }
    map_set(kwargs, "id", Mp::from(interrupt_id(&new_ns).as_str()));
    *payload = encode(&inner);
    Ok(Ok(InterruptWrite {
        task_id: new_task,
        task_path: write.task_path.clone(),
        blob: encode(&value),
    }))
}

fn new_metadata(parent: &Value, parent_step: i64, tags: &Map<String, Value>) -> Value {
    // Keep the parent's entries (the principal custody reads next time, run tags), as
    // `update_state` keeps the config's; then mark the edit.
    let mut m = parent.as_object().cloned().unwrap_or_default();
    m.insert("source".into(), Value::from("update"));
    m.insert("step".into(), Value::from(parent_step + 1));
    m.entry("parents")
        .or_insert_with(|| Value::Object(Map::new()));
    for (k, v) in tags {
        m.insert(k.clone(), v.clone());
    }
    Value::Object(m)
}

fn by_channel(patches: &[Patch]) -> Vec<(String, Vec<&Patch>)> {
    let mut out: Vec<(String, Vec<&Patch>)> = Vec::new();
    for p in patches {
        let channel = p.path.first().cloned().unwrap_or_default();
        match out.iter_mut().find(|(c, _)| *c == channel) {
            Some((_, list)) => list.push(p),
            None => out.push((channel, vec![p])),
        }
    }
    out
}

/// A blob's raw value: `None` for `empty`; only plain msgpack and null are patched.
fn raw_typed(channel: &str, type_: &str, blob: Option<Vec<u8>>) -> Result<Option<Mp>, WriteError> {
    match type_ {
        "empty" => Ok(None),
        "null" => Ok(Some(Mp::Nil)),
        "msgpack" => Ok(Some(read(blob.as_deref().unwrap_or_default())?)),
        other => Err(WriteError::Unsupported(format!(
            "channel {channel} is stored as {other:?}; custody patches only msgpack values"
        ))),
    }
}

fn patch_channel(channel: &str, current: Option<Mp>, patches: &[&Patch]) -> Result<Mp, WriteError> {
    let mut value = current.unwrap_or(Mp::Nil);
    for p in patches {
        let keys = &p.path[1..];
        let mut target = &mut value;
        for key in keys {
            if matches!(target, Mp::Nil) {
                *target = Mp::Map(Vec::new());
            }
            if !matches!(target, Mp::Map(_)) {
                return Err(WriteError::Unsupported(format!(
                    "{}: {channel} holds a non-map value on the way",
                    p.path.join(".")
                )));
            }
            if map_get(target, key).is_none() {
                map_set(target, key, Mp::Nil);
            }
            target = map_get_mut(target, key).expect("just inserted");
        }
        match &p.value {
            PatchValue::Replace(v) => *target = v.clone(),
            PatchValue::SetFields(fields) => {
                if !matches!(target, Mp::Map(_)) {
                    return Err(WriteError::Unsupported(format!(
                        "{}: not a map, cannot set its fields",
                        p.path.join(".")
                    )));
                }
                for (k, v) in fields {
                    map_set(target, k, v.clone());
                }
            }
        }
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::msgpack::primitive_json;
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn task_and_interrupt_ids_match_the_research_dump() {
        // dump_pg.txt: checkpoint 1f1ec46c-9ef5-6203-8001-d46468263aea (metadata step 1) →
        // task 187cfe43-e53a-07fa-0ab6-a6e80514919b, interrupt 9948d3db608a22ec06f521923958b1a3.
        let task = task_id(
            "1f1ec46c-9ef5-6203-8001-d46468263aea",
            "add_item",
            2,
            &["branch:to:add_item".to_owned()],
        )
        .unwrap();
        assert_eq!(task, "187cfe43-e53a-07fa-0ab6-a6e80514919b");
        assert_eq!(
            interrupt_id(&format!("add_item:{task}")),
            "9948d3db608a22ec06f521923958b1a3"
        );
    }

    #[test]
    fn new_ids_sort_after_the_latest_and_carry_the_step() {
        let latest = "1f1ec46c-9ef5-6203-8001-d46468263aea";
        let now = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
        let id = new_checkpoint_id(latest, now, 2).unwrap();
        assert!(id.as_str() > latest, "{id}");
        assert_eq!(&id[14..15], "6", "version nibble: {id}");
        assert_eq!(&id[19..23], "8002", "variant and clock_seq = step: {id}");
        // A clock behind the latest id still yields a later id.
        let past = Utc.with_ymd_and_hms(2001, 1, 1, 0, 0, 0).unwrap();
        let id = new_checkpoint_id(latest, past, 2).unwrap();
        assert!(id.as_str() > latest, "{id}");
        assert_eq!(&id[..18], "1f1ec46c-9ef5-6204", "one tick later: {id}");
    }

    #[test]
    fn versions_bump_the_integer_part() {
        let vs = [
            Value::from("00000000000000000000000000000003.0.69"),
            Value::from("00000000000000000000000000000002.0.16"),
        ];
        let v = next_version(vs.iter()).unwrap();
        assert!(v.starts_with("00000000000000000000000000000004.0."), "{v}");
        assert!(v.as_str() > "00000000000000000000000000000003.9");
        assert!(next_version([Value::from(3)].iter()).is_err());
    }

    #[test]
    fn patches_keep_untouched_fields_and_create_missing_maps() {
        let record = Mp::Map(vec![
            ("value".into(), "bsk_old".into()),
            ("principal".into(), "user-1".into()),
            ("when".into(), Mp::Ext(3, vec![0x90])),
        ]);
        let set = Patch {
            path: vec!["basket".into()],
            value: PatchValue::SetFields(vec![("value".into(), "bsk_new".into())]),
        };
        let out = patch_channel("basket", Some(record), &[&set]).unwrap();
        assert_eq!(map_get(&out, "value").and_then(Mp::as_str), Some("bsk_new"));
        assert_eq!(
            map_get(&out, "principal").and_then(Mp::as_str),
            Some("user-1")
        );
        assert_eq!(map_get(&out, "when"), Some(&Mp::Ext(3, vec![0x90])));

        let nested = Patch {
            path: vec!["order".into(), "custody".into()],
            value: PatchValue::Replace(json_to_mp(&serde_json::json!({"verdict": "escalated"}))),
        };
        let out = patch_channel("order", None, &[&nested]).unwrap();
        let custody = map_get(&out, "custody").unwrap();
        assert_eq!(
            map_get(custody, "verdict").and_then(Mp::as_str),
            Some("escalated")
        );
        assert!(patch_channel("order", Some(Mp::from(3)), &[&nested]).is_err());
    }

    #[test]
    fn only_primitives_stay_inline() {
        assert_eq!(primitive_json(&Mp::from("x")), Some(Value::from("x")));
        assert_eq!(primitive_json(&Mp::Nil), Some(Value::Null));
        assert_eq!(primitive_json(&Mp::Map(vec![])), None);
        assert_eq!(primitive_json(&Mp::Array(vec![])), None);
    }

    fn write(task: &str, channel: &str) -> PendingWrite {
        PendingWrite {
            task_id: task.into(),
            task_path: "~__pregel_pull, add_item".into(),
            channel: channel.into(),
            type_: Some("msgpack".into()),
            blob: None,
        }
    }

    #[test]
    fn moves_are_detected_from_writes() {
        assert_eq!(moved_by_writes(&[write("t", INTERRUPT)], true), None);
        assert_eq!(moved_by_writes(&[], false), None);
        assert!(
            moved_by_writes(
                &[write("t", INTERRUPT), write(NULL_TASK_ID, "__resume__")],
                true
            )
            .is_some()
        );
        assert!(moved_by_writes(&[write("t", INTERRUPT), write("t", "items")], true).is_some());
        assert!(moved_by_writes(&[write("t", INTERRUPT)], false).is_some());
        assert!(
            moved_by_writes(&[write("t", INTERRUPT), write("u", "items")], true).is_some(),
            "finished sibling tasks would be dropped"
        );
    }
}
