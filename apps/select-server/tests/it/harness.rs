//! The routes over the real selection service, in process: a [`Recorder`] between the two
//! notes which backend methods a request reached (a rejected body must reach none) and
//! hands every call on to a [`ServiceBackend`] built from a parsed configuration.

use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use select_server::config::ServerConfig;
use select_server::dto::*;
use select_server::{ApiResult, Backend, EdgeOptions, ServiceBackend, build_service, router};
use service_builder::{PromptQuery, ReservationRequest, SelectRequest};
use tower::ServiceExt;

/// What reached the backend, in order.
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
    SelectAndReserve(SelectRequest),
    Reserve(ReservationRequest),
    Prefill(String),
    Output(String, OutputBlockRequest),
    Free(String),
    Ready,
    Loads(LoadsQuery),
    Potential(PromptQuery),
    Overlap(PromptQuery),
    Dump,
    Register(PeerRequest),
    Deregister(PeerRequest),
    Peers,
}

/// The real backend behind a call log.
#[derive(Debug)]
pub(crate) struct Recorder {
    inner: Arc<ServiceBackend>,
    calls: Mutex<Vec<Call>>,
}

impl Recorder {
    fn record(&self, c: Call) {
        self.calls.lock().push(c);
    }

    pub(crate) fn calls(&self) -> Vec<Call> {
        self.calls.lock().clone()
    }
}

impl Backend for Recorder {
    async fn upsert_worker(&self, req: WorkerRequest) -> ApiResult<WorkerRecord> {
        self.record(Call::Upsert(req.clone()));
        self.inner.upsert_worker(req).await
    }

    async fn list_workers(&self, query: WorkerQuery) -> ApiResult<Vec<WorkerRecord>> {
        self.record(Call::List(query.clone()));
        self.inner.list_workers(query).await
    }

    async fn patch_worker(&self, worker_id: u64, patch: WorkerPatch) -> ApiResult<WorkerRecord> {
        self.record(Call::Patch(worker_id, patch.clone()));
        self.inner.patch_worker(worker_id, patch).await
    }

    async fn delete_worker(&self, worker_id: u64) -> ApiResult<WorkerRecord> {
        self.record(Call::Delete(worker_id));
        self.inner.delete_worker(worker_id).await
    }

    async fn select(&self, req: SelectRequest) -> ApiResult<SelectionResponse> {
        self.record(Call::Select(req.clone()));
        self.inner.select(req).await
    }

    async fn select_and_reserve(&self, req: SelectRequest) -> ApiResult<SelectionResponse> {
        self.record(Call::SelectAndReserve(req.clone()));
        self.inner.select_and_reserve(req).await
    }

    async fn create_reservation(&self, req: ReservationRequest) -> ApiResult<ReservationResponse> {
        self.record(Call::Reserve(req.clone()));
        self.inner.create_reservation(req).await
    }

    async fn prefill_complete(&self, selection_id: String) -> ApiResult<()> {
        self.record(Call::Prefill(selection_id.clone()));
        self.inner.prefill_complete(selection_id).await
    }

    async fn output_block(&self, selection_id: String, req: OutputBlockRequest) -> ApiResult<()> {
        self.record(Call::Output(selection_id.clone(), req));
        self.inner.output_block(selection_id, req).await
    }

    async fn free_reservation(&self, selection_id: String) -> ApiResult<()> {
        self.record(Call::Free(selection_id.clone()));
        self.inner.free_reservation(selection_id).await
    }

    async fn ready(&self) -> ReadyResponse {
        self.record(Call::Ready);
        self.inner.ready().await
    }

    async fn loads(&self, query: LoadsQuery) -> ApiResult<Vec<PartitionLoads>> {
        self.record(Call::Loads(query.clone()));
        self.inner.loads(query).await
    }

    async fn potential_loads(&self, req: PromptQuery) -> ApiResult<Vec<RankLoad>> {
        self.record(Call::Potential(req.clone()));
        self.inner.potential_loads(req).await
    }

    async fn overlap_scores(&self, req: PromptQuery) -> ApiResult<OverlapScoresResponse> {
        self.record(Call::Overlap(req.clone()));
        self.inner.overlap_scores(req).await
    }

    async fn dump(&self) -> ApiResult<RawJson> {
        self.record(Call::Dump);
        self.inner.dump().await
    }

