//! The report vocabulary of acting: how an action ended, as a report row, an Event and a
//! metric label show it.

use std::fmt;

use serde::Serialize;

use crate::domain::policy::Plan;

/// How acting on a row (or settling a ledger entry) ended. [`OutcomeKind`] names its variants
/// (snake_case, as serde's `outcome` tag).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, strum::EnumDiscriminants)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[strum_discriminants(
    name(OutcomeKind),
    derive(strum::IntoStaticStr, strum::EnumIter),
    strum(serialize_all = "snake_case")
)]
pub enum Outcome {
    /// Not acting (dry run, `mode: observe`, or no `--apply`): what would be done.
    Planned {
        /// Why acting would leave the row as it is (already escalated, no `verdictPath`), when
        /// it would; an observing sweep predicts that skip rather than reporting one.
        #[serde(skip_serializing_if = "Option::is_none")]
        would_skip: Option<String>,
    },
    /// A new handle is in the thread, the recorded items replayed onto it.
    Reminted {
        /// The new handle.
        handle: String,
        /// Replay calls made.
        replayed: u32,
    },
    /// Verdict `escalated` is in the thread.
    Escalated {
        /// Why a planned re-mint became an escalation, when it did.
        instead_of_remint: Option<String>,
    },
    /// Verdict `failed` is in the thread.
    Failed,
    /// Nothing was written; the reason says why (thread moved, already escalated, …).
    Skipped {
        /// Why.
        reason: String,
    },
    /// The action could not be completed now; the ledger entry stays open for the next sweep.
    Error {
        /// What failed.
        reason: String,
    },
}

impl Outcome {
    /// A bounded name for metric labels and Event reasons.
    pub fn kind(&self) -> &'static str {
        OutcomeKind::from(self).into()
    }

    /// Whether a person should look (a Warning rather than a Normal Event).
    pub fn is_warning(&self) -> bool {
        matches!(self, Self::Failed | Self::Error { .. })
            || matches!(
                self,
                Self::Escalated {
                    instead_of_remint: Some(_)
                }
            )
    }
}

/// The action column of a report row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RowAction {
    /// What custody does (or would do) about the row.
    pub plan: Plan,
    /// How it went.
    #[serde(flatten)]
    pub outcome: Outcome,
}

impl fmt::Display for RowAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Outcome::Planned { would_skip: None } => write!(f, "planned: {}", self.plan.as_str()),
            Outcome::Planned {
                would_skip: Some(reason),
            } => write!(f, "would skip: {reason}"),
            Outcome::Reminted { handle, replayed } => {
                write!(f, "reminted {handle} ({replayed} replayed)")
            }
            Outcome::Escalated {
                instead_of_remint: None,
            } => f.write_str("escalated"),
            Outcome::Escalated {
                instead_of_remint: Some(why),
            } => write!(f, "escalated: {why}"),
            Outcome::Failed => f.write_str("failed"),
            Outcome::Skipped { reason } => write!(f, "skipped: {reason}"),
            Outcome::Error { reason } => write!(f, "error: {reason}"),
        }
    }
}

/// A ledger entry a sweep settled before scanning.
#[derive(Clone, Debug, Serialize)]
pub struct SettledEntry {
    /// LangGraph thread id.
    pub thread_id: String,
    /// HandleClass name.
    pub handle_class: String,
    /// The action and how it ended.
    #[serde(flatten)]
    pub action: RowAction,
}
