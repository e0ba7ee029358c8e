//! One `Process` stream (one HTTP request through the gateway): the ext_proc conversation
//! and the booking bound to it.
//!
//! When the decision is sent depends on the request body mode the gateway announces in
//! `protocol_config` (first message):
//! - `FULL_DUPLEX_STREAMED` (what GIE gateways use): the headers answer waits for the
//!   whole body; then the headers response carries the decision and the body goes back
//!   unchanged as streamed body mutations.
//! - `STREAMED` with `send_body_without_waiting_for_header_response`: the same wait, then
//!   one `CONTINUE` per body chunk. Without that flag the gateway waits for the headers
//!   answer before sending any body, so the pick happens at the headers, by load only.
//! - `BUFFERED`, `BUFFERED_PARTIAL`, or no `protocol_config` (older Envoy): headers are
//!   answered at once; the body response carries the decision (header mutations on a
//!   buffered body response apply).
//! - `NONE`, or request headers that end the stream: the pick happens at the headers.
//!
//! The response side: the first response body chunk marks the prefill complete; the end
//! of the response (a body or headers chunk with `end_of_stream`, or trailers) frees the
//! booking; a stream that ends otherwise drops the [`Booking`], which frees it.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, Metadata, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

use crate::metrics::StreamEvent;
use crate::picker::{Booking, PickError, PickInput, Picker};
use crate::request::LoadOnlyReason;

/// The decision header and the `envoy.lb` metadata key of the same name.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Namespace of the decision in `dynamic_metadata` and of the served endpoint in the
/// response's `metadata_context`.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The endpoint that actually served the request (response `metadata_context`).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// Namespace and key of the gateway's candidate subset (request `metadata_context`).
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// Body chunks sent back in full-duplex mode stay below gRPC's usual 4 MiB message limit.
const ECHO_CHUNK: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RequestMode {
    /// Answer the headers at once, decide on the first body message.
    Buffered,
    /// Hold the headers answer until the body ends, then one CONTINUE per chunk.
    StreamedDeferred,
    /// Pick at the headers (the body is not available in time).
    AtHeaders(LoadOnlyReason),
    /// Hold the headers answer until the body ends, then echo the body.
    Duplex,
}

/// The state of one `Process` stream.
#[derive(Debug)]
pub(crate) struct StreamState {
    picker: Arc<Picker>,
    modes_known: bool,
    request_mode: RequestMode,
    response_duplex: bool,
    headers: Vec<(String, String)>,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    chunks: usize,
    /// The request phase has been answered (decision sent or refused).
    decided: bool,
    booking: Option<Booking>,
    served_checked: bool,
}

impl StreamState {
    pub(crate) fn new(picker: Arc<Picker>) -> Self {
        picker.metrics().stream(StreamEvent::Opened);
        Self {
            picker,
            modes_known: false,
            request_mode: RequestMode::Buffered,
            response_duplex: false,
            headers: Vec::new(),
            subset: None,
            body: Vec::new(),
            chunks: 0,
            decided: false,
            booking: None,
            served_checked: false,
        }
    }

