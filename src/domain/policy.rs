//! What custody does about a verdict: the action policy, on a small input, and the verdict
//! record custody writes into a thread (built and read here only).
//!
//! | verdict | action |
//! |---|---|
//! | `ok`, `unknown` | nothing. `unknown` never: a probe that could not finish proves nothing |
//! | `gone`, handle minted for another principal | escalate: whether the thread's new principal may take over work done for the old one is a person's call, and a re-mint "for the same principal" would be gone again at the next sweep |
//! | `gone` | the class's `onGone`: `remint`, `escalate` or `fail` |
//! | `absent` | escalate: there is no handle whose work could be replayed, and a thread may lack one on purpose, so a person decides; custody never mints from nothing |
//!
//! A thread whose state already carries custody's `escalated`/`failed` verdict for the same
//! class and handle is left alone, so a parked, escalated thread is not rewritten every sweep.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::verdict::{GoneBy, Verdict};

/// What custody does with a handle that is gone (handle-custody: re-mint and replay, escalate,
/// or fail loudly).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnGone {
    /// Mint a new handle and replay the recorded work.
    Remint,
    /// Route the thread to a human.
    #[default]
    Escalate,
    /// End the thread loudly.
    Fail,
}

/// What custody does about one row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Plan {
    /// Mint a new handle, replay the recorded work, write the handle into the thread.
    Remint,
    /// Write verdict `escalated` so the graph routes to a person.
    Escalate,
    /// Write verdict `failed` so the graph ends loudly.
    Fail,
}

impl Plan {
    /// Lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Remint => "remint",
            Self::Escalate => "escalate",
            Self::Fail => "fail",
        }
    }
}

/// What the policy reads about one row: nothing else of the class, the server or the store.
#[derive(Clone, Copy, Debug)]
pub struct Case<'a> {
    /// The row's verdict.
    pub verdict: Verdict,
    /// The class's `onGone`.
    pub on_gone: OnGone,
    /// The HandleClass name.
    pub class: &'a str,
    /// The handle the thread holds, when it holds one.
    pub handle: Option<&'a str>,
    /// What decided a `gone` verdict ([`crate::domain::verdict::Decision::gone_by`]).
    pub gone_by: Option<GoneBy>,
    /// What the thread holds at the class's `verdictPath`.
    pub written: Option<&'a Value>,
    /// Whether the class has a `verdictPath`: escalate and fail write only there.
    pub has_verdict_path: bool,
}

/// Why an escalate or fail is left undone by a class without `verdictPath`.
pub const NO_VERDICT_PATH: &str = "the handle class has no verdictPath to write the verdict to";

/// The plan for a row (`None` for `ok` and `unknown`), with the reason to leave it undone when
/// custody already wrote its verdict for this handle, or has nowhere to write it (a dry run
/// then predicts the skip `--apply` would make).
pub fn decide(c: &Case<'_>) -> Option<(Plan, Option<String>)> {
    let plan = match c.verdict {
        Verdict::Ok | Verdict::Unknown => return None,
        Verdict::Absent => Plan::Escalate,
        Verdict::Gone => match c.gone_by {
            Some(GoneBy::OtherPrincipal) => Plan::Escalate,
            Some(GoneBy::Probe) | None => match c.on_gone {
                OnGone::Remint => Plan::Remint,
                OnGone::Escalate => Plan::Escalate,
                OnGone::Fail => Plan::Fail,
            },
        },
    };
    if let Some(done) = c.written.and_then(VerdictRecord::parse)
        && matches!(done.verdict, Written::Escalated | Written::Failed)
        && done.handle_class.as_deref() == Some(c.class)
        && done.handle.as_deref() == c.handle
    {
        return Some((plan, Some(format!("already {}", done.verdict.as_str()))));
    }
    if plan != Plan::Remint && !c.has_verdict_path {
        return Some((plan, Some(NO_VERDICT_PATH.to_owned())));
    }
    Some((plan, None))
}

/// The verdict custody writes at `verdictPath` (and at the audit's `verdictPath`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    /// A new handle is in the thread.
    Reminted,
    /// A person must look.
    Escalated,
    /// The thread should end loudly.
    Failed,
}

impl Written {
    /// The name in the record, which graphs route on.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reminted => "reminted",
            Self::Escalated => "escalated",
            Self::Failed => "failed",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Reminted, Self::Escalated, Self::Failed]
            .into_iter()
            .find(|w| w.as_str() == s)
    }
}

/// The audit record an escalated audit verdict is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditRef {
    /// `custody_audit.id`.
    pub id: i64,
    /// MCPServer name.
    pub server: String,
    /// Write tool.
    pub tool: String,
    /// The model's tool call id.
    pub tool_call_id: String,
    /// The call's idempotency key.
    pub idempotency_key: String,
}

/// custody's verdict record in a thread: `{verdict, handle_class, handle, reason, at}`, and
/// `audit` for an escalated audit record (README "Acting"). Built by [`Self::to_json`], read
/// back by [`Self::parse`]; nothing else spells its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerdictRecord {
    /// The verdict.
    pub verdict: Written,
    /// The HandleClass (`None` for an audit escalation).
    pub handle_class: Option<String>,
    /// The handle it is about (the new one after a re-mint).
    pub handle: Option<String>,
    /// Why, for a person and for the graph.
    pub reason: String,
    /// When custody wrote it.
    pub at: DateTime<Utc>,
    /// The audit record, for an audit escalation.
    pub audit: Option<AuditRef>,
}

