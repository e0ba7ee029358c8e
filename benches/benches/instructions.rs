//! `select_and_reserve` + `free` cycles in one configuration, for counting instructions
//! under callgrind (`cargo xtask instructions` runs it over the whole matrix): wall time
//! on a shared machine moves by tens of percent within an hour, an instruction count does
//! not, so a change to the hot path is judged by both.
//!
//! Arguments: `--workers N` (128), `--tokens N` (4096), `--calls N` (2000),
//! `--approximate`. It warms up with as many cycles, then runs `calls` cycles inside
//! [`measured_calls`], the one function `--toggle-collect` names, and prints the wall time
//! per call. Under `cargo bench` (which passes `--bench`) it runs the defaults.
//!
//! It also prints a speed probe: the median time to hash a 4,096-token prompt already in
//! cache. The shared VMs this project is measured on switch between two speeds for
//! minutes at a time (on the 2026-11-30 machine the probe read 1.40 µs or 2.0 µs, and a
//! 128-worker / 4,096-token cycle took 3.75 µs or 6.5 µs accordingly); the probe says which
//! one a wall time was taken in.

use std::time::Instant;

use benches::service_fixture::{core_with, reserve_and_free, reserve_request};
use service_builder::{SelectRequest, SelectionCore};

struct Args {
    workers: u64,
    tokens: usize,
    calls: usize,
    approximate: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        workers: 128,
        tokens: 4096,
        calls: 2000,
        approximate: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| format!("{name} takes a non-negative integer"))
        };
        match flag.as_str() {
            "--workers" => args.workers = value("--workers")?,
            "--tokens" => args.tokens = value("--tokens")? as usize,
            "--calls" => args.calls = value("--calls")? as usize,
            "--approximate" => args.approximate = true,
            // cargo bench's own flag, and criterion-style filters it may forward.
            "--bench" => {}
            other if !other.starts_with("--") => {}
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.workers == 0 || args.calls == 0 {
        return Err("--workers and --calls must be at least 1".into());
    }
    Ok(args)
}

/// The measured cycles: the requests were cloned beforehand, so only the cycles (each
/// dropping its request and response) run in here. Returns the last chosen worker.
#[inline(never)]
fn measured_calls(core: &SelectionCore, requests: Vec<SelectRequest>) -> Option<u64> {
    requests
        .into_iter()
        .map(|req| reserve_and_free(core, req))
        .last()
}

/// Median µs to hash (block hashes and chain) a 4,096-token prompt that is already in cache.
fn speed_probe() -> f64 {
    let tokens = benches::service_fixture::prompt(0, 4096);
    let (mut blocks, mut seqs) = (Vec::new(), Vec::new());
    let mut times: Vec<f64> = (0..301)
        .map(|_| {
            let started = Instant::now();
            kv_types::prompt_hashes_into(
                std::hint::black_box(&tokens),
                benches::service_fixture::BLOCK,
                &kv_types::HashOptions::default(),
                &mut blocks,
                &mut seqs,
            );
            started.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

#[expect(clippy::print_stdout, reason = "the timing line is the bench's output")]
fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("instructions: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let core = core_with(args.workers, !args.approximate);
    let request = reserve_request(args.workers, args.tokens);
    for _ in 0..args.calls {
        reserve_and_free(&core, request.clone());
    }
    let probe_before = speed_probe();
    let requests = vec![request; args.calls];
    let started = Instant::now();
    let chosen = measured_calls(&core, requests);
    let per_call_us = started.elapsed().as_secs_f64() * 1e6 / args.calls as f64;
    let probe_after = speed_probe();
    println!(
        "{} workers, {} tokens{}: {per_call_us:.2} µs per call (wall, {} calls), worker {} \
         chosen; speed probe {probe_before:.2} µs before, {probe_after:.2} µs after",
        args.workers,
        args.tokens,
        if args.approximate {
            ", approximate"
        } else {
            ""
        },
        args.calls,
        chosen.unwrap_or_default(),
    );
    std::process::ExitCode::SUCCESS
}
