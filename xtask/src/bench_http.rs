//! `cargo xtask bench http`: end-to-end load test of `POST /select` (docs/hot-path.md).
//!
//! Builds the release `select-server`, starts it on a free loopback port in approximate mode
//! (`DYN_ROUTER_USE_KV_EVENTS=false`, so no engine or ZMQ publisher is needed), registers
//! [`WORKERS`] workers, gives each a cached 2,048-token prefix by booking it with
//! `/select_and_reserve` pinned to that worker (then freeing the booking, so only the
//! recorded blocks remain), and drives `POST /select` with 2,048-token bodies for a fixed time
//! at each requested connection count. The load generator is a small hyper 1 client on a
//! single-threaded tokio runtime: one keep-alive HTTP/1.1 connection per simulated client,
//! requests back to back, every latency recorded and sorted for the percentiles.
//!
//! With `--lifecycle` each request is instead a booking and its release, what a router
//! does per model request: `POST /select_and_reserve` with the same bodies, then
//! `DELETE /reservations/{id}`. `--sessions` turns session affinity on in the server and
//! gives every body a session of its own (as agentic clients send), so each booking goes
//! through the session table. `--queue-threshold` turns the admission queue on (never
//! reached by the bench's load: it measures admission, not waiting).
//!
//! The server and the load generator share the machine's cores, so the figures are a lower
//! bound of what the server alone sustains; `--perf` records a profile of the server during
//! the last run (`perf record -g`), for `perf report --no-children`.

use std::net::{SocketAddr, TcpListener as StdListener, TcpStream as StdStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use clap::Parser;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

/// Workers registered with the server, each holding one cached prefix.
const WORKERS: u64 = 8;
/// Tokens per KV block of every worker (2,048 tokens = 128 blocks).
const BLOCK_SIZE: usize = 16;
/// Tokens per `/select` body.
const PROMPT_TOKENS: usize = 2048;
/// Distinct request bodies cycled through (pre-serialized, so the client does no JSON work).
const BODIES: usize = 64;

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask bench http",
    about = "Load-test POST /select of the release select-server over loopback"
)]
struct Args {
    /// Measured seconds per connection count (after a 1 s warm-up).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Comma-separated connection counts, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16])]
    connections: Vec<usize>,
    /// Use this server binary instead of building target/release/select-server
    /// (e.g. a saved copy of an older build, for before/after comparisons).
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// Record a `perf record -g` profile of the server during the last run into this file
    /// (with `--wrk`: select-server's last round at the first connection count).
    #[arg(long, value_name = "PATH")]
    perf: Option<PathBuf>,
    /// Drive the load from this (debug) build of the xtask instead of rerunning it as a
    /// release build first.
    #[arg(long)]
    debug_client: bool,
    /// Drive a minimal hyper server instead of select-server: it reads each body and answers
    /// a fixed selection. Its figures are the ceiling that this machine's loopback TCP, hyper
    /// and the load generator allow, whatever the server computes.
    #[arg(long, conflicts_with_all = ["binary", "perf"])]
    ceiling: bool,
    /// Drive the booking lifecycle instead of `/select`: each request is a
    /// `POST /select_and_reserve` (same bodies) followed by `DELETE /reservations/{id}`, and
    /// the latency is the pair's.
    #[arg(long, conflicts_with = "ceiling")]
    lifecycle: bool,
    /// Start the server with session affinity on (`--session-affinity-ttl-secs 600`) and
    /// give each of the request bodies its own `session_id`.
    #[arg(long, conflicts_with = "ceiling")]
    sessions: bool,
    /// Start the server with the admission queue on (`DYN_ROUTER_QUEUE_THRESHOLD`). The
    /// workers' prefill capacity (1,000,000 tokens) keeps them below any threshold the
    /// bench reaches, so this measures the cost of admission itself, not waiting.
    #[arg(long, value_name = "FRACTION", conflicts_with = "ceiling")]
    queue_threshold: Option<f64>,
    /// Drive the load with `wrk` (one thread) instead of the built-in generator, against
    /// select-server and the ceiling server in alternating rounds, and print both with
    /// their ratio (bench_wrk.rs). Needs the `wrk` binary.
    #[arg(long, conflicts_with_all = ["ceiling", "lifecycle", "sessions", "debug_client"])]
    wrk: bool,
    /// Rounds per server and connection count with `--wrk` (the table gives medians).
    #[arg(long, default_value_t = 3, requires = "wrk")]
    rounds: usize,
    /// With `--wrk`: run wrk on the last CPU this process may use and both servers on the
    /// others (`taskset`), so the generator never preempts a server thread. select-server
    /// and the ceiling server size their threads to the CPUs they are given.
    #[arg(long, requires = "wrk")]
    pin: bool,
    /// An extra select-server flag (repeatable), e.g. `--server-arg=--http-threads=1`.
    #[arg(long = "server-arg", value_name = "FLAG", allow_hyphen_values = true)]
    server_args: Vec<String>,
    /// Internal: serve the ceiling server on this address until killed.
    #[arg(long, hide = true, value_name = "ADDR")]
    serve_ceiling: Option<SocketAddr>,
}

