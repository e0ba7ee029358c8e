//! The ZMQ listener: one SUB socket per publisher stream, sequence watermark, gap detection
//! and replay over DEALER (`spec/kv-events.md` §2, §10).
//!
//! Listeners run on a [`ListenerGroup`]: one OS thread waiting in `epoll` (through `mio`) on
//! the sockets of all its listeners and on a waker. A wake-up costs what the ready sockets
//! cost, not what the group holds. Stop and open requests use the waker, so they take effect
//! at once. A replay is a state of its listener, not a blocking call: while one listener
//! waits for its engine's replay socket, the others of its group keep reading.
//!
//! ZMQ sockets are not file descriptors; each exposes one (`ZMQ_FD`) that signals, edge
//! triggered, that its `ZMQ_EVENTS` may have changed. So a signal only marks a socket as
//! worth checking, every check reads `ZMQ_EVENTS`, and a socket is marked clear only once
//! `ZMQ_EVENTS` says so after the last receive (after a send too: libzmq may make a socket
//! readable during a send without signalling). A group also re-checks every socket every
//! [`IDLE_POLL_MS`], so a missed edge could delay a stream, never lose it.
use std::os::fd::RawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use kv_types::{KvOperation, KvOperationKind, WorkerKey};
use parking_lot::{Condvar, Mutex};

use crate::decode::{FrameError, parse_live_frames, parse_seq};
use crate::endpoint::{EndpointError, validate_endpoint};
use crate::normalize::{LogLimiter, Normalizer};
use crate::stats::{DropReason, ListenerStats, ReasonTotals};
use crate::watermark::{SeqObservation, Watermark};
use zmq_monitor::Monitor;

/// Receives the operations of each applied batch, in publisher order. Called from the
/// listener group's thread; it must not block for long (that group's other listeners wait
/// meanwhile), and it must not stop listeners of its own group (their stop would wait for
/// the thread that is calling it: such a stop only requests, see [`KvEventListener::stop`]).
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

/// Longest wait of an idle group, after which it re-checks every socket (see the module
/// docs). Stop and open requests wake it at once, so this only bounds the idle wake-ups:
/// with a 100 ms slice per listener, 1,200 idle listeners took about a quarter of a core.
const IDLE_POLL_MS: u64 = 5_000;
/// The waker's token; listener `slot` uses `2·slot` (SUB) and `2·slot + 1` (DEALER).
const WAKE: mio::Token = mio::Token(usize::MAX);
/// Messages one listener may handle per poll round before the group polls again, so that a
/// flooding publisher cannot starve the rest of its group.
const BURST: usize = 64;
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
    /// Service-wide drop, filter and truncation totals this listener adds to (see
    /// [`ReasonTotals`]).
    pub totals: Option<Arc<ReasonTotals>>,
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
            totals: None,
        }
    }

    /// Also counts this listener's drops, filters and truncations into `totals`, shared
    /// with others.
    pub fn with_totals(mut self, totals: Arc<ReasonTotals>) -> Self {
        self.totals = Some(totals);
        self
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
    #[error("could not spawn the listener group's thread: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("could not create the listener group's poller: {0}")]
    Poller(#[source] std::io::Error),
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
    /// Signalled once the group has let go of the listener (its sockets are closed by then
    /// and `state` is no longer `Running`).
    ended: Condvar,
    stats: Arc<ListenerStats>,
}

/// One OS thread running many listeners: it waits on all their sockets at once, so a
/// thousand (worker, rank) streams need a few dozen threads instead of a thousand. Cheap to
/// clone; the thread ends once the group and every listener started on it are dropped.
///
/// A group's listeners share its thread for decoding and for the sink, so a slow sink delays
/// the group's other streams (their messages wait in their SUB queues), and one group uses at
/// most one core. Callers size groups with [`ListenerGroup::len`].
#[derive(Clone, Debug)]
pub struct ListenerGroup {
    inner: Arc<GroupHandle>,
}

struct GroupHandle {
    shared: Arc<GroupShared>,
    waker: mio::Waker,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

#[derive(Default)]
struct GroupShared {
    /// Listeners started but not yet taken over by the thread.
    pending: Mutex<Vec<Worker>>,
    closed: AtomicBool,
    /// Listeners started on the group that have not ended.
    listeners: AtomicUsize,
}

impl std::fmt::Debug for GroupHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerGroup")
            .field("listeners", &self.shared.listeners.load(Ordering::Relaxed))
            .finish()
    }
}

