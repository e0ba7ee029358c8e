//! ZMQ-direct KV-event ingress: one listener per (worker, DP rank) endpoint, reconciled rank
//! by rank on every catalog change (`spec/service-semantics.md` §3.4).
//!
//! A rank whose endpoint and replay endpoint are unchanged keeps its listener, watermark and
//! indexed blocks; every other rank of the previous record is stopped and its blocks
//! dropped; new ranks get a fresh listener. Listeners share ZMQ contexts (one I/O thread
//! for hundreds of sockets), at most [`LISTENERS_PER_CONTEXT`] per context: libzmq caps a
//! context at 1,023 sockets. They also share threads: a [`ListenerGroup`] polls about
//! [`LISTENERS_PER_GROUP`] of them.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kv_events::{
    KvEventListener, KvEventSink, ListenerConfig, ListenerError, ListenerGroup, ListenerState,
    ListenerStats,
};
use kv_types::{KvOperation, WorkerId, WorkerKey};
use parking_lot::Mutex;

use crate::catalog::{PartitionKey, WorkerRequest};
use crate::core::partition::Partition;

/// Why `endpoint` cannot reach an engine, for the `inproc://` transport: it only connects
/// sockets of one ZMQ context, and the listeners' contexts are private to the service, so
/// no engine can ever publish there. The endpoint stays valid (http-api §4.2 accepts the
/// scheme, and the worker stays schedulable, as with the reference) but is not connected:
/// each connect to a name nobody binds stays pending in the context for good, libzmq
/// creates a socket per pending name when the context ends (aborting the process past
/// 1,023), and the names share the context with the listeners' connection monitors.
fn private_endpoint(endpoint: &str) -> Option<String> {
    endpoint.starts_with("inproc://").then(|| {
        format!(
            "inproc endpoint `{endpoint}` cannot receive events: it names a socket inside \
             this service's own ZMQ context, where no engine publishes"
        )
    })
}

/// Where decoded engine events go (the core, through a weak reference).
pub(crate) trait IngressSink: Send + Sync + 'static {
    fn apply(&self, partition: &PartitionKey, ops: &[KvOperation]);

    /// [`IngressSink::apply`] that may keep `ops`, leaving another vector of operations
    /// it is done with in their place ([`KvEventSink::apply_batches_owned`]).
    fn apply_owned(&self, partition: &PartitionKey, ops: &mut Vec<KvOperation>) {
        self.apply(partition, ops);
    }
}

/// A listener's sink: its partition's index, through the core.
struct PartitionSink {
    sink: Arc<dyn IngressSink>,
    partition: PartitionKey,
}

impl KvEventSink for PartitionSink {
    fn apply(&self, ops: &[KvOperation]) {
        self.sink.apply(&self.partition, ops);
    }

    /// The batches' operations in one call: applied in order, they change the index as
    /// the batches one by one would, under one writer's turn instead of one per batch.
    fn apply_batches(&self, ops: &[KvOperation], _batches: &[(usize, u64)]) {
        self.sink.apply(&self.partition, ops);
    }

    fn apply_batches_owned(&self, ops: &mut Vec<KvOperation>, _batches: &[(usize, u64)]) {
        self.sink.apply_owned(&self.partition, ops);
    }
}

#[derive(Debug)]
struct Registered {
    endpoint: String,
    replay_endpoint: Option<String>,
    partition: Arc<Partition>,
    listener: RankListener,
    /// Dropped after the listener (declaration order): its sockets are closed by then.
    /// `None` for a refused endpoint, which holds no socket.
    _context: Option<ContextLease>,
}

/// A rank's listener, or the connect error of an endpoint libzmq refused.
///
/// Endpoints are only syntax-checked (http-api §4.2): libzmq refuses some valid-looking ones
/// at connect time, such as `tcp://*:5557` (a wildcard host can be bound, not connected
/// to). The reference keeps such a worker schedulable and selectable, without events
/// (transcript steps 75–76), so a refused rank is kept too, shown as failed in the
/// worker's warnings and in `/metrics` (beyond-reference #10).
#[derive(Debug)]
enum RankListener {
    Running(KvEventListener),
    Refused { error: String },
}

impl RankListener {
    fn request_stop(&self) {
        if let Self::Running(l) = self {
            l.request_stop();
        }
    }

