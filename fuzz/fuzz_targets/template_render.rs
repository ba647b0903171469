//! Argument templates of probe, mint and replay calls: any template, any handle and record.
#![no_main]

use std::collections::BTreeMap;

use custody::domain::template::{Context, Template};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\n');
    let (Some(args), handle, record) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or("{}")) else {
        return;
    };
    let Ok(args) = serde_json::from_str::<BTreeMap<String, serde_json::Value>>(args) else { return };
    let record = serde_json::from_str(record).unwrap_or(serde_json::Value::Null);
    let Ok(template) = Template::parse(&args) else { return };
    let ctx = Context { handle, thread_id: "t", principal: Some(handle), record: &record, item: Some(&record) };
    let _ = template.render(&ctx);
});
