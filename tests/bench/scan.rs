//! custody's side of the sweep benchmark (issue 8); driven by `tests/bench/run.sh`.
//!
//! Built as `[[bench]] scan` (`harness = false`) on the public library API only:
//!
//! ```text
//! scan  --dsn URL [--channel basket] [--shard I/N]   scan + decode every parked thread's handle
//!                                                   record through checkpoint::Store (one shard
//!                                                   of them with --shard, filtered in SQL), no
//!                                                   probes; reports the plan the store chose
//! sql [--plan full|indexed]                          the statement a one-channel scan runs
//! sql-indexes                                       the optional indexes' CREATE INDEX statements,
//!                                                   one a line
//! probe --resources DIR                              custody::sweep::run_with on every
//!                                                   CheckpointStore in DIR (probes on, dry run),
//!                                                   rows counted and dropped as the CLI's
//!                                                   streaming writer does, not collected
//! ```
//!
//! Each run prints one JSON line on stdout. `scan` reports an order-independent digest of
//! (thread_id, handle value) so the Python sweepers can be checked against it: the wrapping sum
//! of the first 8 bytes (big-endian) of sha256("{thread_id}\t{value or -}") over all parked
//! threads. Peak RSS is the process's VmHWM (the whole process: tokio, sqlx, buffers).

use std::collections::BTreeMap;
use std::time::Instant;

use custody::checkpoint::{Backend, ScanPlan, Scanned, Shard, Store};
use custody::domain::handle::{self, Holding, RecordFields};
use custody::domain::path::StatePath;
use futures::TryStreamExt;
use serde_json::json;
use sha2::{Digest, Sha256};

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let Some(mode) = args.first().cloned() else {
        // `cargo test --all-targets` runs bench targets once without arguments: there is
        // nothing to measure then, and that is not a failure.
        eprintln!("scan: no mode given; the benchmark runs through tests/bench/run.sh");
        return;
    };
    let opts = parse(&args[1..]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let out = match mode.as_str() {
        "scan" => rt.block_on(scan(&opts)),
        "probe" => rt.block_on(probe(&opts)),
        "sql" => {
            // The statement a scan for one channel runs, for EXPLAIN and psql's \copy.
            let plan = match opts.get("plan").map(String::as_str) {
                None | Some("full") => ScanPlan::Full,
                Some("indexed") => ScanPlan::Indexed,
                Some(_) => usage(),
            };
            print!("{}", custody::checkpoint::postgres_scan_statement(1, plan));
            return;
        }
        "sql-indexes" => {
            for (_, _, statement) in custody::checkpoint::PARKED_INDEXES {
                println!("{statement}");
            }
            return;
        }
        _ => usage(),
    };
    println!("{out}");
}

fn usage() -> ! {
    eprintln!(
        "usage: scan scan --dsn URL [--channel C] | scan probe --resources DIR | scan sql [--plan full|indexed] | scan sql-indexes"
    );
    std::process::exit(2)
}

fn parse(args: &[String]) -> BTreeMap<String, String> {
    let mut map = BTreeMap::new();
    let mut it = args.iter();
    while let Some(k) = it.next() {
        let Some(key) = k.strip_prefix("--") else {
            usage()
        };
        let Some(v) = it.next() else { usage() };
        map.insert(key.to_owned(), v.clone());
    }
    map
}

