//! `cargo xtask instructions`: instructions per `select_and_reserve` + `free` cycle through
//! the service core, counted by callgrind, over the matrix of the `service` bench (8, 64,
//! 128 and 512 workers; 256 and 4,096 tokens; 128 workers / 4,096 tokens in approximate
//! mode).
//!
//! Wall time on a shared two-core machine moves by tens of percent within an hour; an
//! instruction count moves only when the code does. A hot-path change is judged by both:
//! this count first, then criterion medians (docs/hot-path.md). Needs valgrind, which the
//! CI machine does not have, so this is a developer tool and not part of `ci`.
//!
//! `--ingest` counts the KV-event ingest path instead: instructions per block of `bench
//! ingest`'s default stream applied to a fresh partition without decoding or sockets
//! (`benches/benches/ingest_instructions.rs`), as the server holds it by default (index,
//! mirror and declared capacities) and in three lighter forms, so that a change to the
//! store path is judged by a count the host's drift does not move.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;

/// The configurations of the matrix: workers, tokens, approximate mode.
const MATRIX: [(u64, u64, bool); 9] = [
    (8, 256, false),
    (8, 4096, false),
    (64, 256, false),
    (64, 4096, false),
    (128, 256, false),
    (128, 4096, false),
    (512, 256, false),
    (512, 4096, false),
    (128, 4096, true),
];

/// The bench function whose inclusive cost is counted (`benches/benches/instructions.rs`).
const MEASURED: &str = "instructions::measured_calls";

/// The ingest bench's measured function (`benches/benches/ingest_instructions.rs`).
const MEASURED_INGEST: &str = "ingest_instructions::measured_stream";

/// What `--ingest` applies the stream to (the bench's `--cell` names).
const INGEST_CELLS: [&str; 4] = ["two-copies-capacity", "two-copies", "one-copy", "index"];

#[derive(Parser, Debug)]
#[command(
    name = "cargo xtask instructions",
    about = "Instructions per select_and_reserve + free cycle, counted by callgrind"
)]
struct Args {
    /// Cycles counted per configuration (after as many warm-up cycles).
    #[arg(long, default_value_t = 200)]
    calls: u64,
    /// Only these configurations, as WORKERS/TOKENS (e.g. 128/4096), or
    /// WORKERS/TOKENS/approximate; repeatable.
    #[arg(long)]
    only: Vec<String>,
    /// Also simulate the caches and report L1 instruction and data misses per cycle (or
    /// per block with `--ingest`; about twice as slow).
    #[arg(long)]
    cache_sim: bool,
    /// Count the KV-event ingest path (instructions per applied block of `bench ingest`'s
    /// default stream) instead of the selection matrix.
    #[arg(long, conflicts_with = "only")]
    ingest: bool,
}

/// Entry point of `cargo xtask instructions ARGS`.
#[expect(
    clippy::print_stdout,
    reason = "the table is the task's output; progress goes to stderr"
)]
pub(crate) fn main(args: &[String]) -> Result<()> {
    let Some(args) = crate::parse_task_args::<Args>("cargo xtask instructions", args)? else {
        return Ok(());
    };
    ensure!(args.calls > 0, "--calls must be at least 1");
    let configs = selected(&args.only)?;
    check_valgrind()?;
    let out_dir = crate::root().join("target/instructions");
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("failed to create {}", out_dir.display()))?;
    if args.ingest {
        return ingest(
            &build_bench("ingest_instructions")?,
            &out_dir,
            args.cache_sim,
        );
    }
    let binary = build_bench("instructions")?;

    println!(
        "| workers | tokens | mode | instructions per cycle |{}",
        if args.cache_sim {
            " I1 misses | D1 misses |"
        } else {
            ""
        }
    );
    println!(
        "|---:|---:|---|---:|{}",
        if args.cache_sim { "---:|---:|" } else { "" }
    );
    for (workers, tokens, approximate) in configs {
        let counts = count(&binary, &out_dir, &args, workers, tokens, approximate)?;
        let per_call = |i: usize| counts.get(i).map_or(0.0, |&n| n as f64 / args.calls as f64);
        let mode = if approximate {
            "approximate"
        } else {
            "event-driven"
        };
        let misses = if args.cache_sim {
            // Callgrind's event order with the cache simulator: Ir Dr Dw I1mr D1mr D1mw ...
            format!(" {:.0} | {:.0} |", per_call(3), per_call(4) + per_call(5))
        } else {
            String::new()
        };
        println!(
            "| {workers} | {tokens} | {mode} | {:.0} |{misses}",
            per_call(0)
        );
    }
    Ok(())
}

