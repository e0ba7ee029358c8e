//! The ZMQ mesh: one PUB socket (publisher thread) and one SUB socket (receiver thread) per
//! process (`spec/replica-sync.md` §1, §2, §8).
//!
//! ZMQ sockets are not thread-safe, so each socket lives on exactly one thread: callers talk
//! to the publisher through a bounded channel and to the receiver (peer changes) through a
//! command channel with a reply channel per request.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::auth::{AuthError, MacSigner, MacVerifier, ReplicaKey};
use crate::codec::{self, DecodeError};
use crate::endpoint::{InvalidEndpoint, is_bracketed_tcp, validate_endpoint};
use crate::event::{ReplicaEvent, RouterId, SESSION_AFFINITY_TOPIC, SLOT_TRACKER_TOPIC, Topic};
use zmq_monitor::Monitor;

/// Default capacity of the outbound booking-event queue (§4.3).
pub const DEFAULT_SEQUENCE_QUEUE_CAPACITY: usize = 100_000;
/// Default capacity of the outbound session-binding queue (§7.2).
pub const DEFAULT_BINDING_QUEUE_CAPACITY: usize = 4_096;

/// Poll slice of both threads: bounds how long shutdown and a peer change wait.
const POLL_MS: i64 = 100;
/// Messages drained per wake-up before peer commands are looked at again.
const RECV_BATCH: usize = 1024;
/// How long a peer change waits for the receiver thread (one poll slice plus a margin).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
const QUEUE_FULL_LOG_PERIOD: Duration = Duration::from_secs(30);
const RECV_DROP_LOG_PERIOD: Duration = Duration::from_secs(10);
const UNAUTHENTICATED_LOG_PERIOD: Duration = Duration::from_secs(30);
/// Reconnect attempts without a handshake after which a peer counts as unreachable (about
/// 0.3 s when its port refuses connections, the reconnect interval being 100 ms).
pub const UNREACHABLE_AFTER_RETRIES: u64 = 3;
/// Time without a handshake after which a peer counts as unreachable however few attempts
/// were made: a peer that accepts TCP but never speaks ZMQ (a hung or stopped replica, a
/// wrong service) costs one attempt per 30 s handshake timeout, so three took 90 s.
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(15);
/// Connection events applied per receiver wake-up.
const MONITOR_BURST: usize = 64;
/// Connection events the receiver's monitor reports.
const MONITORED: [zmq::SocketEvent; 3] = [
    zmq::SocketEvent::HANDSHAKE_SUCCEEDED,
    zmq::SocketEvent::DISCONNECTED,
    zmq::SocketEvent::CONNECT_RETRIED,
];

/// Receives every accepted event, on the mesh's receiver thread.
///
/// Accepted means: two frames, a known topic, a payload that decodes, an origin other than
/// this mesh, and (for bindings) session affinity enabled. Everything else — the partition
/// and block-size checks and the apply rules of §5 and §7.3 — is the sink's job. The call
/// should return quickly (push into a queue): while it runs, no other message is received.
pub trait ReplicaSink: Send + Sync + 'static {
    fn on_event(&self, event: ReplicaEvent);
}

/// Mesh configuration; [`MeshConfig::new`] gives the spec's defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshConfig {
    /// Host of the PUB bind endpoint; `*` (all IPv4 interfaces) by default.
    pub host: String,
    /// `--replica-sync-port` (1–65535).
    pub port: u16,
    /// `--replica-sync-peers`: connected at start; invalid ones fail the start; duplicates
    /// are ignored.
    pub peers: Vec<String>,
    /// Subscribe to (and deliver) `dynamo.session-affinity.v1`.
    pub session_affinity: bool,
    /// Outbound booking-event queue capacity.
    pub sequence_queue_capacity: usize,
    /// Outbound binding queue capacity.
    pub binding_queue_capacity: usize,
    /// Fixed process id (tests, determinism); `None` draws a random non-zero one.
    pub router_id: Option<RouterId>,
    /// Pre-shared key (`--replica-sync-key-file`): when set, every published message carries
    /// an authentication trailer frame and every received message must carry a valid, fresh
    /// one ([`crate::auth`]). `None` keeps the spec's two-frame wire format.
    pub auth_key: Option<ReplicaKey>,
}

impl MeshConfig {
    pub fn new(port: u16) -> Self {
        Self {
            host: "*".to_owned(),
            port,
            peers: Vec::new(),
            session_affinity: false,
            sequence_queue_capacity: DEFAULT_SEQUENCE_QUEUE_CAPACITY,
            binding_queue_capacity: DEFAULT_BINDING_QUEUE_CAPACITY,
            router_id: None,
            auth_key: None,
        }
    }
}

