//! LangGraph's `JsonPlusSerializer` msgpack format, decoded into a JSON-like data view.
//!
//! Source of the rules: `langgraph/checkpoint/serde/jsonplus.py` (langgraph-checkpoint 4.3),
//! summarised in custody's research notes. Values are ormsgpack documents; anything that is not
//! a plain msgpack type is an extension whose payload is itself a msgpack document:
//!
//! | code | payload | data view |
//! |---|---|---|
//! | 0–2, 4, 5 | `[module, class, arg, ...]` | `arg` (element 2); `uuid.UUID` gets its dashes back |
//! | 3 | `[module, class, arg, method]` (datetime) | `arg`, the ISO-8601 string |
//! | 6 | numpy array | `{"$numpy": dtype}` (no data view: custody never needs array contents) |
//! | 7 | the value itself (DeltaChannel snapshot) | the value |
//!
//! This is the same "data view" LangGraph itself builds in `_msgpack_ext_hook_to_json`.
//! Decoding is two-stage so an unknown extension in one channel spoils only that channel:
//! [`read`] checks framing and yields an [`rmpv::Value`]; [`to_data`] interprets extensions.

use std::fmt;

use rmpv::Value as Mp;
use serde_json::{Map, Number, Value};

/// Extension payloads nest (a message inside a Command inside a Send); deeper than this is
/// treated as hostile input rather than recursed into.
pub const MAX_DEPTH: usize = 128;

/// The largest stored value custody decodes, in bytes: one PostgreSQL blob, or one whole SQLite
/// checkpoint document (SqliteSaver keeps every channel value inside it). 16 MiB is far above a
/// handle record or a long conversation, and keeps a sweep inside the sweep CronJob's 256 MiB
/// memory limit: decoding costs a few times the input, and an oversized value is not even
/// fetched (the readers compare `octet_length`/`length` in SQL first).
pub const MAX_VALUE_BYTES: usize = 16 << 20;

/// Why a stored value was not decoded: a bounded category, used as the metric label
/// `custody_sweep_skipped_threads{reason}` and in `SweepSummary::skipped_by_reason`.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum DecodeKind {
    /// Malformed or truncated msgpack or JSON, an unknown msgpack ext code, a value of the wrong
    /// type where the checkpoint format fixes one.
    Decode,
    /// Larger than [`MAX_VALUE_BYTES`].
    TooLarge,
    /// A format custody does not read: `pickle`, an encrypted `<type>+<cipher>` value, a
    /// checkpoint document newer than format v4, a SQLite checkpoint stored as neither msgpack nor
    /// json.
    UnsupportedFormat,
}

impl DecodeKind {
    /// The snake_case name, as serialized and as a metric label.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Why bytes could not be decoded. The message names the problem, never the bytes themselves
/// (they may hold user data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// The bounded category.
    pub kind: DecodeKind,
    /// What was wrong, in one line.
    pub message: String,
}

impl DecodeError {
    /// A [`DecodeKind::Decode`] error.
    pub fn malformed(message: impl Into<String>) -> Self {
        Self {
            kind: DecodeKind::Decode,
            message: message.into(),
        }
    }

