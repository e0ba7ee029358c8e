//! `cargo xtask bench ingest`: end-to-end KV-event ingestion against the release server
//! (docs/hot-path.md, "KV-event ingestion").
//!
//! Starts the server on a free loopback port, starts the publisher in a separate process
//! (this xtask re-invoked with `--publish`, so its CPU is not the server's; see
//! `ingest_workload.rs` for the workload), registers one worker per publisher stream, waits
//! until every listener has applied seq 0, then streams everything and polls `/metrics`
//! until every listener has applied every batch. Meanwhile one HTTP connection sends
//! `/select` at a fixed interval, its latencies taken only during the stream.
//!
//! It reports applied blocks/s (from the `go` to the poll that sees the last batch applied;
//! polls close in on the projected end, so that time is within a fiftieth of the poll
//! interval: 1 ms up to 64 workers, 5 ms above), server CPU seconds per million blocks
//! (`/proc/<pid>/stat` over the same span), the index writer thread's CPU per block, the
//! `/select` percentiles, the fleet's registration time and the server's threads,
//! descriptors and resident memory. It fails unless every listener applied every batch
//! with nothing lost or dropped, the index holds exactly the expected blocks and
//! memberships, and probes of sampled workers' chains through `/overlap_scores` find them
//! whole.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use clap::Parser;
use http::{Method, StatusCode};
use serde_json::json;

use crate::bench_http::{
    PerfRecorder, ServerProcess, ThreadTimes, call, connect, schedstat_field, send,
    thread_cpu_times,
};
use crate::bench_wrk::median;
use crate::flood::{gauge, metrics, proc_status, register_with_capacity};
use crate::ingest_workload::{
    BLOCK_SIZE, PREFIX_BLOCKS, Parent, Publisher, SHARED_PREFIXES, Workload, prefix_tokens,
};

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask bench ingest",
    about = "Stream KV events from N publishers into the release select-server"
)]
struct Args {
    /// Workers, one ZMQ publisher (one DP rank) each.
    #[arg(long, default_value_t = 16)]
    workers: u64,
    /// Batches per worker (after the batch of shared prefixes).
    #[arg(long, default_value_t = 977)]
    batches: u64,
    /// `BlockStored` events per batch.
    #[arg(long, default_value_t = 32)]
    events: u64,
    /// Blocks per event.
    #[arg(long, default_value_t = 8)]
    blocks: u64,
    /// Fraction of the events whose chain hangs below a prefix every worker holds.
    #[arg(long, default_value_t = 1.0 / 3.0)]
    shared: f64,
    /// Blocks each worker declares it holds (`total_kv_blocks`). Below what it stores, the
    /// index evicts its oldest blocks as new ones come, so the stream runs at a steady
    /// index size (engines that are full) instead of growing it [default: 1000000, four
    /// times what the default workload stores per worker].
    #[arg(long, value_name = "BLOCKS")]
    capacity_blocks: Option<u64>,
    /// Workload events each worker keeps: the batch that stores an event also removes the
    /// one this many events older (`BlockRemoved`), as engines that evict their oldest
    /// blocks report them, so the index runs at a steady size through removal events.
    #[arg(long, value_name = "EVENTS")]
    retain_events: Option<u64>,
    /// Microseconds between two `/select` requests during the stream.
    #[arg(long, default_value_t = 1000)]
    select_interval_us: u64,
    /// Runs, each with a fresh server and publisher; the table ends with the medians.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Use this server binary instead of building target/release/select-server.
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// A flag for the server, as one argument (repeatable): `--server-arg=--kv-listener-threads=1`.
    #[arg(long = "server-arg", value_name = "ARG", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Record a `perf record -g` profile of the server during the last round's stream.
    #[arg(long, value_name = "PATH")]
    perf: Option<PathBuf>,
    /// Seconds `--perf` records (from the start of the stream).
    #[arg(long, default_value_t = 2)]
    perf_seconds: u64,
    /// Compare with this server binary: each round runs it (the baseline) and the build
    /// under test, in alternating order (ABBA), and the table ends with each one's
    /// medians and their ratios, all from the same window.
    #[arg(long, value_name = "PATH")]
    baseline: Option<PathBuf>,
    /// A flag for the baseline's server instead of the `--server-arg` flags (repeatable);
    /// without `--baseline`, compares two settings of one binary.
    #[arg(long = "baseline-arg", value_name = "ARG", allow_hyphen_values = true)]
    baseline_args: Vec<String>,
    /// Milliseconds of the stall probe before every run (0: none): one thread per core
    /// spins reading the clock and counts the gaps over 50 µs, with nothing else of ours
    /// running, so each run's lookup waits can be read against the machine's own stalls.
    #[arg(long, default_value_t = 300)]
    stall_probe_ms: u64,
    /// MiB of fresh memory the page probe writes a byte per page of before every run (0:
    /// none): the machine's price of a fresh page just then, which a growing index pays
    /// for every page it grows by, and which moves between minutes on a virtual machine.
    #[arg(long, default_value_t = 64)]
    page_probe_mib: usize,
    /// Skip the null sink: by default every round first streams the workload to ZMQ
    /// subscribers that only count (`ingest_ceiling.rs`), and each rate is also given over
    /// that ceiling of the same round, which compares across windows and machines.
    #[arg(long)]
    no_ceiling: bool,
    /// Skip the index floor: by default every round also applies the same stream in this
    /// process to a partition as the server keeps it, on one thread (`index_floor.rs`),
    /// and each rate is also given over that floor: the most the server's one index
    /// writer could apply on this host in the same minutes.
    #[arg(long)]
    no_index_floor: bool,
    /// Run from this (debug) build of the xtask instead of rerunning it as a release build.
    #[arg(long)]
    debug_client: bool,
    /// Internal: be the publisher process.
    #[arg(long, hide = true)]
    publish: bool,
    /// Internal: be the index floor's process (`index_floor.rs`).
    #[arg(long, hide = true)]
    index_floor_child: bool,
}

impl Args {
    fn workload(&self) -> Workload {
        Workload {
            workers: self.workers,
            batches: self.batches,
            events: self.events,
            blocks: self.blocks,
            shared: self.shared,
            capacity: self.capacity_blocks,
            retain: self.retain_events,
        }
    }
}