/// Why a mesh could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeshError {
    #[error("replica-sync port must be between 1 and 65535 (got {port})")]
    InvalidPort { port: u16 },
    #[error("invalid replica-sync bind endpoint: {0}")]
    InvalidBindEndpoint(InvalidEndpoint),
    #[error("invalid replica-sync peer: {0}")]
    InvalidPeer(InvalidEndpoint),
    #[error("failed to bind replica-sync publisher on `{endpoint}`: {source}")]
    Bind {
        endpoint: String,
        source: zmq::Error,
    },
    #[error("failed to connect replica-sync peer `{endpoint}`: {source}")]
    Connect {
        endpoint: String,
        source: zmq::Error,
    },
    #[error("replica-sync socket setup failed ({operation}): {source}")]
    Socket {
        operation: &'static str,
        source: zmq::Error,
    },
    #[error("failed to start replica-sync thread: {source}")]
    Spawn { source: std::io::Error },
}

/// Why a peer change failed. `Display` is the HTTP error text of `http-api.md` §9.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// 400.
    #[error(transparent)]
    InvalidEndpoint(#[from] InvalidEndpoint),
    /// 400.
    #[error("failed to register replica peer `{endpoint}`: {source}")]
    Register {
        endpoint: String,
        source: zmq::Error,
    },
    /// 400.
    #[error("failed to deregister replica peer `{endpoint}`: {source}")]
    Deregister {
        endpoint: String,
        source: zmq::Error,
    },
    /// 404.
    #[error("peer not found")]
    NotFound { endpoint: String },
    /// 409. Never returned by a mesh; for hosts that run without one.
    #[error("replica sync is disabled")]
    Disabled,
    /// 503: the receiver thread is gone (shut down) or did not answer.
    #[error("replica peer manager is unavailable")]
    Unavailable,
}

/// What [`ReplicaMesh::publish`] did with an event. Publishing is best-effort; callers
/// normally ignore this (drops are counted in [`MeshStats`] and logged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    /// Enqueued for the publisher thread.
    Queued,
    /// The outbound queue of its topic is full: the new event was dropped.
    QueueFull,
    /// The mesh is shut down.
    Closed,
    /// The event cannot be encoded (a string over 4 GiB).
    Unencodable,
}

/// The connection to one configured peer, as the SUB socket's monitor reports it. libzmq
/// reconnects silently for ever, so without this a mistyped peer is just a replica whose
/// bookings never arrive.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerLink {
    /// The peer's endpoint, as registered.
    pub endpoint: String,
    /// A ZMQ handshake with the peer completed and no disconnect came since.
    pub connected: bool,
    /// Reconnect attempts since the peer was registered.
    pub connect_retries: u64,
    /// Reconnect attempts since the last handshake (or the registration).
    pub retries_since_connected: u64,
    /// Since when the peer has been without a connection (registration or disconnect);
    /// `None` while connected.
    pub disconnected_since: Option<Instant>,
}

impl PeerLink {
    fn new(endpoint: String) -> Self {
        PeerLink {
            endpoint,
            disconnected_since: Some(Instant::now()),
            ..PeerLink::default()
        }
    }

    /// Not connected, and either reconnecting without a handshake at least
    /// [`UNREACHABLE_AFTER_RETRIES`] times or without one for [`UNREACHABLE_AFTER`].
    pub fn unreachable(&self) -> bool {
        !self.connected
            && (self.retries_since_connected >= UNREACHABLE_AFTER_RETRIES
                || self
                    .disconnected_since
                    .is_some_and(|t| t.elapsed() >= UNREACHABLE_AFTER))
    }
}

/// Monotonic counters; relaxed atomics, read by the metrics exporter.
#[derive(Debug, Default)]
pub struct MeshStats {
    /// Messages handed to the PUB socket.
    pub sent: AtomicU64,
    /// Dropped: outbound queue full (per-topic capacity).
    pub dropped_queue_full: AtomicU64,
    /// Dropped: the PUB socket refused the message (high-water mark / would block).
    pub dropped_send: AtomicU64,
    /// Dropped: published after shutdown, or unencodable.
    pub dropped_closed: AtomicU64,
    /// Received and delivered to the sink.
    pub delivered: AtomicU64,
    /// Received with our own id (self-subscription).
    pub ignored_own: AtomicU64,
    /// Received binding while session affinity is disabled.
    pub ignored_affinity_disabled: AtomicU64,
    /// Dropped: frame count other than 2.
    pub dropped_frame_count: AtomicU64,
    /// Dropped: topic frame is not exactly one of the two topics.
    pub dropped_unknown_topic: AtomicU64,
    /// Dropped: the payload does not decode.
    pub dropped_decode: AtomicU64,
    /// Dropped: a key is configured and the message has no valid, fresh authentication
    /// trailer (missing, wrong key, altered, replayed, or not from the payload's origin).
    pub dropped_unauthenticated: AtomicU64,
}

