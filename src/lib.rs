//! custody keeps LangGraph's durable checkpoints and the perishable MCP handles they hold in
//! agreement.
//!
//! The data path of a sweep, each arrow a plain value handed forward:
//!
//! ```text
//! CheckpointStore ─► checkpoint (scan, decode) ─► domain (extract, decide) ─► mcp (probe)
//!                    ParkedThread                 HandleRecord, Verdict      ProbeOutcome
//! ```
//!
//! Only [`checkpoint`] (sqlx) and [`mcp`] (rmcp) touch the outside world during a sweep;
//! [`domain`] is pure and imports neither kube, sqlx nor rmcp.

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