/// Entry point of `cargo xtask bench http ARGS`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let args_as_given = args;
    let Some(args) = crate::parse_task_args::<Args>("cargo xtask bench http", args)? else {
        return Ok(());
    };
    ensure!(args.seconds > 0, "--seconds must be at least 1");
    ensure!(
        !args.connections.is_empty() && args.connections.iter().all(|&c| c > 0),
        "--connections must list positive counts"
    );
    if let Some(addr) = args.serve_ceiling {
        return serve_ceiling(addr);
    }
    if cfg!(debug_assertions) && !args.debug_client {
        // `cargo xtask` builds the xtask with opt-level 1 dependencies; a load generator
        // built that way spends several times the CPU of a release one per request, and on
        // two shared cores that CPU is taken from the server. The ceiling server (`--wrk`)
        // is this binary too, and must be as optimized as select-server. Rerun as a
        // release build.
        let mut rerun = vec!["run", "--release", "-p", "xtask", "--", "bench", "http"];
        rerun.extend(args_as_given.iter().map(String::as_str));
        return crate::cargo(&rerun, &[]);
    }
    if args.wrk {
        return with_wrk(&args);
    }
    let server = if args.ceiling {
        ServerProcess::start_ceiling(None)?
    } else {
        let binary = match &args.binary {
            Some(path) => path.clone(),
            None => {
                crate::cargo(&["build", "--release", "-p", "select-server"], &[])?;
                crate::root().join("target/release/select-server")
            }
        };
        ServerProcess::start(
            &binary,
            args.sessions,
            args.queue_threshold,
            &args.server_args,
            None,
        )?
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the client runtime")?;
    let results = runtime.block_on(drive(&args, &server))?;
    print_results(&results);
    Ok(())
}

/// `--wrk`: both servers up at once, the real one populated, then alternating wrk rounds.
fn with_wrk(args: &Args) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    crate::bench_wrk::check_installed()?;
    let binary = match &args.binary {
        Some(path) => path.clone(),
        None => {
            crate::cargo(&["build", "--release", "-p", "select-server"], &[])?;
            crate::root().join("target/release/select-server")
        }
    };
    let pinning = if args.pin {
        Some(crate::bench_wrk::Pinning::split()?)
    } else {
        None
    };
    let server_cpus = pinning.as_ref().map(|p| p.servers.as_str());
    let ours = ServerProcess::start(
        &binary,
        false,
        args.queue_threshold,
        &args.server_args,
        server_cpus,
    )?;
    let ceiling = ServerProcess::start_ceiling(server_cpus)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the client runtime")?;
    let bodies = runtime.block_on(async {
        let prefixes = populate(ours.addr).await?;
        let bodies = request_bodies(&prefixes, false);
        let mut probe = connect(ours.addr).await?;
        let (status, answer) = call(&mut probe, Method::POST, "/select", bodies[0].clone()).await?;
        ensure!(status == StatusCode::OK, "probe /select: {status} {answer}");
        ensure!(
            answer["overlap"]["gpu"].as_u64().unwrap_or(0) > 0,
            "probe /select found no cached blocks: {answer}"
        );
        Ok::<_, anyhow::Error>(bodies)
    })?;
    let plan = crate::bench_wrk::Plan {
        connections: &args.connections,
        seconds: args.seconds,
        rounds: args.rounds,
        perf: args.perf.as_deref(),
        generator_cpus: pinning.as_ref().map(|p| p.generator.as_str()),
    };
    let rounds = crate::bench_wrk::run(&ours, &ceiling, &bodies, &plan)?;
    print_table(&crate::bench_wrk::table(&rounds));
    Ok(())
}

