//! The ZMQ listener: one SUB socket per publisher stream, sequence watermark, gap detection
//! and replay over DEALER (`spec/kv-events.md` §2, §10). One OS thread per listener, blocked
//! in `zmq_poll` on its sockets and a wake pipe: stop and open requests write to the pipe, so
//! they take effect at once, and an idle listener wakes only every [`IDLE_POLL_MS`].

use std::io::{PipeReader, PipeWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_types::{KvOperation, KvOperationKind, WorkerKey};
use parking_lot::Mutex;

use crate::decode::{FrameError, parse_live_frames, parse_seq};
use crate::endpoint::{EndpointError, validate_endpoint};
use crate::normalize::{LogLimiter, Normalizer};
use crate::stats::{DropReason, ListenerStats};
use crate::watermark::{SeqObservation, Watermark};

/// Receives the operations of each applied batch, in publisher order. Called from the
/// listener's thread; it must not block for long (the SUB queue fills meanwhile).
pub trait KvEventSink: Send + Sync + 'static {
    /// All operations of one batch (possibly empty when every event was filtered).
    fn apply(&self, ops: &[KvOperation]);
}

impl<F> KvEventSink for F
where
    F: Fn(&[KvOperation]) + Send + Sync + 'static,
{
    fn apply(&self, ops: &[KvOperation]) {
        self(ops)
    }
}

