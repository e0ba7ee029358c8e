//! [`Backend`] over the in-process [`SelectionService`]: worker bodies into service types,
//! the service's answers into DTOs, and the error mapping (selection, reservation and
//! prompt-query requests arrive in the service's types already). Operations that may block (catalog changes join listener
//! threads) run on tokio's blocking pool so the async workers never stall. Selections and
//! bookings go through the service's async methods, which run them inline and give only
//! those that would wait (admission queue, a session being initialized) a thread of their
//! own, outside tokio's blocking pool, so waiters cannot fill it and stall the catalog
//! work above.

use std::sync::Arc;

use http::StatusCode;
use prometheus_client::registry::Registry;
use service_builder::{
    Lifecycle as SvcLifecycle, PromptQuery, ReservationRequest, SelectRequest, SelectionCore,
    SelectionError, SelectionService, WorkerCatalogRecord,
};

use crate::backend::{ApiError, ApiResult, Backend};
use crate::dto::{
    self, LoadsQuery, OutputBlockRequest, OverlapScoresResponse, PartitionLoads, PeerRegistration,
    PeerRequest, RankLoad, RankOverlapScores, RawJson, ReadyResponse, ReservationResponse,
    SelectionResponse, SharedCacheScores, WorkerPatch, WorkerQuery, WorkerRecord, WorkerRequest,
};

/// The HTTP edge's view of a running [`SelectionService`].
#[derive(Debug)]
pub struct ServiceBackend {
    service: Arc<SelectionService>,
    /// Every `/metrics` series: the service's counters and its scrape-time collector.
    registry: Registry,
}

impl ServiceBackend {
    pub fn new(service: Arc<SelectionService>) -> Self {
        let mut registry = Registry::default();
        service.register_metrics(&mut registry);
        Self { service, registry }
    }

    /// Adds series of another component of the process (the endpoint picker's) to
    /// `/metrics`, before the backend is shared.
    pub fn register_metrics(&mut self, register: impl FnOnce(&mut Registry)) {
        register(&mut self.registry);
    }

    pub fn service(&self) -> &Arc<SelectionService> {
        &self.service
    }

    fn core(&self) -> Arc<SelectionCore> {
        Arc::clone(self.service.core())
    }

    /// Runs a core operation on the blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&SelectionCore) -> Result<T, SelectionError> + Send + 'static,
    ) -> ApiResult<T> {
        let core = self.core();
        match tokio::task::spawn_blocking(move || f(&core)).await {
            Ok(r) => r.map_err(api_error),
            Err(e) => Err(ApiError::internal(format!("service task failed: {e}"))),
        }
    }
}

