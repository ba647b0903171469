//! Finding the handle record a HandleClass names in a thread's state.
//!
//! The record is the handle-custody `HandleRecord` TypedDict: `{value, server, tool, principal,
//! minted_at, assumed_ttl_s}`; field names are mappable per HandleClass. A bare string at the
//! state path is accepted as a handle with no record around it.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::checkpoint::Channel;
use crate::crd::RecordFields;

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

/// Looks up `state_path` (`channel` or `channel.key.key`) in the decoded channels.
pub fn extract(
    channels: &BTreeMap<String, Channel>,
    state_path: &str,
    fields: &RecordFields,
) -> Holding {
    let mut segments = state_path.split('.');
    let channel = segments.next().unwrap_or_default();
    let mut value = match channels.get(channel) {
        None => return Holding::NotApplicable,
        Some(Channel::Empty) => return Holding::Absent,
        Some(Channel::Undecodable(reason)) => {
            return Holding::Malformed(format!("channel {channel} does not decode: {reason}"));
        }
        Some(Channel::Value(v)) => v,
    };
    for key in segments {
        match value.get(key) {
            Some(v) => value = v,
            None => return Holding::Absent,
        }
    }
    record(value, fields)
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
    use serde_json::json;

    fn channels(name: &str, v: Channel) -> BTreeMap<String, Channel> {
        [(name.to_owned(), v)].into()
    }

    #[test]
    fn table() {
        let f = RecordFields::default();
        let rec = json!({"value": "bsk_1", "principal": "user-1", "minted_at": "2026-11-29T22:47:00.495988Z", "assumed_ttl_s": 900});
        let cases: Vec<(&str, BTreeMap<String, Channel>, &str, Holding)> = vec![
            (
                "no channel",
                BTreeMap::new(),
                "basket",
                Holding::NotApplicable,
            ),
            (
                "empty channel",
                channels("basket", Channel::Empty),
                "basket",
                Holding::Absent,
            ),
            (
                "null",
                channels("basket", Channel::Value(Value::Null)),
                "basket",
                Holding::Absent,
            ),
            (
                "null value field",
                channels("basket", Channel::Value(json!({"value": null}))),
                "basket",
                Holding::Absent,
            ),
            (
                "path ends early",
                channels("order", Channel::Value(json!({}))),
                "order.basket",
                Holding::Absent,
            ),
            (
                "number",
                channels("basket", Channel::Value(json!(3))),
                "basket",
                Holding::Malformed(
                    "expected a handle record (object) or a handle (string), found a number".into(),
                ),
            ),
            (
                "value not a string",
                channels("basket", Channel::Value(json!({"value": 7}))),
                "basket",
                Holding::Malformed("record field value should be a string, found a number".into()),
            ),
            (
                "undecodable",
                channels(
                    "basket",
                    Channel::Undecodable(crate::checkpoint::DecodeError::malformed(
                        "unknown msgpack ext code 42",
                    )),
                ),
                "basket",
                Holding::Malformed(
                    "channel basket does not decode: unknown msgpack ext code 42".into(),
                ),
            ),
        ];
        for (name, ch, path, want) in cases {
            assert_eq!(extract(&ch, path, &f), want, "{name}");
        }

        let Holding::Record(r) = extract(
            &channels("order", Channel::Value(json!({"basket": rec}))),
            "order.basket",
            &f,
        ) else {
            panic!("nested record not found");
        };
        assert_eq!(r.value, "bsk_1");
        assert_eq!(r.principal.as_deref(), Some("user-1"));
        assert_eq!(r.assumed_ttl_seconds, Some(900));
        assert!(r.minted_at.is_some());

        let Holding::Record(bare) = extract(
            &channels("basket_id", Channel::Value(json!("bsk_2"))),
            "basket_id",
            &f,
        ) else {
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
        let ch = channels(
            "ticket",
            Channel::Value(json!({"id": "tkt_1", "owner": "u"})),
        );
        let Holding::Record(r) = extract(&ch, "ticket", &f) else {
            panic!()
        };
        assert_eq!(
            (r.value.as_str(), r.principal.as_deref()),
            ("tkt_1", Some("u"))
        );
    }
}
