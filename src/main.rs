//! The `custody` command: `crd`, `sweep`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use custody::local::Resources;
use custody::report::{self, Format};

/// The static image's allocator: musl's own (mallocng) makes the sweep 1.2x slower in wall time
/// and 1.9x in CPU than the glibc build (BENCHMARKS.md, "The sweep as a Pod"). Other targets use
/// the system allocator.
#[cfg(target_env = "musl")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// custody: keeps LangGraph checkpoints and the MCP handles they hold in agreement.
#[derive(Parser)]
#[command(version = custody::VERSION, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every CustomResourceDefinition as YAML.
    Crd,
    /// Find parked threads, probe the handles they hold, and print a verdict for each.
    Sweep(SweepArgs),
    /// List each MCPServer's tools and check its health.
    Discover(DiscoverArgs),
    /// Run the Kubernetes controller (in a cluster, or out of cluster with a kubeconfig).
    Controller(custody::controller::Options),
}

#[derive(clap::Args)]
struct DiscoverArgs {
    /// Resource YAML file, or directory of them, or `-` for standard input (local mode):
    /// MCPServers and the Secrets they reference. Repeat it to read several, as one set of
    /// resources.
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "PATH",
        env = "CUSTODY_RESOURCES",
        required = true
    )]
    paths: Vec<PathBuf>,
    /// Servers discovered at once (at least 1: none at once would discover nothing).
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    concurrency: usize,
    /// Cap on tools/list pages per server (at least 1).
    #[arg(long, default_value_t = custody::mcp::discovery::DEFAULT_PAGE_CAP, value_parser = at_least_one)]
    page_cap: usize,
    /// Cap on one response body or SSE event, in bytes (at least 1).
    #[arg(long, default_value_t = custody::mcp::DEFAULT_MAX_RESPONSE_BYTES, value_parser = at_least_one)]
    max_response_bytes: usize,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t)]
    output: Format,
    #[command(flatten)]
    egress: custody::mcp::egress::EgressOptions,
}

/// Local mode (`-f`) or one store of the cluster (`--store`): exactly one, and usage says so.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["paths", "store"])))]
struct SweepArgs {
    /// Resource YAML file, or directory of them, or `-` for standard input (local mode):
    /// MCPServers, HandleClasses, CheckpointStores and the Secrets they reference. Repeat it to
    /// read several, as one set of resources (a resource defined in two of them is an error
    /// naming both files).
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "PATH",
        env = "CUSTODY_RESOURCES"
    )]
    paths: Vec<PathBuf>,
    /// Sweep one CheckpointStore of the cluster (`namespace/name`), reading its resources from
    /// the Kubernetes API, and write the summary to its status. This is what the CronJob runs.
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = store_ref)]
    store: Option<String>,
    /// Print verdicts and the planned actions; write nothing to checkpoints, custody's tables or
    /// the cluster. Probes still call each class's read-only probe tool (never one that declares
    /// `destructiveHint`).
    #[arg(long, conflicts_with = "apply")]
    dry_run: bool,
    /// Local mode: act on the verdicts of stores whose `mode` is `act` (re-mint, escalate, fail;
    /// writes checkpoints and custody's ledger). Without it a local sweep only plans. Refused
    /// with `--store`, where the store's `mode` alone decides.
    #[arg(long, conflicts_with = "store")]
    apply: bool,
    /// Sweep only shard I of N (`0 <= I < N <= 64`): the threads whose thread id hashes to I
    /// (first 4 bytes of its sha256, modulo N). N processes with I = 0..N-1 cover every thread
    /// exactly once; acting shards lock their own shard only. Default 0/1, every thread.
    #[arg(long, value_name = "I/N", default_value = "0/1")]
    shard: custody::checkpoint::Shard,
    /// With `--store` and `--shard`: the run this shard belongs to (the CronJob passes its Job's
    /// name). Shards merge into `status.lastSweep` once all N of the same run have reported.
    #[arg(long, value_name = "ID", requires = "store")]
    run: Option<String>,
    /// Parked threads judged, acted on and printed per batch: what the sweep holds in memory
    /// at once, besides one small cache entry per distinct handle.
    #[arg(long, value_name = "N", default_value_t = custody::sweep::BATCH_THREADS, value_parser = at_least_one)]
    batch_threads: usize,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t)]
    output: Format,
    /// For tests only (hidden from --help): the sweep's clock, RFC 3339, instead of the system
    /// time. It moves what the sweep computes from `now` (handle ages, declared TTLs,
    /// `minParkedSeconds`, observed lifetimes), so a test can compress a sweep schedule of
    /// hours into seconds against servers that read the same clock; it also dates the ledger
    /// rows the sweep records (`created_at`), while `finishedAt` keeps the system time.
    #[arg(long, hide = true, value_name = "RFC3339")]
    now: Option<chrono::DateTime<chrono::Utc>>,
    #[command(flatten)]
    egress: custody::mcp::egress::EgressOptions,
}