fn api_error(e: SelectionError) -> ApiError {
    let status = StatusCode::from_u16(e.status_code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut err = ApiError::new(status, e.message());
    if let Some(d) = e.details() {
        err = err.with_details(serde_json::json!({
            "policy_class": d.policy_class,
            "limit_kind": d.limit_kind,
            "current": d.current,
            "limit": d.limit,
        }));
    }
    err
}

fn peer_error(e: &replica_sync::PeerError) -> ApiError {
    use replica_sync::PeerError as P;
    let status = match e {
        P::NotFound { .. } => StatusCode::NOT_FOUND,
        P::Disabled => StatusCode::CONFLICT,
        P::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    };
    ApiError::new(status, e.to_string())
}

pub(crate) fn worker_request(r: WorkerRequest) -> service_builder::WorkerRequest {
    service_builder::WorkerRequest {
        worker_id: r.worker_id,
        model_name: r.model_name,
        routing_group: r.routing_group,
        endpoint: r.endpoint,
        kv_events_endpoint: r.kv_events_endpoint,
        kv_events_endpoints: r.kv_events_endpoints,
        replay_endpoint: r.replay_endpoint,
        block_size: r.block_size,
        data_parallel_start_rank: r.data_parallel_start_rank,
        data_parallel_size: r.data_parallel_size,
        max_num_batched_tokens: r.max_num_batched_tokens,
        total_kv_blocks: r.total_kv_blocks,
        stable_routing_id: r.stable_routing_id,
        is_eagle: r.is_eagle,
        taints: r.taints.into_iter().collect(),
        topology_domains: r.topology_domains,
        kv_transfer_domain: r.kv_transfer_domain,
        kv_transfer_enforcement: r.kv_transfer_enforcement.map(enforcement_str),
        kv_transfer_preferred_weight: r.kv_transfer_preferred_weight,
        router_hint_worker_type: r.router_hint_worker_type,
        router_hint_source_control_endpoints: r.router_hint_source_control_endpoints,
        kv_event_source_mode: r.kv_event_source_mode,
    }
}

fn enforcement_str(e: dto::KvTransferEnforcement) -> String {
    match e {
        dto::KvTransferEnforcement::Required => "required".into(),
        dto::KvTransferEnforcement::Preferred => "preferred".into(),
    }
}

fn enforcement_dto(s: &str) -> Option<dto::KvTransferEnforcement> {
    match s {
        "required" => Some(dto::KvTransferEnforcement::Required),
        "preferred" => Some(dto::KvTransferEnforcement::Preferred),
        _ => None,
    }
}

fn worker_patch(p: WorkerPatch) -> service_builder::WorkerPatch {
    service_builder::WorkerPatch {
        endpoint: p.endpoint,
        kv_events_endpoint: p.kv_events_endpoint,
        kv_events_endpoints: p.kv_events_endpoints,
        replay_endpoint: p.replay_endpoint,
        block_size: p.block_size,
        data_parallel_start_rank: p.data_parallel_start_rank,
        data_parallel_size: p.data_parallel_size,
        max_num_batched_tokens: p.max_num_batched_tokens,
        total_kv_blocks: p.total_kv_blocks,
        stable_routing_id: p.stable_routing_id,
        is_eagle: p.is_eagle,
        taints: p.taints.map(|t| t.into_iter().collect()),
        topology_domains: p.topology_domains,
        kv_transfer_domain: p.kv_transfer_domain,
        kv_transfer_enforcement: p.kv_transfer_enforcement.map(enforcement_str),
        kv_transfer_preferred_weight: p.kv_transfer_preferred_weight,
        router_hint_worker_type: p.router_hint_worker_type,
        router_hint_source_control_endpoints: p.router_hint_source_control_endpoints,
        kv_event_source_mode: p.kv_event_source_mode,
    }
}

pub(crate) fn worker_record(r: WorkerCatalogRecord) -> WorkerRecord {
    let w = r.worker;
    WorkerRecord {
        worker_id: w.worker_id,
        model_name: w.model_name,
        routing_group: w.routing_group,
        lifecycle: match r.lifecycle {
            SvcLifecycle::Schedulable => dto::Lifecycle::Schedulable,
            SvcLifecycle::Incomplete => dto::Lifecycle::Incomplete,
            SvcLifecycle::Draining => dto::Lifecycle::Draining,
            SvcLifecycle::Unschedulable => dto::Lifecycle::Unschedulable,
        },
        endpoint: w.endpoint,
        kv_events_endpoint: w.kv_events_endpoint,
        kv_events_endpoints: w.kv_events_endpoints,
        replay_endpoint: w.replay_endpoint,
        block_size: w.block_size,
        data_parallel_start_rank: w.data_parallel_start_rank,
        data_parallel_size: w.data_parallel_size,
        max_num_batched_tokens: w.max_num_batched_tokens,
        total_kv_blocks: w.total_kv_blocks,
        stable_routing_id: w.stable_routing_id,
        is_eagle: w.is_eagle,
        taints: w.taints.into_iter().collect(),
        topology_domains: w.topology_domains,
        kv_transfer_domain: w.kv_transfer_domain,
        kv_transfer_enforcement: w
            .kv_transfer_enforcement
            .as_deref()
            .and_then(enforcement_dto),
        kv_transfer_preferred_weight: w.kv_transfer_preferred_weight,
        router_hint_worker_type: w.router_hint_worker_type,
        router_hint_source_control_endpoints: w.router_hint_source_control_endpoints,
        kv_event_source_mode: w.kv_event_source_mode,
        not_schedulable_reasons: r.not_schedulable_reasons,
        warnings: r.warnings,
    }
}

fn selection_response(r: service_builder::SelectResponse) -> SelectionResponse {
    SelectionResponse {
        selection_id: r.selection_id,
        sequence_hashes: r
            .sequence_hashes
            .map(|v| v.into_iter().map(|h| h.0).collect()),
        isl_tokens: r.isl_tokens,
        track_prefill_tokens: r.track_prefill_tokens,
        model_name: r.model_name,
        routing_group: r.routing_group,
        worker_id: r.worker_id,
        dp_rank: r.dp_rank,
        endpoint: r.endpoint,
        block_size: r.block_size,
        overlap: dto::Overlap {
            longest_matched: r.overlap.longest_matched,
            gpu: r.overlap.gpu,
            dp: r.overlap.dp,
            cpu: r.overlap.cpu,
            disk: r.overlap.disk,
        },
        effective_prefill_tokens: r.effective_prefill_tokens,
        potential_decode_blocks: r.potential_decode_blocks,
        decode_busy: r.decode_busy,
        worker_load: r.worker_load.map(|l| dto::WorkerLoad {
            active_prefill_tokens: l.active_prefill_tokens,
            prefill_token_capacity: l.prefill_token_capacity,
            total_kv_blocks: l.total_kv_blocks,
            prefill_busy: l.prefill_busy,
        }),
        kv_hint: r.kv_hint.map(|h| dto::KvHint {
            protocol_version: "0.1".into(),
            message_id: h.message_id,
            actions: vec![dto::KvHintAction {
                action_id: "a1".into(),
                action_type: "kv.fetch".into(),
                action_version: "1.0".into(),
                payload: dto::KvFetchPayload {
                    source_control_endpoint: h.source_control_endpoint,
                    block_hashes: h.block_hashes,
                },
            }],
        }),
    }
}

fn rank_load(l: service_builder::LoadRow) -> RankLoad {
    RankLoad {
        worker_id: l.worker_id,
        dp_rank: l.dp_rank,
        potential_prefill_tokens: l.potential_prefill_tokens,
        potential_decode_blocks: l.potential_decode_blocks,
        active_requests: l.active_requests,
    }
}

impl Backend for ServiceBackend {
    async fn upsert_worker(&self, req: WorkerRequest) -> ApiResult<WorkerRecord> {
        let r = worker_request(req);
        self.blocking(move |c| c.upsert_worker(r))
            .await
            .map(worker_record)
    }

    async fn list_workers(&self, query: WorkerQuery) -> ApiResult<Vec<WorkerRecord>> {
        let records = self
            .core()
            .list_workers(query.model_name.as_deref(), query.routing_group.as_deref());
        Ok(records.into_iter().map(worker_record).collect())
    }

    async fn patch_worker(&self, worker_id: u64, patch: WorkerPatch) -> ApiResult<WorkerRecord> {
        let p = worker_patch(patch);
        self.blocking(move |c| c.patch_worker(worker_id, p))
            .await
            .map(worker_record)
    }

    async fn delete_worker(&self, worker_id: u64) -> ApiResult<WorkerRecord> {
        self.blocking(move |c| c.delete_worker(worker_id))
            .await
            .map(worker_record)
    }

    async fn select(&self, req: SelectRequest) -> ApiResult<SelectionResponse> {
        self.service
            .select(req)
            .await
            .map(selection_response)
            .map_err(api_error)
    }

    async fn select_and_reserve(&self, req: SelectRequest) -> ApiResult<SelectionResponse> {
        self.service
            .select_and_reserve(req)
            .await
            .map(selection_response)
            .map_err(api_error)
    }

    async fn create_reservation(&self, req: ReservationRequest) -> ApiResult<ReservationResponse> {
        let out = self
            .service
            .create_reservation(req)
            .await
            .map_err(api_error)?;
        Ok(ReservationResponse {
            selection_id: out.selection_id,
            model_name: out.model_name,
            routing_group: out.routing_group,
            worker_id: out.worker_id,
            dp_rank: out.dp_rank,
            endpoint: out.endpoint,
        })
    }

    async fn prefill_complete(&self, selection_id: String) -> ApiResult<()> {
        self.core()
            .prefill_complete(&selection_id)
            .map_err(api_error)
    }

    async fn output_block(&self, selection_id: String, req: OutputBlockRequest) -> ApiResult<()> {
        self.core()
            .add_output_block(&selection_id, req.decay_fraction)
            .map_err(api_error)
    }

    async fn free_reservation(&self, selection_id: String) -> ApiResult<()> {
        self.core()
            .free_reservation(&selection_id)
            .map_err(api_error)
    }

    async fn ready(&self) -> ReadyResponse {
        let r = self.core().ready();
        ReadyResponse {
            ready: r.ready,
            schedulable_workers: r.schedulable_workers as u64,
            workers: r.workers.into_iter().map(worker_record).collect(),
        }
    }

    async fn loads(&self, query: LoadsQuery) -> ApiResult<Vec<PartitionLoads>> {
        let loads = self
            .core()
            .loads(query.model_name.as_deref(), query.routing_group.as_deref());
        Ok(loads
            .into_iter()
            .map(|p| PartitionLoads {
                model_name: p.model_name,
                routing_group: p.routing_group,
                loads: p.loads.into_iter().map(rank_load).collect(),
                pending_count: p.pending_count,
                pending_isl_tokens: p.pending_isl_tokens,
            })
            .collect())
    }

    async fn potential_loads(&self, req: PromptQuery) -> ApiResult<Vec<RankLoad>> {
        let rows = self.core().potential_loads(&req).map_err(api_error)?;
        Ok(rows.into_iter().map(rank_load).collect())
    }

    async fn overlap_scores(&self, req: PromptQuery) -> ApiResult<OverlapScoresResponse> {
        let r = self.core().overlap_scores(&req).map_err(api_error)?;
        Ok(OverlapScoresResponse {
            block_size: r.block_size,
            num_blocks: r.num_blocks as u64,
            workers: r
                .workers
                .into_iter()
                .map(|w| RankOverlapScores {
                    worker_id: w.worker_id,
                    dp_rank: w.dp_rank,
                    device_blocks: u64::from(w.device_blocks),
                    host_pinned_blocks: u64::from(w.host_pinned_blocks),
                    disk_blocks: u64::from(w.disk_blocks),
                    host_pinned_extension_blocks: u64::from(w.host_pinned_extension_blocks),
                    disk_extension_blocks: u64::from(w.disk_extension_blocks),
                    shared_beyond_device_blocks: None,
                })
                .collect(),
            shared_cache: SharedCacheScores::disabled(),
        })
    }

    async fn dump(&self) -> ApiResult<RawJson> {
        self.blocking(|c| c.dump_json())
            .await
            .map(|b| RawJson(b.into()))
    }

    async fn register_peer(&self, req: PeerRequest) -> ApiResult<PeerRegistration> {
        let core = self.core();
        // The mesh answers within one poll slice of its receiver thread.
        let r = tokio::task::spawn_blocking(move || core.register_replica_peer(&req.endpoint))
            .await
            .map_err(|e| ApiError::internal(format!("service task failed: {e}")))?;
        match r {
            Ok(true) => Ok(PeerRegistration::Created),
            Ok(false) => Ok(PeerRegistration::AlreadyRegistered),
            Err(e) => Err(peer_error(&e)),
        }
    }

    async fn deregister_peer(&self, req: PeerRequest) -> ApiResult<()> {
        let core = self.core();
        let r = tokio::task::spawn_blocking(move || core.deregister_replica_peer(&req.endpoint))
            .await
            .map_err(|e| ApiError::internal(format!("service task failed: {e}")))?;
        r.map_err(|e| peer_error(&e))
    }

    async fn replica_peers(&self) -> ApiResult<Vec<String>> {
        Ok(self.core().replica_peers())
    }

    fn metrics_text(&self) -> String {
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail; a collector error would only cut the text short.
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::warn!(error = %e, "encoding /metrics failed");
        }
        out
    }
}

