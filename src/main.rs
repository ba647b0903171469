//! The `custody` command: `crd`, `sweep`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use custody::local::Resources;
use custody::report::{self, Format};

/// custody: keeps LangGraph checkpoints and the MCP handles they hold in agreement.
#[derive(Parser)]
#[command(version, about)]
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
}

#[derive(clap::Args)]
struct SweepArgs {
    /// Directory of resource YAML files (local mode): MCPServers, HandleClasses,
    /// CheckpointStores and the Secrets they reference.
    #[arg(
        short = 'f',
        long = "filename",
        value_name = "DIR",
        env = "CUSTODY_RESOURCES"
    )]
    dir: PathBuf,
    /// Run one sweep and exit. (Sweeps are scheduled by the controller in a cluster.)
    #[arg(long)]
    once: bool,
    /// Print verdicts and change nothing. Acting on verdicts is not implemented yet, so every
    /// sweep is a dry run for now.
    #[arg(long)]
    dry_run: bool,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t)]
    output: Format,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,custody=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Crd => {
            print!("{}", custody::crd::to_yaml(&custody::crd::all())?);
            Ok(())
        }
        Command::Sweep(args) => sweep(args).await,
    }
}

async fn sweep(args: SweepArgs) -> anyhow::Result<()> {
    let resources = Resources::load(&args.dir)?;
    let targets = resources.targets()?;
    if targets.is_empty() {
        anyhow::bail!(
            "no CheckpointStore among the files in {}",
            args.dir.display()
        );
    }
    let now = chrono::Utc::now();
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for target in &targets {
        match custody::sweep::run(target, now).await {
            Ok(r) => reports.push(r),
            Err(e) => failures.push(e.to_string()),
        }
    }
    let mut stdout = std::io::stdout().lock();
    report::write_sweep(&mut stdout, &reports, args.output)?;
    stdout.flush()?;
    if !failures.is_empty() {
        anyhow::bail!("{}", failures.join("; "));
    }
    Ok(())
}
