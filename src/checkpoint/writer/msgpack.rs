//! Editing raw msgpack documents in place (maps as key/value lists), so the parts custody does
//! not touch keep their extension types byte for byte.

use rmpv::Value as Mp;
use serde_json::Value;

use super::WriteError;

pub(super) fn map_get<'a>(m: &'a Mp, key: &str) -> Option<&'a Mp> {
    match m {
        Mp::Map(entries) => entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

pub(super) fn map_get_mut<'a>(m: &'a mut Mp, key: &str) -> Option<&'a mut Mp> {
    match m {
        Mp::Map(entries) => entries
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

/// Sets `key` in a map, in place when present (msgpack maps keep insertion order, as Python's
/// dicts do), appended otherwise. A non-map is left alone.
pub(super) fn map_set(m: &mut Mp, key: &str, value: Mp) {
    if let Mp::Map(entries) = m {
        match entries.iter_mut().find(|(k, _)| k.as_str() == Some(key)) {
            Some((_, v)) => *v = value,
            None => entries.push((Mp::from(key), value)),
        }
    }
}

pub(super) fn map_mut<'a>(doc: &'a mut Mp, key: &str) -> Result<&'a mut Mp, WriteError> {
    if map_get(doc, key).is_none() {
        map_set(doc, key, Mp::Map(Vec::new()));
    }
    map_get_mut(doc, key)
        .filter(|m| matches!(m, Mp::Map(_)))
        .ok_or_else(|| WriteError::Unsupported(format!("checkpoint {key} is not a map")))
}

pub(super) fn set_json(
    doc: &mut Value,
    field: &str,
    key: &str,
    v: Value,
) -> Result<(), WriteError> {
    doc.get_mut(field)
        .and_then(Value::as_object_mut)
        .ok_or_else(|| WriteError::Unsupported(format!("checkpoint has no {field}")))?
        .insert(key.to_owned(), v);
    Ok(())
}

/// `None`, `str`, `int`, `float`, `bool` stay inline in PostgreSQL's `channel_values`.
pub(super) fn primitive_json(v: &Mp) -> Option<Value> {
    match v {
        Mp::Nil => Some(Value::Null),
        Mp::Boolean(b) => Some(Value::Bool(*b)),
        Mp::Integer(i) => i
            .as_i64()
            .map(Value::from)
            .or_else(|| i.as_u64().map(Value::from)),
        Mp::F32(f) => serde_json::Number::from_f64(f64::from(*f)).map(Value::Number),
        Mp::F64(f) => serde_json::Number::from_f64(*f).map(Value::Number),
        Mp::String(s) => s.as_str().map(|s| Value::String(s.to_owned())),
        _ => None,
    }
}

/// Plain JSON as msgpack: maps, lists, strings, numbers, booleans, nil. No extension types, so
/// nothing custody writes makes Python import anything (research §4, "Safety").
pub fn json_to_mp(v: &Value) -> Mp {
    match v {
        Value::Null => Mp::Nil,
        Value::Bool(b) => Mp::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Mp::from(i),
            (None, Some(u), _) => Mp::from(u),
            (_, _, f) => Mp::F64(f.unwrap_or_default()),
        },
        Value::String(s) => Mp::from(s.as_str()),
        Value::Array(items) => Mp::Array(items.iter().map(json_to_mp).collect()),
        Value::Object(m) => Mp::Map(
            m.iter()
                .map(|(k, v)| (Mp::from(k.as_str()), json_to_mp(v)))
                .collect(),
        ),
    }
}

pub(super) fn encode(v: &Mp) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
    out
}
