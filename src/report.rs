//! Rendering sweep reports for people (a table) and machines (JSON).

use std::io::Write;

use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};

use crate::checkpoint::SkippedThread;
use crate::mcp::discovery::{Catalog, DiscoveryError, Health, Schedule};
use crate::sweep::{Report, Row, RowSink};

/// Output format of CLI commands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Aligned columns and a summary line.
    #[default]
    Table,
    /// One JSON document.
    Json,
}

/// Writes the reports of one `custody sweep` run as the sweeps go, holding no rows: a
/// [`RowSink`] that writes each batch of rows (and each skipped thread) when the sweep hands it
/// over. Call [`SweepWriter::end_store`] after each store's sweep and [`SweepWriter::finish`] once
/// at the end.
///
/// JSON is the document `{"stores": [<Report>…], "errors": [<message>…]}`, written
/// incrementally through serde_json's pretty formatter (indented by two spaces, each row and
/// skipped thread on one line): a store's object is opened at its first row, its `rows` array
/// streamed, and the rest of the [`Report`] fields written when it ends. Skipped threads cannot be written while
/// the `rows` array is open, so they wait in an unnamed temporary file (deleted when closed)
/// until then, however many a broken store has. A store whose sweep failed after rows were
/// written gets `"error": <message>` in place of its summary fields (and is listed under
/// `errors` as well); one that failed before any row is only listed under `errors`.
///
/// The table is `store <name>`, the rows under one header (columns aligned within a batch),
/// `skipped …` lines as the scan meets them, then the settled actions, audit records, warnings
/// and the summary line. A store that could not be swept is not in the table: the caller prints
/// its error once, on stderr (JSON lists it under `errors` as well, for programs reading stdout).
pub struct SweepWriter<W: Write + Send> {
    out: W,
    format: Format,
    /// JSON: the document's formatter, whose depth carries from one call to the next.
    json: PrettyFormatter<'static>,
    /// The first write error: later writes are dropped and [`SweepWriter::finish`] returns it
    /// (a closed stdout must not stop a sweep that is acting).
    error: Option<std::io::Error>,
    /// Stores opened so far in the JSON document.
    stores: usize,
    /// The store being swept.
    current: Option<OpenStore>,
}

struct OpenStore {
    name: String,
    /// Table: warnings printed above its rows, so not again below them.
    early_warnings: Vec<String>,
    /// Whether its header is written.
    opened: bool,
    rows: u64,
    /// JSON: skipped threads as JSON lines, written after the rows.
    spool: Option<Spool>,
}

/// Where `-o json` keeps a store's skipped threads until its rows are written: a temporary file
/// (their number is not bounded), or memory when no temporary file can be made (a `TMPDIR` that
/// does not exist must not cost the sweep its report).
enum Spool {
    File(std::io::BufWriter<std::fs::File>),
    Memory(Vec<u8>),
}

impl Spool {
    fn new() -> Self {
        match tempfile::tempfile() {
            Ok(file) => Self::File(std::io::BufWriter::new(file)),
            Err(e) => {
                tracing::warn!(
                    "cannot create a temporary file in {} (TMPDIR): {e}; the skipped threads of -o json are kept in memory",
                    std::env::temp_dir().display()
                );
                Self::Memory(Vec::new())
            }
        }
    }

    fn writer(&mut self) -> &mut dyn Write {
        match self {
            Self::File(f) => f,
            Self::Memory(m) => m,
        }
    }

    /// A reader of the JSON lines written, from the first.
    fn reader(self) -> std::io::Result<Box<dyn std::io::BufRead>> {
        Ok(match self {
            Self::File(spool) => {
                let mut file = spool.into_inner().map_err(|e| e.into_error())?;
                std::io::Seek::rewind(&mut file)?;
                Box::new(std::io::BufReader::new(file))
            }
            Self::Memory(m) => Box::new(std::io::Cursor::new(m)),
        })
    }
}

