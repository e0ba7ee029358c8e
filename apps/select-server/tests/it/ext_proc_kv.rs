//! End to end through a real tokenizer: a KV-event publisher stores the blocks of a chat's
//! rendered and tokenized prefix on one worker, and the endpoint picker, tokenizing chat
//! requests itself (`--tokenizer chat=DIR`, a BPE trained by `testkit::chat_tokenizer`),
//! routes a chat that starts with that prefix to it and a different chat by load.

#![expect(
    clippy::unwrap_used,
    reason = "test helpers fail loudly on a broken fixture"
)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kv_types::hashing::{HashOptions, block_hashes};
use serde_json::json;

use crate::ext_proc::{DUPLEX, Server, Stream, body, destination, headers, runtime};
use crate::http::{call, dumped_block_hashes, free_port};

/// A directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "select-server-{tag}-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const BLOCK: u32 = 4;
const MODEL: &str = "chat";

const SYSTEM: &str = "Answer as a travel guide for students: the user asks questions and the \
    assistant answers them. Explain how a key-value cache speeds up transformer inference for long \
    prompts: the cache stores the attention keys and values of every token already \
    processed, so a request whose prompt starts with a cached prefix only computes the new \
    tokens. Summarize in three sentences for a busy reader.";
const QUESTION: &str = "What is the capital of France, and which river runs through it?";

fn chat_body(turns: &[(&str, &str)]) -> Vec<u8> {
    let messages: Vec<_> = turns
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    serde_json::to_vec(&json!({"model": MODEL, "messages": messages, "stream": true})).unwrap()
}

/// The `ip:port` a chat is routed to; the stream stays open (its booking live).
async fn pick(
    client: &mut envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient<tonic::transport::Channel>,
    turns: &[(&str, &str)],
) -> (Stream, String) {
    let mut s = Stream::open(client).await;
    s.send(headers(Some(DUPLEX), false, None)).await;
    s.send(body(&chat_body(turns), true)).await;
    let r = s.recv().await;
    let chosen = destination(&r, s.last_metadata.as_ref());
    (s, chosen)
}

/// A PUB socket standing in for an engine, bound on a free loopback port (retried: the
/// port can be taken between choosing and binding it).
fn bound_publisher(ctx: &zmq::Context) -> (zmq::Socket, u16) {
    let socket = ctx.socket(zmq::PUB).unwrap();
    socket.set_linger(0).unwrap();
    for _ in 0..20 {
        let port = free_port();
        if socket.bind(&format!("tcp://127.0.0.1:{port}")).is_ok() {
            return (socket, port);
        }
    }
    panic!("no loopback port could be bound for a publisher");
}

/// Engine block hashes `/dump` holds for `worker_id` in the chat model's partition.
fn dumped_blocks(port: u16, worker_id: u64) -> Vec<u64> {
    let (_, dump) = call(port, "GET", "/dump", None);
    dumped_block_hashes(&dump, &format!("{MODEL}:default"), worker_id)
}