/// The configurations `--only` names (all of them without it).
fn selected(only: &[String]) -> Result<Vec<(u64, u64, bool)>> {
    if only.is_empty() {
        return Ok(MATRIX.to_vec());
    }
    only.iter()
        .map(|spec| {
            let parts: Vec<&str> = spec.split('/').collect();
            let parsed = match parts.as_slice() {
                [w, t] => Some((w.parse().ok(), t.parse().ok(), false)),
                [w, t, "approximate"] => Some((w.parse().ok(), t.parse().ok(), true)),
                _ => None,
            };
            match parsed {
                Some((Some(w), Some(t), a)) if w > 0 => Ok((w, t, a)),
                _ => bail!(
                    "--only {spec:?}: expected WORKERS/TOKENS or WORKERS/TOKENS/approximate, \
                     with at least one worker"
                ),
            }
        })
        .collect()
}

fn check_valgrind() -> Result<()> {
    match Command::new("valgrind").arg("--version").output() {
        Ok(out) if out.status.success() => Ok(()),
        _ => bail!(
            "valgrind is not installed or does not run (`valgrind --version` failed); \
             install it (Debian/Ubuntu: apt install valgrind) to count instructions"
        ),
    }
}

/// Builds the bench target `name` in the bench profile and returns its executable.
fn build_bench(name: &str) -> Result<PathBuf> {
    let cargo_args = [
        "bench",
        "-p",
        "benches",
        "--bench",
        name,
        "--no-run",
        "--message-format=json-render-diagnostics",
    ];
    eprintln!("xtask: cargo {}", cargo_args.join(" "));
    let out = Command::new("cargo")
        .args(cargo_args)
        .current_dir(crate::root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("failed to start cargo")?;
    ensure!(
        out.status.success(),
        "building the {name} bench failed ({})",
        out.status
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|msg| msg["reason"] == "compiler-artifact" && msg["target"]["name"] == name)
        .find_map(|msg| msg["executable"].as_str().map(PathBuf::from))
        .with_context(|| format!("cargo reported no executable for the {name} bench"))
}

/// `--ingest`: one callgrind run of the ingest bench per cell, a table of counts per block.
#[expect(
    clippy::print_stdout,
    reason = "the table is the task's output; progress goes to stderr"
)]
fn ingest(binary: &Path, out_dir: &Path, cache_sim: bool) -> Result<()> {
    println!(
        "| applied to | instructions per block |{}",
        if cache_sim {
            " D1 misses per block | LL misses per block |"
        } else {
            ""
        }
    );
    println!("|---|---:|{}", if cache_sim { "---:|---:|" } else { "" });
    for cell in INGEST_CELLS {
        let out_file = out_dir.join(format!("callgrind.ingest.{cell}.out"));
        let mut cmd = callgrind(MEASURED_INGEST, &out_file);
        if cache_sim {
            // The LL size of the machines this project is measured on (32 MiB); callgrind
            // otherwise takes it from the host, which a VM may misreport.
            cmd.args(["--cache-sim=yes", "--LL=33554432,16,64"]);
        }
        cmd.arg(binary).args(["--cell", cell]);
        eprintln!("xtask: callgrind, ingest stream into {cell}");
        let (counts, stdout) = run_collected(cmd, MEASURED_INGEST)?;
        let blocks = applied_blocks(&stdout)
            .with_context(|| format!("the ingest bench printed no block count:\n{stdout}"))?;
        let per_block = |i: usize| counts.get(i).map_or(0.0, |&n| n as f64 / blocks as f64);
        let misses = if cache_sim {
            // Callgrind's events with the cache simulator: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr
            // DLmw.
            format!(
                " {:.1} | {:.1} |",
                per_block(4) + per_block(5),
                per_block(7) + per_block(8)
            )
        } else {
            String::new()
        };
        println!("| {cell} | {:.0} |{misses}", per_block(0));
    }
    Ok(())
}