/// Default wait for a replay to finish before it is abandoned.
pub const DEFAULT_REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Default cap of one ZMQ frame; a larger message is discarded by libzmq (and the
/// connection reset), which bounds what a hostile publisher can make us buffer.
pub const DEFAULT_MAX_MESSAGE_SIZE: i64 = 64 * 1024 * 1024;

/// Longest wait of an idle listener. Stop and open requests wake it through its pipe, so
/// this only bounds the idle wake-ups: with a 100 ms slice, 1,200 idle listeners took about
/// a quarter of a core.
const IDLE_POLL_MS: i64 = 5_000;
/// Frames kept of one message; more are drained and the message is rejected.
const MAX_FRAMES: usize = 4;

/// What one listener connects to and how it hashes.
#[derive(Clone, Debug)]
pub struct ListenerConfig {
    /// Worker id and registered DP rank (the default rank of events).
    pub worker: WorkerKey,
    /// The engine's PUB endpoint.
    pub endpoint: String,
    /// The engine's ROUTER replay endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// The worker's registered block size (> 0), used to re-hash stored tokens.
    pub block_size: u32,
    pub replay_timeout: Duration,
    pub max_message_size: i64,
    /// When false, the SUB connects immediately but nothing is read until
    /// [`KvEventListener::open`] (the service's ready gate, §2.3).
    pub start_open: bool,
    /// Watermark to resume from (an unchanged re-registration keeps it); `None` = fresh.
    pub initial_watermark: Option<u64>,
}

impl ListenerConfig {
    pub fn new(worker: WorkerKey, endpoint: impl Into<String>, block_size: u32) -> Self {
        Self {
            worker,
            endpoint: endpoint.into(),
            replay_endpoint: None,
            block_size,
            replay_timeout: DEFAULT_REPLAY_TIMEOUT,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            start_open: true,
            initial_watermark: None,
        }
    }

    pub fn with_replay_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    pub fn with_replay_timeout(mut self, timeout: Duration) -> Self {
        self.replay_timeout = timeout;
        self
    }
}

/// Why a listener could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ListenerError {
    #[error("invalid endpoint: {0}")]
    Endpoint(#[from] EndpointError),
    #[error("block size must be greater than 0")]
    ZeroBlockSize,
    #[error("zmq {operation} failed for {endpoint:?}: {source}")]
    Zmq {
        operation: &'static str,
        endpoint: String,
        source: zmq::Error,
    },
    #[error("could not spawn the listener thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("could not create the listener's wake pipe: {0}")]
    Pipe(#[source] std::io::Error),
}

/// Lifecycle of a listener, as the service shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ListenerState {
    Running,
    /// The live socket failed; the listener stopped (spec §3).
    Failed {
        error: String,
    },
    Stopped,
}

#[derive(Debug)]
struct Shared {
    stop: AtomicBool,
    open: AtomicBool,
    /// `u64::MAX` = no batch applied yet (as the reference's sentinel).
    watermark: AtomicU64,
    state: Mutex<ListenerState>,
    stats: Arc<ListenerStats>,
}

/// A running listener. Dropping it stops the thread and closes its sockets.
#[derive(Debug)]
pub struct KvEventListener {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Wakes the thread out of its poll; written at most twice (open, stop).
    wake: PipeWriter,
}

impl KvEventListener {
    /// Validates the config, creates and connects the sockets on a private ZMQ context, and
    /// starts the listener thread.
    pub fn start(
        config: ListenerConfig,
        sink: Arc<dyn KvEventSink>,
    ) -> Result<Self, ListenerError> {
        Self::start_in(&zmq::Context::new(), config, sink)
    }

    /// Like [`Self::start`] on a shared context (one context, hence one I/O thread, for
    /// hundreds of listeners).
    pub fn start_in(
        ctx: &zmq::Context,
        config: ListenerConfig,
        sink: Arc<dyn KvEventSink>,
    ) -> Result<Self, ListenerError> {
        validate_endpoint(&config.endpoint)?;
        if let Some(ep) = &config.replay_endpoint {
            validate_endpoint(ep)?;
        }
        if config.block_size == 0 {
            return Err(ListenerError::ZeroBlockSize);
        }
        let (wake_rx, wake) = std::io::pipe().map_err(ListenerError::Pipe)?;
        let sub = new_socket(ctx, zmq::SUB, &config.endpoint, config.max_message_size)?;
        sub.set_subscribe(b"")
            .map_err(zmq_err("subscribe", &config.endpoint))?;
        sub.connect(&config.endpoint)
            .map_err(zmq_err("connect", &config.endpoint))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            open: AtomicBool::new(config.start_open),
            watermark: AtomicU64::new(config.initial_watermark.unwrap_or(u64::MAX)),
            state: Mutex::new(ListenerState::Running),
            stats: Arc::new(ListenerStats::default()),
        });
        let mut worker = Worker {
            ctx: ctx.clone(),
            normalizer: Normalizer::new(config.worker, config.block_size),
            watermark: match config.initial_watermark {
                Some(v) => Watermark::Live(v),
                None => Watermark::Initial,
            },
            config,
            sub,
            dealer: None,
            wake: wake_rx,
            sink,
            shared: Arc::clone(&shared),
            ops: Vec::new(),
            drop_log: LogLimiter::default(),
            stale_log: LogLimiter::default(),
        };
        let name = format!(
            "kv-events-{}-{}",
            worker.config.worker.worker_id, worker.config.worker.dp_rank
        );
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || worker.run())
            .map_err(ListenerError::Spawn)?;
        Ok(Self {
            shared,
            thread: Some(thread),
            wake,
        })
    }

    /// Opens the ready gate: the listener starts reading (no-op when already open).
    pub fn open(&self) {
        if !self.shared.open.swap(true, Ordering::AcqRel) {
            self.wake();
        }
    }

    /// One byte into the wake pipe. Each flag writes once, so the pipe never fills; a thread
    /// that already ended has closed its end, and the error is moot.
    fn wake(&self) {
        let _ = (&self.wake).write(&[1]);
    }

    pub fn stats(&self) -> &Arc<ListenerStats> {
        &self.shared.stats
    }

    /// Seq of the last applied batch, `None` before the first.
    pub fn watermark(&self) -> Option<u64> {
        match self.shared.watermark.load(Ordering::Acquire) {
            u64::MAX => None,
            v => Some(v),
        }
    }

    pub fn state(&self) -> ListenerState {
        self.shared.state.lock().clone()
    }

    /// Stops the thread and waits for it: at once when idle, after the batch being applied
    /// otherwise (or, during a replay, after the replayed batch being applied).
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// Tells the thread to stop without waiting for it. Stopping many listeners: request
    /// every stop first, then [`Self::stop`] each, so the batches being applied finish in
    /// parallel.
    pub fn request_stop(&self) {
        if !self.shared.stop.swap(true, Ordering::AcqRel) {
            self.wake();
        }
    }

    fn shutdown(&mut self) {
        self.request_stop();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            tracing::error!("kv-events listener thread panicked");
        }
    }
}

