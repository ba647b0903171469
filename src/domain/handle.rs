//! Finding the handle record a HandleClass names in a thread's state.
//!
//! The record is the handle-custody `HandleRecord` TypedDict: `{value, server, tool, principal,
//! minted_at, assumed_ttl_s}`; field names are mappable per HandleClass. A bare string at the
//! state path is accepted as a handle with no record around it.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::path::StatePath;

/// Field names inside the handle record (HandleClass `spec.record`, converted by the compile
/// step). Defaults follow the handle-custody `HandleRecord`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordFields {
    /// The handle string itself.
    pub value: String,
    /// Principal the handle was minted for.
    pub principal: String,
    /// ISO-8601 mint time.
    pub minted_at: String,
    /// Assumed lifetime in seconds, or null.
    pub assumed_ttl_seconds: String,
}

impl Default for RecordFields {
    fn default() -> Self {
        Self {
            value: "value".into(),
            principal: "principal".into(),
            minted_at: "minted_at".into(),
            assumed_ttl_seconds: "assumed_ttl_s".into(),
        }
    }
}

/// One state channel of a thread, as the core reads it. A channel whose value did not decode
/// never gets here: the scan reports such a thread as skipped (`checkpoint::SkippedThread`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Slot<'a> {
    /// The channel has a version but no value.
    Empty,
    /// The channel's value.
    Value(&'a Value),
}

/// A handle and what the graph recorded about it at mint time.
#[derive(Clone, Debug, PartialEq)]
pub struct HandleRecord {
    /// The opaque handle string, e.g. `bsk_66b2da6da6cf`.
    pub value: String,
    /// Principal it was minted for.
    pub principal: Option<String>,
    /// When it was minted.
    pub minted_at: Option<DateTime<Utc>>,
    /// Lifetime the graph assumed at mint time, in seconds.
    pub assumed_ttl_seconds: Option<u64>,
    /// The whole record as stored, for `{{record.<field>}}` placeholders.
    pub raw: Value,
}

/// What a thread holds at a HandleClass's state path.
#[derive(Clone, Debug, PartialEq)]
pub enum Holding {
    /// The channel does not exist in this thread: the class does not apply to its graph.
    NotApplicable,
    /// The channel exists but holds no handle (null, empty, or the path ends early).
    Absent,
    /// A usable handle record.
    Record(HandleRecord),
    /// Something is there but it is not a handle record; the reason names the field.
    Malformed(String),
}

/// Which parked threads a HandleClass applies to (HandleClass `spec.appliesTo`, compiled). A
/// thread a class applies to that has no channel at its `statePath` is `absent`: the user said
/// it needs the handle (issue 17, item 3).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AppliesTo {
    /// The threads whose state has the class's channel (no `appliesTo`).
    #[default]
    HavingChannel,
    /// Every parked thread of the store.
    Every,
    /// The threads whose checkpoint metadata has each of these `(key, value)` entries; a
    /// metadata value that is not a JSON string matches the entry's value read as JSON (`7`,
    /// `true`).
    Metadata(Vec<(String, String)>),
}

/// Why a HandleClass does not apply to a thread; counted in the sweep's summary by
/// [`NotApplicable::as_str`], never dropped silently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotApplicable {
    /// No `appliesTo`, and the thread's state has no channel at `statePath`.
    NoChannel,
    /// The thread's metadata does not match `appliesTo.metadata`.
    Metadata,
}

impl NotApplicable {
    /// The summary's key: `no_channel` or `metadata`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoChannel => "no_channel",
            Self::Metadata => "metadata",
        }
    }
}

impl AppliesTo {
    /// Whether the class applies to a thread with this checkpoint `metadata` and, per
    /// `has_channel`, the class's channel.
    ///
    /// # Errors
    /// Why it does not.
    pub fn check(
        &self,
        metadata: &serde_json::Map<String, Value>,
        has_channel: bool,
    ) -> Result<(), NotApplicable> {
        match self {
            Self::HavingChannel if has_channel => Ok(()),
            Self::HavingChannel => Err(NotApplicable::NoChannel),
            Self::Every => Ok(()),
            Self::Metadata(entries) => {
                let matches = |(key, want): &(String, String)| match metadata.get(key) {
                    Some(Value::String(s)) => s == want,
                    Some(other) => serde_json::from_str::<Value>(want).is_ok_and(|w| w == *other),
                    None => false,
                };
                if entries.iter().all(matches) {
                    Ok(())
                } else {
                    Err(NotApplicable::Metadata)
                }
            }
        }
    }
}

/// Looks up `path` given its channel (`None`: the thread has no such channel).
pub fn extract(channel: Option<Slot<'_>>, path: &StatePath, fields: &RecordFields) -> Holding {
    let value = match channel {
        None => return Holding::NotApplicable,
        Some(Slot::Empty) => return Holding::Absent,
        Some(Slot::Value(v)) => v,
    };
    match path.get_in(value) {
        Some(v) => record(v, fields),
        None => Holding::Absent,
    }
}

