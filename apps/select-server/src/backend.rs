//! The seam between the HTTP edge and the selection service.
//!
//! The edge owns everything that needs no service state (routing, body rejections, DTO
//! shapes, stateless validation); a [`Backend`] owns everything else. One method per route of
//! `http-api.md` §10, except `/health` (answered by the edge) and `/metrics` (text from
//! [`Backend::metrics_text`]).

use std::future::Future;

use http::StatusCode;
use serde::Serialize;

use service_builder::{PromptQuery, ReservationRequest, SelectRequest};

use crate::dto::{
    LoadsQuery, OutputBlockRequest, OverlapScoresResponse, PartitionLoads, PeerRegistration,
    PeerRequest, RankLoad, RawJson, ReadyResponse, ReservationResponse, SelectionResponse,
    WorkerPatch, WorkerQuery, WorkerRecord, WorkerRequest,
};

/// A failure rendered as the contract's error envelope: `{"error": message}` plus `details`
/// when present (the 429 queue-rejection envelope of `http-api.md` §1.2).
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub details: Option<serde_json::Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            details: None,
        }
    }

    /// 400.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// 409.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    /// 429.
    pub fn too_many_requests(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, message)
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// 503.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// 429 with the queue-rejection `details` object (`http-api.md` §1.2); the message is the
    /// reference's template.
    pub fn queue_rejected(
        policy_class: &str,
        limit_kind: QueueLimitKind,
        current: u64,
        limit: u64,
    ) -> Self {
        let kind = limit_kind.as_str();
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!(
                "router policy class \"{policy_class}\" queue {kind} limit reached \
                 (current={current}, limit={limit})"
            ),
            details: Some(serde_json::json!({
                "policy_class": policy_class,
                "limit_kind": kind,
                "current": current,
                "limit": limit,
            })),
        }
    }

    /// Attaches a `details` object to the envelope.
    #[must_use]
    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.details = Some(details);
        self
    }

    /// The JSON body of this error.
    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: &self.message,
            details: self.details.as_ref(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for ApiError {}

/// Wire shape of [`ApiError`].
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<&'a serde_json::Value>,
}

/// `details.limit_kind` of a queue rejection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueLimitKind {
    Requests,
    RawIslTokens,
    CachedTokens,
}

impl QueueLimitKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            QueueLimitKind::Requests => "requests",
            QueueLimitKind::RawIslTokens => "raw_isl_tokens",
            QueueLimitKind::CachedTokens => "cached_tokens",
        }
    }
}

/// What a backend future must be: sendable so the edge can run on a multi-threaded runtime.
pub type ApiResult<T> = Result<T, ApiError>;

/// The selection service as the HTTP edge sees it.
///
/// Every request has already passed the edge's checks: content type, size, JSON syntax,
/// nesting/array bounds, shape (types, required fields, `router_config_override` ranges and
/// alias), and the `decay_fraction` range. Selection, reservation and prompt-query bodies
/// arrive as the service's own request types. Prompt rules of `http-api.md` §3.3 are left to
/// the service because the contract orders them after readiness (and, for explicit
/// reservations, after discarding the cached selection).
pub trait Backend: Send + Sync + 'static {
    /// `POST /workers` → 201.
    fn upsert_worker(
        &self,
        req: WorkerRequest,
    ) -> impl Future<Output = ApiResult<WorkerRecord>> + Send;

    /// `GET /workers` → 200.
    fn list_workers(
        &self,
        query: WorkerQuery,
    ) -> impl Future<Output = ApiResult<Vec<WorkerRecord>>> + Send;

    /// `PATCH /workers/{worker_id}` → 200.
    fn patch_worker(
        &self,
        worker_id: u64,
        patch: WorkerPatch,
    ) -> impl Future<Output = ApiResult<WorkerRecord>> + Send;

    /// `DELETE /workers/{worker_id}` → 200 (record with `lifecycle: unschedulable`).
    fn delete_worker(&self, worker_id: u64)
    -> impl Future<Output = ApiResult<WorkerRecord>> + Send;

    /// `POST /select` → 200.
    fn select(
        &self,
        req: SelectRequest,
    ) -> impl Future<Output = ApiResult<SelectionResponse>> + Send;

    /// `POST /select_and_reserve` → 200.
    fn select_and_reserve(
        &self,
        req: SelectRequest,
    ) -> impl Future<Output = ApiResult<SelectionResponse>> + Send;

    /// `POST /reservations` (replay form when `worker_id` is `None`) → 201.
    fn create_reservation(
        &self,
        req: ReservationRequest,
    ) -> impl Future<Output = ApiResult<ReservationResponse>> + Send;

    /// `POST /reservations/{selection_id}/prefill_complete` → 200 `{"status":"ok"}`.
    fn prefill_complete(&self, selection_id: String) -> impl Future<Output = ApiResult<()>> + Send;

    /// `POST /reservations/{selection_id}/output_block` → 200 `{"status":"ok"}`.
    /// `decay_fraction` is already known to be within `[0, 1]`.
    fn output_block(
        &self,
        selection_id: String,
        req: OutputBlockRequest,
    ) -> impl Future<Output = ApiResult<()>> + Send;

    /// `DELETE /reservations/{selection_id}` → 200 `{"status":"ok"}`.
    fn free_reservation(&self, selection_id: String) -> impl Future<Output = ApiResult<()>> + Send;

    /// `GET /ready` → 200 when `ready`, else 503, same body.
    fn ready(&self) -> impl Future<Output = ReadyResponse> + Send;

    /// `GET /loads` → 200.
    fn loads(
        &self,
        query: LoadsQuery,
    ) -> impl Future<Output = ApiResult<Vec<PartitionLoads>>> + Send;

    /// `POST /potential_loads` → 200.
    fn potential_loads(
        &self,
        req: PromptQuery,
    ) -> impl Future<Output = ApiResult<Vec<RankLoad>>> + Send;

    /// `POST /overlap_scores` → 200.
    fn overlap_scores(
        &self,
        req: PromptQuery,
    ) -> impl Future<Output = ApiResult<OverlapScoresResponse>> + Send;

    /// `GET /dump` → 200 with the already-serialized recovery snapshot
    /// (`replica-sync.md` §9), so a large index is serialized once, by its owner.
    fn dump(&self) -> impl Future<Output = ApiResult<RawJson>> + Send;

    /// `POST /replica_sync/register_peer` → 201 (new) or 200 (already registered).
    fn register_peer(
        &self,
        req: PeerRequest,
    ) -> impl Future<Output = ApiResult<PeerRegistration>> + Send;

    /// `POST /replica_sync/deregister_peer` → 200.
    fn deregister_peer(&self, req: PeerRequest) -> impl Future<Output = ApiResult<()>> + Send;

    /// `GET /replica_sync/peers` → 200 sorted endpoint list.
    fn replica_peers(&self) -> impl Future<Output = ApiResult<Vec<String>>> + Send;

    /// `GET /metrics` body (Prometheus text exposition format).
    fn metrics_text(&self) -> String;
}