impl Drop for KvEventListener {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn zmq_err(operation: &'static str, endpoint: &str) -> impl FnOnce(zmq::Error) -> ListenerError {
    let endpoint = endpoint.to_owned();
    move |source| ListenerError::Zmq {
        operation,
        endpoint,
        source,
    }
}

/// A socket with the reference's options (§2.1).
fn new_socket(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    endpoint: &str,
    max_message_size: i64,
) -> Result<zmq::Socket, ListenerError> {
    let s = ctx.socket(kind).map_err(zmq_err("socket", endpoint))?;
    let set = |r: zmq::Result<()>| r.map_err(zmq_err("setsockopt", endpoint));
    set(s.set_linger(0))?;
    set(s.set_reconnect_ivl(100))?;
    set(s.set_reconnect_ivl_max(5000))?;
    set(s.set_tcp_keepalive(1))?;
    set(s.set_heartbeat_ivl(5000))?;
    set(s.set_heartbeat_timeout(15000))?;
    set(s.set_heartbeat_ttl(15000))?;
    set(s.set_rcvtimeo(100))?;
    if kind != zmq::SUB {
        set(s.set_sndtimeo(0))?;
    }
    set(s.set_maxmsgsize(max_message_size))?;
    if endpoint.starts_with("tcp://[") {
        set(s.set_ipv6(true))?;
    }
    Ok(s)
}

/// Receives one multipart message (already signalled readable), keeping at most
/// [`MAX_FRAMES`] frames and draining the rest. Returns the kept frames and the total count.
fn recv_frames(sock: &zmq::Socket) -> zmq::Result<Option<(Vec<zmq::Message>, usize)>> {
    let mut frames = Vec::with_capacity(MAX_FRAMES);
    let mut count = 0usize;
    loop {
        let msg = match sock.recv_msg(zmq::DONTWAIT) {
            Ok(m) => m,
            Err(zmq::Error::EAGAIN) if count == 0 => return Ok(None),
            Err(e) => return Err(e),
        };
        count += 1;
        if frames.len() < MAX_FRAMES {
            frames.push(msg);
        }
        if !sock.get_rcvmore()? {
            return Ok(Some((frames, count)));
        }
    }
}

/// Why a replay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayEnd {
    Marker,
    BadResponse,
    TimedOut,
    Stopped,
    SendFailed,
}

/// Waits up to `timeout_ms` for `sock` (when given) to be readable or for a wake-up, and
/// drains the wake pipe. Returns whether `sock` is readable; `Err(None)` when the pipe's
/// writer is gone (the handle was dropped without a stop: stop too).
fn wait(
    sock: Option<&zmq::Socket>,
    wake: &mut PipeReader,
    timeout_ms: i64,
) -> Result<bool, Option<zmq::Error>> {
    let wake_item = zmq::PollItem::from_fd(wake.as_raw_fd(), zmq::POLLIN);
    let (readable, woken) = match sock {
        Some(s) => {
            let mut items = [s.as_poll_item(zmq::POLLIN), wake_item];
            zmq::poll(&mut items, timeout_ms).map_err(Some)?;
            (items[0].is_readable(), items[1].is_readable())
        }
        None => {
            let mut items = [wake_item];
            zmq::poll(&mut items, timeout_ms).map_err(Some)?;
            (false, items[0].is_readable())
        }
    };
    if woken {
        // Readable, so this read does not block; at most two bytes are ever written.
        let mut buf = [0u8; 8];
        if matches!(wake.read(&mut buf), Ok(0)) {
            return Err(None);
        }
    }
    Ok(readable)
}

/// State owned by the listener thread.
struct Worker {
    ctx: zmq::Context,
    config: ListenerConfig,
    sub: zmq::Socket,
    dealer: Option<zmq::Socket>,
    wake: PipeReader,
    sink: Arc<dyn KvEventSink>,
    shared: Arc<Shared>,
    normalizer: Normalizer,
    watermark: Watermark,
    ops: Vec<KvOperation>,
    drop_log: LogLimiter,
    stale_log: LogLimiter,
}

impl Worker {
    fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    fn run(&mut self) {
        let wid = self.config.worker.worker_id.0;
        let rank = self.config.worker.dp_rank.0;
        let _span =
            tracing::info_span!("kv_events_listener", worker_id = wid, dp_rank = rank).entered();
        let end = loop {
            if self.stopping() {
                break ListenerState::Stopped;
            }
            // Behind the closed ready gate only the wake pipe is watched.
            let live = self
                .shared
                .open
                .load(Ordering::Acquire)
                .then_some(&self.sub);
            match wait(live, &mut self.wake, IDLE_POLL_MS) {
                Ok(false) | Err(Some(zmq::Error::EINTR)) => continue,
                Ok(true) => {}
                Err(None) => break ListenerState::Stopped,
                Err(Some(e)) => {
                    break ListenerState::Failed {
                        error: e.to_string(),
                    };
                }
            }
            match recv_frames(&self.sub) {
                Ok(Some((frames, count))) => self.on_live(&frames, count),
                Ok(None) => {}
                Err(zmq::Error::EINTR) => {}
                Err(e) => {
                    break ListenerState::Failed {
                        error: e.to_string(),
                    };
                }
            }
        };
        if let ListenerState::Failed { error } = &end {
            tracing::error!(error = %error, "live KV-event socket failed; listener stopped");
        }
        *self.shared.state.lock() = end;
    }

