//! The grammar of a CronJob's `spec.schedule` as the Kubernetes API server checks it, so that a
//! CheckpointStore whose schedule the API server would refuse for its sweep CronJob is refused
//! when it is read: in local mode, and by the controller before it applies the CronJob.
//!
//! Kubernetes validates a schedule with robfig/cron v3's `ParseStandard` (five fields, minute
//! hour day-of-month month day-of-week, or a descriptor) and refuses any schedule containing `TZ`
//! (`pkg/apis/batch/validation`: "cannot use TZ or CRON_TZ in schedule"). Written here rather
//! than taken from a crate: `croner` (which `controller::schedule` uses to compute intervals)
//! also accepts `L`, `W`, `#`, a day-of-week 7 and a year field, and has no `@every`; `cron`
//! requires a seconds field; `saffron` takes Quartz's `L`/`W`/`#`. Each would let through a
//! schedule the API server refuses, or refuse one it takes.

/// One of the five fields: its name in messages, its bounds, and its names (`JAN`, `MON`).
struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

/// robfig/cron's bounds (`spec.go`); day-of-week is 0 (Sunday) to 6, so 7 is out of range.
const FIELDS: [Field; 5] = [
    Field {
        name: "minute",
        min: 0,
        max: 59,
        names: &[],
    },
    Field {
        name: "hour",
        min: 0,
        max: 23,
        names: &[],
    },
    Field {
        name: "day-of-month",
        min: 1,
        max: 31,
        names: &[],
    },
    Field {
        name: "month",
        min: 1,
        max: 12,
        names: &[
            "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
        ],
    },
    Field {
        name: "day-of-week",
        min: 0,
        max: 6,
        names: &["sun", "mon", "tue", "wed", "thu", "fri", "sat"],
    },
];

/// The descriptors robfig/cron's standard parser takes besides `@every <duration>`, spelt
/// exactly so (lowercase).
const DESCRIPTORS: [&str; 7] = [
    "@yearly",
    "@annually",
    "@monthly",
    "@weekly",
    "@daily",
    "@midnight",
    "@hourly",
];

/// Checks `schedule` as the API server checks a CronJob's `spec.schedule`.
///
/// Takes five whitespace-separated fields, each a comma-separated list of `*` or `?`, a value, a
/// range `a-b`, any of them with a step `/n` (`a/n` is `a` to the field's maximum); values are
/// numbers or, in the month and day-of-week fields, names (`JAN`, `mon`; any case). Or a
/// descriptor: `@yearly`, `@annually`, `@monthly`, `@weekly`, `@daily`, `@midnight`, `@hourly`,
/// `@every <Go duration>` (`@every 1h30m`).
///
/// # Errors
/// What is wrong, naming the cron field and the bad value: `minute: 61 is out of range: 0 to
/// 59`.
pub fn check(schedule: &str) -> Result<(), String> {
    if schedule.contains("TZ") {
        return Err(
            "a time zone (TZ= or CRON_TZ=) cannot be part of a CronJob schedule (Kubernetes refuses it)"
                .to_owned(),
        );
    }
    if schedule.is_empty() {
        return Err("empty".to_owned());
    }
    if schedule.starts_with('@') {
        if DESCRIPTORS.contains(&schedule) {
            return Ok(());
        }
        return match schedule.strip_prefix("@every ") {
            Some(duration) => go_duration(duration)
                .map_err(|why| format!("@every: {duration:?} is not a duration: {why}")),
            None => Err(format!(
                "{schedule} is not a descriptor Kubernetes knows ({}, @every <duration>)",
                DESCRIPTORS.join(", ")
            )),
        };
    }
    let fields: Vec<&str> = schedule.split_whitespace().collect();
    if fields.len() != FIELDS.len() {
        return Err(format!(
            "expected 5 fields (minute hour day-of-month month day-of-week), found {}",
            fields.len()
        ));
    }
    for (text, field) in fields.iter().zip(&FIELDS) {
        // robfig/cron splits on ',' and skips empty items (`1,,2`), as Go's FieldsFunc does.
        for range in text.split(',').filter(|r| !r.is_empty()) {
            check_range(range, field).map_err(|why| format!("{}: {why}", field.name))?;
        }
    }
    Ok(())
}

