//! `cargo xtask flood [SCENARIO...]`: floods the release `select-server` and checks that its
//! memory stays bounded (issue #10 item 2). Not part of CI: the full run takes minutes.
//!
//! Every scenario starts a fresh server (the start-up code of `bench http`), drives it from a
//! small client (hyper 1 keep-alive connections on a single-threaded tokio runtime, the same
//! client as `bench http`; a raw ZMQ PUB per engine for `events`), samples the server's
//! `VmRSS`/`VmHWM` from `/proc/<pid>/status` and its gauges from `/metrics` every 250 ms, and
//! checks the scenario's bound:
//!
//! - `pending`: N distinct pending selections (`/select` with a fresh `selection_id`): the
//!   cache never holds more than `--selection-cache-max-entries` entries or
//!   `--selection-cache-max-bytes` bytes.
//! - `reservations`: N bookings (`/select_and_reserve`) never freed, with a short
//!   `DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS` and `--max-active-reservations`: live
//!   reservations never exceed the cap (the excess is answered 429) and expiry reclaims all
//!   of them afterwards.
//! - `workers`: 10 k workers registered (approximate mode, so no KV listener per worker),
//!   then selections over all of them.
//! - `events`: engines publishing a steady 1 M stored blocks/s for 10 s (each engine evicts
//!   its oldest sequence once its KV capacity is full, as a real one does): every batch is
//!   applied (no gap, nothing dropped) and the index stays at the engines' capacity.
//!
//! Peak RSS is the kernel's `VmHWM` of the server process at the end of the scenario.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use http::{Method, StatusCode};
use serde_json::json;

use crate::bench_http::{ServerProcess, call, connect, send, token};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    Pending,
    Reservations,
    Workers,
    Events,
}

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask flood",
    about = "Flood the release select-server and check that its memory stays bounded"
)]
struct Args {
    /// Scenarios to run, in order (default: all four).
    #[arg(value_enum)]
    scenarios: Vec<Scenario>,
    /// HTTP requests of `pending` and `reservations`.
    #[arg(long, default_value_t = 1_000_000)]
    requests: u64,
    /// Concurrent keep-alive connections of the HTTP scenarios.
    #[arg(long, default_value_t = 16)]
    connections: usize,
    /// `--selection-cache-max-entries` of `pending`.
    #[arg(long, default_value_t = 100_000)]
    cache_entries: u64,
    /// `--selection-cache-max-bytes` of `pending`.
    #[arg(long, default_value_t = 16 << 20)]
    cache_bytes: u64,
    /// `--max-active-reservations` of `reservations`.
    #[arg(long, default_value_t = 50_000)]
    max_reservations: u64,
    /// `DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS` of `reservations`.
    #[arg(long, default_value_t = 5)]
    expiry_secs: u64,
    /// Workers registered by `workers`.
    #[arg(long, default_value_t = 10_000)]
    workers: u64,
    /// Stored blocks per second of `events`, over all engines.
    #[arg(long, default_value_t = 1_000_000)]
    blocks_per_sec: u64,
    /// Seconds of `events`.
    #[arg(long, default_value_t = 10)]
    event_seconds: u64,
    /// Engines (workers with a ZMQ publisher each) of `events`.
    #[arg(long, default_value_t = 4)]
    engines: u64,
    /// Use this server binary instead of building target/release/select-server.
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
}