    /// A [`DecodeKind::UnsupportedFormat`] error.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self {
            kind: DecodeKind::UnsupportedFormat,
            message: message.into(),
        }
    }

    /// A [`DecodeKind::TooLarge`] error for a value of `len` bytes (`what` names the value).
    pub fn too_large(what: &str, len: usize) -> Self {
        Self {
            kind: DecodeKind::TooLarge,
            message: format!(
                "{what} is {len} bytes, over custody's limit of {MAX_VALUE_BYTES} bytes; not decoded"
            ),
        }
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DecodeError {}

/// Reads exactly one msgpack document from `bytes`.
///
/// # Errors
/// More than [`MAX_VALUE_BYTES`], truncated or malformed msgpack, nesting beyond [`MAX_DEPTH`],
/// or trailing bytes.
pub fn read(bytes: &[u8]) -> Result<Mp, DecodeError> {
    if bytes.len() > MAX_VALUE_BYTES {
        return Err(DecodeError::too_large("the msgpack value", bytes.len()));
    }
    let mut cursor = bytes;
    let value = rmpv::decode::read_value_with_max_depth(&mut cursor, MAX_DEPTH)
        .map_err(|e| DecodeError::malformed(format!("malformed msgpack: {e}")))?;
    if !cursor.is_empty() {
        return Err(DecodeError::malformed(format!(
            "malformed msgpack: {} trailing bytes after the document",
            cursor.len()
        )));
    }
    Ok(value)
}

/// Decodes a typed value as LangGraph stores it in blobs and writes: `(type, bytes)`.
///
/// Returns `None` for type `empty` (a channel version without a value). Only the unencrypted
/// types are understood: `msgpack`, `null`, `json`, `bytes`/`bytearray`.
///
/// # Errors
/// An unsupported type (`pickle`, an encrypted `msgpack+aes`, anything unknown), more than
/// [`MAX_VALUE_BYTES`], or bytes that do not decode as that type.
pub fn decode_typed(type_: &str, bytes: Option<&[u8]>) -> Result<Option<Value>, DecodeError> {
    if let Some(b) = bytes
        && b.len() > MAX_VALUE_BYTES
    {
        return Err(DecodeError::too_large(
            &format!("the {type_} value"),
            b.len(),
        ));
    }
    match type_ {
        "empty" => Ok(None),
        "null" => Ok(Some(Value::Null)),
        "msgpack" => {
            let bytes =
                bytes.ok_or_else(|| DecodeError::malformed("msgpack value with no bytes"))?;
            to_data(&read(bytes)?).map(Some)
        }
        "json" => {
            let bytes = bytes.ok_or_else(|| DecodeError::malformed("json value with no bytes"))?;
            serde_json::from_slice(bytes)
                .map(Some)
                .map_err(|e| DecodeError::malformed(format!("malformed json value: {e}")))
        }
        "bytes" | "bytearray" => Ok(Some(bytes_view(bytes.unwrap_or_default()))),
        other if other.contains('+') => Err(DecodeError::unsupported(format!(
            "value is encrypted ({other}); custody does not hold the key"
        ))),
        other => Err(DecodeError::unsupported(format!(
            "unsupported serializer type {other:?}"
        ))),
    }
}

/// Converts a msgpack value into the JSON-like data view described in the module docs.
///
/// # Errors
/// An extension whose payload is malformed, an unknown extension code, or nesting beyond
/// [`MAX_DEPTH`].
pub fn to_data(value: &Mp) -> Result<Value, DecodeError> {
    convert(value, 0)
}

fn convert(value: &Mp, depth: usize) -> Result<Value, DecodeError> {
    if depth > MAX_DEPTH {
        return Err(DecodeError::malformed(format!(
            "value nested deeper than {MAX_DEPTH}"
        )));
    }
    Ok(match value {
        Mp::Nil => Value::Null,
        Mp::Boolean(b) => Value::Bool(*b),
        Mp::Integer(i) => match (i.as_i64(), i.as_u64()) {
            (Some(n), _) => Value::from(n),
            (None, Some(n)) => Value::from(n),
            (None, None) => Value::Null,
        },
        Mp::F32(f) => float(f64::from(*f)),
        Mp::F64(f) => float(*f),
        Mp::String(s) => Value::String(text(s)?.to_owned()),
        Mp::Binary(b) => bytes_view(b),
        Mp::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| convert(v, depth + 1))
                .collect::<Result<_, _>>()?,
        ),
        Mp::Map(entries) => {
            let mut map = Map::with_capacity(entries.len());
            for (k, v) in entries {
                map.insert(key_text(k, depth)?, convert(v, depth + 1)?);
            }
            Value::Object(map)
        }
        Mp::Ext(code, payload) => ext(*code, payload, depth)?,
    })
}

/// ormsgpack's `OPT_NON_STR_KEYS` allows int, float, bool and None keys (and extension types
/// that read as one, such as a UUID); JSON needs strings. A key that reads as a map or an array
/// is refused: LangGraph never writes one, and rendering nested keys as JSON text re-escapes
/// each level, so a few hundred bytes of nested keys would grow exponentially (found by the
/// `msgpack_decode` fuzz target).
fn key_text(key: &Mp, depth: usize) -> Result<String, DecodeError> {
    match key {
        Mp::String(s) => Ok(text(s)?.to_owned()),
        Mp::Map(_) | Mp::Array(_) => Err(DecodeError::malformed(
            "map key is a map or an array; only scalar keys are supported",
        )),
        other => match convert(other, depth + 1)? {
            Value::String(s) => Ok(s),
            scalar @ (Value::Null | Value::Bool(_) | Value::Number(_)) => Ok(scalar.to_string()),
            Value::Array(_) | Value::Object(_) => Err(DecodeError::malformed(
                "map key is an extension value that reads as a map or an array; only scalar keys \
                 are supported",
            )),
        },
    }
}

