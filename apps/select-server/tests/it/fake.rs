//! A recording fake backend and request helpers.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use select_server::dto::*;
use select_server::{ApiError, ApiResult, Backend, EdgeOptions, QueueLimitKind, router};
use tower::ServiceExt;

/// Transcript step 10.
pub(crate) const SELECT_10: &str = r#"{"model_name":"default","routing_group":"default","worker_id":4,"dp_rank":1,"endpoint":"http://127.0.0.1:18004","block_size":16,"overlap":{"longest_matched":0,"gpu":0,"dp":{"0":0,"1":0},"cpu":0,"disk":0},"effective_prefill_tokens":64,"potential_decode_blocks":4}"#;

/// Transcript step 19.
pub(crate) const SELECT_AND_RESERVE_19: &str = r#"{"selection_id":"res-1","sequence_hashes":[-3136036677815684470,-4677586368451018952,-6566916317599637088,3888788807566526800,-4512470630039072904,1640577095020996090,-2262763814742251701,-7635597435236928966,-7606495857650227837,-3257353688242210898,-6993314349847459801,-4280837321439328085,3942083316725386419,-459278420858620479,1652450701772669203,1854667030271987280],"isl_tokens":256,"track_prefill_tokens":true,"model_name":"default","routing_group":"default","worker_id":1,"dp_rank":0,"endpoint":"http://127.0.0.1:18001","block_size":16,"overlap":{"longest_matched":0,"gpu":0,"dp":{"0":0},"cpu":0,"disk":0},"effective_prefill_tokens":256,"potential_decode_blocks":16}"#;

/// Transcript step 12.
pub(crate) const RESERVATION_12: &str = r#"{"selection_id":"sel-1","model_name":"default","routing_group":"default","worker_id":5,"dp_rank":0,"endpoint":"http://127.0.0.1:18005"}"#;

/// Transcript step 4.
pub(crate) const WORKER_4: &str = r#"{"worker_id":2,"model_name":"default","routing_group":"default","lifecycle":"incomplete","endpoint":"http://127.0.0.1:18002","kv_events_endpoint":null,"replay_endpoint":null,"block_size":16,"data_parallel_start_rank":null,"data_parallel_size":null,"max_num_batched_tokens":null,"total_kv_blocks":null,"stable_routing_id":null,"is_eagle":null,"taints":[],"topology_domains":{},"kv_transfer_domain":null,"kv_transfer_enforcement":null,"kv_transfer_preferred_weight":null,"not_schedulable_reasons":["kv_events endpoint is required for dp_rank 0"]}"#;

/// Transcript step 20.
pub(crate) const LOADS_20: &str = r#"[{"model_name":"default","routing_group":"default","loads":[{"worker_id":4,"dp_rank":0,"potential_prefill_tokens":0,"potential_decode_blocks":0,"active_requests":0},{"worker_id":1,"dp_rank":0,"potential_prefill_tokens":256,"potential_decode_blocks":16,"active_requests":1},{"worker_id":4,"dp_rank":1,"potential_prefill_tokens":0,"potential_decode_blocks":0,"active_requests":0},{"worker_id":5,"dp_rank":0,"potential_prefill_tokens":64,"potential_decode_blocks":4,"active_requests":1}],"pending_count":0,"pending_isl_tokens":0}]"#;

/// Transcript step 33.
pub(crate) const POTENTIAL_33: &str = r#"[{"worker_id":4,"dp_rank":0,"potential_prefill_tokens":64,"potential_decode_blocks":4,"active_requests":0},{"worker_id":1,"dp_rank":0,"potential_prefill_tokens":128,"potential_decode_blocks":4,"active_requests":1},{"worker_id":4,"dp_rank":1,"potential_prefill_tokens":64,"potential_decode_blocks":4,"active_requests":0},{"worker_id":5,"dp_rank":0,"potential_prefill_tokens":192,"potential_decode_blocks":8,"active_requests":2}]"#;

/// Transcript step 34.
pub(crate) const OVERLAP_34: &str = r#"{"block_size":16,"num_blocks":4,"workers":[{"worker_id":1,"dp_rank":0,"device_blocks":0,"host_pinned_blocks":0,"disk_blocks":0,"host_pinned_extension_blocks":0,"disk_extension_blocks":0,"shared_beyond_device_blocks":null},{"worker_id":4,"dp_rank":0,"device_blocks":0,"host_pinned_blocks":0,"disk_blocks":0,"host_pinned_extension_blocks":0,"disk_extension_blocks":0,"shared_beyond_device_blocks":null},{"worker_id":4,"dp_rank":1,"device_blocks":0,"host_pinned_blocks":0,"disk_blocks":0,"host_pinned_extension_blocks":0,"disk_extension_blocks":0,"shared_beyond_device_blocks":null},{"worker_id":5,"dp_rank":0,"device_blocks":0,"host_pinned_blocks":0,"disk_blocks":0,"host_pinned_extension_blocks":0,"disk_extension_blocks":0,"shared_beyond_device_blocks":null}],"shared_cache":{"enabled":false,"total_hit_blocks":0,"ranges":[],"error":null}}"#;