/// A plain copy of [`MeshStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MeshStatsSnapshot {
    pub sent: u64,
    pub dropped_queue_full: u64,
    pub dropped_send: u64,
    pub dropped_closed: u64,
    pub delivered: u64,
    pub ignored_own: u64,
    pub ignored_affinity_disabled: u64,
    pub dropped_frame_count: u64,
    pub dropped_unknown_topic: u64,
    pub dropped_decode: u64,
    pub dropped_unauthenticated: u64,
}

impl MeshStats {
    pub fn snapshot(&self) -> MeshStatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MeshStatsSnapshot {
            sent: g(&self.sent),
            dropped_queue_full: g(&self.dropped_queue_full),
            dropped_send: g(&self.dropped_send),
            dropped_closed: g(&self.dropped_closed),
            delivered: g(&self.delivered),
            ignored_own: g(&self.ignored_own),
            ignored_affinity_disabled: g(&self.ignored_affinity_disabled),
            dropped_frame_count: g(&self.dropped_frame_count),
            dropped_unknown_topic: g(&self.dropped_unknown_topic),
            dropped_decode: g(&self.dropped_decode),
            dropped_unauthenticated: g(&self.dropped_unauthenticated),
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// Logs at most once per period, reporting how many occurrences it covers.
#[derive(Debug)]
struct LogLimiter {
    period: Duration,
    last: Mutex<Option<Instant>>,
    pending: AtomicU64,
}

impl LogLimiter {
    fn new(period: Duration) -> Self {
        Self {
            period,
            last: Mutex::new(None),
            pending: AtomicU64::new(0),
        }
    }

    /// Records one occurrence; `Some(n)` when the caller should log now (n occurrences since
    /// the last log). Never waits: a contended lock just means someone else is logging.
    fn record(&self) -> Option<u64> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.try_lock()?;
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < self.period) {
            return None;
        }
        *last = Some(now);
        Some(self.pending.swap(0, Ordering::Relaxed))
    }
}

struct Outbound {
    topic: Topic,
    payload: Vec<u8>,
}

enum Command {
    Register(String, Sender<Result<bool, PeerError>>),
    Deregister(String, Sender<Result<(), PeerError>>),
}

#[derive(Debug)]
struct Shared {
    router_id: RouterId,
    session_affinity: bool,
    stop: AtomicBool,
    stats: Arc<MeshStats>,
    /// The configured peers, each with its connection state.
    links: Mutex<BTreeMap<String, PeerLink>>,
    queued_sequence: AtomicUsize,
    queued_binding: AtomicUsize,
    sequence_capacity: usize,
    binding_capacity: usize,
    queue_full_log: LogLimiter,
    recv_drop_log: LogLimiter,
    unauthenticated_log: LogLimiter,
}

impl Shared {
    fn queued(&self, topic: Topic) -> (&AtomicUsize, usize) {
        match topic {
            Topic::SlotTracker => (&self.queued_sequence, self.sequence_capacity),
            Topic::SessionAffinity => (&self.queued_binding, self.binding_capacity),
        }
    }
}

/// A running replica-sync mesh. Dropping it (or [`ReplicaMesh::shutdown`]) stops both threads
/// within one poll slice (100 ms), closes the sockets with linger 0 and terminates the ZMQ
/// context, so the port can be bound again immediately.
pub struct ReplicaMesh {
    shared: Arc<Shared>,
    publish_endpoint: String,
    out_tx: SyncSender<Outbound>,
    cmd_tx: Sender<Command>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    ctx: Mutex<Option<zmq::Context>>,
}

impl std::fmt::Debug for ReplicaMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaMesh")
            .field("router_id", &self.shared.router_id)
            .field("publish_endpoint", &self.publish_endpoint)
            .field("session_affinity", &self.shared.session_affinity)
            .finish_non_exhaustive()
    }
}

