//! `SelectionServiceBuilder` -> `SelectionService`: the core plus the background tasks a
//! running service needs (periodic expiry), with an explicit, idempotent shutdown.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::{Cancel, Undo};
use crate::core::{Attempt, CoreConfig, PolicyFactory, SelectionCore};
use crate::error::{BuildError, SelectionError};
use crate::pending::SelectionCacheConfig;
use crate::request::{ReservationRequest, ReservationResponse, SelectRequest, SelectResponse};

/// Largest accepted session-affinity TTL (one year).
pub const MAX_SESSION_AFFINITY_TTL: Duration = Duration::from_secs(31_536_000);

/// Validates settings and starts a [`SelectionService`].
#[derive(Clone)]
pub struct SelectionServiceBuilder {
    config: CoreConfig,
    policy_factory: Option<PolicyFactory>,
    /// The built-in policy behind `policy_factory`, kept to validate its parameters.
    builtin: Option<selection_policy::BuiltinPolicy>,
    expiry_period: Option<Duration>,
    replica: Option<ReplicaSyncConfig>,
    replica_key: Option<replica_sync::ReplicaKey>,
}

/// The replica mesh settings (`--replica-sync-port`, `--replica-sync-peers`, `--host`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaSyncConfig {
    /// Bind host of the PUB socket (`*` = every interface).
    pub host: String,
    /// `None` with peers is a startup error, as in the contract.
    pub port: Option<u16>,
    pub peers: Vec<String>,
}

impl std::fmt::Debug for SelectionServiceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelectionServiceBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SelectionServiceBuilder {
    pub fn new(config: CoreConfig) -> Self {
        Self {
            config,
            policy_factory: None,
            builtin: None,
            expiry_period: None,
            replica: None,
            replica_key: None,
        }
    }

    /// Uses this factory for every partition instead of the built-in policy.
    pub fn worker_selection_policy_factory(mut self, factory: PolicyFactory) -> Self {
        self.builtin = None;
        self.policy_factory = Some(factory);
        self
    }

    /// Uses a built-in policy for every partition, over the service's router configuration:
    /// `.worker_selection_policy(BuiltinPolicy::KvBounded(KvBoundedConfig::default()))`.
    /// Its parameters are validated in [`Self::build`].
    pub fn worker_selection_policy(mut self, policy: selection_policy::BuiltinPolicy) -> Self {
        self.builtin = Some(policy);
        self.policy_factory = Some(Arc::new(move |router, _| {
            policy.build(router, selection_policy::PoolLabel::default())
        }));
        self
    }

    /// Pending-selection cache bounds.
    pub fn selection_cache(mut self, cache: SelectionCacheConfig) -> Self {
        self.config.selection_cache = cache;
        self
    }

    /// How often the expiry pass runs (default: every 60 s, or the expiry if shorter).
    pub fn expiry_period(mut self, period: Duration) -> Self {
        self.expiry_period = Some(period);
        self
    }

    /// Enables the replica mesh (validated in [`Self::build`]).
    pub fn replica_sync(mut self, replica: ReplicaSyncConfig) -> Self {
        self.replica = Some(replica);
        self
    }

    /// Authenticates replica messages with this pre-shared key (`--replica-sync-key-file`);
    /// only meaningful together with [`Self::replica_sync`].
    pub fn replica_sync_key(mut self, key: replica_sync::ReplicaKey) -> Self {
        self.replica_key = Some(key);
        self
    }

    /// Enables session affinity (hard mode) with this idle TTL, 1 s ..= 31,536,000 s.
    pub fn session_affinity(mut self, ttl: Duration) -> Self {
        self.config.session_affinity_ttl = Some(ttl);
        self
    }

