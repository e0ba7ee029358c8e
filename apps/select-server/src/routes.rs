//! The route table as a `tower::Service`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Body;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Serialize;

use crate::auth::{Access, AccessTokens};
use crate::backend::{ApiError, Backend};
use crate::body::{BodyLimits, parse_json, read_json_body};
use crate::dto::{
    OutputBlockRequest, PeerRegistration, PeerRequest, StatusOk, WirePromptQuery, WireReservation,
    WireSelection, WorkerPatch, WorkerQuery, WorkerRequest,
};

/// Header naming the router policy class (§1.6).
pub const POLICY_CLASS_HEADER: &str = "x-dynamo-meta-policy-class";

/// Edge settings that are not part of the backend.
#[derive(Clone, Default)]
pub struct EdgeOptions {
    pub limits: BodyLimits,
    /// When enabled, every route except `/health` requires `Authorization: Bearer <token>`
    /// (401 otherwise), and a read-only token only opens the read-only routes
    /// (403 otherwise). Its `Debug` shows token counts only.
    pub auth: AccessTokens,
}

impl std::fmt::Debug for EdgeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeOptions")
            .field("limits", &self.limits)
            .field("auth", &self.auth)
            .finish()
    }
}

/// The HTTP routes over a backend. Cheap to clone (three `Arc`s).
pub struct Routes<B> {
    backend: Arc<B>,
    options: Arc<EdgeOptions>,
    edge: Arc<EdgeMetrics>,
}

impl<B> Clone for Routes<B> {
    fn clone(&self) -> Self {
        Self {
            backend: Arc::clone(&self.backend),
            options: Arc::clone(&self.options),
            edge: Arc::clone(&self.edge),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    status: u16,
}

/// Every response by status code, counted at the edge: requests refused before they reach
/// the service (401, 403, 404, 405, 408, 413, 415, body errors) appear nowhere else.
struct EdgeMetrics {
    registry: Registry,
    responses: Family<StatusLabels, Counter>,
}

impl EdgeMetrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let responses = Family::<StatusLabels, Counter>::default();
        registry.sub_registry_with_prefix("kv_select").register(
            "http_responses",
            "HTTP responses by status code, including requests refused before the service \
             (authentication, routing, body limits)",
            responses.clone(),
        );
        Self {
            registry,
            responses,
        }
    }

    fn count(&self, status: StatusCode) {
        self.responses
            .get_or_create(&StatusLabels {
                status: status.as_u16(),
            })
            .inc();
    }

    /// Appends the edge's series to `text`, the backend's exposition.
    fn encode_into(&self, text: &mut String) {
        if let Err(e) = prometheus_client::encoding::prometheus_text::encode(text, &self.registry) {
            tracing::warn!(error = %e, "encoding the HTTP edge metrics failed");
        }
    }
}

impl<B> std::fmt::Debug for Routes<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Builds the routes of `http-api.md` §10 over `backend`.
pub fn router<B: Backend>(backend: Arc<B>, options: EdgeOptions) -> Routes<B> {
    Routes {
        backend,
        options: Arc::new(options),
        edge: Arc::new(EdgeMetrics::new()),
    }
}

/// Response type of [`Routes`].
pub type HttpResponse = Response<Full<Bytes>>;

impl<B, ReqBody> tower::Service<Request<ReqBody>> for Routes<B>
where
    B: Backend,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = HttpResponse;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<HttpResponse, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            // Copied only when the line is logged: a request otherwise paid an allocation
            // for a path nobody reads.
            let logged = tracing::enabled!(tracing::Level::DEBUG)
                .then(|| (req.method().clone(), req.uri().path().to_owned()));
            let response = match this.handle(req).await {
                Ok(r) => r,
                Err(e) => error_response(&e),
            };
            this.edge.count(response.status());
            if let Some((method, path)) = logged {
                tracing::debug!(%method, %path, status = response.status().as_u16(), "request");
            }
            Ok(response)
        })
    }
}