/// A msgpack string as text, exactly. ormsgpack's `unpackb` (LangGraph's reader) refuses a
/// checkpoint with invalid UTF-8 in any string; a replacement character instead would make
/// custody probe a handle that is not the one stored (issue 17, item 1).
///
/// # Errors
/// The string is not valid UTF-8; the message says where, never the bytes.
pub fn text(s: &rmpv::Utf8String) -> Result<&str, DecodeError> {
    s.as_str().ok_or_else(|| match s.as_err() {
        Some(e) => DecodeError::malformed(format!(
            "a msgpack string is not valid UTF-8 (invalid byte at offset {} of {})",
            e.valid_up_to(),
            s.as_bytes().len()
        )),
        None => DecodeError::malformed("a msgpack string is not valid UTF-8"),
    })
}

fn float(f: f64) -> Value {
    // JSON has no NaN or infinity; Python writes them, so keep them readable rather than fail.
    Number::from_f64(f).map_or_else(|| Value::String(f.to_string()), Value::Number)
}

fn bytes_view(bytes: &[u8]) -> Value {
    let mut map = Map::new();
    map.insert("$bytes".into(), Value::String(hex::encode(bytes)));
    Value::Object(map)
}

fn ext(code: i8, payload: &[u8], depth: usize) -> Result<Value, DecodeError> {
    let inner = {
        let mut cursor = payload;
        let v =
            rmpv::decode::read_value_with_max_depth(&mut cursor, MAX_DEPTH.saturating_sub(depth))
                .map_err(|e| {
                DecodeError::malformed(format!("malformed payload of msgpack ext {code}: {e}"))
            })?;
        if !cursor.is_empty() {
            return Err(DecodeError::malformed(format!(
                "trailing bytes in payload of msgpack ext {code}"
            )));
        }
        v
    };
    match code {
        0..=5 => {
            let Mp::Array(parts) = &inner else {
                return Err(DecodeError::malformed(format!(
                    "msgpack ext {code} payload is not an array"
                )));
            };
            let (module, class) = match (parts.first(), parts.get(1)) {
                (Some(Mp::String(m)), Some(Mp::String(c))) => (text(m)?, text(c)?),
                _ => {
                    return Err(DecodeError::malformed(format!(
                        "msgpack ext {code} payload lacks [module, class]"
                    )));
                }
            };
            let arg = parts.get(2).ok_or_else(|| {
                DecodeError::malformed(format!(
                    "msgpack ext {code} ({module}.{class}) has no argument"
                ))
            })?;
            if code == 0
                && module == "uuid"
                && class == "UUID"
                && let Mp::String(hex) = arg
                && let Some(hex) = hex.as_str()
                && hex.len() == 32
                // Byte slicing below needs ASCII: 32 bytes of multi-byte text would panic.
                && hex.bytes().all(|b| b.is_ascii_hexdigit())
            {
                return Ok(Value::String(format!(
                    "{}-{}-{}-{}-{}",
                    &hex[0..8],
                    &hex[8..12],
                    &hex[12..16],
                    &hex[16..20],
                    &hex[20..32]
                )));
            }
            convert(arg, depth + 1)
        }
        6 => {
            let dtype = match &inner {
                Mp::Array(parts) => match parts.first() {
                    Some(Mp::String(d)) => text(d)?,
                    _ => "?",
                },
                _ => "?",
            };
            let mut map = Map::new();
            map.insert("$numpy".into(), Value::String(dtype.to_owned()));
            Ok(Value::Object(map))
        }
        7 => convert(&inner, depth + 1),
        other => Err(DecodeError::malformed(format!(
            "unknown msgpack ext code {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use strum::IntoEnumIterator;

    fn unhex(s: &str) -> Vec<u8> {
        hex::decode(s.split_whitespace().collect::<String>()).unwrap()
    }

    fn encode(v: &Mp) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    /// Regression for a fuzz finding: keys nested in keys made the JSON key text grow
    /// exponentially (each level re-escapes the one below), so ~1 KB of msgpack hung the decoder.
    #[test]
    fn nested_map_keys_are_refused_in_linear_time() {
        let mut key = Mp::from("k");
        for _ in 0..60 {
            key = Mp::Map(vec![(key, Mp::Nil)]);
        }
        let bytes = encode(&Mp::Map(vec![(key, Mp::from(1))]));
        let started = std::time::Instant::now();
        let err = decode_typed("msgpack", Some(&bytes)).unwrap_err();
        assert!(err.message.contains("only scalar keys"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        let found = include_bytes!(
            "../../fuzz/regressions/msgpack_decode/timeout-7e4f3b01d3d425c165f8b28403c67e448200a259"
        );
        let _ = decode_typed("msgpack", Some(&found[1..]));
        let ok = encode(&Mp::Map(vec![
            (Mp::from(7), Mp::from(1)),
            (Mp::Nil, Mp::from(2)),
        ]));
        assert_eq!(
            decode_typed("msgpack", Some(&ok)).unwrap(),
            Some(json!({"7": 1, "null": 2}))
        );
    }

    fn ext_of(code: i8, inner: Mp) -> Mp {
        Mp::Ext(code, encode(&inner))
    }

    #[test]
    fn handle_record_is_a_plain_map() {
        // A HandleRecord TypedDict as LangGraph 1.2 writes it (research serde samples).
        let bytes = unhex(
            "86 a5 76616c7565 b0 62736b5f363662326461366461366366 a6 736572766572 a7 62696c6c696e67
             a4 746f6f6c ad 6372656174655f6261736b6574 a9 7072696e636970616c a6 757365722d31
             a9 6d696e7465645f6174 bb 323032362d31312d32395432323a34373a30302e3439353938385a
             ad 617373756d65645f74746c5f73 cd 0384",
        );
        let v = to_data(&read(&bytes).unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"value": "bsk_66b2da6da6cf", "server": "billing", "tool": "create_basket",
                   "principal": "user-1", "minted_at": "2026-11-29T22:47:00.495988Z",
                   "assumed_ttl_s": 900})
        );
    }

    #[test]
    fn uuid_gets_dashes_and_datetime_its_iso_string() {
        let uuid = ext_of(
            0,
            Mp::Array(vec![
                "uuid".into(),
                "UUID".into(),
                "12345678123456781234567812345678".into(),
            ]),
        );
        assert_eq!(
            to_data(&uuid).unwrap(),
            json!("12345678-1234-5678-1234-567812345678")
        );
        let dt = ext_of(
            3,
            Mp::Array(vec![
                "datetime".into(),
                "datetime".into(),
                "2025-01-02T03:04:05.123456+00:00".into(),
                "fromisoformat".into(),
            ]),
        );
        assert_eq!(
            to_data(&dt).unwrap(),
            json!("2025-01-02T03:04:05.123456+00:00")
        );
    }

    #[test]
    fn pydantic_model_yields_its_field_dict_and_nested_ext_decodes() {
        let created = ext_of(
            3,
            Mp::Array(vec![
                "datetime".into(),
                "datetime".into(),
                "2026-01-01T00:00:00+00:00".into(),
                "fromisoformat".into(),
            ]),
        );
        let model = ext_of(
            5,
            Mp::Array(vec![
                "app.models".into(),
                "Basket".into(),
                Mp::Map(vec![
                    ("value".into(), "bsk_1".into()),
                    ("created".into(), created),
                ]),
                "model_validate_json".into(),
            ]),
        );
        assert_eq!(
            to_data(&model).unwrap(),
            json!({"value": "bsk_1", "created": "2026-01-01T00:00:00+00:00"})
        );
    }

    #[test]
    fn non_string_keys_become_their_json_text() {
        let map = Mp::Map(vec![(Mp::from(1), "a".into()), (Mp::Nil, "b".into())]);
        assert_eq!(to_data(&map).unwrap(), json!({"1": "a", "null": "b"}));
    }

    #[test]
    fn unknown_ext_and_bad_frames_are_errors_not_panics() {
        assert!(
            to_data(&ext_of(42, Mp::Nil))
                .unwrap_err()
                .message
                .contains("unknown msgpack ext code 42")
        );
        assert!(to_data(&Mp::Ext(0, vec![0xc1])).is_err());
        assert!(
            read(&[0x92, 0x01])
                .unwrap_err()
                .message
                .contains("malformed")
        );
        assert!(
            read(&[0x01, 0x02])
                .unwrap_err()
                .message
                .contains("trailing")
        );
        assert!(to_data(&ext_of(1, "not an array".into())).is_err());
    }

    #[test]
    fn typed_values() {
        assert_eq!(decode_typed("empty", None).unwrap(), None);
        assert_eq!(decode_typed("null", Some(b"")).unwrap(), Some(Value::Null));
        assert_eq!(
            decode_typed("json", Some(br#"{"a":1}"#)).unwrap(),
            Some(json!({"a": 1}))
        );
        assert!(
            decode_typed("msgpack+aes", Some(b"x"))
                .unwrap_err()
                .message
                .contains("encrypted")
        );
        assert!(decode_typed("pickle", Some(b"x")).is_err());
    }

    #[test]
    fn errors_carry_a_bounded_kind() {
        let kind = |t: &str, b: &[u8]| decode_typed(t, Some(b)).unwrap_err().kind;
        assert_eq!(kind("pickle", b"x"), DecodeKind::UnsupportedFormat);
        assert_eq!(kind("msgpack+aes", b"x"), DecodeKind::UnsupportedFormat);
        assert_eq!(kind("msgpack", &[0x92, 0x01]), DecodeKind::Decode);
        assert_eq!(kind("msgpack", &[0xd4, 42, 0x00]), DecodeKind::Decode);
        assert_eq!(kind("json", b"{"), DecodeKind::Decode);
        let huge = vec![0xc0; MAX_VALUE_BYTES + 1];
        let e = decode_typed("msgpack", Some(&huge)).unwrap_err();
        assert_eq!(e.kind, DecodeKind::TooLarge);
        assert_eq!(
            e.message,
            format!(
                "the msgpack value is {} bytes, over custody's limit of {MAX_VALUE_BYTES} bytes; not decoded",
                MAX_VALUE_BYTES + 1
            )
        );
        assert_eq!(read(&huge).unwrap_err().kind, DecodeKind::TooLarge);
        assert_eq!(
            DecodeKind::iter()
                .map(DecodeKind::as_str)
                .collect::<Vec<_>>(),
            ["decode", "too_large", "unsupported_format"]
        );
    }

    /// ormsgpack (LangGraph's reader) refuses invalid UTF-8 in any string; so does custody,
    /// in values, keys and extension payloads, instead of replacing bytes (issue 17, item 1).
    #[test]
    fn invalid_utf8_is_an_error_never_a_replacement() {
        let err = decode_typed("msgpack", Some(&[0xa4, b'b', b's', b'k', 0xff])).unwrap_err();
        assert_eq!(err.kind, DecodeKind::Decode);
        assert_eq!(
            err.message,
            "a msgpack string is not valid UTF-8 (invalid byte at offset 3 of 4)"
        );
        let key = [0x81, 0xa2, 0xff, b'k', 0x01];
        assert!(decode_typed("msgpack", Some(&key)).is_err());
        let mut module = vec![0x93, 0xa2, 0xc3, 0x28, 0xa1, b'C', 0x01];
        let mut ext = vec![0xc7, u8::try_from(module.len()).unwrap(), 0x00];
        ext.append(&mut module);
        assert!(decode_typed("msgpack", Some(&ext)).is_err());
        // 32 bytes that are valid UTF-8 but not hex: no slicing inside a character.
        let uuid = ext_of(
            0,
            Mp::Array(vec![
                "uuid".into(),
                "UUID".into(),
                format!("aa{}", "€".repeat(10)).into(),
            ]),
        );
        assert_eq!(
            to_data(&uuid).unwrap(),
            json!(format!("aa{}", "€".repeat(10)))
        );
    }

    #[test]
    fn deep_nesting_is_refused() {
        let mut v = Mp::Nil;
        for _ in 0..(MAX_DEPTH + 2) {
            v = ext_of(7, v);
        }
        assert!(to_data(&v).is_err());
    }
}
