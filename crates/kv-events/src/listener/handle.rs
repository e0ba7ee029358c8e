//! The public handles: a [`ListenerGroup`] owns a group's thread, a [`KvEventListener`]
//! starts one listener on a group and stops it again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{JoinHandle, ThreadId};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::config::{KvEventSink, ListenerConfig, ListenerError, ListenerState};
use super::group::{GroupShared, run_group};
use super::socket::{WAKE, new_socket, watch_connection, zmq_err};
use super::worker::{Shared, Worker};
use crate::endpoint::validate_endpoint;
use crate::stats::ListenerStats;

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
        Self::lowered(name, 0)
    }

    /// Like [`Self::new`], its thread's nice value raised by `nice` (see
    /// [`crate::lower_thread_priority`]); a thread that cannot lower itself runs at its
    /// creator's priority, with a warning.
    pub fn lowered(name: impl Into<String>, nice: u8) -> Result<Self, ListenerError> {
        let poll = mio::Poll::new().map_err(ListenerError::Poller)?;
        let waker = mio::Waker::new(poll.registry(), WAKE).map_err(ListenerError::Poller)?;
        let shared = Arc::new(GroupShared::default());
        let for_thread = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                if let Err(error) = crate::lower_thread_priority(nice) {
                    tracing::warn!(%error, nice, "could not lower a KV listener thread's priority");
                }
                run_group(&for_thread, poll)
            })
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
        sub.set_rcvhwm(config.receive_hwm)
            .map_err(zmq_err("setsockopt", &config.endpoint))?;
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
        let worker = Worker::new(ctx, config, sub, monitor, sink, &shared);
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