/// A count flag's parser: 0 is refused with a message naming the flag (`invalid value '0' for
/// '--page-cap <PAGE_CAP>': must be at least 1`; clap's own ranged parser prints the type's
/// whole range, `1..18446744073709551615`). A whole number beyond the type says so, not that it
/// is not a whole number.
fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => {
            Err(format!("is too large: at most {}", usize::MAX))
        }
        Err(_) => Err("must be a whole number, at least 1".to_owned()),
    }
}

/// `--store`'s parser: a usage error naming the flag (exit status 2, as any other bad flag), not
/// a failed sweep.
fn store_ref(text: &str) -> Result<String, String> {
    custody::cluster::parse_ref(text).map(|_| text.to_owned())
}

/// The log filter without `RUST_LOG`: custody at INFO, its dependencies (kube, hyper, sqlx, …)
/// at WARN, except the targets below, which log failures that reach custody as typed errors and
/// that custody reports once, with their cause, in its own words (so each would be said twice,
/// often as a `Debug` dump):
///
/// - `rmcp`: its transport logs every failed request and teardown at ERROR or WARN
///   (`fail to get common stream: HTTP 500`, `Err(HttpStatus(HttpStatusError { … }))`);
/// - `kube_client::client::builder`: one ERROR per failed API request (`failed with error
///   client error (Connect)`), beside custody's message naming the object and the cause;
/// - `rustls_platform_verifier`: `failed to verify TLS certificate`, which custody's `tls`
///   cause says with the server's address;
/// - `kube_runtime::watcher` (at ERROR): each failed list or watch as the API server's
///   `Status` dump, which custody logs and counts in its own words.
///
/// - `kube_lease_manager` (at ERROR): each failed Lease read or renewal as kube's `Debug` dump,
///   every backoff step; custody's lapse check says in its own words, once, that the leader lost
///   its Lease and why (the read's cause, or that its renewals stopped landing).
///
/// `RUST_LOG=rmcp=debug` (and so on) shows any of them.
const DEFAULT_LOG: &str = "warn,custody=info,rmcp=off,kube_client::client::builder=off,\
                           rustls_platform_verifier=off,kube_runtime::watcher=error,\
                           kube_lease_manager=off";

/// How log lines look on stderr. A person runs local mode at a terminal, as cargo or kubectl:
/// `warning: <sentence>`, no time, no module path. The controller and a sweep of the cluster
/// (`--store`, the CronJob's Pod) are read through `kubectl logs` and log collectors: time,
/// level, module and fields, as tracing-subscriber writes them.
#[derive(Clone, Copy)]
enum LogStyle {
    Person,
    Service,
}

/// `level: message k=v…` for [`LogStyle::Person`]; DEBUG and TRACE lines keep their module,
/// which is what someone who asked for them (`RUST_LOG=debug`) is looking for.
struct PersonFormat;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for PersonFormat
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        match *meta.level() {
            tracing::Level::ERROR => write!(writer, "error: ")?,
            tracing::Level::WARN => write!(writer, "warning: ")?,
            tracing::Level::INFO => write!(writer, "info: ")?,
            level => write!(
                writer,
                "{}: {}: ",
                level.as_str().to_lowercase(),
                meta.target()
            )?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

fn init_logs(style: LogStyle) {
    // Whatever RUST_LOG says: sqlx logs an unrecognized connect parameter's value at WARN, and
    // that value may be a password (`sslpassword=…`, a mis-cased `PassWord=…`).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| DEFAULT_LOG.into())
        .add_directive(
            "sqlx_postgres::options::parse=off"
                .parse()
                .expect("a valid directive"),
        );
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match style {
        LogStyle::Person => logs.event_format(PersonFormat).init(),
        LogStyle::Service => logs.init(),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logs(match &cli.command {
        Command::Controller(_) => LogStyle::Service,
        Command::Sweep(a) if a.store.is_some() => LogStyle::Service,
        Command::Crd | Command::Sweep(_) | Command::Discover(_) => LogStyle::Person,
    });
    // Test builds only: FAILPOINTS=act::<step>=return stops the sweeper at that step.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    // A sweep of the cluster's store says why it failed in its container's termination message,
    // which the controller copies into the store's LastSweepSucceeded.
    let in_pod = matches!(&cli.command, Command::Sweep(a) if a.store.is_some());
    let terminated = match &cli.command {
        Command::Sweep(a) => Some(stop_at_sigterm(a.store.as_deref(), in_pod)),
        _ => None,
    };
    let result = match terminated {
        Some(mut terminated) => tokio::select! {
            r = run(cli) => r,
            // The sweep is dropped where it stands, as a crash would leave it; then its SQLite
            // pools are closed, which a process exit does not do.
            Ok(stop) = &mut terminated => {
                custody::checkpoint::close_open_pools(CLOSE_AT_SIGTERM).await;
                stop.exit()
            }
        },
        None => run(cli).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // `custody discover | head`: the reader is gone, which is not custody's failure. Only a
        // bare write error is one; a database or server connection's wears its own error type.
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            // custody's errors already carry their causes in their message.
            eprintln!("error: {e}");
            if in_pod {
                custody::cluster::termination_message(&e.to_string());
            }
            ExitCode::FAILURE
        }
    }
}

/// How long a sweep stopped by SIGTERM waits for its SQLite connections to close. The kubelet
/// allows 30 s before SIGKILL; a connection in a statement is returned when the statement ends,
/// and SQLite waits at most 5 s for a lock (`busy_timeout`).
const CLOSE_AT_SIGTERM: std::time::Duration = std::time::Duration::from_secs(6);

/// A sweep stopped by SIGTERM: says so in one line (and in the termination message when
/// `in_pod`) and exits with status 143, once, whichever of the main task and the signal's own
/// task gets there first.
struct Stopped {
    started: std::time::Instant,
    what: String,
    in_pod: bool,
}

impl Stopped {
    fn exit(&self) -> ! {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let message = format!(
                "stopped by SIGTERM after {:.1} s, before {} finished; an action it was taking is settled by the next sweep",
                self.started.elapsed().as_secs_f64(),
                self.what
            );
            eprintln!("error: {message}");
            if self.in_pod {
                custody::cluster::termination_message(&message);
            }
            std::process::exit(143);
        });
        // Another thread is exiting the process inside `call_once`.
        loop {
            std::thread::park();
        }
    }
}

