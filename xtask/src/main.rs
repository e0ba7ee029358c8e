//! `cargo xtask`: the one entry point for developer automation.
//!
//! - `ci`: everything CI checks, in order: fmt, clippy (`-D warnings`), tests, then docs
//!   beside the ingest bench's smoke test, the Python client and the Ray example against
//!   the debug server (`python.rs`).
//! - `python`: only those Python checks (the debug server must be built).
//! - `bench [ARGS]`: `cargo bench -p benches` with the given arguments.
//! - `bench http [--seconds N] [--connections a,b]`: load test of `POST /select` against the
//!   release server on loopback (docs/hot-path.md).
//! - `bench ingest [--workers N] [--batches N] [...]`: KV events streamed from N ZMQ
//!   publishers (a separate process) into the release server: applied blocks/s, server CPU
//!   per million blocks, `/select` latency during the stream, fleet figures; every batch is
//!   checked as applied. `--baseline BIN` / `--baseline-arg=...` alternate it with another
//!   build or setting (ABBA) and print both medians and their ratios; `--retain-events R`
//!   / `--capacity-blocks K` hold the index at a steady size; a stall probe of the machine
//!   precedes each run. `ci` runs small configurations against the debug server.
//! - `instructions [--only W/N] [--cache-sim]`: instructions per `select_and_reserve` +
//!   `free` cycle counted by callgrind, over the service bench's matrix (needs valgrind;
//!   docs/hot-path.md).
//! - `flood [pending|reservations|workers|events]...`: floods the release server and checks
//!   that its memory stays bounded, printing peak RSS per scenario (docs/operations.md).
//! - `loom`: the loom models of the index, ledger and admission protocols, with `--cfg loom`
//!   in `target/loom` (docs/architecture.md, "Concurrency checking").
//! - `replay --trace PATH [...]`: trace-driven routing-quality simulation of the selection
//!   policies (docs/routing-quality.md).
//!
//! Tidy checks (crate docs, layering, no `anyhow` in libraries, no environment reads in
//! libraries) are `#[test]`s in `tidy.rs`, so `cargo test` runs them.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

mod bench_http;
mod bench_ingest;
mod bench_wrk;
mod flood;
mod index_floor;
mod ingest_ceiling;
mod ingest_workload;
mod instructions;
mod loom;
mod page_probe;
mod python;
mod replay;
mod stall_probe;
#[cfg(test)]
mod tidy;

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "ci" => ci(),
        "python" => python::ci(&root()),
        "bench" if rest.first().map(String::as_str) == Some("http") => bench_http::main(&rest[1..]),
        "bench" if rest.first().map(String::as_str) == Some("ingest") => {
            bench_ingest::main(&rest[1..])
        }
        "bench" => {
            let mut a = vec!["bench", "-p", "benches"];
            a.extend(rest.iter().map(String::as_str));
            cargo(&a, &[])
        }
        "flood" => flood::main(&rest),
        "instructions" => instructions::main(&rest),
        "loom" => loom::main(&rest),
        "replay" => replay::main(&rest),
        "" | "help" | "-h" | "--help" => {
            eprintln!(
                "usage: cargo xtask <ci | python | bench [criterion args] | bench http --help | bench ingest --help | instructions --help | flood --help | loom | replay --help>"
            );
            Ok(())
        }
        other => {
            bail!(
                "unknown task {other:?}; expected ci, python, bench, instructions, flood, loom or replay"
            )
        }
    }
}

/// Incremental compilation off for the checks: CI builds once, from a clean clone, so the
/// incremental caches only took disk there (0.9 GiB of a 2.1 GiB `target/`, and a CI
/// machine ran out of space). Locally a change costs a full rebuild of the crates it touches.
const NOT_INCREMENTAL: (&str, &str) = ("CARGO_INCREMENTAL", "0");

/// Tests per test binary at once: most of the integration tests wait on sockets, child
/// processes and timeouts rather than compute, so on a 2-core machine the default of one
/// test per core leaves the cores idle, and the binaries run one after another.
const TEST_THREADS: (&str, &str) = ("RUST_TEST_THREADS", "6");

fn ci() -> Result<()> {
    let started = std::time::Instant::now();
    // The Python checks' venv is made while cargo builds: it needs no build output, and
    // pip's downloads and unpacking would otherwise add their time to the run's.
    let venv = std::thread::spawn(|| python::ci_venv(&root()));
    cargo(&["fmt", "--all", "--check"], &[])?;
    cargo(
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ],
        &[NOT_INCREMENTAL],
    )?;
    cargo(
        &["test", "--workspace", "--locked"],
        &[NOT_INCREMENTAL, TEST_THREADS],
    )?;
    // The docs build beside the checks below: those run the debug select-server that
    // `cargo test --workspace` built, take no cargo lock, and mostly wait on processes, so
    // rustdoc uses cores they leave idle.
    let doc = std::thread::spawn(|| {
        cargo(
            &["doc", "--workspace", "--no-deps", "--locked"],
            &[("RUSTDOCFLAGS", "-D warnings"), NOT_INCREMENTAL],
        )
    });
    let checks = bench_ingest::smoke(&root()).and_then(|()| {
        let python = venv
            .join()
            .map_err(|_| anyhow::anyhow!("making the Python venv panicked"))??;
        python::checks(&root(), &python)
    });
    let doc = doc
        .join()
        .map_err(|_| anyhow::anyhow!("the docs build panicked"))?;
    checks?;
    doc?;
    eprintln!("xtask ci: all checks passed in {:.0?}", started.elapsed());
    Ok(())
}

fn cargo(args: &[&str], envs: &[(&str, &str)]) -> Result<()> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = Command::new("cargo")
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(root())
        .status()
        .with_context(|| format!("failed to start cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Parses a task's arguments (`name` is how its usage names it). `None` once clap has
/// printed the help or version a user asked for: that is the task's whole output, not an
/// error.
fn parse_task_args<A: clap::Parser>(name: &str, args: &[String]) -> Result<Option<A>> {
    match A::try_parse_from(std::iter::once(name).chain(args.iter().map(String::as_str))) {
        Ok(parsed) => Ok(Some(parsed)),
        Err(e) if !e.use_stderr() => {
            e.print().context("printing help")?;
            Ok(None)
        }
        Err(e) => bail!("{e}"),
    }
}

/// The workspace root (xtask lives one level below it).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[derive(clap::Parser, Debug)]
    struct Demo {
        #[arg(long, default_value_t = 1)]
        n: u32,
    }

    fn parse(args: &[&str]) -> anyhow::Result<Option<Demo>> {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        super::parse_task_args::<Demo>("demo", &args)
    }

    #[test]
    fn help_is_output_and_bad_arguments_are_errors() {
        assert_eq!(parse(&["--n", "3"]).ok().flatten().map(|d| d.n), Some(3));
        assert_eq!(parse(&[]).ok().flatten().map(|d| d.n), Some(1));
        assert!(matches!(parse(&["--help"]), Ok(None)));
        let err = parse(&["--n", "x"]).err().map(|e| e.to_string());
        assert!(
            err.is_some_and(|e| e.contains("--n")),
            "the error names the argument"
        );
        assert!(parse(&["--nope"]).is_err());
    }
}