    /// Validates everything and starts the service's tasks on the current Tokio runtime.
    pub fn build(self) -> Result<SelectionService, BuildError> {
        if let Some(policy) = &self.builtin {
            policy.validate().map_err(BuildError::Policy)?;
        }
        if let Some(ttl) = self.config.session_affinity_ttl
            && !(Duration::from_secs(1)..=MAX_SESSION_AFFINITY_TTL).contains(&ttl)
        {
            return Err(BuildError::SessionAffinityTtl);
        }
        let cache = self.config.selection_cache;
        if cache.max_entries == 0 {
            return Err(BuildError::SelectionCache {
                field: "max_entries",
            });
        }
        if cache.max_bytes == 0 {
            return Err(BuildError::SelectionCache { field: "max_bytes" });
        }
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| BuildError::Startup("build() must run inside a Tokio runtime".into()))?;
        let period = self
            .expiry_period
            .unwrap_or_else(|| {
                self.config
                    .active_request_expiry
                    .min(Duration::from_secs(60))
            })
            .max(Duration::from_millis(10));
        let mut config = self.config;
        let mesh_config = match self.replica {
            Some(ReplicaSyncConfig {
                port: None, peers, ..
            }) if !peers.is_empty() => {
                return Err(BuildError::ReplicaPeersWithoutPort);
            }
            Some(ReplicaSyncConfig { port: Some(0), .. }) => {
                return Err(BuildError::ReplicaPortZero);
            }
            Some(ReplicaSyncConfig {
                host,
                port: Some(port),
                peers,
            }) => {
                let router_id = replica_sync::RouterId::random();
                config.replica_id = router_id.0;
                let mut m = replica_sync::MeshConfig::new(port);
                m.host = host;
                m.peers = peers;
                m.session_affinity = config.session_affinity_ttl.is_some();
                m.router_id = Some(router_id);
                m.auth_key = self.replica_key;
                Some(m)
            }
            _ => None,
        };
        let core = SelectionCore::try_new_local(config, self.policy_factory)?;
        if let Some(m) = mesh_config {
            let sink = Arc::new(crate::core::replica::CoreSink(Arc::downgrade(&core)));
            let mesh = replica_sync::ReplicaMesh::start(m, sink)
                .map_err(|e| BuildError::Startup(e.to_string()))?;
            core.set_replica_mesh(Arc::new(mesh));
        }
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let expiry_core = Arc::clone(&core);
        let expiry = runtime.spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        let n = expiry_core.expire(Instant::now());
                        if n > 0 {
                            tracing::info!(expired = n, "reclaimed reservations older than the expiry");
                        }
                    }
                    _ = stop_rx.changed() => break,
                }
            }
        });
        Ok(SelectionService {
            core,
            stop: stop_tx,
            tasks: parking_lot::Mutex::new(vec![expiry]),
            waiting: Arc::new(AtomicUsize::new(0)),
        })
    }
}

/// A running selection service. Dropping it without [`Self::shutdown`] stops its tasks too.
#[derive(Debug)]
pub struct SelectionService {
    core: Arc<SelectionCore>,
    stop: watch::Sender<bool>,
    tasks: parking_lot::Mutex<Vec<JoinHandle<()>>>,
    /// Requests waiting on threads of their own (see [`MAX_WAITING_THREADS`]).
    waiting: Arc<AtomicUsize>,
}

impl SelectionService {
    /// The shared core: every operation of the service.
    pub fn core(&self) -> &Arc<SelectionCore> {
        &self.core
    }

    /// [`SelectionCore::select`] for async callers: it runs on the calling task, and only a
    /// request that would wait in the admission queue moves to a thread of its own. The
    /// core's plain methods block while a request waits (up to minutes in a full queue), so
    /// async code calls these instead.
    pub async fn select(&self, req: SelectRequest) -> Result<SelectResponse, SelectionError> {
        self.attempt(
            req,
            SelectionCore::try_select,
            SelectionCore::select_cancellable,
            |_, _| None,
        )
        .await
    }

    /// [`SelectionCore::select_and_reserve`] for async callers, as [`Self::select`] (it can
    /// also wait behind a concurrent first booking of its session).
    pub async fn select_and_reserve(
        &self,
        req: SelectRequest,
    ) -> Result<SelectResponse, SelectionError> {
        self.attempt(
            req,
            SelectionCore::try_select_and_reserve,
            SelectionCore::select_and_reserve_cancellable,
            |core, r| free_unseen(core, r.selection_id.clone()),
        )
        .await
    }

    /// [`SelectionCore::create_reservation`] for async callers, as [`Self::select`].
    pub async fn create_reservation(
        &self,
        req: ReservationRequest,
    ) -> Result<ReservationResponse, SelectionError> {
        self.attempt(
            req,
            SelectionCore::try_create_reservation,
            SelectionCore::create_reservation_cancellable,
            |core, r| free_unseen(core, Some(r.selection_id.clone())),
        )
        .await
    }

