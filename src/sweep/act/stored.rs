//! The plan stored with a ledger entry: an action's inputs, so it can be finished after a crash
//! without re-reading the thread (and the idempotency key it is filed under).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::Facts;
use crate::domain::path::StatePath;
use crate::domain::policy::Plan;
use crate::domain::template::{Context, Template, TemplateError};
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

/// What a ledger entry's `plan` column holds: the action's inputs, and why a planned re-mint
/// became an escalation when it did.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Stored {
    pub(super) plan: LedgerPlan,
    pub(super) instead_of_remint: Option<String>,
    /// The replay templates bound to the plan's items ([`bind_replay`]), when this process
    /// planned the re-mint; not stored (a resumed entry binds them from the plan again).
    pub(super) replay: Option<Vec<Template>>,
}

impl Stored {
    pub(super) fn new(plan: LedgerPlan, instead_of_remint: Option<String>) -> Self {
        Self {
            plan,
            instead_of_remint,
            replay: None,
        }
    }

    /// The column's JSON: `{plan, instead_of_remint}`.
    pub(super) fn to_json(&self) -> Value {
        json!({"plan": self.plan, "instead_of_remint": self.instead_of_remint})
    }

    /// Reads the column back; `None` when it is not what [`Self::to_json`] writes.
    pub(super) fn from_json(v: &Value) -> Option<Self> {
        let plan = LedgerPlan::deserialize(v.get("plan")?).ok()?;
        let instead_of_remint = v
            .get("instead_of_remint")
            .and_then(Value::as_str)
            .map(str::to_owned);
        Some(Self::new(plan, instead_of_remint))
    }
}

/// Why a row's re-mint cannot be planned (it is escalated instead, with nothing minted).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum PlanError {
    /// A tool call waiting for the thread to resume carries the handle (the tool's name).
    #[error(
        "the tool call {0} waiting for the thread to resume carries the handle, and would spend the old one after a re-mint"
    )]
    PendingCall(String),
    /// The class has no `mint` or no `mintInputsPath`.
    #[error("the handle class has no mint or mintInputsPath")]
    NoMint,
    /// The value at `mintInputsPath` is not an object.
    #[error("the state at {0} is not an object of mint arguments")]
    MintInputsNotAnObject(String),
    /// Nothing at `mintInputsPath`.
    #[error("the thread recorded no mint arguments at {0}")]
    NoMintInputs(String),
    /// The value at `replay.itemsPath` is not a list.
    #[error("the state at {0} is not a list")]
    ItemsNotAList(String),
    /// A replay item's arguments cannot be filled in (1-based item number).
    #[error("replay item {item}: {source}")]
    ReplayItem {
        /// 1-based item number.
        item: usize,
        /// The template's error.
        source: TemplateError,
    },
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

/// The plan stored for a row, and for a re-mint its replay templates, bound.
///
/// # Errors
/// What a re-mint lacks (the row is then escalated).
pub(super) fn ledger_plan(
    row: &Row,
    class: &ClassPlan,
    facts: &Facts,
    plan: Plan,
    key: &str,
) -> Result<Stored, PlanError> {
    let mut p = ledger_plan_base(row, class, facts);
    if plan != Plan::Remint {
        return Ok(Stored::new(p, None));
    }
    if let Some(tool) = &facts.pending_call {
        return Err(PlanError::PendingCall(tool.clone()));
    }
    let a = &class.action;
    let (Some(mint), Some(path)) = (&a.mint, &a.mint_inputs_path) else {
        return Err(PlanError::NoMint);
    };
    let mut arguments = match &facts.mint_inputs {
        Some(Value::Object(m)) => m.clone(),
        Some(_) => return Err(PlanError::MintInputsNotAnObject(path.to_string())),
        None => return Err(PlanError::NoMintInputs(path.to_string())),
    };
    if let Some(arg) = &mint.idempotency_key_argument {
        arguments.insert(arg.clone(), Value::from(key));
    }
    p.mint_arguments = Some(arguments);
    if let Some(replay) = &a.replay {
        p.items = match &facts.items {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items.clone(),
            Some(_) => return Err(PlanError::ItemsNotAList(replay.items_path.to_string())),
        };
    }
    // Bound before minting, so a template that cannot be filled escalates with nothing minted;
    // only the handle, which is not known yet, is left to fill in.
    let bound = bind_replay(class, &p, &row.thread_id)?;
    let mut stored = Stored::new(p, None);
    stored.replay = Some(bound);
    Ok(stored)
}

/// The replay templates with every placeholder but `{{handle}}` filled in, one per recorded
/// item ([`Template::bind`]); none when the class has no replay.
///
/// # Errors
/// [`PlanError::ReplayItem`] for the first item whose arguments cannot be filled in.
pub(super) fn bind_replay(
    class: &ClassPlan,
    plan: &LedgerPlan,
    thread_id: &str,
) -> Result<Vec<Template>, PlanError> {
    let Some(replay) = &class.action.replay else {
        return Ok(Vec::new());
    };
    plan.items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let ctx = Context {
                handle: "",
                thread_id,
                principal: plan.principal.as_deref(),
                record: &plan.record,
                item: Some(item),
            };
            replay
                .arguments
                .bind(&ctx)
                .map_err(|source| PlanError::ReplayItem {
                    item: i + 1,
                    source,
                })
        })
        .collect()
}

/// The replay calls' arguments for `handle`, from [`bind_replay`]'s templates.
///
/// # Errors
/// [`PlanError::ReplayItem`] should a bound template still miss a value (binding left only
/// `{{handle}}`, which always has one).
pub(super) fn replay_calls(bound: &[Template], handle: &str) -> Result<Vec<Value>, PlanError> {
    let ctx = Context {
        handle,
        thread_id: "",
        principal: None,
        record: &Value::Null,
        item: None,
    };
    bound
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.render(&ctx)
                .map(Value::Object)
                .map_err(|source| PlanError::ReplayItem {
                    item: i + 1,
                    source,
                })
        })
        .collect()
}