/// Runs one configuration under callgrind; returns the events it collected inside the
/// measured function (instructions first).
fn count(
    binary: &Path,
    out_dir: &Path,
    args: &Args,
    workers: u64,
    tokens: u64,
    approximate: bool,
) -> Result<Vec<u64>> {
    let suffix = if approximate { ".approximate" } else { "" };
    let out_file = out_dir.join(format!("callgrind.{workers}.{tokens}{suffix}.out"));
    let mut cmd = callgrind(MEASURED, &out_file);
    if args.cache_sim {
        cmd.arg("--cache-sim=yes");
    }
    cmd.arg(binary)
        .args(["--workers", &workers.to_string()])
        .args(["--tokens", &tokens.to_string()])
        .args(["--calls", &args.calls.to_string()]);
    if approximate {
        cmd.arg("--approximate");
    }
    eprintln!("xtask: callgrind, {workers} workers, {tokens} tokens{suffix}");
    Ok(run_collected(cmd, MEASURED)?.0)
}

/// The block count of the ingest bench's line (`... (wall, N blocks) ...`).
fn applied_blocks(stdout: &str) -> Option<u64> {
    let (_, rest) = stdout.split_once("(wall, ")?;
    let (n, _) = rest.split_once(" blocks)")?;
    n.parse().ok().filter(|&n| n > 0)
}

/// A callgrind command that collects only inside the function `measured` and writes its
/// profile to `out_file`; the caller adds options, the program and its arguments.
fn callgrind(measured: &str, out_file: &Path) -> Command {
    let mut cmd = Command::new("valgrind");
    cmd.arg("--tool=callgrind")
        .arg(format!("--toggle-collect={measured}"))
        .arg(format!("--callgrind-out-file={}", out_file.display()));
    cmd
}

/// Runs `cmd` (a callgrind run collecting inside `measured`); returns the events of its
/// `Collected` line (instructions first) and what the bench printed.
fn run_collected(mut cmd: Command, measured: &str) -> Result<(Vec<u64>, String)> {
    let out = cmd.output().context("failed to start valgrind")?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.success(),
        "the bench failed under callgrind ({}):\n{stderr}",
        out.status
    );
    let counts = collected(&stderr).with_context(|| {
        format!("callgrind printed no `Collected` line for {measured}:\n{stderr}")
    })?;
    Ok((counts, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The event counts of callgrind's `==pid== Collected : n n n` summary line.
fn collected(stderr: &str) -> Option<Vec<u64>> {
    let line = stderr.lines().find(|l| l.contains("Collected :"))?;
    let (_, counts) = line.split_once("Collected :")?;
    let counts: Vec<u64> = counts
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    (!counts.is_empty()).then_some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_collected_line() {
        let stderr = "==12== Events    : Ir\n==12== Collected : 55410181 14867962 3648420\n\
                      ==12== I   refs:      55,410,181\n";
        assert_eq!(
            collected(stderr),
            Some(vec![55_410_181, 14_867_962, 3_648_420])
        );
        assert_eq!(collected("==12== I   refs: 5\n"), None);
        assert_eq!(collected("==12== Collected : lots\n"), None);
    }

    #[test]
    fn reads_the_ingest_bench_block_count() {
        let line = "TwoCopiesCapacity: 0.412 µs per block (wall, 4001792 blocks), 4002304 nodes\n";
        assert_eq!(applied_blocks(line), Some(4_001_792));
        assert_eq!(applied_blocks("(wall, 0 blocks)"), None);
        assert_eq!(applied_blocks("0.4 µs per block"), None);
    }

    #[test]
    fn only_selects_and_rejects_configurations() {
        assert_eq!(selected(&[]).map(|c| c.len()).ok(), Some(MATRIX.len()));
        assert_eq!(
            selected(&["128/4096".into(), "128/4096/approximate".into()]).ok(),
            Some(vec![(128, 4096, false), (128, 4096, true)])
        );
        for bad in ["128", "0/256", "8/x", "8/256/exact"] {
            assert!(selected(&[bad.into()]).is_err(), "{bad}");
        }
    }
}