    fn on_live(&mut self, frames: &[zmq::Message], count: usize) {
        let parsed = if count == frames.len() {
            let slices: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
            parse_live_frames(&slices).map(|m| (m.seq, m.payload))
        } else {
            Err(FrameError::WrongFrameCount { count })
        };
        let (seq, payload) = match parsed {
            Ok(v) => v,
            Err(e) => {
                self.drop_message(DropReason::from(&e), &e);
                return;
            }
        };
        if let SeqObservation::Gap { start, end } = self.watermark.observe(seq) {
            ListenerStats::add(&self.shared.stats.gaps_detected, 1);
            self.handle_gap(start, end);
        }
        if self.watermark.observe(seq) == SeqObservation::Stale {
            ListenerStats::add(&self.shared.stats.stale_batches, 1);
            if self.stale_log.allow() {
                tracing::warn!(
                    seq,
                    watermark = ?self.watermark.last(),
                    occurrences = self.stale_log.count(),
                    "stale KV-event batch dropped (duplicate after replay, or the publisher restarted)"
                );
            }
            return;
        }
        self.apply(seq, payload);
    }

    fn drop_message(&mut self, reason: DropReason, err: &dyn std::fmt::Display) {
        self.shared.stats.count_drop(reason);
        if self.drop_log.allow() {
            tracing::warn!(
                reason = reason.as_str(),
                error = %err,
                occurrences = self.drop_log.count(),
                "KV-event message dropped"
            );
        }
    }

    /// Decodes, normalizes and hands one batch to the sink; advances the watermark unless
    /// the payload failed to decode.
    fn apply(&mut self, seq: u64, payload: &[u8]) -> bool {
        self.ops.clear();
        let stats = Arc::clone(&self.shared.stats);
        let res = self
            .normalizer
            .process_payload(payload, seq, &mut self.ops, |r| stats.count_filter(r));
        if let Err(e) = res {
            self.drop_message(DropReason::from(&e), &e);
            return false;
        }
        self.sink.apply(&self.ops);
        let blocks: usize = self
            .ops
            .iter()
            .map(|op| match &op.kind {
                KvOperationKind::Stored { blocks, .. } => blocks.len(),
                _ => 0,
            })
            .sum();
        ListenerStats::add(&stats.batches_applied, 1);
        ListenerStats::add(&stats.operations_applied, self.ops.len() as u64);
        ListenerStats::add(&stats.blocks_stored, blocks as u64);
        self.set_watermark(seq);
        true
    }

    fn set_watermark(&mut self, seq: u64) {
        self.watermark = Watermark::Live(seq);
        self.shared.watermark.store(seq, Ordering::Release);
    }

    /// §10.3: replays `[start, end)` when a replay endpoint is configured; otherwise the
    /// batches are lost (logged and counted).
    fn handle_gap(&mut self, start: u64, end: u64) {
        if self.config.replay_endpoint.is_none() {
            ListenerStats::add(&self.shared.stats.batches_lost, end - start);
            tracing::warn!(
                start,
                end,
                "KV-event sequence gap and no replay endpoint: batches lost"
            );
            return;
        }
        ListenerStats::add(&self.shared.stats.replays_requested, 1);
        let mut first: Option<u64> = None;
        let mut last: Option<u64> = None;
        let mut contiguous = true;
        let outcome = self.replay(start, |seq| {
            if first.is_none() {
                first = Some(seq);
            }
            if let Some(prev) = last
                && seq != prev.wrapping_add(1)
            {
                contiguous = false;
            }
            last = Some(seq);
        });
        let stats = &self.shared.stats;
        let complete = outcome == ReplayEnd::Marker
            && first == Some(start)
            && contiguous
            && last.is_some_and(|l| l >= end - 1);
        if complete {
            ListenerStats::add(&stats.replays_complete, 1);
        } else {
            if outcome == ReplayEnd::TimedOut {
                ListenerStats::add(&stats.replays_timed_out, 1);
            } else {
                ListenerStats::add(&stats.replays_incomplete, 1);
            }
            let defect = match (first, last) {
                (None, _) => "empty",
                (Some(f), _) if f > start => "started_after_requested",
                _ if !contiguous => "non_contiguous",
                (_, Some(l)) if l < end - 1 => "ended_before_target",
                _ => "ended_abnormally",
            };
            let lost = match self.watermark.last() {
                Some(w) if w + 1 >= end => 0,
                Some(w) => end - (w + 1).max(start),
                None => end - start,
            };
            ListenerStats::add(&stats.batches_lost, lost);
            tracing::warn!(
                start,
                end,
                defect,
                outcome = ?outcome,
                lost,
                "KV-event replay incomplete; live ingestion continues"
            );
        }
    }