    /// Runs `attempt` here; what it hands back runs `wait` on a thread of its own. If this
    /// future is dropped meanwhile (the caller went away), the request leaves the admission
    /// queue, and what `undo` returns for a result nobody received runs (a booking is
    /// freed).
    ///
    /// Not tokio's blocking pool: a waiter holds its thread for up to the queue deadline,
    /// and 512 of them (the pool's cap) stalled everything else that needs the pool (worker
    /// registration, `/dump`, shutdown, which is what releases the waiters) while later
    /// waiters sat in the pool's own queue, outside the admission queue's order and limits.
    /// At most [`MAX_WAITING_THREADS`] wait at once; more are refused with 503.
    async fn attempt<T: Send + 'static, R: Send + 'static>(
        &self,
        req: R,
        attempt: impl FnOnce(&SelectionCore, R) -> Attempt<T, R>,
        wait: fn(&SelectionCore, R, &Cancel) -> Result<T, SelectionError>,
        undo: fn(&Arc<SelectionCore>, &T) -> Option<Undo>,
    ) -> Result<T, SelectionError> {
        match attempt(&self.core, req) {
            Attempt::Done(result) => result,
            Attempt::WouldWait(req) => {
                let Some(slot) = WaitingSlot::take(&self.waiting) else {
                    return Err(SelectionError::scheduler(
                        503,
                        format!(
                            "too many requests are waiting ({MAX_WAITING_THREADS}); retry later"
                        ),
                    ));
                };
                let core = Arc::clone(&self.core);
                let cancel = Arc::new(Cancel::default());
                let guard = CancelOnDrop(Some(Arc::clone(&cancel)));
                let task_cancel = Arc::clone(&cancel);
                let (tx, rx) = tokio::sync::oneshot::channel();
                let spawned = std::thread::Builder::new()
                    .name("kv-select-wait".to_owned())
                    .spawn(move || {
                        let _slot = slot;
                        let result = wait(&core, req, &task_cancel);
                        if let Some(free) = result.as_ref().ok().and_then(|v| undo(&core, v)) {
                            task_cancel.finished(free);
                        }
                        let _ = tx.send(result);
                    });
                if let Err(e) = spawned {
                    guard.disarm();
                    return Err(SelectionError::internal(format!(
                        "cannot start a thread for a waiting request: {e}"
                    )));
                }
                let received = rx.await;
                guard.disarm();
                cancel.delivered();
                received.unwrap_or_else(|_| {
                    Err(SelectionError::internal(
                        "a waiting request's thread ended without an answer",
                    ))
                })
            }
        }
    }

    /// Registers the service's `kv_select_*` series into `registry`
    /// (see [`SelectionCore::register_metrics`]).
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.core.register_metrics(registry);
    }

    /// Stops accepting work, stops listeners and background tasks, and waits for them.
    /// Idempotent.
    pub async fn shutdown(&self) {
        let core = Arc::clone(&self.core);
        // Stopping listeners waits for their groups' threads: keep that off the async
        // workers, and off the blocking pool, which a host may have filled.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let spawned = std::thread::Builder::new()
            .name("kv-select-shutdown".to_owned())
            .spawn(move || {
                core.shutdown();
                let _ = tx.send(());
            });
        match spawned {
            Ok(_) => {
                let _ = rx.await;
            }
            Err(_) => self.core.shutdown(),
        }
        let _ = self.stop.send(true);
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
        for t in tasks {
            let _ = t.await;
        }
    }
}

/// Requests that may wait in the admission queue (or behind a session's first booking) at
/// once, each on a thread of its own.
pub const MAX_WAITING_THREADS: usize = 4096;

/// One of the [`MAX_WAITING_THREADS`] places, given back when dropped.
struct WaitingSlot(Arc<AtomicUsize>);

impl WaitingSlot {
    fn take(count: &Arc<AtomicUsize>) -> Option<Self> {
        count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_WAITING_THREADS).then_some(n + 1)
            })
            .ok()
            .map(|_| WaitingSlot(Arc::clone(count)))
    }
}

impl Drop for WaitingSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Cancels a waiting operation when the future awaiting it is dropped before it finished.
struct CancelOnDrop(Option<Arc<Cancel>>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(cancel) = self.0.take() {
            cancel.cancel();
        }
    }
}

/// Frees the booking `selection_id` names; for a result nobody received.
fn free_unseen(core: &Arc<SelectionCore>, selection_id: Option<String>) -> Option<Undo> {
    let id = selection_id?;
    let core = Arc::clone(core);
    Some(Box::new(move || {
        if core.free_reservation(&id).is_ok() {
            tracing::debug!(selection_id = %id.escape_debug(), "freed a booking its caller did not wait for");
        }
    }))
}

impl Drop for SelectionService {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_slots_are_capped_and_given_back() {
        let count = Arc::new(AtomicUsize::new(0));
        let slots: Vec<WaitingSlot> = (0..MAX_WAITING_THREADS)
            .map(|_| WaitingSlot::take(&count).expect("below the cap"))
            .collect();
        assert!(WaitingSlot::take(&count).is_none(), "the cap holds");
        drop(slots.into_iter().next());
        assert!(
            WaitingSlot::take(&count).is_some(),
            "a slot given back is reusable"
        );
    }
}