#[expect(
    clippy::print_stdout,
    reason = "the results table is the task's output"
)]
fn print_table(table: &str) {
    print!("{table}");
}

/// One measured run.
#[derive(Debug)]
struct RunResult {
    connections: usize,
    requests: usize,
    errors: usize,
    elapsed: Duration,
    /// Sorted ascending.
    latencies: Vec<Duration>,
    /// CPU time the server process used during the run (Linux only): on a shared machine
    /// CPU per request is steadier than requests per second.
    server_cpu: Option<Duration>,
    /// CPU time of this load generator during the run: on a small machine it competes with
    /// the server for the same cores, so the two together bound the rate.
    client_cpu: Option<Duration>,
}

impl RunResult {
    fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((self.latencies.len() - 1) as f64 * p / 100.0).round() as usize;
        self.latencies[rank.min(self.latencies.len() - 1)]
    }

    fn rate(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }

    /// CPU microseconds per request of `cpu`.
    fn per_request(&self, cpu: Option<Duration>) -> Option<f64> {
        let cpu = cpu?;
        (self.requests > 0).then(|| cpu.as_secs_f64() * 1e6 / self.requests as f64)
    }
}

async fn drive(args: &Args, server: &ServerProcess) -> Result<Vec<RunResult>> {
    let addr = server.addr;
    let prefixes = if !args.ceiling {
        populate(addr).await?
    } else {
        // Bodies of the same shape; the ceiling server does not look at them.
        let mut rng = rand::rng();
        (0..WORKERS)
            .map(|_| (0..PROMPT_TOKENS).map(|_| token(&mut rng)).collect())
            .collect()
    };
    let bodies = Arc::new(request_bodies(&prefixes, args.sessions));
    let mut probe = connect(addr).await?;
    let (status, answer) = call(&mut probe, Method::POST, "/select", bodies[0].clone()).await?;
    ensure!(status == StatusCode::OK, "probe /select: {status} {answer}");
    // The cache must actually be hit, or the index walk is not exercised.
    let gpu = answer["overlap"]["gpu"].as_u64().unwrap_or(0);
    ensure!(
        args.ceiling || gpu > 0,
        "probe /select found no cached blocks: {answer}"
    );
    eprintln!(
        "xtask bench http: probe selected worker {} with overlap {} tokens",
        answer["worker_id"], gpu
    );

    let mut results = Vec::new();
    for (i, &connections) in args.connections.iter().enumerate() {
        eprintln!("xtask bench http: {connections} connection(s), 1 s warm-up");
        load(
            addr,
            &bodies,
            connections,
            Duration::from_secs(1),
            args.lifecycle,
        )
        .await?;
        let last = i + 1 == args.connections.len();
        let perf = match (&args.perf, last) {
            (Some(out), true) => Some(PerfRecorder::start(server.pid(), out, args.seconds)?),
            _ => None,
        };
        eprintln!(
            "xtask bench http: {connections} connection(s), {} s measured",
            args.seconds
        );
        let cpu_before = server.cpu_time();
        let client_before = process_cpu_time(std::process::id());
        let mut run = load(
            addr,
            &bodies,
            connections,
            Duration::from_secs(args.seconds),
            args.lifecycle,
        )
        .await?;
        run.server_cpu = server
            .cpu_time()
            .zip(cpu_before)
            .map(|(a, b)| a.saturating_sub(b));
        run.client_cpu = process_cpu_time(std::process::id())
            .zip(client_before)
            .map(|(a, b)| a.saturating_sub(b));
        if let Some(perf) = perf {
            perf.finish()?;
        }
        ensure!(
            run.errors == 0,
            "{} of {} requests failed",
            run.errors,
            run.requests
        );
        results.push(run);
    }
    Ok(results)
}

