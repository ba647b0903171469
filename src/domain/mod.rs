//! The custody core: handle records, verdicts, argument templates and observed lifetimes.
//!
//! Pure functions over plain values. Nothing here talks to a database, an MCP server or the
//! Kubernetes API, and nothing here imports another module of the crate (tests/layering.rs
//! checks it): the adapters and the compile step convert into these types.

pub mod audit;
pub mod handle;
pub mod lifetime;
pub mod path;
pub mod pending;
pub mod policy;
pub mod recovery;
pub mod template;
pub mod tool;
pub mod verdict;