impl ReplicaMesh {
    /// Binds the PUB socket, connects the initial peers and starts both threads.
    pub fn start(config: MeshConfig, sink: Arc<dyn ReplicaSink>) -> Result<Self, MeshError> {
        if config.port == 0 {
            return Err(MeshError::InvalidPort { port: 0 });
        }
        let publish_endpoint = format!("tcp://{}:{}", config.host, config.port);
        validate_endpoint(&publish_endpoint).map_err(MeshError::InvalidBindEndpoint)?;
        let mut initial = BTreeSet::new();
        for peer in &config.peers {
            validate_endpoint(peer).map_err(MeshError::InvalidPeer)?;
            initial.insert(peer.clone());
        }

        let ctx = zmq::Context::new();
        let publisher = new_socket(&ctx, zmq::PUB)?;
        if is_bracketed_tcp(&publish_endpoint) {
            publisher.set_ipv6(true).map_err(socket_err("set ipv6"))?;
        }
        publisher
            .bind(&publish_endpoint)
            .map_err(|source| MeshError::Bind {
                endpoint: publish_endpoint.clone(),
                source,
            })?;

        let subscriber = new_socket(&ctx, zmq::SUB)?;
        subscriber
            .set_rcvtimeo(POLL_MS as i32)
            .map_err(socket_err("set receive timeout"))?;
        subscriber
            .set_subscribe(SLOT_TRACKER_TOPIC.as_bytes())
            .map_err(socket_err("subscribe"))?;
        if config.session_affinity {
            subscriber
                .set_subscribe(SESSION_AFFINITY_TOPIC.as_bytes())
                .map_err(socket_err("subscribe"))?;
        }
        // Before the connects, so their first events are seen.
        let monitor = watch_connections(&ctx, &subscriber);
        for peer in &initial {
            if let Err(source) = connect(&subscriber, peer) {
                if let Some(monitor) = monitor {
                    monitor.stop(&subscriber);
                }
                return Err(MeshError::Connect {
                    endpoint: peer.clone(),
                    source,
                });
            }
        }
        let links = initial
            .iter()
            .map(|p| (p.clone(), PeerLink::new(p.clone())))
            .collect();

        let shared = Arc::new(Shared {
            router_id: config.router_id.unwrap_or_else(RouterId::random),
            session_affinity: config.session_affinity,
            stop: AtomicBool::new(false),
            stats: Arc::new(MeshStats::default()),
            links: Mutex::new(links),
            queued_sequence: AtomicUsize::new(0),
            queued_binding: AtomicUsize::new(0),
            sequence_capacity: config.sequence_queue_capacity,
            binding_capacity: config.binding_queue_capacity,
            queue_full_log: LogLimiter::new(QUEUE_FULL_LOG_PERIOD),
            recv_drop_log: LogLimiter::new(RECV_DROP_LOG_PERIOD),
            unauthenticated_log: LogLimiter::new(UNAUTHENTICATED_LOG_PERIOD),
        });
        let signer = config
            .auth_key
            .clone()
            .map(|key| MacSigner::new(key, shared.router_id));
        let verifier = config.auth_key.clone().map(MacVerifier::new);
        // One channel for both topics keeps FIFO order across them; the per-topic
        // capacities are enforced by the counters in `Shared`.
        let (out_tx, out_rx) = mpsc::sync_channel(
            config
                .sequence_queue_capacity
                .saturating_add(config.binding_queue_capacity)
                .max(1),
        );
        let (cmd_tx, cmd_rx) = mpsc::channel();

        let mut threads = Vec::with_capacity(2);
        let s = Arc::clone(&shared);
        threads.push(
            std::thread::Builder::new()
                .name("replica-sync-pub".to_owned())
                .spawn(move || run_publisher(&s, &publisher, &out_rx, signer))
                .map_err(|source| MeshError::Spawn { source })?,
        );
        let s = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("replica-sync-sub".to_owned())
            .spawn(move || {
                run_receiver(&s, &subscriber, monitor, &cmd_rx, sink.as_ref(), verifier);
            });
        let receiver = match spawned {
            Ok(handle) => handle,
            Err(source) => {
                shared.stop.store(true, Ordering::Relaxed);
                for t in threads {
                    let _ = t.join();
                }
                return Err(MeshError::Spawn { source });
            }
        };
        threads.push(receiver);
        tracing::info!(
            endpoint = %publish_endpoint,
            router_id = %shared.router_id,
            session_affinity = config.session_affinity,
            authenticated = config.auth_key.is_some(),
            "replica sync started"
        );
        Ok(Self {
            shared,
            publish_endpoint,
            out_tx,
            cmd_tx,
            threads: Mutex::new(threads),
            ctx: Mutex::new(Some(ctx)),
        })
    }

    /// This process's id, stamped on everything it publishes.
    pub fn router_id(&self) -> RouterId {
        self.shared.router_id
    }

    /// The PUB endpoint as bound, e.g. `tcp://*:9092`.
    pub fn publish_endpoint(&self) -> &str {
        &self.publish_endpoint
    }