/// Registers the workers and books each worker's prefix on it; returns the prefixes.
async fn populate(addr: SocketAddr) -> Result<Vec<Vec<u32>>> {
    let mut conn = connect(addr).await?;
    for id in 0..WORKERS {
        let worker = json!({
            "worker_id": id,
            "endpoint": format!("http://127.0.0.1:1/w{id}"),
            "block_size": BLOCK_SIZE,
            "total_kv_blocks": 1_000_000,
            "max_num_batched_tokens": 1_000_000,
        });
        let (status, body) = call_json(&mut conn, Method::POST, "/workers", &worker).await?;
        ensure!(
            status == StatusCode::CREATED,
            "POST /workers: {status} {body}"
        );
    }
    let (status, body) = call(&mut conn, Method::GET, "/ready", Bytes::new()).await?;
    ensure!(status == StatusCode::OK, "GET /ready: {status} {body}");

    let mut rng = rand::rng();
    // A system prompt shared by every worker's prefix, so the walk branches after it.
    let shared: Vec<u32> = (0..256).map(|_| token(&mut rng)).collect();
    let mut prefixes = Vec::new();
    for id in 0..WORKERS {
        let mut prefix = shared.clone();
        prefix.extend((shared.len()..PROMPT_TOKENS).map(|_| token(&mut rng)));
        let req = json!({
            "token_ids": prefix,
            "pinned_worker": {"worker_id": id, "dp_rank": 0},
        });
        let (status, body) =
            call_json(&mut conn, Method::POST, "/select_and_reserve", &req).await?;
        ensure!(
            status == StatusCode::OK,
            "POST /select_and_reserve: {status} {body}"
        );
        let id = body["selection_id"]
            .as_str()
            .context("/select_and_reserve answered without a selection_id")?;
        let path = format!("/reservations/{id}");
        let (status, body) = call(&mut conn, Method::DELETE, &path, Bytes::new()).await?;
        ensure!(status == StatusCode::OK, "DELETE {path}: {status} {body}");
        prefixes.push(prefix);
    }
    Ok(prefixes)
}

/// Bodies of `/select`: a worker's prefix cut after 512, 1,024, 1,536 or 2,048 tokens, then
/// fresh tokens up to [`PROMPT_TOKENS`], so the walk stops at different depths. With
/// `sessions`, body `i` carries `"session_id": "session-i"`.
fn request_bodies(prefixes: &[Vec<u32>], sessions: bool) -> Vec<Bytes> {
    let mut rng = rand::rng();
    (0..BODIES)
        .map(|i| {
            let prefix = &prefixes[i % prefixes.len()];
            let keep = PROMPT_TOKENS / 4 * (1 + (i / prefixes.len()) % 4);
            let mut tokens: Vec<u32> = prefix[..keep].to_vec();
            tokens.extend((keep..PROMPT_TOKENS).map(|_| token(&mut rng)));
            let body = if sessions {
                json!({ "token_ids": tokens, "session_id": format!("session-{i}") })
            } else {
                json!({ "token_ids": tokens })
            };
            Bytes::from(body.to_string())
        })
        .collect()
}

/// Runs `connections` clients sending requests back to back for `duration` (with
/// `lifecycle`, booking-and-free pairs).
async fn load(
    addr: SocketAddr,
    bodies: &Arc<Vec<Bytes>>,
    connections: usize,
    duration: Duration,
    lifecycle: bool,
) -> Result<RunResult> {
    let mut senders = Vec::with_capacity(connections);
    for _ in 0..connections {
        senders.push(connect(addr).await?);
    }
    let started = Instant::now();
    let deadline = tokio::time::Instant::from_std(started + duration);
    let mut tasks = Vec::with_capacity(connections);
    for (c, mut sender) in senders.into_iter().enumerate() {
        let bodies = Arc::clone(bodies);
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(1 << 16);
            let mut errors = 0usize;
            let mut i = c;
            while tokio::time::Instant::now() < deadline {
                let body = bodies[i % bodies.len()].clone();
                i += 1;
                let t = Instant::now();
                let outcome = if lifecycle {
                    book_and_free(&mut sender, body).await
                } else {
                    send(&mut sender, Method::POST, "/select", body)
                        .await
                        .map(|(status, _)| status == StatusCode::OK)
                };
                latencies.push(t.elapsed());
                match outcome {
                    Ok(true) => {}
                    Ok(false) => errors += 1,
                    Err(e) => return Err(e),
                }
            }
            Ok::<_, anyhow::Error>((latencies, errors))
        }));
    }
    let mut latencies = Vec::new();
    let mut errors = 0;
    for task in tasks {
        let (l, e) = task.await.context("client task panicked")??;
        latencies.extend(l);
        errors += e;
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    Ok(RunResult {
        connections,
        requests: latencies.len(),
        errors,
        elapsed,
        latencies,
        server_cpu: None,
        client_cpu: None,
    })
}