    fn stop(self) {
        if let Self::Running(l) = self {
            l.stop();
        }
    }

    /// Reconnects without a handshake, when the publisher looks unreachable.
    fn unreachable(&self) -> Option<u64> {
        match self {
            Self::Running(l) if l.stats().unreachable() => {
                Some(ListenerStats::get(&l.stats().retries_since_connected))
            }
            _ => None,
        }
    }

    /// Why the listener is not receiving events, if it failed.
    fn failure(&self) -> Option<String> {
        match self {
            Self::Running(l) => match l.state() {
                ListenerState::Failed { error } => Some(error),
                _ => None,
            },
            Self::Refused { error } => Some(error.clone()),
        }
    }

    fn stats(&self) -> Option<&Arc<ListenerStats>> {
        match self {
            Self::Running(l) => Some(l.stats()),
            Self::Refused { .. } => None,
        }
    }

    fn watermark(&self) -> Option<u64> {
        match self {
            Self::Running(l) => l.watermark(),
            Self::Refused { .. } => None,
        }
    }
}

/// Listeners given one ZMQ context. libzmq refuses a context's 1,024th socket
/// (`ZMQ_MAX_SOCKETS`, which the `zmq` crate cannot raise) with EMFILE, and a listener holds
/// up to four (its SUB socket, the two PAIR ends of its connection monitor and, during a
/// replay, a DEALER); with a single context every registration past about 1,000 (worker,
/// rank) listeners failed with "Too many open files" whatever the process's descriptor
/// limit.
const LISTENERS_PER_CONTEXT: usize = 250;

/// Name of libzmq's I/O and reaper threads (at most 15 bytes, Linux's limit).
const ZMQ_THREAD_NAME: &str = "kv-zmq-io";

/// A ZMQ context whose threads are named [`ZMQ_THREAD_NAME`] and run with their nice value
/// raised by `nice` ([`kv_events::lower_thread_priority`]).
///
/// libzmq starts a context's I/O and reaper threads with its first socket, from the thread
/// that opens it, and (as the `zmq` crate builds it) does not name them, so they take that
/// thread's name: a registration's `tokio-rt-worker`. Under a stream of events the I/O
/// thread is the third-busiest of the server, and per-thread tools (`top -H`, `perf`)
/// showed its time as the async runtime's. A first socket opened and closed on a thread of
/// that name starts them under it, and with its nice value (a thread inherits its
/// creator's); should it fail, the listener's own socket reports why.
fn named_context(nice: u8) -> zmq::Context {
    let ctx = zmq::Context::new();
    let opener = ctx.clone();
    let started = std::thread::Builder::new()
        .name(ZMQ_THREAD_NAME.to_owned())
        .spawn(move || {
            if let Err(error) = kv_events::lower_thread_priority(nice) {
                tracing::warn!(%error, nice, "could not lower the ZMQ I/O threads' priority");
            }
            opener.socket(zmq::SUB).map(drop)
        });
    if let Ok(handle) = started {
        let _ = handle.join();
    }
    ctx
}

/// ZMQ contexts shared by listeners, each holding at most `cap` of them.
#[derive(Debug)]
struct ContextPool {
    cap: usize,
    /// Nice value increment of the contexts' I/O threads.
    nice: u8,
    slots: Mutex<Vec<Arc<ContextSlot>>>,
}

struct ContextSlot {
    ctx: zmq::Context,
    listeners: AtomicUsize,
}

impl std::fmt::Debug for ContextSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextSlot")
            .field("listeners", &self.listeners.load(Ordering::Relaxed))
            .finish()
    }
}

/// One listener's place in a context; gives it back when dropped.
#[derive(Debug)]
struct ContextLease(Arc<ContextSlot>);

impl Drop for ContextLease {
    fn drop(&mut self) {
        self.0.listeners.fetch_sub(1, Ordering::AcqRel);
    }
}

