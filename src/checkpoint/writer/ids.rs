//! The ids and versions LangGraph computes, computed the same way: task and interrupt ids,
//! checkpoint ids, channel versions and timestamps.

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::{PULL, WriteError};

/// Offset of the UUID epoch (1582-10-15) from the Unix epoch, in 100-ns ticks.
const UUID_EPOCH_OFFSET: u64 = 0x01B2_1DD2_1381_4000;

/// LangGraph's PULL task id (`_algo.py` `prepare_single_task`, checkpoint v ≥ 2):
/// `_xxhash_str(unhex(checkpoint_id), node, str(step), node, "__pregel_pull", *sorted(triggers))`
/// at the root namespace, formatted as a UUID.
///
/// # Errors
/// The checkpoint id is not a UUID.
pub fn task_id(
    checkpoint_id: &str,
    node: &str,
    step: i64,
    triggers: &[String],
) -> Result<String, WriteError> {
    let mut bytes = hex::decode(checkpoint_id.replace('-', "")).map_err(|_| {
        WriteError::Unsupported(format!("checkpoint id {checkpoint_id} is not a UUID"))
    })?;
    let mut sorted = triggers.to_vec();
    sorted.sort();
    for part in [node, &step.to_string(), node, PULL]
        .into_iter()
        .chain(sorted.iter().map(String::as_str))
    {
        bytes.extend_from_slice(part.as_bytes());
    }
    let hex = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes));
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    ))
}

/// LangGraph's id of a task's first interrupt: `xxh3_128_hexdigest(task checkpoint namespace)`
/// (`langgraph/types.py` `_interrupt_id`).
pub fn interrupt_id(task_ns: &str) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(task_ns.as_bytes()))
}

/// A UUIDv6 checkpoint id (`langgraph/checkpoint/base/id.py`) for `now`, with `clock_seq = step`,
/// that sorts after `after`: if the clock is behind the latest id, one tick after it.
///
/// # Errors
/// `after` is not a UUID.
pub fn new_checkpoint_id(after: &str, now: DateTime<Utc>, step: i64) -> Result<String, WriteError> {
    let hex: String = after.chars().filter(|c| *c != '-').collect();
    let ticks_of = |hex: &str| -> Option<u64> {
        let high = u64::from_str_radix(hex.get(0..12)?, 16).ok()?;
        let low = u64::from_str_radix(hex.get(13..16)?, 16).ok()?;
        Some((high << 12) | low)
    };
    let after_ticks = ticks_of(&hex)
        .ok_or_else(|| WriteError::Unsupported(format!("checkpoint id {after} is not a UUID")))?;
    let now_ticks = u64::try_from(now.timestamp_nanos_opt().unwrap_or_default() / 100)
        .unwrap_or_default()
        + UUID_EPOCH_OFFSET;
    let ticks = now_ticks.max(after_ticks + 1);
    let clock_seq = (step as u64) & 0x3fff;
    let node = uuid::Uuid::new_v4();
    let mut b = [0u8; 16];
    b[..6].copy_from_slice(&((ticks >> 12) << 16).to_be_bytes()[..6]);
    b[6..8].copy_from_slice(&(0x6000 | (ticks & 0x0fff) as u16).to_be_bytes());
    b[8..10].copy_from_slice(&(0x8000 | clock_seq as u16).to_be_bytes());
    b[10..].copy_from_slice(&node.as_bytes()[10..]);
    Ok(uuid::Uuid::from_bytes(b).hyphenated().to_string())
}

/// `get_next_version` of both savers: `f"{int(max) + 1:032}.{random}"`, one version for every
/// channel changed together.
pub(super) fn next_version<'a>(
    versions: impl Iterator<Item = &'a Value>,
) -> Result<String, WriteError> {
    let mut max = 0u64;
    for v in versions {
        let n = match v {
            Value::String(s) => s.split('.').next().and_then(|n| n.parse::<u64>().ok()),
            _ => None,
        }
        .ok_or_else(|| {
            WriteError::Unsupported("channel versions are not LangGraph 1.x version strings".into())
        })?;
        max = max.max(n);
    }
    let fraction = u64::from_be_bytes(
        uuid::Uuid::new_v4().as_bytes()[..8]
            .try_into()
            .unwrap_or_default(),
    ) % 10_000_000_000_000_000;
    Ok(format!("{:032}.0.{fraction:016}", max + 1))
}

/// `datetime.now(timezone.utc).isoformat()`.
pub(super) fn python_iso(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6f+00:00").to_string()
}