/// Entry point of `cargo xtask bench ingest ARGS`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let args_as_given = args;
    let Some(args) = crate::parse_task_args::<Args>("cargo xtask bench ingest", args)? else {
        return Ok(());
    };
    let workload = args.workload();
    if args.publish {
        return crate::ingest_workload::publish(&workload);
    }
    if args.index_floor_child {
        return crate::index_floor::child_main(&workload);
    }
    workload.validate()?;
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    if cfg!(debug_assertions) && !args.debug_client {
        // A debug publisher and poller take CPU from the server on two shared cores.
        let mut rerun = vec!["run", "--release", "-p", "xtask", "--", "bench", "ingest"];
        rerun.extend(args_as_given.iter().map(String::as_str));
        return crate::cargo(&rerun, &[]);
    }
    let binary = match &args.binary {
        Some(path) => path.clone(),
        None => {
            crate::cargo(&["build", "--release", "-p", "select-server"], &[])?;
            crate::root().join("target/release/select-server")
        }
    };
    let (test, baseline) = builds(&args, binary);
    // A copied binary is easily an old one: say which builds run, and how old they are.
    for build in std::iter::once(&test).chain(baseline.as_ref()) {
        eprintln!(
            "xtask bench ingest: {}: {}, {}",
            build.label,
            build.binary.display(),
            binary_age(&build.binary)
        );
    }
    let ceiling = !args.no_ceiling;
    let mut runs: Vec<(&'static str, Run)> = Vec::with_capacity(args.rounds * 2);
    for round in 0..args.rounds {
        let last_round = round + 1 == args.rounds;
        let ceiling_rate = ceiling
            .then(|| {
                reference_rate(
                    &workload,
                    round,
                    "null sink",
                    crate::ingest_ceiling::null_sink,
                )
            })
            .transpose()?;
        let floor_rate = (!args.no_index_floor)
            .then(|| reference_rate(&workload, round, "index floor", crate::index_floor::measure))
            .transpose()?;
        for build in round_order(round, &test, baseline.as_ref()) {
            let stalls = (args.stall_probe_ms > 0)
                .then(|| crate::stall_probe::probe(Duration::from_millis(args.stall_probe_ms)));
            let page_us = crate::page_probe::probe(args.page_probe_mib);
            // The profile is of the build under test.
            let perf = args
                .perf
                .as_deref()
                .filter(|_| last_round && build.label == "test");
            let mut run = run_once(
                &workload,
                &build.binary,
                &build.server_args,
                args.select_interval_us,
                perf,
                args.perf_seconds,
            )?;
            run.stalls = stalls;
            run.page_us = page_us;
            run.ceiling = ceiling_rate;
            run.floor = floor_rate;
            eprintln!(
                "xtask bench ingest: round {} ({}): {}",
                round + 1,
                build.label,
                run.summary()
            );
            runs.push((build.label, run));
        }
    }
    print_table(&workload, &runs, baseline.is_some());
    Ok(())
}

/// Blocks/s of one of a round's references (`measure` returns how long the stream took),
/// reported as it is measured.
fn reference_rate(
    w: &Workload,
    round: usize,
    name: &str,
    measure: fn(&Workload) -> Result<Duration>,
) -> Result<f64> {
    let took = measure(w)?;
    let rate = w.stream_blocks() as f64 / took.as_secs_f64();
    eprintln!(
        "xtask bench ingest: round {} ({name}): {:.2} M blocks/s",
        round + 1,
        rate / 1e6
    );
    Ok(rate)
}

/// How long ago `binary` was written, for the run's header.
fn binary_age(binary: &Path) -> String {
    match std::fs::metadata(binary).and_then(|m| m.modified()) {
        Ok(written) => match written.elapsed() {
            Ok(age) => format!("built {} min ago", age.as_secs() / 60),
            Err(_) => "built in the future (clock skew)".to_owned(),
        },
        Err(e) => format!("unreadable: {e}"),
    }
}

/// A server binary and its flags: the build under test, or the baseline it is compared with.
#[derive(Debug, PartialEq)]
struct Build {
    label: &'static str,
    binary: PathBuf,
    server_args: Vec<String>,
}

/// The build under test (`binary` with `--server-arg`) and, with `--baseline` or
/// `--baseline-arg`, the baseline: its binary defaults to the same one, its flags to the
/// same flags.
fn builds(args: &Args, binary: PathBuf) -> (Build, Option<Build>) {
    let baseline = (args.baseline.is_some() || !args.baseline_args.is_empty()).then(|| Build {
        label: "base",
        binary: args.baseline.clone().unwrap_or_else(|| binary.clone()),
        server_args: if args.baseline_args.is_empty() {
            args.server_args.clone()
        } else {
            args.baseline_args.clone()
        },
    });
    let test = Build {
        label: "test",
        binary,
        server_args: args.server_args.clone(),
    };
    (test, baseline)
}

/// The runs of one round: ABBA order, so a drift over the rounds weighs on both builds alike.
fn round_order<'a>(round: usize, test: &'a Build, base: Option<&'a Build>) -> Vec<&'a Build> {
    match base {
        Some(base) if round.is_multiple_of(2) => vec![base, test],
        Some(base) => vec![test, base],
        None => vec![test],
    }
}

/// The small configuration `cargo xtask ci` runs against the debug server: correctness
/// only (every batch applied, the index exact, the probes whole), no timing asserted.
pub(crate) fn smoke(root: &Path) -> Result<()> {
    let workload = Workload {
        workers: 3,
        batches: 12,
        events: 8,
        blocks: 4,
        shared: 1.0 / 3.0,
        capacity: None,
        retain: None,
    };
    let binary = root.join("target/debug/select-server");
    ensure!(
        binary.exists(),
        "{} is missing (cargo test --workspace builds it)",
        binary.display()
    );
    // Growing the index; at its capacity (each worker stores 416 blocks and holds 160,
    // the prefixes and four batches, so the index evicts 256 per worker); at a steady
    // size through removals (each worker keeps its last 16 of 96 events): with the
    // default two copies and writer thread, with one copy written by the listeners, and
    // at the capacity with two copies written by the listeners, whose evictions must match.
    let one_copy = ["--kv-index-copies=1".to_owned()];
    let listeners_write = ["--kv-index-writer=listeners".to_owned()];
    for (capacity, retain, args) in [
        (None, None, &[][..]),
        (Some(160), None, &[][..]),
        (None, Some(16), &[][..]),
        (None, None, &one_copy[..]),
        (Some(160), None, &one_copy[..]),
        (None, Some(16), &one_copy[..]),
        (Some(160), None, &listeners_write[..]),
    ] {
        let workload = Workload {
            capacity,
            retain,
            ..workload
        };
        workload.validate()?;
        let started = Instant::now();
        let run = run_once(&workload, &binary, args, 5_000, None, 0)?;
        eprintln!(
            "xtask: bench ingest smoke test (capacity {}, {} removals, {}) passed in {:.1?} ({})",
            workload.declared_capacity(),
            workload.removed_events(),
            if args.is_empty() {
                "defaults".to_owned()
            } else {
                args.join(" ")
            },
            started.elapsed(),
            run.summary()
        );
    }
    // The null sink receives every batch of a stream, and the index floor applies it
    // whole (their rates are not looked at).
    let started = Instant::now();
    crate::ingest_ceiling::null_sink(&workload)?;
    crate::index_floor::measure(&workload)?;
    eprintln!(
        "xtask: bench ingest smoke test (null sink, index floor) passed in {:.1?}",
        started.elapsed()
    );
    Ok(())
}

