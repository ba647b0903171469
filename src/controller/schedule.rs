//! The interval of a CheckpointStore's sweep schedule, for `custody_sweep_schedule_interval_seconds`
//! (the sweep-overdue alert compares the time since the last successful sweep with twice it).
//!
//! A cron schedule need not be regular: `0 9 * * 1-5` runs daily on weekdays and then not for
//! three days. The interval is therefore the longest gap between two consecutive runs among the
//! next [`RUNS`] runs (within [`HORIZON_DAYS`]), so the alert never calls a sweep overdue during
//! a gap the schedule itself leaves. For a regular schedule that is its period.

use chrono::{DateTime, Utc};
use croner::parser::{CronParser, Seconds, Year};

/// Runs looked at: more than a week of a run every minute, so a weekly pattern's longest gap
/// is among them from any start (`*/5 * * * 1-5` runs 1440 times a week; 1000 runs from a
/// Monday would end before the weekend). Looking at them takes a few milliseconds.
pub const RUNS: usize = 20_000;

/// Days ahead looked at, at most: eight years hold two runs of a leap-day schedule.
pub const HORIZON_DAYS: i64 = 8 * 366;

/// The longest gap in seconds between consecutive runs of `schedule` among its next [`RUNS`]
/// runs after `now` within [`HORIZON_DAYS`], in UTC (the CronJob's `timeZone`).
///
/// Takes what a CronJob's `spec.schedule` takes: five fields (minute hour day-of-month month
/// day-of-week; day-of-month and day-of-week both restricted means either, as in Vixie cron),
/// the macros `@yearly`, `@annually`, `@monthly`, `@weekly`, `@daily`, `@midnight`, `@hourly`,
/// and `@every <duration>` with hour, minute and second units (`@every 1h30m`, `@every 90s`).
/// `None` for anything else (the API server refuses such a CronJob; `Scheduled=False` says so)
/// or a schedule with fewer than two runs ahead.
pub fn longest_gap(schedule: &str, now: DateTime<Utc>) -> Option<u64> {
    let schedule = schedule.trim();
    if let Some(every) = schedule.strip_prefix("@every ") {
        return every_seconds(every.trim());
    }
    let cron = cron(schedule)?;
    let horizon = now + chrono::Duration::days(HORIZON_DAYS);
    let mut runs = cron
        .iter_after(now)
        .take(RUNS)
        .take_while(|run| *run <= horizon);
    let mut previous = runs.next()?;
    let mut longest = None;
    for run in runs {
        let gap = u64::try_from((run - previous).num_seconds()).ok()?;
        longest = longest.max(Some(gap));
        previous = run;
    }
    longest
}

/// Years ahead a schedule must have a run within: Kubernetes' cron library (robfig/cron's
/// `Next`) looks five years ahead and, finding nothing, the CronJob controller starts nothing.
pub const FIRES_WITHIN_YEARS: i64 = 5;

/// Whether `schedule` (five fields or a macro, as [`cron`] reads it) has no run within
/// [`FIRES_WITHIN_YEARS`] after `now`, in UTC (the CronJob's `timeZone`): a day that does not
/// exist (`0 0 30 2 *`, `0 0 31 4 *`). `false` for `@every` (it always runs) and for what does
/// not parse (the API server refuses that CronJob; `Scheduled=False CronJobRefused` says so).
/// A schedule that fires finds its next run at once; one that never does costs croner's search
/// up to its last year (5000), under a second even in a debug build.
pub fn never_fires(schedule: &str, now: DateTime<Utc>) -> bool {
    let Some(cron) = cron(schedule) else {
        return false;
    };
    let horizon = now + chrono::Duration::days(FIRES_WITHIN_YEARS * 366);
    cron.iter_after(now).next().is_none_or(|run| run > horizon)
}

/// A CronJob schedule of five fields or a macro other than `@every`, as Kubernetes' cron library
/// reads it; `None` for anything else.
pub fn cron(schedule: &str) -> Option<croner::Cron> {
    let schedule = schedule.trim();
    // croner knows every macro of Kubernetes' cron library but this one.
    let schedule = if schedule.eq_ignore_ascii_case("@midnight") {
        "@daily"
    } else {
        schedule
    };
    CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(schedule)
        .ok()
}