/// The wrapping sum of per-row digests: equal sets of rows give equal sums in any order.
fn row_digest(thread_id: &str, value: Option<&str>) -> u64 {
    let mut h = Sha256::new();
    h.update(thread_id.as_bytes());
    h.update(b"\t");
    h.update(value.unwrap_or("-").as_bytes());
    let d = h.finalize();
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// Peak resident set of this process in KiB (VmHWM), and CPU seconds used so far.
fn proc_stats() -> (u64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let hwm = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    (hwm, cpu_seconds())
}

fn cpu_seconds() -> f64 {
    // Fields 14 and 15 of /proc/self/stat (utime, stime) in clock ticks (USER_HZ = 100).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // After "pid (comm) ", state is field 3, so utime (14) is index 11.
    (ticks(11) + ticks(12)) as f64 / 100.0
}

async fn scan(opts: &BTreeMap<String, String>) -> serde_json::Value {
    let dsn = opts.get("dsn").cloned().unwrap_or_else(|| usage());
    let channel = opts
        .get("channel")
        .cloned()
        .unwrap_or_else(|| "basket".into());
    let shard: Shard = opts
        .get("shard")
        .map(|s| s.parse().unwrap_or_else(|e| panic!("--shard: {e}")))
        .unwrap_or_default();
    let fields = RecordFields::default();
    let path = StatePath::new(&channel);
    let t0 = Instant::now();
    let store = Store::connect(Backend::Postgres, &dsn)
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let connected = t0.elapsed().as_secs_f64();
    let plan = store.scan_plan();
    let channels = vec![channel.clone()];
    let mut stream = store.parked_threads_in(&channels, shard);
    let (mut parked, mut with_handle, mut without, mut malformed, mut skipped) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut digest = 0u64;
    let mut first_row = None;
    while let Some(item) = stream
        .try_next()
        .await
        .unwrap_or_else(|e| panic!("scan: {e}"))
    {
        if first_row.is_none() {
            first_row = Some(t0.elapsed().as_secs_f64());
        }
        let thread = match item {
            Scanned::Parked(t) => t,
            Scanned::Skipped(_) => {
                skipped += 1;
                continue;
            }
        };
        parked += 1;
        let value = match handle::extract(thread.slot(path.channel()), &path, &fields) {
            Holding::Record(r) => {
                with_handle += 1;
                Some(r.value)
            }
            Holding::Absent | Holding::NotApplicable => {
                without += 1;
                None
            }
            Holding::Malformed(_) => {
                malformed += 1;
                None
            }
        };
        digest = digest.wrapping_add(row_digest(&thread.thread_id, value.as_deref()));
    }
    drop(stream);
    let total = t0.elapsed().as_secs_f64();
    let (rss_kb, cpu) = proc_stats();
    json!({
        "sweeper": "a_custody",
        "plan": plan.map(|p| format!("{p:?}").to_lowercase()),
        "parked": parked,
        "with_handle": with_handle,
        "without_handle": without,
        "malformed": malformed,
        "skipped": skipped,
        "digest": format!("{digest:016x}"),
        "connect_s": connected,
        "first_row_s": first_row,
        "inproc_s": total,
        "cpu_s": cpu,
        "peak_rss_kb": rss_kb,
    })
}

/// Distinct probed handles are counted up to this many (the probe-cost run has ~20k); past it
/// the set is dropped and the count reported as null, so the full sweeps' peak RSS measures
/// the sweep, not this set (at most ~3 MB of it, the same at 100k and 1M threads).
const DISTINCT_CAP: usize = 100_000;

/// Counts what a sweep hands over, keeping no row: the memory figure is the sweep's own, as
/// under `custody sweep`'s streaming writer (whose formatting of a batch is not measured here).
#[derive(Default)]
struct Counting {
    rows: u64,
    skipped: u64,
    /// First 16 bytes of sha256("{class}\t{handle}") of the probed rows, up to [`DISTINCT_CAP`].
    distinct: Option<std::collections::HashSet<[u8; 16]>>,
}

impl custody::sweep::RowSink for Counting {
    fn rows(&mut self, rows: Vec<custody::sweep::Row>) {
        self.rows += rows.len() as u64;
        if let Some(d) = &mut self.distinct {
            for r in rows.iter().filter(|r| r.probed) {
                let Some(handle) = &r.handle else { continue };
                let digest = Sha256::digest(format!("{}\t{handle}", r.handle_class));
                d.insert(digest[..16].try_into().expect("16 bytes"));
            }
        }
        if self
            .distinct
            .as_ref()
            .is_some_and(|d| d.len() > DISTINCT_CAP)
        {
            self.distinct = None;
        }
    }

    fn skipped(&mut self, _: custody::checkpoint::SkippedThread) {
        self.skipped += 1;
    }
}

async fn probe(opts: &BTreeMap<String, String>) -> serde_json::Value {
    let dir = opts.get("resources").cloned().unwrap_or_else(|| usage());
    let resources = custody::local::Resources::load(std::path::Path::new(&dir))
        .unwrap_or_else(|e| panic!("resources: {e}"));
    let targets = resources
        .targets()
        .unwrap_or_else(|e| panic!("targets: {e}"));
    let mut out = Vec::new();
    for target in &targets {
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let mut rows = Counting {
            distinct: Some(Default::default()),
            ..Counting::default()
        };
        let report = custody::sweep::run_with(
            target,
            chrono::Utc::now(),
            custody::sweep::RunOptions::default(),
            &custody::sweep::act::LogSink,
            &mut rows,
        )
        .await
        .unwrap_or_else(|e| panic!("sweep: {e}"));
        let wall = t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu0;
        let s = &report.summary;
        out.push(json!({
            "store": report.store,
            "rows": rows.rows,
            "parked_threads": s.parked_threads,
            "skipped": rows.skipped,
            "probes": s.probes,
            "distinct_probed_handles": rows.distinct.map(|d| d.len()),
            "ok": s.ok, "gone": s.gone, "absent": s.absent, "unknown": s.unknown,
            "servers": report.servers.len(),
            "connect_ms": report.servers.iter().filter_map(|c| c.connect_ms).collect::<Vec<_>>(),
            "wall_s": wall,
            "cpu_s": cpu,
        }));
    }
    let (rss_kb, _) = proc_stats();
    json!({"sweeper": "probe", "stores": out, "peak_rss_kb": rss_kb})
}