/// Builds and starts the service from the parsed configuration (startup validation
/// included: tracking key, router settings, cache bounds).
pub fn build_service(cfg: &crate::config::ServerConfig) -> anyhow::Result<ServiceBackend> {
    use anyhow::Context as _;
    let tracking = cfg.tracking.hasher()?;
    let tracking_algorithm = tracking.algorithm();
    let router = selection_policy::RouterConfig {
        router_tracking_hash: tracking.algorithm(),
        router_tracking_key_file: cfg.tracking.key_file.clone(),
        router_tracking_key_id: cfg.tracking.key_id.clone(),
        ..cfg.router.clone()
    };
    let core = service_builder::CoreConfig {
        router,
        selection_cache: service_builder::SelectionCacheConfig {
            ttl: cfg.selection_cache_ttl,
            max_entries: cfg.selection_cache_max_entries,
            max_bytes: usize::try_from(cfg.selection_cache_max_bytes).unwrap_or(usize::MAX),
        },
        tracking,
        active_request_expiry: cfg.active_request_expiry,
        max_active_reservations: cfg
            .max_active_reservations
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        session_affinity_ttl: cfg.session_affinity_ttl,
        max_prompt_tokens: usize::try_from(cfg.max_prompt_tokens).unwrap_or(usize::MAX),
        policy_classes: cfg.policy_classes.clone(),
        overlap_refresh_after: cfg.overlap_refresh_after,
        replay_timeout: cfg.kv_replay_timeout,
        kv_listener_threads: cfg.kv_listener_threads,
        kv_writer_step_aside: cfg.kv_writer_step_aside,
        kv_ingest_nice: cfg.kv_ingest_nice,
        kv_index_copies: cfg.kv_index_copies,
        kv_index_writer: cfg.kv_index_writer,
        kv_receive_hwm: cfg.kv_receive_hwm,
        ..service_builder::CoreConfig::default()
    };
    let mut builder = service_builder::SelectionServiceBuilder::new(core);
    if let Some((_, instance, policy)) = &cfg.worker_selection {
        // The chosen instance's weights over the process configuration; tracking settings
        // stay those of the process. The kind's parameters were validated with the file.
        let instance = selection_policy::RouterConfig {
            router_tracking_hash: tracking_algorithm,
            ..instance.clone()
        };
        let policy = *policy;
        builder = builder.worker_selection_policy_factory(Arc::new(move |_, _| {
            policy.build(&instance, selection_policy::PoolLabel::default())
        }));
    }
    if cfg.replica_sync_port.is_some() || !cfg.replica_sync_peers.is_empty() {
        let host = if cfg.host.is_unspecified() {
            "*".to_owned()
        } else {
            cfg.host.to_string()
        };
        builder = builder.replica_sync(service_builder::ReplicaSyncConfig {
            host,
            port: cfg.replica_sync_port,
            peers: cfg.replica_sync_peers.clone(),
        });
        if let Some(key) = &cfg.replica_sync_key {
            builder = builder.replica_sync_key(key.clone());
        }
    }
    let service = builder
        .build()
        .context("failed to start the selection service")?;
    Ok(ServiceBackend::new(Arc::new(service)))
}
