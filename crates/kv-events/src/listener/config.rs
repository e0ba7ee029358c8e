//! What a listener is told and what it tells: its configuration, the sink its batches go
//! to, why it could not start, and its lifecycle state.

use std::sync::Arc;
use std::time::Duration;

use kv_types::{KvOperation, WorkerKey};

use crate::endpoint::EndpointError;
use crate::stats::ReasonTotals;

/// Receives the operations of each applied batch, in publisher order. Called from the
/// listener group's thread; it must not block for long (that group's other listeners wait
/// meanwhile), and it must not stop listeners of its own group (their stop would wait for
/// the thread that is calling it: such a stop only requests, see [`KvEventListener::stop`]).
///
/// [`KvEventListener::stop`]: crate::KvEventListener::stop
pub trait KvEventSink: Send + Sync + 'static {
    /// All operations of one batch (possibly empty when every event was filtered).
    fn apply(&self, ops: &[KvOperation]);

    /// Several consecutive batches of one listener, in order: `batches` holds, per batch,
    /// where its operations end in `ops`, and its seq. A listener that read several
    /// messages in one go hands them over in one call, so a sink that takes a lock per call
    /// takes it once for them all. The default applies them batch by batch.
    fn apply_batches(&self, ops: &[KvOperation], batches: &[(usize, u64)]) {
        let mut start = 0;
        for &(end, _) in batches {
            self.apply(ops.get(start..end).unwrap_or_default());
            start = end;
        }
    }

    /// [`KvEventSink::apply_batches`] by a sink that may keep the operations instead of
    /// copying them: it may swap `ops` with another vector of operations it is done with,
    /// which the caller then empties and reuses as its own (its vectors included). The
    /// default applies them where they are.
    fn apply_batches_owned(&self, ops: &mut Vec<KvOperation>, batches: &[(usize, u64)]) {
        self.apply_batches(ops, batches);
    }
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

/// Default receive high-water mark of a listener's SUB socket, in messages: a tenth of
/// libzmq's 1,000, which the reference keeps (it sets no `ZMQ_RCVHWM`).
///
/// A listener that falls behind holds up to this many batches of its engine in the
/// server's memory; past it the backlog waits in the connection's TCP buffers and the
/// engine's own send queue (vLLM's and SGLang's publishers queue 100,000 messages). With
/// 1,000, a server that a burst of events outran held the whole burst: every batch a fresh
/// allocation of libzmq's I/O thread, a page fault per 4 KiB to receive it, and after the
/// burst a heap that stayed that large (docs/hot-path.md, "a receive queue of 100
/// batches"). A hundred batches are still a few seconds of an engine's events.
pub const DEFAULT_RECEIVE_HWM: i32 = 100;

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
    /// Messages the SUB socket queues before it stops reading its connection
    /// (`ZMQ_RCVHWM`): with `max_message_size`, what one listener can hold unapplied. Past
    /// it the publisher's queue fills and the engine drops, which the listener sees as a
    /// sequence gap and replays. 0 means no limit.
    pub receive_hwm: i32,
    /// When false, the SUB connects immediately but nothing is read until
    /// [`KvEventListener::open`] (the service's ready gate, §2.3).
    ///
    /// [`KvEventListener::open`]: crate::KvEventListener::open
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
            receive_hwm: DEFAULT_RECEIVE_HWM,
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

    pub fn with_receive_hwm(mut self, messages: i32) -> Self {
        self.receive_hwm = messages;
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