impl VerdictRecord {
    /// The record as stored (`at` in RFC 3339 with microseconds and `Z`).
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "verdict": self.verdict.as_str(),
            "handle_class": self.handle_class,
            "handle": self.handle,
            "reason": self.reason,
            "at": self.at.to_rfc3339_opts(SecondsFormat::Micros, true),
        });
        if let Some(a) = &self.audit {
            v["audit"] = json!({
                "id": a.id,
                "server": a.server,
                "tool": a.tool,
                "tool_call_id": a.tool_call_id,
                "idempotency_key": a.idempotency_key,
            });
        }
        v
    }

    /// Reads what [`decide`] needs from a stored record: `None` when it is not one of custody's
    /// (no known `verdict`). Fields that are missing or not strings read as `None` or empty, and
    /// an unreadable `at` as the epoch: decide compares verdict, class and handle only.
    pub fn parse(v: &Value) -> Option<Self> {
        let verdict = Written::parse(v.get("verdict")?.as_str()?)?;
        let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        Some(Self {
            verdict,
            handle_class: text("handle_class"),
            handle: text("handle"),
            reason: text("reason").unwrap_or_default(),
            at: text("at")
                .and_then(|t| DateTime::parse_from_rfc3339(&t).ok())
                .map_or(DateTime::UNIX_EPOCH, |t| t.with_timezone(&Utc)),
            audit: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn case(verdict: Verdict, on_gone: OnGone) -> Case<'static> {
        Case {
            verdict,
            on_gone,
            class: "basket",
            handle: Some("bsk_1"),
            gone_by: (verdict == Verdict::Gone).then_some(GoneBy::Probe),
            written: None,
            has_verdict_path: true,
        }
    }

    /// The table of the module doc, row by row.
    #[test]
    fn the_policy_table() {
        use Verdict::*;
        let other = Case {
            gone_by: Some(GoneBy::OtherPrincipal),
            ..case(Gone, OnGone::Remint)
        };
        let cases = [
            ("ok is left alone", case(Ok, OnGone::Remint), None),
            (
                "unknown is never acted on",
                case(Unknown, OnGone::Fail),
                None,
            ),
            (
                "gone: remint",
                case(Gone, OnGone::Remint),
                Some(Plan::Remint),
            ),
            (
                "gone: escalate",
                case(Gone, OnGone::Escalate),
                Some(Plan::Escalate),
            ),
            ("gone: fail", case(Gone, OnGone::Fail), Some(Plan::Fail)),
            ("another principal escalates", other, Some(Plan::Escalate)),
            (
                "absent escalates",
                case(Absent, OnGone::Remint),
                Some(Plan::Escalate),
            ),
            (
                "absent escalates even on fail",
                case(Absent, OnGone::Fail),
                Some(Plan::Escalate),
            ),
        ];
        for (name, c, want) in cases {
            let got = decide(&c).map(|(p, skip)| {
                assert!(skip.is_none(), "{name}");
                p
            });
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn without_a_verdict_path_only_a_remint_is_planned() {
        for (on_gone, want) in [
            (OnGone::Remint, None),
            (OnGone::Escalate, Some(NO_VERDICT_PATH.to_owned())),
            (OnGone::Fail, Some(NO_VERDICT_PATH.to_owned())),
        ] {
            let c = Case {
                has_verdict_path: false,
                ..case(Verdict::Gone, on_gone)
            };
            assert_eq!(decide(&c).and_then(|(_, skip)| skip), want, "{on_gone:?}");
        }
        let absent = Case {
            has_verdict_path: false,
            ..case(Verdict::Absent, OnGone::Remint)
        };
        assert_eq!(
            decide(&absent).and_then(|(_, skip)| skip).as_deref(),
            Some(NO_VERDICT_PATH)
        );
    }

    #[test]
    fn custody_s_own_verdict_is_not_written_again() {
        let at = Utc.with_ymd_and_hms(2026, 11, 30, 1, 2, 3).unwrap();
        let record = |verdict, handle: &str| {
            VerdictRecord {
                verdict,
                handle_class: Some("basket".into()),
                handle: Some(handle.into()),
                reason: "gone".into(),
                at,
                audit: None,
            }
            .to_json()
        };
        let escalated = record(Written::Escalated, "bsk_1");
        let failed = record(Written::Failed, "bsk_1");
        let newer = record(Written::Escalated, "bsk_0");
        let reminted = record(Written::Reminted, "bsk_1");
        let foreign = json!({"verdict": "escalated", "handle_class": "ticket", "handle": "bsk_1"});
        let cases = [
            (&escalated, Some("already escalated")),
            (&failed, Some("already failed")),
            // A different handle since (someone fixed it, and the new one died too): act again.
            (&newer, None),
            (&reminted, None),
            (&foreign, None),
        ];
        for (written, want) in cases {
            let c = Case {
                written: Some(written),
                ..case(Verdict::Gone, OnGone::Escalate)
            };
            assert_eq!(
                decide(&c),
                Some((Plan::Escalate, want.map(str::to_owned))),
                "{written}"
            );
        }
    }

    #[test]
    fn the_record_reads_back_what_it_wrote() {
        let r = VerdictRecord {
            verdict: Written::Reminted,
            handle_class: Some("basket".into()),
            handle: Some("bsk_2".into()),
            reason: "probe answered isError: BASKET_NOT_FOUND".into(),
            at: Utc.with_ymd_and_hms(2026, 11, 30, 1, 2, 3).unwrap(),
            audit: None,
        };
        let v = r.to_json();
        assert_eq!(
            v,
            json!({"verdict": "reminted", "handle_class": "basket", "handle": "bsk_2",
                   "reason": "probe answered isError: BASKET_NOT_FOUND",
                   "at": "2026-11-30T01:02:03.000000Z"})
        );
        assert_eq!(VerdictRecord::parse(&v), Some(r));
        assert_eq!(VerdictRecord::parse(&json!({"verdict": "maybe"})), None);
        assert_eq!(VerdictRecord::parse(&json!("escalated")), None);
    }
}
