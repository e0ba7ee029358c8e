//! Response shapes and status codes against the reference transcript, and request DTO
//! contents as the backend receives them.

use http::{Method, StatusCode};
use select_server::dto::{
    KvFetchPayload, KvHint, KvHintAction, Lifecycle, PromptForm, SelectionResponse, WorkerRecord,
    WorkerRequest,
};

use crate::fake::{
    Call, DUMP_35, Harness, LOADS_20, OVERLAP_34, POTENTIAL_33, RESERVATION_12, SELECT_10,
    SELECT_AND_RESERVE_19, WORKER_4,
};

const TOKENS_64: &str = "[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63]";

#[tokio::test]
async fn golden_bodies_are_byte_exact() {
    let h = Harness::new();
    let body = format!(r#"{{"token_ids":{TOKENS_64}}}"#);
    let r = h.json(Method::POST, "/select", body.clone()).await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, SELECT_10));
    assert_eq!(r.content_type, "application/json");

    let r = h
        .json(Method::POST, "/select_and_reserve", body.clone())
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, SELECT_AND_RESERVE_19)
    );

    let r = h
        .json(Method::POST, "/reservations", r#"{"selection_id":"sel-1"}"#)
        .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::CREATED, RESERVATION_12)
    );

    let r = h.bare(Method::GET, "/workers").await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (StatusCode::OK, format!("[{WORKER_4}]").as_str())
    );

    let r = h.bare(Method::GET, "/loads").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, LOADS_20));

    let r = h.json(Method::POST, "/potential_loads", body.clone()).await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, POTENTIAL_33));

    let r = h.json(Method::POST, "/overlap_scores", body).await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, OVERLAP_34));

    let r = h.bare(Method::GET, "/dump").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, DUMP_35));
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

#[test]
fn worker_record_omitted_when_rules() {
    let req: WorkerRequest = serde_json::from_str(
        r#"{"worker_id":7,"taints":["b","a","a"],"router_hint_worker_type":"decode",
            "router_hint_source_control_endpoints":{"1":"tcp://h:2"},"kv_event_source_mode":"state_agent_v2",
            "kv_transfer_enforcement":"preferred","kv_transfer_preferred_weight":0.5,
            "topology_domains":{"rack":"r1"}}"#,
    )
    .unwrap();
    let rec = WorkerRecord::from_request(req, Lifecycle::Draining, vec!["x".to_owned()]);
    let v = serde_json::to_value(&rec).unwrap();
    assert_eq!(v["lifecycle"], "draining");
    assert_eq!(v["taints"], serde_json::json!(["a", "b"]));
    assert_eq!(v["router_hint_worker_type"], "decode");
    assert_eq!(v["router_hint_source_control_endpoints"]["1"], "tcp://h:2");
    assert_eq!(v["kv_event_source_mode"], "state_agent_v2");
    assert_eq!(v["kv_transfer_enforcement"], "preferred");
    assert_eq!(v["not_schedulable_reasons"], serde_json::json!(["x"]));
    assert_eq!(v["model_name"], "default");
    assert!(v.get("kv_events_endpoints").is_none());
    assert!(v["data_parallel_size"].is_null());
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
    *h.fake.ready.lock() = true;
    let r = h.bare(Method::GET, "/ready").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["ready"], true);
}

#[tokio::test]
async fn replica_peer_routes() {
    let h = Harness::new();
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

    let calls = h.fake.calls();
    let Call::Select(sel) = &calls[0] else {
        panic!("{calls:?}")
    };
    assert!(sel.advisory);
    let o = &sel.options;
    assert_eq!(o.model_name, "llama");
    assert_eq!(o.routing_group, "default");
    assert_eq!(o.selection_id.as_deref(), Some("req-43"));
    assert_eq!(o.expected_output_tokens, Some(256));
    assert_eq!(o.priority_jump, -5.0);
    assert_eq!(o.strict_priority, 0);
    assert_eq!(o.session_id.as_deref(), Some("legacy"));
    assert_eq!(
        o.session_context.as_ref().map(|c| c.session_id.as_str()),
        Some("chat-1")
    );
    assert!(o.affinity_target.is_none() && o.pinned_worker.is_none());
    assert_eq!(o.allowed_worker_ids.as_ref().map(|s| s.len()), Some(2));
    assert!(o.routing_constraints.required_taints.contains("gpu"));
    assert_eq!(
        sel.prompt.selection_form().unwrap(),
        PromptForm::Hashes {
            block_hashes: Some(&[11, 12]),
            sequence_hashes: &[21, u64::MAX - 21],
            isl_tokens: 40,
        }
    );

    let Call::Reserve(res) = &calls[1] else {
        panic!("{calls:?}")
    };
    assert_eq!(res.worker_id, Some(7));
    assert_eq!(res.dp_rank, Some(1));
    assert_eq!(res.effective_prefill_tokens, Some(8));
    assert_eq!(res.prompt.reservation_form().unwrap().isl(), 40);

    let Call::Overlap(q) = &calls[2] else {
        panic!("{calls:?}")
    };
    assert_eq!(
        (q.model_name.as_str(), q.routing_group.as_str()),
        ("default", "g")
    );
    assert_eq!(
        q.router_config_override
            .as_ref()
            .and_then(|o| o.assume_kv_reuse),
        Some(false)
    );
}