#[test]
fn a_chat_starting_with_a_workers_stored_prefix_is_routed_to_it_and_another_by_load() {
    let dir = TempDir::new("chat-tokenizer");
    testkit::chat_tokenizer(&dir.0);
    let library = tokenizers::Tokenizer::from_file(dir.0.join("tokenizer.json")).unwrap();
    let encode = |text: &str| library.encode(text, false).unwrap().get_ids().to_vec();

    // The engine's side: the first turn of a conversation was served by worker 1, which
    // stored the full blocks of its rendered, tokenized prompt.
    let first = [("system", SYSTEM), ("user", QUESTION)];
    let prefix = encode(&testkit::chatml_text(&first, false));
    let stored = &prefix[..prefix.len() / BLOCK as usize * BLOCK as usize];
    assert!(
        stored.len() >= 40 * BLOCK as usize,
        "{} tokens",
        stored.len()
    );
    // Engine block hashes as the spec's hashing gives them; the server hashes the tokens.
    let hashes: Vec<u64> = block_hashes(stored, BLOCK, &HashOptions::default())
        .iter()
        .map(|h| h.0)
        .collect();
    let batch = crate::binary::stored_batch(&hashes, stored, BLOCK);

    // The follow-up turn: its rendering starts with the first turn's (without the
    // generation prompt), so its tokens start with the stored blocks.
    let follow_up = [
        ("system", SYSTEM),
        ("user", QUESTION),
        (
            "assistant",
            "The capital of France is Paris, a city on the Seine.",
        ),
        ("user", "Write a short poem about it."),
    ];
    let follow_up_ids = encode(&testkit::chatml_text(&follow_up, true));
    assert!(follow_up_ids.starts_with(stored), "the fixture's premise");
    let other = [(
        "user",
        "Translate this sentence into German, then explain the grammar.",
    )];
    let other_ids = encode(&testkit::chatml_text(&other, true));
    // Every ChatML chat starts with `<bos><|im_start|>system\n`: one shared block at most.
    assert_ne!(
        other_ids[..8],
        stored[..8],
        "the other chat shares one block at most"
    );

    let ctx = zmq::Context::new();
    let (publisher, zport) = bound_publisher(&ctx);
    // Worker 2's engine publishes nothing, but its socket is bound: the server's
    // subscription never dangles on a port another test may bind meanwhile.
    let (_idle, idle_port) = bound_publisher(&ctx);

    let tokenizer_arg = format!("{MODEL}={}", dir.0.display());
    let server = Server::start_with(&["--tokenizer", &tokenizer_arg], &[]);
    for (id, ep, events_port) in [
        (1, "http://127.0.0.1:9001", zport),
        (2, "127.0.0.1:9002", idle_port),
    ] {
        let events = format!("tcp://127.0.0.1:{events_port}");
        let (status, body) = call(
            server.port,
            "POST",
            "/workers",
            Some(
                &json!({"worker_id": id, "model_name": MODEL, "endpoint": ep,
                         "block_size": BLOCK, "kv_events_endpoint": events}),
            ),
        );
        assert_eq!(status, 201, "{body}");
    }
    // Republished until the subscription has joined and the index holds the blocks.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seq = 0u64;
    while dumped_blocks(server.port, 1) != hashes {
        assert!(
            Instant::now() < deadline,
            "worker 1's blocks were not indexed"
        );
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &batch[..]], 0)
            .unwrap();
        seq += 1;
        std::thread::sleep(Duration::from_millis(50));
    }

    runtime().block_on(async {
        let mut client = server.client().await;
        // Both workers idle: the cached prefix decides.
        let (held_a, chosen) = pick(&mut client, &follow_up).await;
        assert_eq!(chosen, "127.0.0.1:9001", "the follow-up goes to its prefix");
        // Worker 1 now busy and no block of this chat cached anywhere: load decides.
        let (held_b, chosen) = pick(&mut client, &other).await;
        assert_eq!(chosen, "127.0.0.1:9002", "a different chat goes by load");
        // One request on each: the prefix still outweighs the equal load.
        let (held_c, chosen) = pick(&mut client, &follow_up).await;
        assert_eq!(
            chosen, "127.0.0.1:9001",
            "the prefix outweighs an equal load"
        );
        assert_eq!(server.active_requests(), 3);
        drop((held_a, held_b, held_c));
        server.wait_idle("the held streams ended").await;
    });
    let metrics = server.metrics();
    assert!(
        metrics.contains("kv_select_ext_proc_picks_total{outcome=\"picked\"} 3"),
        "{metrics}"
    );
    for line in metrics
        .lines()
        .filter(|l| l.starts_with("kv_select_ext_proc_load_only_picks_total{"))
    {
        assert!(line.ends_with(" 0"), "no pick went by load only: {line}");
    }
}
