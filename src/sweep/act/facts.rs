//! What acting needs of a row's thread, gathered while the scan has it in hand.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::checkpoint::Channel;
use crate::domain::handle::HandleRecord;
use crate::domain::path::StatePath;
use crate::domain::pending::{self, MESSAGES_CHANNEL};
use crate::domain::policy::{self, Case, Plan};
use crate::domain::verdict::{GoneBy, Verdict};
use crate::plan::ClassPlan;

/// What the scan saw of a row's thread that acting needs.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// The checkpoint had a pending interrupt (else it was parked by an edit).
    pub expect_interrupt: bool,
    /// The handle record, when there is one.
    pub record: Option<HandleRecord>,
    /// What decided the row's `gone` verdict, once it is decided.
    pub gone_by: Option<GoneBy>,
    /// The value at `mintInputsPath`.
    pub mint_inputs: Option<Value>,
    /// The value at `replay.itemsPath`.
    pub items: Option<Value>,
    /// The value at `verdictPath`.
    pub verdict_record: Option<Value>,
    /// A tool call waiting to run whose arguments carry the handle (its name): a re-mint would
    /// leave it spending the old handle, so the thread is escalated instead
    /// ([`pending::call_holding`]).
    pub pending_call: Option<String>,
}

impl Facts {
    /// Reads what `class` needs from a thread's decoded channels.
    pub fn gather(
        channels: &BTreeMap<String, Channel>,
        class: &ClassPlan,
        expect_interrupt: bool,
        record: Option<HandleRecord>,
    ) -> Self {
        let at = |path: Option<&StatePath>| path.and_then(|p| state_value(channels, p)).cloned();
        let pending_call = match (channels.get(MESSAGES_CHANNEL), &record) {
            (Some(Channel::Value(messages)), Some(r)) => pending::call_holding(messages, &r.value),
            _ => None,
        };
        Self {
            expect_interrupt,
            record,
            gone_by: None,
            mint_inputs: at(class.action.mint_inputs_path.as_ref()),
            items: at(class.action.replay.as_ref().map(|r| &r.items_path)),
            verdict_record: at(class.action.verdict_path.as_ref()),
            pending_call,
        }
    }
}

fn state_value<'a>(channels: &'a BTreeMap<String, Channel>, path: &StatePath) -> Option<&'a Value> {
    let Some(Channel::Value(v)) = channels.get(path.channel()) else {
        return None;
    };
    path.get_in(v)
}

/// The plan for a row: [`policy::decide`] on what the row, its class and its facts say.
pub fn decide(
    verdict: Verdict,
    class: &ClassPlan,
    facts: &Facts,
) -> Option<(Plan, Option<String>)> {
    let record = facts.record.as_ref();
    policy::decide(&Case {
        verdict,
        on_gone: class.action.on_gone,
        class: &class.name,
        handle: record.map(|r| r.value.as_str()),
        gone_by: facts.gone_by,
        written: facts.verdict_record.as_ref(),
        has_verdict_path: class.action.verdict_path.is_some(),
    })
}