impl<W: Write + Send> SweepWriter<W> {
    /// A writer of `format` to `out`; nothing is written before the first store's rows.
    pub fn new(out: W, format: Format) -> Self {
        Self {
            out,
            format,
            json: PrettyFormatter::with_indent(b"  "),
            error: None,
            stores: 0,
            current: None,
        }
    }

    /// Starts the report of the store `name` (`namespace/name`). The table prints
    /// `early_warnings` (what the resources alone show, [`crate::sweep::input_warnings`]) under
    /// the store's name, above the rows they qualify, and leaves them out of the warnings after
    /// the rows; JSON lists every warning in the store's `warnings`.
    pub fn begin_store(&mut self, name: &str, early_warnings: Vec<String>) {
        self.current = Some(OpenStore {
            name: name.to_owned(),
            early_warnings,
            opened: false,
            rows: 0,
            spool: None,
        });
    }

    /// Ends the current store's report: with the rest of its [`crate::sweep::Report`] when its sweep finished,
    /// or with the error message when it failed.
    pub fn end_store(&mut self, result: Result<&Report, &str>) {
        let Some(mut store) = self.current.take() else {
            return;
        };
        if result.is_ok() {
            self.open(&mut store);
        }
        let written = store.opened.then(|| self.close_store(store, result));
        if let Some(Err(e)) = written {
            self.error.get_or_insert(e);
        }
    }

    /// Writes the end of the report (JSON: `errors`, the stores that could not be swept), then
    /// flushes.
    ///
    /// # Errors
    /// The first I/O error of `out` or of the skipped-thread spool.
    pub fn finish(mut self, errors: &[String]) -> std::io::Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        let (out, json) = (&mut self.out, &mut self.json);
        match self.format {
            Format::Json => {
                if self.stores == 0 {
                    json.begin_object(out)?;
                    key(out, json, "stores", true)?;
                    json.begin_array(out)?;
                }
                json.end_array(out)?;
                json.end_object_value(out)?;
                field(out, json, "errors", false, errors)?;
                json.end_object(out)?;
                writeln!(out)?;
            }
            Format::Table => {}
        }
        self.out.flush()
    }

    fn write(
        &mut self,
        f: impl FnOnce(&mut W, &mut PrettyFormatter<'static>, Format) -> std::io::Result<()>,
    ) {
        if self.error.is_none()
            && let Err(e) = f(&mut self.out, &mut self.json, self.format)
        {
            self.error = Some(e);
        }
    }

    fn open(&mut self, store: &mut OpenStore) {
        if store.opened {
            return;
        }
        store.opened = true;
        let first = self.stores == 0;
        self.stores += 1;
        let name = store.name.clone();
        let early = store.early_warnings.clone();
        self.write(|out, json, format| match format {
            Format::Json => {
                if first {
                    json.begin_object(out)?;
                    key(out, json, "stores", true)?;
                    json.begin_array(out)?;
                }
                json.begin_array_value(out, first)?;
                json.begin_object(out)?;
                field(out, json, "store", true, &name)?;
                key(out, json, "rows", false)?;
                json.begin_array(out)
            }
            Format::Table => {
                writeln!(out, "store {name}")?;
                early.iter().try_for_each(|w| writeln!(out, "warning: {w}"))
            }
        });
    }

    fn close_store(
        &mut self,
        mut store: OpenStore,
        result: Result<&Report, &str>,
    ) -> std::io::Result<()> {
        if self.error.is_some() {
            return Ok(());
        }
        let (out, json) = (&mut self.out, &mut self.json);
        match self.format {
            Format::Json => {
                json.end_array(out)?;
                json.end_object_value(out)?;
                key(out, json, "skipped", false)?;
                json.begin_array(out)?;
                if let Some(spool) = store.spool.take() {
                    let lines = std::io::BufRead::lines(spool.reader()?);
                    for (i, line) in lines.enumerate() {
                        json.begin_array_value(out, i == 0)?;
                        out.write_all(line?.as_bytes())?;
                        json.end_array_value(out)?;
                    }
                }
                json.end_array(out)?;
                json.end_object_value(out)?;
                match result {
                    // The fields after `skipped`, in their declared order; a field added to
                    // `Report` and missed here fails `streamed_json_is_the_reports`.
                    Ok(r) => {
                        field(out, json, "settled", false, &r.settled)?;
                        field(out, json, "audit", false, &r.audit)?;
                        field(out, json, "too_recent", false, &r.too_recent)?;
                        // The early warnings the sweep did not repeat (`--apply` on an
                        // observing store, known only to the command) come first.
                        let warnings: Vec<&String> = store
                            .early_warnings
                            .iter()
                            .filter(|w| !r.warnings.contains(w))
                            .chain(&r.warnings)
                            .collect();
                        field(out, json, "warnings", false, &warnings)?;
                        field(out, json, "servers", false, &r.servers)?;
                        field(out, json, "summary", false, &r.summary)?;
                        field(out, json, "lifetimes", false, &r.lifetimes)?;
                        field(out, json, "acting", false, &r.acting)?;
                    }
                    Err(e) => field(out, json, "error", false, e)?,
                }
                json.end_object(out)?;
                json.end_array_value(out)?;
            }
            Format::Table => {
                if store.rows == 0 {
                    write_rows(out, &[], true)?;
                }
                if let Ok(f) = result {
                    write_end(out, f, store.rows, &store.early_warnings)?;
                }
                writeln!(out)?;
            }
        }
        out.flush()
    }
}

