//! `SelectionCore`: the catalog, the partitions and every selection / reservation operation.
//!
//! Locking: the catalog (`State`) is a `RwLock` read by every selection for a few
//! microseconds and written only by catalog mutations, which are additionally serialized by
//! `catalog_mutation` so that listener reconciliation never races itself. Each partition has
//! its own index lock (readers: selections; writer: event ingestion, one event at a time)
//! and its own ledger mutex. Hashing happens before any lock is taken.

mod admit;
mod attempt;
mod booking;
mod catalog;
mod ingest;
mod inspect;
pub(crate) mod partition;
mod prompt;
pub(crate) mod replica;
mod rows;
mod select;
mod sessions;
mod state;

pub use attempt::Attempt;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_types::{TrackingHasher, WorkerKey};
use load_accounting::ReservationId;
use parking_lot::{Mutex, RwLock};
use selection_policy::{Policy, PolicyClasses, RouterConfig};

use self::partition::{Partition, index_config};
use self::state::{ReservationRow, State};
use crate::catalog::PartitionKey;
use crate::error::SelectionError;
use crate::ingress::{Ingress, IngressSink};
use crate::metrics::CoreMetrics;
use crate::pending::{PendingCache, SelectionCacheConfig};

/// Builds the worker-selection policy of a partition; called once per partition.
pub type PolicyFactory = Arc<dyn Fn(&RouterConfig, &PartitionKey) -> Policy + Send + Sync>;

/// [`CoreConfig::kv_writer_step_aside`]'s default: about a tenth of the scheduler's slice,
/// so a `/select` woken on a listener's core waits far less than one (docs/hot-path.md,
/// "listeners that step aside").
pub const DEFAULT_KV_WRITER_STEP_ASIDE: Duration = Duration::from_micros(250);

/// Everything the core needs to know, with the spec's defaults.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    pub router: RouterConfig,
    pub selection_cache: SelectionCacheConfig,
    pub tracking: TrackingHasher,
    /// Absolute booking age after which a reservation is reclaimed.
    pub active_request_expiry: Duration,
    /// Upper bound on live reservations across the process (`None` = unbounded).
    pub max_active_reservations: Option<usize>,
    /// How long a gap replay may wait for the engine.
    pub replay_timeout: Duration,
    /// Threads that receive, decode and index KV events, each running a group of up to
    /// 1,024 listeners (`None` = one per available core, one fewer with a writer thread,
    /// which takes a core of its own; more are made past that many listeners).
    pub kv_listener_threads: Option<std::num::NonZeroUsize>,
    /// How long a listener thread applies events before it steps aside at the next
    /// write-section boundary: it releases the index lock and yields its core, so a busy
    /// listener is preempted between sections rather than inside one, and a woken HTTP
    /// thread gets the core within about this long (`None`: never; see kv-index's gate.rs).
    pub kv_writer_step_aside: Option<Duration>,
    /// How much lower than the process's priority the threads that receive and decode KV
    /// events run (nice value increment, 0–19): where they share cores with the HTTP
    /// threads and an index writer thread, the serial work (the index write, lookups) gets
    /// the larger share of a contended core (docs/hot-path.md, "ingest threads at a lower
    /// priority"). With the listeners writing the index themselves, it lowers the writes
    /// too.
    pub kv_ingest_nice: u8,
    /// Copies of each partition's index: one behind a lock (lookups wait for the write
    /// section in progress), or the index and a lookup-only mirror, so lookups never wait
    /// for a writer, for a third more index memory and more write CPU (docs/hot-path.md,
    /// "a lookup-only mirror").
    pub kv_index_copies: kv_index::IndexCopies,
    /// Who applies the listeners' batches to a two-copy index: the listener threads, one
    /// at a time, or a writer thread per partition that they hand their batches to, so
    /// that decoding and writing run on two cores (docs/hot-path.md, "a writer thread").
    /// One copy ignores it.
    pub kv_index_writer: kv_index::IndexWriter,
    /// Messages each KV listener queues unread before it stops reading its connection
    /// (`ZMQ_RCVHWM`; [`kv_events::DEFAULT_RECEIVE_HWM`], 100). With the largest message accepted, this
    /// bounds the memory a stalled server gives to backlogs; past it the engines drop,
    /// and the listeners replay the gaps.
    pub kv_receive_hwm: i32,
    /// Seed of the pickers' random source (`None` = from the clock).
    pub rng_seed: Option<u64>,
    /// Enables per-partition session-affinity tables (hard mode) with this idle TTL.
    pub session_affinity_ttl: Option<Duration>,
    /// This replica's id as a session-binding writer (0 without replica sync).
    pub replica_id: u64,
    /// Longest prompt accepted, in tokens; longer ones fail with 413 before hashing.
    pub max_prompt_tokens: usize,
    /// Policy classes of the admission queue (from a policy file); `None` = the synthetic
    /// class of `router.router_queue_threshold` / `router.router_queue_policy`.
    pub policy_classes: Option<PolicyClasses>,
    /// A request that waited in the queue at least this long has its overlap looked up
    /// again before scheduling (`DYN_ROUTER_OVERLAP_REFRESH_AFTER_SECS`); `None` = never.
    pub overlap_refresh_after: Option<Duration>,
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            selection_cache: SelectionCacheConfig::default(),
            tracking: TrackingHasher::Public,
            active_request_expiry: Duration::from_secs(300),
            max_active_reservations: None,
            replay_timeout: Duration::from_secs(5),
            kv_listener_threads: None,
            kv_writer_step_aside: Some(DEFAULT_KV_WRITER_STEP_ASIDE),
            kv_ingest_nice: 0,
            kv_index_copies: kv_index::IndexCopies::One,
            kv_index_writer: kv_index::IndexWriter::Listeners,
            kv_receive_hwm: kv_events::DEFAULT_RECEIVE_HWM,
            rng_seed: None,
            session_affinity_ttl: None,
            replica_id: 0,
            max_prompt_tokens: 1_000_000,
            policy_classes: None,
            overlap_refresh_after: Some(selection_policy::DEFAULT_OVERLAP_REFRESH_AFTER),
        }
    }
}

