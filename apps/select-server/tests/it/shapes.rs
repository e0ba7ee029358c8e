//! Response shapes and status codes against the reference transcript, and request DTO
//! contents as the backend receives them.

use http::{Method, StatusCode};
use select_server::EdgeOptions;
use select_server::dto::{KvFetchPayload, KvHint, KvHintAction, Lifecycle, SelectionResponse};

use crate::harness::{Call, Harness, service};

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

const TOKENS_64: &str = "[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63]";

/// The transcript's workers 1, 4 and 5 (steps 3, 6, 7) with KV events on; nobody publishes
/// on their event endpoints.
async fn transcript_workers(h: &Harness) {
    let events = || format!("tcp://127.0.0.1:{}", testkit::free_port());
    for body in [
        serde_json::json!({"worker_id":1,"endpoint":"http://127.0.0.1:18001","block_size":16,
            "data_parallel_start_rank":0,"data_parallel_size":1,
            "kv_events_endpoints":{"0":events()}}),
        serde_json::json!({"worker_id":4,"endpoint":"http://127.0.0.1:18004","block_size":16,
            "data_parallel_start_rank":0,"data_parallel_size":2,"max_num_batched_tokens":8192,
            "total_kv_blocks":4096,"kv_events_endpoints":{"0":events(),"1":events()}}),
        serde_json::json!({"worker_id":5,"endpoint":"http://127.0.0.1:18005","block_size":16,
            "kv_events_endpoint":events()}),
    ] {
        h.setup(Method::POST, "/workers", &body.to_string()).await;
    }
}

/// Flat JSON rows `{...},{...}` of the reference, in the service's order (by worker and
/// rank; the reference's follows its hash map), each row's bytes untouched.
fn in_our_row_order(rows: &str) -> String {
    let inner = &rows[1..rows.len() - 1];
    let mut rows: Vec<String> = inner.split("},{").map(|r| format!("{{{r}}}")).collect();
    rows.sort_by_key(|r| {
        let v: serde_json::Value = serde_json::from_str(r).expect("golden row");
        (v["worker_id"].as_u64(), v["dp_rank"].as_u64())
    });
    rows.join(",")
}

/// The transcript's steps 4, 10, 12, 19, 20 and 33-35 in process. Where the reference chose
/// among equal-cost workers at random, the request pins the worker it chose; rows of loads
/// are compared in the service's order.
#[tokio::test]
async fn golden_bodies_are_byte_exact() {
    let h = Harness::with_service(service(&[], &[]), EdgeOptions::default());
    transcript_workers(&h).await;
    let pin = |w: u32, r: u32| format!(r#""pinned_worker":{{"worker_id":{w},"dp_rank":{r}}}"#);
    let body = format!(r#"{{"token_ids":{TOKENS_64}}}"#);
    let r = h
        .json(
            Method::POST,
            "/select",
            format!(r#"{{"token_ids":{TOKENS_64},{}}}"#, pin(4, 1)),
        )
        .await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, SELECT_10));
    assert_eq!(r.content_type, "application/json");

    h.setup(
        Method::POST,
        "/select",
        &format!(
            r#"{{"selection_id":"sel-1","token_ids":{TOKENS_64},{}}}"#,
            pin(5, 0)
        ),
    )
    .await;
    let r = h
        .json(Method::POST, "/reservations", r#"{"selection_id":"sel-1"}"#)
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::CREATED, RESERVATION_12)
    );

    let tokens_256: Vec<u32> = (0..256).collect();
    let r = h
        .json(
            Method::POST,
            "/select_and_reserve",
            format!(
                r#"{{"selection_id":"res-1","token_ids":{},"expected_output_tokens":32,{}}}"#,
                serde_json::to_string(&tokens_256).expect("JSON"),
                pin(1, 0)
            ),
        )
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, SELECT_AND_RESERVE_19)
    );

    let r = h.bare(Method::GET, "/loads").await;
    let (head, rest) = LOADS_20.split_once("\"loads\":[").expect("golden loads");
    let (rows, tail) = rest.split_once("],").expect("golden loads");
    let loads_20 = format!("{head}\"loads\":[{}],{tail}", in_our_row_order(rows));
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, loads_20.as_str())
    );

    // Steps 26, 29 and 30: res-1 freed, one 64-token booking each on workers 1 and 5.
    h.setup(Method::DELETE, "/reservations/res-1", "").await;
    h.setup(
        Method::POST,
        "/select_and_reserve",
        &format!(r#"{{"token_ids":{TOKENS_64},{}}}"#, pin(1, 0)),
    )
    .await;
    h.setup(
        Method::POST,
        "/reservations",
        r#"{"selection_id":"explicit-1","worker_id":5,"dp_rank":0,"sequence_hashes":[21,22,23,24],"isl_tokens":64,"effective_prefill_tokens":64,"track_prefill_tokens":true}"#,
    )
    .await;

    let r = h.json(Method::POST, "/potential_loads", body.clone()).await;
    let potential_33 = format!(
        "[{}]",
        in_our_row_order(&POTENTIAL_33[1..POTENTIAL_33.len() - 1])
    );
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, potential_33.as_str())
    );

    let r = h.json(Method::POST, "/overlap_scores", body).await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, OVERLAP_34));

    let r = h.bare(Method::GET, "/dump").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, DUMP_35));

    // Step 4 (and 8 with only that worker): no KV events endpoint, so incomplete.
    let h = Harness::with_service(service(&[], &[]), EdgeOptions::default());
    h.setup(
        Method::POST,
        "/workers",
        r#"{"worker_id":2,"endpoint":"http://127.0.0.1:18002","block_size":16}"#,
    )
    .await;
    let r = h.bare(Method::GET, "/workers").await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, format!("[{WORKER_4}]").as_str())
    );
}