/// Figures of one round.
#[derive(Debug, Clone)]
struct Run {
    blocks: u64,
    /// From `go` to the poll that saw every batch applied.
    applied_in: Duration,
    /// The publisher's own time to send everything.
    published_in: Duration,
    server_cpu: Option<Duration>,
    /// The server's minor page faults over the same span.
    server_faults: Option<u64>,
    /// The server's busiest threads over the same span, by name (threads of one name
    /// summed): which one limits the rate, and whether it waited for a core.
    busiest: Vec<BusyThread>,
    /// `/select` latencies during the stream.
    selects: Selects,
    registration: Duration,
    threads: u64,
    descriptors: u64,
    rss_kib: u64,
    hwm_kib: u64,
    /// Lookups that found the index held by a writer, those that waited over 50 µs, and
    /// the longest wait (the server's `kv_select_index_lookup_*` metrics after the stream).
    lookup_waits: u64,
    lookup_waits_over_50us: u64,
    /// Of those, the waits a writer let in more than 50 µs after they began (the rest
    /// waited for a core after it let them in).
    lookup_waits_behind_writer: u64,
    lookup_wait_max: Duration,
    /// Times a listener ended a write section early to yield its core.
    step_asides: u64,
    /// With two index copies (`--kv-index-copies 2`): writes that waited over 50 µs for
    /// lookups to leave a copy (lookups do not wait for writers then, except the rare
    /// fallback counted in `lookup_waits`).
    drains_over_50us: u64,
    /// The machine's own stalls, probed just before the run.
    stalls: Option<crate::stall_probe::Stalls>,
    /// Microseconds per fresh page of memory, probed just before the run (`page_probe.rs`).
    page_us: Option<f64>,
    /// Blocks/s of the round's null sink (`ingest_ceiling.rs`).
    ceiling: Option<f64>,
    /// Blocks/s of the round's index floor (`index_floor.rs`).
    floor: Option<f64>,
    /// The same selections as the service timed them (`kv_select_selection_duration_seconds`
    /// over the stream): from the request's arrival in the selection service to its answer,
    /// lock waits included, without the HTTP thread's or the client's waits for a core.
    in_service: Buckets,
}

/// Counts of a latency histogram per bucket, by upper bound in seconds (the last one
/// `+Inf`), not cumulative.
#[derive(Debug, Clone, Default, PartialEq)]
struct Buckets(Vec<(f64, u64)>);

impl Buckets {
    const SERIES: &str = "kv_select_selection_duration_seconds_bucket{le=\"";

    /// The selection-latency histogram of a scrape.
    fn scrape(text: &str) -> Self {
        let mut cumulative: Vec<(f64, u64)> = text
            .lines()
            .filter_map(|l| l.strip_prefix(Self::SERIES))
            .filter_map(|rest| {
                let (le, count) = rest.split_once("\"} ")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, count.trim().parse::<f64>().ok()? as u64))
            })
            .collect();
        cumulative.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut below = 0;
        Buckets(
            cumulative
                .into_iter()
                .map(|(le, n)| {
                    let own = n.saturating_sub(below);
                    below = below.max(n);
                    (le, own)
                })
                .collect(),
        )
    }

    /// What was counted between `before` and this scrape.
    fn since(&self, before: &Buckets) -> Buckets {
        Buckets(
            self.0
                .iter()
                .map(|&(le, n)| {
                    let was = before.0.iter().find(|b| b.0 == le).map_or(0, |b| b.1);
                    (le, n.saturating_sub(was))
                })
                .collect(),
        )
    }

    fn total(&self) -> u64 {
        self.0.iter().map(|b| b.1).sum()
    }

    /// Counted above `bound` seconds (`bound` must be a bucket bound).
    fn over(&self, bound: f64) -> u64 {
        self.0.iter().filter(|b| b.0 > bound).map(|b| b.1).sum()
    }

    /// The upper bound of the bucket holding the `p`-th percentile, in µs.
    fn percentile_bound_us(&self, p: f64) -> f64 {
        let rank = (self.total() as f64 * p / 100.0).ceil() as u64;
        let mut seen = 0;
        for &(le, n) in &self.0 {
            seen += n;
            if seen >= rank.max(1) {
                return le * 1e6;
            }
        }
        f64::NAN
    }
}

impl Run {
    fn rate(&self) -> f64 {
        self.blocks as f64 / self.applied_in.as_secs_f64()
    }

    /// The rate over the round's null sink; NaN without one.
    fn over_ceiling(&self) -> f64 {
        self.ceiling.map_or(f64::NAN, |c| self.rate() / c)
    }

    /// The rate over the round's index floor; NaN without one.
    fn over_floor(&self) -> f64 {
        self.floor.map_or(f64::NAN, |f| self.rate() / f)
    }

    fn cpu_per_million(&self) -> Option<f64> {
        self.server_cpu
            .map(|c| c.as_secs_f64() * 1e6 / self.blocks as f64)
    }

    /// The index writer thread's CPU per applied block, in µs; NaN without one (one copy).
    /// Its inverse is the rate the writer would apply on a whole core: the serial stage's
    /// own speed, apart from how much of a core it got.
    fn writer_us_per_block(&self) -> f64 {
        writer_us_per_block(&self.busiest, self.applied_in, self.blocks)
    }

    /// The server's minor page faults per thousand blocks.
    fn faults_per_thousand(&self) -> f64 {
        self.server_faults
            .map_or(f64::NAN, |f| f as f64 * 1e3 / self.blocks as f64)
    }

    fn percentile(&self, p: f64) -> Duration {
        percentile(&self.selects.observed, p)
    }

    /// The `p`-th percentile less the client's own waits for a core (NaN without them).
    fn percentile_less_client_waits_us(&self, p: f64) -> f64 {
        if self.selects.less_client_waits.is_empty() {
            return f64::NAN;
        }
        us(percentile(&self.selects.less_client_waits, p))
    }

