//! Black-box tests of the endpoint picker: the real binary with `--ext-proc-port`, driven
//! by a tonic client that plays Envoy's side of ext_proc streams over loopback gRPC.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::process::{Child, Stdio};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
    body_mutation, processing_request, processing_response,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::http::{call, free_port, spawn_server};

pub(crate) const DUPLEX: i32 = 4;
pub(crate) const BUFFERED: i32 = 2;

pub(crate) struct Server {
    child: Child,
    pub(crate) port: u16,
    pub(crate) grpc: u16,
}

impl Server {
    /// The binary with `--ext-proc-port` and KV events off.
    fn start() -> Server {
        Self::start_with(&[], &[("DYN_ROUTER_USE_KV_EVENTS", "false")])
    }

    /// The binary with `--ext-proc-port` and `extra` arguments.
    pub(crate) fn start_with(extra: &[&str], env: &[(&str, &str)]) -> Server {
        Self::start_logging(extra, env, None)
    }

    /// [`Server::start_with`], its stderr (warnings and errors) written to `log` if given.
    pub(crate) fn start_logging(
        extra: &[&str],
        env: &[(&str, &str)],
        log: Option<&std::path::Path>,
    ) -> Server {
        for _ in 0..5 {
            let (port, grpc) = (free_port(), free_port());
            let grpc_arg = grpc.to_string();
            let mut args = vec!["--ext-proc-port", &grpc_arg];
            args.extend_from_slice(extra);
            let stderr = match log {
                Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
                None => Stdio::null(),
            };
            if let Some(child) = spawn_server(port, &args, env, stderr) {
                return Server { child, port, grpc };
            }
        }
        panic!("select-server with --ext-proc-port did not start");
    }

    /// Registers workers 1 and 2 at 127.0.0.1:9001 and 127.0.0.1:9002 (the second without a
    /// scheme), block size 4.
    pub(crate) fn register_pair(&self) {
        for (id, ep) in [(1, "http://127.0.0.1:9001"), (2, "127.0.0.1:9002")] {
            let (status, body) = call(
                self.port,
                "POST",
                "/workers",
                Some(&json!({"worker_id": id, "endpoint": ep, "block_size": 4})),
            );
            assert_eq!(status, 201, "{body}");
        }
    }

    pub(crate) fn active_requests(&self) -> u64 {
        let (_, loads) = call(self.port, "GET", "/loads", None);
        loads
            .as_array()
            .map(|ps| {
                ps.iter()
                    .flat_map(|p| p["loads"].as_array().cloned().unwrap_or_default())
                    .map(|r| r["active_requests"].as_u64().unwrap_or(0))
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Waits (bounded, 5 s) until no booking is active: a dropped stream's booking is freed
    /// when the server sees the stream end, after the client's drop returns.
    pub(crate) async fn wait_idle(&self, what: &str) {
        for _ in 0..50 {
            if self.active_requests() == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "{what}: {} requests still active after 5 s",
            self.active_requests()
        );
    }

    pub(crate) async fn client(&self) -> ExternalProcessorClient<tonic::transport::Channel> {
        ExternalProcessorClient::connect(format!("http://127.0.0.1:{}", self.grpc))
            .await
            .unwrap()
    }

    pub(crate) fn metrics(&self) -> String {
        crate::http::raw(self.port, "GET", "/metrics", None, b"").1
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One Envoy-side stream: messages in through a channel, answers out.
pub(crate) struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
    pub(crate) last_metadata: Option<Struct>,
}

impl Stream {
    pub(crate) async fn open(
        client: &mut ExternalProcessorClient<tonic::transport::Channel>,
    ) -> Stream {
        let (tx, rx) = mpsc::channel(16);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream {
            tx,
            rx,
            last_metadata: None,
        }
    }

    pub(crate) async fn send(&self, m: ProcessingRequest) {
        self.tx.send(m).await.unwrap();
    }

    pub(crate) async fn recv(&mut self) -> processing_response::Response {
        let r = tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer within 10 s")
            .unwrap()
            .expect("the stream is open");
        self.last_metadata = r.dynamic_metadata.clone();
        r.response.unwrap()
    }
}

pub(crate) fn headers(
    body_mode: Option<i32>,
    eos: bool,
    subset: Option<&[&str]>,
) -> ProcessingRequest {
    let hv = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..HeaderValue::default()
    };
    let metadata_context = subset.map(|s| {
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: s
                    .iter()
                    .map(|e| Value {
                        kind: Some(Kind::StringValue((*e).into())),
                    })
                    .collect(),
            })),
        };
        let mut ns = Struct::default();
        ns.fields
            .insert("x-gateway-destination-endpoint-subset".into(), list);
        let mut md = Metadata::default();
        md.filter_metadata.insert("envoy.lb.subset_hint".into(), ns);
        md
    });
    ProcessingRequest {
        protocol_config: body_mode.map(|m| ProtocolConfiguration {
            request_body_mode: m,
            response_body_mode: 0,
            send_body_without_waiting_for_header_response: false,
        }),
        metadata_context,
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    hv(":method", "POST"),
                    hv(":path", "/v1/completions"),
                    hv("content-type", "application/json"),
                ],
            }),
            end_of_stream: eos,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

