//! The verdict on one handle, after handle-custody's `confirm_handle`:
//!
//! 1. no handle → `absent` (a node that needs a handle and has none is as stuck as one holding a
//!    dead handle);
//! 2. minted for another principal than the thread now runs for → `gone`, without a round trip;
//! 3. a declared lifetime that has not elapsed → `ok`, without a round trip, unless the sweep
//!    probes the handle as one of its bounded sample of young handles ([`Precheck::WithinTtl`],
//!    [`sampled`]): then the probe decides, except that a probe that could not be completed
//!    leaves the lifetime's `ok`;
//! 4. otherwise the probe decides: an answer that says unknown/expired → `gone`, a success → `ok`,
//!    and a probe that could not be completed → `unknown`. A probe that *raised* is never `gone`.

use chrono::{DateTime, Utc};
use regex::Regex;
use serde::Serialize;
use serde_json::Value;

use super::handle::{HandleRecord, Holding};

/// The verdict on one (thread, handle class). Its names (serde's and strum's, which
/// [`Verdict::as_str`] and the metric labels use) are the lower-case variant names.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum Verdict {
    /// The handle is alive, or presumed alive within its declared lifetime.
    Ok,
    /// The server no longer honours the handle for this thread.
    Gone,
    /// The thread needs a handle and holds none.
    Absent,
    /// It could not be decided; nothing may be done on its basis.
    Unknown,
}

impl Verdict {
    /// Lower-case name, as printed.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What decided a `gone` verdict. The action policy follows the class's `onGone` for a probe's
/// `gone` but escalates a handle minted for another principal, so it reads the cause here
/// instead of comparing the principals again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GoneBy {
    /// The probe's answer (step 4).
    Probe,
    /// The handle was minted for another principal than the thread now runs for (step 2).
    OtherPrincipal,
}

/// A verdict with the reason a person reads at 3 a.m.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    /// The verdict.
    pub verdict: Verdict,
    /// Why, in one line.
    pub reason: String,
    /// What decided it: `Some` exactly when the verdict is `gone`.
    #[serde(skip)]
    pub gone_by: Option<GoneBy>,
}

impl Decision {
    fn new(verdict: Verdict, reason: impl Into<String>) -> Self {
        Self {
            verdict,
            reason: reason.into(),
            gone_by: None,
        }
    }

    fn gone(by: GoneBy, reason: impl Into<String>) -> Self {
        Self {
            verdict: Verdict::Gone,
            reason: reason.into(),
            gone_by: Some(by),
        }
    }
}

/// The outcome of the steps that need no round trip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Precheck {
    /// Decided without the server.
    Decided(Decision),
    /// Within its declared lifetime: `ok` without a round trip ([`within_ttl`]), unless the
    /// sweep probes it to measure the lifetime (its sample of young handles), when [`sampled`]
    /// decides.
    WithinTtl {
        /// Seconds since the handle's `minted_at`.
        age: i64,
        /// The lifetime that has not elapsed (the shorter of the declared ones), seconds.
        ttl: u64,
    },
    /// Only the probe can tell.
    Probe,
}

/// Steps 1–3: decides what can be decided without the server.
///
/// `thread_principal` is the principal in the thread's latest checkpoint metadata; when either
/// side has none, the principal check is skipped (there is nothing to compare). The lifetime is
/// the shorter of the class's `declared_ttl` and the record's own `assumed_ttl_s`.
pub fn precheck(
    holding: &Holding,
    thread_principal: Option<&str>,
    declared_ttl: Option<u64>,
    now: DateTime<Utc>,
) -> Precheck {
    let record = match holding {
        Holding::NotApplicable | Holding::Absent => {
            return Precheck::Decided(Decision::new(Verdict::Absent, "the thread holds no handle"));
        }
        Holding::Malformed(reason) => {
            return Precheck::Decided(Decision::new(Verdict::Unknown, reason.clone()));
        }
        Holding::Record(r) => r,
    };
    if let (Some(minted_for), Some(current)) = (record.principal.as_deref(), thread_principal)
        && minted_for != current
    {
        return Precheck::Decided(Decision::gone(
            GoneBy::OtherPrincipal,
            format!("minted for principal {minted_for}, thread now runs as {current}"),
        ));
    }
    fresh(record, declared_ttl, now).unwrap_or(Precheck::Probe)
}