impl<W: Write + Send> RowSink for SweepWriter<W> {
    fn rows(&mut self, rows: Vec<Row>) {
        // A batch without rows writes nothing: the table's header waits for the first row, or
        // for the store's end (which writes it when no row came).
        if rows.is_empty() {
            return;
        }
        let Some(mut store) = self.current.take() else {
            return;
        };
        self.open(&mut store);
        let first = store.rows == 0;
        store.rows += rows.len() as u64;
        self.current = Some(store);
        self.write(|out, json, format| {
            match format {
                Format::Json => {
                    for (i, row) in rows.iter().enumerate() {
                        json.begin_array_value(out, first && i == 0)?;
                        serde_json::to_writer(&mut *out, row)?;
                        json.end_array_value(out)?;
                    }
                }
                Format::Table => write_rows(out, &rows, first)?,
            }
            out.flush()
        });
    }

    fn skipped(&mut self, thread: SkippedThread) {
        let Some(mut store) = self.current.take() else {
            return;
        };
        self.open(&mut store);
        if self.format == Format::Json {
            let spool = store.spool.get_or_insert_with(Spool::new).writer();
            let spooled = serde_json::to_writer(&mut *spool, &thread)
                .map_err(std::io::Error::from)
                .and_then(|()| writeln!(spool));
            if let Err(e) = spooled {
                self.error.get_or_insert(e);
            }
        } else {
            self.write(|out, _, _| writeln!(out, "skipped {thread}"));
        }
        self.current = Some(store);
    }
}

/// Lends the document's [`PrettyFormatter`] to a serializer of one value, so the value is
/// indented at the depth the document has reached (serde_json implements [`Formatter`] for no
/// reference). The pretty formatter overrides just these methods.
struct Lent<'a>(&'a mut PrettyFormatter<'static>);

impl Formatter for Lent<'_> {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_array(w)
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array(w)
    }
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_array_value(w, first)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_array_value(w)
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object(w)
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object(w)
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_object_key(w, first)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.begin_object_value(w)
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.0.end_object_value(w)
    }
}

/// Writes `value` pretty at the document's depth.
fn value<W: Write>(
    out: &mut W,
    json: &mut PrettyFormatter<'static>,
    value: &(impl Serialize + ?Sized),
) -> std::io::Result<()> {
    value
        .serialize(&mut serde_json::Serializer::with_formatter(out, Lent(json)))
        .map_err(std::io::Error::from)
}