pub(crate) fn body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream: eos,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

pub(crate) fn response_headers(served: Option<&str>) -> ProcessingRequest {
    let metadata_context = served.map(|s| {
        let mut ns = Struct::default();
        ns.fields.insert(
            "x-gateway-destination-endpoint-served".into(),
            Value {
                kind: Some(Kind::StringValue(s.into())),
            },
        );
        let mut md = Metadata::default();
        md.filter_metadata.insert("envoy.lb".into(), ns);
        md
    });
    ProcessingRequest {
        metadata_context,
        request: Some(processing_request::Request::ResponseHeaders(
            HttpHeaders::default(),
        )),
        ..ProcessingRequest::default()
    }
}

pub(crate) fn response_body(eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: b"data".to_vec(),
            end_of_stream: eos,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// The destination of a headers or body answer, checked against its dynamic metadata.
pub(crate) fn destination(r: &processing_response::Response, metadata: Option<&Struct>) -> String {
    use processing_response::Response as R;
    let common = match r {
        R::RequestHeaders(h) => h.response.clone(),
        R::RequestBody(b) => b.response.clone(),
        other => panic!("expected a decision, got {other:?}"),
    }
    .unwrap();
    let set = &common.header_mutation.unwrap().set_headers[0];
    let header = set.header.clone().unwrap();
    assert_eq!(header.key, "x-gateway-destination-endpoint");
    let value = String::from_utf8(header.raw_value).unwrap();
    let lb = match &metadata.unwrap().fields["envoy.lb"].kind {
        Some(Kind::StructValue(s)) => s.clone(),
        other => panic!("envoy.lb: {other:?}"),
    };
    assert_eq!(
        lb.fields["x-gateway-destination-endpoint"].kind,
        Some(Kind::StringValue(value.clone()))
    );
    value
}

pub(crate) fn immediate_status(r: &processing_response::Response) -> i32 {
    match r {
        processing_response::Response::ImmediateResponse(i) => i.status.unwrap().code,
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub(crate) const BODY: &str = r#"{"model":"default","prompt":[1,2,3,4,5,6,7,8,9,10,11,12]}"#;

#[test]
fn a_duplex_stream_picks_passes_the_body_on_and_frees_at_the_end_of_the_response() {
    let server = Server::start();
    server.register_pair();
    runtime().block_on(async {
        let mut client = server.client().await;
        let mut s = Stream::open(&mut client).await;
        s.send(headers(Some(DUPLEX), false, None)).await;
        // The body in two chunks; nothing is answered before its end.
        let (a, b) = BODY.as_bytes().split_at(20);
        s.send(body(a, false)).await;
        s.send(body(b, true)).await;
        let decision = s.recv().await;
        let chosen = destination(&decision, s.last_metadata.as_ref());
        assert!(
            chosen == "127.0.0.1:9001" || chosen == "127.0.0.1:9002",
            "{chosen}"
        );
        let echoed = match s.recv().await {
            processing_response::Response::RequestBody(b) => {
                match b.response.unwrap().body_mutation.unwrap().mutation.unwrap() {
                    body_mutation::Mutation::StreamedResponse(r) => {
                        assert!(r.end_of_stream);
                        r.body
                    }
                    other => panic!("{other:?}"),
                }
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(echoed, BODY.as_bytes(), "the body goes on unchanged");
        assert_eq!(server.active_requests(), 1, "the pick booked");
        s.send(response_headers(None)).await;
        assert!(matches!(
            s.recv().await,
            processing_response::Response::ResponseHeaders(_)
        ));
        s.send(response_body(false)).await;
        s.recv().await;
        assert_eq!(server.active_requests(), 1);
        s.send(response_body(true)).await;
        s.recv().await;
        assert_eq!(server.active_requests(), 0, "the end of the response frees");

        // The same tokens again: the recorded blocks steer them to the same worker.
        let mut s = Stream::open(&mut client).await;
        s.send(headers(Some(BUFFERED), false, None)).await;
        assert!(matches!(
            s.recv().await,
            processing_response::Response::RequestHeaders(_)
        ));
        s.send(body(BODY.as_bytes(), true)).await;
        let again = s.recv().await;
        assert_eq!(destination(&again, s.last_metadata.as_ref()), chosen);
    });
    let metrics = server.metrics();
    assert!(
        metrics.contains("kv_select_ext_proc_picks_total{outcome=\"picked\"} 2"),
        "{metrics}"
    );
}

#[test]
fn subset_hints_cancellations_moves_and_health() {
    let server = Server::start();
    runtime().block_on(async {
        let channel =
            tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", server.grpc))
                .unwrap()
                .connect()
                .await
                .unwrap();
        let mut health = HealthClient::new(channel);
        let status = |service: &str| {
            let mut health = health.clone();
            let service = service.to_owned();
            async move {
                health
                    .check(HealthCheckRequest { service })
                    .await
                    .unwrap()
                    .into_inner()
                    .status
            }
        };
        let ext = "envoy.service.ext_proc.v3.ExternalProcessor";
        assert_eq!(status("liveness").await, ServingStatus::Serving as i32);
        assert_eq!(status("readiness").await, ServingStatus::NotServing as i32);
        // No worker: 503.
        let mut client = server.client().await;
        let mut s = Stream::open(&mut client).await;
        s.send(headers(Some(DUPLEX), true, None)).await;
        assert_eq!(immediate_status(&s.recv().await), 503);

        server.register_pair();
        let mut ready = false;
        for _ in 0..40 {
            if status("readiness").await == ServingStatus::Serving as i32 {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ready, "readiness follows /ready");
        assert_eq!(status(ext).await, ServingStatus::Serving as i32);
        let _ = &mut health;

        // An empty subset, and one naming no worker: 503. One worker named: that one.
        for (subset, expected) in [
            (&[][..], None),
            (&["10.9.9.9:1"][..], None),
            (&["127.0.0.1:9002"][..], Some("127.0.0.1:9002")),
        ] {
            let mut s = Stream::open(&mut client).await;
            s.send(headers(Some(BUFFERED), false, Some(subset))).await;
            s.recv().await;
            s.send(body(BODY.as_bytes(), true)).await;
            let r = s.recv().await;
            match expected {
                None => assert_eq!(immediate_status(&r), 503, "{subset:?}"),
                Some(e) => assert_eq!(destination(&r, s.last_metadata.as_ref()), e),
            }
        }
        server.wait_idle("the subset stream ended").await;

        // The gateway served elsewhere: the booking moves to the worker it names.
        let mut s = Stream::open(&mut client).await;
        s.send(headers(Some(BUFFERED), false, Some(&["127.0.0.1:9001"])))
            .await;
        s.recv().await;
        s.send(body(BODY.as_bytes(), true)).await;
        assert_eq!(
            destination(&s.recv().await, s.last_metadata.as_ref()),
            "127.0.0.1:9001"
        );
        s.send(response_headers(Some("127.0.0.1:9002"))).await;
        s.recv().await;
        let (_, loads) = call(server.port, "GET", "/loads", None);
        let by_worker: Vec<(u64, u64)> = loads[0]["loads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["worker_id"].as_u64().unwrap(),
                    r["active_requests"].as_u64().unwrap(),
                )
            })
            .collect();
        assert!(
            by_worker.contains(&(2, 1)) && by_worker.contains(&(1, 0)),
            "{by_worker:?}"
        );
        drop(s);

        // A burst of streams cancelled after their pick leaves nothing booked.
        let mut open = Vec::new();
        for _ in 0..20 {
            let mut s = Stream::open(&mut client).await;
            s.send(headers(Some(DUPLEX), false, None)).await;
            s.send(body(BODY.as_bytes(), true)).await;
            s.recv().await;
            open.push(s);
        }
        assert!(server.active_requests() >= 20);
        drop(open);
        server
            .wait_idle("cancelled streams free their bookings")
            .await;
    });
    let metrics = server.metrics();
    assert!(
        metrics.contains("kv_select_ext_proc_stream_events_total{event=\"moved\"} 1\n"),
        "{metrics}"
    );
}