/// `POST /select_and_reserve` then `DELETE /reservations/{id}` of the booking it made;
/// whether both succeeded.
async fn book_and_free(sender: &mut Sender, body: Bytes) -> Result<bool> {
    let (status, booked) = call(sender, Method::POST, "/select_and_reserve", body).await?;
    let Some(id) = booked["selection_id"]
        .as_str()
        .filter(|_| status == StatusCode::OK)
    else {
        return Ok(false);
    };
    let path = format!("/reservations/{id}");
    let (status, _) = send(sender, Method::DELETE, &path, Bytes::new()).await?;
    Ok(status == StatusCode::OK)
}

pub(crate) type Sender = SendRequest<Full<Bytes>>;

pub(crate) async fn connect(addr: SocketAddr) -> Result<Sender> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP/1.1 handshake")?;
    tokio::spawn(async move {
        // The connection ends when its sender is dropped; an error then is not interesting.
        let _ = conn.await;
    });
    Ok(sender)
}

/// One request; returns the status and the raw body.
pub(crate) async fn send(
    sender: &mut Sender,
    method: Method,
    path: &str,
    body: Bytes,
) -> Result<(StatusCode, Bytes)> {
    sender.ready().await.context("connection closed")?;
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, "127.0.0.1")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(body))?;
    let resp = sender.send_request(req).await.context("request failed")?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

pub(crate) async fn call(
    sender: &mut Sender,
    method: Method,
    path: &str,
    body: Bytes,
) -> Result<(StatusCode, Value)> {
    let (status, raw) = send(sender, method, path, body).await?;
    let value = serde_json::from_slice(&raw)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&raw).into_owned()));
    Ok((status, value))
}

pub(crate) async fn call_json(
    sender: &mut Sender,
    method: Method,
    path: &str,
    body: &Value,
) -> Result<(StatusCode, Value)> {
    call(sender, method, path, Bytes::from(body.to_string())).await
}

#[expect(
    clippy::print_stdout,
    reason = "the results table is the task's output"
)]
fn print_results(results: &[RunResult]) {
    println!(
        "connections  requests      req/s   p50 (µs)   p99 (µs)  p99.9 (µs)   max (µs)  errors  server CPU µs/req  client CPU µs/req"
    );
    for r in results {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let fmt = |c: Option<f64>| c.map_or_else(|| "n/a".to_owned(), |c| format!("{c:.1}"));
        let cpu = fmt(r.per_request(r.server_cpu));
        let client = fmt(r.per_request(r.client_cpu));
        println!(
            "{:>11}  {:>8}  {:>9.0}  {:>9.0}  {:>9.0}  {:>10.0}  {:>9.0}  {:>6}  {cpu:>17}  {client:>17}",
            r.connections,
            r.requests,
            r.rate(),
            us(r.percentile(50.0)),
            us(r.percentile(99.0)),
            us(r.percentile(99.9)),
            us(r.latencies.last().copied().unwrap_or_default()),
            r.errors,
        );
    }
}

/// A random token id below a realistic vocabulary size. Load tests need prompts that
/// differ from each other, not the same prompts on every run, so this is `rand`'s.
pub(crate) fn token(rng: &mut impl rand::RngExt) -> u32 {
    rng.random_range(0..128_000)
}

/// The server child process; killed when dropped, so an error anywhere stops it.
#[derive(Debug)]
pub(crate) struct ServerProcess {
    child: Child,
    pub(crate) addr: SocketAddr,
}