#[tokio::test]
async fn worker_upsert_echoes_the_record() {
    let h = Harness::new();
    // transcript step 3: kv_events_endpoints present, reasons omitted
    let r = h
        .json(
            Method::POST,
            "/workers",
            r#"{"worker_id":1,"model_name":"default","routing_group":"default","endpoint":"http://127.0.0.1:18001","block_size":16,"data_parallel_start_rank":0,"data_parallel_size":1,"kv_events_endpoints":{"0":"tcp://127.0.0.1:15599"}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(
        r.body,
        r#"{"worker_id":1,"model_name":"default","routing_group":"default","lifecycle":"schedulable","endpoint":"http://127.0.0.1:18001","kv_events_endpoint":null,"kv_events_endpoints":{"0":"tcp://127.0.0.1:15599"},"replay_endpoint":null,"block_size":16,"data_parallel_start_rank":0,"data_parallel_size":1,"max_num_batched_tokens":null,"total_kv_blocks":null,"stable_routing_id":null,"is_eagle":null,"taints":[],"topology_domains":{},"kv_transfer_domain":null,"kv_transfer_enforcement":null,"kv_transfer_preferred_weight":null}"#
    );
    // transcript step 73: service-level 400 passes through
    let r = h
        .json(
            Method::POST,
            "/workers",
            r#"{"worker_id":9,"endpoint":"http://127.0.0.1:18009","block_size":16,"data_parallel_size":100000}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.body,
        r#"{"error":"data_parallel_size 100000 exceeds the maximum 4096"}"#
    );
}

#[tokio::test]
async fn worker_record_omitted_when_rules() {
    let h = Harness::new();
    let r = h
        .json(
            Method::POST,
            "/workers",
            r#"{"worker_id":7,"taints":["b","a","a"],"router_hint_worker_type":"decode",
            "router_hint_source_control_endpoints":{"1":"tcp://h:2"},"kv_event_source_mode":"state_agent_v2",
            "kv_transfer_enforcement":"preferred","kv_transfer_preferred_weight":0.5,
            "topology_domains":{"rack":"r1"}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED, "{}", r.body);
    let v = r.json();
    assert_eq!(v["lifecycle"], "incomplete");
    assert_eq!(v["taints"], serde_json::json!(["a", "b"]));
    assert_eq!(v["router_hint_worker_type"], "decode");
    assert_eq!(v["router_hint_source_control_endpoints"]["1"], "tcp://h:2");
    assert_eq!(v["kv_event_source_mode"], "state_agent_v2");
    assert_eq!(v["kv_transfer_enforcement"], "preferred");
    assert_eq!(
        v["not_schedulable_reasons"],
        serde_json::json!(["endpoint is required", "block_size must be greater than 0"])
    );
    assert_eq!(v["model_name"], "default");
    assert!(v.get("kv_events_endpoints").is_none());
    assert!(v["data_parallel_size"].is_null());
    // The service never reports `draining` today; the rendering is the contract's all the same.
    assert_eq!(
        serde_json::to_value(Lifecycle::Draining).expect("JSON"),
        "draining"
    );
}