    /// Handles one message from the gateway, pushing the answers to send, in order.
    pub(crate) async fn handle(
        &mut self,
        msg: ProcessingRequest,
        out: &mut Vec<ProcessingResponse>,
    ) {
        if !self.modes_known {
            self.modes_known = true;
            if let Some(pc) = &msg.protocol_config {
                let req =
                    BodySendMode::try_from(pc.request_body_mode).unwrap_or(BodySendMode::None);
                self.request_mode = match req {
                    BodySendMode::FullDuplexStreamed => RequestMode::Duplex,
                    BodySendMode::Streamed if pc.send_body_without_waiting_for_header_response => {
                        RequestMode::StreamedDeferred
                    }
                    BodySendMode::Streamed => {
                        RequestMode::AtHeaders(LoadOnlyReason::StreamedBodyMode)
                    }
                    BodySendMode::Buffered | BodySendMode::BufferedPartial => RequestMode::Buffered,
                    _ => RequestMode::AtHeaders(LoadOnlyReason::NoBody),
                };
                self.response_duplex = BodySendMode::try_from(pc.response_body_mode)
                    == Ok(BodySendMode::FullDuplexStreamed);
            }
        }
        if self.booking.is_some()
            && !self.served_checked
            && let Some(served) = served_endpoint(msg.metadata_context.as_ref())
        {
            self.served_checked = true;
            if let Some(b) = &mut self.booking {
                b.move_to(&served).await;
            }
        }
        let Some(request) = msg.request else {
            return;
        };
        use processing_request::Request as R;
        match request {
            R::RequestHeaders(h) => {
                self.request_headers(h, msg.metadata_context.as_ref(), out)
                    .await
            }
            R::RequestBody(b) => self.request_body(b, out).await,
            R::RequestTrailers(_) => {
                if !self.decided {
                    let body_pending = matches!(
                        self.request_mode,
                        RequestMode::Duplex | RequestMode::StreamedDeferred
                    );
                    self.decide(None, false, out).await;
                    if body_pending {
                        self.flush_body(false, out);
                    }
                }
                out.push(response(processing_response::Response::RequestTrailers(
                    TrailersResponse::default(),
                )));
            }
            R::ResponseHeaders(h) => {
                out.push(response(processing_response::Response::ResponseHeaders(
                    HeadersResponse::default(),
                )));
                if h.end_of_stream
                    && let Some(b) = &mut self.booking
                {
                    b.prefill_complete();
                    b.finish();
                }
            }
            R::ResponseBody(b) => {
                if let Some(booking) = &mut self.booking {
                    booking.prefill_complete();
                    if b.end_of_stream {
                        booking.finish();
                    }
                }
                let common = if self.response_duplex {
                    Some(CommonResponse {
                        body_mutation: Some(streamed(b.body, b.end_of_stream)),
                        ..CommonResponse::default()
                    })
                } else {
                    None
                };
                out.push(response(processing_response::Response::ResponseBody(
                    BodyResponse { response: common },
                )));
            }
            R::ResponseTrailers(_) => {
                if let Some(b) = &mut self.booking {
                    b.prefill_complete();
                    b.finish();
                }
                out.push(response(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                )));
            }
        }
    }

    async fn request_headers(
        &mut self,
        h: HttpHeaders,
        metadata: Option<&Metadata>,
        out: &mut Vec<ProcessingResponse>,
    ) {
        if self.decided || !self.headers.is_empty() {
            self.picker.metrics().stream(StreamEvent::ProtocolError);
            out.push(response(processing_response::Response::RequestHeaders(
                HeadersResponse::default(),
            )));
            return;
        }
        if let Some(map) = h.headers {
            self.headers = map
                .headers
                .into_iter()
                .map(|hv| {
                    let value = if hv.value.is_empty() {
                        String::from_utf8_lossy(&hv.raw_value).into_owned()
                    } else {
                        hv.value
                    };
                    (hv.key.to_ascii_lowercase(), value)
                })
                .collect();
        }
        self.subset = subset_hint(metadata);
        if h.end_of_stream {
            self.decide(Some(LoadOnlyReason::NoBody), true, out).await;
            return;
        }
        match self.request_mode {
            RequestMode::AtHeaders(reason) => self.decide(Some(reason), true, out).await,
            RequestMode::Buffered => out.push(response(
                processing_response::Response::RequestHeaders(HeadersResponse::default()),
            )),
            RequestMode::Duplex | RequestMode::StreamedDeferred => {}
        }
    }

    async fn request_body(&mut self, b: HttpBody, out: &mut Vec<ProcessingResponse>) {
        if self.decided {
            // Streamed chunks after a pick at the headers, or anything after a refusal.
            let common = (self.request_mode == RequestMode::Duplex).then(|| CommonResponse {
                body_mutation: Some(streamed(b.body, b.end_of_stream)),
                ..CommonResponse::default()
            });
            out.push(response(processing_response::Response::RequestBody(
                BodyResponse { response: common },
            )));
            return;
        }
        self.body.extend_from_slice(&b.body);
        self.chunks += 1;
        match self.request_mode {
            RequestMode::Buffered => self.decide(None, false, out).await,
            RequestMode::Duplex | RequestMode::StreamedDeferred if b.end_of_stream => {
                self.decide(None, true, out).await;
                self.flush_body(true, out);
            }
            _ => {}
        }
    }

    /// After a deferred decision: the body chunks' answers (duplex: the body itself).
    fn flush_body(&mut self, end_of_stream: bool, out: &mut Vec<ProcessingResponse>) {
        if out.iter().any(|r| {
            matches!(
                r.response,
                Some(processing_response::Response::ImmediateResponse(_))
            )
        }) {
            return;
        }
        match self.request_mode {
            RequestMode::Duplex => {
                let body = std::mem::take(&mut self.body);
                let mut pieces = body.chunks(ECHO_CHUNK).peekable();
                if pieces.peek().is_none() {
                    out.push(body_response(streamed(Vec::new(), end_of_stream)));
                }
                while let Some(piece) = pieces.next() {
                    let last = pieces.peek().is_none();
                    out.push(body_response(streamed(
                        piece.to_vec(),
                        last && end_of_stream,
                    )));
                }
            }
            _ => {
                for _ in 0..std::mem::take(&mut self.chunks) {
                    out.push(response(processing_response::Response::RequestBody(
                        BodyResponse::default(),
                    )));
                }
            }
        }
    }

    /// Picks and pushes the decision: on the headers answer when `on_headers`, else on the
    /// body answer; a refusal is an immediate response either way.
    async fn decide(
        &mut self,
        load_only: Option<LoadOnlyReason>,
        on_headers: bool,
        out: &mut Vec<ProcessingResponse>,
    ) {
        self.decided = true;
        let input = PickInput {
            headers: &self.headers,
            body: &self.body,
            subset: self.subset.take(),
            load_only,
        };
        match self.picker.pick(input).await {
            Ok(booking) => {
                let endpoint = booking.destination();
                self.booking = Some(booking);
                let common = Some(CommonResponse {
                    header_mutation: Some(destination_header(&endpoint)),
                    ..CommonResponse::default()
                });
                let r = if on_headers {
                    processing_response::Response::RequestHeaders(HeadersResponse {
                        response: common,
                    })
                } else {
                    processing_response::Response::RequestBody(BodyResponse { response: common })
                };
                out.push(ProcessingResponse {
                    response: Some(r),
                    dynamic_metadata: Some(destination_metadata(&endpoint)),
                    ..ProcessingResponse::default()
                });
            }
            Err(e) => out.push(immediate(&e)),
        }
    }
}