/// Ends the sweep at SIGTERM, exit status 143. In its container the sweep is PID 1, which the
/// kernel gives no default action for SIGTERM: without a handler a Job stopped at its deadline ran
/// on through the kubelet's 30 s grace period, and under `concurrencyPolicy: Forbid` blocked the
/// next run meanwhile. Stopping at any point leaves the store as a crash would, which the ledger
/// is made for: an acting sweep's action in flight is settled by the next one (README "Crash
/// safety").
///
/// The returned receiver tells the main task, which drops the sweep and closes its SQLite pools
/// (so an acting sweep leaves no `-wal`/`-shm` it created) before exiting. A task of its own, so
/// a main task that is busy and does not yield is stopped from here after the same bound.
fn stop_at_sigterm(
    store: Option<&str>,
    in_pod: bool,
) -> tokio::sync::oneshot::Receiver<std::sync::Arc<Stopped>> {
    let (tell, told) = tokio::sync::oneshot::channel();
    let stopped = std::sync::Arc::new(Stopped {
        started: std::time::Instant::now(),
        what: store.map_or_else(
            || "the sweep".to_owned(),
            |s| format!("the sweep of CheckpointStore {s}"),
        ),
        in_pod,
    });
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return told;
    };
    tokio::spawn(async move {
        term.recv().await;
        let _ = tell.send(stopped.clone());
        tokio::time::sleep(CLOSE_AT_SIGTERM + std::time::Duration::from_secs(1)).await;
        stopped.exit()
    });
    told
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let egress = match &cli.command {
        Command::Crd => None,
        Command::Sweep(a) => Some(a.egress),
        Command::Discover(a) => Some(a.egress),
        Command::Controller(o) => Some(o.egress),
    };
    if let Some(e) = egress {
        custody::mcp::egress::set_policy(e.policy());
    }
    match cli.command {
        Command::Crd => {
            let yaml = custody::crd::to_yaml(&custody::crd::all())?;
            std::io::stdout().lock().write_all(yaml.as_bytes())?;
            Ok(())
        }
        Command::Sweep(args) => sweep(args).await,
        Command::Discover(args) => discover(args).await,
        Command::Controller(opts) => custody::controller::run(opts).await,
    }
}

