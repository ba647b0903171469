//! The one failpoint runner: a `custody` process started with `FAILPOINTS=<point>=<action>`
//! (the binary built with `--features failpoints`) and held at the point it reports reaching.

use std::io::{BufRead, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// A running custody stopped at a failpoint.
pub struct Stopped {
    child: Child,
    lines: Receiver<String>,
    /// The thread forwarding stderr's lines; it ends at the pipe's end, when the process exits.
    reader: std::thread::JoinHandle<()>,
}

impl Stopped {
    /// Starts `custody ARGS…` with `FAILPOINTS=<point>=<action>` (e.g. `act::after-mint`,
    /// `return(wait)`) and waits, up to 60 s, until it prints `custody failpoint <point>`.
    pub fn at(args: &[String], point: &str, action: &str) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_custody"))
            .args(args)
            .env("FAILPOINTS", format!("{point}={action}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start custody");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let marker = format!("custody failpoint {point}");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = Vec::new();
        loop {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) if line == marker => break,
                Ok(line) => seen.push(line),
                Err(_) => panic!(
                    "custody never reached {point}; stderr:\n{}",
                    seen.join("\n")
                ),
            }
        }
        Self {
            child,
            lines,
            reader,
        }
    }

    /// Lets a `return(wait)` stop go on; returns its exit status, report (stdout) and stderr.
    pub fn go(mut self) -> (ExitStatus, String, String) {
        self.child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let out = self.child.wait_with_output().unwrap();
        // Every line is forwarded once the reader has seen the pipe end: without the join, a
        // loaded machine could leave the last lines (the error) still in the pipe.
        self.reader.join().unwrap();
        let stderr: Vec<String> = self.lines.try_iter().collect();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr.join("\n"),
        )
    }

    /// SIGKILL, and waits for the process.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}