/// Opens the member `name` of the open object (`first`: its first member).
fn key<W: Write>(
    out: &mut W,
    json: &mut PrettyFormatter<'static>,
    name: &str,
    first: bool,
) -> std::io::Result<()> {
    json.begin_object_key(out, first)?;
    value(out, json, name)?;
    json.end_object_key(out)?;
    json.begin_object_value(out)
}

/// Writes the member `name: v` of the open object.
fn field<W: Write>(
    out: &mut W,
    json: &mut PrettyFormatter<'static>,
    name: &str,
    first: bool,
    v: &(impl Serialize + ?Sized),
) -> std::io::Result<()> {
    key(out, json, name, first)?;
    value(out, json, v)?;
    json.end_object_value(out)
}

/// Widest table cell, in display columns: a longer value (a 10 000-character handle) is cut
/// and ends in [`CUT`]; `-o json` keeps every value whole.
pub const MAX_CELL: usize = 48;
/// Widest REASON cell (the last column, so it pads no other), in display columns.
pub const MAX_REASON: usize = 160;
/// The marker ending a cut cell.
pub const CUT: char = '…';

/// `value` as one table cell of at most `max` display columns (tabwriter aligns by the same
/// width, from unicode-width): control characters (a tab or newline would break the columns)
/// become spaces, and a longer value is cut at a character boundary and ends in [`CUT`].
pub fn cell(value: &str, max: usize) -> std::borrow::Cow<'_, str> {
    use unicode_width::{UnicodeWidthChar, UnicodeWidthStr};
    let clean = !value.chars().any(char::is_control);
    if clean && value.width() <= max {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut out = String::new();
    let mut width = 0;
    let total: usize = value
        .chars()
        .map(|c| {
            if c.is_control() {
                1
            } else {
                c.width().unwrap_or(0)
            }
        })
        .sum();
    let room = if total > max {
        max.saturating_sub(1)
    } else {
        max
    };
    for c in value.chars() {
        let c = if c.is_control() { ' ' } else { c };
        let w = c.width().unwrap_or(0);
        if width + w > room {
            break;
        }
        width += w;
        out.push(c);
    }
    if total > max {
        out.push(CUT);
    }
    std::borrow::Cow::Owned(out)
}

/// A batch of rows as aligned table lines, under the header when `header`.
fn write_rows(out: &mut dyn Write, rows: &[Row], header: bool) -> std::io::Result<()> {
    let mut tw = tabwriter::TabWriter::new(&mut *out).padding(2);
    if header {
        writeln!(
            tw,
            "THREAD\tNS\tCLASS\tHANDLE\tAGE\tPRINCIPAL\tVERDICT\tACTION\tREASON"
        )?;
    }
    for row in rows {
        writeln!(
            tw,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            cell(&row.thread_id, MAX_CELL),
            if row.checkpoint_ns.is_empty() {
                "-".into()
            } else {
                cell(&row.checkpoint_ns, MAX_CELL)
            },
            cell(&row.handle_class, MAX_CELL),
            cell(row.handle.as_deref().unwrap_or("-"), MAX_CELL),
            row.age_seconds.map_or_else(|| "-".to_owned(), age),
            cell(row.principal.as_deref().unwrap_or("-"), MAX_CELL),
            row.verdict.as_str(),
            cell(
                &row.action
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), ToString::to_string),
                MAX_REASON
            ),
            cell(&row.reason, MAX_REASON),
        )?;
    }
    tw.flush()
}

