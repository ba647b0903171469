//! Named stopping points for the kill -9 and fault tests (feature `failpoints`).

/// Stops the process at a named point when the `failpoints` feature is built in and
/// `FAILPOINTS=<point>=return` (or `return(wait)`) is set: it prints `custody failpoint <point>`
/// on stderr and then blocks until killed (or, with `wait`, until a line arrives on stdin).
/// Points are `act::<step>` (a re-mint), `audit::<step>` (an audit settlement) and
/// `sweep::<step>` (the scan). For the kill -9 and fault tests; a no-op otherwise.
#[cfg(feature = "failpoints")]
pub(crate) fn stop_at(point: &str) {
    fail::fail_point!(point, |arg: Option<String>| {
        use std::io::{BufRead, Write};
        eprintln!("custody failpoint {point}");
        let _ = std::io::stderr().flush();
        if arg.as_deref() == Some("wait") {
            let mut line = String::new();
            let _ = std::io::stdin().lock().read_line(&mut line);
        } else {
            loop {
                std::thread::park();
            }
        }
    });
}

/// See the `failpoints` build of this function.
#[cfg(not(feature = "failpoints"))]
pub(crate) fn stop_at(_: &str) {}