fn fresh(record: &HandleRecord, declared_ttl: Option<u64>, now: DateTime<Utc>) -> Option<Precheck> {
    let ttl = match (declared_ttl, record.assumed_ttl_seconds) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    let age = now.signed_duration_since(record.minted_at?).num_seconds();
    // A mint time in the future (clock skew) proves nothing; probe instead.
    (age >= 0 && (age as u64) < ttl).then_some(Precheck::WithinTtl { age, ttl })
}

/// The decision on a handle within its declared lifetime that is not probed: `ok`.
pub fn within_ttl(age: i64, ttl: u64) -> Decision {
    Decision::new(
        Verdict::Ok,
        format!("within its declared lifetime ({age}s of {ttl}s); not probed"),
    )
}

/// The decision on a handle within its declared lifetime that the sweep probed as one of its
/// sample of young handles (so that handles dying before their declared lifetime are seen at
/// all), and whether the probe decided it. An `ok` or `gone` answer decides, exactly as for any
/// probe (a dead handle is dead whatever its declaration said); a probe that could not be
/// completed (`unknown`) proves nothing, so the lifetime's `ok` stands ([`within_ttl`], with
/// the failure in the reason) and the row does not count as probed.
pub fn sampled(probe: Decision, age: i64, ttl: u64) -> (Decision, bool) {
    match probe.verdict {
        Verdict::Unknown => (
            Decision::new(
                Verdict::Ok,
                format!(
                    "within its declared lifetime ({age}s of {ttl}s); a sample probe did not decide ({})",
                    probe.reason
                ),
            ),
            false,
        ),
        _ => (
            Decision {
                reason: format!(
                    "{}; sampled within its declared lifetime ({age}s of {ttl}s)",
                    probe.reason
                ),
                ..probe
            },
            true,
        ),
    }
}

/// What a probe call came back with.
#[derive(Clone, Debug, PartialEq)]
pub enum ProbeOutcome {
    /// The server answered the `tools/call` with a result.
    Answered {
        /// The result's `isError`.
        is_error: bool,
        /// The text content blocks, joined by newlines.
        text: String,
        /// The result's `structuredContent`.
        structured: Option<Value>,
    },
    /// No result: refused, timed out, 5xx, a JSON-RPC error, a malformed reply.
    Failed(String),
}

/// Which probe answers mean "gone" (HandleClass `spec.probe.goneWhen`, converted by the compile
/// step). Anything else that is an error means `unknown`, never gone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GoneWhen {
    /// An `isError` text starting with one of these is gone. `Some` narrows even when empty
    /// (then no text matches): a list that was written, however short, is never read as "no
    /// narrowing" (validation refuses an empty one; this keeps the rule safe without it).
    pub error_text_prefixes: Option<Vec<String>>,
    /// An `isError` text matching this regular expression is gone.
    pub error_text_regex: Option<String>,
    /// A successful answer whose `structuredContent` field equals one of the values is gone.
    pub structured_content: Option<StructuredMatch>,
}

/// A `structuredContent` field compared with a list of values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StructuredMatch {
    /// `.`-separated path into `structuredContent`.
    pub path: String,
    /// Values (strings as written, others as their JSON text) that mean gone.
    pub equals: Vec<String>,
}

/// [`GoneWhen`] with its regular expression compiled.
#[derive(Clone, Debug)]
pub struct GoneRule {
    prefixes: Option<Vec<String>>,
    regex: Option<Regex>,
    structured: Option<(Vec<String>, Vec<String>)>,
}