/// The `-f` paths for a message: `a, b` (`-` is standard input).
fn shown(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| match p.to_str() {
            Some("-") => custody::local::STDIN.to_owned(),
            _ => p.display().to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn discover(args: DiscoverArgs) -> anyhow::Result<()> {
    use custody::mcp::discovery::{DiscoveryError, Health};
    let resources = Resources::load_all(&args.paths)?;
    let entries = resources.each_server_config();
    if entries.is_empty() {
        anyhow::bail!("no MCPServer in {}", shown(&args.paths));
    }
    // A server that cannot be used (a Secret of it is missing) is reported in its place, as
    // an unreachable one: the others are discovered.
    let mut servers = Vec::new();
    for (_, config) in &entries {
        if let Ok((cfg, allowlist)) = config {
            let mut cfg = cfg.clone();
            cfg.max_response_bytes = args.max_response_bytes;
            servers.push((cfg, allowlist.clone()));
        }
    }
    let mut discovered =
        custody::mcp::discovery::discover_all(&servers, args.page_cap, args.concurrency)
            .await
            .into_iter();
    let results: Vec<_> = entries
        .iter()
        .map(|(server, config)| match config {
            Ok(_) => discovered.next().expect("one result per usable server"),
            Err(e) => {
                let name = server.metadata.name.clone().unwrap_or_default();
                let error = DiscoveryError::Mcp(custody::mcp::McpError::Config {
                    server: name.clone(),
                    reason: e.to_string(),
                });
                // Not checked: said as the discovery's failure.
                let health = Health {
                    server: name,
                    healthy: false,
                    reason: error.detail(),
                    category: Some(error.category()),
                    latency_ms: 0,
                };
                (Err(error), health)
            }
        })
        .collect();
    let shown: Vec<report::Discovered<'_>> = entries
        .iter()
        .zip(&results)
        .map(|((server, _), (catalog, health))| report::Discovered {
            name: server.metadata.name.as_deref().unwrap_or_default(),
            url: &server.spec.url,
            catalog,
            health,
            schedule: custody::mcp::discovery::Schedule::default(),
        })
        .collect();
    let mut stdout = std::io::stdout().lock();
    report::write_discovery(&mut stdout, &shown, args.output)?;
    stdout.flush()?;
    let failed: Vec<&str> = results
        .iter()
        .zip(&shown)
        .filter(|((c, _), _)| c.is_err())
        .map(|(_, d)| d.name)
        .collect();
    if !failed.is_empty() {
        anyhow::bail!("discovery failed for {}", failed.join(", "));
    }
    Ok(())
}

async fn sweep(args: SweepArgs) -> anyhow::Result<()> {
    let cluster = match &args.store {
        Some(store) => {
            let (ns, name) = custody::cluster::parse_ref(store).map_err(anyhow::Error::msg)?;
            Some((custody::cluster::client().await?, ns, name))
        }
        None => None,
    };
    let events = custody::cluster::CollectingSink::default();
    let mut in_cluster = None;
    let targets = match &cluster {
        Some((client, ns, name)) => {
            let (target, store) = custody::cluster::store_target(client, ns, name).await?;
            in_cluster = Some(store);
            vec![target]
        }
        None => {
            let targets = Resources::load_all(&args.paths)?.targets()?;
            if targets.is_empty() {
                anyhow::bail!("no CheckpointStore in {}", shown(&args.paths));
            }
            targets
        }
    };
    let now = args.now.unwrap_or_else(chrono::Utc::now);
    let mut finished = Vec::new();
    let mut failures = Vec::new();
    // Rows are written as each batch finishes, never held: memory stays flat with the store.
    let mut out = report::SweepWriter::new(std::io::BufWriter::new(std::io::stdout()), args.output);
    for target in &targets {
        let mut warnings = custody::sweep::input_warnings(target);
        // `--apply` cannot make an observing store act; a silent no-op would look like a sweep
        // that found nothing to do. Said on stderr before the table; a JSON reader, who may not
        // see stderr, finds it in the store's `warnings` too.
        if args.apply && target.mode == custody::crd::StoreMode::Observe {
            let warning = format!(
                "CheckpointStore {} has spec.mode observe: --apply acts only on stores with \
                 mode: act, so this sweep only plans",
                target.store
            );
            eprintln!("warning: {warning}");
            if args.output == Format::Json {
                warnings.push(warning);
            }
        }
        let options = custody::sweep::RunOptions {
            apply: !args.dry_run && (args.apply || cluster.is_some()),
            shard: args.shard,
            batch_threads: args.batch_threads,
        };
        let sink: &dyn custody::sweep::act::ActionSink = if cluster.is_some() {
            &events
        } else {
            &custody::sweep::act::LogSink
        };
        out.begin_store(&target.store, warnings);
        match custody::sweep::run_with(target, now, options, sink, &mut out).await {
            Ok(f) => {
                out.end_store(Ok(&f));
                finished.push(f);
            }
            Err(e) => {
                let e = e.to_string();
                out.end_store(Err(&e));
                failures.push(e);
            }
        }
    }
    // Its status, Events (HandleClasses left out, gone handles not acted on, servers whose
    // probes failed, the actions), the classes' lifetimes and the servers' results off schema.
    if let Some(store) = &in_cluster
        && let Some(r) = finished.first()
    {
        store
            .report(r, &events, args.shard, args.run.as_deref(), now)
            .await?;
    }
    out.finish(&failures)?;
    // Printed once, on stderr (the table leaves it out; JSON lists it under `errors` for
    // programs reading stdout).
    if !failures.is_empty() {
        anyhow::bail!("{}", failures.join("; "));
    }
    Ok(())
}