impl ServerProcess {
    fn start(
        binary: &std::path::Path,
        sessions: bool,
        queue_threshold: Option<f64>,
        extra: &[String],
        cpus: Option<&str>,
    ) -> Result<Self> {
        let mut flags: Vec<&str> = if sessions {
            vec!["--session-affinity-ttl-secs", "600"]
        } else {
            Vec::new()
        };
        flags.extend(extra.iter().map(String::as_str));
        let threshold = queue_threshold.map(|t| t.to_string());
        let mut envs = vec![
            ("DYN_ROUTER_USE_KV_EVENTS", "false"),
            // Recorded prefixes must outlive every run.
            ("DYN_ROUTER_TTL_SECS", "3600"),
        ];
        if let Some(t) = &threshold {
            envs.push(("DYN_ROUTER_QUEUE_THRESHOLD", t));
        }
        let addr = free_loopback_addr()?;
        Self::spawn(Self::command(binary, addr, &flags, &envs, cpus), addr)
    }

    /// Starts `binary` on a free loopback port with extra flags and environment.
    pub(crate) fn start_with(
        binary: &std::path::Path,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Result<Self> {
        let addr = free_loopback_addr()?;
        Self::spawn(Self::command(binary, addr, args, envs, None), addr)
    }

    /// select-server on `addr`, under `taskset -c CPUS` when given (taskset execs it, so the
    /// child's pid is the server's).
    fn command(
        binary: &std::path::Path,
        addr: SocketAddr,
        args: &[&str],
        envs: &[(&str, &str)],
        cpus: Option<&str>,
    ) -> Command {
        let mut command = pinned(binary.as_os_str(), cpus);
        command
            .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
            .args(args)
            .envs(envs.iter().copied())
            .env("RUST_LOG", "warn");
        command
    }

    /// Starts this xtask's ceiling server (`--serve-ceiling`) on a free loopback port.
    fn start_ceiling(cpus: Option<&str>) -> Result<Self> {
        let addr = free_loopback_addr()?;
        let exe = std::env::current_exe().context("cannot locate the running xtask")?;
        let mut command = pinned(exe.as_os_str(), cpus);
        command.args(["bench", "http", "--serve-ceiling", &addr.to_string()]);
        Self::spawn(command, addr)
    }

    /// Spawns `command` and waits until `addr` accepts connections.
    fn spawn(mut command: Command, addr: SocketAddr) -> Result<Self> {
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("failed to start {:?}", command.get_program()))?;
        let mut server = ServerProcess { child, addr };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if StdStream::connect(addr).is_ok() {
                eprintln!("xtask: server pid {} listening on {addr}", server.pid());
                return Ok(server);
            }
            if let Some(status) = server.child.try_wait()? {
                bail!("the server exited during startup ({status})");
            }
            if Instant::now() > deadline {
                bail!("the server did not listen on {addr} within 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// User + system CPU time of the server so far (Linux only).
    pub(crate) fn cpu_time(&self) -> Option<Duration> {
        process_cpu_time(self.pid())
    }

    /// Minor page faults of the server so far (Linux only).
    pub(crate) fn minor_faults(&self) -> Option<u64> {
        process_minor_faults(self.pid())
    }
}

/// `program` itself, or `taskset -c CPUS program` (util-linux, on every Debian).
pub(crate) fn pinned(program: &std::ffi::OsStr, cpus: Option<&str>) -> Command {
    match cpus {
        Some(cpus) => {
            let mut command = Command::new("taskset");
            command.args(["-c", cpus]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// A loopback address whose port was free a moment ago.
fn free_loopback_addr() -> Result<SocketAddr> {
    let port = StdListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("no free loopback port")?
        .port();
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// A `/select` answer of the shape and size select-server gives for these bodies.
const CEILING_ANSWER: &str = concat!(
    r#"{"worker_id":0,"dp_rank":0,"overlap":{"gpu":512,"host":0,"disk":0,"#,
    r#""dp":{"0":512}},"effective_prefill_tokens":1536,"potential_decode_blocks":128,"#,
    r#""worker_load":{"active_prefill_tokens":0,"prefill_token_capacity":1000000,"#,
    r#""total_kv_blocks":1000000}}"#
);

/// The ceiling server: multi-threaded tokio with one worker per CPU it may use (as many as
/// select-server's serving threads), hyper HTTP/1.1 per connection, reading every body whole
/// and answering [`CEILING_ANSWER`]. Runs until the process is killed.
fn serve_ceiling(addr: SocketAddr) -> Result<()> {
    use hyper::server::conn::http1;
    let workers = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .context("failed to start the ceiling server's runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind {addr}"))?;
        loop {
            let (stream, _) = listener.accept().await.context("accept")?;
            stream.set_nodelay(true)?;
            let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| async {
                let body = req.into_body().collect().await?.to_bytes();
                let status = if body.is_empty() {
                    StatusCode::BAD_REQUEST
                } else {
                    StatusCode::OK
                };
                let mut resp =
                    hyper::Response::new(Full::new(Bytes::from_static(CEILING_ANSWER.as_bytes())));
                *resp.status_mut() = status;
                resp.headers_mut().insert(
                    header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                Ok::<_, hyper::Error>(resp)
            });
            tokio::spawn(async move {
                // A connection ends when the load generator drops it.
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    })
}

/// User + system CPU time of process `pid` so far, from `/proc/<pid>/stat` (fields 14 and
/// 15, in clock ticks; 100 Hz on every Linux this runs on). `None` elsewhere.
fn process_cpu_time(pid: u32) -> Option<Duration> {
    let [utime, stime] = stat_fields(pid, 14)?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// Minor page faults of process `pid` so far (`/proc/<pid>/stat` field 10): on a VM whose
/// fresh pages are expensive, the figure that says how much of a run went to growing
/// memory.
pub(crate) fn process_minor_faults(pid: u32) -> Option<u64> {
    let [minflt] = stat_fields(pid, 10)?;
    Some(minflt)
}

/// One thread of a process at one moment: what it has run and waited for so far.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ThreadTimes {
    pub(crate) tid: u32,
    pub(crate) name: String,
    /// User + system CPU time.
    pub(crate) cpu: Duration,
    /// Time it was runnable but waited for a core (`schedstat`'s second field; `None`
    /// where the kernel keeps no scheduler statistics).
    pub(crate) waited: Option<Duration>,
}

/// [`ThreadTimes`] of each thread of process `pid` so far (Linux only; empty elsewhere).
pub(crate) fn thread_cpu_times(pid: u32) -> Vec<ThreadTimes> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|task| {
            let task = task.ok()?;
            let tid: u32 = task.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            let name = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?.to_owned();
            let [utime, stime] = parse_stat_fields(&stat, 14)?;
            let waited = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| schedstat_field(&s, 1))
                .map(Duration::from_nanos);
            Some(ThreadTimes {
                tid,
                name,
                cpu: Duration::from_millis((utime + stime) * 10),
                waited,
            })
        })
        .collect()
}

/// Field `i` of a `schedstat` file's text (0: nanoseconds on a core, 1: nanoseconds
/// runnable but waiting for one, 2: time slices).
pub(crate) fn schedstat_field(text: &str, i: usize) -> Option<u64> {
    text.split_ascii_whitespace().nth(i)?.parse().ok()
}

/// `N` numeric fields of `/proc/<pid>/stat` from field number `first` (1-based, as
/// proc(5) numbers them; `first` > 2).
fn stat_fields<const N: usize>(pid: u32, first: usize) -> Option<[u64; N]> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_fields(&stat, first)
}

/// `N` numeric fields of a proc(5) `stat` line from field number `first` (> 2).
fn parse_stat_fields<const N: usize>(stat: &str, first: usize) -> Option<[u64; N]> {
    // The command name (field 2) may contain spaces; the fields after it are plain.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = rest.split_ascii_whitespace().skip(first.checked_sub(3)?);
    let mut out = [0; N];
    for slot in &mut out {
        *slot = fields.next()?.parse().ok()?;
    }
    Some(out)
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `perf record -g -p <server>` for the length of one run.
#[derive(Debug)]
pub(crate) struct PerfRecorder {
    child: Child,
}

impl PerfRecorder {
    pub(crate) fn start(pid: u32, out: &std::path::Path, seconds: u64) -> Result<Self> {
        let child = Command::new("perf")
            .args(["record", "-g", "-F", "999", "-o"])
            .arg(out)
            .args(["-p", &pid.to_string(), "--", "sleep", &seconds.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("failed to start perf (is linux-perf installed?)")?;
        Ok(Self { child })
    }

    pub(crate) fn finish(mut self) -> Result<()> {
        let status = self.child.wait()?;
        ensure!(status.success(), "perf record failed ({status})");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank() {
        let run = RunResult {
            connections: 1,
            requests: 101,
            errors: 0,
            elapsed: Duration::from_secs(1),
            latencies: (0..=100).map(Duration::from_micros).collect(),
            server_cpu: Some(Duration::from_micros(202)),
            client_cpu: None,
        };
        assert_eq!(run.percentile(50.0), Duration::from_micros(50));
        assert_eq!(run.percentile(99.0), Duration::from_micros(99));
        assert_eq!(run.rate(), 101.0);
        assert_eq!(run.per_request(run.server_cpu), Some(2.0));
        assert_eq!(run.per_request(run.client_cpu), None);
    }

    #[test]
    fn bodies_have_the_prompt_length_and_cut_prefixes_at_four_depths() {
        let prefixes: Vec<Vec<u32>> = (0..WORKERS as u32)
            .map(|w| vec![w; PROMPT_TOKENS])
            .collect();
        let bodies = request_bodies(&prefixes, false);
        assert_eq!(bodies.len(), BODIES);
        let mut kept = std::collections::BTreeSet::new();
        for (i, b) in bodies.iter().enumerate() {
            let v: Value = serde_json::from_slice(b).unwrap();
            let tokens = v["token_ids"].as_array().unwrap();
            assert_eq!(tokens.len(), PROMPT_TOKENS);
            let w = (i % prefixes.len()) as u64;
            kept.insert(tokens.iter().take_while(|t| t.as_u64() == Some(w)).count() / 512);
        }
        assert_eq!(kept.into_iter().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    }

    #[test]
    fn arguments_parse() {
        let a = Args::try_parse_from(["x", "--seconds", "3", "--connections", "1,4,16"]).unwrap();
        assert_eq!((a.seconds, a.connections), (3, vec![1, 4, 16]));
        let d = Args::try_parse_from(["x"]).unwrap();
        assert_eq!((d.seconds, d.connections), (10, vec![1, 16]));
        assert!(!d.ceiling && d.serve_ceiling.is_none());
        assert!(Args::try_parse_from(["x", "--ceiling"]).unwrap().ceiling);
        assert!(
            Args::try_parse_from(["x", "--lifecycle"])
                .unwrap()
                .lifecycle
        );
        // The ceiling server answers only `/select`.
        assert!(Args::try_parse_from(["x", "--ceiling", "--lifecycle"]).is_err());
        assert!(Args::try_parse_from(["x", "--ceiling", "--sessions"]).is_err());
        let queued = Args::try_parse_from(["x", "--queue-threshold", "0.9"]).unwrap();
        assert_eq!(queued.queue_threshold, Some(0.9));
        assert!(
            Args::try_parse_from(["x", "--lifecycle", "--sessions"])
                .unwrap()
                .sessions
        );
        // The ceiling server is the xtask's own: no other binary, no server profile.
        assert!(Args::try_parse_from(["x", "--ceiling", "--binary", "/bin/true"]).is_err());
        let w = Args::try_parse_from(["x", "--wrk", "--rounds", "5"]).unwrap();
        assert!(w.wrk && w.rounds == 5);
        assert!(Args::try_parse_from(["x", "--wrk", "--lifecycle"]).is_err());
        let p = Args::try_parse_from(["x", "--wrk", "--perf", "out.data"]).unwrap();
        assert!(p.wrk && p.perf.is_some());
        assert!(
            Args::try_parse_from(["x", "--pin"]).is_err(),
            "--pin needs --wrk"
        );
        let a =
            Args::try_parse_from(["x", "--wrk", "--pin", "--server-arg=--http-threads=1"]).unwrap();
        assert!(a.pin && a.server_args == ["--http-threads=1"]);
        assert!(Args::try_parse_from(["x", "--rounds", "5"]).is_err());
        let serve = Args::try_parse_from(["x", "--serve-ceiling", "127.0.0.1:9"]).unwrap();
        assert_eq!(
            serve.serve_ceiling,
            Some(SocketAddr::from(([127, 0, 0, 1], 9)))
        );
    }

    #[test]
    fn ceiling_server_answers_a_selection_shaped_json() {
        let answer: Value = serde_json::from_str(CEILING_ANSWER).unwrap();
        assert!(answer["overlap"]["gpu"].as_u64().unwrap() > 0);
        assert!(answer["worker_id"].is_u64());
    }
}