    fn summary(&self) -> String {
        format!(
            "{:.2} M blocks/s{}, {} s CPU per M blocks{}, /select p50 {:.0} µs p99 {:.0} µs ({} requests){}{}",
            self.rate() / 1e6,
            match (self.ceiling, self.floor) {
                (None, None) => String::new(),
                (Some(_), None) => format!(" ({:.3} of the null sink)", self.over_ceiling()),
                (None, Some(_)) => format!(" ({:.3} of the index floor)", self.over_floor()),
                (Some(_), Some(_)) => format!(
                    " ({:.3} of the null sink, {:.3} of the index floor)",
                    self.over_ceiling(),
                    self.over_floor()
                ),
            },
            self.cpu_per_million()
                .map_or_else(|| "n/a".to_owned(), |c| format!("{c:.3}")),
            match self.writer_us_per_block() {
                w if w.is_nan() => String::new(),
                w => format!(
                    " (the writer thread {w:.3} µs per block: {:.2} M blocks/s on a whole core)",
                    1.0 / w
                ),
            },
            us(self.percentile(50.0)),
            us(self.percentile(99.0)),
            self.selects.observed.len(),
            self.page_us.map_or_else(String::new, |us| format!(
                "; fresh pages before the run: {us:.2} µs each"
            )),
            if self.busiest.is_empty() {
                String::new()
            } else {
                let threads: Vec<String> = self.busiest.iter().map(BusyThread::describe).collect();
                format!(
                    "; server threads in cores (waiting for one): {}",
                    threads.join(", ")
                )
            }
        )
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn run_once(
    w: &Workload,
    binary: &Path,
    server_args: &[String],
    select_interval_us: u64,
    perf: Option<&Path>,
    perf_seconds: u64,
) -> Result<Run> {
    let mut publisher = Publisher::start(w)?;
    // Each listener holds a few descriptors; the server raises its own soft limit.
    let server_args: Vec<&str> = server_args.iter().map(String::as_str).collect();
    let server = ServerProcess::start_with(binary, &server_args, &[])?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the client runtime")?;
    runtime.block_on(drive(
        w,
        &server,
        &mut publisher,
        select_interval_us,
        perf,
        perf_seconds,
    ))
}

/// `(worker_id, value)` of every series of `name` (e.g. `kv_select_kv_batches_applied_total`).
fn per_worker(text: &str, name: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|rest| {
            let id = rest
                .split("worker_id=\"")
                .nth(1)?
                .split('"')
                .next()?
                .parse()
                .ok()?;
            let v = rest.rsplit_once(' ')?.1.parse::<f64>().ok()?;
            Some((id, v as u64))
        })
        .collect()
}

/// The CPU a server thread (or the threads of one name) took over a run, in cores, and
/// how long it was runnable but waited for a core, in the same unit: a thread that limits
/// the rate and never waits is limited by its own work, one that waits by the machine.
#[derive(Clone, Debug, PartialEq)]
struct BusyThread {
    name: String,
    cores: f64,
    /// `None` where the kernel keeps no scheduler statistics.
    waiting: Option<f64>,
}

impl BusyThread {
    fn describe(&self) -> String {
        match self.waiting {
            Some(w) => format!("{} {:.2} ({w:.2})", self.name, self.cores),
            None => format!("{} {:.2}", self.name, self.cores),
        }
    }
}

/// Threads that took more than a twentieth of a core between two `thread_cpu_times`
/// snapshots `span` apart, by name (summed), busiest first.
fn busiest_threads(
    before: &[ThreadTimes],
    after: &[ThreadTimes],
    span: Duration,
) -> Vec<BusyThread> {
    let per_span = |d: Duration| d.as_secs_f64() / span.as_secs_f64().max(1e-9);
    let mut by_name: Vec<BusyThread> = Vec::new();
    for now in after {
        let was = before
            .iter()
            .find(|b| b.tid == now.tid && b.name == now.name);
        let cores = per_span(
            now.cpu
                .saturating_sub(was.map_or(Duration::ZERO, |b| b.cpu)),
        );
        let waiting = now.waited.map(|w| {
            per_span(w.saturating_sub(was.and_then(|b| b.waited).unwrap_or(Duration::ZERO)))
        });
        match by_name.iter_mut().find(|t| t.name == now.name) {
            Some(entry) => {
                entry.cores += cores;
                entry.waiting = entry.waiting.zip(waiting).map(|(a, b)| a + b);
            }
            None => by_name.push(BusyThread {
                name: now.name.clone(),
                cores,
                waiting,
            }),
        }
    }
    by_name.retain(|t| t.cores > 0.05);
    by_name.sort_by(|a, b| b.cores.total_cmp(&a.cores));
    by_name
}

/// The µs of CPU per block of the index writer thread among `busiest` (in cores over
/// `span`, in which `blocks` were applied); NaN if it is not among them.
fn writer_us_per_block(busiest: &[BusyThread], span: Duration, blocks: u64) -> f64 {
    busiest
        .iter()
        .find(|t| t.name == WRITER_THREAD)
        .map_or(f64::NAN, |t| {
            t.cores * span.as_secs_f64() * 1e6 / blocks.max(1) as f64
        })
}

/// Workers `0..workers` with no applied batch in `applied` (`per_worker`'s pairs).
fn without_seq_0(workers: u64, applied: &[(u64, u64)]) -> Vec<u64> {
    let ready: std::collections::HashSet<u64> = applied
        .iter()
        .filter(|(_, n)| *n >= 1)
        .map(|(id, _)| *id)
        .collect();
    (0..workers).filter(|id| !ready.contains(id)).collect()
}

/// Sum of the series of `name` whose labels contain every one of `labels`.
fn labelled(text: &str, name: &str, labels: &[&str]) -> u64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter(|rest| labels.iter().all(|label| rest.contains(label)))
        .filter_map(|rest| rest.rsplit_once(' ')?.1.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

const APPLIED: &str = "kv_select_kv_batches_applied_total";

/// The name the kernel shows for a partition's index writer thread (kv-index's cell.rs).
const WRITER_THREAD: &str = "kv-index-writer";

/// The shortest wait between two polls of the stream's end: a fiftieth of the coarse
/// interval, at least this. A fleet's `/metrics` page is as long as its worker list, and
/// back-to-back scrapes of it would take CPU from the stream they time.
const FINE_POLL: Duration = Duration::from_millis(1);

/// How long to wait for the next poll of the stream's end, given `applied` of `expected`
/// batches seen applied `elapsed` after the `go`: half the time left at the rate so far,
/// between a fiftieth of `coarse` (at least [`FINE_POLL`]) and `coarse`. The end is taken
/// at the first poll that sees every batch applied, so a fixed `coarse` interval would add
/// half of it on average to a stream of about a second (a 2 % lower rate at 50 ms); polls
/// that close in on the projected end take it within a fiftieth of that interval, at a few
/// more scrapes per run.
fn next_poll(elapsed: Duration, applied: u64, expected: u64, coarse: Duration) -> Duration {
    if applied == 0 || applied >= expected {
        return coarse;
    }
    let fine = (coarse / 50).max(FINE_POLL).min(coarse);
    let left = elapsed.mul_f64((expected - applied) as f64 / applied as f64);
    (left / 2).clamp(fine, coarse)
}

async fn drive(
    w: &Workload,
    server: &ServerProcess,
    publisher: &mut Publisher,
    select_interval_us: u64,
    perf: Option<&Path>,
    perf_seconds: u64,
) -> Result<Run> {
    let endpoints = Arc::new(publisher.endpoints.clone());
    let kv: Arc<dyn Fn(u64) -> String + Send + Sync> =
        Arc::new(move |id| endpoints[id as usize].clone());
    let registered = Instant::now();
    let capacity = w.declared_capacity();
    register_with_capacity(server.addr, 4, w.workers, Some(kv), capacity).await?;
    let registration = registered.elapsed();
    let mut conn = connect(server.addr).await?;
    let (status, body) = call(&mut conn, Method::GET, "/ready", Bytes::new()).await?;
    ensure!(status == StatusCode::OK, "GET /ready: {status} {body}");

    // Seq 0 until every listener has applied it: ZMQ drops what a PUB sends before a
    // subscription lands. Resent only to the workers still without it: a listener that
    // has it drops (and warns of) every copy after.
    let waited = Instant::now();
    let poll = if w.workers <= 64 { 50 } else { 250 };
    let mut probe = "probe".to_owned();
    loop {
        publisher.command(&probe)?;
        ensure!(
            publisher.line()? == "ok",
            "the publisher did not acknowledge the probe"
        );
        tokio::time::sleep(Duration::from_millis(poll)).await;
        let text = metrics(&mut conn).await?;
        let missing = without_seq_0(w.workers, &per_worker(&text, APPLIED));
        if missing.is_empty() {
            break;
        }
        ensure!(
            waited.elapsed() < Duration::from_secs(60),
            "{} of {} subscriptions landed within 60 s",
            w.workers - missing.len() as u64,
            w.workers
        );
        probe = std::iter::once("probe".to_owned())
            .chain(missing.iter().map(u64::to_string))
            .collect::<Vec<_>>()
            .join(" ");
    }

    let selects = SelectLoop::start(server, Duration::from_micros(select_interval_us)).await?;
    let in_service_before = Buckets::scrape(&metrics(&mut conn).await?);
    let cpu_before = server.cpu_time();
    let faults_before = server.minor_faults();
    let threads_before = thread_cpu_times(server.pid());
    let recorder = perf
        .map(|out| PerfRecorder::start(server.pid(), out, perf_seconds))
        .transpose()?;
    let go = Instant::now();
    publisher.command("go")?;
    let expected = w.workers * (w.batches_per_worker() + 1);
    let deadline = Duration::from_secs(120);
    let mut peak_threads = 0;
    let mut last = 0;
    let mut wait = Duration::from_millis(poll);
    loop {
        tokio::time::sleep(wait).await;
        let text = metrics(&mut conn).await?;
        peak_threads = peak_threads.max(proc_status(server.pid(), "Threads:").unwrap_or(0));
        let applied = gauge(&text, APPLIED);
        if applied >= expected {
            break;
        }
        wait = next_poll(go.elapsed(), applied, expected, Duration::from_millis(poll));
        if go.elapsed() > deadline {
            bail!(
                "{applied} of {expected} batches applied after {:.0?} ({last} at the poll before); lost {}, dropped {}",
                go.elapsed(),
                gauge(&text, "kv_select_kv_batches_lost_total"),
                gauge(&text, "kv_select_kv_dropped_batches_total"),
            );
        }
        last = applied;
    }
    let applied_in = go.elapsed();
    let server_cpu = cpu_before.and_then(|b| Some(server.cpu_time()? - b));
    let server_faults = faults_before.and_then(|b| Some(server.minor_faults()?.saturating_sub(b)));
    let busiest = busiest_threads(&threads_before, &thread_cpu_times(server.pid()), applied_in);
    let selects = selects.finish().await?;
    let in_service = Buckets::scrape(&metrics(&mut conn).await?).since(&in_service_before);
    if let Some(r) = recorder {
        r.finish()?;
    }
    let done = publisher.line()?;
    let published_in = done
        .strip_prefix("done ")
        .and_then(|s| s.parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .with_context(|| format!("unexpected publisher answer {done:?}"))?;

    verify(w, &mut conn).await?;
    let text = metrics(&mut conn).await?;
    let lookup_wait_max = text
        .lines()
        .filter_map(|l| l.strip_prefix("kv_select_index_lookup_wait_max_seconds"))
        .filter_map(|rest| rest.rsplit_once(' '))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .fold(0.0, f64::max);
    Ok(Run {
        lookup_waits: gauge(&text, "kv_select_index_lookup_waits_total")
            + gauge(&text, "kv_select_index_two_copy_lookup_waits_total"),
        lookup_waits_over_50us: gauge(&text, "kv_select_index_lookup_waits_over_50us_total"),
        lookup_waits_behind_writer: gauge(
            &text,
            "kv_select_index_lookup_waits_behind_writer_over_50us_total",
        ),
        step_asides: gauge(&text, "kv_select_index_writer_step_asides_total"),
        drains_over_50us: gauge(&text, "kv_select_index_writer_drain_waits_over_50us_total"),
        stalls: None,
        page_us: None,
        ceiling: None,
        floor: None,
        lookup_wait_max: Duration::from_secs_f64(lookup_wait_max),
        in_service,
        blocks: w.stream_blocks(),
        applied_in,
        published_in,
        server_cpu,
        server_faults,
        busiest,
        selects,
        registration,
        threads: peak_threads,
        descriptors: std::fs::read_dir(format!("/proc/{}/fd", server.pid()))
            .map(|d| d.count() as u64)
            .unwrap_or(0),
        rss_kib: proc_status(server.pid(), "VmRSS:").unwrap_or(0),
        hwm_kib: proc_status(server.pid(), "VmHWM:").unwrap_or(0),
    })
}

/// Fails unless every batch of every worker is applied and the index is exactly the
/// workload's.
async fn verify(w: &Workload, conn: &mut crate::bench_http::Sender) -> Result<()> {
    let text = metrics(conn).await?;
    let per = per_worker(&text, APPLIED);
    let short: Vec<String> = per
        .iter()
        .filter(|(_, n)| *n != w.batches_per_worker() + 1)
        .map(|(id, n)| format!("worker {id}: {n}"))
        .collect();
    ensure!(
        per.len() as u64 == w.workers && short.is_empty(),
        "batches applied per worker differ from {} (seq 0 included) on {} of {} listeners: {}",
        w.batches_per_worker() + 1,
        short.len(),
        per.len(),
        short.join(", ")
    );
    for (name, what) in [
        ("kv_select_kv_batches_lost_total", "lost"),
        ("kv_select_kv_dropped_batches_total", "dropped"),
    ] {
        let n = gauge(&text, name);
        ensure!(n == 0, "{n} batches {what}");
    }
    let stored = labelled(
        &text,
        "kv_select_index_events_total",
        &["event_type=\"stored\"", "status=\"ok\""],
    );
    let rejected = labelled(
        &text,
        "kv_select_index_events_total",
        &["status=\"parent_block_not_found\""],
    );
    ensure!(
        stored == w.stored_events() && rejected == 0,
        "{stored} stored events applied (expected {}), {rejected} rejected for a missing parent",
        w.stored_events()
    );
    let removed = labelled(
        &text,
        "kv_select_index_events_total",
        &["event_type=\"removed\"", "status=\"ok\""],
    );
    let missing = labelled(
        &text,
        "kv_select_index_events_total",
        &["event_type=\"removed\"", "status=\"block_not_found\""],
    );
    ensure!(
        removed == w.removed_events() && missing == 0,
        "{removed} removed events applied (expected {}), {missing} with blocks not found",
        w.removed_events()
    );
    let nodes = gauge(&text, "kv_select_index_blocks");
    let memberships = labelled(&text, "kv_select_index_memberships", &["tier=\"device\""]);
    let evicted = gauge(&text, "kv_select_index_capacity_evictions_total");
    if w.evictions() == 0 {
        ensure!(
            nodes == w.nodes() && memberships == w.memberships() && evicted == 0,
            "the index holds {nodes} blocks and {memberships} memberships after {evicted} \
             evictions, expected {} and {} and none",
            w.nodes(),
            w.memberships()
        );
    } else {
        // Which blocks a capacity keeps depends on the order of the stores, so the node
        // count is known only to lie between one worker's and every worker's.
        ensure!(
            memberships == w.memberships()
                && evicted == w.evictions()
                && (memberships / w.workers..=memberships).contains(&nodes),
            "the index holds {nodes} blocks and {memberships} memberships after {evicted} \
             evictions, expected {} memberships and {} evictions",
            w.memberships(),
            w.evictions()
        );
    }
    // Probes: the last root chain and the last chain below a prefix of up to 32 workers.
    let step = w.workers.div_ceil(32).max(1);
    let events = w.batches * w.events;
    for worker in (0..w.workers).step_by(step as usize) {
        for kind in [false, true] {
            let Some(g) = (0..events)
                .rev()
                .find(|&g| (w.parent(g) != Parent::Root) == kind)
            else {
                continue;
            };
            let (mut tokens, own, others) = match w.parent(g) {
                Parent::Root => (Vec::new(), w.blocks, 0),
                Parent::Prefix(p) => (prefix_tokens(p), PREFIX_BLOCKS + w.blocks, PREFIX_BLOCKS),
            };
            tokens.extend(w.event_tokens(worker, g));
            probe(conn, &tokens, worker, own, others).await?;
        }
    }
    Ok(())
}

/// `/overlap_scores` of `tokens`: `worker` holds `own` blocks, every other worker `others`.
async fn probe(
    conn: &mut crate::bench_http::Sender,
    tokens: &[u32],
    worker: u64,
    own: u64,
    others: u64,
) -> Result<()> {
    let body = Bytes::from(json!({ "token_ids": tokens }).to_string());
    let (status, answer) = call(conn, Method::POST, "/overlap_scores", body).await?;
    ensure!(
        status == StatusCode::OK,
        "/overlap_scores: {status} {answer}"
    );
    let rows = answer["workers"]
        .as_array()
        .context("/overlap_scores without workers")?;
    for row in rows {
        let id = row["worker_id"].as_u64().unwrap_or(u64::MAX);
        let blocks = row["device_blocks"].as_u64().unwrap_or(u64::MAX);
        let want = if id == worker { own } else { others };
        ensure!(
            blocks == want,
            "probe of worker {worker}'s chain: worker {id} holds {blocks} blocks, expected {want}"
        );
    }
    Ok(())
}

/// `/select` at a fixed interval on one connection until stopped, from a thread of its
/// own: on the driver's thread a response could wait behind the parse of a `/metrics` poll.
#[derive(Debug)]
struct SelectLoop {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<Result<Selects>>,
}

/// The `/select` latencies of a stream, each sorted.
#[derive(Debug, Clone, Default)]
struct Selects {
    /// As the client saw them: from the request's write to the response's end.
    observed: Vec<Duration>,
    /// The same, less the time the client thread itself waited for a core meanwhile (its
    /// run-queue delay, `/proc/thread-self/schedstat`): on two cores shared with the server
    /// and the publisher, the client's wake-up after the response is part of what it
    /// observes. Empty where the kernel does not report it.
    less_client_waits: Vec<Duration>,
}

/// The run-queue wait of the thread that opened it: nanoseconds it has waited for a core,
/// the second field of its `/proc/thread-self/schedstat`. The file stays open and is read
/// again from its start, so a reading costs one system call, not three.
struct RunQueueWait(Option<std::fs::File>);

impl RunQueueWait {
    fn of_this_thread() -> Self {
        RunQueueWait(std::fs::File::open("/proc/thread-self/schedstat").ok())
    }

    fn read(&self) -> Option<u64> {
        self.field(1)
    }

    /// Field `i` of the file now (0: nanoseconds on a core, 1: waiting for one).
    fn field(&self, i: usize) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 128];
        let n = self.0.as_ref()?.read_at(&mut buf, 0).ok()?;
        schedstat_field(std::str::from_utf8(buf.get(..n)?).ok()?, i)
    }
}

impl SelectLoop {
    async fn start(server: &ServerProcess, interval: Duration) -> Result<Self> {
        let addr = server.addr;
        let (ready, probed) = tokio::sync::oneshot::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("bench-select".into())
            .spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("failed to start the select loop's runtime")?
                    .block_on(select_loop(addr, interval, ready, stopped))
            })
            .context("failed to start the select loop's thread")?;
        match probed.await {
            Ok(()) => Ok(Self { stop, thread }),
            // The loop ended before its probe answered: its error says why.
            Err(_) => match thread.join() {
                Ok(result) => result.and_then(|_| bail!("the select loop ended at once")),
                Err(_) => bail!("select loop panicked"),
            },
        }
    }

    async fn finish(self) -> Result<Selects> {
        let _ = self.stop.send(());
        tokio::task::spawn_blocking(move || self.thread.join())
            .await
            .context("select loop join")?
            .map_err(|_| anyhow::anyhow!("select loop panicked"))?
    }
}