/// The whole selection service state, usable without any task or socket.
pub struct SelectionCore {
    config: CoreConfig,
    policy_factory: Option<PolicyFactory>,
    state: RwLock<State>,
    catalog_mutation: Mutex<()>,
    /// Keyed by the id the ledger books under: a claim allocates it once, the booking
    /// shares it.
    reservations: Mutex<HashMap<ReservationId, ReservationRow>>,
    pending: Mutex<PendingCache>,
    ingress: Ingress,
    shut_down: AtomicBool,
    metrics: CoreMetrics,
    rng_seed: AtomicU64,
    replica: RwLock<Option<Arc<replica_sync::ReplicaMesh>>>,
    replica_stats: crate::replica::ReplicaApplyStats,
    /// When a claim at the reservation limit may next run the expiry sweep itself.
    next_full_sweep: Mutex<Instant>,
}

impl std::fmt::Debug for SelectionCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelectionCore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn no_schedulable() -> SelectionError {
    SelectionError::not_ready("no schedulable workers are available")
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0x5EED)
}

impl SelectionCore {
    /// A local-only core: no replica mesh, no recovery; the index is ready immediately.
    pub fn try_new_local(
        config: CoreConfig,
        policy_factory: Option<PolicyFactory>,
    ) -> Result<Arc<Self>, crate::BuildError> {
        config
            .router
            .validate()
            .map_err(|e| crate::BuildError::RouterConfig(e.to_string()))?;
        index_config(&config.router)
            .validate()
            .map_err(|e| crate::BuildError::RouterConfig(e.to_string()))?;
        let seed = config.rng_seed.unwrap_or_else(clock_seed);
        let replay_timeout = config.replay_timeout;
        let listener_threads = config
            .kv_listener_threads
            .or_else(|| default_listener_threads(&config));
        let receive_hwm = config.kv_receive_hwm;
        let ingest_nice = config.kv_ingest_nice;
        // One line with what the ingest path resolved to: several of these defaults
        // depend on each other and on the cores, and an operator reading a profile or a
        // memory figure needs them.
        tracing::info!(
            index_copies = ?config.kv_index_copies,
            index_writer = ?effective_writer(&config),
            listener_threads = listener_threads.map_or(1, usize::from),
            ingest_nice,
            receive_hwm,
            step_aside_us = config.kv_writer_step_aside.map_or(0, |d| d.as_micros()),
            "kv-event ingest settings"
        );
        Ok(Arc::new_cyclic(|weak: &std::sync::Weak<SelectionCore>| {
            let sink: Arc<dyn IngressSink> = Arc::new(weak.clone());
            Self {
                pending: Mutex::new(PendingCache::new(config.selection_cache)),
                config,
                policy_factory,
                state: RwLock::default(),
                catalog_mutation: Mutex::new(()),
                reservations: Mutex::default(),
                ingress: Ingress::new(sink, replay_timeout, listener_threads)
                    .with_receive_hwm(receive_hwm)
                    .with_nice(ingest_nice),
                shut_down: AtomicBool::new(false),
                metrics: CoreMetrics::default(),
                rng_seed: AtomicU64::new(seed),
                replica: RwLock::new(None),
                replica_stats: crate::replica::ReplicaApplyStats::default(),
                next_full_sweep: Mutex::new(Instant::now()),
            }
        }))
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    pub fn metrics(&self) -> &CoreMetrics {
        &self.metrics
    }

    /// Statistics of every running KV-event listener, by worker key.
    pub fn listener_stats(&self) -> Vec<(WorkerKey, Arc<kv_events::ListenerStats>)> {
        self.ingress.stats()
    }

    /// Drops and filters by reason over every KV listener this core has run, removed
    /// ones included: monotonic, unlike a sum over [`Self::listener_stats`].
    pub fn listener_totals(&self) -> &kv_events::ReasonTotals {
        self.ingress.totals()
    }

    /// The (worker, rank) listeners that receive no events because they failed (a socket
    /// error, or an endpoint libzmq refused at connect), in key order. The worker's catalog
    /// record says why, in `warnings`.
    pub fn failed_listeners(&self) -> Vec<WorkerKey> {
        self.ingress.failed()
    }

    /// The (worker, rank) listeners whose publisher looks unreachable: libzmq keeps
    /// retrying without a handshake ([`kv_events::ListenerStats::unreachable`]). They
    /// recover by themselves once the publisher answers; the worker's catalog record says
    /// so in `warnings` meanwhile.
    pub fn unreachable_listeners(&self) -> Vec<WorkerKey> {
        self.ingress.unreachable()
    }

    /// Seq of the last batch applied by a rank's listener.
    pub fn listener_watermark(&self, key: WorkerKey) -> Option<u64> {
        self.ingress.watermark(key)
    }

    /// Stops accepting selections and new bookings, and stops every KV listener.
    pub fn shutdown(&self) {
        if !self.shut_down.swap(true, Ordering::SeqCst) {
            self.ingress.stop_all();
            if let Some(mesh) = self.replica.write().take() {
                mesh.shutdown();
            }
            let partitions: Vec<Arc<Partition>> =
                self.state.read().partitions.values().cloned().collect();
            for p in partitions {
                if let Some(q) = &p.queue {
                    q.shut_down();
                }
            }
        }
    }

    pub fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::SeqCst)
    }

    pub(super) fn check_running(&self) -> Result<(), SelectionError> {
        if self.is_shut_down() {
            Err(SelectionError::shutting_down())
        } else {
            Ok(())
        }
    }

    /// Whether any policy class queues (then non-advisory selections may wait).
    pub fn queueing_enabled(&self) -> bool {
        self.policy_classes().queueing_enabled()
    }

    /// The configured policy classes, or the synthetic one.
    pub(super) fn policy_classes(&self) -> PolicyClasses {
        self.config
            .policy_classes
            .clone()
            .unwrap_or_else(|| PolicyClasses::synthetic(&self.config.router))
    }
}