fn response(r: processing_response::Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        ..ProcessingResponse::default()
    }
}

fn body_response(m: BodyMutation) -> ProcessingResponse {
    response(processing_response::Response::RequestBody(BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(m),
            ..CommonResponse::default()
        }),
    }))
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyMutation {
    BodyMutation {
        mutation: Some(body_mutation::Mutation::StreamedResponse(
            StreamedBodyResponse {
                body,
                end_of_stream,
                ..StreamedBodyResponse::default()
            },
        )),
    }
}

fn destination_header(endpoint: &str) -> HeaderMutation {
    HeaderMutation {
        set_headers: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: DESTINATION_HEADER.into(),
                raw_value: endpoint.as_bytes().to_vec(),
                ..HeaderValue::default()
            }),
            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..HeaderValueOption::default()
        }],
        ..HeaderMutation::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

fn destination_metadata(endpoint: &str) -> Struct {
    let mut lb = Struct::default();
    lb.fields
        .insert(DESTINATION_HEADER.into(), string_value(endpoint));
    let mut root = Struct::default();
    root.fields.insert(
        LB_NAMESPACE.into(),
        Value {
            kind: Some(Kind::StructValue(lb)),
        },
    );
    root
}

fn immediate(e: &PickError) -> ProcessingResponse {
    let body =
        serde_json::json!({ "error": { "message": e.to_string(), "code": e.http_status() } });
    response(processing_response::Response::ImmediateResponse(
        ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(e.http_status()),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![HeaderValueOption {
                    header: Some(HeaderValue {
                        key: "content-type".into(),
                        raw_value: b"application/json".to_vec(),
                        ..HeaderValue::default()
                    }),
                    append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                    ..HeaderValueOption::default()
                }],
                ..HeaderMutation::default()
            }),
            body: body.to_string().into_bytes(),
            details: format!("kv-select: {e}"),
            ..ImmediateResponse::default()
        },
    ))
}

/// A string field of a metadata namespace, or the strings of a list field.
fn metadata_strings(md: Option<&Metadata>, namespace: &str, key: &str) -> Option<Vec<String>> {
    let v = md?.filter_metadata.get(namespace)?.fields.get(key)?;
    match v.kind.as_ref()? {
        Kind::StringValue(s) => Some(
            s.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        ),
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match &v.kind {
                    Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                    _ => None,
                })
                .collect(),
        ),
        _ => None,
    }
}

fn subset_hint(md: Option<&Metadata>) -> Option<Vec<String>> {
    metadata_strings(md, SUBSET_NAMESPACE, SUBSET_KEY)
}

fn served_endpoint(md: Option<&Metadata>) -> Option<String> {
    metadata_strings(md, LB_NAMESPACE, SERVED_KEY)?
        .into_iter()
        .next()
}