impl GoneRule {
    /// Compiles the rule.
    ///
    /// # Errors
    /// The regular expression does not compile; the message is the regex crate's.
    pub fn new(spec: &GoneWhen) -> Result<Self, regex::Error> {
        Ok(Self {
            prefixes: spec.error_text_prefixes.clone(),
            regex: spec
                .error_text_regex
                .as_deref()
                .map(Regex::new)
                .transpose()?,
            structured: spec.structured_content.as_ref().map(|m| {
                (
                    m.path.split('.').map(str::to_owned).collect(),
                    m.equals.clone(),
                )
            }),
        })
    }
}

/// Step 4: the verdict from a probe's outcome.
pub fn judge(outcome: &ProbeOutcome, rule: &GoneRule) -> Decision {
    match outcome {
        ProbeOutcome::Failed(reason) => {
            Decision::new(Verdict::Unknown, format!("probe failed: {reason}"))
        }
        ProbeOutcome::Answered {
            is_error: true,
            text,
            ..
        } => {
            let narrowed = rule.prefixes.is_some() || rule.regex.is_some();
            let matched = rule
                .prefixes
                .iter()
                .flatten()
                .any(|p| text.starts_with(p.as_str()))
                || rule.regex.as_ref().is_some_and(|r| r.is_match(text));
            if !narrowed || matched {
                Decision::gone(
                    GoneBy::Probe,
                    format!("probe answered isError: {}", first_line(text)),
                )
            } else {
                Decision::new(
                    Verdict::Unknown,
                    format!(
                        "probe answered an error not recognised as gone: {}",
                        first_line(text)
                    ),
                )
            }
        }
        ProbeOutcome::Answered {
            is_error: false,
            structured,
            ..
        } => {
            if let (Some((path, equals)), Some(structured)) = (&rule.structured, structured) {
                let field = path.iter().try_fold(structured, |v, k| v.get(k));
                if let Some(field) = field {
                    let text = match field {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    if equals.contains(&text) {
                        return Decision::gone(
                            GoneBy::Probe,
                            format!("probe answered {}={text}", path.join(".")),
                        );
                    }
                }
            }
            Decision::new(Verdict::Ok, "probe answered success")
        }
    }
}

/// Error texts can be long and multi-line; a table cell needs the first line, bounded (160
/// characters, then `…`). The one shortening rule of every reason custody prints.
pub fn first_line(text: &str) -> String {
    const MAX: usize = 160;
    let line = text.lines().next().unwrap_or_default();
    match line.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;

    fn record(principal: Option<&str>, minted_secs_ago: Option<i64>, ttl: Option<u64>) -> Holding {
        let now = now();
        Holding::Record(HandleRecord {
            value: "bsk_1".into(),
            principal: principal.map(str::to_owned),
            minted_at: minted_secs_ago.map(|s| now - chrono::Duration::seconds(s)),
            assumed_ttl_seconds: ttl,
            raw: json!({}),
        })
    }

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap()
    }

    fn verdict(p: Precheck) -> Option<Verdict> {
        match p {
            Precheck::Decided(d) => Some(d.verdict),
            Precheck::WithinTtl { age, ttl } => Some(within_ttl(age, ttl).verdict),
            Precheck::Probe => None,
        }
    }

    #[test]
    fn a_sample_probe_decides_unless_it_failed() {
        assert_eq!(
            precheck(&record(None, Some(10), None), None, Some(60), now()),
            Precheck::WithinTtl { age: 10, ttl: 60 }
        );
        let gone = Decision::gone(GoneBy::Probe, "probe answered isError: BASKET_EXPIRED");
        let ok = Decision::new(Verdict::Ok, "probe answered success");
        let failed = Decision::new(Verdict::Unknown, "probe failed: connect failed");
        // (probe's decision, verdict, gone_by, counts as probed, reason)
        let cases = [
            (
                gone.clone(),
                Verdict::Gone,
                Some(GoneBy::Probe),
                true,
                "probe answered isError: BASKET_EXPIRED; sampled within its declared lifetime (10s of 60s)",
            ),
            (
                ok,
                Verdict::Ok,
                None,
                true,
                "probe answered success; sampled within its declared lifetime (10s of 60s)",
            ),
            (
                failed,
                Verdict::Ok,
                None,
                false,
                "within its declared lifetime (10s of 60s); a sample probe did not decide (probe failed: connect failed)",
            ),
        ];
        for (probe, verdict, gone_by, probed, reason) in cases {
            let (d, was_probed) = sampled(probe, 10, 60);
            assert_eq!(
                (d.verdict, d.gone_by, was_probed, d.reason.as_str()),
                (verdict, gone_by, probed, reason)
            );
        }
    }

    /// (case, holding, thread principal, declared ttl, expected verdict or None for "probe").
    type Case = (
        &'static str,
        Holding,
        Option<&'static str>,
        Option<u64>,
        Option<Verdict>,
    );

    #[test]
    fn precheck_table() {
        use Verdict::*;
        let cases: Vec<Case> = vec![
            ("no handle", Holding::Absent, Some("u1"), None, Some(Absent)),
            (
                "not applicable counts as absent",
                Holding::NotApplicable,
                None,
                None,
                Some(Absent),
            ),
            (
                "malformed is unknown, never gone",
                Holding::Malformed("x".into()),
                None,
                None,
                Some(Unknown),
            ),
            (
                "other principal",
                record(Some("u1"), Some(10), None),
                Some("u2"),
                None,
                Some(Gone),
            ),
            (
                "other principal beats a fresh ttl",
                record(Some("u1"), Some(10), Some(3600)),
                Some("u2"),
                Some(3600),
                Some(Gone),
            ),
            (
                "same principal, no ttl → probe",
                record(Some("u1"), Some(10), None),
                Some("u1"),
                None,
                None,
            ),
            (
                "no thread principal → no comparison",
                record(Some("u1"), Some(10), None),
                None,
                None,
                None,
            ),
            (
                "no principal recorded with the handle → no comparison",
                record(None, Some(10), None),
                Some("u2"),
                None,
                None,
            ),
            (
                "record ttl not elapsed",
                record(Some("u1"), Some(10), Some(60)),
                Some("u1"),
                None,
                Some(Ok),
            ),
            (
                "record ttl elapsed → probe",
                record(Some("u1"), Some(100), Some(60)),
                Some("u1"),
                None,
                None,
            ),
            (
                "declared ttl not elapsed",
                record(None, Some(10), None),
                None,
                Some(60),
                Some(Ok),
            ),
            (
                "shorter ttl wins",
                record(None, Some(100), Some(3600)),
                None,
                Some(60),
                None,
            ),
            (
                "no mint time → probe",
                record(None, None, Some(60)),
                None,
                Some(60),
                None,
            ),
            (
                "mint time in the future → probe",
                record(None, Some(-100), Some(60)),
                None,
                None,
                None,
            ),
        ];
        for (name, holding, principal, ttl, want) in cases {
            assert_eq!(
                verdict(precheck(&holding, principal, ttl, now())),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn principal_reason_names_both() {
        let Precheck::Decided(d) = precheck(
            &record(Some("user-1"), None, None),
            Some("user-2"),
            None,
            now(),
        ) else {
            panic!()
        };
        assert_eq!(
            d.reason,
            "minted for principal user-1, thread now runs as user-2"
        );
        assert_eq!(d.gone_by, Some(GoneBy::OtherPrincipal));
    }

    fn answered(is_error: bool, text: &str, structured: Option<Value>) -> ProbeOutcome {
        ProbeOutcome::Answered {
            is_error,
            text: text.into(),
            structured,
        }
    }

    #[test]
    fn judge_table() {
        use Verdict::*;
        let plain = GoneRule::new(&GoneWhen::default()).unwrap();
        let narrowed = GoneRule::new(&GoneWhen {
            error_text_prefixes: Some(vec!["BASKET_EXPIRED".into(), "BASKET_NOT_FOUND".into()]),
            ..GoneWhen::default()
        })
        .unwrap();
        let empty = GoneRule::new(&GoneWhen {
            error_text_prefixes: Some(Vec::new()),
            ..GoneWhen::default()
        })
        .unwrap();
        let regex = GoneRule::new(&GoneWhen {
            error_text_regex: Some("(?i)expired|unknown".into()),
            ..GoneWhen::default()
        })
        .unwrap();
        let structured = GoneRule::new(&GoneWhen {
            structured_content: Some(StructuredMatch {
                path: "state.phase".into(),
                equals: vec!["closed".into(), "false".into()],
            }),
            ..GoneWhen::default()
        })
        .unwrap();
        let cases: Vec<(&str, ProbeOutcome, &GoneRule, Verdict)> = vec![
            (
                "timeout is unknown",
                ProbeOutcome::Failed("timed out after 10s".into()),
                &plain,
                Unknown,
            ),
            (
                "refused is unknown",
                ProbeOutcome::Failed("connection refused".into()),
                &narrowed,
                Unknown,
            ),
            (
                "success is ok",
                answered(false, "{}", Some(json!({"items": []}))),
                &plain,
                Ok,
            ),
            (
                "any isError is gone without narrowing",
                answered(true, "whatever", None),
                &plain,
                Gone,
            ),
            (
                "matching prefix is gone",
                answered(true, "BASKET_EXPIRED: basket x expired", None),
                &narrowed,
                Gone,
            ),
            (
                "other error is unknown when narrowed",
                answered(true, "RATE_LIMITED: slow down", None),
                &narrowed,
                Unknown,
            ),
            (
                "an empty prefix list narrows to nothing: an error is unknown, never gone",
                answered(true, "BASKET_NOT_FOUND: x", None),
                &empty,
                Unknown,
            ),
            (
                "regex match is gone",
                answered(true, "Handle Expired", None),
                &regex,
                Gone,
            ),
            (
                "regex miss is unknown",
                answered(true, "internal error", None),
                &regex,
                Unknown,
            ),
            (
                "structured match is gone",
                answered(false, "", Some(json!({"state": {"phase": "closed"}}))),
                &structured,
                Gone,
            ),
            (
                "structured bool match",
                answered(false, "", Some(json!({"state": {"phase": false}}))),
                &structured,
                Gone,
            ),
            (
                "structured miss is ok",
                answered(false, "", Some(json!({"state": {"phase": "open"}}))),
                &structured,
                Ok,
            ),
            (
                "structured field absent is ok",
                answered(false, "", Some(json!({}))),
                &structured,
                Ok,
            ),
        ];
        for (name, outcome, rule, want) in cases {
            let d = judge(&outcome, rule);
            assert_eq!(d.verdict, want, "{name}");
            assert_eq!(
                d.gone_by,
                (want == Gone).then_some(GoneBy::Probe),
                "a probe's gone says so: {name}"
            );
        }
    }

    #[test]
    fn bad_regex_is_an_error() {
        assert!(
            GoneRule::new(&GoneWhen {
                error_text_regex: Some("(".into()),
                ..GoneWhen::default()
            })
            .is_err()
        );
    }

    #[test]
    fn reasons_are_one_bounded_line() {
        let long = format!("{}\nsecond line", "x".repeat(500));
        let d = judge(
            &answered(true, &long, None),
            &GoneRule::new(&GoneWhen::default()).unwrap(),
        );
        assert!(!d.reason.contains('\n'));
        assert!(d.reason.chars().count() < 200);
    }
}
