//! The recovery rules of a re-mint, as a pure transition function: where each step's result
//! leads. The ledger executor (`sweep::act`) does the I/O and asks here what comes next; the
//! rules are the contract of crash safety (a `kill -9` anywhere neither loses the thread nor
//! mints twice):
//!
//! - killed before the mint was recorded: the mint is repeated with the same idempotency key,
//!   which returns the same handle; a class without `idempotencyKeyArgument` is escalated
//!   instead, since a second mint would be a second handle;
//! - the mint could not be sent (no session): nothing reached the server, so the intent is
//!   forgotten and the next sweep starts cleanly;
//! - the mint call failed after it may have reached the server: with an idempotency key the next
//!   sweep repeats it safely; without one it is escalated;
//! - the mint answered an error or no handle: escalated;
//! - killed between a replay call and its record: that call's effect is unknown, so the thread
//!   is escalated rather than the item replayed twice;
//! - a replay call that could not be sent (no session to the server, the connection refused):
//!   nothing reached the server, so the entry stays minted, its progress as recorded, and the
//!   next sweep replays from there ([`after_replay_failure`]), until the new handle may have
//!   expired: once the entry is older than the class's declared TTL (or
//!   [`REPLAY_RETRY_WITHOUT_TTL`] without one), the thread is escalated instead (a replay onto
//!   an expired handle would fail anyway, and the run would retry forever); one that failed
//!   after it may have reached the server (a timeout, a dropped stream, an HTTP error) is
//!   escalated;
//! - an escalation with nowhere to write it (no `verdictPath`): the entry is abandoned
//!   ([`escalate_instead`]).
//!
//! (Killed around the append needs no rule: the ledger and the checkpoint commit together.)

use super::verdict::first_line;

/// Where a step of a re-mint leads when it does not go on to the next step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Stop now with this error; the entry stays as it is and the next sweep drives it again.
    RetryNextRun(String),
    /// Stop with this error and delete the intent: nothing was sent.
    ForgetIntent(String),
    /// Write verdict `escalated` instead of finishing the re-mint, with this reason.
    EscalateInstead(String),
}

/// The mint tool, as the rules see it.
#[derive(Clone, Copy, Debug)]
pub struct MintTool<'a> {
    /// Tool name.
    pub tool: &'a str,
    /// `structuredContent` field of the new handle.
    pub handle_field: &'a str,
    /// Whether the class names an `idempotencyKeyArgument`.
    pub idempotent: bool,
}

/// Before minting. `mint` is the class's mint tool with what it is called with (`None` when
/// the class no longer has one, or the stored plan has no arguments); `resumed`: the entry was
/// found unfinished (a crash or an earlier error). The tool and its arguments when the mint may
/// go ahead.
///
/// # Errors
/// The [`Next`] step instead of minting.
pub fn before_mint<'a, T>(
    mint: Option<(MintTool<'a>, T)>,
    resumed: bool,
) -> Result<(MintTool<'a>, T), Next> {
    let Some((tool, arguments)) = mint else {
        return Err(Next::EscalateInstead(
            "the handle class no longer has a mint tool".into(),
        ));
    };
    if resumed && !tool.idempotent {
        return Err(Next::EscalateInstead(format!(
            "an earlier mint may have created a handle; {} has no idempotency key, so custody does not mint again",
            tool.tool
        )));
    }
    Ok((tool, arguments))
}