impl ContextPool {
    fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            nice: 0,
            slots: Mutex::new(Vec::new()),
        }
    }

    /// A place in the first context with room, or in a new context (its I/O thread starts
    /// with its first socket). Contexts are kept once made: two idle threads each.
    fn lease(&self) -> ContextLease {
        let mut slots = self.slots.lock();
        // Counts only grow under this lock, so a slot seen with room keeps it.
        let slot = match slots
            .iter()
            .find(|s| s.listeners.load(Ordering::Acquire) < self.cap)
        {
            Some(s) => Arc::clone(s),
            None => {
                let s = Arc::new(ContextSlot {
                    ctx: named_context(self.nice),
                    listeners: AtomicUsize::new(0),
                });
                slots.push(Arc::clone(&s));
                s
            }
        };
        slot.listeners.fetch_add(1, Ordering::AcqRel);
        ContextLease(slot)
    }

    #[cfg(test)]
    fn contexts(&self) -> usize {
        self.slots.lock().len()
    }
}

/// Listeners per group thread once every core has a group: 1,200 (worker, rank) streams on
/// two cores run in 2 threads instead of 1,200 (past the `pids.max` of many container
/// platforms). A wake-up costs only what its ready sockets cost, and a group decodes and
/// indexes on one core, so groups beyond the cores add only context switches, and threads
/// that keep the HTTP thread from a core: with 64 per group, 2,048 publishing workers ran 32
/// groups on two cores and applied 15 % fewer blocks per second (docs/hot-path.md). The cap
/// only bounds the sockets one thread re-checks on its 5 s safety pass.
const LISTENERS_PER_GROUP: usize = 1024;

/// Listener groups with room for about `cap` listeners each. A group decodes and indexes on
/// one core, so the first `min_groups` listeners (the machine's cores) get a group each and
/// later ones go to the least loaded group with room: a few engines keep their parallelism,
/// a thousand need a few dozen threads. Groups are kept once made (an idle one wakes every
/// few seconds); the cap is soft, since two registrations racing may both pick the last
/// place.
#[derive(Debug)]
struct GroupPool {
    cap: usize,
    min_groups: usize,
    /// Nice value increment of the groups' threads.
    nice: u8,
    groups: Mutex<Vec<ListenerGroup>>,
}

impl GroupPool {
    fn new(cap: usize, min_groups: usize) -> Self {
        Self {
            cap: cap.max(1),
            min_groups,
            nice: 0,
            groups: Mutex::new(Vec::new()),
        }
    }

    fn group(&self) -> Result<ListenerGroup, ListenerError> {
        let mut groups = self.groups.lock();
        if groups.len() >= self.min_groups
            && let Some(g) = groups
                .iter()
                .filter(|g| g.len() < self.cap)
                .min_by_key(|g| g.len())
        {
            return Ok(g.clone());
        }
        let g = ListenerGroup::lowered(format!("kv-events-{}", groups.len()), self.nice)?;
        groups.push(g.clone());
        Ok(g)
    }

    #[cfg(test)]
    fn groups(&self) -> usize {
        self.groups.lock().len()
    }
}

/// The set of running listeners.
pub(crate) struct Ingress {
    contexts: ContextPool,
    groups: GroupPool,
    sink: Arc<dyn IngressSink>,
    replay_timeout: Duration,
    /// Every listener's `ZMQ_RCVHWM` ([`ListenerConfig::receive_hwm`]).
    receive_hwm: i32,
    /// Drops and filters of every listener this ingress ever ran, by reason.
    totals: Arc<kv_events::ReasonTotals>,
    listeners: Mutex<HashMap<WorkerKey, Registered>>,
    /// Listeners start consuming only once the service is ready (after startup recovery).
    open: AtomicBool,
}

impl std::fmt::Debug for Ingress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingress")
            .field("listeners", &self.listeners.lock().len())
            .finish()
    }
}

impl Ingress {
    /// `listener_threads`: the groups the first listeners get one each (`None`: one per
    /// available core).
    pub(crate) fn new(
        sink: Arc<dyn IngressSink>,
        replay_timeout: Duration,
        listener_threads: Option<std::num::NonZeroUsize>,
    ) -> Self {
        let min_groups = listener_threads
            .or_else(|| std::thread::available_parallelism().ok())
            .map_or(1, usize::from);
        Self {
            contexts: ContextPool::new(LISTENERS_PER_CONTEXT),
            groups: GroupPool::new(LISTENERS_PER_GROUP, min_groups),
            sink,
            replay_timeout,
            receive_hwm: kv_events::DEFAULT_RECEIVE_HWM,
            totals: Arc::default(),
            listeners: Mutex::new(HashMap::new()),
            open: AtomicBool::new(true),
        }
    }