/// Seconds of a Go duration such as `1h30m` or `90s` (what `@every` takes), in whole seconds;
/// `None` for an empty, zero, fractional or otherwise unknown one. Written here because croner
/// does not take `@every` (an extension of Kubernetes' cron library, not a cron field).
fn every_seconds(duration: &str) -> Option<u64> {
    let mut total = 0u64;
    let mut rest = duration;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "h" => 3600,
            "m" => 60,
            "s" => 1,
            _ => return None,
        };
        total = total.checked_add(n.checked_mul(unit)?)?;
        rest = &rest[unit_len..];
    }
    (total > 0).then_some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(t).unwrap().to_utc()
    }

    #[test]
    fn a_regular_schedule_has_its_period() {
        let now = at("2026-12-01T10:07:00Z");
        assert_eq!(longest_gap("*/15 * * * *", now), Some(900));
        assert_eq!(longest_gap("* * * * *", now), Some(60));
        assert_eq!(longest_gap("@hourly", now), Some(3600));
        assert_eq!(longest_gap("@daily", now), Some(86_400));
        assert_eq!(longest_gap("@midnight", now), Some(86_400));
        assert_eq!(longest_gap("  @weekly ", now), Some(7 * 86_400));
        // 40 does not divide 60: the gap over the hour is the shorter one (40 -> 00)
        assert_eq!(longest_gap("*/40 * * * *", now), Some(40 * 60));
    }

    #[test]
    fn an_irregular_schedule_has_its_longest_gap() {
        // weekdays at 09:00: Friday to Monday is three days
        let now = at("2026-12-01T10:07:00Z");
        assert_eq!(longest_gap("0 9 * * 1-5", now), Some(3 * 86_400));
        // twice a day at uneven hours: 20:00 -> 02:00 is 6 h, 02:00 -> 20:00 is 18 h
        assert_eq!(longest_gap("0 2,20 * * *", now), Some(18 * 3600));
        // day-of-month and day-of-week both restricted: either one (the 1st, or any Sunday)
        let gap = longest_gap("0 0 1 * 0", now).unwrap();
        assert!(gap <= 7 * 86_400 && gap > 86_400, "{gap}");
        // monthly: the longest month is 31 days
        assert_eq!(longest_gap("@monthly", now), Some(31 * 86_400));
        // every 5 minutes on weekdays, from a Monday: the weekend is still seen
        let monday = at("2026-11-30T00:00:00Z");
        assert_eq!(
            longest_gap("*/5 * * * 1-5", monday),
            Some(2 * 86_400 + 5 * 60)
        );
        // the 29th of February: four years (2028 to 2032)
        assert_eq!(longest_gap("0 0 29 2 *", now), Some((4 * 365 + 1) * 86_400));
    }

    #[test]
    fn a_day_that_does_not_exist_never_fires() {
        let now = at("2026-12-01T10:07:00Z");
        for never in ["0 0 30 2 *", "0 0 31 4 *", "15 3 31 2,4,6,9,11 *"] {
            assert!(never_fires(never, now), "{never}");
        }
        // The 29th of February is four years away at most; the 31st exists in some months; a
        // restricted day of the week makes the day of the month either.
        for fires in [
            "0 0 29 2 *",
            "0 0 31 * *",
            "0 0 30 2 1",
            "*/15 * * * *",
            "@yearly",
            "@midnight",
            "@every 1h",
            "61 * * * *",
        ] {
            assert!(!never_fires(fires, now), "{fires}");
        }
    }

    #[test]
    fn every_takes_a_go_duration() {
        let now = at("2026-12-01T10:07:00Z");
        assert_eq!(longest_gap("@every 30m", now), Some(1800));
        assert_eq!(longest_gap("@every 1h30m", now), Some(5400));
        assert_eq!(longest_gap("@every 90s", now), Some(90));
        for bad in [
            "@every 0s",
            "@every 1.5h",
            "@every 10",
            "@every m",
            "@every ",
        ] {
            assert_eq!(longest_gap(bad, now), None, "{bad}");
        }
    }

    #[test]
    fn what_a_cron_job_refuses_has_no_interval() {
        let now = at("2026-12-01T10:07:00Z");
        for bad in [
            "",
            "61 * * * *",
            "* * * *",
            "0 0 * * * *",
            "@fortnightly",
            "nonsense",
        ] {
            assert_eq!(longest_gap(bad, now), None, "{bad:?}");
        }
    }
}