/// How a mint call went.
#[derive(Clone, Copy, Debug)]
pub enum MintCall<'a> {
    /// No session to the server: the call was not sent.
    NotSent(&'a str),
    /// The call was sent and failed without an answer (timeout, transport error).
    Failed(&'a str),
    /// The server answered `isError`, with this text.
    AnsweredError(&'a str),
    /// The server answered; the value at `structuredContent.<handleField>`, when a string.
    Answered(Option<&'a str>),
}

/// After the mint call: the new handle, or where the re-mint goes instead.
///
/// # Errors
/// The [`Next`] step when the mint did not produce a handle.
pub fn after_mint(mint: MintTool<'_>, call: MintCall<'_>) -> Result<String, Next> {
    match call {
        MintCall::NotSent(e) => Err(Next::ForgetIntent(format!("mint not attempted: {e}"))),
        MintCall::Answered(Some(h)) if !h.is_empty() => Ok(h.to_owned()),
        MintCall::Answered(_) => Err(Next::EscalateInstead(format!(
            "{} answered without a string structuredContent.{}",
            mint.tool, mint.handle_field
        ))),
        MintCall::AnsweredError(text) => Err(Next::EscalateInstead(format!(
            "{} answered isError: {}",
            mint.tool,
            first_line(text)
        ))),
        // The call may have reached the server. With an idempotency key the next sweep repeats
        // it safely; without one, a repeat could mint a second handle.
        MintCall::Failed(e) if mint.idempotent => Err(Next::RetryNextRun(format!(
            "mint failed, retried next sweep: {e}"
        ))),
        MintCall::Failed(e) => Err(Next::EscalateInstead(format!(
            "{} failed and may have minted a handle: {e}",
            mint.tool
        ))),
    }
}

/// Before replaying: `started` and `done` are the ledger's counters of replay calls begun and
/// finished, `total` the calls to make.
///
/// # Errors
/// [`Next::EscalateInstead`] when a replay call may have been sent without its record.
pub fn before_replay(started: u32, done: u32, total: usize, handle: &str) -> Result<(), Next> {
    if started > done {
        return Err(Next::EscalateInstead(format!(
            "replay call {started} of {total} was interrupted; its effect on {handle} is unknown"
        )));
    }
    Ok(())
}

/// How a replay call failed.
#[derive(Clone, Copy, Debug)]
pub enum ReplayFailure<'a> {
    /// Not sent: no session to the server, or the connection was refused.
    NotSent(&'a str),
    /// Sent, or perhaps sent, and failed without a usable answer (or answered `isError`).
    Failed(&'a str),
}

/// How long a replay that could not be sent is retried when the class declares no TTL: one
/// day from the entry's creation (just before the mint). A guess, so that an unreachable server
/// does not keep a thread waiting without bound; a class with `declaredTtlSeconds` uses that.
pub const REPLAY_RETRY_WITHOUT_TTL: u64 = 86_400;

/// How long a replay may still be retried: the entry's age and the handle's declared TTL.
#[derive(Clone, Copy, Debug)]
pub struct ReplayBudget {
    /// Seconds since the entry was created (the sweep's clock minus its `created_at`): the
    /// first mint attempt followed within that sweep, and a repeated mint with the same
    /// idempotency key returns the handle that attempt may have made, so this is the oldest the
    /// handle can be.
    pub age_seconds: i64,
    /// The class's `declaredTtlSeconds`.
    pub declared_ttl: Option<u64>,
}

/// After a replay call that did not succeed: where the re-mint goes.
pub fn after_replay_failure(failure: ReplayFailure<'_>, budget: ReplayBudget) -> Next {
    match failure {
        ReplayFailure::NotSent(e) => {
            let (limit, source) = match budget.declared_ttl {
                Some(ttl) => (ttl, "the handle's declared TTL"),
                None => (
                    REPLAY_RETRY_WITHOUT_TTL,
                    "custody's limit without a declared TTL",
                ),
            };
            if budget.age_seconds >= i64::try_from(limit).unwrap_or(i64::MAX) {
                Next::EscalateInstead(format!(
                    "replay not sent for {}s since the mint, past {limit}s ({source}): the new \
                     handle may have expired; last attempt: {e}",
                    budget.age_seconds
                ))
            } else {
                Next::RetryNextRun(format!("replay not sent, retried next sweep: {e}"))
            }
        }
        ReplayFailure::Failed(e) => Next::EscalateInstead(e.to_owned()),
    }
}

/// An escalation instead of a re-mint, given whether the class has a `verdictPath`: the reason
/// to write.
///
/// # Errors
/// The reason to abandon the entry instead, when there is nowhere to write the verdict.
pub fn escalate_instead(why: String, has_verdict_path: bool) -> Result<String, String> {
    if has_verdict_path {
        Ok(why)
    } else {
        Err(format!(
            "re-mint abandoned ({why}); no verdictPath to escalate to"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEYED: MintTool<'static> = MintTool {
        tool: "create_basket",
        handle_field: "basket_id",
        idempotent: true,
    };
    const UNKEYED: MintTool<'static> = MintTool {
        idempotent: false,
        ..KEYED
    };

    fn kind<T>(r: &Result<T, Next>) -> &'static str {
        match r {
            Ok(_) => "continue",
            Err(Next::RetryNextRun(_)) => "retry",
            Err(Next::ForgetIntent(_)) => "forget",
            Err(Next::EscalateInstead(_)) => "escalate",
        }
    }

    fn replay(
        failure: ReplayFailure<'_>,
        age_seconds: i64,
        declared_ttl: Option<u64>,
    ) -> &'static str {
        let budget = ReplayBudget {
            age_seconds,
            declared_ttl,
        };
        kind::<()>(&Err(after_replay_failure(failure, budget)))
    }

    #[test]
    fn the_recovery_table() {
        let start = |tool: Option<MintTool<'static>>, resumed| {
            kind(&before_mint(tool.map(|t| (t, ())), resumed))
        };
        let cases = [
            ("first mint", start(Some(UNKEYED), false), "continue"),
            (
                "killed before the mint was recorded, keyed: mint again",
                start(Some(KEYED), true),
                "continue",
            ),
            (
                "killed before the mint was recorded, no key: escalate",
                start(Some(UNKEYED), true),
                "escalate",
            ),
            (
                "the class lost its mint tool",
                start(None, false),
                "escalate",
            ),
            (
                "killed between a replay call and its record",
                kind(&before_replay(3, 2, 4, "bsk_2")),
                "escalate",
            ),
            (
                "replay from where it stopped",
                kind(&before_replay(2, 2, 4, "bsk_2")),
                "continue",
            ),
            (
                "a replay not sent (no session, refused) within the TTL: retry next run",
                replay(ReplayFailure::NotSent("refused"), 599, Some(600)),
                "retry",
            ),
            (
                "a replay not sent at the TTL's age: the handle may have expired, escalate",
                replay(ReplayFailure::NotSent("refused"), 600, Some(600)),
                "escalate",
            ),
            (
                "a replay not sent, no declared TTL, within a day: retry next run",
                replay(
                    ReplayFailure::NotSent("refused"),
                    REPLAY_RETRY_WITHOUT_TTL as i64 - 1,
                    None,
                ),
                "retry",
            ),
            (
                "a replay not sent, no declared TTL, for a day: escalate",
                replay(
                    ReplayFailure::NotSent("refused"),
                    REPLAY_RETRY_WITHOUT_TTL as i64,
                    None,
                ),
                "escalate",
            ),
            (
                "a replay call that may have reached the server: escalate",
                replay(ReplayFailure::Failed("timed out"), 0, Some(600)),
                "escalate",
            ),
        ];
        for (name, got, want) in cases {
            assert_eq!(got, want, "{name}");
        }
        let budget = ReplayBudget {
            age_seconds: 700,
            declared_ttl: Some(600),
        };
        assert_eq!(
            after_replay_failure(ReplayFailure::NotSent("connection refused"), budget),
            Next::EscalateInstead(
                "replay not sent for 700s since the mint, past 600s (the handle's declared TTL): \
                 the new handle may have expired; last attempt: connection refused"
                    .into()
            )
        );
        let mint = |tool, call| {
            let r = after_mint(tool, call);
            r.clone().map_err(|_| kind(&r))
        };
        type Minted = Result<String, &'static str>;
        let calls: [(&str, Minted, Minted); 6] = [
            (
                "no session: forget the intent",
                mint(KEYED, MintCall::NotSent("refused")),
                Err("forget"),
            ),
            (
                "sent, failed, keyed: retry next run",
                mint(KEYED, MintCall::Failed("timeout")),
                Err("retry"),
            ),
            (
                "sent, failed, no key: escalate",
                mint(UNKEYED, MintCall::Failed("timeout")),
                Err("escalate"),
            ),
            (
                "answered isError",
                mint(KEYED, MintCall::AnsweredError("QUOTA\nmore")),
                Err("escalate"),
            ),
            (
                "answered without a handle",
                mint(KEYED, MintCall::Answered(None)),
                Err("escalate"),
            ),
            (
                "answered a handle",
                mint(KEYED, MintCall::Answered(Some("bsk_2"))),
                Ok("bsk_2".into()),
            ),
        ];
        for (name, got, want) in calls {
            assert_eq!(got, want, "{name}");
        }
        assert_eq!(
            mint(KEYED, MintCall::Answered(Some(""))),
            Err("escalate"),
            "an empty handle is no handle"
        );
        assert_eq!(escalate_instead("x".into(), true), Ok("x".into()));
        assert!(
            escalate_instead("x".into(), false).is_err(),
            "nowhere to escalate: abandon"
        );
    }

    #[test]
    fn reasons_name_the_cause() {
        assert_eq!(
            before_replay(3, 2, 4, "bsk_2"),
            Err(Next::EscalateInstead(
                "replay call 3 of 4 was interrupted; its effect on bsk_2 is unknown".into()
            ))
        );
        assert_eq!(
            after_mint(KEYED, MintCall::AnsweredError("QUOTA\nmore")),
            Err(Next::EscalateInstead(
                "create_basket answered isError: QUOTA".into()
            ))
        );
        assert_eq!(
            escalate_instead("why".into(), false),
            Err("re-mint abandoned (why); no verdictPath to escalate to".into())
        );
    }
}
