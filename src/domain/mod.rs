//! The custody domain: handle records, verdicts and argument templates.
//!
//! Pure functions over plain values. Nothing here talks to a database, an MCP server or the
//! Kubernetes API; it reads the plain spec structs of [`crate::crd`] and the decoded channels of
//! [`crate::checkpoint`], and every rule is table-tested.

pub mod handle;
pub mod template;
pub mod verdict;