/// Entry point of `cargo xtask flood ARGS`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let Some(mut args) = crate::parse_task_args::<Args>("cargo xtask flood", args)? else {
        return Ok(());
    };
    ensure!(args.connections > 0, "--connections must be at least 1");
    if args.scenarios.is_empty() {
        args.scenarios = Scenario::value_variants().to_vec();
    }
    let binary = match &args.binary {
        Some(path) => path.clone(),
        None => {
            crate::cargo(&["build", "--release", "-p", "select-server"], &[])?;
            crate::root().join("target/release/select-server")
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the client runtime")?;
    let mut outcomes = Vec::new();
    for &scenario in &args.scenarios {
        eprintln!("xtask flood: {scenario:?}");
        let outcome = match scenario {
            Scenario::Pending => runtime.block_on(pending(&args, &binary)),
            Scenario::Reservations => runtime.block_on(reservations(&args, &binary)),
            Scenario::Workers => runtime.block_on(workers(&args, &binary)),
            Scenario::Events => runtime.block_on(events(&args, &binary)),
        }
        .with_context(|| format!("scenario {scenario:?}"))?;
        eprintln!("xtask flood: {scenario:?}: {}", outcome.result);
        outcomes.push(outcome);
    }
    print_table(&outcomes);
    ensure!(
        outcomes.iter().all(|o| o.passed),
        "some scenario broke its bound"
    );
    Ok(())
}

/// One scenario's row of the table.
#[derive(Debug)]
struct Outcome {
    scenario: &'static str,
    operations: String,
    duration: Duration,
    peak_rss_kib: u64,
    passed: bool,
    result: String,
}

// ------------------------------------------------------------------ sampling

/// Maxima seen by the sampler.
#[derive(Debug, Default, Clone, Copy)]
struct Peaks {
    pending: u64,
    pending_bytes: u64,
    reservations: u64,
    rss_kib: u64,
}

/// Polls `/proc/<pid>/status` and `/metrics` every 250 ms until stopped.
#[derive(Debug)]
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Peaks>>,
}

impl Sampler {
    fn start(server: &ServerProcess) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let (addr, pid) = (server.addr, server.pid());
        let task = tokio::spawn(async move {
            let mut peaks = Peaks::default();
            let mut conn = connect(addr).await?;
            while !flag.load(Ordering::Relaxed) {
                let text = metrics(&mut conn).await?;
                peaks.pending = peaks
                    .pending
                    .max(gauge(&text, "kv_select_pending_selections"));
                peaks.pending_bytes = peaks
                    .pending_bytes
                    .max(gauge(&text, "kv_select_pending_selection_bytes"));
                peaks.reservations = peaks
                    .reservations
                    .max(gauge(&text, "kv_select_active_reservations"));
                peaks.rss_kib = peaks.rss_kib.max(proc_status(pid, "VmRSS:").unwrap_or(0));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(peaks)
        });
        Self { stop, task }
    }