    /// Whether bindings are subscribed to and delivered.
    pub fn session_affinity(&self) -> bool {
        self.shared.session_affinity
    }

    pub fn stats(&self) -> &Arc<MeshStats> {
        &self.shared.stats
    }

    /// Encodes `event` (with this mesh's id as `router_id` / `writer_id`, whatever the event
    /// says) and enqueues it without blocking. A full queue drops the new event.
    pub fn publish(&self, event: &ReplicaEvent) -> PublishOutcome {
        let stats = &self.shared.stats;
        if self.shared.stop.load(Ordering::Relaxed) {
            bump(&stats.dropped_closed);
            tracing::debug!("replica sync is shut down; event dropped");
            return PublishOutcome::Closed;
        }
        let mut payload = Vec::with_capacity(160);
        let topic = match codec::encode_as(event, self.shared.router_id, &mut payload) {
            Ok(topic) => topic,
            Err(e) => {
                bump(&stats.dropped_closed);
                tracing::error!(error = %e, "replica-sync event cannot be encoded; dropped");
                return PublishOutcome::Unencodable;
            }
        };
        let (queued, capacity) = self.shared.queued(topic);
        if queued.fetch_add(1, Ordering::Relaxed) >= capacity {
            queued.fetch_sub(1, Ordering::Relaxed);
            return self.queue_full(topic);
        }
        match self.out_tx.try_send(Outbound { topic, payload }) {
            Ok(()) => PublishOutcome::Queued,
            Err(TrySendError::Full(_)) => {
                queued.fetch_sub(1, Ordering::Relaxed);
                self.queue_full(topic)
            }
            Err(TrySendError::Disconnected(_)) => {
                queued.fetch_sub(1, Ordering::Relaxed);
                bump(&stats.dropped_closed);
                tracing::debug!("replica-sync publisher is gone; event dropped");
                PublishOutcome::Closed
            }
        }
    }

    fn queue_full(&self, topic: Topic) -> PublishOutcome {
        bump(&self.shared.stats.dropped_queue_full);
        // Bindings are dropped silently (§7.2); booking events are logged (§4.3).
        if topic == Topic::SlotTracker
            && let Some(dropped) = self.shared.queue_full_log.record()
        {
            tracing::error!(dropped, "replica-sync outbound queue full; events dropped");
        }
        PublishOutcome::QueueFull
    }

    /// Connects the SUB socket to another replica's PUB endpoint. `Ok(true)` when newly
    /// added, `Ok(false)` when already present (exact string match). Blocks the caller for up
    /// to one poll slice of the receiver thread (≈100 ms): call it off async executors.
    pub fn register_peer(&self, endpoint: &str) -> Result<bool, PeerError> {
        validate_endpoint(endpoint)?;
        let (tx, rx) = mpsc::channel();
        self.command(Command::Register(endpoint.to_owned(), tx))?;
        rx.recv_timeout(COMMAND_TIMEOUT)
            .map_err(|_| PeerError::Unavailable)?
    }

    /// Disconnects a registered peer; [`PeerError::NotFound`] when absent. Blocks like
    /// [`Self::register_peer`].
    pub fn deregister_peer(&self, endpoint: &str) -> Result<(), PeerError> {
        validate_endpoint(endpoint)?;
        let (tx, rx) = mpsc::channel();
        self.command(Command::Deregister(endpoint.to_owned(), tx))?;
        rx.recv_timeout(COMMAND_TIMEOUT)
            .map_err(|_| PeerError::Unavailable)?
    }

    fn command(&self, cmd: Command) -> Result<(), PeerError> {
        if self.shared.stop.load(Ordering::Relaxed) {
            return Err(PeerError::Unavailable);
        }
        self.cmd_tx.send(cmd).map_err(|_| PeerError::Unavailable)
    }

    /// The configured peers, sorted.
    pub fn peers(&self) -> Vec<String> {
        self.shared.links.lock().keys().cloned().collect()
    }

    /// The connection state of every configured peer, sorted by endpoint.
    pub fn peer_links(&self) -> Vec<PeerLink> {
        self.shared.links.lock().values().cloned().collect()
    }

    /// Stops both threads, closes the sockets and terminates the ZMQ context. Idempotent.
    /// Events still queued are sent (non-blocking) before the publisher exits.
    pub fn shutdown(&self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            if t.join().is_err() {
                tracing::error!("a replica-sync thread panicked");
            }
        }
        // Every socket was owned by a joined thread and is closed; terminating the context
        // now makes the close (and the port release) synchronous.
        drop(self.ctx.lock().take());
    }
}