/// One item of a field's list: robfig/cron's `getRange`, rule for rule.
fn check_range(range: &str, field: &Field) -> Result<(), String> {
    let mut range_and_step = range.split('/');
    let low_high = range_and_step.next().unwrap_or_default();
    let step = range_and_step.next();
    if range_and_step.next().is_some() {
        return Err(format!("{range:?} has more than one '/'"));
    }
    let mut bounds = low_high.split('-');
    let low = bounds.next().unwrap_or_default();
    let high = bounds.next();
    let (start, mut end) = if low == "*" || low == "?" {
        // robfig/cron reads `*-5` as `*`: what follows the star is not looked at.
        (field.min, field.max)
    } else {
        if bounds.next().is_some() {
            return Err(format!("{range:?} has more than one '-'"));
        }
        if low.is_empty() {
            return Err(format!(
                "{range:?} does not start with a number (a negative one is never in range)"
            ));
        }
        let start = value(low, field)?;
        (start, high.map_or(Ok(start), |high| value(high, field))?)
    };
    if let Some(step) = step {
        if number(step)? == 0 {
            return Err(format!(
                "{range:?} has a step of 0; a step must be positive"
            ));
        }
        if high.is_none() {
            end = field.max;
        }
    }
    for v in [start, end] {
        if !(field.min..=field.max).contains(&v) {
            return Err(super::validate::out_of_range(
                v,
                Some(field.min.into()),
                Some(field.max.into()),
            ));
        }
    }
    if start > end {
        return Err(format!(
            "{range:?} is a range whose beginning ({start}) is beyond its end ({end})"
        ));
    }
    Ok(())
}

/// A number, or a name of the field (any case) as its number.
fn value(text: &str, field: &Field) -> Result<u32, String> {
    let lower = text.to_ascii_lowercase();
    match field.names.iter().position(|n| *n == lower) {
        // Months are named from 1, days of the week from 0 (Sunday).
        Some(i) => Ok(field.min + u32::try_from(i).expect("at most 12 names")),
        None => number(text).map_err(|why| {
            if field.names.is_empty() {
                why
            } else {
                format!(
                    "{why} nor a name ({} to {})",
                    field.names[0].to_uppercase(),
                    field.names[field.names.len() - 1].to_uppercase()
                )
            }
        }),
    }
}

/// A non-negative number as Go's `strconv.Atoi` reads it (an optional sign, decimal digits),
/// saturated at `u32::MAX`, which is out of every field's range anyway.
fn number(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{text:?} is not a number"));
    }
    if text.starts_with('-') && digits.bytes().any(|b| b != b'0') {
        return Err(format!("{text} is negative"));
    }
    Ok(digits.parse().unwrap_or(u32::MAX))
}