    /// Threads started from now on to receive and decode events (listener groups, ZMQ I/O
    /// threads) run with their nice value raised by `nice`.
    pub(crate) fn with_nice(mut self, nice: u8) -> Self {
        self.contexts.nice = nice;
        self.groups.nice = nice;
        self
    }

    /// Listeners started from now on queue at most `messages` unread messages each.
    pub(crate) fn with_receive_hwm(mut self, messages: i32) -> Self {
        self.receive_hwm = messages;
        self
    }

    /// Reconciles the listeners of `record` against `prev` (same partition, schedulable).
    pub(crate) fn reconcile(
        &self,
        partition: &Arc<Partition>,
        prev: Option<&WorkerRequest>,
        record: &WorkerRequest,
    ) -> Result<(), String> {
        let endpoints = record.listener_endpoints();
        for (rank, ep) in &endpoints {
            check_endpoint(ep).map_err(|why| {
                format!(
                    "invalid kv_events endpoint for worker {} dp_rank {rank}: {why}",
                    record.worker_id
                )
            })?;
        }
        if let Some(ep) = &record.replay_endpoint {
            check_endpoint(ep).map_err(|why| {
                format!(
                    "invalid replay endpoint for worker {}: {why}",
                    record.worker_id
                )
            })?;
        }
        let worker_id = WorkerId(record.worker_id);
        let mut to_stop = Vec::new();
        let mut retained = Vec::new();
        {
            let mut listeners = self.listeners.lock();
            let mine: Vec<WorkerKey> = listeners
                .keys()
                .filter(|k| k.worker_id == worker_id)
                .copied()
                .collect();
            for key in mine {
                let keep = prev.is_some()
                    && listeners.get(&key).is_some_and(|r| {
                        Arc::ptr_eq(&r.partition, partition)
                            && record.has_rank(key.dp_rank.0)
                            && endpoints.get(&key.dp_rank.0) == Some(&r.endpoint)
                            && r.replay_endpoint == record.replay_endpoint
                    });
                if keep {
                    retained.push(key.dp_rank.0);
                } else if let Some(r) = listeners.remove(&key) {
                    to_stop.push((key, r));
                }
            }
        }
        // Stop outside the lock: a stop waits for the batch its group is applying.
        for (key, r) in to_stop {
            r.listener.stop();
            r.partition.index.write(|index| index.remove_rank(key));
        }
        if let Some(prev) = prev {
            for rank in prev.dp_ranks().filter(|r| !retained.contains(r)) {
                let key = WorkerKey::new(prev.worker_id, rank);
                partition.index.write(|index| index.remove_rank(key));
            }
        }
        let mut started: BTreeMap<WorkerKey, Registered> = BTreeMap::new();
        for (rank, ep) in endpoints.iter().filter(|(r, _)| !retained.contains(r)) {
            let key = WorkerKey::new(record.worker_id, *rank);
            let (listener, context) = match private_endpoint(ep) {
                Some(error) => {
                    tracing::warn!(
                        worker_id = record.worker_id,
                        dp_rank = rank,
                        "kv_events endpoint refused, the rank gets no events: {error}"
                    );
                    (RankListener::Refused { error }, None)
                }
                None => match self.start_rank(record, partition, key, ep) {
                    Ok(started_rank) => started_rank,
                    Err(e) => {
                        for (_, r) in started {
                            r.listener.stop();
                        }
                        return Err(e);
                    }
                },
            };
            started.insert(
                key,
                Registered {
                    endpoint: ep.clone(),
                    replay_endpoint: record.replay_endpoint.clone(),
                    partition: Arc::clone(partition),
                    listener,
                    _context: context,
                },
            );
        }
        self.listeners.lock().extend(started);
        Ok(())
    }