/// Transcript step 35.
pub(crate) const DUMP_35: &str = r#"{"default:default":{"block_size":16,"events":[]}}"#;

/// What the fake saw, in order.
#[derive(Debug, Clone)]
#[expect(
    dead_code,
    reason = "some payloads are only read through Debug on failure"
)]
pub(crate) enum Call {
    Upsert(WorkerRequest),
    List(WorkerQuery),
    Patch(u64, WorkerPatch),
    Delete(u64),
    Select(SelectRequest),
    SelectAndReserve(SelectAndReserveRequest),
    Reserve(ReservationRequest),
    Prefill(String),
    Output(String, OutputBlockRequest),
    Free(String),
    Loads(LoadsQuery),
    Potential(PromptQueryRequest),
    Overlap(PromptQueryRequest),
    Register(PeerRequest),
    Deregister(PeerRequest),
}

#[derive(Debug, Default)]
pub(crate) struct Fake {
    pub(crate) calls: Mutex<Vec<Call>>,
    pub(crate) ready: Mutex<bool>,
    pub(crate) peers: Mutex<Vec<String>>,
}

impl Fake {
    fn record(&self, c: Call) {
        self.calls.lock().push(c);
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }
}

fn parse<T: serde::de::DeserializeOwned>(s: &str) -> T {
    serde_json::from_str(s).expect("golden JSON parses into the DTO")
}

impl Backend for Fake {
    async fn upsert_worker(&self, req: WorkerRequest) -> ApiResult<WorkerRecord> {
        self.record(Call::Upsert(req.clone()));
        if req.data_parallel_size.is_some_and(|n| n > 4096) {
            return Err(ApiError::bad_request(format!(
                "data_parallel_size {} exceeds the maximum 4096",
                req.data_parallel_size.unwrap_or_default()
            )));
        }
        Ok(WorkerRecord::from_request(
            req,
            Lifecycle::Schedulable,
            Vec::new(),
        ))
    }

    async fn list_workers(&self, query: WorkerQuery) -> ApiResult<Vec<WorkerRecord>> {
        self.record(Call::List(query));
        Ok(vec![parse(WORKER_4)])
    }

    async fn patch_worker(&self, worker_id: u64, patch: WorkerPatch) -> ApiResult<WorkerRecord> {
        self.record(Call::Patch(worker_id, patch));
        Err(ApiError::not_found(format!("worker {worker_id} not found")))
    }

    async fn delete_worker(&self, worker_id: u64) -> ApiResult<WorkerRecord> {
        self.record(Call::Delete(worker_id));
        let mut r: WorkerRecord = parse(WORKER_4);
        r.lifecycle = Lifecycle::Unschedulable;
        r.not_schedulable_reasons.clear();
        Ok(r)
    }

    async fn select(&self, req: SelectRequest) -> ApiResult<SelectionResponse> {
        self.record(Call::Select(req.clone()));
        if req.options.model_name == "nope" {
            return Err(ApiError::unavailable(
                "no schedulable workers for model=nope routing_group=default",
            ));
        }
        if req.options.selection_id.as_deref() == Some("queue") {
            return Err(ApiError::queue_rejected(
                "batch",
                QueueLimitKind::RawIslTokens,
                100,
                64,
            ));
        }
        // The edge leaves prompt rules to the backend; a real one applies them like this.
        req.prompt.selection_form()?;
        Ok(parse(SELECT_10))
    }

    async fn select_and_reserve(
        &self,
        req: SelectAndReserveRequest,
    ) -> ApiResult<SelectionResponse> {
        self.record(Call::SelectAndReserve(req));
        Ok(parse(SELECT_AND_RESERVE_19))
    }

    async fn create_reservation(&self, req: ReservationRequest) -> ApiResult<ReservationResponse> {
        self.record(Call::Reserve(req));
        Ok(parse(RESERVATION_12))
    }

    async fn prefill_complete(&self, selection_id: String) -> ApiResult<()> {
        self.record(Call::Prefill(selection_id.clone()));
        if selection_id == "nope" {
            return Err(ApiError::not_found(format!(
                "reservation {selection_id} not found"
            )));
        }
        Ok(())
    }