    async fn register_peer(&self, req: PeerRequest) -> ApiResult<PeerRegistration> {
        self.record(Call::Register(req.clone()));
        self.inner.register_peer(req).await
    }

    async fn deregister_peer(&self, req: PeerRequest) -> ApiResult<()> {
        self.record(Call::Deregister(req.clone()));
        self.inner.deregister_peer(req).await
    }

    async fn replica_peers(&self) -> ApiResult<Vec<String>> {
        self.record(Call::Peers);
        self.inner.replica_peers().await
    }

    fn metrics_text(&self) -> String {
        self.inner.metrics_text()
    }
}

/// A started service from `select-server` arguments and environment variables.
pub(crate) fn service(args: &[&str], env: &[(&str, &str)]) -> Arc<ServiceBackend> {
    let args = std::iter::once("select-server").chain(args.iter().copied());
    let cfg = ServerConfig::parse_from(args, |name| {
        env.iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| (*v).to_owned())
    })
    .expect("valid configuration");
    Arc::new(build_service(&cfg).expect("service starts"))
}

/// Without KV events a worker with an endpoint and a block size is schedulable at once.
const NO_KV_EVENTS: &[(&str, &str)] = &[("DYN_ROUTER_USE_KV_EVENTS", "false")];

/// A test harness: one real service behind a recorder, one set of edge options.
pub(crate) struct Harness {
    pub(crate) backend: Arc<Recorder>,
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
    /// A service without KV events and without workers.
    pub(crate) fn new() -> Self {
        Self::with_options(EdgeOptions::default())
    }

    pub(crate) fn with_options(options: EdgeOptions) -> Self {
        Self::with_service(service(&[], NO_KV_EVENTS), options)
    }

    pub(crate) fn with_service(inner: Arc<ServiceBackend>, options: EdgeOptions) -> Self {
        Self {
            backend: Arc::new(Recorder {
                inner,
                calls: Mutex::new(Vec::new()),
            }),
            options,
        }
    }

    /// Every backend call so far, setup excluded.
    pub(crate) fn calls(&self) -> Vec<Call> {
        self.backend.calls()
    }

    /// Sends `req` through the routes; the recorder notes what reaches the service.
    pub(crate) async fn send(&self, req: Request<Full<Bytes>>) -> Reply {
        let routes = router(Arc::clone(&self.backend), self.options.clone());
        reply(routes.oneshot(req).await.expect("infallible")).await
    }

    /// A request with a JSON content type.
    pub(crate) async fn json(&self, method: Method, uri: &str, body: impl Into<Bytes>) -> Reply {
        self.send(json_request(method, uri, body)).await
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

    /// A JSON request that prepares state: it goes past the recorder, and must succeed.
    pub(crate) async fn setup(&self, method: Method, uri: &str, body: &str) -> Reply {
        let routes = router(Arc::clone(&self.backend.inner), self.options.clone());
        let r = reply(
            routes
                .oneshot(json_request(method.clone(), uri, body.to_owned()))
                .await
                .expect("infallible"),
        )
        .await;
        assert!(r.status.is_success(), "{method} {uri} {body}: {r:?}");
        r
    }

    /// Registers worker `worker_id` with an endpoint and block size 16 (schedulable when KV
    /// events are off); `extra` members (`"model_name":"m"`) are added to the body.
    pub(crate) async fn worker(&self, worker_id: u64, extra: &str) -> Reply {
        let sep = if extra.is_empty() { "" } else { "," };
        let body = format!(
            r#"{{"worker_id":{worker_id},"endpoint":"http://127.0.0.1:1{worker_id}","block_size":16{sep}{extra}}}"#
        );
        self.setup(Method::POST, "/workers", &body).await
    }

    /// Books `selection_id` on a freshly chosen worker (`/select_and_reserve`).
    pub(crate) async fn reservation(&self, selection_id: &str) -> Reply {
        let body = serde_json::json!({"selection_id": selection_id, "token_ids": [1, 2, 3]});
        self.setup(Method::POST, "/select_and_reserve", &body.to_string())
            .await
    }
}

fn json_request(method: Method, uri: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Full::new(body.into()))
        .expect("request")
}

async fn reply(resp: http::Response<Full<Bytes>>) -> Reply {
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