/// Known paths; parameters are raw (still percent-encoded) segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route<'a> {
    Workers,
    Worker(&'a str),
    Select,
    SelectAndReserve,
    Reservations,
    Reservation(&'a str),
    PrefillComplete(&'a str),
    OutputBlock(&'a str),
    Health,
    Metrics,
    Ready,
    Loads,
    PotentialLoads,
    OverlapScores,
    Dump,
    RegisterPeer,
    DeregisterPeer,
    Peers,
}

fn match_path(path: &str) -> Option<Route<'_>> {
    let rest = path.strip_prefix('/')?;
    let mut segs = rest.split('/');
    let first = segs.next()?;
    let second = segs.next();
    let third = segs.next();
    if segs.next().is_some() {
        return None;
    }
    let param = |s: &str| !s.is_empty();
    Some(match (first, second, third) {
        ("workers", None, None) => Route::Workers,
        ("workers", Some(id), None) if param(id) => Route::Worker(id),
        ("select", None, None) => Route::Select,
        ("select_and_reserve", None, None) => Route::SelectAndReserve,
        ("reservations", None, None) => Route::Reservations,
        ("reservations", Some(id), None) if param(id) => Route::Reservation(id),
        ("reservations", Some(id), Some("prefill_complete")) if param(id) => {
            Route::PrefillComplete(id)
        }
        ("reservations", Some(id), Some("output_block")) if param(id) => Route::OutputBlock(id),
        ("health", None, None) => Route::Health,
        ("metrics", None, None) => Route::Metrics,
        ("ready", None, None) => Route::Ready,
        ("loads", None, None) => Route::Loads,
        ("potential_loads", None, None) => Route::PotentialLoads,
        ("overlap_scores", None, None) => Route::OverlapScores,
        ("dump", None, None) => Route::Dump,
        ("replica_sync", Some("register_peer"), None) => Route::RegisterPeer,
        ("replica_sync", Some("deregister_peer"), None) => Route::DeregisterPeer,
        ("replica_sync", Some("peers"), None) => Route::Peers,
        _ => return None,
    })
}

impl<B: Backend> Routes<B> {
    async fn handle<ReqBody>(&self, req: Request<ReqBody>) -> Result<HttpResponse, ApiError>
    where
        ReqBody: Body + Send + 'static,
        ReqBody::Data: Send,
        ReqBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (parts, body) = req.into_parts();
        let path = parts.uri.path();
        // Authentication precedes routing, so without a token even 404 reveals nothing.
        let access = if path == "/health" {
            None
        } else {
            self.authorize(&parts.headers)?
        };
        let route = match_path(path).ok_or_else(|| ApiError::not_found("route not found"))?;
        // HEAD is served like GET (hyper drops the body).
        let method = if parts.method == Method::HEAD {
            Method::GET
        } else {
            parts.method.clone()
        };
        if access == Some(Access::ReadOnly) && !is_read_only(route, &method) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "this bearer token is read-only; the route needs a full token",
            ));
        }
        let query = parts.uri.query().unwrap_or("");
        let limits = &self.options.limits;
        let be = &*self.backend;
        let headers = &parts.headers;

        macro_rules! json_body {
            ($ty:ty) => {{
                let bytes = read_json_body(headers, body, limits).await?;
                parse_json::<$ty>(&bytes, limits)?
            }};
        }

        // The fast token parser first; the exact one only for unusual or invalid bodies.
        macro_rules! selection_body {
            () => {{
                let bytes = read_json_body(headers, body, limits).await?;
                match WireSelection::parse_fast(&bytes, limits) {
                    Some(wire) => wire,
                    None => parse_json::<WireSelection>(&bytes, limits)?,
                }
            }};
        }

        match (route, method) {
            (Route::Health, Method::GET) => json(StatusCode::OK, &StatusOk::OK),
            (Route::Metrics, Method::GET) => {
                // On the blocking pool: a scrape reads every partition's whole index, which
                // waits for a write section in progress (one copy) or for the writer
                // thread to apply the batches handed to it (a threaded two-copy index).
                let backend = Arc::clone(&self.backend);
                let mut text = tokio::task::spawn_blocking(move || backend.metrics_text())
                    .await
                    .map_err(|e| ApiError::internal(format!("metrics task failed: {e}")))?;
                self.edge.encode_into(&mut text);
                Ok(metrics_response(text))
            }
            (Route::Workers, Method::POST) => {
                let req = json_body!(WorkerRequest);
                json(StatusCode::CREATED, &be.upsert_worker(req).await?)
            }
            (Route::Workers, Method::GET) => {
                let q = worker_query(query);
                json(StatusCode::OK, &be.list_workers(q).await?)
            }
            (Route::Worker(raw), Method::PATCH) => {
                let id = parse_worker_id(raw)?;
                let patch = json_body!(WorkerPatch);
                json(StatusCode::OK, &be.patch_worker(id, patch).await?)
            }
            (Route::Worker(raw), Method::DELETE) => {
                let id = parse_worker_id(raw)?;
                json(StatusCode::OK, &be.delete_worker(id).await?)
            }
            (Route::Select, Method::POST) => {
                let req = selection_body!().into_request(policy_class(headers), true)?;
                json(StatusCode::OK, &be.select(req).await?)
            }
            (Route::SelectAndReserve, Method::POST) => {
                let req = selection_body!().into_request(policy_class(headers), false)?;
                json(StatusCode::OK, &be.select_and_reserve(req).await?)
            }
            (Route::Reservations, Method::POST) => {
                let req = json_body!(WireReservation).into_request()?;
                json(StatusCode::CREATED, &be.create_reservation(req).await?)
            }
            (Route::PrefillComplete(raw), Method::POST) => {
                let id = decode_param(raw)?;
                be.prefill_complete(id).await?;
                json(StatusCode::OK, &StatusOk::OK)
            }
            (Route::OutputBlock(raw), Method::POST) => {
                let id = decode_param(raw)?;
                let req = json_body!(OutputBlockRequest);
                if let Some(f) = req.decay_fraction
                    && !(0.0..=1.0).contains(&f)
                {
                    return Err(ApiError::bad_request(
                        "decay_fraction must be between 0.0 and 1.0",
                    ));
                }
                be.output_block(id, req).await?;
                json(StatusCode::OK, &StatusOk::OK)
            }
            (Route::Reservation(raw), Method::DELETE) => {
                let id = decode_param(raw)?;
                be.free_reservation(id).await?;
                json(StatusCode::OK, &StatusOk::OK)
            }
            (Route::Ready, Method::GET) => {
                let ready = be.ready().await;
                let status = if ready.ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                json(status, &ready)
            }
            (Route::Loads, Method::GET) => {
                let q = worker_query(query);
                json(StatusCode::OK, &be.loads(q).await?)
            }
            (Route::PotentialLoads, Method::POST) => {
                let req = json_body!(WirePromptQuery).into_request()?;
                json(StatusCode::OK, &be.potential_loads(req).await?)
            }
            (Route::OverlapScores, Method::POST) => {
                let req = json_body!(WirePromptQuery).into_request()?;
                json(StatusCode::OK, &be.overlap_scores(req).await?)
            }
            (Route::Dump, Method::GET) => {
                let raw = be.dump().await?;
                Ok(with_content_type(
                    StatusCode::OK,
                    raw.0,
                    HeaderValue::from_static("application/json"),
                ))
            }
            (Route::RegisterPeer, Method::POST) => {
                let req = json_body!(PeerRequest);
                let status = match be.register_peer(req).await? {
                    PeerRegistration::Created => StatusCode::CREATED,
                    PeerRegistration::AlreadyRegistered => StatusCode::OK,
                };
                json(status, &StatusOk::OK)
            }
            (Route::DeregisterPeer, Method::POST) => {
                let req = json_body!(PeerRequest);
                be.deregister_peer(req).await?;
                json(StatusCode::OK, &StatusOk::OK)
            }
            (Route::Peers, Method::GET) => json(StatusCode::OK, &be.replica_peers().await?),
            _ => {
                let mut resp = error_response(&ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method not allowed",
                ));
                resp.headers_mut().insert(
                    header::ALLOW,
                    HeaderValue::from_static(allowed_methods(route)),
                );
                Ok(resp)
            }
        }
    }

    /// `Ok(None)` when authentication is off, else what the presented token may do.
    fn authorize(&self, headers: &HeaderMap) -> Result<Option<Access>, ApiError> {
        let tokens = &self.options.auth;
        if !tokens.enabled() {
            return Ok(None);
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, token) = v.trim().split_once(' ')?;
                scheme
                    .eq_ignore_ascii_case("bearer")
                    .then_some(token.trim())
            });
        match presented.and_then(|token| tokens.check(token.as_bytes())) {
            Some(access) => Ok(Some(access)),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid bearer token",
            )),
        }
    }
}