impl ListenerGroup {
    /// Starts the group's thread, named `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, ListenerError> {
        let poll = mio::Poll::new().map_err(ListenerError::Poller)?;
        let waker = mio::Waker::new(poll.registry(), WAKE).map_err(ListenerError::Poller)?;
        let shared = Arc::new(GroupShared::default());
        let for_thread = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || run_group(&for_thread, poll))
            .map_err(ListenerError::Spawn)?;
        let thread_id = thread.thread().id();
        Ok(Self {
            inner: Arc::new(GroupHandle {
                shared,
                waker,
                thread: Mutex::new(Some(thread)),
                thread_id,
            }),
        })
    }

    /// Listeners started on this group that have not ended yet.
    pub fn len(&self) -> usize {
        self.inner.shared.listeners.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl GroupHandle {
    /// Wakes the thread out of its wait. An error means the thread already ended (its
    /// poller is gone), which makes the wake-up moot.
    fn wake(&self) {
        let _ = self.waker.wake();
    }

    fn on_group_thread(&self) -> bool {
        std::thread::current().id() == self.thread_id
    }

    fn thread_finished(&self) -> bool {
        self.thread
            .lock()
            .as_ref()
            .is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for GroupHandle {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.wake();
        let Some(thread) = self.thread.get_mut().take() else {
            return;
        };
        // The last handle can only go on the group's own thread through a sink (see
        // `KvEventSink`); that thread sees `closed` and ends by itself.
        if !self.on_group_thread() && thread.join().is_err() {
            tracing::error!("kv-events listener group thread panicked");
        }
    }
}

/// A running listener. Dropping it stops it and closes its sockets.
#[derive(Debug)]
pub struct KvEventListener {
    shared: Arc<Shared>,
    group: Arc<GroupHandle>,
}

impl KvEventListener {
    /// Validates the config, creates and connects the sockets on a private ZMQ context, and
    /// starts the listener on a group of its own (one thread).
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
        let name = format!(
            "kv-events-{}-{}",
            config.worker.worker_id, config.worker.dp_rank
        );
        Self::start_on(&ListenerGroup::new(name)?, ctx, config, sink)
    }

    /// Like [`Self::start_in`], run by `group`'s thread alongside its other listeners.
    pub fn start_on(
        group: &ListenerGroup,
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
        let sub = new_socket(ctx, zmq::SUB, &config.endpoint, config.max_message_size)?;
        sub.set_subscribe(b"")
            .map_err(zmq_err("subscribe", &config.endpoint))?;
        // Before the connect, so its first events are seen.
        let monitor = watch_connection(ctx, &sub, &config);
        sub.connect(&config.endpoint)
            .map_err(zmq_err("connect", &config.endpoint))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            open: AtomicBool::new(config.start_open),
            watermark: AtomicU64::new(config.initial_watermark.unwrap_or(u64::MAX)),
            state: Mutex::new(ListenerState::Running),
            ended: Condvar::new(),
            stats: Arc::new(ListenerStats::with_totals(config.totals.clone())),
        });
        let worker = Worker {
            ctx: ctx.clone(),
            normalizer: Normalizer::new(config.worker, config.block_size),
            watermark: match config.initial_watermark {
                Some(v) => Watermark::Live(v),
                None => Watermark::Initial,
            },
            accounted: None,
            config,
            sub,
            monitor,
            dealer: None,
            slot: 0,
            sub_ready: true,
            monitor_ready: true,
            dealer_ready: false,
            mode: Mode::Live,
            sink,
            shared: Arc::clone(&shared),
            ops: Vec::new(),
            drop_log: Default::default(),
            stale_log: LogLimiter::default(),
            loss_log: LogLimiter::default(),
        };
        let inner = &group.inner;
        inner.shared.listeners.fetch_add(1, Ordering::AcqRel);
        inner.shared.pending.lock().push(worker);
        inner.wake();
        Ok(Self {
            shared,
            group: Arc::clone(inner),
        })
    }

    /// Opens the ready gate: the listener starts reading (no-op when already open).
    pub fn open(&self) {
        if !self.shared.open.swap(true, Ordering::AcqRel) {
            self.group.wake();
        }
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

    /// Stops the listener and waits until its sockets are closed: at once when idle or
    /// mid-replay, otherwise after the batch being applied. Called from the group's own
    /// thread (a sink), it only requests the stop: waiting there would wait for itself.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// Asks the group to stop this listener without waiting. Stopping many listeners:
    /// request every stop first, then [`Self::stop`] each, so their groups work through
    /// the stops in parallel.
    pub fn request_stop(&self) {
        if !self.shared.stop.swap(true, Ordering::AcqRel) {
            self.group.wake();
        }
    }

    fn shutdown(&mut self) {
        self.request_stop();
        if self.group.on_group_thread() {
            return;
        }
        let mut state = self.shared.state.lock();
        while *state == ListenerState::Running {
            // The group marks its listeners ended even when its thread unwinds; the check of
            // the thread only covers a listener started on a group whose thread had died.
            if self
                .shared
                .ended
                .wait_for(&mut state, Duration::from_millis(100))
                .timed_out()
                && self.group.thread_finished()
            {
                break;
            }
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
    // Listed by spec §2.1; unused here too, since every receive is non-blocking.
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

/// Connection events a listener's monitor reports.
const MONITORED: [zmq::SocketEvent; 3] = [
    zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
    zmq::SocketEvent::DISCONNECTED,
    zmq::SocketEvent::CONNECT_RETRIED,
];

/// Monitor events read per listener and poll round.
const MONITOR_BURST: usize = 64;

/// `sub`'s connection monitor, or `None` (logged) when libzmq will not set one up: the
/// monitor only informs, the listener works without it. Costs two sockets of the context
/// and two descriptors.
fn watch_connection(
    ctx: &zmq::Context,
    sub: &zmq::Socket,
    config: &ListenerConfig,
) -> Option<Monitor> {
    match Monitor::watch(ctx, sub, &MONITORED, "kv-events-monitor") {
        Ok(monitor) => Some(monitor),
        Err(e) => {
            tracing::warn!(
                worker_id = config.worker.worker_id.0,
                dp_rank = config.worker.dp_rank.0,
                error = %e,
                "KV-event connection monitor unavailable; reachability is not reported"
            );
            None
        }
    }
}

/// Applies one connection event to the listener's connection state.
fn on_connection_event(stats: &ListenerStats, event: &zmq_monitor::Event) {
    if event.is(zmq::SocketEvent::HANDSHAKE_SUCCEEDED) {
        stats.connected.store(true, Ordering::Relaxed);
        stats.retries_since_connected.store(0, Ordering::Relaxed);
    } else if event.is(zmq::SocketEvent::DISCONNECTED) {
        stats.connected.store(false, Ordering::Relaxed);
    } else if event.is(zmq::SocketEvent::CONNECT_RETRIED) {
        ListenerStats::add(&stats.connect_retries, 1);
        ListenerStats::add(&stats.retries_since_connected, 1);
    }
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

/// The listeners a group's thread runs, by slot (a slot's tokens stay its own until it is
/// freed). Dropping it (also when the thread unwinds) ends every listener it holds or that
/// is still pending, so no `stop` waits forever.
struct Members<'a> {
    group: &'a GroupShared,
    registry: &'a mio::Registry,
    slots: Vec<Option<Worker>>,
    free: Vec<usize>,
}

impl Members<'_> {
    fn adopt(&mut self, mut worker: Worker) {
        let slot = self.free.pop().unwrap_or(self.slots.len());
        worker.slot = slot;
        if let Err(e) = register(self.registry, worker.sub.get_fd(), sub_token(slot)) {
            self.group.listeners.fetch_sub(1, Ordering::AcqRel);
            worker.finish(self.registry, ListenerState::Failed { error: e });
            return;
        }
        if let Some(monitor) = &worker.monitor
            && let Err(e) = register(
                self.registry,
                monitor.reader().get_fd(),
                monitor_token(slot),
            )
        {
            // Without its descriptor the monitor is read by the periodic sweep only.
            tracing::warn!(error = %e, "KV-event connection monitor not polled");
        }
        if slot == self.slots.len() {
            self.slots.push(Some(worker));
        } else {
            self.slots[slot] = Some(worker);
        }
    }

    /// Ends the listener in `slot`. The group's count drops first: a `stop` returns as
    /// soon as the listener is marked ended.
    fn finish(&mut self, slot: usize, end: ListenerState) {
        if let Some(worker) = self.slots.get_mut(slot).and_then(Option::take) {
            self.group.listeners.fetch_sub(1, Ordering::AcqRel);
            worker.finish(self.registry, end);
            self.free.push(slot);
        }
    }

    fn workers(&mut self) -> impl Iterator<Item = &mut Worker> {
        self.slots.iter_mut().flatten()
    }

    fn finish_all(&mut self, end: &ListenerState) {
        for slot in 0..self.slots.len() {
            self.finish(slot, end.clone());
        }
    }
}

impl Drop for Members<'_> {
    fn drop(&mut self) {
        // Unwinding here means the group's own code panicked: every listener is failed, so
        // the service shows it, rather than stopped as if asked to.
        let end = if std::thread::panicking() {
            ListenerState::Failed {
                error: "the listener group's thread panicked".to_owned(),
            }
        } else {
            ListenerState::Stopped
        };
        let pending = std::mem::take(&mut *self.group.pending.lock());
        for worker in pending {
            self.group.listeners.fetch_sub(1, Ordering::AcqRel);
            worker.finish(self.registry, end.clone());
        }
        self.finish_all(&end);
    }
}

/// Poller tokens: three per slot (SUB, DEALER, monitor).
const TOKENS_PER_SLOT: usize = 3;

fn sub_token(slot: usize) -> mio::Token {
    mio::Token(TOKENS_PER_SLOT * slot)
}

fn dealer_token(slot: usize) -> mio::Token {
    mio::Token(TOKENS_PER_SLOT * slot + 1)
}

fn monitor_token(slot: usize) -> mio::Token {
    mio::Token(TOKENS_PER_SLOT * slot + 2)
}

fn register(
    registry: &mio::Registry,
    fd: zmq::Result<RawFd>,
    token: mio::Token,
) -> Result<(), String> {
    let fd = fd.map_err(|e| format!("reading the socket's ZMQ_FD failed: {e}"))?;
    registry
        .register(
            &mut mio::unix::SourceFd(&fd),
            token,
            mio::Interest::READABLE,
        )
        .map_err(|e| format!("registering the socket with the poller failed: {e}"))
}

/// Removes a socket from the poller before it is closed: libzmq closes the descriptor
/// later, on its reaper thread, and a reused number must not inherit the registration.
fn deregister(registry: &mio::Registry, socket: &zmq::Socket) {
    if let Ok(fd) = socket.get_fd() {
        let _ = registry.deregister(&mut mio::unix::SourceFd(&fd));
    }
}

/// The group's thread: adopts new listeners, ends stopped ones, times replays out, and lets
/// each listener whose socket may be readable read it.
fn run_group(group: &GroupShared, mut poll: mio::Poll) {
    let registry = match poll.registry().try_clone() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "KV-event listener group cannot start its poller");
            return;
        }
    };
    let mut members = Members {
        group,
        registry: &registry,
        slots: Vec::new(),
        free: Vec::new(),
    };
    let mut events = mio::Events::with_capacity(256);
    let idle = Duration::from_millis(IDLE_POLL_MS);
    let mut last_sweep = Instant::now();
    loop {
        let adopted = std::mem::take(&mut *group.pending.lock());
        for worker in adopted {
            members.adopt(worker);
        }
        if group.closed.load(Ordering::Acquire) {
            // Every handle is gone, so every listener was stopped; `Members` ends any left.
            return;
        }
        let now = Instant::now();
        for slot in 0..members.slots.len() {
            let stopping = match &mut members.slots[slot] {
                Some(w) if w.stopping() => true,
                Some(w) => {
                    w.check_deadline(&registry, now);
                    false
                }
                None => false,
            };
            if stopping {
                members.finish(slot, ListenerState::Stopped);
            }
        }
        let busy = members.workers().any(|w| w.has_work() || w.monitor_ready);
        let timeout = if busy {
            Duration::ZERO
        } else {
            let sweep = (last_sweep + idle).saturating_duration_since(now);
            members
                .workers()
                .filter_map(|w| w.deadline())
                .min()
                .map_or(sweep, |d| d.saturating_duration_since(now).min(sweep))
        };
        match poll.poll(&mut events, Some(timeout)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(error = %e, "waiting on KV-event sockets failed; the group's listeners stop");
                members.finish_all(&ListenerState::Failed {
                    error: e.to_string(),
                });
                // Not a hot loop if the error persists.
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        }
        if last_sweep.elapsed() >= idle {
            // The periodic re-check of the module docs, however busy the group is.
            last_sweep = Instant::now();
            for w in members.workers() {
                w.sub_ready = true;
                w.dealer_ready = w.dealer.is_some();
                w.monitor_ready = w.monitor.is_some();
            }
        }
        for event in &events {
            let token = event.token();
            if token == WAKE {
                continue;
            }
            if let Some(Some(w)) = members.slots.get_mut(token.0 / TOKENS_PER_SLOT) {
                match token.0 % TOKENS_PER_SLOT {
                    0 => w.sub_ready = true,
                    1 => w.dealer_ready = true,
                    _ => w.monitor_ready = true,
                }
            }
        }
        // Connection events are read whether or not the listener's gate is open.
        for w in members.workers().filter(|w| w.monitor_ready) {
            w.read_monitor();
        }
        for slot in 0..members.slots.len() {
            let ended = match &mut members.slots[slot] {
                Some(w) if w.has_work() => read_guarded(w, &registry),
                _ => None,
            };
            if let Some(end) = ended {
                members.finish(slot, end);
            }
        }
    }
}