fn record(value: &Value, fields: &RecordFields) -> Holding {
    let map = match value {
        Value::Null => return Holding::Absent,
        Value::String(s) if s.is_empty() => return Holding::Absent,
        Value::String(s) => {
            return Holding::Record(HandleRecord {
                value: s.clone(),
                principal: None,
                minted_at: None,
                assumed_ttl_seconds: None,
                raw: value.clone(),
            });
        }
        Value::Object(map) => map,
        other => {
            return Holding::Malformed(format!(
                "expected a handle record (object) or a handle (string), found {}",
                kind(other)
            ));
        }
    };
    let handle = match map.get(&fields.value) {
        None | Some(Value::Null) => return Holding::Absent,
        Some(Value::String(s)) if s.is_empty() => return Holding::Absent,
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Holding::Malformed(format!(
                "record field {} should be a string, found {}",
                fields.value,
                kind(other)
            ));
        }
    };
    let text = |name: &str| map.get(name).and_then(Value::as_str).map(str::to_owned);
    Holding::Record(HandleRecord {
        value: handle,
        principal: text(&fields.principal),
        minted_at: text(&fields.minted_at).and_then(|t| parse_time(&t)),
        assumed_ttl_seconds: map.get(&fields.assumed_ttl_seconds).and_then(|v| {
            v.as_u64()
                .or_else(|| v.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
        }),
        raw: value.clone(),
    })
}

/// Python's `isoformat()` with an offset, or with `Z`, or naive (taken as UTC).
fn parse_time(s: &str) -> Option<DateTime<Utc>> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .or_else(|_| {
            chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f").map(|t| t.and_utc())
        })
        .ok()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applies_to_reads_the_channel_or_the_metadata() {
        let metadata = serde_json::json!({"graph_id": "orders", "step": 7})
            .as_object()
            .cloned()
            .unwrap();
        assert_eq!(AppliesTo::HavingChannel.check(&metadata, true), Ok(()));
        assert_eq!(
            AppliesTo::HavingChannel.check(&metadata, false),
            Err(NotApplicable::NoChannel)
        );
        assert_eq!(AppliesTo::Every.check(&metadata, false), Ok(()));
        let orders = |step: &str| {
            AppliesTo::Metadata(vec![
                ("graph_id".into(), "orders".into()),
                ("step".into(), step.into()),
            ])
        };
        assert_eq!(orders("7").check(&metadata, false), Ok(()));
        assert_eq!(
            orders("8").check(&metadata, true),
            Err(NotApplicable::Metadata)
        );
        let missing = AppliesTo::Metadata(vec![("assistant_id".into(), "a".into())]);
        assert_eq!(missing.check(&metadata, true), Err(NotApplicable::Metadata));
    }
    use serde_json::json;

    fn run(slot: Option<Slot<'_>>, path: &str, f: &RecordFields) -> Holding {
        extract(slot, &StatePath::new(path), f)
    }

    #[test]
    fn table() {
        let f = RecordFields::default();
        let rec = json!({"value": "bsk_1", "principal": "user-1", "minted_at": "2026-11-29T22:47:00.495988Z", "assumed_ttl_s": 900});
        let (null, empty, three, seven) = (json!(null), json!({}), json!(3), json!({"value": 7}));
        let null_value = json!({"value": null});
        let cases: Vec<(&str, Option<Slot<'_>>, &str, Holding)> = vec![
            ("no channel", None, "basket", Holding::NotApplicable),
            (
                "empty channel",
                Some(Slot::Empty),
                "basket",
                Holding::Absent,
            ),
            ("null", Some(Slot::Value(&null)), "basket", Holding::Absent),
            (
                "null value field",
                Some(Slot::Value(&null_value)),
                "basket",
                Holding::Absent,
            ),
            (
                "path ends early",
                Some(Slot::Value(&empty)),
                "order.basket",
                Holding::Absent,
            ),
            (
                "number",
                Some(Slot::Value(&three)),
                "basket",
                Holding::Malformed(
                    "expected a handle record (object) or a handle (string), found a number".into(),
                ),
            ),
            (
                "value not a string",
                Some(Slot::Value(&seven)),
                "basket",
                Holding::Malformed("record field value should be a string, found a number".into()),
            ),
        ];
        for (name, ch, path, want) in cases {
            assert_eq!(run(ch, path, &f), want, "{name}");
        }

        let nested = json!({"basket": rec});
        let Holding::Record(r) = run(Some(Slot::Value(&nested)), "order.basket", &f) else {
            panic!("nested record not found");
        };
        assert_eq!(r.value, "bsk_1");
        assert_eq!(r.principal.as_deref(), Some("user-1"));
        assert_eq!(r.assumed_ttl_seconds, Some(900));
        assert!(r.minted_at.is_some());

        let bare = json!("bsk_2");
        let Holding::Record(bare) = run(Some(Slot::Value(&bare)), "basket_id", &f) else {
            panic!("bare string handle not accepted");
        };
        assert_eq!((bare.value.as_str(), bare.principal), ("bsk_2", None));
    }

    #[test]
    fn mapped_field_names() {
        let f = RecordFields {
            value: "id".into(),
            principal: "owner".into(),
            ..RecordFields::default()
        };
        let ticket = json!({"id": "tkt_1", "owner": "u"});
        let Holding::Record(r) = run(Some(Slot::Value(&ticket)), "ticket", &f) else {
            panic!()
        };
        assert_eq!(
            (r.value.as_str(), r.principal.as_deref()),
            ("tkt_1", Some("u"))
        );
    }
}
