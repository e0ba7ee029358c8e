//! The endpoint picker's metrics on `/metrics`: picks by outcome (picked, 503, 429),
//! load-only picks by reason, tokenization time, and the stream lifecycle events.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use serde_json::json;
use tonic::transport::Channel;

use crate::ext_proc::{
    BODY, BUFFERED, Server, Stream, body, destination, headers, immediate_status, response_body,
    response_headers, runtime,
};
use crate::ext_proc_kv::TempDir;
use crate::http::call;

/// STREAMED request body mode (without `send_body_without_waiting_for_header_response`).
const STREAMED: i32 = 1;

/// The value of the sample named exactly `series` (name and labels); 0 when absent.
fn value(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// One buffered request: headers, then `bytes` as the whole body (none: the headers end
/// the stream). The decision or refusal comes back with the open stream.
async fn request(
    client: &mut ExternalProcessorClient<Channel>,
    mode: i32,
    bytes: Option<&[u8]>,
    subset: Option<&[&str]>,
) -> (Stream, Response) {
    let mut s = Stream::open(client).await;
    s.send(headers(Some(mode), bytes.is_none(), subset)).await;
    let Some(bytes) = bytes else {
        let r = s.recv().await;
        return (s, r);
    };
    if mode == STREAMED {
        // Picked at the headers: the body is not waited for.
        let r = s.recv().await;
        return (s, r);
    }
    s.recv().await;
    s.send(body(bytes, true)).await;
    let r = s.recv().await;
    (s, r)
}

/// The response side of a picked request, to its end: prefill complete, then freed.
async fn respond(s: &mut Stream) {
    s.send(response_headers(None)).await;
    s.recv().await;
    s.send(response_body(false)).await;
    s.recv().await;
    s.send(response_body(true)).await;
    s.recv().await;
}

#[test]
fn picks_refusals_load_only_reasons_tokenize_time_and_stream_events_are_counted() {
    // Every worker takes one request at a time: a second one is shed (429).
    let dir = TempDir::new("ext-proc-metrics");
    let policy = dir.0.join("policy.yaml");
    std::fs::write(
        &policy,
        "classes:\n\
         \x20 - name: strict\n\
         \x20   prefill_busy_threshold: 10\n\
         \x20   request_queue_limit_per_worker: 0\n\
         default_class: strict\n",
    )
    .unwrap();
    let chat = dir.0.join("chat");
    let plain = dir.0.join("plain");
    for d in [&chat, &plain] {
        std::fs::create_dir_all(d).unwrap();
        testkit::chat_tokenizer(d);
    }
    // A tokenizer without a chat template.
    std::fs::remove_file(plain.join("tokenizer_config.json")).unwrap();
    let (chat_arg, plain_arg) = (
        format!("chat={}", chat.display()),
        format!("plain={}", plain.display()),
    );
    let server = Server::start_with(
        &["--tokenizer", &chat_arg, "--tokenizer", &plain_arg],
        &[
            ("DYN_ROUTER_USE_KV_EVENTS", "false"),
            ("DYN_ROUTER_POLICY_CONFIG", policy.to_str().unwrap()),
        ],
    );
    runtime().block_on(async {
        let mut client = server.client().await;
        // No worker yet: 503.
        let (_, r) = request(&mut client, BUFFERED, Some(BODY.as_bytes()), None).await;
        assert_eq!(immediate_status(&r), 503);
        // A body routed by load alone finds no worker either: a 503, not a load-only pick.
        let (_, r) = request(&mut client, BUFFERED, Some(b"not json"), None).await;
        assert_eq!(immediate_status(&r), 503);
        for (id, model) in [(1, "default"), (2, "chat"), (3, "plain")] {
            let (status, body) = call(
                server.port,
                "POST",
                "/workers",
                Some(&json!({"worker_id": id, "model_name": model,
                             "endpoint": format!("127.0.0.1:900{id}"), "block_size": 4,
                             "max_num_batched_tokens": 10000})),
            );
            assert_eq!(status, 201, "{body}");
        }
        // A subset naming no worker: 503.
        let (_, r) = request(
            &mut client,
            BUFFERED,
            Some(BODY.as_bytes()),
            Some(&["10.9.9.9:1"]),
        )
        .await;
        assert_eq!(immediate_status(&r), 503);

        // Worker 1 busy with a long prompt: the next request is shed (429).
        let long = json!({"model": "default", "prompt": (0..80).collect::<Vec<u32>>()});
        let long = serde_json::to_vec(&long).unwrap();
        let (mut busy, r) = request(&mut client, BUFFERED, Some(&long), None).await;
        assert_eq!(
            destination(&r, busy.last_metadata.as_ref()),
            "127.0.0.1:9001"
        );
        let (_, r) = request(&mut client, BUFFERED, Some(&long), None).await;
        assert_eq!(immediate_status(&r), 429);
        respond(&mut busy).await;
        assert_eq!(server.active_requests(), 0);

        // Load-only picks, one per reason; each response runs to its end.
        let chat_body = |role: &str, model: &str| {
            serde_json::to_vec(&json!({"model": model,
                "messages": [{"role": role, "content": "What is the capital of France?"}]}))
            .unwrap()
        };
        let good_chat = chat_body("user", "chat");
        let bad_role = chat_body("wizard", "chat");
        let no_template = chat_body("user", "plain");
        let cases: [(i32, Option<&[u8]>); 8] = [
            (BUFFERED, None),
            (BUFFERED, Some(b"not json")),
            (BUFFERED, Some(br#"{"model":"default","input":"x"}"#)),
            (BUFFERED, Some(br#"{"model":"default","prompt":["a","b"]}"#)),
            (BUFFERED, Some(br#"{"model":"default","prompt":"hello"}"#)),
            (STREAMED, Some(br#"{"model":"default","prompt":[1,2,3,4]}"#)),
            (BUFFERED, Some(&bad_role)),
            (BUFFERED, Some(&no_template)),
        ];
        for (mode, bytes) in cases {
            let (mut s, r) = request(&mut client, mode, bytes, None).await;
            destination(&r, s.last_metadata.as_ref());
            respond(&mut s).await;
        }
        // Tokenized: counted in the tokenize histogram, not as load-only.
        let (mut s, r) = request(&mut client, BUFFERED, Some(&good_chat), None).await;
        assert_eq!(destination(&r, s.last_metadata.as_ref()), "127.0.0.1:9002");
        // The gateway reports a served endpoint that names no worker: the booking stays.
        s.send(response_headers(Some("10.9.9.9:1"))).await;
        s.recv().await;
        s.send(response_body(true)).await;
        s.recv().await;

        // A second request headers on one stream is a protocol error; a stream dropped
        // with its booking live is cancelled.
        let (mut s, r) = request(
            &mut client,
            BUFFERED,
            Some(br#"{"prompt":[9,9,9,9]}"#),
            None,
        )
        .await;
        destination(&r, s.last_metadata.as_ref());
        s.send(headers(Some(BUFFERED), true, None)).await;
        s.recv().await;
        drop(s);
        server
            .wait_idle("the dropped stream's booking is freed")
            .await;
    });

    let m = server.metrics();
    let picks = |o: &str| {
        value(
            &m,
            &format!("kv_select_ext_proc_picks_total{{outcome=\"{o}\"}}"),
        )
    };
    assert_eq!(
        (picks("picked"), picks("unavailable"), picks("shed")),
        (11.0, 3.0, 1.0),
        "{m}"
    );
    let load_only = |r: &str| {
        value(
            &m,
            &format!("kv_select_ext_proc_load_only_picks_total{{reason=\"{r}\"}}"),
        )
    };
    for (reason, n) in [
        ("no_body", 1.0),
        ("not_json", 1.0),
        ("unknown_shape", 1.0),
        ("batch_prompt", 1.0),
        ("no_tokenizer", 1.0),
        ("streamed_body_mode", 1.0),
        ("template_error", 1.0),
        ("no_chat_template", 1.0),
        ("tokenize_error", 0.0),
        ("prompt_rejected", 0.0),
    ] {
        assert_eq!(load_only(reason), n, "{reason}: {m}");
    }
    // Rendered and tokenized: the good chat, and the two whose template failed or was
    // missing (the time is spent either way).
    assert_eq!(
        value(&m, "kv_select_ext_proc_tokenize_seconds_count"),
        3.0,
        "{m}"
    );
    assert!(
        value(&m, "kv_select_ext_proc_tokenize_seconds_sum") > 0.0,
        "{m}"
    );
    let events = |e: &str| {
        value(
            &m,
            &format!("kv_select_ext_proc_stream_events_total{{event=\"{e}\"}}"),
        )
    };
    for (event, n) in [
        ("opened", 15.0),
        ("prefill_complete", 10.0),
        ("completed", 10.0),
        ("cancelled", 1.0),
        ("moved", 0.0),
        ("move_unknown_endpoint", 1.0),
        ("protocol_error", 1.0),
    ] {
        assert_eq!(events(event), n, "{event}: {m}");
    }
}
