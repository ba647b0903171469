//! The patches an action appends to a thread: the verdict record, and the new handle.

use chrono::{DateTime, SecondsFormat, Utc};

use super::stored::LedgerPlan;
use crate::checkpoint::writer::{self, Patch, PatchValue};
use crate::domain::policy::{VerdictRecord, Written};
use crate::ledger::Entry;

/// The verdict record at the plan's `verdictPath`; none without one.
pub(super) fn verdict(
    entry: &Entry,
    plan: &LedgerPlan,
    verdict: Written,
    reason: &str,
    handle: Option<&str>,
    now: DateTime<Utc>,
) -> Vec<Patch> {
    let Some(path) = &plan.verdict_path else {
        return Vec::new();
    };
    let record = VerdictRecord {
        verdict,
        handle_class: Some(entry.handle_class.clone()),
        handle: handle.map(str::to_owned),
        reason: reason.to_owned(),
        at: now,
        audit: None,
    };
    vec![Patch {
        path: path.split('.').map(str::to_owned).collect(),
        value: PatchValue::Replace(writer::json_to_mp(&record.to_json())),
    }]
}

/// The new handle at the plan's state path: the value and mint-time fields of a record (its
/// other fields untouched), or the bare handle where the thread held a bare string.
pub(super) fn handle(plan: &LedgerPlan, handle: &str, now: DateTime<Utc>) -> Patch {
    let value = if plan.record.is_object() {
        PatchValue::SetFields(vec![
            (plan.value_field.clone(), handle.into()),
            (
                plan.minted_at_field.clone(),
                now.to_rfc3339_opts(SecondsFormat::Micros, true)
                    .as_str()
                    .into(),
            ),
        ])
    } else {
        PatchValue::Replace(handle.into())
    };
    Patch {
        path: plan.state_path.split('.').map(str::to_owned).collect(),
        value,
    }
}
