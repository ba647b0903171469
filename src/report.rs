//! Rendering sweep reports for people (a table) and machines (JSON).

use std::io::Write;

use serde::Serialize;

use crate::mcp::discovery::{Catalog, DiscoveryError, Health, Schedule};
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
///
/// `errors` are the stores that could not be swept (their message names the store); in JSON
/// they are listed under `errors` so a machine reading stdout sees them too.
pub fn write_sweep(
    out: &mut dyn Write,
    reports: &[Report],
    errors: &[String],
    format: Format,
) -> std::io::Result<()> {
    match format {
        Format::Json => {
            #[derive(Serialize)]
            struct Doc<'a> {
                stores: &'a [Report],
                errors: &'a [String],
            }
            serde_json::to_writer_pretty(
                &mut *out,
                &Doc {
                    stores: reports,
                    errors,
                },
            )?;
            writeln!(out)
        }
        Format::Table => {
            for report in reports {
                write_table(out, report)?;
            }
            for e in errors {
                writeln!(out, "not swept: {e}")?;
            }
            Ok(())
        }
    }
}

fn write_table(out: &mut dyn Write, r: &Report) -> std::io::Result<()> {
    writeln!(out, "store {}", r.store)?;
    for w in &r.warnings {
        writeln!(out, "warning: {w}")?;
    }
    let mut tw = tabwriter::TabWriter::new(&mut *out).padding(2);
    writeln!(
        tw,
        "THREAD\tNS\tCLASS\tHANDLE\tAGE\tPRINCIPAL\tVERDICT\tACTION\tREASON"
    )?;
    for row in &r.rows {
        writeln!(
            tw,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
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
            row.action
                .as_ref()
                .map_or_else(|| "-".to_owned(), ToString::to_string),
            row.reason,
        )?;
    }
    tw.flush()?;
    drop(tw);
    for s in &r.settled {
        writeln!(
            out,
            "settled an interrupted action on thread {} ({}): {}",
            s.thread_id, s.handle_class, s.action
        )?;
    }
    if let Some(audit) = &r.audit {
        write_audit(out, audit)?;
    }
    for s in &r.skipped {
        writeln!(out, "skipped {s}")?;
    }
    let s = &r.summary;
    writeln!(
        out,
        "{} parked threads, {} handles: {} ok, {} gone, {} absent, {} unknown; {} probes{}; {} skipped{}, {} parked too recently; {} ms",
        s.parked_threads,
        r.rows.len(),
        s.ok,
        s.gone,
        s.absent,
        s.unknown,
        s.probes,
        by_reason(&s.probe_errors, "failed"),
        s.skipped_threads,
        by_reason(&s.skipped_by_reason, ""),
        r.too_recent,
        s.duration_ms
    )?;
    writeln!(out)
}

/// ` (2 failed: 1 protocol, 1 timeout)`, or nothing when there are no counts.
fn by_reason(counts: &std::collections::BTreeMap<String, u64>, what: &str) -> String {
    if counts.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    if what.is_empty() {
        format!(" ({})", parts.join(", "))
    } else {
        let total: u64 = counts.values().sum();
        format!(" ({total} {what}: {})", parts.join(", "))
    }
}

/// One line per audit record the sweep handled, then the counts by outcome.
fn write_audit(out: &mut dyn Write, a: &crate::audit::AuditReport) -> std::io::Result<()> {
    for e in &a.records {
        let outcome = match &e.server_id {
            Some(id) => format!("{} {id}", e.outcome.as_str()),
            None => e.outcome.as_str().to_owned(),
        };
        writeln!(
            out,
            "audit record {} (thread {}, tool call {}, {} on {}): {outcome}: {}",
            e.id, e.thread_id, e.tool_call_id, e.tool, e.server, e.detail
        )?;
    }
    let counts = a.counts();
    let n = |k: &str| counts.get(k).copied().unwrap_or(0);
    writeln!(
        out,
        "audit: {} committed, {} not_committed, {} unknown; {} left pending (lookup failed), {} completed meanwhile; {} lookups",
        n("committed"),
        n("not_committed"),
        n("unknown"),
        n("error"),
        n("skipped"),
        a.lookups
    )
}

/// One server's discovery outcome, as `custody discover` prints it.
pub struct Discovered<'a> {
    /// MCPServer name.
    pub name: &'a str,
    /// Endpoint.
    pub url: &'a str,
    /// The catalog, or why there is none.
    pub catalog: &'a Result<Catalog, DiscoveryError>,
    /// The health check.
    pub health: &'a Health,
    /// Re-discovery bounds.
    pub schedule: Schedule,
}

