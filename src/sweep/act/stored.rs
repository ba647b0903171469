//! The plan stored with a ledger entry: an action's inputs, so it can be finished after a crash
//! without re-reading the thread (and the idempotency key it is filed under).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::Facts;
use crate::domain::path::StatePath;
use crate::domain::policy::Plan;
use crate::domain::template::Context;
use crate::plan::ClassPlan;
use crate::sweep::Row;

/// The idempotency key of an action: hex SHA-256 of (thread, namespace, checkpoint, class),
/// truncated to 128 bits. Stable across crashes and sweeps, different for every checkpoint.
pub fn idempotency_key(thread_id: &str, ns: &str, checkpoint_id: &str, class: &str) -> String {
    let mut h = Sha256::new();
    for part in [thread_id, ns, checkpoint_id, class] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    format!("custody-{}", &hex::encode(h.finalize())[..32])
}

/// An action's inputs, stored with its ledger entry so it can be finished after a crash
/// without re-reading the thread.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub(super) struct LedgerPlan {
    /// The handle the verdict is about (`None` when absent).
    pub(super) handle: Option<String>,
    /// The verdict's reason.
    pub(super) reason: String,
    pub(super) expect_interrupt: bool,
    pub(super) state_path: String,
    /// The handle record as stored (a map, or the bare handle string).
    pub(super) record: Value,
    pub(super) principal: Option<String>,
    pub(super) value_field: String,
    pub(super) minted_at_field: String,
    pub(super) verdict_path: Option<String>,
    /// Mint arguments, the idempotency key included.
    pub(super) mint_arguments: Option<Map<String, Value>>,
    /// The recorded items to replay.
    pub(super) items: Vec<Value>,
}

pub(super) fn ledger_plan_base(row: &Row, class: &ClassPlan, facts: &Facts) -> LedgerPlan {
    LedgerPlan {
        handle: row.handle.clone(),
        reason: row.reason.clone(),
        expect_interrupt: facts.expect_interrupt,
        state_path: class.state_path.to_string(),
        record: facts
            .record
            .as_ref()
            .map(|r| r.raw.clone())
            .unwrap_or(Value::Null),
        principal: facts.record.as_ref().and_then(|r| r.principal.clone()),
        value_field: class.fields.value.clone(),
        minted_at_field: class.fields.minted_at.clone(),
        verdict_path: class.action.verdict_path.as_ref().map(StatePath::to_string),
        mint_arguments: None,
        items: Vec::new(),
    }
}

/// The plan stored for a row; `Err` names what a re-mint lacks (it then escalates).
pub(super) fn ledger_plan(
    row: &Row,
    class: &ClassPlan,
    facts: &Facts,
    plan: Plan,
    key: &str,
) -> Result<LedgerPlan, String> {
    let mut p = ledger_plan_base(row, class, facts);
    if plan != Plan::Remint {
        return Ok(p);
    }
    if let Some(tool) = &facts.pending_call {
        return Err(format!(
            "the tool call {tool} waiting for the thread to resume carries the handle, and would spend the old one after a re-mint"
        ));
    }
    let a = &class.action;
    let (Some(mint), Some(path)) = (&a.mint, &a.mint_inputs_path) else {
        return Err("the handle class has no mint or mintInputsPath".into());
    };
    let mut arguments = match &facts.mint_inputs {
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(format!(
                "the state at {path} is not an object of mint arguments"
            ));
        }
        None => return Err(format!("the thread recorded no mint arguments at {path}")),
    };
    if let Some(arg) = &mint.idempotency_key_argument {
        arguments.insert(arg.clone(), Value::from(key));
    }
    p.mint_arguments = Some(arguments);
    if let Some(replay) = &a.replay {
        p.items = match &facts.items {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items.clone(),
            Some(_) => return Err(format!("the state at {} is not a list", replay.items_path)),
        };
    }
    // Render once before minting, so a template that cannot be filled escalates with nothing
    // minted; the handle is not known yet and does not change whether rendering succeeds.
    replay_calls(class, &p, "", &row.thread_id)?;
    Ok(p)
}

pub(super) fn replay_calls(
    class: &ClassPlan,
    plan: &LedgerPlan,
    handle: &str,
    thread_id: &str,
) -> Result<Vec<Value>, String> {
    let Some(replay) = &class.action.replay else {
        return Ok(Vec::new());
    };
    plan.items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let ctx = Context {
                handle,
                thread_id,
                principal: plan.principal.as_deref(),
                record: &plan.record,
                item: Some(item),
            };
            replay
                .arguments
                .render(&ctx)
                .map(Value::Object)
                .map_err(|e| format!("replay item {}: {e}", i + 1))
        })
        .collect()
}