    async fn output_block(&self, selection_id: String, req: OutputBlockRequest) -> ApiResult<()> {
        self.record(Call::Output(selection_id, req));
        Ok(())
    }

    async fn free_reservation(&self, selection_id: String) -> ApiResult<()> {
        self.record(Call::Free(selection_id));
        Ok(())
    }

    async fn ready(&self) -> ReadyResponse {
        ReadyResponse {
            ready: *self.ready.lock(),
            schedulable_workers: 0,
            workers: Vec::new(),
        }
    }

    async fn loads(&self, query: LoadsQuery) -> ApiResult<Vec<PartitionLoads>> {
        self.record(Call::Loads(query));
        Ok(parse(LOADS_20))
    }

    async fn potential_loads(&self, req: PromptQueryRequest) -> ApiResult<Vec<RankLoad>> {
        self.record(Call::Potential(req));
        Ok(parse(POTENTIAL_33))
    }

    async fn overlap_scores(&self, req: PromptQueryRequest) -> ApiResult<OverlapScoresResponse> {
        self.record(Call::Overlap(req));
        Ok(parse(OVERLAP_34))
    }

    async fn dump(&self) -> ApiResult<RawJson> {
        Ok(RawJson(Bytes::from_static(DUMP_35.as_bytes())))
    }

    async fn register_peer(&self, req: PeerRequest) -> ApiResult<PeerRegistration> {
        self.record(Call::Register(req.clone()));
        if !req.endpoint.contains("://") {
            return Err(ApiError::bad_request(format!(
                "invalid ZMQ endpoint `{}`: missing scheme",
                req.endpoint
            )));
        }
        let mut peers = self.peers.lock();
        if peers.contains(&req.endpoint) {
            return Ok(PeerRegistration::AlreadyRegistered);
        }
        peers.push(req.endpoint);
        peers.sort();
        Ok(PeerRegistration::Created)
    }

    async fn deregister_peer(&self, req: PeerRequest) -> ApiResult<()> {
        self.record(Call::Deregister(req.clone()));
        let mut peers = self.peers.lock();
        let before = peers.len();
        peers.retain(|p| *p != req.endpoint);
        if peers.len() == before {
            return Err(ApiError::not_found("peer not found"));
        }
        Ok(())
    }

    async fn replica_peers(&self) -> ApiResult<Vec<String>> {
        Ok(self.peers.lock().clone())
    }

    fn metrics_text(&self) -> String {
        "# TYPE kv_select_up gauge\nkv_select_up 1\n".to_owned()
    }
}

/// A test harness: one fake, one set of edge options.
pub(crate) struct Harness {
    pub(crate) fake: Arc<Fake>,
    pub(crate) options: EdgeOptions,
}

/// A response as status, content type, `Allow` header and body text.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) content_type: String,
    pub(crate) allow: Option<String>,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).expect("response body is JSON")
    }

    pub(crate) fn error(&self) -> String {
        assert!(
            self.content_type.starts_with("application/json"),
            "{}",
            self.content_type
        );
        self.json()["error"]
            .as_str()
            .expect("error envelope")
            .to_owned()
    }
}

impl Harness {
    pub(crate) fn new() -> Self {
        Self::with_options(EdgeOptions::default())
    }

    pub(crate) fn with_options(options: EdgeOptions) -> Self {
        Self {
            fake: Arc::new(Fake::default()),
            options,
        }
    }

    pub(crate) async fn send(&self, req: Request<Full<Bytes>>) -> Reply {
        let routes = router(Arc::clone(&self.fake), self.options.clone());
        let resp = routes.oneshot(req).await.expect("infallible");
        let status = resp.status();
        let header = |name| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let content_type = header(http::header::CONTENT_TYPE).unwrap_or_default();
        let allow = header(http::header::ALLOW);
        let bytes = resp
            .into_body()
            .collect()
            .await
            .expect("full body")
            .to_bytes();
        Reply {
            status,
            content_type,
            allow,
            body: String::from_utf8(bytes.to_vec()).expect("UTF-8 body"),
        }
    }

    /// A request with a JSON content type.
    pub(crate) async fn json(&self, method: Method, uri: &str, body: impl Into<Bytes>) -> Reply {
        self.send(
            Request::builder()
                .method(method)
                .uri(uri)
                .header("content-type", "application/json")
                .body(Full::new(body.into()))
                .expect("request"),
        )
        .await
    }

    /// A request without body or content type.
    pub(crate) async fn bare(&self, method: Method, uri: &str) -> Reply {
        self.send(
            Request::builder()
                .method(method)
                .uri(uri)
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
    }
}