/// [`Worker::on_readable`], with a panic (a sink's bug, say) ending only that listener, as
/// failed: with a thread per listener a panic took one stream down, and a group must not
/// let it take down the others.
fn read_guarded(worker: &mut Worker, registry: &mio::Registry) -> Option<ListenerState> {
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        worker.on_readable(registry)
    }));
    match read {
        Ok(r) => r.err(),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a non-string payload".to_owned());
            Some(ListenerState::Failed {
                error: format!("panicked while handling KV events: {what}"),
            })
        }
    }
}

/// A gap being filled by the engine's replay socket.
struct Replay {
    start: u64,
    end: u64,
    /// The first seq of `[start, end)` not already accounted for (an undecodable batch
    /// counted as dropped is not lost again).
    from: u64,
    /// Replayed seqs of `[from, end)` applied or counted as dropped: the rest are lost.
    taken: u64,
    deadline: Instant,
    first: Option<u64>,
    last: Option<u64>,
    contiguous: bool,
    /// The live batch that revealed the gap, applied once the replay is over.
    held: (u64, Vec<zmq::Message>),
}

enum Mode {
    /// Reading the SUB socket (once the ready gate is open).
    Live,
    /// Reading the DEALER until the end marker, a bad answer or the deadline; live
    /// messages wait in the SUB queue meanwhile.
    Replaying(Box<Replay>),
}