async fn select_loop(
    addr: std::net::SocketAddr,
    interval: Duration,
    ready: tokio::sync::oneshot::Sender<()>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> Result<Selects> {
    let mut conn = connect(addr).await?;
    // A prompt below shared prefix 0, so each lookup walks the trie the stream writes.
    let mut tokens = prefix_tokens(0);
    tokens.extend((0..4 * BLOCK_SIZE as u32).map(|t| 127_000 - t));
    let body = Bytes::from(json!({ "token_ids": tokens }).to_string());
    let (status, answer) = send(&mut conn, Method::POST, "/select", body.clone()).await?;
    ensure!(
        status == StatusCode::OK,
        "probe /select: {status} {}",
        String::from_utf8_lossy(&answer)
    );
    let _ = ready.send(());
    let mut selects = Selects {
        observed: Vec::with_capacity(1 << 16),
        less_client_waits: Vec::with_capacity(1 << 16),
    };
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The runtime runs on this thread alone (`new_current_thread`).
    let run_queue = RunQueueWait::of_this_thread();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = tick.tick() => {}
        }
        let waited_before = run_queue.read();
        let t = Instant::now();
        let (status, _) = send(&mut conn, Method::POST, "/select", body.clone()).await?;
        let took = t.elapsed();
        selects.observed.push(took);
        if let (Some(before), Some(after)) = (waited_before, run_queue.read()) {
            let waited = Duration::from_nanos(after.saturating_sub(before));
            selects.less_client_waits.push(took.saturating_sub(waited));
        }
        ensure!(
            status == StatusCode::OK,
            "/select during the stream: {status}"
        );
    }
    selects.observed.sort_unstable();
    selects.less_client_waits.sort_unstable();
    if selects.less_client_waits.len() != selects.observed.len() {
        selects.less_client_waits.clear();
    }
    Ok(selects)
}