/// Listener threads when the configuration names none: one per available core, and one
/// fewer (at least one) beside a writer thread, which keeps a core busy applying what they
/// decode. On 2 cores, one listener thread beside the writer applied 1.09× the rate of two
/// at 2,048 publishers and kept the client's `/select` p99 under 1 ms at 16
/// (docs/hot-path.md, "a writer thread"). `None` when the cores cannot be read (the ingress
/// then uses one).
/// Who writes the partitions' indexes: a one-copy index ignores the writer thread.
fn effective_writer(config: &CoreConfig) -> kv_index::IndexWriter {
    match config.kv_index_copies {
        kv_index::IndexCopies::Two => config.kv_index_writer,
        kv_index::IndexCopies::One => kv_index::IndexWriter::Listeners,
    }
}

fn default_listener_threads(config: &CoreConfig) -> Option<std::num::NonZeroUsize> {
    let cores = std::thread::available_parallelism().ok()?;
    if effective_writer(config) == kv_index::IndexWriter::Thread {
        std::num::NonZeroUsize::new(cores.get() - 1).or(Some(std::num::NonZeroUsize::MIN))
    } else {
        Some(cores)
    }
}

#[cfg(test)]
mod tests {
    use super::{CoreConfig, default_listener_threads};
    use kv_index::{IndexCopies, IndexWriter};

    #[test]
    fn a_writer_thread_leaves_one_core_fewer_to_the_listeners() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = |copies, writer| {
            let config = CoreConfig {
                kv_index_copies: copies,
                kv_index_writer: writer,
                ..CoreConfig::default()
            };
            default_listener_threads(&config).map(usize::from)
        };
        assert_eq!(
            threads(IndexCopies::One, IndexWriter::Listeners),
            Some(cores)
        );
        assert_eq!(
            threads(IndexCopies::Two, IndexWriter::Listeners),
            Some(cores)
        );
        // One copy ignores the writer thread.
        assert_eq!(threads(IndexCopies::One, IndexWriter::Thread), Some(cores));
        assert_eq!(
            threads(IndexCopies::Two, IndexWriter::Thread),
            Some((cores - 1).max(1))
        );
    }
}