#[test]
fn selection_response_optional_fields() {
    let mut resp: SelectionResponse = serde_json::from_str(SELECT_10).unwrap();
    assert_eq!(resp.overlap.dp.len(), 2);
    resp.selection_id = Some("s".to_owned());
    resp.sequence_hashes = Some(vec![u64::MAX, 1 << 63, 5]);
    resp.decode_busy = Some(false);
    resp.kv_hint = Some(KvHint {
        protocol_version: "0.1".to_owned(),
        message_id: "s".to_owned(),
        actions: vec![KvHintAction {
            action_id: "a1".to_owned(),
            action_type: "kv.fetch".to_owned(),
            action_version: "1.0".to_owned(),
            payload: KvFetchPayload {
                source_control_endpoint: "tcp://10.0.0.8:5600".to_owned(),
                block_hashes: vec![u64::MAX, 1928374650],
            },
        }],
    });
    let v = serde_json::to_value(&resp).unwrap();
    assert_eq!(
        v["sequence_hashes"],
        serde_json::json!([-1, i64::MIN, 5]),
        "hashes render signed"
    );
    assert_eq!(v["decode_busy"], false);
    assert!(v.get("worker_load").is_none());
    assert!(v.get("isl_tokens").is_none());
    assert_eq!(
        v["kv_hint"],
        serde_json::json!({"protocol_version": "0.1", "message_id": "s",
            "actions": [{"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
                "payload": {"source_control_endpoint": "tcp://10.0.0.8:5600",
                            "block_hashes": [u64::MAX, 1928374650u64]}}]}),
        "kv_hint block hashes stay unsigned"
    );
    // round trip through the signed rendering
    let back: SelectionResponse = serde_json::from_value(v).unwrap();
    assert_eq!(back, resp);
}

#[tokio::test]
async fn ready_status_follows_the_body() {
    let h = Harness::new();
    let r = h.bare(Method::GET, "/ready").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        r.body,
        r#"{"ready":false,"schedulable_workers":0,"workers":[]}"#
    );
    h.worker(1, "").await;
    let r = h.bare(Method::GET, "/ready").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["ready"], true);
}

#[tokio::test]
async fn replica_peer_routes() {
    let port = testkit::free_port().to_string();
    let h = Harness::with_service(
        service(
            &["--host", "127.0.0.1", "--replica-sync-port", &port],
            &[("DYN_ROUTER_USE_KV_EVENTS", "false")],
        ),
        EdgeOptions::default(),
    );
    let r = h.bare(Method::GET, "/replica_sync/peers").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, "[]"));
    let body = r#"{"endpoint":"tcp://127.0.0.1:19999"}"#;
    let r = h
        .json(Method::POST, "/replica_sync/register_peer", body)
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::CREATED, r#"{"status":"ok"}"#)
    );
    let r = h
        .json(Method::POST, "/replica_sync/register_peer", body)
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, r#"{"status":"ok"}"#)
    );
    let r = h.bare(Method::GET, "/replica_sync/peers").await;
    assert_eq!(r.body, r#"["tcp://127.0.0.1:19999"]"#);
    let r = h
        .json(Method::POST, "/replica_sync/deregister_peer", body)
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, r#"{"status":"ok"}"#)
    );
    let r = h
        .json(Method::POST, "/replica_sync/deregister_peer", body)
        .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body, r#"{"error":"peer not found"}"#);
    let r = h
        .json(
            Method::POST,
            "/replica_sync/register_peer",
            r#"{"endpoint":"bogus"}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.body,
        r#"{"error":"invalid ZMQ endpoint `bogus`: missing scheme"}"#
    );
}

