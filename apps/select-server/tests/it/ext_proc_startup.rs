//! At startup the endpoint picker names, one warning each, the models known by then (here
//! from `--workers-file`) that have no `--tokenizer`.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::collections::BTreeSet;

use serde_json::json;

use crate::ext_proc::Server;
use crate::ext_proc_kv::TempDir;

const WARNING: &str = "no --tokenizer for this model";

/// The `model` field of every startup warning about a missing tokenizer.
fn warned_models(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains(WARNING))
        .map(|l| {
            let (_, rest) = l
                .split_once("model=")
                .unwrap_or_else(|| panic!("no model field: {l}"));
            rest.split_whitespace().next().unwrap().to_owned()
        })
        .collect()
}

#[test]
fn each_known_model_without_a_tokenizer_is_named_at_startup() {
    let dir = TempDir::new("ext-proc-startup");
    let tokenizer = dir.0.join("chat");
    std::fs::create_dir_all(&tokenizer).unwrap();
    testkit::chat_tokenizer(&tokenizer);
    let workers = dir.0.join("workers.json");
    let record = |id: u64, model: &str| {
        json!({"worker_id": id, "model_name": model,
               "endpoint": format!("127.0.0.1:900{id}"), "block_size": 4})
    };
    let file = json!([
        record(1, "alpha"),
        record(2, "beta"),
        record(3, "beta"),
        record(4, "chat")
    ]);
    let log = dir.0.join("stderr.log");
    let tokenizer_arg = format!("chat={}", tokenizer.display());
    // The server started on a workers file, and what it wrote to stderr: the warnings are
    // written before the HTTP port listens.
    let start = |records: &serde_json::Value| {
        std::fs::write(&workers, records.to_string()).unwrap();
        let server = Server::start_logging(
            &[
                "--workers-file",
                workers.to_str().unwrap(),
                "--tokenizer",
                &tokenizer_arg,
            ],
            &[("DYN_ROUTER_USE_KV_EVENTS", "false"), ("NO_COLOR", "1")],
            Some(&log),
        );
        let text = std::fs::read_to_string(&log).unwrap();
        (server, text)
    };
    let (server, text) = start(&file);
    assert_eq!(warned_models(&text), ["alpha", "beta"], "{text}");
    drop(server);

    // Every model has its tokenizer: no such warning.
    let (server, text) = start(&json!([record(1, "chat")]));
    assert_eq!(warned_models(&text), Vec::<String>::new(), "{text}");
    let models: BTreeSet<String> = crate::http::call(server.port, "GET", "/workers", None)
        .1
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["model_name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(models, BTreeSet::from(["chat".to_owned()]));
}