    /// Starts the listener of one rank; a connect libzmq refuses keeps the rank, refused.
    fn start_rank(
        &self,
        record: &WorkerRequest,
        partition: &Arc<Partition>,
        key: WorkerKey,
        ep: &str,
    ) -> Result<(RankListener, Option<ContextLease>), String> {
        let rank = key.dp_rank.0;
        let block_size = record.block_size.unwrap_or(0);
        let mut cfg = ListenerConfig::new(key, ep.to_owned(), block_size)
            .with_replay_timeout(self.replay_timeout)
            .with_receive_hwm(self.receive_hwm)
            .with_totals(Arc::clone(&self.totals));
        match &record.replay_endpoint {
            Some(replay) if private_endpoint(replay).is_some() => {
                tracing::warn!(
                    worker_id = record.worker_id,
                    "replay endpoint {replay} is in-process: gaps are counted, not replayed"
                );
            }
            Some(replay) => cfg = cfg.with_replay_endpoint(replay.clone()),
            None => {}
        }
        cfg.start_open = self.open.load(Ordering::SeqCst);
        let apply = PartitionSink {
            sink: Arc::clone(&self.sink),
            partition: partition.key.clone(),
        };
        let lease = self.contexts.lease();
        let started_on = self.groups.group().and_then(|group| {
            KvEventListener::start_on(&group, &lease.0.ctx, cfg, Arc::new(apply))
        });
        match started_on {
            Ok(l) => Ok((RankListener::Running(l), Some(lease))),
            Err(
                e @ ListenerError::Zmq {
                    operation: "connect",
                    ..
                },
            ) => {
                tracing::warn!(
                    worker_id = record.worker_id,
                    dp_rank = rank,
                    "kv_events endpoint refused, the rank gets no events: {e}"
                );
                let error = e.to_string();
                Ok((RankListener::Refused { error }, None))
            }
            Err(e) => Err(format!(
                "failed to start kv_events listener for dp_rank {rank}: {e}"
            )),
        }
    }

    /// Stops every listener of a worker (all ranks).
    pub(crate) fn detach_worker(&self, worker_id: WorkerId) {
        let stopped: Vec<Registered> = {
            let mut listeners = self.listeners.lock();
            let keys: Vec<WorkerKey> = listeners
                .keys()
                .filter(|k| k.worker_id == worker_id)
                .copied()
                .collect();
            keys.into_iter()
                .filter_map(|k| listeners.remove(&k))
                .collect()
        };
        stop_together(stopped);
    }

    pub(crate) fn stop_all(&self) {
        let all: Vec<Registered> = self.listeners.lock().drain().map(|(_, r)| r).collect();
        stop_together(all);
    }