impl Drop for ReplicaMesh {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn socket_err(operation: &'static str) -> impl FnOnce(zmq::Error) -> MeshError {
    move |source| MeshError::Socket { operation, source }
}

/// The options of §2.1 common to both sockets.
fn new_socket(ctx: &zmq::Context, kind: zmq::SocketType) -> Result<zmq::Socket, MeshError> {
    let s = ctx.socket(kind).map_err(socket_err("create socket"))?;
    let set = |r: zmq::Result<()>| r.map_err(socket_err("setsockopt"));
    set(s.set_linger(0))?;
    set(s.set_reconnect_ivl(100))?;
    set(s.set_reconnect_ivl_max(5000))?;
    set(s.set_tcp_keepalive(1))?;
    set(s.set_heartbeat_ivl(5000))?;
    set(s.set_heartbeat_timeout(15000))?;
    set(s.set_heartbeat_ttl(15000))?;
    set(s.set_sndtimeo(0))?;
    Ok(s)
}

fn connect(sub: &zmq::Socket, endpoint: &str) -> zmq::Result<()> {
    if is_bracketed_tcp(endpoint) {
        sub.set_ipv6(true)?;
    }
    sub.connect(endpoint)
}

fn run_publisher(
    shared: &Shared,
    socket: &zmq::Socket,
    rx: &Receiver<Outbound>,
    mut signer: Option<MacSigner>,
) {
    let mut send = |msg: Outbound| {
        let (queued, _) = shared.queued(msg.topic);
        queued.fetch_sub(1, Ordering::Relaxed);
        let topic = msg.topic.as_str().as_bytes();
        // Signed here, on the one publisher thread, so counters follow the send order.
        let trailer = signer.as_mut().map(|s| s.sign(topic, &msg.payload));
        let result =
            socket
                .send(topic, zmq::SNDMORE | zmq::DONTWAIT)
                .and_then(|()| match &trailer {
                    None => socket.send(msg.payload, zmq::DONTWAIT),
                    // Once the first part is accepted, ZMQ queues the rest of the message
                    // atomically, so the trailer cannot be cut off by the high-water mark.
                    Some(t) => socket
                        .send(msg.payload, zmq::SNDMORE | zmq::DONTWAIT)
                        .and_then(|()| socket.send(&t[..], zmq::DONTWAIT)),
                });
        match result {
            Ok(()) => bump(&shared.stats.sent),
            Err(e) => {
                bump(&shared.stats.dropped_send);
                tracing::debug!(error = %e, "replica-sync send failed; event dropped");
            }
        }
    };
    loop {
        if shared.stop.load(Ordering::Relaxed) {
            while let Ok(msg) = rx.try_recv() {
                send(msg);
            }
            return;
        }
        match rx.recv_timeout(Duration::from_millis(POLL_MS as u64)) {
            Ok(msg) => send(msg),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

fn run_receiver(
    shared: &Shared,
    socket: &zmq::Socket,
    monitor: Option<Monitor>,
    commands: &Receiver<Command>,
    sink: &dyn ReplicaSink,
    mut verifier: Option<MacVerifier>,
) {
    let mut frames: Vec<zmq::Message> = Vec::with_capacity(MAX_KEPT_FRAMES);
    while !shared.stop.load(Ordering::Relaxed) {
        while let Ok(cmd) = commands.try_recv() {
            handle_command(shared, socket, cmd);
        }
        let polled = match &monitor {
            Some(m) => {
                let mut items = [
                    socket.as_poll_item(zmq::POLLIN),
                    m.reader().as_poll_item(zmq::POLLIN),
                ];
                zmq::poll(&mut items, POLL_MS)
                    .map(|_| (items[0].is_readable(), items[1].is_readable()))
            }
            None => socket.poll(zmq::POLLIN, POLL_MS).map(|n| (n > 0, false)),
        };
        let messages = match polled {
            Ok((messages, events)) => {
                if let (true, Some(monitor)) = (events, &monitor) {
                    read_connection_events(shared, monitor);
                }
                messages
            }
            Err(zmq::Error::EINTR) => false,
            Err(e) => {
                // Not expected on a live socket; back off one slice instead of spinning.
                tracing::error!(error = %e, "replica-sync poll failed");
                std::thread::sleep(Duration::from_millis(POLL_MS as u64));
                false
            }
        };
        if !messages {
            continue;
        }
        for _ in 0..RECV_BATCH {
            match recv_message(socket, &mut frames) {
                Ok(Some(count)) => on_message(shared, sink, &frames, count, verifier.as_mut()),
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "replica-sync receive failed");
                    break;
                }
            }
        }
    }
    if let Some(monitor) = monitor {
        monitor.stop(socket);
    }
}

/// `sub`'s connection monitor, or `None` (logged) when libzmq will not set one up: the
/// monitor only informs, the mesh works without it.
fn watch_connections(ctx: &zmq::Context, sub: &zmq::Socket) -> Option<Monitor> {
    match Monitor::watch(ctx, sub, &MONITORED, "replica-sync-monitor") {
        Ok(monitor) => Some(monitor),
        Err(e) => {
            tracing::warn!(error = %e, "replica-sync connection monitor unavailable; peer reachability is not reported");
            None
        }
    }
}

/// Applies up to [`MONITOR_BURST`] connection events (`[event u16 LE, value u32 LE]`,
/// then the endpoint) to the links of the peers they name; events of a peer no longer
/// registered are ignored.
fn read_connection_events(shared: &Shared, monitor: &Monitor) {
    for _ in 0..MONITOR_BURST {
        let Some(event) = monitor.next_event() else {
            return;
        };
        let mut links = shared.links.lock();
        let Some(link) = links.get_mut(&event.endpoint) else {
            continue;
        };
        if event.is(zmq::SocketEvent::HANDSHAKE_SUCCEEDED) {
            link.connected = true;
            link.retries_since_connected = 0;
            link.disconnected_since = None;
        } else if event.is(zmq::SocketEvent::DISCONNECTED) {
            if link.connected {
                link.disconnected_since = Some(Instant::now());
            }
            link.connected = false;
        } else if event.is(zmq::SocketEvent::CONNECT_RETRIED) {
            link.connect_retries += 1;
            link.retries_since_connected += 1;
            if link.retries_since_connected == UNREACHABLE_AFTER_RETRIES {
                tracing::warn!(
                    endpoint = %link.endpoint,
                    retries = link.retries_since_connected,
                    "replica-sync peer is not connected: reconnecting without a ZMQ handshake"
                );
            }
        }
    }
}

/// Frames kept per message: topic, payload and (with a key) the authentication trailer.
const MAX_KEPT_FRAMES: usize = 3;

/// Reads one whole multipart message without blocking, keeping its first three frames in
/// `frames`; returns the total frame count, or `None` if nothing is waiting.
fn recv_message(
    socket: &zmq::Socket,
    frames: &mut Vec<zmq::Message>,
) -> zmq::Result<Option<usize>> {
    frames.clear();
    let mut count = 0;
    loop {
        let msg = match socket.recv_msg(zmq::DONTWAIT) {
            Ok(m) => m,
            Err(zmq::Error::EAGAIN) if count == 0 => return Ok(None),
            Err(e) => return Err(e),
        };
        count += 1;
        // Parts of one message arrive atomically, so this loop ends with the message.
        let more = msg.get_more();
        if frames.len() < MAX_KEPT_FRAMES {
            frames.push(msg);
        }
        if !more {
            return Ok(Some(count));
        }
    }
}

fn on_message(
    shared: &Shared,
    sink: &dyn ReplicaSink,
    frames: &[zmq::Message],
    count: usize,
    verifier: Option<&mut MacVerifier>,
) {
    let stats = &shared.stats;
    // Authentication comes first: without a valid trailer nothing else of the message is
    // looked at.
    let (topic, payload, authenticated) = match (verifier, frames) {
        (None, [topic, payload]) if count == 2 => (topic, payload, None),
        (Some(verifier), [topic, payload, trailer]) if count == 3 => {
            match verifier.verify(topic, payload, trailer) {
                Ok(auth) => (topic, payload, Some(auth.sender)),
                Err(e) => return drop_unauthenticated(shared, &e),
            }
        }
        (Some(_), [_, _]) if count == 2 => {
            return drop_unauthenticated(shared, &AuthError::Missing);
        }
        (verifier, _) => {
            let expected = if verifier.is_some() { 3 } else { 2 };
            bump(&stats.dropped_frame_count);
            log_drop(
                shared,
                &format_args!("{count} frames instead of {expected}"),
            );
            return;
        }
    };
    let event = match codec::decode(topic, payload) {
        Ok(event) => event,
        Err(DecodeError::UnknownTopic) => {
            bump(&stats.dropped_unknown_topic);
            log_drop(shared, &"unknown topic");
            return;
        }
        Err(e) => {
            bump(&stats.dropped_decode);
            log_drop(shared, &e);
            return;
        }
    };
    if let Some(sender) = authenticated
        && sender != event.origin()
    {
        let e = AuthError::SenderMismatch {
            sender,
            origin: event.origin(),
        };
        return drop_unauthenticated(shared, &e);
    }
    if event.origin() == shared.router_id {
        bump(&stats.ignored_own);
        return;
    }
    if matches!(event, ReplicaEvent::Binding(_)) && !shared.session_affinity {
        bump(&stats.ignored_affinity_disabled);
        return;
    }
    bump(&stats.delivered);
    sink.on_event(event);
}

/// Unauthenticated messages are a security signal, so they are logged at `warn` (at most
/// once per 30 s, with the number dropped since the last line).
fn drop_unauthenticated(shared: &Shared, why: &AuthError) {
    bump(&shared.stats.dropped_unauthenticated);
    if let Some(dropped) = shared.unauthenticated_log.record() {
        tracing::warn!(reason = %why, dropped, "unauthenticated replica-sync message dropped");
    }
}

fn log_drop(shared: &Shared, why: &dyn std::fmt::Display) {
    if let Some(dropped) = shared.recv_drop_log.record() {
        tracing::debug!(reason = %why, dropped, "replica-sync message dropped");
    }
}

fn handle_command(shared: &Shared, socket: &zmq::Socket, cmd: Command) {
    match cmd {
        Command::Register(endpoint, reply) => {
            let mut peers = shared.links.lock();
            let result = if peers.contains_key(&endpoint) {
                Ok(false)
            } else {
                match connect(socket, &endpoint) {
                    Ok(()) => {
                        tracing::info!(%endpoint, "replica-sync peer registered");
                        peers.insert(endpoint.clone(), PeerLink::new(endpoint));
                        Ok(true)
                    }
                    Err(source) => Err(PeerError::Register { endpoint, source }),
                }
            };
            drop(peers);
            // The caller may have timed out and left; nothing to do then.
            let _ = reply.send(result);
        }
        Command::Deregister(endpoint, reply) => {
            let mut peers = shared.links.lock();
            let result = if !peers.contains_key(&endpoint) {
                Err(PeerError::NotFound { endpoint })
            } else {
                match socket.disconnect(&endpoint) {
                    Ok(()) => {
                        tracing::info!(%endpoint, "replica-sync peer deregistered");
                        peers.remove(&endpoint);
                        Ok(())
                    }
                    Err(source) => Err(PeerError::Deregister { endpoint, source }),
                }
            };
            drop(peers);
            let _ = reply.send(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_limiter_reports_the_count_since_the_last_log() {
        let limiter = LogLimiter::new(Duration::from_secs(3600));
        assert_eq!(limiter.record(), Some(1));
        assert_eq!(limiter.record(), None);
        assert_eq!(limiter.record(), None);
        // Force the period to have elapsed.
        *limiter.last.lock() = Instant::now().checked_sub(Duration::from_secs(7200));
        assert_eq!(limiter.record(), Some(3));
    }

    #[test]
    fn a_peer_is_unreachable_after_three_retries_or_fifteen_seconds_without_a_handshake() {
        let mut link = PeerLink::new("tcp://a:1".into());
        assert!(!link.unreachable(), "just registered");
        link.retries_since_connected = UNREACHABLE_AFTER_RETRIES;
        assert!(link.unreachable(), "refused three times");
        // A peer that accepts TCP but never completes a handshake retries once per 30 s.
        link.retries_since_connected = 1;
        link.disconnected_since = Instant::now().checked_sub(UNREACHABLE_AFTER);
        assert!(link.unreachable(), "no handshake for 15 s");
        link.connected = true;
        link.disconnected_since = None;
        assert!(!link.unreachable());
    }

    #[test]
    fn default_config_matches_the_spec() {
        let c = MeshConfig::new(9092);
        assert_eq!(c.host, "*");
        assert_eq!(c.sequence_queue_capacity, 100_000);
        assert_eq!(c.binding_queue_capacity, 4_096);
        assert!(!c.session_affinity);
        assert!(c.peers.is_empty());
        assert_eq!(c.router_id, None);
    }

    #[test]
    fn peer_errors_use_the_http_wording() {
        let e = PeerError::NotFound {
            endpoint: "tcp://a:1".into(),
        };
        assert_eq!(e.to_string(), "peer not found");
        assert_eq!(PeerError::Disabled.to_string(), "replica sync is disabled");
        assert_eq!(
            PeerError::Unavailable.to_string(),
            "replica peer manager is unavailable"
        );
        let e = PeerError::Register {
            endpoint: "tcp://a:1".into(),
            source: zmq::Error::EINVAL,
        };
        assert!(
            e.to_string()
                .starts_with("failed to register replica peer `tcp://a:1`: ")
        );
    }
}