/// What follows a store's rows in the table: settled actions, audit records, warnings (but the
/// `early` ones, printed above the rows), and the summary line.
fn write_end(out: &mut dyn Write, r: &Report, rows: u64, early: &[String]) -> std::io::Result<()> {
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
    for w in r.warnings.iter().filter(|w| !early.contains(w)) {
        writeln!(out, "warning: {w}")?;
    }
    for c in &r.servers {
        for w in &c.conformance {
            writeln!(
                out,
                "conformance warning: server {} ({}): {}",
                c.server,
                w.kind.label(),
                w.message
            )?;
        }
    }
    let s = &r.summary;
    writeln!(
        out,
        "{} parked threads, {} handles: {} ok, {} gone, {} absent, {} unknown; {} probes{}; {} skipped{}{}, {} parked too recently{}; {} ms",
        s.parked_threads,
        rows,
        s.ok,
        s.gone,
        s.absent,
        s.unknown,
        s.probes,
        by_reason(&s.probe_errors, "failed"),
        s.skipped_threads,
        by_reason(&s.skipped_by_reason, ""),
        not_applicable(&s.not_applicable),
        r.too_recent,
        acted(r.acting, &s.actions),
        s.duration_ms
    )?;
    for l in &r.lifetimes {
        write_lifetime(out, l)?;
    }
    Ok(())
}

