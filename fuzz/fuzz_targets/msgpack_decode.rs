//! LangGraph's msgpack (JsonPlusSerializer) as custody decodes it: a blob or writes value of any
//! serializer type, and a whole SQLite checkpoint document. Must never panic, hang or blow the
//! stack; malformed input is an error.
#![no_main]

use custody::checkpoint::{CheckpointDoc, serde};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (type_, bytes) = match data.split_first() {
        Some((t, rest)) => (["msgpack", "json", "null", "bytes", "empty", "msgpack+aes"][*t as usize % 6], rest),
        None => ("msgpack", data),
    };
    let _ = serde::decode_typed(type_, Some(bytes));
    if let Ok(doc) = serde::read(bytes) {
        let _ = serde::to_data(&doc);
        let _ = CheckpointDoc::from_msgpack(&doc, &["basket".to_owned(), "items".to_owned()]);
    }
});