/// One listener's state, owned by its group's thread.
struct Worker {
    ctx: zmq::Context,
    config: ListenerConfig,
    sub: zmq::Socket,
    /// The SUB's connection events. Silenced before it is closed (see `Drop`).
    monitor: Option<Monitor>,
    dealer: Option<zmq::Socket>,
    /// Index in the group (its poller tokens).
    slot: usize,
    /// The SUB may have a message: an edge of its `ZMQ_FD` came, or it was not read empty.
    sub_ready: bool,
    /// The same for the monitor.
    monitor_ready: bool,
    /// The same for the DEALER.
    dealer_ready: bool,
    mode: Mode,
    sink: Arc<dyn KvEventSink>,
    shared: Arc<Shared>,
    normalizer: Normalizer,
    watermark: Watermark,
    /// The highest live seq already accounted for: applied, dropped as undecodable, or
    /// counted lost. A batch that fails to decode leaves the watermark below it (§3), so
    /// every later batch reports a gap over it again; only seqs past this one are lost.
    accounted: Option<u64>,
    ops: Vec<KvOperation>,
    /// One limiter per drop reason: a shared one hid a new reason behind the count of an
    /// old one (only occurrences 1-3 and powers of two are logged).
    drop_log: [LogLimiter; DropReason::ALL.len()],
    stale_log: LogLimiter,
    /// Gaps that lost batches and replays that came back incomplete.
    loss_log: LogLimiter,
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(monitor) = self.monitor.take() {
            monitor.stop(&self.sub);
        }
    }
}

