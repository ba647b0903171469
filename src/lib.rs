//! custody keeps LangGraph's durable checkpoints and the perishable MCP handles they hold in
//! agreement.
//!
//! The modules form layers; each imports only the layers below it (tests/layering.rs reads the
//! sources and fails on any other import, with its file and line):
//!
//! ```text
//! main                      the binary: clap subcommands
//! controller                reconcilers, metrics, health endpoints, leader election
//! local  cluster  report    YAML files, the API server, table/JSON output
//! sweep                     the only sequencing of I/O: settle → audit → scan → probe → act
//! plan                      the compile step: resources into validated plans, once
//! crd                       the custom resources (serde structs and their schemas)
//! ledger                    custody's own tables (actions, audit claims)
//! checkpoint  mcp           adapters: LangGraph storage (sqlx), MCP client (rmcp)
//! domain                    the pure core: no other module of the crate, no I/O crate
//! ```
//!
//! A sweep's data path, each arrow a plain value handed forward:
//!
//! ```text
//! CheckpointStore ─► checkpoint (scan, decode) ─► domain (extract, decide) ─► mcp (probe)
//!                    ParkedThread                 HandleRecord, Verdict      ProbeOutcome
//!                ─► domain::policy (plan) ─► sweep::act (ledger, append) ─► report
//! ```
//!
//! [`domain`] holds every rule that decides something: handle records, verdicts, the action
//! policy ([`domain::policy`]), the recovery rules of a re-mint ([`domain::recovery`]), audit
//! settlement ([`domain::audit`]), templates. Adapters convert into its types at their edge.

/// The git commit this binary was built from (`deploy/build-image.sh` sets it; `-dirty` when the
/// tree had uncommitted changes), or `unknown` (build.rs).
pub const REVISION: &str = env!("CUSTODY_REVISION");

/// `custody --version`: the crate version and [`REVISION`].
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (revision ",
    env!("CUSTODY_REVISION"),
    ")"
);

pub mod checkpoint;
pub mod cluster;
pub mod controller;
pub mod crd;
pub mod domain;
pub mod ledger;
pub mod local;
pub mod mcp;
pub mod plan;
pub mod report;
pub mod sweep;