/// Whether a read-only token may call `route` with `method` (HEAD already mapped to GET).
///
/// An allow-list, so that a route added later needs a full token until someone decides
/// otherwise: every `GET` (`/workers`, `/ready`, `/loads`, `/dump`, `/metrics`,
/// `/replica_sync/peers`; a `GET` on a POST-only path is a 405 either way) and the two query
/// POSTs that the contract says book, queue and cache nothing (`/potential_loads`,
/// `/overlap_scores`, `http-api.md` §8.2–§8.3).
///
/// `/select` is *not* read-only: although it never books, with a `selection_id` it stores a
/// pending selection that a later `POST /reservations` turns into a booking (replacing an
/// earlier one with the same id), and without `advisory` it takes part in queue admission,
/// occupying queue capacity. Deciding by body would mean reading up to 8 MiB before
/// authorising, so the route as a whole needs a full token.
fn is_read_only(route: Route<'_>, method: &Method) -> bool {
    *method == Method::GET
        || (*method == Method::POST
            && matches!(route, Route::PotentialLoads | Route::OverlapScores))
}

fn policy_class(headers: &HeaderMap) -> Option<String> {
    let raw = headers.get(POLICY_CLASS_HEADER)?;
    let s = std::str::from_utf8(raw.as_bytes()).ok()?.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

fn parse_worker_id(raw: &str) -> Result<u64, ApiError> {
    let decoded = decode_param(raw)?;
    decoded.parse::<u64>().map_err(|_| {
        ApiError::bad_request(format!("Invalid URL: Cannot parse `{decoded}` to a `u64`"))
    })
}

fn decode_param(raw: &str) -> Result<String, ApiError> {
    String::from_utf8(percent_decode(raw.as_bytes(), false))
        .map_err(|_| ApiError::bad_request("Invalid URL: path parameter is not valid UTF-8"))
}

/// Percent-decoding; invalid escapes are kept literally. `plus_as_space` for query strings.
fn percent_decode(input: &[u8], plus_as_space: bool) -> Vec<u8> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        match input[i] {
            b'%' if i + 2 < input.len() => match (hex(input[i + 1]), hex(input[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' if plus_as_space => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// `model_name` / `routing_group` filters; other keys are ignored, the last duplicate wins.
fn worker_query(query: &str) -> WorkerQuery {
    let mut q = WorkerQuery::default();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = String::from_utf8_lossy(&percent_decode(k.as_bytes(), true)).into_owned();
        let v = String::from_utf8_lossy(&percent_decode(v.as_bytes(), true)).into_owned();
        match k.as_str() {
            "model_name" => q.model_name = Some(v),
            "routing_group" => q.routing_group = Some(v),
            _ => {}
        }
    }
    q
}

fn with_content_type(status: StatusCode, body: Bytes, ct: HeaderValue) -> HttpResponse {
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    resp
}

fn json<T: Serialize + ?Sized>(status: StatusCode, value: &T) -> Result<HttpResponse, ApiError> {
    // A selection answer is about 250 bytes: sized once instead of grown from serde_json's
    // 128 by a reallocation per request.
    let mut body = Vec::with_capacity(512);
    serde_json::to_writer(&mut body, value)
        .map_err(|e| ApiError::internal(format!("failed to serialize response: {e}")))?;
    Ok(with_content_type(
        status,
        Bytes::from(body),
        HeaderValue::from_static("application/json"),
    ))
}

fn metrics_response(text: String) -> HttpResponse {
    with_content_type(
        StatusCode::OK,
        Bytes::from(text),
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    )
}

/// Renders an [`ApiError`] as the contract's envelope.
pub fn error_response(e: &ApiError) -> HttpResponse {
    let body = serde_json::to_vec(&e.body()).unwrap_or_else(|_| b"{\"error\":\"\"}".to_vec());
    let mut resp = with_content_type(
        e.status,
        Bytes::from(body),
        HeaderValue::from_static("application/json"),
    );
    if e.status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if e.status == StatusCode::REQUEST_TIMEOUT {
        // The rest of the body may still be on its way: the connection cannot carry
        // another request.
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// The methods a known path answers, for the `Allow` header every 405 must carry
/// (RFC 9110 §15.5.6). HEAD goes with GET, as `handle` serves it.
fn allowed_methods(route: Route<'_>) -> &'static str {
    match route {
        Route::Workers => "GET, HEAD, POST",
        Route::Worker(_) => "PATCH, DELETE",
        Route::Reservation(_) => "DELETE",
        Route::Health
        | Route::Metrics
        | Route::Ready
        | Route::Loads
        | Route::Dump
        | Route::Peers => "GET, HEAD",
        Route::Select
        | Route::SelectAndReserve
        | Route::Reservations
        | Route::PrefillComplete(_)
        | Route::OutputBlock(_)
        | Route::PotentialLoads
        | Route::OverlapScores
        | Route::RegisterPeer
        | Route::DeregisterPeer => "POST",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(match_path("/select"), Some(Route::Select));
        assert_eq!(match_path("/select/"), None);
        assert_eq!(match_path("/workers/7"), Some(Route::Worker("7")));
        assert_eq!(match_path("/workers/"), None);
        assert_eq!(
            match_path("/reservations/a%2Fb/output_block"),
            Some(Route::OutputBlock("a%2Fb"))
        );
        assert_eq!(match_path("/reservations/x/other"), None);
        assert_eq!(match_path("/replica_sync/peers"), Some(Route::Peers));
        assert_eq!(match_path("/replica_sync"), None);
        assert_eq!(match_path(""), None);
    }

    #[test]
    fn decoding() {
        assert_eq!(percent_decode(b"a%2Fb%zz%4", false), b"a/b%zz%4");
        assert_eq!(percent_decode(b"a+b%20c", true), b"a b c");
        assert_eq!(percent_decode(b"a+b", false), b"a+b");
        let q = worker_query("model_name=llama%203&x=1&routing_group=g&routing_group=h");
        assert_eq!(q.model_name.as_deref(), Some("llama 3"));
        assert_eq!(q.routing_group.as_deref(), Some("h"));
        assert_eq!(
            parse_worker_id("abc").unwrap_err().message,
            "Invalid URL: Cannot parse `abc` to a `u64`"
        );
        assert_eq!(parse_worker_id("%31%32").unwrap(), 12);
    }

    #[test]
    fn read_only_routes() {
        let route = |p| match_path(p).unwrap();
        for (m, p) in [
            (Method::GET, "/workers"),
            (Method::GET, "/loads"),
            (Method::GET, "/dump"),
            (Method::GET, "/metrics"),
            (Method::GET, "/ready"),
            (Method::GET, "/replica_sync/peers"),
            (Method::POST, "/potential_loads"),
            (Method::POST, "/overlap_scores"),
        ] {
            assert!(is_read_only(route(p), &m), "{m} {p}");
        }
        for (m, p) in [
            (Method::POST, "/select"),
            (Method::POST, "/select_and_reserve"),
            (Method::POST, "/workers"),
            (Method::PATCH, "/workers/1"),
            (Method::DELETE, "/workers/1"),
            (Method::POST, "/reservations"),
            (Method::POST, "/reservations/x/prefill_complete"),
            (Method::POST, "/reservations/x/output_block"),
            (Method::DELETE, "/reservations/x"),
            (Method::POST, "/replica_sync/register_peer"),
            (Method::POST, "/replica_sync/deregister_peer"),
            (Method::PUT, "/loads"),
        ] {
            assert!(!is_read_only(route(p), &m), "{m} {p}");
        }
    }
}
