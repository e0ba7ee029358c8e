//! `SelectionServiceBuilder` -> `SelectionService`: the core plus the background tasks a
//! running service needs (periodic expiry), with an explicit, idempotent shutdown.

use std::sync::Arc;
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
            expiry_period: None,
            replica: None,
            replica_key: None,
        }
    }

    /// Uses this factory for every partition instead of the built-in policy.
    pub fn worker_selection_policy_factory(mut self, factory: PolicyFactory) -> Self {
        self.policy_factory = Some(factory);
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
            let sink = Arc::new(crate::replica::CoreSink(Arc::downgrade(&core)));
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
        })
    }
}

/// A running selection service. Dropping it without [`Self::shutdown`] stops its tasks too.
#[derive(Debug)]
pub struct SelectionService {
    core: Arc<SelectionCore>,
    stop: watch::Sender<bool>,
    tasks: parking_lot::Mutex<Vec<JoinHandle<()>>>,
}

impl SelectionService {
    /// The shared core: every operation of the service.
    pub fn core(&self) -> &Arc<SelectionCore> {
        &self.core
    }

    /// [`SelectionCore::select`] for async callers: it runs on the calling task, and only a
    /// request that would wait in the admission queue moves to tokio's blocking pool. The
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

    /// Runs `attempt` here; what it hands back runs `wait` on the blocking pool. If this
    /// future is dropped meanwhile (the caller went away), the request leaves the admission
    /// queue, and what `undo` returns for a result nobody received runs (a booking is
    /// freed).
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
                let core = Arc::clone(&self.core);
                let cancel = Arc::new(Cancel::default());
                let guard = CancelOnDrop(Some(Arc::clone(&cancel)));
                let task_cancel = Arc::clone(&cancel);
                let joined = tokio::task::spawn_blocking(move || {
                    let result = wait(&core, req, &task_cancel);
                    if let Some(free) = result.as_ref().ok().and_then(|v| undo(&core, v)) {
                        task_cancel.finished(free);
                    }
                    result
                })
                .await;
                guard.disarm();
                cancel.delivered();
                joined.unwrap_or_else(|e| {
                    Err(SelectionError::internal(format!(
                        "selection task failed: {e}"
                    )))
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
        // Stopping listeners waits for their groups' threads: keep that off the async workers.
        let _ = tokio::task::spawn_blocking(move || core.shutdown()).await;
        let _ = self.stop.send(true);
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
        for t in tasks {
            let _ = t.await;
        }
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
            tracing::debug!(selection_id = %id, "freed a booking its caller did not wait for");
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
