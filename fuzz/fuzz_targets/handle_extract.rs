//! Handle records and state paths: any JSON state value, any state path, mapped field names.
#![no_main]

use std::collections::BTreeMap;

use custody::checkpoint::Channel;
use custody::crd::RecordFields;
use custody::domain::handle::extract;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (path, json) = text.split_once('\n').unwrap_or(("basket", &text));
    let Ok(value) = serde_json::from_str::<serde_json::Value>(json) else { return };
    let channel = path.split('.').next().unwrap_or_default().to_owned();
    let channels: BTreeMap<String, Channel> = [(channel, Channel::Value(value))].into();
    let _ = extract(&channels, path, &RecordFields::default());
    let mapped = RecordFields { value: "id".into(), principal: "value".into(), ..RecordFields::default() };
    let _ = extract(&channels, path, &mapped);
});