/// The payload frame of a live message (`[topic, seq, payload]`, checked when parsed).
fn live_payload(frames: &[zmq::Message]) -> &[u8] {
    frames.get(2).map_or(&[], |m| &m[..])
}

impl Worker {
    fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Whether the group should let this listener read now: its current socket may have a
    /// message (the SUB only once the gate is open).
    fn has_work(&self) -> bool {
        match self.mode {
            Mode::Replaying(_) => self.dealer_ready,
            Mode::Live => self.sub_ready && self.shared.open.load(Ordering::Acquire),
        }
    }

    fn deadline(&self) -> Option<Instant> {
        match &self.mode {
            Mode::Replaying(r) => Some(r.deadline),
            Mode::Live => None,
        }
    }

    fn check_deadline(&mut self, registry: &mio::Registry, now: Instant) {
        if self.deadline().is_some_and(|d| now >= d) {
            self.end_replay(registry, ReplayEnd::TimedOut);
        }
    }

    /// Closes the sockets, then publishes the end state and wakes whoever waits in `stop`.
    fn finish(mut self, registry: &mio::Registry, end: ListenerState) {
        if matches!(self.mode, Mode::Replaying(_)) {
            self.end_replay(registry, ReplayEnd::Stopped);
        }
        deregister(registry, &self.sub);
        let monitor = self.monitor.as_ref().map(Monitor::reader);
        for socket in [monitor, self.dealer.as_ref()].into_iter().flatten() {
            deregister(registry, socket);
        }
        if let ListenerState::Failed { error } = &end {
            let wid = self.config.worker.worker_id.0;
            let rank = self.config.worker.dp_rank.0;
            tracing::error!(worker_id = wid, dp_rank = rank, error = %error, "live KV-event socket failed; listener stopped");
        }
        let shared = Arc::clone(&self.shared);
        drop(self);
        *shared.state.lock() = end;
        shared.ended.notify_all();
    }

