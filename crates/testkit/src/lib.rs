//! Test support shared by kv-select's integration tests and benches. Dev-only: it is a
//! `[dev-dependencies]` entry everywhere and never a normal dependency (the layering test in
//! `xtask` allows it nothing but a leaf position).
//!
//! Everything here fails loudly: a helper that cannot do its job panics with a message
//! naming what it was doing, because in a test that is the useful outcome. Every wait is
//! bounded in time, so a broken fixture ends a run instead of hanging CI.
//!
//! - [`free_port`]: a loopback TCP port that was free a moment ago (tests bind only
//!   127.0.0.1 and pick their ports themselves).
//! - [`poll_until`] / [`wait_until`]: poll a condition every 20 ms up to a limit.
//! - [`run`]: run a command and insist it succeeded, showing its output otherwise.
//! - [`python_venv`]: the Python virtual environment the engine interop tests install the
//!   engines' own publisher code into.
//! - [`chat_tokenizer`]: a trained byte-level BPE `tokenizer.json` and a
//!   `tokenizer_config.json` with a ChatML chat template, for the endpoint picker.

mod chat_tokenizer;

pub use chat_tokenizer::{
    BOS, CHATML_TEMPLATE, DEFAULT_SYSTEM, IM_END, IM_START, chat_tokenizer, chatml_text,
};

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// How often the waits re-check their condition.
const POLL: Duration = Duration::from_millis(20);

/// The port of a ZMQ `tcp://host:port` endpoint, e.g. the `get_last_endpoint` of a socket
/// bound to `tcp://127.0.0.1:*`: binding the wildcard lets the kernel pick the port at bind
/// time, where [`free_port`] then `bind` leaves a window for another process to take it.
pub fn endpoint_port(endpoint: &str) -> u16 {
    endpoint
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in endpoint {endpoint:?}"))
}

/// A loopback TCP port that was free a moment ago. Another process can take it before the
/// caller binds it; callers that start servers retry on a bind failure.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}

/// The nice values of process `pid`'s threads whose names start with `prefix` (Linux's
/// `/proc`; empty elsewhere or for a process that is gone).
pub fn thread_nice_values(pid: u32, prefix: &str) -> Vec<i64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim_end().starts_with(prefix))
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("stat")).ok())
        // Past the parenthesised name, the state is field 3 and the nice value field 19.
        .filter_map(|stat| {
            let rest = &stat[stat.rfind(')')? + 1..];
            rest.split_whitespace().nth(16)?.parse().ok()
        })
        .collect()
}

/// Polls `cond` until it holds or `limit` has passed; whether it held.
pub fn poll_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// [`poll_until`], panicking with `what` when `limit` passes first.
pub fn wait_until(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    assert!(
        poll_until(limit, cond),
        "timed out after {limit:?} waiting for {what}"
    );
}

/// Runs `cmd` to completion and panics, with its exit status, stdout and stderr, unless it
/// succeeded; `what` names it in the message.
pub fn run(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `pip install` for the tests' venvs. `--no-compile`: a test imports a few of the modules
/// it installs (SGLang's wheel alone is thousands of files), so compiling them all to
/// bytecode at install time is wasted, and it was half of a fresh setup's time.
pub const PIP_INSTALL: [&str; 5] = ["-m", "pip", "install", "--quiet", "--no-compile"];

/// The interpreter of a Python virtual environment at `dir`, created with `python3 -m venv`
/// unless it already exists, then given exactly `packages` (pinned requirement strings) by
/// pip. The installation runs once per `dir`: a marker file records it, so later runs
/// only check the marker. Callers that share `dir` within one process serialize their
/// calls (e.g. through a `OnceLock`).
pub fn python_venv(dir: &Path, packages: &[&str]) -> PathBuf {
    let python = dir.join("bin").join("python");
    let ready = dir.join(".installed");
    if !ready.exists() {
        run(
            Command::new("python3").args(["-m", "venv"]).arg(dir),
            "python3 -m venv",
        );
        run(
            Command::new(&python).args(PIP_INSTALL).args(packages),
            &format!("pip install {}", packages.join(" ")),
        );
        std::fs::write(&ready, b"ok")
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", ready.display()));
    }
    python
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_ports_are_read_from_the_end() {
        assert_eq!(endpoint_port("tcp://127.0.0.1:5557"), 5557);
        assert_eq!(endpoint_port("tcp://[::1]:40000"), 40000);
    }

    #[test]
    fn free_ports_bind() {
        let port = free_port();
        assert!(std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn polls_stop_at_the_condition_or_the_limit() {
        let mut calls = 0;
        assert!(poll_until(Duration::from_secs(5), || {
            calls += 1;
            calls == 3
        }));
        assert_eq!(calls, 3);
        let started = Instant::now();
        assert!(!poll_until(Duration::from_millis(50), || false));
        assert!(started.elapsed() >= Duration::from_millis(50));
    }

    #[test]
    #[should_panic(expected = "timed out after 10ms waiting for nothing")]
    fn waits_name_what_they_waited_for() {
        wait_until("nothing", Duration::from_millis(10), || false);
    }

    #[test]
    fn run_returns_the_output_and_reports_failures() {
        let out = run(Command::new("sh").args(["-c", "echo hi"]), "echo");
        assert_eq!(out.stdout, b"hi\n");
        let failed = std::panic::catch_unwind(|| {
            run(
                Command::new("sh").args(["-c", "echo oops >&2; exit 3"]),
                "failing",
            );
        });
        let message = failed
            .err()
            .and_then(|p| p.downcast::<String>().ok())
            .map(|s| *s)
            .unwrap_or_default();
        assert!(
            message.contains("failing failed") && message.contains("oops"),
            "{message}"
        );
    }
}