/// A duration as Go's `time.ParseDuration` reads it: an optional sign, then one or more
/// decimal numbers (a fraction allowed) each with a unit of `ns`, `us` (`µs`, `μs`), `ms`, `s`,
/// `m`, `h` (`1h30m`, `1.5h`); `0` alone needs no unit. At most 2^63-1 ns (about 292 years).
fn go_duration(text: &str) -> Result<(), String> {
    const UNITS: [(&str, u128); 8] = [
        ("ns", 1),
        ("us", 1_000),
        ("\u{b5}s", 1_000),
        ("\u{3bc}s", 1_000),
        ("ms", 1_000_000),
        ("s", 1_000_000_000),
        ("m", 60_000_000_000),
        ("h", 3_600_000_000_000),
    ];
    let mut rest = text.strip_prefix(['+', '-']).unwrap_or(text);
    if rest == "0" {
        return Ok(());
    }
    if rest.is_empty() {
        return Err("empty".to_owned());
    }
    let mut total_ns: u128 = 0;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(number_len);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(format!("{number:?} is not a number"));
        }
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        if unit.is_empty() {
            return Err(format!("{number} has no unit (ns, us, ms, s, m, h)"));
        }
        let Some(&(_, unit_ns)) = UNITS.iter().find(|(u, _)| *u == unit) else {
            return Err(format!("unknown unit {unit:?} (ns, us, ms, s, m, h)"));
        };
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().unwrap_or(u128::MAX)
        };
        // Go adds a fraction's nanoseconds truncated; only the bound below depends on them.
        let fraction_ns = if fraction.is_empty() {
            0
        } else {
            let digits = fraction.len().min(30);
            let scale = 10u128.pow(u32::try_from(digits).expect("at most 30"));
            fraction[..digits].parse::<u128>().unwrap_or(0) * unit_ns / scale
        };
        total_ns = whole
            .saturating_mul(unit_ns)
            .saturating_add(fraction_ns)
            .saturating_add(total_ns);
        rest = after;
    }
    if total_ns > i64::MAX as u128 {
        return Err("longer than Go's longest duration (about 292 years)".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check;

    /// What the API server takes for a CronJob (robfig/cron v3 `ParseStandard`'s grammar).
    #[test]
    fn what_kubernetes_takes_is_taken() {
        for good in [
            "*/15 * * * *",
            "0 0 * * *",
            "0 9 * * 1-5",
            "0 9 * * MON-FRI",
            "0 0 1 jan,Jul *",
            "5/10 * * * *",
            "0-30/5 0,12 1-31 1-12 0-6",
            "? * ? * ?",
            "*-5 * * * *",
            "1,,2 * * * *",
            "+5 * * * *",
            "0 0 29 2 *",
            "@yearly",
            "@annually",
            "@monthly",
            "@weekly",
            "@daily",
            "@midnight",
            "@hourly",
            "@every 30m",
            "@every 1h30m",
            "@every 1.5h",
            "@every 90s",
            "@every 0",
            "@every 500ms",
        ] {
            assert_eq!(check(good), Ok(()), "{good}");
        }
    }

    /// What it refuses, each said naming the cron field and the bad value.
    #[test]
    fn what_kubernetes_refuses_is_named() {
        for (bad, says) in [
            ("61 * * * *", "minute: 61 is out of range: 0 to 59"),
            ("0 24 * * *", "hour: 24 is out of range: 0 to 23"),
            ("0 0 0 * *", "day-of-month: 0 is out of range: 1 to 31"),
            ("0 0 32 * *", "day-of-month: 32 is out of range: 1 to 31"),
            ("0 0 * 13 *", "month: 13 is out of range: 1 to 12"),
            ("0 0 * * 7", "day-of-week: 7 is out of range: 0 to 6"),
            ("0 0 * * 1-7", "day-of-week: 7 is out of range: 0 to 6"),
            (
                "*/0 * * * *",
                "minute: \"*/0\" has a step of 0; a step must be positive",
            ),
            (
                "0 5-3 * * *",
                "hour: \"5-3\" is a range whose beginning (5) is beyond its end (3)",
            ),
            ("1-2-3 * * * *", "minute: \"1-2-3\" has more than one '-'"),
            ("1/2/3 * * * *", "minute: \"1/2/3\" has more than one '/'"),
            ("-1 * * * *", "minute: \"-1\" does not start with a number"),
            ("*/-5 * * * *", "minute: -5 is negative"),
            (
                "0 0 * * FUN",
                "day-of-week: \"FUN\" is not a number nor a name (SUN to SAT)",
            ),
            ("0 0 L * *", "day-of-month: \"L\" is not a number"),
            (
                "0 0 * * 1#2",
                "day-of-week: \"1#2\" is not a number nor a name (SUN to SAT)",
            ),
            (
                "0 0 * * * *",
                "expected 5 fields (minute hour day-of-month month day-of-week), found 6",
            ),
            (
                "@fortnightly",
                "@fortnightly is not a descriptor Kubernetes knows",
            ),
            ("@HOURLY", "@HOURLY is not a descriptor Kubernetes knows"),
            (
                "@every 10",
                "@every: \"10\" is not a duration: 10 has no unit (ns, us, ms, s, m, h)",
            ),
            (
                "@every 1d",
                "@every: \"1d\" is not a duration: unknown unit \"d\" (ns, us, ms, s, m, h)",
            ),
            (
                "@every .h",
                "@every: \".h\" is not a duration: \".\" is not a number",
            ),
            (
                "@every 3000000h",
                "@every: \"3000000h\" is not a duration: longer than Go's longest duration",
            ),
            (
                "CRON_TZ=UTC 0 * * * *",
                "a time zone (TZ= or CRON_TZ=) cannot be part of a CronJob schedule",
            ),
            ("TZ=UTC * * * *", "a time zone (TZ= or CRON_TZ=)"),
        ] {
            let e = check(bad).unwrap_err();
            assert!(e.starts_with(says), "{bad}: {e}");
        }
    }
}