/// Writes `custody discover` output.
///
/// # Errors
/// Only I/O errors of `out`.
pub fn write_discovery(
    out: &mut dyn Write,
    servers: &[Discovered<'_>],
    format: Format,
) -> std::io::Result<()> {
    if format == Format::Json {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Server<'a> {
            name: &'a str,
            url: &'a str,
            catalog: Option<&'a Catalog>,
            error: Option<String>,
            health: &'a Health,
            next_discovery_seconds: u64,
        }
        #[derive(Serialize)]
        struct Doc<'a> {
            servers: Vec<Server<'a>>,
        }
        let doc = Doc {
            servers: servers
                .iter()
                .map(|d| Server {
                    name: d.name,
                    url: d.url,
                    catalog: d.catalog.as_ref().ok(),
                    error: d.catalog.as_ref().err().map(ToString::to_string),
                    health: d.health,
                    next_discovery_seconds: d
                        .schedule
                        .next(d.catalog.as_ref().ok().and_then(|c| c.ttl_ms))
                        .as_secs(),
                })
                .collect(),
        };
        serde_json::to_writer_pretty(&mut *out, &doc)?;
        return writeln!(out);
    }
    for d in servers {
        let health = if d.health.healthy {
            "healthy"
        } else {
            "unhealthy"
        };
        match d.catalog {
            Err(e) => {
                writeln!(out, "server {} ({})", d.name, d.url)?;
                writeln!(out, "  discovery failed: {e}")?;
            }
            Ok(c) => {
                writeln!(out, "server {} ({})", c.server, d.url)?;
                writeln!(
                    out,
                    "  protocol {}  serverInfo {} {}  {} tools in {} page(s)  digest {}  {} ms",
                    c.protocol_version.as_deref().unwrap_or("?"),
                    c.server_name.as_deref().unwrap_or("?"),
                    c.server_version.as_deref().unwrap_or("?"),
                    c.tools.len(),
                    c.pages,
                    c.digest,
                    c.latency_ms
                )?;
                let hints = match (c.ttl_ms, c.cache_scope) {
                    (None, None) => "none (handshake era)".to_owned(),
                    (ttl, scope) => format!(
                        "ttlMs {} cacheScope {}",
                        ttl.map_or("-".into(), |t| t.to_string()),
                        scope.map_or(
                            "-",
                            |s| if s == crate::mcp::discovery::CacheScope::Private {
                                "private"
                            } else {
                                "public"
                            }
                        )
                    ),
                };
                writeln!(
                    out,
                    "  cache hints {hints}; next discovery in {}s",
                    d.schedule.next(c.ttl_ms).as_secs()
                )?;
                let mut tw = tabwriter::TabWriter::new(&mut *out).padding(2);
                writeln!(
                    tw,
                    "  EXPOSED NAME\tTITLE\tREAD-ONLY\tDESTRUCTIVE\tIDEMPOTENT\tOPEN-WORLD\tINPUT\tOUTPUT"
                )?;
                for t in &c.tools {
                    let a = t.annotations;
                    writeln!(
                        tw,
                        "  {}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                        t.exposed_name,
                        t.title.as_deref().unwrap_or("-"),
                        a.read_only_hint,
                        a.destructive_hint,
                        a.idempotent_hint,
                        a.open_world_hint,
                        t.input_schema_digest,
                        t.output_schema_digest.as_deref().unwrap_or("-"),
                    )?;
                }
                tw.flush()?;
            }
        }
        writeln!(
            out,
            "  health: {health} ({}, {} ms)",
            d.health.reason, d.health.latency_ms
        )?;
        writeln!(out)?;
    }
    Ok(())
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
    fn counts_by_reason() {
        let counts = [("protocol".to_owned(), 1), ("timeout".to_owned(), 2)].into();
        assert_eq!(
            super::by_reason(&counts, "failed"),
            " (3 failed: 1 protocol, 2 timeout)"
        );
        assert_eq!(super::by_reason(&counts, ""), " (1 protocol, 2 timeout)");
        assert_eq!(super::by_reason(&Default::default(), "failed"), "");
    }

    #[test]
    fn ages() {
        assert_eq!(super::age(5), "5s");
        assert_eq!(super::age(600), "10m");
        assert_eq!(super::age(4 * 3600), "4h");
        assert_eq!(super::age(3 * 86_400), "3d");
    }
}
