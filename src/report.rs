//! Rendering sweep reports for people (a table) and machines (JSON).

use std::io::Write;

use serde::Serialize;

use crate::sweep::Report;

/// Output format of CLI commands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns and a summary line.
    #[default]
    Table,
    /// One JSON document.
    Json,
}

/// Writes the reports of one `custody sweep` run.
///
/// # Errors
/// Only I/O errors of `out`.
pub fn write_sweep(out: &mut dyn Write, reports: &[Report], format: Format) -> std::io::Result<()> {
    match format {
        Format::Json => {
            #[derive(Serialize)]
            struct Doc<'a> {
                stores: &'a [Report],
            }
            serde_json::to_writer_pretty(&mut *out, &Doc { stores: reports })?;
            writeln!(out)
        }
        Format::Table => {
            for report in reports {
                write_table(out, report)?;
            }
            Ok(())
        }
    }
}

fn write_table(out: &mut dyn Write, r: &Report) -> std::io::Result<()> {
    writeln!(out, "store {}", r.store)?;
    let mut tw = tabwriter::TabWriter::new(&mut *out).padding(2);
    writeln!(
        tw,
        "THREAD\tNS\tCLASS\tHANDLE\tAGE\tPRINCIPAL\tVERDICT\tREASON"
    )?;
    for row in &r.rows {
        writeln!(
            tw,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            row.thread_id,
            if row.checkpoint_ns.is_empty() {
                "-"
            } else {
                &row.checkpoint_ns
            },
            row.handle_class,
            row.handle.as_deref().unwrap_or("-"),
            row.age_seconds.map_or_else(|| "-".to_owned(), age),
            row.principal.as_deref().unwrap_or("-"),
            row.verdict.as_str(),
            row.reason,
        )?;
    }
    tw.flush()?;
    drop(tw);
    for s in &r.skipped {
        writeln!(
            out,
            "skipped thread {} (checkpoint {}): {}",
            s.thread_id, s.checkpoint_id, s.reason
        )?;
    }
    let s = &r.summary;
    writeln!(
        out,
        "{} parked threads, {} handles: {} ok, {} gone, {} absent, {} unknown; {} probes; {} skipped, {} parked too recently; {} ms",
        s.parked_threads,
        r.rows.len(),
        s.ok,
        s.gone,
        s.absent,
        s.unknown,
        s.probes,
        s.skipped_threads,
        r.too_recent,
        s.duration_ms
    )?;
    writeln!(out)
}

/// `42s`, `7m`, `3h`, `2d`: the largest whole unit, as kubectl prints ages.
fn age(seconds: i64) -> String {
    match seconds {
        s if s < 0 => "0s".into(),
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ages() {
        assert_eq!(super::age(5), "5s");
        assert_eq!(super::age(600), "10m");
        assert_eq!(super::age(4 * 3600), "4h");
        assert_eq!(super::age(3 * 86_400), "3d");
    }
}
