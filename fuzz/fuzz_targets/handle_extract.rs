//! Handle records and state paths: any JSON state value, any state path, mapped field names.
#![no_main]

use custody::domain::handle::{RecordFields, Slot, extract};
use custody::domain::path::StatePath;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (path, json) = text.split_once('\n').unwrap_or(("basket", &text));
    let Ok(value) = serde_json::from_str::<serde_json::Value>(json) else { return };
    let path = StatePath::new(path);
    let _ = extract(Some(Slot::Value(&value)), &path, &RecordFields::default());
    let _ = extract(Some(Slot::Empty), &path, &RecordFields::default());
    let mapped = RecordFields { value: "id".into(), principal: "value".into(), ..RecordFields::default() };
    let _ = extract(Some(Slot::Value(&value)), &path, &mapped);
});