#[tokio::test]
async fn lifecycle_routes_answer_status_ok() {
    let h = Harness::new();
    h.worker(1, "").await;
    h.reservation("res-1").await;
    let r = h
        .bare(Method::POST, "/reservations/res-1/prefill_complete")
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, r#"{"status":"ok"}"#)
    );
    let r = h.bare(Method::DELETE, "/reservations/res-1").await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, r#"{"status":"ok"}"#)
    );
}

#[tokio::test]
async fn request_dtos_reach_the_backend_as_typed_values() {
    let h = Harness::new();
    h.worker(5, r#""model_name":"llama","taints":["gpu"]"#)
        .await;
    h.worker(
        7,
        r#""model_name":"llama","taints":["gpu"],"data_parallel_size":2"#,
    )
    .await;
    h.worker(8, r#""routing_group":"g""#).await;
    let r = h
        .json(
            Method::POST,
            "/select",
            r#"{"selection_id":"req-43","model_name":"llama","block_hashes":[11,12],
                "sequence_hashes":[21,-22],"isl_tokens":40,"expected_output_tokens":256,
                "priority_jump":-5.0,"session_id":"legacy",
                "session_context":{"session_id":"chat-1","agent_headers":{"x":["y"]}},
                "allowed_worker_ids":[5,5,7],"routing_constraints":{"required_taints":["gpu"],
                "preferred_taints":{"fast":1.5}},"advisory":true,"unknown":{"deep":[1]}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let r = h
        .json(
            Method::POST,
            "/reservations",
            r#"{"selection_id":"req-44","model_name":"llama","worker_id":7,"dp_rank":1,
                "sequence_hashes":[21,-22],"isl_tokens":40,"effective_prefill_tokens":8}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::CREATED);
    let r = h
        .json(
            Method::POST,
            "/overlap_scores",
            r#"{"routing_group":"g","token_ids":[1,2],"router_config_override":{"assume_kv_reuse":false,"x":1}}"#,
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);

    let calls = h.calls();
    let Call::Select(sel) = &calls[0] else {
        panic!("{calls:?}")
    };
    assert!(sel.advisory);
    let o = sel;
    assert_eq!(o.partition.model_name, "llama");
    assert_eq!(o.partition.routing_group, "default");
    assert_eq!(o.selection_id.as_deref(), Some("req-43"));
    assert_eq!(o.expected_output_tokens, Some(256));
    assert_eq!(o.priority_jump, -5.0);
    assert_eq!(o.strict_priority, 0);
    assert_eq!(o.session_id.as_deref(), Some("legacy"));
    assert_eq!(
        o.session_context.as_ref().map(|c| c.session_id()),
        Some("chat-1")
    );
    assert!(o.affinity_target.is_none() && o.pinned_worker.is_none());
    assert_eq!(o.allowed_worker_ids.as_ref().map(|s| s.len()), Some(2));
    assert!(o.required_taints.iter().any(|t| t == "gpu"));
    assert_eq!(sel.prompt.block_hashes, Some(vec![11, 12]));
    assert_eq!(sel.prompt.sequence_hashes, Some(vec![21, u64::MAX - 21]));
    assert_eq!(sel.prompt.isl_tokens, Some(40));

    let Call::Reserve(res) = &calls[1] else {
        panic!("{calls:?}")
    };
    assert_eq!(res.worker_id, Some(7));
    assert_eq!(res.dp_rank, Some(1));
    assert_eq!(res.effective_prefill_tokens, Some(8));
    assert_eq!(res.prompt.isl_tokens, Some(40));

    let Call::Overlap(q) = &calls[2] else {
        panic!("{calls:?}")
    };
    assert_eq!(
        (
            q.partition.model_name.as_str(),
            q.partition.routing_group.as_str()
        ),
        ("default", "g")
    );
    assert_eq!(q.router_config_override.assume_kv_reuse, Some(false));
}