    /// Operator-visible problems of a worker's listeners.
    pub(crate) fn warnings(&self, worker_id: WorkerId) -> Vec<String> {
        let listeners = self.listeners.lock();
        let mut out: Vec<(u32, String)> = listeners
            .iter()
            .filter(|(k, _)| k.worker_id == worker_id)
            .filter_map(|(k, r)| {
                if let Some(error) = r.listener.failure() {
                    return Some((
                        k.dp_rank.0,
                        format!(
                            "kv_events listener for dp_rank {} failed: {error}",
                            k.dp_rank
                        ),
                    ));
                }
                let retries = r.listener.unreachable()?;
                Some((
                    k.dp_rank.0,
                    format!(
                        "kv_events endpoint {} for dp_rank {} is not connected: {retries} \
                         reconnect attempts without a ZMQ handshake",
                        r.endpoint, k.dp_rank
                    ),
                ))
            })
            .collect();
        out.sort();
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// Every failed listener (`/metrics`), in key order.
    pub(crate) fn failed(&self) -> Vec<WorkerKey> {
        self.keys_where(|r| r.failure().is_some())
    }

    /// Every listener whose publisher looks unreachable (`/metrics`), in key order.
    pub(crate) fn unreachable(&self) -> Vec<WorkerKey> {
        self.keys_where(|r| r.unreachable().is_some())
    }

    fn keys_where(&self, f: impl Fn(&RankListener) -> bool) -> Vec<WorkerKey> {
        let listeners = self.listeners.lock();
        let mut out: Vec<WorkerKey> = listeners
            .iter()
            .filter(|(_, r)| f(&r.listener))
            .map(|(k, _)| *k)
            .collect();
        out.sort();
        out
    }

    /// Drops, filters and truncations of every listener this ingress ran, by reason.
    pub(crate) fn totals(&self) -> &kv_events::ReasonTotals {
        &self.totals
    }

    /// Per-listener statistics for `/metrics`.
    pub(crate) fn stats(&self) -> Vec<(WorkerKey, Arc<ListenerStats>)> {
        let listeners = self.listeners.lock();
        let mut out: Vec<(WorkerKey, Arc<ListenerStats>)> = listeners
            .iter()
            .filter_map(|(k, r)| Some((*k, Arc::clone(r.listener.stats()?))))
            .collect();
        out.sort_by_key(|(k, _)| *k);
        out
    }

    pub(crate) fn watermark(&self, key: WorkerKey) -> Option<u64> {
        self.listeners
            .lock()
            .get(&key)
            .and_then(|r| r.listener.watermark())
    }
}

/// The contract's wording of an invalid endpoint (http-api §4.2).
fn check_endpoint(ep: &str) -> Result<(), String> {
    kv_types::validate_endpoint(ep).map_err(|e| e.to_string())
}

impl Drop for Ingress {
    fn drop(&mut self) {
        // A core dropped without `shutdown` stops its listeners the same way.
        self.stop_all();
    }
}

/// Stops listeners with overlapping waits: every stop is requested before any is waited for,
/// so each group finishes the batch it is applying once, not once per listener.
fn stop_together(listeners: Vec<Registered>) {
    for r in &listeners {
        r.listener.request_stop();
    }
    for r in listeners {
        r.listener.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::{ContextPool, GroupPool, check_endpoint};
    use kv_events::{KvEventListener, ListenerConfig};
    use kv_types::{KvOperation, WorkerKey};

    #[test]
    fn groups_fill_up_to_the_cap_and_reuse_freed_places() {
        let pool = GroupPool::new(2, 1);
        let ctx = zmq::Context::new();
        let start = |w: u64| {
            let group = pool.group().expect("group thread starts");
            // Nothing listens there: ZMQ keeps retrying the connect, which is all this needs.
            let config = ListenerConfig::new(WorkerKey::new(w, 0), "tcp://127.0.0.1:1", 4);
            let sink = std::sync::Arc::new(|_: &[KvOperation]| {});
            let listener = KvEventListener::start_on(&group, &ctx, config, sink);
            (group, listener.expect("listener starts"))
        };
        let mut started: Vec<_> = (0..5).map(start).collect();
        assert_eq!(pool.groups(), 3);
        let lens: Vec<usize> = started.iter().map(|(g, _)| g.len()).collect();
        assert_eq!(lens, [2, 2, 2, 2, 1]);
        // A stopped listener's place is the next one given, without a new group.
        let (_, listener) = started.remove(1);
        listener.stop();
        let (group, _again) = start(5);
        assert_eq!(group.len(), 2);
        assert_eq!(pool.groups(), 3);
        assert_eq!(started[0].0.len(), 2);
    }

    #[test]
    fn the_first_listeners_get_a_group_each_then_the_least_loaded_one() {
        let pool = GroupPool::new(4, 3);
        let ctx = zmq::Context::new();
        let mut started = Vec::new();
        let mut lens = Vec::new();
        for w in 0..7 {
            let group = pool.group().expect("group thread starts");
            let config = ListenerConfig::new(WorkerKey::new(w, 0), "tcp://127.0.0.1:1", 4);
            let sink = std::sync::Arc::new(|_: &[KvOperation]| {});
            let listener = KvEventListener::start_on(&group, &ctx, config, sink);
            started.push((group, listener.expect("listener starts")));
            lens.push(pool.groups());
        }
        assert_eq!(lens, [1, 2, 3, 3, 3, 3, 3]);
        let sizes: Vec<usize> = started.iter().take(3).map(|(g, _)| g.len()).collect();
        assert_eq!(sizes, [3, 2, 2]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_contexts_threads_carry_its_name() {
        let names = || -> Vec<String> {
            std::fs::read_dir("/proc/self/task")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .map(|c| c.trim_end().to_owned())
                .collect()
        };
        let ctx = super::named_context(0);
        // The I/O and reaper threads run from the first socket on, under the name, until
        // the context ends (other tests' contexts can only add to the count). Each takes
        // the name once it runs: wait for that, boundedly.
        let named = || {
            names()
                .iter()
                .filter(|n| *n == super::ZMQ_THREAD_NAME)
                .count()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while named() < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(named() >= 2, "{} named: {:?}", named(), names());
        drop(ctx);
    }

    /// The nice values of this process's threads whose names start with `name`.
    #[cfg(target_os = "linux")]
    fn nice_values(name: &str) -> Vec<i64> {
        testkit::thread_nice_values(std::process::id(), name)
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn ingest_threads_start_with_their_nice_value_raised() {
        struct Nowhere;
        impl super::IngressSink for Nowhere {
            fn apply(&self, _: &crate::catalog::PartitionKey, _: &[KvOperation]) {}
        }
        // 7: no other test of this process lowers a thread by that much, so a thread at 7
        // is one of this ingress's.
        let ingress = super::Ingress::new(
            std::sync::Arc::new(Nowhere),
            std::time::Duration::from_secs(1),
            NonZeroUsize::new(1),
        )
        .with_nice(7);
        let _group = ingress.groups.group().expect("group");
        let _lease = ingress.contexts.lease();
        // The group's thread lowers itself once running, and every thread takes its name
        // once it runs: wait for both, boundedly.
        let lowered_io = || {
            nice_values(super::ZMQ_THREAD_NAME)
                .iter()
                .filter(|&&n| n == 7)
                .count()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !(nice_values("kv-events-").contains(&7) && lowered_io() >= 2)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            nice_values("kv-events-").contains(&7),
            "{:?}",
            nice_values("kv-events-")
        );
        // libzmq's I/O and reaper threads inherit the opener's value.
        let io = nice_values(super::ZMQ_THREAD_NAME);
        assert!(io.iter().filter(|&&n| n == 7).count() >= 2, "{io:?}");
    }

    #[test]
    fn listener_threads_set_the_groups_the_first_listeners_get() {
        struct Nowhere;
        impl super::IngressSink for Nowhere {
            fn apply(&self, _: &crate::catalog::PartitionKey, _: &[KvOperation]) {}
        }
        let timeout = std::time::Duration::from_secs(1);
        let one = super::Ingress::new(std::sync::Arc::new(Nowhere), timeout, NonZeroUsize::new(1));
        assert_eq!(one.groups.min_groups, 1);
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let default = super::Ingress::new(std::sync::Arc::new(Nowhere), timeout, None);
        assert_eq!(default.groups.min_groups, cores);
        // With one thread, listeners share its group until it is full.
        let a = one.groups.group().expect("group");
        let b = one.groups.group().expect("group");
        assert_eq!(one.groups.groups(), 1);
        drop((a, b));
    }

    #[test]
    fn contexts_fill_up_to_the_cap_and_reuse_freed_places() {
        let pool = ContextPool::new(2);
        let leases: Vec<_> = (0..5).map(|_| pool.lease()).collect();
        assert_eq!(pool.contexts(), 3);
        let same = |a: usize, b: usize| std::sync::Arc::ptr_eq(&leases[a].0, &leases[b].0);
        assert!(same(0, 1) && same(2, 3) && !same(1, 2) && !same(3, 4));
        let mut leases = leases;
        // A place freed in the first context is the next one given, without a new context.
        let freed = std::sync::Arc::clone(&leases[1].0);
        drop(leases.remove(1));
        let again = pool.lease();
        assert!(std::sync::Arc::ptr_eq(&again.0, &freed));
        assert_eq!(pool.contexts(), 3);
        let counts: Vec<usize> = pool
            .slots
            .lock()
            .iter()
            .map(|s| s.listeners.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        assert_eq!(counts, [2, 2, 1]);
    }

    #[test]
    fn endpoint_errors_use_the_contract_wording() {
        let cases = [
            (
                "127.0.0.1:1",
                "invalid ZMQ endpoint `127.0.0.1:1`: missing scheme",
            ),
            ("tcp://", "invalid ZMQ endpoint `tcp://`: missing address"),
            (
                "tcp://h",
                "invalid ZMQ endpoint `tcp://h`: missing TCP port",
            ),
            (
                "tcp://:1",
                "invalid ZMQ endpoint `tcp://:1`: missing TCP host",
            ),
            (
                "tcp://h:x",
                "invalid ZMQ endpoint `tcp://h:x`: invalid TCP port: invalid digit found in string",
            ),
            (
                "udp://h:1",
                "invalid ZMQ endpoint `udp://h:1`: unsupported scheme `udp`",
            ),
        ];
        for (ep, msg) in cases {
            assert_eq!(check_endpoint(ep).err().as_deref(), Some(msg), "{ep}");
        }
        assert!(check_endpoint("tcp://*:5557").is_ok());
    }
}