    async fn finish(self) -> Result<Peaks> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.context("sampler panicked")?
    }
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS:`, `VmHWM:`).
pub(crate) fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()
}

fn peak_rss(server: &ServerProcess) -> u64 {
    proc_status(server.pid(), "VmHWM:").unwrap_or(0)
}

pub(crate) async fn metrics(conn: &mut crate::bench_http::Sender) -> Result<String> {
    let (status, body) = send(conn, Method::GET, "/metrics", Bytes::new()).await?;
    ensure!(status == StatusCode::OK, "GET /metrics: {status}");
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Sum of the samples whose series starts with `prefix` (a bare name matches only itself
/// and its labelled series).
pub(crate) fn gauge(text: &str, prefix: &str) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with([' ', '{']) || prefix.ends_with(['{', ',']))
        })
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

// ------------------------------------------------------------------ HTTP load

/// Statuses of a flood, by code.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    statuses: BTreeMap<u16, u64>,
    elapsed: Duration,
}

impl Tally {
    fn count(&self, status: u16) -> u64 {
        self.statuses.get(&status).copied().unwrap_or(0)
    }

    fn others(&self, allowed: &[u16]) -> u64 {
        self.statuses
            .iter()
            .filter(|(s, _)| !allowed.contains(s))
            .map(|(_, n)| n)
            .sum()
    }

    fn describe(&self) -> String {
        self.statuses
            .iter()
            .map(|(s, n)| format!("{n}×{s}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

type BodyFn = dyn Fn(u64) -> (Method, String, Bytes) + Send + Sync;

/// Sends `total` requests over `connections` keep-alive connections; request `i` is
/// `make(i)`.
async fn hammer(
    addr: SocketAddr,
    connections: usize,
    total: u64,
    make: Arc<BodyFn>,
) -> Result<Tally> {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(connections);
    for _ in 0..connections {
        let mut conn = connect(addr).await?;
        let next = Arc::clone(&next);
        let make = Arc::clone(&make);
        tasks.push(tokio::spawn(async move {
            let mut statuses = BTreeMap::<u16, u64>::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                if i > 0 && i.is_multiple_of(100_000) {
                    eprintln!("xtask flood:   {i} requests in {:.0?}", started.elapsed());
                }
                let (method, path, body) = make(i);
                let (status, _) = send(&mut conn, method, &path, body).await?;
                *statuses.entry(status.as_u16()).or_default() += 1;
            }
            Ok::<_, anyhow::Error>(statuses)
        }));
    }
    let mut tally = Tally::default();
    for task in tasks {
        for (s, n) in task.await.context("client task panicked")?? {
            *tally.statuses.entry(s).or_default() += n;
        }
    }
    tally.elapsed = started.elapsed();
    Ok(tally)
}

/// Registers `n` workers (block size 16) on `conn`; `kv` gives each one's KV endpoint.
pub(crate) async fn register(
    addr: SocketAddr,
    connections: usize,
    n: u64,
    kv: Option<Arc<dyn Fn(u64) -> String + Send + Sync>>,
) -> Result<Tally> {
    register_with_capacity(addr, connections, n, kv, 1_000_000).await
}

/// [`register`] with each worker declaring `total_kv_blocks`.
pub(crate) async fn register_with_capacity(
    addr: SocketAddr,
    connections: usize,
    n: u64,
    kv: Option<Arc<dyn Fn(u64) -> String + Send + Sync>>,
    total_kv_blocks: u64,
) -> Result<Tally> {
    let make: Arc<BodyFn> = Arc::new(move |id| {
        let mut w = json!({
            "worker_id": id,
            "endpoint": format!("http://127.0.0.1:1/w{id}"),
            "block_size": 16,
            "total_kv_blocks": total_kv_blocks,
            "max_num_batched_tokens": 1_000_000,
        });
        if let Some(kv) = &kv {
            w["kv_events_endpoint"] = json!(kv(id));
        }
        (
            Method::POST,
            "/workers".to_owned(),
            Bytes::from(w.to_string()),
        )
    });
    let tally = hammer(addr, connections, n, make).await?;
    ensure!(
        tally.others(&[201]) == 0,
        "worker registration: {}",
        tally.describe()
    );
    Ok(tally)
}

/// `{"token_ids": [...]}` bodies without the closing brace, so an id can be appended.
fn prompts(count: usize, tokens: usize) -> Arc<Vec<String>> {
    let mut rng = rand::rng();
    Arc::new(
        (0..count)
            .map(|_| {
                let t: Vec<u32> = (0..tokens).map(|_| token(&mut rng)).collect();
                let mut s = json!({ "token_ids": t }).to_string();
                s.pop();
                s
            })
            .collect(),
    )
}

// ------------------------------------------------------------------ scenarios

async fn pending(args: &Args, binary: &std::path::Path) -> Result<Outcome> {
    let (entries, bytes) = (args.cache_entries.to_string(), args.cache_bytes.to_string());
    let server = ServerProcess::start_with(
        binary,
        &[
            "--selection-cache-max-entries",
            &entries,
            "--selection-cache-max-bytes",
            &bytes,
        ],
        &[("DYN_ROUTER_USE_KV_EVENTS", "false")],
    )?;
    register(server.addr, 1, 8, None).await?;
    let sampler = Sampler::start(&server);
    let bodies = prompts(64, 256);
    let make: Arc<BodyFn> = Arc::new(move |i| {
        let body = format!(
            "{},\"selection_id\":\"pending-{i}\"}}",
            bodies[(i % 64) as usize]
        );
        (Method::POST, "/select".to_owned(), Bytes::from(body))
    });
    let tally = hammer(server.addr, args.connections, args.requests, make).await?;
    let peaks = sampler.finish().await?;
    let mut conn = connect(server.addr).await?;
    let text = metrics(&mut conn).await?;
    let (now, now_bytes) = (
        gauge(&text, "kv_select_pending_selections"),
        gauge(&text, "kv_select_pending_selection_bytes"),
    );
    let evicted = gauge(&text, "kv_select_pending_selection_evictions_total");
    let peak_pending = peaks.pending.max(now);
    let peak_bytes = peaks.pending_bytes.max(now_bytes);
    let within = peak_pending <= args.cache_entries && peak_bytes <= args.cache_bytes;
    let passed = within && tally.others(&[200]) == 0;
    Ok(Outcome {
        scenario: "pending",
        operations: format!("{} /select with new selection_id", args.requests),
        duration: tally.elapsed,
        peak_rss_kib: peak_rss(&server),
        passed,
        result: format!(
            "{}: cache peak {peak_pending} entries (max {}), {:.1} MiB (max {:.1} MiB), {evicted} evicted; {}",
            verdict(passed),
            args.cache_entries,
            mib(peak_bytes),
            mib(args.cache_bytes),
            tally.describe()
        ),
    })
}

async fn reservations(args: &Args, binary: &std::path::Path) -> Result<Outcome> {
    let (cap, expiry) = (
        args.max_reservations.to_string(),
        args.expiry_secs.to_string(),
    );
    let server = ServerProcess::start_with(
        binary,
        &["--max-active-reservations", &cap],
        &[
            ("DYN_ROUTER_USE_KV_EVENTS", "false"),
            ("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", &expiry),
            // The recorded routing decisions expire as fast as the bookings.
            ("DYN_ROUTER_TTL_SECS", &expiry),
        ],
    )?;
    register(server.addr, 1, 8, None).await?;
    let sampler = Sampler::start(&server);
    let bodies = prompts(64, 64);
    let make: Arc<BodyFn> = Arc::new(move |i| {
        let body = format!(
            "{},\"selection_id\":\"booked-{i}\"}}",
            bodies[(i % 64) as usize]
        );
        (
            Method::POST,
            "/select_and_reserve".to_owned(),
            Bytes::from(body),
        )
    });
    let tally = hammer(server.addr, args.connections, args.requests, make).await?;
    // Expiry runs every `expiry` seconds and reclaims bookings older than `expiry`.
    let mut conn = connect(server.addr).await?;
    let waited = Instant::now();
    let limit = Duration::from_secs(3 * args.expiry_secs + 5);
    let mut left = u64::MAX;
    while waited.elapsed() < limit {
        left = gauge(&metrics(&mut conn).await?, "kv_select_active_reservations");
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let peaks = sampler.finish().await?;
    let text = metrics(&mut conn).await?;
    let expired = gauge(&text, "kv_select_expired_reservations_total");
    let rejected = gauge(&text, "kv_select_reservations_rejected_total");
    let passed = peaks.reservations <= args.max_reservations
        && left == 0
        && tally.others(&[200, 429]) == 0
        && rejected == tally.count(429);
    Ok(Outcome {
        scenario: "reservations",
        operations: format!("{} /select_and_reserve, never freed", args.requests),
        duration: tally.elapsed,
        peak_rss_kib: peak_rss(&server),
        passed,
        result: format!(
            "{}: peak {} live (cap {}), {} rejected 429, {expired} expired, {left} left {:.0?} after the flood (expiry {} s); {}",
            verdict(passed),
            peaks.reservations,
            args.max_reservations,
            rejected,
            waited.elapsed(),
            args.expiry_secs,
            tally.describe()
        ),
    })
}

async fn workers(args: &Args, binary: &std::path::Path) -> Result<Outcome> {
    let server = ServerProcess::start_with(binary, &[], &[("DYN_ROUTER_USE_KV_EVENTS", "false")])?;
    let sampler = Sampler::start(&server);
    let registered = register(server.addr, args.connections, args.workers, None).await?;
    let mut conn = connect(server.addr).await?;
    let (status, listed) = call(&mut conn, Method::GET, "/workers", Bytes::new()).await?;
    ensure!(status == StatusCode::OK, "GET /workers: {status}");
    let listed = listed.as_array().map_or(0, Vec::len) as u64;
    let (ready, _) = call(&mut conn, Method::GET, "/ready", Bytes::new()).await?;
    let bodies = prompts(64, 256);
    let selects = 2_000;
    let make: Arc<BodyFn> = Arc::new(move |i| {
        let body = format!("{}}}", bodies[(i % 64) as usize]);
        (Method::POST, "/select".to_owned(), Bytes::from(body))
    });
    let selected = hammer(server.addr, args.connections, selects, make).await?;
    sampler.finish().await?;
    let passed = listed == args.workers && ready == StatusCode::OK && selected.others(&[200]) == 0;
    Ok(Outcome {
        scenario: "workers",
        operations: format!("{} POST /workers, then {selects} /select", args.workers),
        duration: registered.elapsed + selected.elapsed,
        peak_rss_kib: peak_rss(&server),
        passed,
        result: format!(
            "{}: {listed} listed, registration {:.0}/s, /select over all of them {:.0}/s",
            verdict(passed),
            args.workers as f64 / registered.elapsed.as_secs_f64(),
            selects as f64 / selected.elapsed.as_secs_f64(),
        ),
    })
}

/// Blocks per published batch of `events` (one sequence of 16-token blocks).
const BATCH_BLOCKS: usize = 1_000;
/// Sequences an engine cycles through; it holds [`CAPACITY_SEQUENCES`] of them at a time.
const POOL_SEQUENCES: usize = 128;
const CAPACITY_SEQUENCES: usize = 100;

/// Pre-encoded batches of one engine: `fill[k]` stores sequence `k`; `steady[k]` removes
/// sequence `k - CAPACITY` (mod pool) and stores sequence `k`.
#[derive(Debug)]
struct EngineBatches {
    fill: Vec<Vec<u8>>,
    steady: Vec<Vec<u8>>,
}

impl EngineBatches {
    fn new(engine: u64) -> Result<Self> {
        let hashes = |k: usize| -> Vec<u64> {
            let base = (engine << 40) | ((k as u64) << 20);
            (0..BATCH_BLOCKS as u64).map(|b| base | b).collect()
        };
        let mut rng = rand::rng();
        let tokens: Vec<Vec<u32>> = (0..POOL_SEQUENCES)
            .map(|_| (0..BATCH_BLOCKS * 16).map(|_| token(&mut rng)).collect())
            .collect();
        let mut fill = Vec::with_capacity(POOL_SEQUENCES);
        let mut steady = Vec::with_capacity(POOL_SEQUENCES);
        for (k, tokens) in tokens.iter().enumerate() {
            let evict = (k + POOL_SEQUENCES - CAPACITY_SEQUENCES) % POOL_SEQUENCES;
            fill.push(encode_batch(None, &hashes(k), tokens)?);
            steady.push(encode_batch(Some(&hashes(evict)), &hashes(k), tokens)?);
        }
        Ok(Self { fill, steady })
    }

    fn batch(&self, j: usize) -> &[u8] {
        if j < CAPACITY_SEQUENCES {
            &self.fill[j]
        } else {
            &self.steady[j % POOL_SEQUENCES]
        }
    }
}

/// `[0.0, [["BlockRemoved", removed]?, ["BlockStored", stored, nil, tokens, 16]], nil]`.
fn encode_batch(removed: Option<&[u64]>, stored: &[u64], tokens: &[u32]) -> Result<Vec<u8>> {
    use rmp::encode::{write_array_len, write_f64, write_nil, write_str, write_uint};
    let mut b = Vec::with_capacity(tokens.len() * 3 + stored.len() * 18 + 64);
    let len = |n: usize| u32::try_from(n).context("array too long");
    write_array_len(&mut b, 3)?;
    write_f64(&mut b, 0.0)?;
    write_array_len(&mut b, if removed.is_some() { 2 } else { 1 })?;
    if let Some(removed) = removed {
        write_array_len(&mut b, 2)?;
        write_str(&mut b, "BlockRemoved")?;
        write_array_len(&mut b, len(removed.len())?)?;
        for &h in removed {
            write_uint(&mut b, h)?;
        }
    }
    write_array_len(&mut b, 5)?;
    write_str(&mut b, "BlockStored")?;
    write_array_len(&mut b, len(stored.len())?)?;
    for &h in stored {
        write_uint(&mut b, h)?;
    }
    write_nil(&mut b)?;
    write_array_len(&mut b, len(tokens.len())?)?;
    for &t in tokens {
        write_uint(&mut b, u64::from(t))?;
    }
    write_uint(&mut b, 16)?;
    write_nil(&mut b)?;
    Ok(b)
}

/// `[0.0, [], nil]`: a batch without events, used to wait for every subscription.
fn empty_batch() -> Result<Vec<u8>> {
    use rmp::encode::{write_array_len, write_f64, write_nil};
    let mut b = Vec::new();
    write_array_len(&mut b, 3)?;
    write_f64(&mut b, 0.0)?;
    write_array_len(&mut b, 0)?;
    write_nil(&mut b)?;
    Ok(b)
}

async fn events(args: &Args, binary: &std::path::Path) -> Result<Outcome> {
    ensure!(args.engines > 0, "--engines must be at least 1");
    let ctx = zmq::Context::new();
    let mut sockets = Vec::new();
    let mut endpoints = Vec::new();
    for _ in 0..args.engines {
        let s = ctx.socket(zmq::PUB)?;
        s.set_linger(0)?;
        s.bind("tcp://127.0.0.1:*")?;
        endpoints.push(
            s.get_last_endpoint()?
                .map_err(|_| anyhow::anyhow!("non-UTF-8 endpoint"))?,
        );
        sockets.push(s);
    }
    eprintln!("xtask flood:   encoding the engines' batches");
    let batches: Vec<EngineBatches> = (0..args.engines)
        .map(EngineBatches::new)
        .collect::<Result<_>>()?;

    let server = ServerProcess::start_with(binary, &[], &[])?;
    let endpoints = Arc::new(endpoints);
    let kv: Arc<dyn Fn(u64) -> String + Send + Sync> = {
        let endpoints = Arc::clone(&endpoints);
        Arc::new(move |id| endpoints[id as usize].clone())
    };
    register(server.addr, 1, args.engines, Some(kv)).await?;
    let mut conn = connect(server.addr).await?;
    // seq 0 (empty) until every listener has applied it: ZMQ drops what a SUB sends before
    // its subscription lands.
    let empty = empty_batch()?;
    let waited = Instant::now();
    loop {
        for s in &sockets {
            s.send_multipart([&b""[..], &0u64.to_be_bytes()[..], &empty[..]], 0)?;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let text = metrics(&mut conn).await?;
        if text
            .lines()
            .filter(|l| l.starts_with("kv_select_kv_batches_applied_total{"))
            .filter(|l| l.ends_with(" 1"))
            .count() as u64
            == args.engines
        {
            break;
        }
        ensure!(
            waited.elapsed() < Duration::from_secs(20),
            "the engines' subscriptions did not land within 20 s"
        );
    }

    let sampler = Sampler::start(&server);
    let batches_per_sec = args.blocks_per_sec as f64 / BATCH_BLOCKS as f64;
    let seconds = args.event_seconds;
    let engines = args.engines as usize;
    // The publisher is a plain thread: pacing needs sub-millisecond sleeps.
    let publisher = std::thread::spawn(move || -> Result<(u64, Duration)> {
        let started = Instant::now();
        let stop = Duration::from_secs(seconds);
        let mut sent = 0u64;
        while started.elapsed() < stop {
            let due = (started.elapsed().as_secs_f64() * batches_per_sec) as u64;
            if sent >= due {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
            let engine = (sent % engines as u64) as usize;
            let j = (sent / engines as u64) as usize;
            let seq = (j + 1) as u64;
            sockets[engine].send_multipart(
                [&b""[..], &seq.to_be_bytes()[..], batches[engine].batch(j)],
                0,
            )?;
            sent += 1;
        }
        Ok((sent, started.elapsed()))
    });
    let (sent, elapsed) = tokio::task::spawn_blocking(move || publisher.join())
        .await?
        .map_err(|_| anyhow::anyhow!("publisher panicked"))??;
    // Let the server drain what is queued: until the applied count stops moving.
    let mut applied = 0;
    let mut still = 0;
    let drain = Instant::now();
    while drain.elapsed() < Duration::from_secs(60) && still < 4 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = gauge(
            &metrics(&mut conn).await?,
            "kv_select_kv_batches_applied_total{",
        );
        still = if now == applied { still + 1 } else { 0 };
        applied = now;
    }
    sampler.finish().await?;
    let text = metrics(&mut conn).await?;
    let applied = applied.saturating_sub(args.engines); // the seq-0 probes
    let lost = gauge(&text, "kv_select_kv_batches_lost_total{");
    let dropped = gauge(&text, "kv_select_kv_dropped_batches_total{");
    let stored_ok = text
        .lines()
        .filter(|l| l.starts_with("kv_select_index_events_total{"))
        .filter(|l| l.contains("event_type=\"stored\"") && l.contains("status=\"ok\""))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum::<f64>() as u64;
    let passed = applied == sent && lost == 0 && dropped == 0;
    let blocks = sent * BATCH_BLOCKS as u64;
    Ok(Outcome {
        scenario: "events",
        operations: format!(
            "{blocks} blocks stored ({} engines, {BATCH_BLOCKS}/batch, oldest evicted at {} blocks each)",
            args.engines,
            CAPACITY_SEQUENCES * BATCH_BLOCKS
        ),
        duration: elapsed,
        peak_rss_kib: peak_rss(&server),
        passed,
        result: format!(
            "{}: published {:.2} M blocks/s; {applied}/{sent} batches applied, {lost} lost, {dropped} dropped, {stored_ok} stored ops ok; drained in {:.1?}",
            if passed { "ok" } else { "FELL BEHIND" },
            blocks as f64 / elapsed.as_secs_f64() / 1e6,
            drain.elapsed(),
        ),
    })
}

fn verdict(passed: bool) -> &'static str {
    if passed { "ok" } else { "FAIL" }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

#[expect(
    clippy::print_stdout,
    reason = "the results table is the task's output"
)]
fn print_table(outcomes: &[Outcome]) {
    println!(
        "{:<13} {:<60} {:>9} {:>14}  result",
        "scenario", "operations", "duration", "peak RSS (MiB)"
    );
    for o in outcomes {
        println!(
            "{:<13} {:<60} {:>8.1}s {:>14.1}  {}",
            o.scenario,
            o.operations,
            o.duration.as_secs_f64(),
            o.peak_rss_kib as f64 / 1024.0,
            o.result
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_match_whole_names_and_sum_labelled_series() {
        let text = "# TYPE x gauge\nkv_select_pending_selections 7\nkv_select_pending_selection_bytes 900\n\
                    kv_select_kv_batches_lost_total{worker_id=\"1\",dp_rank=\"0\"} 2\n\
                    kv_select_kv_batches_lost_total{worker_id=\"2\",dp_rank=\"0\"} 3\n";
        assert_eq!(gauge(text, "kv_select_pending_selections"), 7);
        assert_eq!(gauge(text, "kv_select_pending_selection_bytes"), 900);
        assert_eq!(gauge(text, "kv_select_kv_batches_lost_total{"), 5);
        assert_eq!(gauge(text, "kv_select_pending"), 0);
    }

    #[test]
    fn engine_batches_evict_the_sequence_stored_capacity_steps_earlier() {
        let b = EngineBatches::new(0).unwrap();
        assert_eq!(b.fill.len(), POOL_SEQUENCES);
        // The first CAPACITY batches only store; later ones remove then store.
        let first: rmpv::Value = rmpv::decode::read_value(&mut b.batch(0)).unwrap();
        assert_eq!(first[1].as_array().unwrap().len(), 1);
        let later: rmpv::Value =
            rmpv::decode::read_value(&mut b.batch(CAPACITY_SEQUENCES)).unwrap();
        let events = later[1].as_array().unwrap();
        assert_eq!(events[0][0].as_str(), Some("BlockRemoved"));
        assert_eq!(events[0][1][0].as_u64(), Some(0));
        assert_eq!(
            events[1][1][0].as_u64(),
            Some((CAPACITY_SEQUENCES as u64) << 20)
        );
        assert_eq!(events[1][3].as_array().unwrap().len(), BATCH_BLOCKS * 16);
    }

    #[test]
    fn arguments_parse() {
        let a = Args::try_parse_from(["flood", "pending", "events", "--requests", "10"]).unwrap();
        assert_eq!(a.scenarios, [Scenario::Pending, Scenario::Events]);
        assert_eq!(a.requests, 10);
        let d = Args::try_parse_from(["flood"]).unwrap();
        assert!(d.scenarios.is_empty());
        assert_eq!((d.workers, d.blocks_per_sec), (10_000, 1_000_000));
    }
}
