//! The production-shaped agent of tests/py/hitl_agent.py (`create_agent`, tools through the
//! agent toolkit's loader and `langchain.mcp.MCPAdapter`, `HumanInTheLoopMiddleware`), run as
//! its CLI against a checkpoint database.

use std::process::Command;

use serde_json::{Value, json};

use super::checkpoints::Checkpoints;
use super::{Db, var};

/// The state `hitl_agent.py` prints, `"next"` of an agent parked at its HITL interrupt.
pub const PARKED_AT: &str = "HumanInTheLoopMiddleware.after_model";

/// Runs `hitl_agent.py ARGS… (--sqlite PATH | --postgres URL)` and returns its JSON, asserting
/// success.
pub fn run(db: Db<'_>, args: &[&str]) -> Value {
    let mut cmd = Command::new(var("CUSTODY_TEST_PYTHON"));
    cmd.arg(var("CUSTODY_TEST_HITL_AGENT")).args(args);
    match db {
        Db::Sqlite(p) => cmd.arg("--sqlite").arg(p),
        Db::Postgres(url) => cmd.args(["--postgres", url]),
    };
    let out = cmd.output().expect("run hitl_agent.py");
    assert!(
        out.status.success(),
        "hitl_agent.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("hitl_agent.py JSON")
}

/// Starts thread `thread` (principal `user-1`) with these plan `items`, approves the first
/// `approve` interrupts and returns the state it is left in. `handle_in_args`: the model copies
/// the basket id into its `add_item` calls.
pub fn write(
    c: &Checkpoints,
    server: &str,
    thread: &str,
    items: &Value,
    approve: u32,
    handle_in_args: bool,
) -> Value {
    let (items, approve) = (items.to_string(), approve.to_string());
    let mut args = vec![
        "write",
        "--server",
        server,
        "--thread",
        thread,
        "--items",
        &items,
        "--approve",
        &approve,
    ];
    if handle_in_args {
        args.push("--handle-in-args");
    }
    run(c.db(), &args)
}

/// Resumes `thread` with `Command(resume={"decisions": decisions})`; its state after.
pub fn resume(c: &Checkpoints, server: &str, thread: &str, decisions: &Value) -> Value {
    let decisions = decisions.to_string();
    run(
        c.db(),
        &[
            "resume",
            "--server",
            server,
            "--thread",
            thread,
            "--decisions",
            &decisions,
        ],
    )
}

/// A thread's state.
pub fn state(c: &Checkpoints, thread: &str) -> Value {
    run(c.db(), &["state", "--thread", thread])
}

/// Approve every action of the pending interrupt (one here).
pub fn approve() -> Value {
    json!([{"type": "approve"}])
}

/// The tool messages of a state, in order: `(name, status, text)`.
pub fn tool_messages(state: &Value) -> Vec<(String, String, String)> {
    state["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["type"] == "tool")
        .map(|m| {
            let text = match &m["content"] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            (
                m["name"].as_str().unwrap_or_default().to_owned(),
                m["status"].as_str().unwrap_or_default().to_owned(),
                text,
            )
        })
        .collect()
}