/// The summary line's part for what the sweep did: `; actions: 2 escalated, 3 skipped` (or
/// `none`) when it acted, `; no actions: …` when another process held the act lock,
/// nothing when it only planned (the rows say `planned: …`). Local mode logs no line per write:
/// the rows and this are the record.
fn acted(
    acting: crate::sweep::Acting,
    actions: &std::collections::BTreeMap<String, u64>,
) -> String {
    use crate::sweep::Acting;
    match acting {
        Acting::Planned => String::new(),
        Acting::LockHeldElsewhere => {
            "; no actions: another custody process holds the act lock".to_owned()
        }
        Acting::Acted if actions.is_empty() => "; actions: none".to_owned(),
        Acting::Acted => format!(
            "; actions: {}",
            actions
                .iter()
                .map(|(kind, n)| format!("{n} {kind}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// One line per class a probe answered for: its observed lifetime.
fn write_lifetime(
    out: &mut dyn Write,
    l: &crate::sweep::lifetime::ClassLifetime,
) -> std::io::Result<()> {
    let o = &l.observed;
    let secs = |s: Option<u64>| s.map_or_else(|| "-".to_owned(), |s| format!("{s}s"));
    let age = |s: Option<i64>| s.map_or_else(|| "-".to_owned(), |s| format!("{s}s"));
    writeln!(
        out,
        "observed lifetime of {} ({} handles, {} found gone, {}): p5 {}, p50 {}, p95 {}; oldest alive {}, youngest gone {}",
        l.handle_class,
        o.handles,
        o.handles_gone,
        if o.across_sweeps {
            "across sweeps"
        } else {
            "this sweep only"
        },
        secs(o.p5_seconds),
        secs(o.p50_seconds),
        secs(o.p95_seconds),
        age(o.oldest_alive_seconds),
        age(o.youngest_gone_seconds),
    )?;
    if let Some(c) = &l.declared_ttl {
        let verdict = match (c.plausible, c.suggested_seconds) {
            (Some(true), _) => "consistent with the observations".to_owned(),
            (Some(false), Some(s)) => format!(
                "longer than the observations support: consider {s}s (p5 × {}; never applied)",
                crate::domain::lifetime::SUGGESTION_FACTOR
            ),
            (Some(false), None) => "longer than the observations support".to_owned(),
            (None, _) => "not judged: too few observations".to_owned(),
        };
        writeln!(
            out,
            "  declared TTL of {} ({} {}s): {verdict}",
            l.handle_class, c.source, c.ttl_seconds
        )?;
    }
    Ok(())
}

/// `, 2 not applicable (1 metadata, 1 no_channel)`: the (thread, HandleClass) pairs a class
/// does not apply to, so the handle count adds up; nothing when there are none.
fn not_applicable(counts: &std::collections::BTreeMap<String, u64>) -> String {
    if counts.is_empty() {
        return String::new();
    }
    let total: u64 = counts.values().sum();
    format!(", {total} not applicable{}", by_reason(counts, ""))
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
fn write_audit(out: &mut dyn Write, a: &crate::sweep::audit::AuditReport) -> std::io::Result<()> {
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
                // The block is headed by the server: its lines do not name it again.
                writeln!(out, "server {} ({})", d.name, d.url)?;
                writeln!(out, "  discovery failed: {}", e.detail())?;
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
                for t in &c.left_out {
                    writeln!(out, "  left out {:?}: {}", t.name, t.reason)?;
                }
                if let Some(why) = &c.incomplete {
                    writeln!(out, "  catalog incomplete: {why}")?;
                }
                for w in &c.conformance {
                    writeln!(
                        out,
                        "  conformance warning ({}): {}",
                        w.kind.label(),
                        w.message
                    )?;
                }
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
        // A health check that failed as discovery did says so, not the cause a second time.
        let reason = match d.catalog {
            Err(e) if !d.health.healthy && e.detail() == d.health.reason => "as discovery failed",
            _ => &d.health.reason,
        };
        writeln!(
            out,
            "  health: {health} ({reason}, {} ms)",
            d.health.latency_ms
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

    fn row(thread: &str) -> crate::sweep::Row {
        crate::sweep::Row {
            thread_id: thread.into(),
            checkpoint_ns: String::new(),
            checkpoint_id: "c1".into(),
            parked_by: crate::checkpoint::ParkedBy::Interrupt,
            handle_class: "basket".into(),
            handle: Some("bsk_1".into()),
            age_seconds: Some(5),
            probe_age_seconds: None,
            principal: None,
            verdict: crate::domain::verdict::Verdict::Ok,
            reason: "probe answered success".into(),
            probed: true,
            action: None,
        }
    }

    fn finished(store: &str) -> crate::sweep::Report {
        crate::sweep::Report {
            store: store.into(),
            rows: Vec::new(),
            skipped: Vec::new(),
            settled: Vec::new(),
            audit: None,
            too_recent: 0,
            warnings: vec!["a warning".into()],
            servers: Vec::new(),
            failed_probes: Default::default(),
            summary: crate::crd::SweepSummary {
                parked_threads: 3,
                ok: 3,
                ..Default::default()
            },
            lifetimes: Vec::new(),
            acting: crate::sweep::Acting::Planned,
        }
    }

    /// Two stores streamed in batches: one finishes, one fails after its first batch. The
    /// document parses, keeps the report's field names, and names the failure twice.
    #[test]
    fn streamed_json_is_one_document_even_when_a_store_fails_part_way() {
        use crate::sweep::RowSink;
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Json);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![row("t1"), row("t2")]);
        w.skipped(crate::checkpoint::SkippedThread::new(
            "t-bad".into(),
            "c9".into(),
            Some("basket".into()),
            crate::checkpoint::DecodeError::malformed("not msgpack"),
        ));
        w.rows(vec![row("t3")]);
        w.end_store(Ok(&finished("ns/a")));
        w.begin_store("ns/b", Vec::new());
        w.rows(vec![row("u1")]);
        w.end_store(Err("store ns/b: the scan stopped"));
        w.begin_store("ns/c", Vec::new());
        w.end_store(Err("store ns/c: cannot connect"));
        let errors = [
            "store ns/b: the scan stopped".to_owned(),
            "store ns/c: cannot connect".to_owned(),
        ];
        w.finish(&errors).unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        let stores = doc["stores"].as_array().unwrap();
        assert_eq!(stores.len(), 2, "{doc:#}");
        let a = &stores[0];
        assert_eq!(a["store"], "ns/a");
        let threads: Vec<&str> = a["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["thread_id"].as_str().unwrap())
            .collect();
        assert_eq!(threads, ["t1", "t2", "t3"]);
        assert_eq!(a["skipped"][0]["thread_id"], "t-bad");
        assert_eq!(a["summary"]["parkedThreads"], 3);
        assert_eq!(a["warnings"][0], "a warning");
        assert_eq!(a["too_recent"], 0);
        let b = &stores[1];
        assert_eq!(b["rows"].as_array().unwrap().len(), 1);
        assert_eq!(b["skipped"].as_array().unwrap().len(), 0);
        assert_eq!(b["error"], "store ns/b: the scan stopped");
        assert_eq!(doc["errors"].as_array().unwrap().len(), 2);
    }

    /// The streamed document is the reports a whole-document serializer would write (every
    /// field of [`crate::sweep::Report`], rows and skipped threads included), byte for byte in
    /// the layout `custody sweep -o json` has always printed: serde_json's pretty layout with
    /// two-space indents, each row and skipped thread on one line.
    #[test]
    fn streamed_json_is_the_reports() {
        use crate::sweep::RowSink;
        let skipped = crate::checkpoint::SkippedThread::new(
            "t-bad".into(),
            "c9".into(),
            Some("basket".into()),
            crate::checkpoint::DecodeError::malformed("not msgpack"),
        );
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Json);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![row("t1")]);
        w.skipped(skipped.clone());
        w.rows(vec![row("t2")]);
        w.end_store(Ok(&finished("ns/a")));
        w.begin_store("ns/b", Vec::new());
        w.rows(vec![row("u1")]);
        w.end_store(Err("store ns/b: \"quoted\""));
        w.finish(&["store ns/b: \"quoted\"".to_owned()]).unwrap();
        let text = String::from_utf8(buf).unwrap();

        let whole = crate::sweep::Report {
            rows: vec![row("t1"), row("t2")],
            skipped: vec![skipped.clone()],
            ..finished("ns/a")
        };
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc["stores"][0], serde_json::to_value(&whole).unwrap());

        fn line(v: &impl serde::Serialize) -> String {
            serde_json::to_string(v).unwrap()
        }
        fn pretty(v: &impl serde::Serialize, depth: usize) -> String {
            let text = serde_json::to_string_pretty(v).unwrap();
            text.replace('\n', &format!("\n{}", "  ".repeat(depth)))
        }
        let f = finished("ns/a");
        let expected = format!(
            "{{\n  \"stores\": [\n    {{\n      \"store\": \"ns/a\",\n      \"rows\": [\n        {},\n        {}\n      ],\n      \"skipped\": [\n        {}\n      ],\n      \"settled\": [],\n      \"audit\": null,\n      \"too_recent\": 0,\n      \"warnings\": {},\n      \"servers\": [],\n      \"summary\": {},\n      \"lifetimes\": [],\n      \"acting\": \"planned\"\n    }},\n    {{\n      \"store\": \"ns/b\",\n      \"rows\": [\n        {}\n      ],\n      \"skipped\": [],\n      \"error\": \"store ns/b: \\\"quoted\\\"\"\n    }}\n  ],\n  \"errors\": [\n    \"store ns/b: \\\"quoted\\\"\"\n  ]\n}}\n",
            line(&row("t1")),
            line(&row("t2")),
            line(&skipped),
            pretty(&f.warnings, 3),
            pretty(&f.summary, 3),
            line(&row("u1")),
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn streamed_table_and_empty_json() {
        use crate::sweep::RowSink;
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Table);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![row("t1")]);
        w.rows(vec![row("t2")]);
        w.end_store(Ok(&finished("ns/a")));
        w.finish(&["store ns/c: cannot connect".to_owned()])
            .unwrap();
        let text = String::from_utf8(buf).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "store ns/a");
        assert!(lines[1].starts_with("THREAD"), "{text}");
        assert!(
            lines[2].starts_with("t1 ") && lines[3].starts_with("t2 "),
            "{text}"
        );
        assert_eq!(lines[4], "warning: a warning");
        assert!(
            lines[5].starts_with("3 parked threads, 2 handles: 3 ok"),
            "{text}"
        );
        assert!(
            !text.contains("cannot connect"),
            "the caller prints a store's error, once: {text}"
        );

        // Warnings the resources alone show: above the rows they qualify, and only there.
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Table);
        w.begin_store("ns/a", vec!["a warning".to_owned()]);
        w.rows(vec![row("t1")]);
        w.end_store(Ok(&finished("ns/a")));
        w.finish(&[]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..2], ["store ns/a", "warning: a warning"], "{text}");
        assert!(lines[2].starts_with("THREAD"), "{text}");
        assert_eq!(text.matches("warning:").count(), 1, "{text}");

        // Batches without rows: the header once, at the store's end.
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Table);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![]);
        w.rows(vec![]);
        w.end_store(Ok(&finished("ns/a")));
        w.finish(&[]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "store ns/a", "{text}");
        assert!(lines[1].starts_with("THREAD"), "{text}");
        assert_eq!(lines[2], "warning: a warning", "{text}");
        // ... and before the first row when a batch without rows came first.
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Table);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![]);
        w.rows(vec![row("t1")]);
        w.end_store(Ok(&finished("ns/a")));
        w.finish(&[]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        assert_eq!(text.matches("THREAD").count(), 1, "{text}");
        assert!(text.lines().nth(2).unwrap().starts_with("t1 "), "{text}");

        let mut buf = Vec::new();
        super::SweepWriter::new(&mut buf, super::Format::Json)
            .finish(&[])
            .unwrap();
        assert_eq!(
            String::from_utf8(buf).unwrap(),
            "{\n  \"stores\": [],\n  \"errors\": []\n}\n"
        );
    }

    /// Issue 17, item 15: a huge handle is cut with a marker, wide characters count two
    /// columns, a tab cannot break the columns; JSON keeps the whole value.
    #[test]
    fn table_cells_are_cut_and_aligned_by_display_width() {
        use crate::sweep::RowSink;
        use unicode_width::UnicodeWidthStr;
        let mut huge = row("t-huge");
        huge.handle = Some("h".repeat(10_000));
        let mut wide = row("t-宽宽宽");
        wide.handle = Some("🧺🧺🧺".into());
        wide.reason = "line one\nline\ttwo".into();
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Table);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![huge.clone(), wide, row("t1")]);
        w.end_store(Ok(&finished("ns/a")));
        w.finish(&[]).unwrap();
        let text = String::from_utf8(buf).unwrap();
        let lines: Vec<&str> = text.lines().skip(1).take(4).collect();
        assert!(lines.iter().all(|l| l.len() < 400), "{text}");
        assert!(
            lines[1].contains(&format!(
                "{}{}",
                "h".repeat(super::MAX_CELL - 1),
                super::CUT
            )),
            "{text}"
        );
        assert!(lines[2].contains("line one line two"), "{text}");
        // The VERDICT column starts at the same display column on every line.
        let at: Vec<usize> = lines
            .iter()
            .map(|l| {
                let i = l
                    .find("VERDICT")
                    .or_else(|| l.find(" ok ").map(|i| i + 1))
                    .unwrap();
                l[..i].width()
            })
            .collect();
        assert!(at.windows(2).all(|w| w[0] == w[1]), "{at:?}\n{text}");
        let mut buf = Vec::new();
        let mut w = super::SweepWriter::new(&mut buf, super::Format::Json);
        w.begin_store("ns/a", Vec::new());
        w.rows(vec![huge]);
        w.end_store(Ok(&finished("ns/a")));
        w.finish(&[]).unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(
            doc["stores"][0]["rows"][0]["handle"]
                .as_str()
                .unwrap()
                .len(),
            10_000
        );
        assert_eq!(super::cell("ab", 2), "ab");
        assert_eq!(super::cell("abc", 2), "a…");
        assert_eq!(super::cell("宽宽", 3), "宽…");
    }

    #[test]
    fn ages() {
        assert_eq!(super::age(5), "5s");
        assert_eq!(super::age(600), "10m");
        assert_eq!(super::age(4 * 3600), "4h");
        assert_eq!(super::age(3 * 86_400), "3d");
    }
}