    /// Applies up to [`MONITOR_BURST`] connection events; clears the ready flag once
    /// `ZMQ_EVENTS` shows the monitor empty.
    fn read_monitor(&mut self) {
        let Some(monitor) = &self.monitor else {
            self.monitor_ready = false;
            return;
        };
        for _ in 0..MONITOR_BURST {
            match monitor.next_event() {
                Some(event) => on_connection_event(&self.shared.stats, &event),
                None => break,
            }
        }
        if !monitor
            .reader()
            .get_events()
            .is_ok_and(|e| e.contains(zmq::POLLIN))
        {
            self.monitor_ready = false;
        }
    }

    /// Reads up to [`BURST`] messages of the current socket. Clears its ready flag only when
    /// `ZMQ_EVENTS` shows it empty, so a listener cut off by the burst limit is let back in
    /// without waiting for an edge. `Err` ends the listener.
    fn on_readable(&mut self, registry: &mio::Registry) -> Result<(), ListenerState> {
        for _ in 0..BURST {
            if self.stopping() {
                break;
            }
            let replaying = matches!(self.mode, Mode::Replaying(_));
            let socket = match (replaying, &self.dealer) {
                (false, _) => &self.sub,
                (true, Some(dealer)) => dealer,
                (true, None) => {
                    self.end_replay(registry, ReplayEnd::SendFailed);
                    continue;
                }
            };
            let readable = socket.get_events().map(|e| e.contains(zmq::POLLIN));
            let received = match readable {
                Ok(true) => recv_frames(socket),
                Ok(false) => Ok(None),
                Err(e) => Err(e),
            };
            match received {
                Ok(None) => {
                    // Read empty: only a new edge brings this socket back.
                    if replaying {
                        self.dealer_ready = false;
                    } else {
                        self.sub_ready = false;
                    }
                    break;
                }
                Err(zmq::Error::EINTR) => {}
                Ok(Some((frames, count))) if replaying => {
                    self.on_replayed(registry, &frames, count);
                }
                Ok(Some((frames, count))) => self.on_live(registry, frames, count),
                Err(_) if replaying => self.end_replay(registry, ReplayEnd::BadResponse),
                Err(e) => {
                    return Err(ListenerState::Failed {
                        error: e.to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    fn on_live(&mut self, registry: &mio::Registry, frames: Vec<zmq::Message>, count: usize) {
        let parsed = if count == frames.len() {
            let slices: Vec<&[u8]> = frames.iter().map(|m| &m[..]).collect();
            parse_live_frames(&slices).map(|m| m.seq)
        } else {
            Err(FrameError::WrongFrameCount { count })
        };
        let seq = match parsed {
            Ok(seq) => seq,
            Err(e) => {
                self.drop_message(DropReason::from(&e), &e);
                return;
            }
        };
        let frames = match self.watermark.observe(seq) {
            SeqObservation::Gap { start, end } => {
                ListenerStats::add(&self.shared.stats.gaps_detected, 1);
                match self.begin_replay(registry, start, end, (seq, frames)) {
                    Ok(()) => return,
                    Err(frames) => frames,
                }
            }
            _ => frames,
        };
        self.resume_live(seq, live_payload(&frames));
    }

    /// Applies a live batch unless a replay already covered it.
    fn resume_live(&mut self, seq: u64, payload: &[u8]) {
        if self.watermark.observe(seq) == SeqObservation::Stale {
            ListenerStats::add(&self.shared.stats.stale_batches, 1);
            if self.stale_log.allow() {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
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
        let log = &mut self.drop_log[reason.index()];
        if log.allow() {
            tracing::warn!(
                worker_id = self.config.worker.worker_id.0,
                dp_rank = self.config.worker.dp_rank.0,
                reason = reason.as_str(),
                error = %err,
                occurrences = log.count(),
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
        let truncated = self.normalizer.take_truncated();
        if let Err(e) = res {
            self.drop_message(DropReason::from(&e), &e);
            self.account(seq);
            return false;
        }
        // Counted before the sink sees the batch, so whoever sees it sees the counts.
        stats.count_truncated(truncated);
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

    /// Counts the seqs of `[start, end)` not accounted for yet as lost; returns how many.
    fn count_lost(&mut self, start: u64, end: u64) -> u64 {
        let from = self
            .accounted
            .map_or(start, |a| start.max(a.saturating_add(1)));
        let lost = end.saturating_sub(from);
        ListenerStats::add(&self.shared.stats.batches_lost, lost);
        if end > start {
            self.account(end - 1);
        }
        lost
    }

    fn account(&mut self, seq: u64) {
        self.accounted = Some(self.accounted.map_or(seq, |a| a.max(seq)));
    }

    fn set_watermark(&mut self, seq: u64) {
        self.watermark = Watermark::Live(seq);
        self.shared.watermark.store(seq, Ordering::Release);
    }

    /// §10.3: asks the engine to replay from `start` (the batches `[start, end)` are
    /// missing) and holds the live batch until the replay is over. Without a replay
    /// endpoint the batches are lost (logged and counted); when the request cannot be sent
    /// the replay ends at once. Either way the live batch comes back to be applied now.
    fn begin_replay(
        &mut self,
        registry: &mio::Registry,
        start: u64,
        end: u64,
        held: (u64, Vec<zmq::Message>),
    ) -> Result<(), Vec<zmq::Message>> {
        if self.config.replay_endpoint.is_none() {
            let lost = self.count_lost(start, end);
            if lost > 0 && self.loss_log.allow() {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    start,
                    end,
                    lost,
                    occurrences = self.loss_log.count(),
                    "KV-event sequence gap and no replay endpoint: batches lost"
                );
            }
            return Err(held.1);
        }
        ListenerStats::add(&self.shared.stats.replays_requested, 1);
        let replay = Replay {
            start,
            end,
            from: self
                .accounted
                .map_or(start, |a| start.max(a.saturating_add(1))),
            taken: 0,
            // A timeout too large for the clock (an embedder's choice) waits a year.
            deadline: Instant::now()
                .checked_add(self.config.replay_timeout)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 86_400)),
            first: None,
            last: None,
            contiguous: true,
            held,
        };
        let sent = match self.ensure_dealer(registry) {
            Ok(dealer) => dealer
                .send_multipart([&b""[..], &start.to_be_bytes()[..]], 0)
                .map_err(|e| {
                    tracing::warn!(
                        worker_id = self.config.worker.worker_id.0,
                        dp_rank = self.config.worker.dp_rank.0,
                        error = %e,
                        "replay request could not be sent"
                    );
                }),
            Err(e) => {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    error = %e,
                    "cannot open the replay socket"
                );
                Err(())
            }
        };
        self.mode = Mode::Replaying(Box::new(replay));
        // A send can make the socket readable without an edge (module docs).
        self.dealer_ready = true;
        if sent.is_err() {
            let held = self.close_replay(registry, ReplayEnd::SendFailed);
            return Err(held.map(|(_, frames)| frames).unwrap_or_default());
        }
        Ok(())
    }

    /// One answer of the replay socket: `["", seq, payload]` (SGLang) or
    /// `["", topic, seq, payload]` (vLLM); an empty payload is the end marker.
    fn on_replayed(&mut self, registry: &mio::Registry, frames: &[zmq::Message], count: usize) {
        let (seq_frame, payload) = match (count, frames) {
            (3, [_, seq, payload]) => (seq, payload),
            (4, [_, _, seq, payload]) => (seq, payload),
            _ => return self.end_replay(registry, ReplayEnd::BadResponse),
        };
        let Ok(seq) = parse_seq(seq_frame) else {
            return self.end_replay(registry, ReplayEnd::BadResponse);
        };
        if payload.is_empty() {
            return self.end_replay(registry, ReplayEnd::Marker);
        }
        ListenerStats::add(&self.shared.stats.replayed_batches, 1);
        if let Mode::Replaying(r) = &mut self.mode {
            if r.first.is_none() {
                r.first = Some(seq);
            }
            if let Some(prev) = r.last
                && seq != prev.wrapping_add(1)
            {
                r.contiguous = false;
            }
            r.last = Some(seq);
        }
        // Deviation from the reference (which applies whatever comes): a replayed batch at
        // or below the watermark was already applied, so applying it again would only churn
        // the index.
        if self.watermark.observe(seq) == SeqObservation::Stale {
            return;
        }
        // Each seq once: an undecodable batch leaves the watermark below it, so a second
        // copy is not stale, but it was accounted for (dropped) the first time.
        if let Mode::Replaying(r) = &mut self.mode
            && (r.from..r.end).contains(&seq)
            && self.accounted.is_none_or(|a| seq > a)
        {
            r.taken += 1;
        }
        self.apply(seq, payload);
    }

    /// Ends the replay in progress and applies the live batch it held (unless stopping).
    fn end_replay(&mut self, registry: &mio::Registry, outcome: ReplayEnd) {
        if let Some((seq, frames)) = self.close_replay(registry, outcome)
            && outcome != ReplayEnd::Stopped
        {
            self.resume_live(seq, live_payload(&frames));
        }
    }

    /// Ends the replay in progress: counts and logs its outcome, closes the DEALER unless
    /// the replay finished cleanly, and returns the held live batch.
    fn close_replay(
        &mut self,
        registry: &mio::Registry,
        outcome: ReplayEnd,
    ) -> Option<(u64, Vec<zmq::Message>)> {
        let Mode::Replaying(r) = std::mem::replace(&mut self.mode, Mode::Live) else {
            return None;
        };
        // The SUB was not read during the replay: whatever queued there is read next.
        self.sub_ready = true;
        let Replay {
            start,
            end,
            from,
            taken,
            first,
            last,
            contiguous,
            held,
            ..
        } = *r;
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
            // Every missing seq the replay did not bring: before its first batch, between
            // its batches and after its last (counting only the tail lost holes before and
            // between, which the later batches had moved past).
            let lost = end.saturating_sub(from).saturating_sub(taken);
            ListenerStats::add(&stats.batches_lost, lost);
            self.account(end - 1);
            if lost > 0 && self.loss_log.allow() {
                tracing::warn!(
                    worker_id = self.config.worker.worker_id.0,
                    dp_rank = self.config.worker.dp_rank.0,
                    start,
                    end,
                    defect,
                    outcome = ?outcome,
                    lost,
                    occurrences = self.loss_log.count(),
                    "KV-event replay incomplete; live ingestion continues"
                );
            }
        }
        if outcome != ReplayEnd::Marker
            && let Some(dealer) = self.dealer.take()
        {
            // Late answers to an abandoned request must not be read as answers to the next.
            deregister(registry, &dealer);
            self.dealer_ready = false;
        }
        Some(held)
    }

    fn ensure_dealer(&mut self, registry: &mio::Registry) -> Result<&zmq::Socket, String> {
        let dealer = match self.dealer.take() {
            Some(d) => d,
            None => {
                let ep = self.config.replay_endpoint.clone().unwrap_or_default();
                let s = new_socket(&self.ctx, zmq::DEALER, &ep, self.config.max_message_size)
                    .map_err(|e| e.to_string())?;
                s.connect(&ep)
                    .map_err(|e| format!("zmq connect failed for {ep:?}: {e}"))?;
                register(registry, s.get_fd(), dealer_token(self.slot))?;
                s
            }
        };
        Ok(self.dealer.insert(dealer))
    }
}

#[cfg(test)]
mod tests {
    use super::{ListenerStats, on_connection_event};
    use std::sync::atomic::Ordering;

    fn event(e: zmq::SocketEvent) -> zmq_monitor::Event {
        zmq_monitor::Event {
            kind: e.to_raw(),
            endpoint: "tcp://127.0.0.1:7".to_owned(),
        }
    }

    #[test]
    fn connection_events_track_reachability() {
        let stats = ListenerStats::default();
        let retried = event(zmq::SocketEvent::CONNECT_RETRIED);
        for _ in 0..crate::stats::UNREACHABLE_AFTER_RETRIES - 1 {
            on_connection_event(&stats, &retried);
        }
        assert!(!stats.unreachable());
        on_connection_event(&stats, &retried);
        assert!(stats.unreachable());
        on_connection_event(&stats, &event(zmq::SocketEvent::HANDSHAKE_SUCCEEDED));
        assert!(stats.connected.load(Ordering::Relaxed) && !stats.unreachable());
        assert_eq!(ListenerStats::get(&stats.retries_since_connected), 0);
        // A lost connection counts again from zero; the total keeps growing.
        on_connection_event(&stats, &event(zmq::SocketEvent::DISCONNECTED));
        for _ in 0..3 {
            on_connection_event(&stats, &retried);
        }
        assert!(stats.unreachable());
        assert_eq!(ListenerStats::get(&stats.connect_retries), 6);
        // Other events change nothing.
        on_connection_event(&stats, &event(zmq::SocketEvent::ACCEPTED));
        assert_eq!(ListenerStats::get(&stats.connect_retries), 6);
        assert!(stats.unreachable());
    }
}