#[expect(
    clippy::print_stdout,
    reason = "the results table is the task's output"
)]
fn print_table(w: &Workload, runs: &[(&'static str, Run)], compared: bool) {
    println!(
        "workload: {} workers × {} batches × {} events × {} blocks = {} blocks, {:.0} % below {SHARED_PREFIXES} shared prefixes",
        w.workers,
        w.batches,
        w.events,
        w.blocks,
        w.stream_blocks(),
        w.shared * 100.0
    );
    println!(
        "round       M blocks/s  null sink  ÷ null sink  index floor  ÷ floor  CPU s/M blocks  faults/k blocks  writer µs/block  published (s)  /select p50 (µs)  p99 (µs)  max (µs)  p99 less client waits (µs)  selects  in service: p99 ≤ (µs)  > 1 ms  lock waits  > 50 µs  behind writer  longest (µs)  step-asides  drains > 50 µs  register (s)  threads  fds  RSS (MiB)  HWM (MiB)  stalls/core-s  page (µs)"
    );
    let cpu = |r: &Run| r.cpu_per_million().unwrap_or(f64::NAN);
    for (i, (label, r)) in runs.iter().enumerate() {
        // Compared, every round has one run of each build.
        let round = if compared { i / 2 + 1 } else { i + 1 };
        let name = if compared {
            format!("{round} {label}")
        } else {
            round.to_string()
        };
        println!(
            "{:>10}  {:>10.3}  {:>9.3}  {:>11.3}  {:>11.3}  {:>7.3}  {:>14.3}  {:>15.1}  {:>15.3}  {:>13.2}  {:>16.0}  {:>8.0}  {:>8.0}  {:>26.0}  {:>7}  {:>23.0}  {:>6}  {:>10}  {:>7}  {:>13}  {:>12.0}  {:>11}  {:>14}  {:>11.2}  {:>7}  {:>3}  {:>9.1}  {:>9.1}  {:>13}  {:>9}",
            name,
            r.rate() / 1e6,
            r.ceiling.map_or(f64::NAN, |c| c / 1e6),
            r.over_ceiling(),
            r.floor.map_or(f64::NAN, |f| f / 1e6),
            r.over_floor(),
            cpu(r),
            r.faults_per_thousand(),
            r.writer_us_per_block(),
            r.published_in.as_secs_f64(),
            us(r.percentile(50.0)),
            us(r.percentile(99.0)),
            us(r.selects.observed.last().copied().unwrap_or_default()),
            r.percentile_less_client_waits_us(99.0),
            r.selects.observed.len(),
            r.in_service.percentile_bound_us(99.0),
            r.in_service.over(1e-3),
            r.lookup_waits,
            r.lookup_waits_over_50us,
            r.lookup_waits_behind_writer,
            us(r.lookup_wait_max),
            r.step_asides,
            r.drains_over_50us,
            r.registration.as_secs_f64(),
            r.threads,
            r.descriptors,
            r.rss_kib as f64 / 1024.0,
            r.hwm_kib as f64 / 1024.0,
            r.stalls.map_or_else(String::new, |s| format!(
                "{:.0}",
                s.over_50us_per_core_second()
            )),
            r.page_us.map_or_else(String::new, |us| format!("{us:.2}")),
        );
    }
    let labels: &[&str] = if compared {
        &["base", "test"]
    } else {
        &["test"]
    };
    let mut medians = Vec::new();
    for &label in labels {
        let of: Vec<&Run> = runs
            .iter()
            .filter(|(l, _)| *l == label)
            .map(|(_, r)| r)
            .collect();
        if of.len() < 2 && !compared {
            return;
        }
        let m = Medians::of(&of);
        println!(
            "{:>10}  {:>10.3}  {:>9.3}  {:>11.3}  {:>11.3}  {:>7.3}  {:>14.3}  {:>15.1}  {:>15.3}  {:>13}  {:>16.0}  {:>8.0}  {:>8}  {:>26.0}  {:>7}  {:>23}  {:>6}  {:>10}  {:>7.0}  {:>13.0}",
            if compared {
                format!("median {label}")
            } else {
                "median".to_owned()
            },
            m.rate,
            m.ceiling,
            m.over_ceiling,
            m.floor,
            m.over_floor,
            m.cpu,
            m.faults,
            m.writer,
            "",
            m.p50,
            m.p99,
            "",
            m.p99_less_client_waits,
            "",
            "",
            "",
            "",
            m.over_50us,
            m.behind_writer,
        );
        medians.push(m);
    }
    if let [base, test] = medians.as_slice() {
        println!(
            "test / base (medians): M blocks/s ×{:.3} (over the null sink ×{:.3}, over the index floor ×{:.3}), CPU per M blocks ×{:.3}, page faults ×{:.3}, writer CPU per block ×{:.3}, /select p99 ×{:.2}, p99 less client waits ×{:.2}, lookups over 50 µs ×{:.2}, behind the writer ×{:.2}",
            test.rate / base.rate,
            test.over_ceiling / base.over_ceiling,
            test.over_floor / base.over_floor,
            test.cpu / base.cpu,
            test.faults / base.faults,
            test.writer / base.writer,
            test.p99 / base.p99,
            test.p99_less_client_waits / base.p99_less_client_waits,
            test.over_50us / base.over_50us,
            test.behind_writer / base.behind_writer,
        );
    }
}

/// Medians of one build's runs, for the table's last lines and the ratios.
struct Medians {
    rate: f64,
    /// The null sink's M blocks/s and each run's rate over its round's.
    ceiling: f64,
    over_ceiling: f64,
    /// The index floor's M blocks/s and each run's rate over its round's.
    floor: f64,
    over_floor: f64,
    cpu: f64,
    /// Server minor page faults per thousand blocks.
    faults: f64,
    /// The index writer thread's µs of CPU per block.
    writer: f64,
    p50: f64,
    p99: f64,
    p99_less_client_waits: f64,
    over_50us: f64,
    behind_writer: f64,
}

impl Medians {
    fn of(runs: &[&Run]) -> Self {
        let m = |f: &dyn Fn(&Run) -> f64| median(runs.iter().map(|r| f(r)).collect());
        Medians {
            rate: m(&|r| r.rate() / 1e6),
            ceiling: m(&|r| r.ceiling.map_or(f64::NAN, |c| c / 1e6)),
            over_ceiling: m(&|r| r.over_ceiling()),
            floor: m(&|r| r.floor.map_or(f64::NAN, |f| f / 1e6)),
            over_floor: m(&|r| r.over_floor()),
            cpu: m(&|r| r.cpu_per_million().unwrap_or(f64::NAN)),
            faults: m(&|r| r.faults_per_thousand()),
            writer: m(&|r| r.writer_us_per_block()),
            p50: m(&|r| us(r.percentile(50.0))),
            p99: m(&|r| us(r.percentile(99.0))),
            p99_less_client_waits: m(&|r| r.percentile_less_client_waits_us(99.0)),
            over_50us: m(&|r| r.lookup_waits_over_50us as f64),
            behind_writer: m(&|r| r.lookup_waits_behind_writer as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_close_in_on_the_projected_end() {
        let ms = Duration::from_millis;
        let coarse = ms(50);
        // Nothing applied yet, or all of it: no projection.
        assert_eq!(next_poll(ms(100), 0, 1000, coarse), coarse);
        assert_eq!(next_poll(ms(100), 1000, 1000, coarse), coarse);
        // A tenth done in 100 ms: 900 ms left, capped at the coarse interval.
        assert_eq!(next_poll(ms(100), 100, 1000, coarse), coarse);
        // 96 % in 960 ms leaves 40 ms: the next poll in 20.
        assert_eq!(next_poll(ms(960), 960, 1000, coarse), ms(20));
        // The last batch due within a millisecond: the finest poll, never less.
        assert_eq!(next_poll(ms(1000), 999, 1000, coarse), FINE_POLL);
        // A fleet's coarse 250 ms closes in to 5 ms at the finest.
        assert_eq!(next_poll(ms(1000), 999, 1000, ms(250)), ms(5));
        assert_eq!(next_poll(ms(960), 960, 1000, ms(250)), ms(20));
    }

    #[test]
    fn series_are_read_per_worker_and_by_label() {
        let text = "# HELP x\n\
            kv_select_kv_batches_applied_total{worker_id=\"3\",dp_rank=\"0\"} 12\n\
            kv_select_kv_batches_applied_total{dp_rank=\"0\",worker_id=\"10\"} 4\n\
            kv_select_index_events_total{model_name=\"\",event_type=\"stored\",status=\"ok\"} 7\n\
            kv_select_index_events_total{model_name=\"\",event_type=\"removed\",status=\"ok\"} 2\n";
        assert_eq!(per_worker(text, APPLIED), vec![(3, 12), (10, 4)]);
        let stored = ["event_type=\"stored\"", "status=\"ok\""];
        assert_eq!(labelled(text, "kv_select_index_events_total", &stored), 7);
        assert_eq!(
            labelled(text, "kv_select_index_events_total", &["status=\"ok\""]),
            9
        );
    }

    #[test]
    fn threads_are_summed_by_name_in_cores_and_idle_ones_left_out() {
        let ms = Duration::from_millis;
        let t = |tid, name: &str, cpu, waited: Option<u64>| ThreadTimes {
            tid,
            name: name.to_owned(),
            cpu: ms(cpu),
            waited: waited.map(ms),
        };
        let before = [
            t(1, "writer", 500, Some(40)),
            t(2, "listener", 100, Some(0)),
            t(3, "listener", 0, Some(100)),
            t(4, "http", 10, Some(0)),
        ];
        let after = [
            t(1, "writer", 2_400, Some(140)),
            t(2, "listener", 300, Some(200)),
            t(3, "listener", 400, Some(300)),
            t(4, "http", 20, Some(0)),
            // Started during the span: all of its time counts.
            t(5, "pool", 200, None),
        ];
        let busiest = busiest_threads(&before, &after, Duration::from_secs(2));
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        let rounded: Vec<(&str, f64, Option<f64>)> = busiest
            .iter()
            .map(|b| (b.name.as_str(), round(b.cores), b.waiting.map(round)))
            .collect();
        assert_eq!(
            rounded,
            [
                ("writer", 0.95, Some(0.05)),
                ("listener", 0.3, Some(0.2)),
                ("pool", 0.1, None),
            ]
        );
        assert_eq!(busiest[0].describe(), "writer 0.95 (0.05)");
        assert_eq!(busiest[2].describe(), "pool 0.10");
    }

    #[test]
    fn the_writer_threads_cpu_is_given_per_block() {
        let thread = |name: &str, cores| BusyThread {
            name: name.to_owned(),
            cores,
            waiting: None,
        };
        let busiest = [thread("kv-events-0", 0.4), thread(WRITER_THREAD, 0.9)];
        // 0.9 of a core for 1.2 s over 4 M blocks: 0.27 µs a block.
        let per_block = writer_us_per_block(&busiest, Duration::from_millis(1200), 4_000_000);
        assert!((per_block - 0.27).abs() < 1e-9, "{per_block}");
        // One copy has no writer thread.
        let listeners = [thread("kv-events-0", 0.9)];
        assert!(writer_us_per_block(&listeners, Duration::from_secs(1), 1000).is_nan());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_schedstat_file_is_read_afresh_each_time() {
        let clock = RunQueueWait::of_this_thread();
        let (on_core, waited) = (clock.field(0), clock.read());
        assert!(
            on_core.is_some() && waited.is_some(),
            "schedstat is readable on Linux"
        );
        // Busy for 20 ms on this thread: its time on a core must have grown since.
        let until = std::time::Instant::now() + Duration::from_millis(20);
        while std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
        assert!(
            clock.field(0) > on_core,
            "a reading repeated the file's old content"
        );
        assert!(clock.read() >= waited);
    }

    #[test]
    fn only_workers_without_an_applied_batch_are_probed_again() {
        assert_eq!(without_seq_0(4, &[(2, 1), (0, 0), (3, 5)]), [0, 1]);
        assert_eq!(
            without_seq_0(2, &[(0, 1), (1, 1), (7, 1)]),
            Vec::<u64>::new()
        );
        assert_eq!(without_seq_0(3, &[]), [0, 1, 2]);
    }

    #[test]
    fn the_selection_histogram_is_read_per_bucket_and_differenced() {
        let scrape = |a: u64, b: u64, c: u64| {
            format!(
                "# TYPE kv_select_selection_duration_seconds histogram\n\
                 kv_select_selection_duration_seconds_bucket{{le=\"0.0001\"}} {a}\n\
                 kv_select_selection_duration_seconds_bucket{{le=\"0.001\"}} {b}\n\
                 kv_select_selection_duration_seconds_bucket{{le=\"+Inf\"}} {c}\n\
                 kv_select_selection_duration_seconds_count {c}\n"
            )
        };
        let before = Buckets::scrape(&scrape(1, 1, 1));
        let after = Buckets::scrape(&scrape(91, 199, 201));
        assert_eq!(
            after,
            Buckets(vec![(1e-4, 91), (1e-3, 108), (f64::INFINITY, 2)])
        );
        let d = after.since(&before);
        assert_eq!(d.total(), 200);
        assert_eq!(d.over(1e-3), 2);
        assert_eq!(d.over(1e-4), 110);
        assert_eq!(d.percentile_bound_us(50.0), 1e3);
        assert_eq!(d.percentile_bound_us(45.0), 100.0);
        assert_eq!(d.percentile_bound_us(99.0), 1e3);
        assert_eq!(d.percentile_bound_us(99.5), f64::INFINITY);
    }

    #[test]
    fn arguments_parse_to_the_issue_workload() {
        let a = Args::try_parse_from(["x"]).unwrap();
        let w = a.workload();
        assert_eq!((w.workers, w.batches, w.events, w.blocks), (16, 977, 32, 8));
        assert_eq!(w.stream_blocks(), 4_001_792);
        assert!(
            !a.no_ceiling,
            "every round measures the null sink unless told not to"
        );
        assert!(
            !a.no_index_floor
                && Args::try_parse_from(["x", "--no-index-floor"])
                    .unwrap()
                    .no_index_floor,
            "every round measures the index floor unless told not to"
        );
        assert!(
            Args::try_parse_from(["x", "--no-ceiling"])
                .unwrap()
                .no_ceiling
        );
        let p = Args::try_parse_from(["x", "--workers", "2048", "--batches", "8", "--rounds", "3"])
            .unwrap();
        assert_eq!((p.workers, p.batches, p.rounds), (2048, 8, 3));
        let q = Args::try_parse_from(["x", "--server-arg=--kv-listener-threads=1"]).unwrap();
        assert_eq!(q.server_args, ["--kv-listener-threads=1"]);
        assert!(Args::try_parse_from(["x", "--workers", "x"]).is_err());
    }

    #[test]
    fn a_child_process_gets_the_same_workload() {
        for given in [
            vec![],
            vec!["--workers", "2048", "--batches", "8", "--shared", "0.25"],
            vec![
                "--capacity-blocks",
                "50000",
                "--retain-events",
                "7816",
                "--blocks",
                "3",
            ],
        ] {
            let w = Args::try_parse_from(std::iter::once("x").chain(given))
                .unwrap()
                .workload();
            let args = w.child_args();
            let child =
                Args::try_parse_from(std::iter::once("x").chain(args.iter().map(String::as_str)))
                    .unwrap();
            assert_eq!(child.workload(), w);
        }
    }

    #[test]
    fn a_baseline_is_another_binary_or_other_flags_and_runs_in_abba_order() {
        let bin = || PathBuf::from("/b/test");
        let alone = Args::try_parse_from(["x", "--server-arg=--a"]).unwrap();
        let (test, base) = builds(&alone, bin());
        assert_eq!(
            (test.binary, test.server_args),
            (bin(), vec!["--a".to_owned()])
        );
        assert_eq!(base, None);

        let flags = Args::try_parse_from(["x", "--server-arg=--a", "--baseline-arg=--b"]).unwrap();
        let (test, base) = builds(&flags, bin());
        let base = base.unwrap();
        assert_eq!(
            (base.binary, base.server_args),
            (bin(), vec!["--b".to_owned()])
        );
        assert_eq!(test.server_args, ["--a"]);

        let binary =
            Args::try_parse_from(["x", "--server-arg=--a", "--baseline", "/b/old"]).unwrap();
        let (test, base) = builds(&binary, bin());
        let base = base.unwrap();
        assert_eq!(base.binary, PathBuf::from("/b/old"));
        assert_eq!(base.server_args, ["--a"]);

        let labels = |round| -> Vec<&str> {
            round_order(round, &test, Some(&base))
                .iter()
                .map(|b| b.label)
                .collect()
        };
        assert_eq!(
            (0..4).map(labels).collect::<Vec<_>>(),
            [
                ["base", "test"],
                ["test", "base"],
                ["base", "test"],
                ["test", "base"]
            ]
        );
        assert_eq!(round_order(1, &test, None).len(), 1);
    }

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let d: Vec<Duration> = (0..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile(&d, 99.0), Duration::from_micros(99));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        // An even count averages the middle two (the table's median row).
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