    fn ensure_dealer(&mut self) -> Result<(), ListenerError> {
        if self.dealer.is_none() {
            let ep = self.config.replay_endpoint.clone().unwrap_or_default();
            let s = new_socket(&self.ctx, zmq::DEALER, &ep, self.config.max_message_size)?;
            s.connect(&ep).map_err(zmq_err("connect", &ep))?;
            self.dealer = Some(s);
        }
        Ok(())
    }

    /// Requests replay from `start` and applies every batch until the end marker, a bad
    /// response, the timeout or a stop request. `on_seq` sees every replayed seq.
    fn replay(&mut self, start: u64, mut on_seq: impl FnMut(u64)) -> ReplayEnd {
        let timeout = self.config.replay_timeout;
        if let Err(e) = self.ensure_dealer() {
            tracing::warn!(error = %e, "cannot open the replay socket");
            return ReplayEnd::SendFailed;
        }
        let sent = match &self.dealer {
            Some(d) => d.send_multipart([&b""[..], &start.to_be_bytes()[..]], 0),
            None => return ReplayEnd::SendFailed,
        };
        if let Err(e) = sent {
            tracing::warn!(error = %e, "replay request could not be sent");
            self.reset_dealer();
            return ReplayEnd::SendFailed;
        }
        let deadline = Instant::now() + timeout;
        let end = loop {
            if self.stopping() {
                break ReplayEnd::Stopped;
            }
            let now = Instant::now();
            if now >= deadline {
                break ReplayEnd::TimedOut;
            }
            let slice = i64::try_from((deadline - now).as_millis()).unwrap_or(i64::MAX);
            let Some(dealer) = self.dealer.as_ref() else {
                break ReplayEnd::SendFailed;
            };
            match wait(Some(dealer), &mut self.wake, slice.max(1)) {
                Ok(false) | Err(Some(zmq::Error::EINTR)) => continue,
                Ok(true) => {}
                Err(None) => break ReplayEnd::Stopped,
                Err(Some(_)) => break ReplayEnd::BadResponse,
            }
            let (frames, count) = match recv_frames(dealer) {
                Ok(Some(v)) => v,
                Ok(None) | Err(zmq::Error::EINTR) => continue,
                Err(_) => break ReplayEnd::BadResponse,
            };
            // ["", seq, payload] (SGLang) or ["", topic, seq, payload] (vLLM).
            let (seq_frame, payload) = match (count, frames.as_slice()) {
                (3, [_, seq, payload]) => (seq, payload),
                (4, [_, _, seq, payload]) => (seq, payload),
                _ => break ReplayEnd::BadResponse,
            };
            let Ok(seq) = parse_seq(seq_frame) else {
                break ReplayEnd::BadResponse;
            };
            if payload.is_empty() {
                break ReplayEnd::Marker;
            }
            ListenerStats::add(&self.shared.stats.replayed_batches, 1);
            on_seq(seq);
            // Deviation from the reference (which applies whatever comes): a replayed batch
            // at or below the watermark was already applied, so applying it again would
            // only churn the index.
            if self.watermark.observe(seq) == SeqObservation::Stale {
                continue;
            }
            self.apply(seq, payload);
        };
        if end != ReplayEnd::Marker {
            // Late answers to an abandoned request must not be read as answers to the next.
            self.reset_dealer();
        }
        end
    }

    fn reset_dealer(&mut self) {
        self.dealer = None;
    }
}
